"""A rank's start-up phases tile the time from the launch to its first iteration."""

import pytest

from megatron.training import startup


@pytest.fixture
def clock(monkeypatch):
    """Marks at chosen times; the process started at 100 (cold) unless a warm worker says."""
    monkeypatch.setattr(startup, "_marks", {})
    monkeypatch.delenv(startup.ASSIGNED_AT_ENV, raising=False)
    monkeypatch.setenv(startup.LAUNCHED_AT_ENV, "97.5")
    now = {"t": 0.0}
    monkeypatch.setattr(startup.time, "time", lambda: now["t"])
    monkeypatch.setattr(startup, "_process_started_at", lambda: float(
        startup.os.environ.get(startup.ASSIGNED_AT_ENV, 100.0)))

    def at(t, phase):
        now["t"] = t
        startup.mark(phase)
    return at


def test_phases_tile_the_launch_to_the_first_iteration_and_a_missing_mark_lasts_nothing(clock):
    for t, phase in [(100.1, "interpreter"), (106.0, "imports"), (107.0, "process-group"),
                     (108.0, "model-and-optimizer-setup"),
                     (108.5, "train/valid/test-data-iterators-setup"), (108.6, "checkpoint-search"),
                     (109.6, "checkpoint-read"), (110.0, "first-iteration")]:
        clock(t, phase)
    clock(120.0, "imports")  # a later mark of the same phase does not move it
    got = startup.phases()
    assert got == {"launch": 2.5, "interpreter": pytest.approx(0.1), "imports": pytest.approx(5.9),
                   "process-group": 1.0, "model-and-optimizer-setup": 1.0,
                   "train/valid/test-data-iterators-setup": 0.5,
                   "checkpoint-search": pytest.approx(0.1), "checkpoint-verify": 0.0,
                   "checkpoint-read": 1.0, "first-iteration": pytest.approx(0.4)}
    assert sum(got.values()) == pytest.approx(110.0 - 97.5)


def test_a_warm_rank_starts_at_its_assignment(clock, monkeypatch):
    monkeypatch.setenv(startup.ASSIGNED_AT_ENV, "97.6")
    clock(97.61, "interpreter")
    clock(97.62, "imports")
    got = startup.phases()
    assert got["launch"] == pytest.approx(0.1) and got["imports"] == pytest.approx(0.01)
    assert startup.summary([got])["warm"] is True


def test_the_event_takes_each_phases_slowest_rank_and_the_slowest_total(clock):
    fast = dict.fromkeys(startup.PHASES, 1.0)
    slow = {**fast, "imports": 3.0, "checkpoint-read": 0.5}
    summary = startup.summary([fast, slow])
    assert summary["phases"]["imports"] == 3.0 and summary["phases"]["checkpoint-read"] == 1.0
    assert (summary["seconds"], summary["slowest_rank"], summary["ranks"]) == (11.5, 1, 2)
    assert summary["warm"] is False


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown start-up phase"):
        startup.mark("lunch")
