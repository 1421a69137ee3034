"""A run directory that runs out of room mid-run: its writers skip and say so once, and the
supervisor names the full run directory, not a GPU, as the cause."""

import errno
import os

import pytest

from ftmaster import runfiles
from ftmaster.states import Trigger
from ftmaster.supervisor import Supervisor, SupervisorConfig
from helpers.tmpfs import small_tmpfs
from test_supervisor_console import FailingMonitor, RankEndingAttempt


def full(folder):
    """Fill ``folder``'s filesystem to the last byte."""
    with open(folder / "filler", "wb", buffering=0) as handle:
        with pytest.raises(OSError) as raised:
            while True:
                handle.write(b"\0" * 4096)
    assert raised.value.errno == errno.ENOSPC
    return folder


@pytest.fixture
def full_run_dir(tmp_path):
    with small_tmpfs(tmp_path / "run", "1m") as folder:
        yield full(folder)


def test_a_failed_write_is_said_once_per_file_until_it_works_again(tmp_path):
    said = []
    outage = runfiles.WriteOutage(lambda m: said.append(("failed", m)),
                                  lambda m: said.append(("recovered", m)), "it goes on")
    target = tmp_path / "a"

    def fail():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    assert outage.write(target, fail) is None and outage.write(target, fail) is None
    assert said == [("failed", f"cannot write {target} (ENOSPC: No space left on device); "
                               "it goes on until it can")]
    assert outage.write(target, lambda: 7) == 7 and outage.write(target, lambda: 8) == 8
    assert said[1:] == [("recovered", f"{target} is written again")]
    with pytest.raises(ValueError):  # only the filesystem's errors are an outage
        outage.write(target, lambda: int("x"))


def test_events_that_cannot_be_appended_are_skipped(full_run_dir):
    said = []
    outage = runfiles.WriteOutage(said.append, said.append, "it goes on")
    outage.append_event(full_run_dir, "checkpoint_request", source="test")
    assert runfiles.read_events(full_run_dir) == []
    assert len(said) == 1 and "ENOSPC" in said[0]


def test_room_is_the_free_space_of_a_writable_run_directory(full_run_dir, tmp_path):
    assert runfiles.room_problem(tmp_path) is None
    assert runfiles.room_problem(full_run_dir) == f"{full_run_dir} has 0 bytes free"
    (full_run_dir / "filler").unlink()
    assert runfiles.room_problem(full_run_dir) is None  # 1 MiB free again, just
    assert runfiles.room_problem(tmp_path / "absent") == f"{tmp_path / 'absent'}: No such file or directory"


def test_a_rank_that_died_in_a_full_run_directory_gives_up_on_it_not_on_a_gpu(full_run_dir, caplog):
    from ftmaster import exit_codes
    from ftmaster.launch import check_layout
    from ftmaster.states import State, exit_status
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=full_run_dir, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, FailingMonitor())
    supervisor.attempt = RankEndingAttempt()
    supervisor.attempt.log_path = full_run_dir / "logs" / "attempt_1.log"
    supervisor.attempt.root_cause = lambda rank, lines: "(no training output)"
    assert supervisor._check_training() is Trigger.FAILURE  # its event unwritten, and said
    assert supervisor._last_failure == ("run_dir", 0)
    assert supervisor._decide() is Trigger.GIVE_UP
    assert exit_status(State.GAVE_UP, None, supervisor._requeue_helps) == exit_codes.DO_NOT_REQUEUE
    text = caplog.text
    assert f"the run directory cannot take training's output: {full_run_dir} has 0 bytes free" in text
    assert f"cannot write {full_run_dir / 'events.jsonl'} (ENOSPC" in text
    assert "giving up: the run directory is out of room or read-only" in text


def test_an_event_a_full_disk_cuts_short_is_said_and_costs_no_later_event(tmp_path):
    with small_tmpfs(tmp_path / "run", "1m") as run_dir:
        runfiles.append_event(run_dir, "first")  # events.jsonl's first page, mostly free
        full(run_dir)
        with pytest.raises(OSError) as raised:  # the page takes part of it, then none is left
            runfiles.append_event(run_dir, "cut_short", reason="x" * 6000)
        assert raised.value.errno == errno.ENOSPC
        (run_dir / "filler").unlink()
        runfiles.append_event(run_dir, "after", iteration=3)
        assert [event["event"] for event in runfiles.read_events(run_dir)] == ["first", "after"]
