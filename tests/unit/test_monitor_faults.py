import pytest

from ftmaster.faults import Fault, Injection, parse_injection


def test_parses_iteration_and_seconds_triggers():
    assert parse_injection("degrade:gpu=1,at=iter:20") == Injection(Fault.DEGRADE, 1, at_iteration=20)
    assert parse_injection("FAIL: gpu=0 , at=2.5s") == Injection(Fault.FAIL, 0, at_seconds=2.5)
    assert str(parse_injection("recover:gpu=3,at=30s")) == "recover:gpu=3,at=30s"


@pytest.mark.parametrize("spec, words", [
    ("explode:gpu=1,at=10s", "unknown kind"),
    ("degrade", "expected"),
    ("degrade:gpu=1", "missing at="),
    ("degrade:at=10s", "missing gpu="),
    ("degrade:gpu=x,at=10s", "gpu must be"),
    ("degrade:gpu=1,at=iter:-3", "iter:K"),
    ("degrade:gpu=1,at=soon", "at= must be"),
    ("degrade:gpu=1,at=infs", "at= must be"),
    ("degrade:gpu=1,at=1s,when=2", "unknown field"),
    ("degrade:gpu=1,gpu=2,at=1s", "given twice"),
])
def test_bad_specs_say_what_is_wrong(spec, words):
    with pytest.raises(ValueError, match=words):
        parse_injection(spec)


def test_due_waits_for_the_trigger_and_never_fires_on_unknown_iteration():
    by_iter = parse_injection("hang:gpu=0,at=iter:10")
    assert not by_iter.due(None, 1e9)
    assert not by_iter.due(9, 0.0)
    assert by_iter.due(10, 0.0)
    by_time = parse_injection("hang:gpu=0,at=5s")
    assert not by_time.due(100, 4.9)
    assert by_time.due(None, 5.0)
