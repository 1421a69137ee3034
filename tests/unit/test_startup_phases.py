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


def durations(ends):
    names = ("start",) + startup.PHASES
    return {b: pytest.approx(ends[b] - ends[a]) for a, b in zip(names, names[1:])}


def test_phases_tile_the_launch_to_the_first_iteration_and_a_missing_mark_lasts_nothing(clock):
    for t, phase in [(100.1, "interpreter"), (106.0, "imports"), (107.0, "process-group"),
                     (108.0, "model-and-optimizer-setup"),
                     (108.5, "train/valid/test-data-iterators-setup"), (108.6, "checkpoint-search"),
                     (109.6, "checkpoint-read"), (110.0, "first-iteration")]:
        clock(t, phase)
    clock(120.0, "imports")  # a later mark of the same phase does not move it
    ends = startup.ends()
    assert ends["start"] == 97.5 and ends["first-iteration"] == 110.0
    assert durations(ends) == {"launch": 2.5, "interpreter": 0.1, "imports": 5.9,
                               "process-group": 1.0, "model-and-optimizer-setup": 1.0,
                               "train/valid/test-data-iterators-setup": 0.5,
                               "checkpoint-search": 0.1, "checkpoint-verify": 0.0,
                               "checkpoint-read": 1.0, "first-iteration": 0.4}


def test_a_warm_rank_starts_at_its_assignment(clock, monkeypatch):
    monkeypatch.setenv(startup.ASSIGNED_AT_ENV, "97.6")
    clock(97.61, "interpreter")
    clock(97.62, "imports")
    ends = startup.ends()
    assert durations(ends)["launch"] == pytest.approx(0.1)
    assert durations(ends)["imports"] == pytest.approx(0.01)
    assert startup.summary([ends])["warm"] is True


def test_a_phase_ends_when_its_last_rank_ends_it_so_the_phases_add_up(clock):
    names = ("start",) + startup.PHASES
    # Rank 1 imports slowly, rank 0 then waits for it in the process group.
    rank0 = dict(zip(names, (10, 10.1, 10.1, 12, 15, 16, 16.5, 16.5, 16.5, 17, 18)))
    rank1 = dict(zip(names, (10, 10.1, 10.1, 14.5, 15, 16.2, 16.5, 16.5, 16.5, 17, 18.5)))
    summary = startup.summary([rank0, rank1])
    assert summary["phases"]["imports"] == pytest.approx(4.4)
    assert summary["phases"]["process-group"] == pytest.approx(0.5)
    assert summary["phases"]["first-iteration"] == pytest.approx(1.5)
    assert sum(summary["phases"].values()) == pytest.approx(summary["seconds"]) == 8.5
    assert (summary["slowest_rank"], summary["ranks"], summary["warm"]) == (1, 2, False)
def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown start-up phase"):
        startup.mark("lunch")


def test_a_cold_process_start_is_read_exactly_not_from_the_drifting_boot_time():
    """psutil's create_time put a process started now 0.9 s in the past on these VMs."""
    import subprocess
    import sys
    import time
    before = time.time()
    child = subprocess.run([sys.executable, "-c", "import time; from megatron.training import "
                            "startup; print(startup._process_started_at(), time.time())"],
                           capture_output=True, text=True, check=True,
                           env={k: v for k, v in startup.os.environ.items()
                                if k != startup.ASSIGNED_AT_ENV})
    started, now = map(float, child.stdout.split())
    assert before - 0.02 <= started <= now  # one clock tick of slack
