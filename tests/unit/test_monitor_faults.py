import pytest

from ftmaster.faults import Fault, Injection, parse_injection


def test_parses_iteration_and_seconds_triggers():
    assert parse_injection("degrade:gpu=1,at=iter:20") == Injection(Fault.DEGRADE, 1, at_iteration=20)
    assert parse_injection("FAIL: gpu=0 , at=2.5s") == Injection(Fault.FAIL, 0, at_seconds=2.5)
    assert str(parse_injection("recover:gpu=3,at=30s")) == "recover:gpu=3,at=30s"


@pytest.mark.parametrize("spec, injection", [
    ("xid:gpu=1,code=95,at=iter:8", Injection(Fault.XID, 1, at_iteration=8, code=95)),
    ("XID:at=3s,code=79,gpu=2", Injection(Fault.XID, 2, at_seconds=3.0, code=79)),
    ("wedge:gpu=3,at=iter:5", Injection(Fault.WEDGE, 3, at_iteration=5)),
    ("nan:gpu=0,at=iter:12", Injection(Fault.NAN, 0, at_iteration=12)),
    ("fail:gpu=1,at=iter:12,after=emergency_save",
     Injection(Fault.FAIL, 1, at_iteration=12, after="emergency_save")),
    ("xid:after=Risk_Alert,gpu=2,code=79,at=0s",
     Injection(Fault.XID, 2, at_seconds=0.0, code=79, after="risk_alert")),
    ("slow:gpu=1,factor=2,at=iter:8", Injection(Fault.SLOW, 1, at_iteration=8, factor=2.0)),
    ("slow:gpu=3,at=90s,factor=1.25", Injection(Fault.SLOW, 3, at_seconds=90.0, factor=1.25)),
])
def test_parses_the_new_kinds_and_prints_them_back(spec, injection):
    assert parse_injection(spec) == injection
    assert parse_injection(str(injection)) == injection


def test_at_once_keeps_the_fault_and_fires_now():
    fired = parse_injection("xid:gpu=1,code=95,at=iter:8").at_once()
    assert fired == Injection(Fault.XID, 1, at_seconds=0.0, code=95) and fired.due(None, 0.0)


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
    ("xid:gpu=1,at=iter:8", r"missing code= \(the XID number"),
    ("xid:gpu=1,code=abc,at=1s", "code must be an XID number"),
    ("xid:gpu=1,code=0,at=1s", "code must be an XID number"),
    ("xid:gpu=1,code=-5,at=1s", "code must be an XID number"),
    ("xid:gpu=1,code=79,code=48,at=1s", "given twice"),
    ("wedge:gpu=1,code=79,at=1s", "code= is only for xid"),
    ("nan:gpu=1,code=1,at=iter:3", "code= is only for xid"),
    ("nan:gpu=1,at=30s", "nan needs at=iter:K"),
    ("nan:gpu=1,at=iter:0", r"nan needs at=iter:K with K >= 1 \(iterations count from 1\)"),
    ("wedge:gpu=1", "missing at="),
    ("nan:at=iter:3", "missing gpu="),
    ("wedged:gpu=1,at=1s", "unknown kind 'wedged'.*wedge, nan"),
    ("fail:gpu=1,at=iter:3,after=saved", "after= takes an event, one of .*emergency_save"),
    ("fail:gpu=1,at=iter:3,after=", "is not key=value"),
    ("nan:gpu=1,at=iter:3,after=risk_alert", "nan cannot take after="),
    ("slow:gpu=1,at=iter:8", r"missing factor= \(how many times slower"),
    ("slow:gpu=1,factor=1,at=iter:8", "factor must be a number above 1"),
    ("slow:gpu=1,factor=fast,at=iter:8", "factor must be a number above 1"),
    ("slow:gpu=1,factor=nan,at=iter:8", "factor must be a number above 1"),
    # beyond, the trainer's sleep overflows: the rank died of an OverflowError traceback
    ("slow:gpu=1,factor=1e300,at=iter:8", "factor must be a number above 1 and at most 1000"),
    ("fail:gpu=1,factor=2,at=iter:8", "factor= is only for slow"),
    ("xid:gpu=1,code=79,factor=2,at=iter:8", "factor= is only for slow"),
    # str.isdigit takes a superscript, and int() refuses 5000 digits in words of its own
    ("fail:gpu=\u00b2,at=iter:3", "bad --inject .*gpu must be"),
    ("fail:gpu=0,at=iter:" + "9" * 5000, "bad --inject .*at=iter:K"),
    ("xid:gpu=0,code=" + "9" * 5000 + ",at=1s", "bad --inject .*code must be"),
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


def test_after_waits_for_its_event_as_well_as_its_trigger():
    waiting = parse_injection("fail:gpu=1,at=iter:12,after=emergency_save")
    assert not waiting.due(40, 0.0)  # however far training got
    assert not waiting.due(40, 0.0, frozenset({"periodic_save", "risk_alert"}))
    assert not waiting.due(11, 0.0, frozenset({"emergency_save"}))  # the save came first
    assert waiting.due(12, 0.0, frozenset({"emergency_save"}))
    fired = waiting.at_once()  # the monitor gets it once it fired: nothing left to wait for
    assert fired.after is None and fired.due(None, 0.0)


@pytest.mark.parametrize("kwargs, words", [
    ({"kind": Fault.XID}, "needs code=N"),
    ({"kind": Fault.XID, "code": 0}, "needs code=N"),
    ({"kind": Fault.WEDGE, "code": 79}, "only for xid"),
    ({"kind": Fault.FAIL, "after": "saved"}, "after= takes one of"),
    ({"kind": Fault.NAN, "after": "risk_alert"}, "cannot wait for an event"),
])
def test_injections_built_in_code_are_checked_too(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Injection(gpu=0, at_seconds=1.0, **kwargs)
