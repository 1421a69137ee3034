"""The supervisor's reading of an attempt: causes from exit statuses, the root cause, the
console (events echoed, progress lines), attempt numbers across a restart, and the checks made
before the first launch."""

import json
import logging
import signal
import time
from pathlib import Path
import shutil
from types import SimpleNamespace

import pytest

from ftmaster import exit_codes, runfiles
from ftmaster.attempt import Attempt, RankRecord, classify_exits, error_summary, \
    failed_despite_the_stop
from ftmaster.guard import write_rank_record
from ftmaster.console import FileTail, Progress, describe_event, duration, gpus_text, new_events
from ftmaster.launch import needs_gpu_probe, uses_trainer_parser
from ftmaster.recovery.checkpoints import iteration_dir
from ftmaster.supervisor import Supervisor, SupervisorConfig
from helpers.trainer import PRETRAIN


def record(local_rank, code, ended_at):
    return RankRecord(local_rank=local_rank, rank=local_rank, pid=100 + local_rank,
                      guard_pid=200 + local_rank, exit_code=code, ended_at=ended_at)


@pytest.mark.parametrize("failed, cause, gpus, first", [
    # a CUDA-style crash on GPU 3 first, then its peer's connection reset
    ({1: record(1, 1, 10.0), 0: record(0, 1, 10.2)}, "exit", (3, 5), 1),
    ({0: record(0, -9, 5.0)}, "exit", (5,), 0),
    # the trainer's own statuses are never put on a GPU, whoever else failed after
    ({0: record(0, exit_codes.NONFINITE, 1.0), 1: record(1, -15, 1.1)}, "nonfinite", (), 0),
    ({1: record(1, exit_codes.STORAGE, 2.0)}, "storage", (), 1),
    ({0: record(0, exit_codes.NO_CHECKPOINT, 2.0)}, "no_checkpoint", (), 0),
    ({0: record(0, exit_codes.USAGE, 2.0)}, "usage", (), 0),
    # a corrupt corpus, then the peers it left in a collective: no GPU named (issue 20's D10)
    ({1: record(1, exit_codes.DATA, 2.0), 0: record(0, 1, 2.3)}, "data", (), 1),
    # a peer that failed while a memory checkpoint was read from it: no GPU at fault
    ({0: record(0, exit_codes.PEER_READ, 2.0)}, "peer_read", (), 0),
    # a SIGTERMed peer that ended first does not hide the real cause... it is the first
    ({0: record(0, -15, 1.0), 1: record(1, exit_codes.STORAGE, 2.0)}, "exit", (5, 3), 0),
])
def test_the_first_failed_rank_names_the_cause(failed, cause, gpus, first):
    report = classify_exits(failed, gpus=(5, 3))
    assert (report.cause, report.first_local_rank) == (cause, first)
    assert report.gpus == tuple(sorted(gpus))
    assert report.exit_codes == {str(r.rank): r.exit_code for r in failed.values()}


LOST_PEER = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"


@pytest.mark.parametrize("codes, errors, killed, expected", [
    # saved and exited, or ended by the SIGTERM itself (before the trainer's handler was set)
    ({0: 0, 1: -signal.SIGTERM}, {}, False, set()),
    # killed at the stop's deadline by ftmaster's own SIGKILL
    ({0: -signal.SIGKILL, 1: -signal.SIGKILL}, {}, True, set()),
    # a crash racing the stop: another signal, the OOM killer's SIGKILL, an error of its own
    ({0: -signal.SIGTERM, 1: -signal.SIGSEGV}, {}, False, {1}),
    ({0: 0, 1: -signal.SIGKILL}, {}, False, {1}),
    ({0: 0, 1: -signal.SIGABRT}, {}, True, {1}),
    ({0: 1, 1: -signal.SIGTERM}, {0: "RuntimeError: CUDA error: an illegal memory access"},
     False, {0}),
    ({0: exit_codes.STORAGE}, {}, False, {0}),  # the exit save could not be written
    # the peers it left stay with it, so that the first to end is found among them
    ({0: 1, 1: -signal.SIGBUS}, {0: LOST_PEER}, False, {0, 1}),
    # only a peer lost to the stop (a rank its SIGTERM ended): no failure
    ({0: 1, 1: -signal.SIGTERM}, {0: LOST_PEER}, False, set()),
])
def test_a_rank_that_fails_while_a_stop_is_under_way_is_a_failure_not_a_stop(
        codes, errors, killed, expected):
    """Only the ends a stop asks for are a stop: the rest were recorded as 'stopped' with
    torchrun's exit status, the crash and its GPU lost."""
    failed = {rank: record(rank, code, 1.0 + rank) for rank, code in codes.items() if code}
    assert set(failed_despite_the_stop(failed, errors, killed_at_deadline=killed)) == expected


def test_a_rank_that_lost_a_peer_points_elsewhere():
    failed = {0: record(0, 1, 1.0), 1: record(1, 1, 1.1)}
    errors = {0: "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:21395: "
                 "Connection reset by peer. This is typically caused by a remote worker hanging"}
    report = classify_exits(failed, gpus=(0, 1), errors=errors)
    assert (report.cause, report.gpus) == ("peer", ())
    assert classify_exits(failed, gpus=(0, 1), errors={0: "RuntimeError: CUDA error"}).cause == "exit"


def test_a_peer_that_ended_before_the_rank_it_lost_does_not_hide_that_rank():
    """The rank that raised closed its connections, then took longer to end than the peer it
    left (a CI run on a busy machine named no GPU for an XID)."""
    failed = {0: record(0, 1, 5.20), 1: record(1, 1, 5.31), 2: record(2, -15, 5.4)}
    errors = {0: "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer",
              1: "RuntimeError: CUDA error: uncorrectable ECC error encountered"}
    report = classify_exits(failed, gpus=(10, 11, 12), errors=errors)
    assert (report.cause, report.gpus, report.first_local_rank) == ("exit", (11,), 1)
    killed = {0: failed[0], 2: record(2, -9, 5.4)}
    assert classify_exits(killed, gpus=(10, 11, 12), errors=errors).gpus == (12,)
    stopped = {0: failed[0], 2: failed[2]}  # only a lost peer and torchrun's SIGTERM: elsewhere
    assert classify_exits(stopped, gpus=(10, 11, 12), errors={0: errors[0]}).cause == "peer"


def test_a_rank_that_raised_and_still_runs_is_the_root_cause_over_the_peer_it_left():
    """A CI run on a busy machine: rank 1 recorded its XID error 3 s before the poll and had
    not ended; rank 0, which lost it, had. Its GPU is named, from its error alone; torchrun's
    SIGTERM in its slow exit does not make it a bystander either."""
    lost = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    errors = {0: lost, 1: "RuntimeError: CUDA error: uncorrectable ECC error encountered",
              2: lost}
    failed = {0: record(0, 1, 5.2)}
    report = classify_exits(failed, gpus=(10, 11, 12, 13), errors=errors)
    assert (report.cause, report.gpus, report.first_local_rank) == ("exit", (11,), 1)
    assert report.exit_codes == {"0": 1}
    failed[1] = record(1, -15, 5.4)
    report = classify_exits(failed, gpus=(10, 11, 12, 13), errors=errors)
    assert (report.cause, report.gpus, report.first_local_rank) == ("exit", (11,), 1)
    only_lost = {0: lost, 2: lost}  # ranks still running that only lost a peer: elsewhere
    assert classify_exits({0: record(0, 1, 5.2)}, gpus=(10, 11, 12, 13),
                          errors=only_lost).cause == "peer"


def test_peers_that_failed_close_behind_the_first_are_not_blamed():
    """An XID on rank 1's GPU under a busy machine: its exit took seconds, and the peers it
    left in collectives (one lost its connection, one was SIGTERMed) ended within the same
    poll. Only rank 1's GPU is named; a rank that failed on its own is named too."""
    failed = {1: record(1, 1, 5.25), 0: record(0, 1, 5.31), 3: record(3, -15, 5.41)}
    errors = {1: "RuntimeError: CUDA error: uncorrectable ECC error encountered",
              0: "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer",
              3: "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"}
    gpus = (10, 11, 12, 13)
    report = classify_exits(failed, gpus=gpus, errors=errors)
    assert (report.cause, report.gpus, report.first_local_rank) == ("exit", (11,), 1)
    failed[2] = record(2, -9, 5.3)  # killed on its own, with no error of a lost peer
    assert classify_exits(failed, gpus=gpus, errors=errors).gpus == (11, 12)


def test_error_summary_is_the_exception_and_its_innermost_frames(tmp_path):
    stack = "Traceback (most recent call last):\n" + "".join(
        f'  File "/x/f{i}.py", line {i}, in g{i}\n    call()\n' for i in range(8)) + \
        "RuntimeError: CUDA error: uncorrectable ECC error encountered\n"
    error_file = tmp_path / "error_0.json"
    error_file.write_text(json.dumps({"message": {
        "message": "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        "extraInfo": {"py_callstack": stack, "timestamp": "1"}}}))
    summary = error_summary(error_file, traceback_lines=2).splitlines()
    assert summary[0] == "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    assert summary[1:] == ['  File "/x/f6.py", line 6, in g6', '  File "/x/f7.py", line 7, in g7']
    assert error_summary(tmp_path / "absent.json") is None
    (tmp_path / "torn.json").write_text('{"message": ')
    assert error_summary(tmp_path / "torn.json") is None


def test_a_file_tail_returns_whole_new_lines_and_starts_over_on_a_new_file(tmp_path):
    path = tmp_path / "events.jsonl"
    tail = FileTail(path)
    assert tail.new_lines() == []
    path.write_text('{"event": "a", "time": 1}\n{"event": "b"')
    assert [e["event"] for e in new_events(tail)] == ["a"]
    with path.open("a") as handle:
        handle.write(', "time": 2}\nnot json\n')
    assert [e["event"] for e in new_events(tail)] == ["b"]
    with path.open("a") as handle:  # a foreign line nested past json's depth killed the supervisor
        handle.write("[" * 200_000 + '\n{"event": "d", "time": 3}\n')
    assert [e["event"] for e in new_events(tail)] == ["d"]
    path.write_text('{"event": "c", "time": 3}\n')  # replaced by a shorter file
    assert [e["event"] for e in new_events(tail)] == ["c"]
    tail.skip_to_end()
    assert tail.new_lines() == []


@pytest.mark.parametrize("seconds, text", [(0, "0 s"), (59.4, "59 s"), (250, "4 min 10 s"),
                                           (3 * 3600 + 125, "3 h 02 min")])
def test_duration(seconds, text):
    assert duration(seconds) == text


@pytest.mark.parametrize("gpus, text", [([3], "GPU 3"), ((0, 1), "GPUs 0, 1"), ([], "no GPU"),
                                        ("7", "GPU 7")])  # a hand-edited event's field
def test_gpu_ids_read_as_an_operator_writes_them(gpus, text):
    assert gpus_text(gpus) == text


def test_a_progress_line_shows_iteration_loss_speed_checkpoint_and_eta(tmp_path):
    log_path = tmp_path / "attempt_1.log"
    log_path.write_text("iteration 10/30 | consumed samples: 240 | elapsed time per iteration "
                        "(ms): 250.0 | learning rate: 1.0E-03 | global batch size: 24 | "
                        "lm loss: 3.912345E+00 |\n")
    progress = Progress(log_path, interval_s=5, started_at=0.0)
    assert progress.line({"iteration": 8, "time": 100.0}, now=1.0) is None  # not due yet
    first = progress.line({"iteration": 8, "time": 100.0}, now=6.0)
    assert first == ("progress: iteration 8/30 | lm loss 3.912 (iteration 10) | "
                     "0.25 s/iteration | no checkpoint yet | ETA 6 s")  # the trainer's timing
    assert progress.line({"iteration": 8, "time": 100.0}, now=11.0) is None  # stalled
    progress.last_checkpoint = {"iteration": 5, "time": 101.0}
    line = progress.line({"iteration": 10, "time": 100.5}, now=111.0)
    assert line == ("progress: iteration 10/30 | lm loss 3.912 (iteration 10) | "
                    "0.25 s/iteration | last checkpoint 5 (10 s ago) | ETA 5 s")
    progress.last_checkpoint = {"event": "checkpoint_loaded", "iteration": 4, "time": 110.0}
    line = progress.line({"iteration": 12, "time": 101.0}, now=117.0)
    assert "| resumed from checkpoint 4 |" in line  # a resume's, until its first save


@pytest.mark.parametrize("loss, shown", [("NAN", "nan"), ("-INF", "-inf"), ("INF", "inf")])
def test_a_non_finite_loss_as_megatron_logs_it_is_shown(tmp_path, loss, shown):
    """Megatron formats the loss with ``{:.6E}``: a NaN is ``NAN``. Such a line was not read at
    all, and the progress line kept the last finite loss while training diverged."""
    log_path = tmp_path / "attempt_1.log"
    log_path.write_text("".join(
        f"iteration {it}/30 | consumed samples: {24 * it} | elapsed time per iteration (ms): "
        f"250.0 | learning rate: 1.0E-03 | global batch size: 24 | lm loss: {value} |\n"
        for it, value in ((10, "3.912345E+00"), (20, loss))))
    progress = Progress(log_path, interval_s=5, started_at=0.0)
    line = progress.line({"iteration": 20, "time": 100.0}, now=6.0)
    assert f"| lm loss {shown} (iteration 20) |" in line
    assert progress.steps_logged == 2


def test_the_pace_is_the_trainers_own_timing_else_the_heartbeats(tmp_path):
    """Across nodes the last rank, which logs the iterations, may run on another node: the
    persist cadence went by no pace at all and copied every memory checkpoint to disk."""
    log_path = tmp_path / "attempt_1.log"
    log_path.write_text("")
    progress = Progress(log_path, interval_s=5, started_at=0.0)
    progress.line({"iteration": 8, "time": 100.0}, now=6.0)
    assert progress.seconds_per_iteration is None
    progress.line({"iteration": 12, "time": 102.0}, now=12.0)
    assert progress.seconds_per_iteration == 0.5
    for step_ms in (300.0, 100.0, 200.0):
        progress.took(step_ms)
    assert progress.seconds_per_iteration == 0.2


@pytest.mark.parametrize("event, level, text", [
    ({"event": "save_failed", "iteration": 20, "kind": "periodic", "path": "/c/iter_0000020",
      "reason": "ENOSPC (No space left on device)"}, logging.ERROR,
     "periodic checkpoint at iteration 20 failed: ENOSPC (No space left on device) "
     "(/c/iter_0000020); the checkpoints before it are untouched"),
    ({"event": "checkpoint_skipped", "iteration": 30, "path": "/c/iter_0000030",
      "reason": "__1_0.distcp checksum mismatch"}, logging.WARNING,
     "skipped checkpoint /c/iter_0000030: __1_0.distcp checksum mismatch"),
    ({"event": "nonfinite", "iteration": 12, "what": "loss"}, logging.ERROR,
     "non-finite loss at iteration 12: stopped before the update, nothing saved"),
    ({"event": "emergency_save", "iteration": 11, "kind": "emergency", "bytes": 3_100_000,
      "seconds": 0.2, "persist_seconds": 0.5}, logging.INFO,
     "checkpoint at iteration 11 (emergency, 3.1 MB): training blocked 0.20 s, durable after 0.50 s"),
    ({"event": "fresh_start", "folders": ["/c"]}, logging.INFO,
     "no checkpoint in /c; starting from scratch"),
    ({"event": "tracker_problem", "reason": "/c/latest_checkpointed_iteration.txt holds 'x?': "
      "trying every iter_* folder, newest first"}, logging.WARNING,
     "checkpoint tracker: /c/latest_checkpointed_iteration.txt holds 'x?': trying every iter_* "
     "folder, newest first"),
    ({"event": "checkpoint_set_aside", "iteration": 9, "path": "/c/iter_0000012",
      "moved_to": None}, logging.WARNING,
     "/c/iter_0000012 removed (left by a save that never finished: nothing in it could be "
     "loaded): newer than the resumed iteration 9"),
    ({"event": "checkpoint_set_aside", "iteration": 9, "path": "/c/iter_0000012",
      "moved_to": "/c/iter_0000012.discarded-x"}, logging.WARNING,
     "/c/iter_0000012 set aside as /c/iter_0000012.discarded-x: newer than the resumed "
     "iteration 9"),
    # The tier not resumed from: its folder of the resumed iteration, a killed save's.
    ({"event": "checkpoint_set_aside", "iteration": 9, "path": "/m/iter_0000009",
      "moved_to": None}, logging.WARNING,
     "/m/iter_0000009 removed (left by a save that never finished: nothing in it could be "
     "loaded): iteration 9 was resumed from the other tier"),
    ({"event": "checkpoint_set_aside", "iteration": 9, "path": "/m/iter_0000009",
      "moved_to": "/m/iter_0000009.discarded-x"}, logging.WARNING,
     "/m/iter_0000009 set aside as /m/iter_0000009.discarded-x (left by a save that never "
     "finished, and it could not be removed): iteration 9 was resumed from the other tier"),
    # A save's: another run's checkpoint of the iteration it saves, in a --save not --load.
    ({"event": "checkpoint_set_aside", "iteration": 9, "path": "/s/iter_0000009",
      "moved_to": "/s/iter_0000009.discarded-x", "reason": "it holds another state"},
     logging.WARNING, "/s/iter_0000009 set aside as /s/iter_0000009.discarded-x: it holds "
     "another state"),
])
def test_trainer_events_become_one_console_line(event, level, text):
    assert describe_event(event) == (level, text)
    assert describe_event({"event": "launch", "attempt": 1}) is None  # the supervisor's own


@pytest.mark.parametrize("nproc, visible, backend, probe", [
    (4, None, "sim", False), (4, None, "replay:x.csv", False), (4, None, "nvml", True),
    (None, None, "sim", True), (None, ("0", "1"), "nvml", True),  # UUIDs and MIG modes
    (4, (), "nvml", False),  # every GPU hidden: nothing to ask
    (4, ("0", "1"), "sim", False),
    # a rehearsal on a GPU host's UUIDs was refused as needing NVML, which it did not ask
    (4, ("GPU-8932f937", "GPU-1234"), "sim", True), (4, ("MIG-5c1a",), "replay:x.csv", True)])
def test_the_gpu_probe_runs_only_when_a_count_is_needed(nproc, visible, backend, probe):
    assert needs_gpu_probe(nproc, visible, backend) is probe


def test_the_trainer_parser_is_used_only_for_scripts_that_use_it(tmp_path):
    assert uses_trainer_parser(PRETRAIN)
    foreign = tmp_path / "pretrain_gpt.py"
    foreign.write_text("from megatron.training import get_args, pretrain\n")
    assert not uses_trainer_parser(foreign)
    assert not uses_trainer_parser(tmp_path / "absent.py")


class QuietMonitor:
    on_alert = None

    def lost_gpus(self):
        return frozenset()


def test_a_new_supervisor_continues_the_attempt_numbers_and_records_the_lost_attempt(tmp_path):
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL

    runfiles.append_event(tmp_path, "launch", attempt=1)
    runfiles.append_event(tmp_path, "failure", attempt=1, iteration=4, cause="exit")
    runfiles.append_event(tmp_path, "launch", attempt=2)
    runfiles.write_heartbeat(tmp_path, iteration=17, consumed_samples=0)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    assert supervisor.attempts_before == 2
    lost = runfiles.read_events(tmp_path)[-1]
    assert (lost["event"], lost["attempt"], lost["iteration"], lost["cause"]) == \
        ("failure", 2, 17, "supervisor_lost")
    heartbeat_at = runfiles.read_heartbeat(tmp_path)["time"]
    assert lost["lost_at"] == max(heartbeat_at, runfiles.read_events(tmp_path)[-2]["time"])
    assert Supervisor(config, QuietMonitor()).attempts_before == 2  # recorded once


def test_a_lost_attempt_whose_heartbeat_cannot_be_read_ended_at_an_unknown_iteration(tmp_path):
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL

    runfiles.append_event(tmp_path, "launch", attempt=1)
    runfiles.heartbeat_path(tmp_path).write_text("garbage")
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    Supervisor(config, QuietMonitor())
    lost = runfiles.read_events(tmp_path)[-1]
    assert (lost["cause"], lost["iteration"]) == ("supervisor_lost", None)  # not 0: none lost


@pytest.mark.parametrize("damaged", [False, True])
def test_a_persist_is_recorded_at_the_time_its_copy_finished_not_when_it_was_read(tmp_path,
                                                                                 damaged):
    """The copy's result is read at the supervisor's next poll of training, which a launch
    waiting for warm workers held off (15.6 s in a real run): the event was dated then. A
    failed copy's too."""
    from ftmaster.launch import check_layout
    from ftmaster.persist import Persister
    from test_launch_parts import MODEL
    from test_persist import fake_checkpoint

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    source = fake_checkpoint(tmp_path / "memory", 8)
    if damaged:  # a shard other than its manifest says: the copy fails its check
        (source / "common.pt").write_bytes(b"x" * 100)
    supervisor.persister = Persister(tmp_path / "memory", tmp_path / "disk")
    assert supervisor.persister.start(8)
    supervisor.persister.wait(10)
    finished_by = time.time()
    time.sleep(0.5)  # the launch's wait
    supervisor._report_persisted()
    persisted = runfiles.read_events(tmp_path)[-1]
    assert (persisted["event"], persisted.get("iteration")) == \
        (("persist_failed", None) if damaged else ("persisted", 8))
    assert persisted["time"] <= finished_by


@pytest.mark.parametrize("loaded, kept", [(100, None), (110, 110)])
def test_an_attempt_that_loaded_an_older_checkpoint_lets_its_number_be_copied_again(tmp_path,
                                                                                    loaded, kept):
    """110 persisted, then a relaunch resumed from disk at 100 (110 loaded neither from memory
    nor from disk), which set every memory checkpoint aside: the new timeline's 110 stayed
    in memory alone, 110 being the iteration copied last."""
    from ftmaster.launch import check_layout
    from ftmaster.persist import Persister
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    supervisor.persister = Persister(tmp_path / "memory", tmp_path / "disk")
    supervisor.persister.last_requested = 110
    runfiles.append_event(tmp_path, "checkpoint_loaded", iteration=loaded, tier="disk")
    supervisor._follow_events()
    assert supervisor.persister.last_requested == kept

def test_one_damaged_memory_checkpoint_is_one_failed_persist_not_three(tmp_path):
    """A copy failed at a poll was tried again at once when the attempt failed and again at
    the end of the run, each failing the same way: three persist_failed events and three
    console lines for one damaged checkpoint within a second."""
    from ftmaster.launch import check_layout
    from ftmaster.persist import Persister
    from test_launch_parts import MODEL
    from test_persist import fake_checkpoint

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    source = fake_checkpoint(tmp_path / "memory", 8)
    (source / "common.pt").write_bytes(b"x" * 100)
    supervisor.persister = Persister(tmp_path / "memory", tmp_path / "disk")
    supervisor._persist_when_due()  # the emergency save's copy, at a poll
    supervisor.persister.wait(10)
    supervisor._persist_when_due(now=True)  # the attempt failed
    supervisor.persister.wait(10)
    supervisor._finish_persisting()  # the run ends
    failed = [e for e in runfiles.read_events(tmp_path) if e["event"] == "persist_failed"]
    assert len(failed) == 1 and "does not match its checksum" in failed[0]["reason"]


class FinishedAttempt:
    """An attempt whose ranks finished training but have not exited yet."""

    number, gpus, killed, stuck_gpus = 1, (0, 1, 2, 3), False, {}

    def failed_ranks(self):
        return {}

    def exit_code(self):
        return None

    def kill(self):
        self.killed = True


def test_finished_training_is_never_a_hang_however_slow_its_exit(tmp_path):
    import time

    from ftmaster.launch import check_layout
    from ftmaster.states import Trigger
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None),
                              hang_timeout_s=0.01, startup_timeout_s=0.01, stop_timeout_s=0.2)
    supervisor = Supervisor(config, QuietMonitor())
    supervisor.attempt = FinishedAttempt()
    runfiles.write_heartbeat(tmp_path, 30, 0, finished=True)
    supervisor._progress = (30, time.monotonic() - 100)  # far past the hang timeout
    assert supervisor._check_training() is None
    time.sleep(0.25)  # past the stop timeout: its processes are stopped, the run is complete
    assert supervisor._check_training() is Trigger.COMPLETED and supervisor.attempt.killed
    assert runfiles.read_events(tmp_path)[-1]["event"] == "complete"


class RankEndingAttempt(FinishedAttempt):
    """Its one rank exits with status 3 just as the supervisor polls the attempt's end."""

    ended, stuck_gpus = False, {}

    def exit_code(self):
        self.ended = True
        return 1

    def failed_ranks(self):
        return {0: record(0, 3, 1.0)} if self.ended else {}

    def recorded_errors(self, local_ranks):
        return {}


class FailingMonitor(QuietMonitor):
    pending_injections = ()

    def refresh(self, timeout_s):
        pass

    def lost_reasons(self):
        return {}

    def unschedulable_gpus(self):
        return {}


def test_a_rank_that_ends_as_the_attempt_is_polled_is_named_with_its_own_status(tmp_path):
    """The exit status is read before the rank records: once the ranks have ended, their
    records are complete (a CI run once blamed torchrun's status 1, with no GPU)."""
    from ftmaster.launch import check_layout
    from ftmaster.states import Trigger
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, FailingMonitor())
    supervisor.attempt = RankEndingAttempt()
    assert supervisor._check_training() is Trigger.FAILURE
    failure = runfiles.read_events(tmp_path)[-1]
    assert (failure["cause"], failure["gpus"], failure["exit_codes"]) == ("exit", [0], {"0": 3})


class PeerFailedMembership:
    """A peer announced the failure of this node's round, with ``cause``."""

    def __init__(self, cause):
        self.cause = cause

    def peer_failure(self, stop=None):
        return self.cause

    def peers_waiting(self, stop=None):
        return True

    def announce_failure(self, cause, stop=None):
        pass


class SlowToEndAttempt(RankEndingAttempt):
    """Polled while running once, then its rank ends with status 3 (``fails``) or keeps on."""

    def __init__(self, fails):
        self.fails, self.polls = fails, 0

    def exit_code(self):
        self.polls += 1
        self.ended = self.fails and self.polls > 1
        return 1 if self.ended else None


@pytest.mark.parametrize("peer_cause, fails, polls, cause", [
    ("usage", True, 2, "exit"), ("usage", False, 2, "peer"), ("nonfinite", True, 2, "exit"),
    ("device_lost", True, 1, "peer"), ("exit", False, 1, "peer")])
def test_a_peers_failure_lets_this_nodes_ranks_end_on_their_own_first(
        tmp_path, monkeypatch, peer_cause, fails, polls, cause):
    """An error every rank shares ends the ranks of every node at once: a node that hears of
    its peer's failure first still reports its own ranks' error. Ranks that keep running
    are stopped once the grace is over, as cause peer; after any other cause of the peer's
    they are stopped at once (blocked on a dead peer, or to dump their replicas)."""
    import time

    from ftmaster import supervisor as supervisor_module
    from ftmaster.launch import check_layout
    from ftmaster.states import Trigger
    from test_launch_parts import MODEL

    monkeypatch.setattr(supervisor_module, "PEER_FAILURE_GRACE_S", 0.05)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, FailingMonitor())
    supervisor.membership = PeerFailedMembership(peer_cause)
    supervisor.attempt = SlowToEndAttempt(fails)
    supervisor._progress = (None, time.monotonic())  # just launched
    if polls == 2:
        assert supervisor._check_training() is None  # the grace starts: no rejoin either
        time.sleep(0.1)
    assert supervisor._check_training() is Trigger.FAILURE
    failure = runfiles.read_events(tmp_path)[-1]
    assert (failure["event"], failure["cause"]) == ("failure", cause)


def test_a_nan_injection_is_armed_for_the_attempt_on_its_gpu_once(tmp_path):
    from ftmaster.faults import parse_injection
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None),
                              injections=(parse_injection("nan:gpu=2,at=iter:7"),
                                          parse_injection("fail:gpu=1,at=iter:9")))
    supervisor = Supervisor(config, QuietMonitor())
    assert supervisor._armed_injections((0, 1, 3)) == {}  # not on these GPUs
    devices = SimpleNamespace(cuda_env=lambda gpus: {"CUDA_VISIBLE_DEVICES": "0,2,3"})
    assert supervisor._attempt_env(devices, (0, 2, 3)) == {
        "CUDA_VISIBLE_DEVICES": "0,2,3", "FTMASTER_INJECT_NAN": "1:7",
        "FTMASTER_HANG_TIMEOUT": "300.0",  # the default --hang-timeout, for the blocking waits
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "150"}  # the default --stop-timeout, 120 s, and 30
    supervisor.injector.trained(7)
    assert supervisor._armed_injections((0, 2, 3)) == {}  # handed over once, and reached
    assert [str(i) for i in supervisor.injector.pending] == ["fail:gpu=1,at=iter:9"]


def test_torchrun_signalled_with_ftmaster_leaves_the_ranks_ftmasters_stop_timeout(tmp_path):
    # SLURM signals every process of the step, torchrun too, and torchrun SIGKILLs its ranks
    # 30 s after a signal of its own (torch's default), in the middle of a longer save.
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), stop_timeout_s=200.5)
    devices = SimpleNamespace(cuda_env=lambda gpus: {})
    env = Supervisor(config, QuietMonitor())._attempt_env(devices, (0, 1, 2, 3))
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "231"  # after ftmaster's own deadline


def memory_tier_supervisor(tmp_path, memory: Path, disk: Path, scratch: bool = True,
                           save_interval: int | None = None) -> Supervisor:
    """A supervisor of a 4-GPU run with a memory tier in ``memory`` (one ftmaster picked, with
    ``scratch``) over ``disk``."""
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL

    command = MODEL + ["--save", str(disk), "--non-persistent-ckpt-type", "global",
                       "--non-persistent-global-ckpt-dir", str(memory)]
    if save_interval is not None:
        command += ["--save-interval", str(save_interval)]
    return Supervisor(SupervisorConfig(
        run_dir=tmp_path / "run", command=tuple(command), gpus=(0, 1, 2, 3),
        first_plan=check_layout(command, 4, None, None),
        scratch_memory_dir=memory if scratch else None), QuietMonitor())


@pytest.mark.parametrize("on_disk, removed", [(8, True), (6, False)])
def test_a_run_that_succeeds_removes_the_memory_folder_it_chose_once_disk_has_it_all(
        tmp_path, on_disk, removed, caplog):
    from test_persist import fake_checkpoint

    memory, disk = tmp_path / "shm", tmp_path / "ckpt"
    fake_checkpoint(memory, 8)
    fake_checkpoint(disk, on_disk)
    memory_tier_supervisor(tmp_path, memory, disk)._remove_scratch_memory()
    assert memory.exists() is not removed  # a memory checkpoint newer than disk is kept
    # ... and said to be there alone (a full --save made its persist copy fail): a user who
    # removed it, or a reboot, would lose the run's newest checkpoint unawares
    kept = (f"kept the memory tier {memory}: its checkpoint of iteration 8 is not on disk (the "
            f"newest in {disk} is iteration 6); launch again with --run-dir {tmp_path / 'run'} "
            "to resume from it")
    assert (kept in caplog.text) is not removed


def test_a_relaunch_keeps_load_while_save_holds_only_another_runs_older_checkpoint(tmp_path):
    """--load base (iteration 100000) --save B, B holding an earlier run's iteration 5000: the
    attempt died before its first save, and the relaunch loaded B's 5000, without
    --no-load-optim. A save of this run's own in B switches it."""
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL
    from test_persist import fake_checkpoint

    base, save = tmp_path / "base", tmp_path / "save"
    fake_checkpoint(base, 100000)
    fake_checkpoint(save, 5000)
    command = (*MODEL, "--load", str(base), "--save", str(save), "--no-load-optim")
    config = SupervisorConfig(run_dir=tmp_path / "run", command=command, gpus=(0, 1, 2, 3),
                              first_plan=check_layout(command, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    supervisor.attempt = FakeAttempt()
    runfiles.append_event(tmp_path / "run", "checkpoint_loaded", iteration=100000,
                          path=str(base / "iter_0100000"), tier="disk")
    supervisor._follow_events()
    assert supervisor._resuming(command) == list(command)
    fake_checkpoint(save, 100010)
    assert supervisor._resuming(command) == [*MODEL, "--load", str(save), "--save", str(save)]


def test_a_supervisor_started_after_a_reboot_says_the_memory_tier_lost_the_killed_ones_newest(
        tmp_path, caplog):
    """A node reboot kills ftmaster and empties /dev/shm: the one started again resumed from
    disk's older checkpoint without a word of the iterations that went with memory."""
    from test_persist import fake_checkpoint

    memory, disk = tmp_path / "shm", tmp_path / "ckpt"
    fake_checkpoint(disk, 20)
    run_dir = tmp_path / "run"
    runfiles.append_event(run_dir, "launch", attempt=1)
    runfiles.append_event(run_dir, "periodic_save", iteration=24, tier="memory", kind="periodic")
    supervisor = memory_tier_supervisor(tmp_path, memory, disk)
    supervisor._resuming(supervisor.config.command)
    (lost,) = [e for e in runfiles.read_events(run_dir) if e["event"] == "memory_tier_lost"]
    assert (lost["path"], lost["iteration"]) == (str(memory), 24)
    assert f"the memory tier {memory} no longer holds checkpoints (the newest was iteration 24)" \
        in caplog.text


def test_a_supervisor_killed_after_its_attempt_failed_still_has_its_memory_loss_said(tmp_path):
    """The attempt failed (its failure recorded), then the reboot killed ftmaster while it
    planned the relaunch (waited for a round, merged replicas): a failed attempt counted as
    a run that ended, so the ftmaster started again took no newest checkpoint from it and
    resumed from disk's 20 without a word of memory's 24."""
    memory, (lost,) = resumed_after_a_failed_attempt(tmp_path, 20)
    assert (lost["path"], lost["iteration"]) == (str(memory), 24)


@pytest.mark.parametrize("end", ["complete", "gave_up", "stopped", "store_lost"])
def test_a_supervisor_started_after_one_that_ended_has_no_memory_tier_to_miss(tmp_path, end):
    """A run that ends removes the memory folder it chose once disk holds it all."""
    _, lost = resumed_after_a_failed_attempt(tmp_path, 24, end)
    assert not lost


def resumed_after_a_failed_attempt(tmp_path, on_disk: int, *ends: str):
    """A run whose attempt saved 24 to memory and failed at 25, then ``ends``; disk holds
    ``on_disk``. A supervisor started again on it resumes: its memory folder (empty, as after
    a reboot) and its ``memory_tier_lost`` events."""
    from test_persist import fake_checkpoint

    memory, disk, run_dir = tmp_path / "shm", tmp_path / "ckpt", tmp_path / "run"
    fake_checkpoint(disk, on_disk)
    runfiles.append_event(run_dir, "launch", attempt=1)
    runfiles.append_event(run_dir, "periodic_save", iteration=24, tier="memory", kind="periodic")
    runfiles.append_event(run_dir, "failure", attempt=1, iteration=25, cause="exit")
    for end in ends:
        runfiles.append_event(run_dir, end)
    supervisor = memory_tier_supervisor(tmp_path, memory, disk)
    supervisor._resuming(supervisor.config.command)
    return memory, [e for e in runfiles.read_events(run_dir) if e["event"] == "memory_tier_lost"]


def test_a_persist_given_up_for_a_newer_checkpoint_takes_the_newer_one_at_once(tmp_path):
    """The peers pruned the checkpoint being copied: they hold newer ones, which waited a
    whole --save-interval of time after it, as if its copy had landed."""
    import time

    from ftmaster.persist import PersistSuperseded
    from ftmaster.recovery.checkpoints import read_tracker
    from test_persist import fake_checkpoint

    memory, disk = tmp_path / "shm", tmp_path / "ckpt"
    supervisor = memory_tier_supervisor(tmp_path, memory, disk, save_interval=20)
    supervisor.progress = SimpleNamespace(seconds_per_iteration=1.0)  # due every 20 s
    supervisor._last_persist_start = time.monotonic()  # the copy of iteration 2 started
    supervisor.persister._results.put(PersistSuperseded("iteration 2 is no longer held"))
    fake_checkpoint(memory, 4, kind="periodic")  # an emergency one is due at once anyway
    supervisor._persist_when_due()
    assert supervisor.persister.last_requested == 4
    supervisor.persister.wait(10)
    assert read_tracker(disk) == 4


def test_a_save_folder_that_stopped_answering_does_not_hold_up_the_supervisor(tmp_path, monkeypatch):
    """Whether the newest memory checkpoint needs a copy is read from --save: on a hung
    mount the supervisor's loop (hang detection, failure handling) stopped with it."""
    import threading
    import time

    from ftmaster import persist as persist_module
    from ftmaster import supervisor as supervisor_module
    from test_persist import fake_checkpoint

    memory, disk = tmp_path / "shm", tmp_path / "ckpt"
    fake_checkpoint(memory, 4)
    hung = threading.Event()
    monkeypatch.setattr(persist_module, "newest_on_disk", lambda save_dir: hung.wait(30))
    monkeypatch.setattr(supervisor_module, "CHECKPOINT_LOOK_S", 0.2)
    supervisor = memory_tier_supervisor(tmp_path, memory, disk)
    started = time.monotonic()
    supervisor._persist_when_due()
    supervisor._persist_when_due()  # while the first look is stuck
    hung.set()
    assert time.monotonic() - started < 5 and supervisor.persister.last_requested is None


def test_a_save_folder_that_cannot_be_listed_is_a_failed_persist_not_a_dead_supervisor(
        tmp_path, monkeypatch, caplog):
    """Without a tracker, whether disk has the newest memory checkpoint is read by listing
    --save: an EIO there (a flaky mount) raised out of the poll, killed the attempt and ended
    the supervisor in a traceback, and again at the end of the run, as it decides whether the
    memory tier it chose may go. Unknown is neither: the copy is tried (and says why it
    failed), and the memory tier is kept."""
    import errno

    from test_persist import fake_checkpoint

    memory, disk = tmp_path / "shm", tmp_path / "ckpt"
    fake_checkpoint(memory, 4)
    disk.mkdir()
    listing = Path.iterdir

    def iterdir(folder):
        if folder == disk:
            raise OSError(errno.EIO, "Input/output error", str(folder))
        return listing(folder)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    supervisor = memory_tier_supervisor(tmp_path, memory, disk)
    supervisor._persist_when_due()
    supervisor.persister.wait(10)
    assert supervisor.persister.last_requested is None  # failed, to be tried again
    supervisor._report_persisted()
    assert "persisting a memory checkpoint failed" in caplog.text
    supervisor._remove_scratch_memory()
    assert memory.exists() and "cannot be read" in caplog.text


@pytest.mark.parametrize("held_manifest, removed", [(True, False), (False, True)])
def test_a_node_whose_memory_folder_is_never_whole_keeps_its_parts_newer_than_disk(
        tmp_path, held_manifest, removed):
    """3 nodes with one replica: a node's folder holds parts of checkpoints, each with its
    manifest kept beside them, and no tracker. Its parts of one newer than disk may still be
    persisted from it: kept at the end. A folder a save killed mid-write left (no manifest of
    either kind) holds nothing any peer could fetch, and keeps nothing."""
    from ftmaster.recovery.manifest import HELD_MANIFEST_NAME
    from test_persist import fake_checkpoint

    memory, disk = tmp_path / "shm", tmp_path / "ckpt"
    iteration_dir(memory, 8).mkdir(parents=True)  # this node's shards of 8, no tracker
    (iteration_dir(memory, 8) / "__2_0.distcp").write_bytes(b"shard")
    if held_manifest:
        (iteration_dir(memory, 8) / HELD_MANIFEST_NAME).write_text("{}")
    fake_checkpoint(disk, 6)
    memory_tier_supervisor(tmp_path, memory, disk)._remove_scratch_memory()
    assert memory.exists() is not removed


@pytest.mark.parametrize("memory_intact, removed", [(True, True), (False, False)])
def test_a_run_stopped_by_a_signal_removes_the_memory_folder_it_chose_once_disk_has_it_all(
        tmp_path, memory_intact, removed):
    """SIGTERM (a SLURM time limit) makes training save to disk and exit, and the end of the
    run persists the newest memory checkpoint: the /dev/shm folder then holds nothing the disk
    lacks, and was left holding node RAM after every such job. One whose newest checkpoint
    could not be persisted (damaged) is kept."""
    from ftmaster.recovery.checkpoints import read_tracker
    from test_persist import fake_checkpoint

    memory, disk = tmp_path / "shm", tmp_path / "ckpt"
    fake_checkpoint(memory, 8)
    fake_checkpoint(disk, 6)
    if not memory_intact:
        (iteration_dir(memory, 8) / "__0_0.distcp").write_bytes(b"torn")
    supervisor = memory_tier_supervisor(tmp_path, memory, disk)
    supervisor.request_stop(signal.SIGTERM)  # before the launch: nothing trains, it ends
    assert supervisor.run() != 0
    assert read_tracker(disk) == (8 if memory_intact else 6)
    assert memory.exists() is not removed


def ran_steps(tmp_path, steps_ms, plan=None):
    """A supervisor whose attempt ran ``plan`` (of the first plan; by default that one),
    logging steps of ``steps_ms``."""
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    supervisor.attempt = object()
    supervisor.plan = config.first_plan if plan is None else plan(config.first_plan)
    supervisor.progress = Progress(tmp_path / "log", 10, 0)
    for step_ms in steps_ms:
        supervisor.progress.took(step_ms)
    return supervisor


HEALTHY_STEPS_MS = [5000.0, 900.0, 210.0, 190.0, 200.0]
SLOWED_STEPS_MS = [5000.0, 900.0, 210.0, 400.0, 410.0, 400.0]


@pytest.mark.parametrize("same_layout, expected", [(True, 0.2), (False, None)])
def test_the_original_layouts_measured_step_calibrates_the_planner_only_from_that_layout(
        tmp_path, same_layout, expected):
    """The median after the first two logged iterations (start-up and the first save are slow)."""
    import dataclasses

    supervisor = ran_steps(tmp_path, HEALTHY_STEPS_MS, None if same_layout else (
        lambda first: dataclasses.replace(first, micro_batch_size=1)))
    supervisor._measure_original_layout()
    assert supervisor._original_step_s == expected


def test_an_attempt_a_straggler_is_drained_from_calibrates_the_planner_without_its_slowdown(tmp_path):
    """Its logged steps were slowed: the plan after the drain estimates from the step the drain
    was decided on, not from them."""
    supervisor = ran_steps(tmp_path, SLOWED_STEPS_MS)
    supervisor._unslowed_step_s = 0.21
    supervisor._measure_original_layout()
    assert supervisor._original_step_s == 0.21


def test_a_relaunch_on_the_original_layout_still_calibrates_the_planner(tmp_path):
    """A relaunch on the same GPUs and layout (after a failure that retired none) was not the
    original layout: its plan's calibrated estimates differ from the first plan's, which were
    compared too. Its steps no longer calibrated the planner, nor a drain weighed on it."""
    from ftmaster.recovery.planner import plan_layout

    supervisor = ran_steps(tmp_path, HEALTHY_STEPS_MS, lambda first: plan_layout(
        first.command, 4, original_world_size=4, measured_step_s=2.0))
    assert supervisor.plan.layout() == supervisor.config.first_plan.layout()
    assert supervisor.plan.estimated_step_seconds != \
        supervisor.config.first_plan.estimated_step_seconds
    supervisor._measure_original_layout()
    assert supervisor._original_step_s == 0.2


@pytest.mark.parametrize("healthy_step_s, expected", [(0.21, 0.21), (None, 0.22)])
def test_a_straggler_kept_in_an_attempt_leaves_its_slowdown_out_of_the_planners_step(
        tmp_path, healthy_step_s, expected):
    """A straggler named and kept (or never weighed), then another failure: the attempt's
    slowed median calibrated the next plan, whose estimates then ran slow by its factor, so a
    straggler of the next attempt was kept on a line saying 'without the slowdown'."""
    from ftmaster.monitor.stragglers import Straggler

    supervisor = ran_steps(tmp_path, SLOWED_STEPS_MS)
    watch = supervisor.stragglers
    watch.new_attempt((0, 1, 2, 3), 0)
    watch.step_seconds = lambda since=None, until=None: 0.4 if until is None else healthy_step_s
    # 190 ms of compute against its peers' 10: 0.4 s less its extra 0.18 s is 0.22 s
    assert watch._found(Straggler(1, 20, 14, 19.0, None, 190.0, 10.0, 190.0)) is not None
    supervisor._measure_original_layout()
    assert supervisor._original_step_s == pytest.approx(expected)


class FakeAttempt:
    number = 3
    killed = False
    stuck_gpus = {}

    def kill(self):
        self.killed = True


@pytest.mark.parametrize("policy", ["now", "at-save"])
def test_a_waiting_peer_stops_the_attempt_at_once_or_after_an_agreed_save(tmp_path, policy):
    """--scale-up: ``now`` stops at once; ``at-save`` asks for a save and stops once one is
    durable (a failure with cause peer either way, no GPU blamed)."""
    from ftmaster.launch import check_layout
    from ftmaster.states import Trigger
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), scale_up=policy)
    supervisor = Supervisor(config, QuietMonitor())
    supervisor.attempt = attempt = FakeAttempt()
    if policy == "at-save":
        assert supervisor._rejoin(7) is None and not attempt.killed
        assert runfiles.trigger_flag_path(tmp_path).exists()  # the save asked for
        assert supervisor._rejoin(8) is None  # not saved yet
        runfiles.append_event(tmp_path, "emergency_save", iteration=8)
    assert supervisor._rejoin(8) is Trigger.PEERS_WAITING and attempt.killed
    failure = runfiles.read_events(tmp_path)[-1]
    assert (failure["event"], failure["cause"], failure["gpus"]) == ("failure", "peer", [])
    assert runfiles.trigger_flag_path(tmp_path).exists() == (policy == "at-save")


class LaunchedAttempt(FakeAttempt):
    """What ``Supervisor._launch`` starts, without processes."""

    def __init__(self, run_dir, number, command, gpus, env, world=None, starter=None):
        import time

        self.number, self.gpus, self.argv = number, tuple(gpus), list(command)
        self.log_path = Path(run_dir) / "logs" / f"attempt_{number}.log"
        self.started_at = time.time()


class WatchingMonitor(QuietMonitor):
    def watch(self, gpus):
        pass


def test_a_save_asked_for_a_waiting_peer_is_asked_again_of_the_next_attempt(tmp_path, monkeypatch):
    """--scale-up at-save: the attempt that asked for a save failed as it landed (its peer on
    another node saw it first and stopped). The next peer's wait found that old save, newer
    than the old request, and stopped the relaunched attempt at once, nothing saved for it."""
    from ftmaster import supervisor as supervisor_module
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL

    monkeypatch.setattr(supervisor_module, "Attempt", LaunchedAttempt)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, WatchingMonitor())
    supervisor.attempt = FakeAttempt()
    assert supervisor._rejoin(7) is None  # a save asked for
    runfiles.append_event(tmp_path, "periodic_save", iteration=8)  # unseen: the attempt failed
    supervisor._launch()
    assert not runfiles.trigger_flag_path(tmp_path).exists()  # the old request, cleared
    assert supervisor._rejoin(9) is None and not supervisor.attempt.killed
    assert runfiles.trigger_flag_path(tmp_path).exists()  # asked anew


class CancelledAttempt(LaunchedAttempt):
    def __init__(self, *args, **kwargs):
        from ftmaster.warm import LaunchCancelled

        raise LaunchCancelled("ftmaster is stopping")


@pytest.mark.parametrize("state", ["relaunching", "starting"])
def test_a_stop_while_a_relaunch_waits_for_warm_workers_launches_nothing(tmp_path, monkeypatch,
                                                                        state):
    """SIGTERM during the relaunch's wait for a warm set: the wait ends (``WarmStarter``), and
    the run ends interrupted with nothing started; it used to start training to stop it. A
    restarted ftmaster's first launch waits too, in ``starting`` (recorded as relaunching)."""
    from ftmaster import supervisor as supervisor_module
    from ftmaster.launch import check_layout
    from ftmaster.states import State, Trigger, advance
    from test_launch_parts import MODEL

    monkeypatch.setattr(supervisor_module, "Attempt", CancelledAttempt)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, WatchingMonitor())
    supervisor.attempt, supervisor.signum = FakeAttempt(), 15
    trigger = supervisor._handlers[State(state)]()
    assert trigger is Trigger.SIGNALLED
    assert advance(State(state), trigger) is State.INTERRUPTED
    stopped = runfiles.read_events(tmp_path)[-1]
    assert (stopped["event"], stopped["signal"], stopped["state"]) == ("stopped", 15, state)


@pytest.mark.parametrize("save, completes", [
    ({"kind": "final", "iteration": 8}, True),
    ({"kind": "periodic", "iteration": 10}, True),  # at --train-iters: the schedule's end
    ({"kind": "periodic", "iteration": 6}, False),
    ({"kind": "final", "iteration": 8, "tier": "memory"}, False),
])
def test_a_failure_after_trainings_last_checkpoint_is_durable_completes_the_run(
        tmp_path, save, completes):
    """A GPU lost, or a rank killed in its exit, after the last save: a relaunch would only
    load that checkpoint and end (and report a resume past the schedule)."""
    from ftmaster.launch import check_layout
    from ftmaster.states import Trigger
    from test_launch_parts import MODEL

    command = [*MODEL, "--train-iters", "10"]
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(command), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(command, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    supervisor.attempt = attempt = FakeAttempt()
    runfiles.append_event(tmp_path, "periodic_save", **save)
    if completes:
        assert supervisor._failure("device_lost", 8, [1], {}) is Trigger.COMPLETED and attempt.killed
        assert [e["event"] for e in runfiles.read_events(tmp_path)][-1] == "complete"
    else:
        supervisor._follow_events()
        assert supervisor._schedule_saved is None


def test_after_a_relaunch_at_another_global_batch_only_the_final_save_ends_the_schedule(tmp_path):
    """The relaunch trains to --train-samples: iteration 10 of the first batch is not its end."""
    from ftmaster.launch import check_layout
    from ftmaster.recovery.batch_schedule import change_global_batch
    from test_launch_parts import MODEL

    command = [*MODEL, "--train-iters", "10"]
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(command), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(command, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    supervisor.attempt = FakeAttempt()
    supervisor._training_command = change_global_batch(command, 12, 8)
    assert "--train-iters" not in supervisor._training_command
    runfiles.append_event(tmp_path, "periodic_save", kind="periodic", iteration=10)
    supervisor._follow_events()
    assert supervisor._schedule_saved is None
    # the periodic save at the last iteration of --train-samples, as the trainer says it is
    runfiles.append_event(tmp_path, "periodic_save", kind="periodic", iteration=14,
                          ends_schedule=True)
    supervisor._follow_events()
    assert supervisor._schedule_saved == 14


def test_a_fault_on_a_retired_gpu_is_not_injected_nor_recorded(tmp_path):
    from ftmaster.faults import parse_injection
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    supervisor.retired[1] = "lost (device_lost)"
    assert supervisor._apply(parse_injection("fail:gpu=1,at=iter:8"))  # consumed: nothing to do
    assert 1 not in supervisor.injected_lost and runfiles.read_events(tmp_path) == []


@pytest.mark.parametrize("code, carried", [(95, True), (13, False)])
def test_only_an_xid_that_needs_a_reset_fails_the_ranks_started_on_its_gpu_later(tmp_path, code,
                                                                                 carried):
    """An application XID blames the program: the relaunch on that GPU runs (it ended runs as
    'fix the script' after two start-up failures)."""
    from ftmaster.faults import parse_injection
    from ftmaster.launch import check_layout
    from ftmaster.monitor.health import HealthConfig
    from test_launch_parts import MODEL

    class HealthyMonitor(QuietMonitor):
        health = HealthConfig()
        pending_injections: list = []

    command = (PRETRAIN, *MODEL[1:])  # the trainer, whose handler the XID's error needs
    config = SupervisorConfig(run_dir=tmp_path, command=command, gpus=(0, 1, 2, 3),
                              first_plan=check_layout(list(command), 4, None, None),
                              injections=(parse_injection(f"xid:gpu=1,code={code},at=iter:8"),))
    supervisor = Supervisor(config, HealthyMonitor())
    assert supervisor._apply(config.injections[0])  # no attempt running: its GPU's state only
    env = supervisor._armed_injections((0, 1, 2, 3))
    assert ("1:" + str(code) in env.get("FTMASTER_INJECT_CUDA_ERROR", "")) == carried


@pytest.mark.parametrize("heartbeat, resumed", [
    ({"iteration": 12, "first_iteration": 11}, 11),
    ({"iteration": 8, "first_iteration": 9, "finished": True}, None),  # loaded the last: trained none
])
def test_a_relaunch_resumes_at_its_first_iteration_only_if_it_trained_one(tmp_path, heartbeat, resumed):
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    supervisor.attempt, supervisor._progress = FakeAttempt(), (None, 0.0)
    assert supervisor._track_progress(heartbeat) == heartbeat["iteration"]
    found = [e["iteration"] for e in runfiles.read_events(tmp_path) if e["event"] == "resumed"]
    assert found == ([] if resumed is None else [resumed])


class CleanExitAttempt(RankEndingAttempt):
    """Its ranks all ended with status 0, and torchrun too."""

    log_path = None

    def exit_code(self):
        return 0

    def failed_ranks(self):
        return {}


def clean_exit_supervisor(tmp_path, finished):
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, FailingMonitor())
    supervisor.attempt = CleanExitAttempt()
    if finished is not None:
        runfiles.write_heartbeat(tmp_path, 69, 276, finished=finished)
    return supervisor


@pytest.mark.parametrize("finished, outcome", [(True, "complete"), (None, "complete"),
                                               (False, "failure")])
def test_a_clean_exit_is_complete_only_when_training_says_it_finished(tmp_path, caplog, finished,
                                                                      outcome):
    """A rank signalled from outside makes the ranks save and exit 0 before the end of the
    schedule: that is resumed, not a success (a script without heartbeats is believed)."""
    from ftmaster.states import Trigger

    supervisor = clean_exit_supervisor(tmp_path, finished)
    trigger = supervisor._check_training()
    assert trigger is (Trigger.COMPLETED if outcome == "complete" else Trigger.FAILURE)
    assert runfiles.read_events(tmp_path)[-1]["event"] == outcome
    if outcome == "failure":
        assert "on a signal ftmaster did not send, before the end of its schedule" in caplog.text
        assert supervisor._decide() is Trigger.RETRY  # resumed from its exit checkpoint


def test_a_give_up_lists_the_runs_failures_and_quotes_no_log_when_ftmaster_ended_them(
        tmp_path, caplog):
    """A lost GPU is ftmaster's finding, not a rank's: the give-up names every failure of the
    run in one line, and no training output stands in for a rank's error."""
    from ftmaster.launch import check_layout
    from ftmaster.states import Trigger
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), max_restarts=0)
    supervisor = Supervisor(config, FailingMonitor())
    supervisor.attempt = RankEndingAttempt()
    supervisor.attempt.root_cause = lambda rank, lines: "iteration 3/400 | an ordinary line"
    supervisor.attempt.stated_errors = lambda: None  # the trainer said nothing of its own
    supervisor._failure("device_lost", 30, [1], {})
    assert supervisor._decide() is Trigger.GIVE_UP
    assert "the run's failures: attempt 1 failed (device_lost) after iteration 30 on GPU 1" \
        in caplog.text
    assert "root cause" not in caplog.text and "an ordinary line" not in caplog.text
    assert "root_cause" not in runfiles.read_events(tmp_path)[-1]  # nor for the report


class ResetNeededMonitor(FailingMonitor):
    """GPU 0 needs a reset (the XID its rank raised): it is never planned on again."""

    def unschedulable_gpus(self):
        return {0: "xid_79"}

    def exclude_gpus(self, gpus):
        pass


def test_a_failure_no_layout_is_left_for_ends_the_run_with_its_root_cause(tmp_path, caplog):
    """A rank's XID took its GPU out and the 3 GPUs left fit no layout (2.53 GiB each): that
    give-up, from planning rather than from the failure's own decision, neither said the
    rank's error on the console nor kept it for the report."""
    from ftmaster.launch import check_layout
    from ftmaster.states import Trigger
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), gpu_memory_gb=2.53)
    supervisor = Supervisor(config, ResetNeededMonitor())
    supervisor.attempt = RankEndingAttempt()
    said = "local rank 0 (GPU 0) raised RuntimeError: CUDA error: uncorrectable ECC error"
    supervisor.attempt.root_cause = lambda rank, lines: said
    supervisor.attempt.log_path = tmp_path / "attempt_1.log"
    supervisor.progress = Progress(supervisor.attempt.log_path, 10, 0)
    assert supervisor._check_training() is Trigger.FAILURE
    assert supervisor._decide() is Trigger.RETRY
    assert supervisor._plan() is Trigger.NO_LAYOUT
    gave_up = runfiles.read_events(tmp_path)[-1]
    assert (gave_up["event"], gave_up.get("root_cause")) == ("gave_up", said)
    assert "the run's failures: attempt 1 failed (exit)" in caplog.text
    assert f"root cause, from {supervisor.attempt.log_path}:\n{said}" in caplog.text


class RelaunchingMonitor(FailingMonitor):
    def watch(self, gpus):
        pass


def test_a_relaunch_that_cannot_start_gives_up_on_the_failure_in_one_line(
        tmp_path, monkeypatch, caplog):
    """A run directory out of room (or quota) refuses the new attempt's folder: the OSError
    was a traceback out of the supervisor, the failure it was to resume from unsaid."""
    import errno
    import os

    from ftmaster import supervisor as supervisor_module
    from ftmaster.launch import check_layout
    from ftmaster.states import State, Trigger, advance
    from test_launch_parts import MODEL

    def out_of_room(run_dir, number, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run_dir / "ranks"))

    monkeypatch.setattr(supervisor_module, "Attempt", out_of_room)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, RelaunchingMonitor())
    supervisor.attempt = RankEndingAttempt()
    supervisor.attempt.root_cause = lambda rank, lines: "local rank 0 (GPU 0) raised OSError"
    supervisor.attempt.log_path = tmp_path / "attempt_1.log"
    assert supervisor._check_training() is Trigger.FAILURE
    assert supervisor._decide() is Trigger.RETRY
    assert advance(State.RELAUNCHING, supervisor._launch()) is State.GAVE_UP
    gave_up = runfiles.read_events(tmp_path)[-1]
    assert gave_up["event"] == "gave_up" and gave_up["root_cause"].endswith("raised OSError")
    assert "attempt 2 could not start: [Errno 28] No space left on device" in gave_up["reason"]


def test_a_run_directory_gone_read_only_gives_up_without_a_requeue(tmp_path, monkeypatch):
    """Clearing the last attempt's heartbeat raised EROFS out of the supervisor, a traceback;
    and a run directory that cannot take files gave up with exit 1, which a requeue repeats."""
    import errno

    from ftmaster.launch import check_layout
    from ftmaster.states import State, advance
    from test_launch_parts import MODEL

    def read_only(self):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Supervisor, "_clear_previous_attempt", read_only)
    monkeypatch.setattr(runfiles, "room_problem", lambda run_dir: f"{run_dir} is on a read-only filesystem")
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, RelaunchingMonitor())
    assert advance(State.RELAUNCHING, supervisor._launch()) is State.GAVE_UP
    gave_up = runfiles.read_events(tmp_path)[-1]
    assert gave_up["requeue"] is False
    assert gave_up["reason"] == f"attempt 1 could not start: {tmp_path} is on a read-only filesystem"


def test_a_save_folder_that_cannot_be_read_at_a_relaunch_gives_up_in_one_line(tmp_path,
                                                                            monkeypatch):
    """Looking into --save for the relaunch to resume from raised ESTALE (an NFS mount gone
    stale) out of the supervisor's main loop: a traceback."""
    import errno
    import types

    from ftmaster import supervisor as supervisor_module
    from ftmaster.launch import check_layout
    from ftmaster.states import State, advance
    from test_launch_parts import MODEL

    def stale(folder):
        raise OSError(errno.ESTALE, "Stale file handle", str(folder))

    monkeypatch.setattr(supervisor_module, "holds_checkpoints", stale)
    command = (*MODEL, "--save", str(tmp_path / "ckpt"))
    config = SupervisorConfig(run_dir=tmp_path, command=command, gpus=(0, 1, 2, 3),
                              first_plan=check_layout(list(command), 4, None, None))
    supervisor = Supervisor(config, RelaunchingMonitor())
    supervisor.attempt = types.SimpleNamespace(number=1)
    assert advance(State.RELAUNCHING, supervisor._launch()) is State.GAVE_UP
    gave_up = runfiles.read_events(tmp_path)[-1]
    assert gave_up["requeue"] is True
    assert gave_up["reason"] == (f"attempt 2 could not start: its checkpoint folders cannot be "
                                 f"read: [Errno 116] Stale file handle: '{tmp_path / 'ckpt'}'")

def test_a_signal_where_nothing_trains_is_recorded_as_the_runs_end(tmp_path):
    from ftmaster.launch import check_layout
    from ftmaster.states import State
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, FailingMonitor())
    supervisor.request_stop(15)
    supervisor._handlers[State.STARTING] = lambda: pytest.fail("nothing should be launched")
    supervisor.run()
    stopped = runfiles.read_events(tmp_path)[-1]
    assert (stopped["event"], stopped["signal"], stopped["state"]) == ("stopped", 15, "starting")


class UnstoppableAttempt(FinishedAttempt):
    def stop(self, deadline_s):
        return None  # killed at the deadline, nothing saved


def test_a_stop_cut_short_at_its_deadline_says_so(tmp_path, caplog):
    from ftmaster.launch import check_layout
    from ftmaster.states import Trigger
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), stop_timeout_s=2.0)
    supervisor = Supervisor(config, FailingMonitor())
    supervisor.attempt, supervisor.signum = UnstoppableAttempt(), 15
    runfiles.append_event(tmp_path, "periodic_save", iteration=40, kind="periodic", tier="disk")
    supervisor._follow_events()
    assert supervisor._stop() is Trigger.STOPPED
    assert ("training did not save and exit within --stop-timeout 2 s: killed; the newest "
            "checkpoint is iteration 40 (disk)") in caplog.text
    stopped = runfiles.read_events(tmp_path)[-1]
    assert (stopped["event"], stopped["exit_code"]) == ("stopped", None)


def test_a_rank_killed_by_a_signal_is_the_root_cause_not_the_peer_it_left(tmp_path):
    """The output's last error is rank 0's lost connection: it says nothing of rank 1's end."""
    attempt = Attempt.__new__(Attempt)
    attempt.gpus, attempt.rank_dir = (4, 5), tmp_path / "ranks"
    attempt.log_path = tmp_path / "attempt_1.log"
    attempt.log_path.write_text("RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: "
                                "Connection reset by peer\n")
    attempt.rank_dir.mkdir()
    write_rank_record(attempt.rank_dir, {**record(1, -9, 5.0).__dict__})
    assert attempt.root_cause(1, 20) == (
        "local rank 1 (GPU 5) was killed by SIGKILL without an error of its own (the OOM killer, "
        "a user, a failing node); the others lost it")
    assert "Connection reset by peer" in attempt.root_cause(0, 20)  # alive: its output speaks


def test_the_root_cause_of_many_failed_saves_ends_with_the_error_that_ended_training(tmp_path):
    """A --save that filled up for a while: the first failed saves said an older newest
    checkpoint; the line that ended the run (its last save failed) must be shown too."""
    attempt = Attempt.__new__(Attempt)
    attempt.gpus, attempt.rank_dir = (0, 1), tmp_path / "ranks"
    attempt.log_path = tmp_path / "attempt_1.log"
    failed = [f"error: periodic checkpoint at iteration {it} not saved: ENOSPC; the newest "
              f"checkpoint is still iteration {4 if it < 22 else 30}" for it in (6, 8, 10, 12, 40)]
    last = "error: training ended at iteration 40 without its last checkpoint: ENOSPC"
    attempt.log_path.write_text("\n".join([*failed, "iteration 40/40", last]) + "\n")
    said = attempt.root_cause(None, 20).splitlines()
    assert said[:3] == failed[:3]
    assert said[-1] == last
    assert said[3] == "... (2 more error line(s) in the log)"
    assert attempt.stated_errors() == "\n".join(said)


@pytest.mark.parametrize("finished, state, trigger", [
    (True, "running", "completed"), (False, "running", "store_lost"),
    (True, "planning", "store_lost")])  # a heartbeat left by an attempt that is over
def test_a_lost_rendezvous_after_training_finished_is_the_jobs_end_not_a_requeue(
        tmp_path, finished, state, trigger):
    """The store's host stalled while this node's ranks saved their final checkpoint: the
    node asked for a requeue of a job that had completed."""
    from ftmaster.launch import check_layout
    from ftmaster.membership import StoreLost
    from ftmaster.states import State
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    runfiles.write_heartbeat(tmp_path, iteration=100, consumed_samples=0, finished=finished)
    assert supervisor._store_lost(StoreLost("the store is gone"), State(state)).value == trigger
    ends = [e for e in runfiles.read_events(tmp_path) if e["event"] == "complete"]
    assert all("on_other_nodes" not in e for e in ends)  # this node trained to the end


@pytest.mark.parametrize("on_disk, trigger", [(40, "completed"), (30, "store_lost")])
def test_a_lost_rendezvous_with_the_schedules_last_checkpoint_on_disk_is_the_jobs_end(
        tmp_path, on_disk, trigger):
    """A node started again (its ftmaster killed) joined while the other node completed the
    job and exited with the store: it asked for a requeue (exit 75) of a job whose final
    checkpoint was durable on the shared --save."""
    from ftmaster.launch import check_layout
    from ftmaster.membership import StoreLost
    from ftmaster.recovery.checkpoints import tracker_path
    from test_checkpoint_discovery import write_checkpoint
    from ftmaster.states import State
    from test_launch_parts import MODEL

    save = tmp_path / "ckpt"
    command = (*MODEL, "--train-iters", "40", "--save", str(save))
    config = SupervisorConfig(run_dir=tmp_path / "run", command=command, gpus=(0, 1, 2, 3),
                              first_plan=check_layout(list(command), 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    write_checkpoint(save, on_disk)  # whole: a load would take it
    tracker_path(save).write_text(str(on_disk))
    assert supervisor._store_lost(StoreLost("the store is gone"), State.PLANNING).value == trigger
    if trigger == "completed":  # recorded as a node that waited records the job's end
        (ended,) = [e for e in runfiles.read_events(tmp_path / "run") if e["event"] == "complete"]
        assert (ended["iteration"], ended.get("on_other_nodes")) == (40, True)


@pytest.mark.parametrize("state", ["standby", "planning"])
def test_a_lost_rendezvous_after_a_stop_signal_is_the_stop_not_a_requeue(tmp_path, state):
    """scancel and a time limit signal every node: the store's host, no longer waiting for
    the others' word, may exit first, and a spare's read of the store in flight then failed:
    'store_lost' and exit 75, which the SLURM wrapper answers with a requeue of the job just
    cancelled."""
    import signal

    from ftmaster.launch import check_layout
    from ftmaster.membership import StoreLost
    from ftmaster.states import State, advance, exit_status
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    supervisor.request_stop(signal.SIGTERM)
    trigger = supervisor._store_lost(StoreLost("the store is gone"), State(state))
    assert exit_status(advance(State(state), trigger), supervisor.signum) == 143
    stopped = runfiles.read_events(tmp_path)[-1]
    assert (stopped["event"], stopped["state"]) == ("stopped", state)


class StoreGoneMembership:
    """The store's host exited: every store call fails."""

    def announce_failure(self, cause, stop=None):
        from ftmaster.membership import StoreLost

        raise StoreLost("the store is gone")


class CrashingInTheStopAttempt(RankEndingAttempt):
    """Its rank 0 crashes (status 3) as the stop's SIGTERM asks it to save."""

    stops = 0

    def stop(self, deadline_s):
        self.stops, self.ended = self.stops + 1, True
        return 1


def signalled_at_launch(tmp_path, membership):
    """A supervisor on 4 GPUs whose first launch is an attempt crashing in its stop, with a
    SIGTERM at once; its membership made by ``membership()``."""
    from ftmaster.launch import check_layout
    from ftmaster.states import State, Trigger
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, FailingMonitor())
    supervisor.membership = membership()
    attempt = CrashingInTheStopAttempt()

    def launched():
        supervisor.attempt = attempt
        supervisor.request_stop(signal.SIGTERM)
        return Trigger.LAUNCHED

    supervisor._handlers[State.PLANNING] = lambda: Trigger.PLANNED
    supervisor._handlers[State.RELAUNCHING] = launched
    return supervisor, attempt


def test_a_rendezvous_lost_while_training_stops_on_a_signal_ends_as_the_stop_not_a_requeue(
        tmp_path):
    """scancel signals every node; the store's host exits first, and a rank crashing during
    the stop had ftmaster announce its failure on a store that is gone: 'store_lost' and
    exit 75, which the SLURM wrapper answers with a requeue of the job just cancelled."""
    supervisor, attempt = signalled_at_launch(tmp_path, lambda: StoreGoneMembership())
    assert supervisor.run() == 128 + signal.SIGTERM
    assert attempt.stops == 1  # the ranks were asked to save and exit, not just killed
    events = [e["event"] for e in runfiles.read_events(tmp_path)]
    assert events[-1] == "stopped" and "store_lost" not in events


def test_a_failure_announced_during_a_stop_on_a_store_that_hangs_ends_as_the_stop_at_once(
        tmp_path):
    """The store's host blackholed (no reset comes) as scancel signalled every node: the
    announce of a rank's crash during the stop waited out the store's timeout (read_timeout
    + 5 s, 65 s by default) twice, far past SLURM's grace period before its SIGKILL."""
    import threading
    from types import SimpleNamespace

    from ftmaster.membership import NodeMembership, RendezvousConfig, Round

    cut = threading.Event()

    def hanging_membership():
        membership = NodeMembership(
            RendezvousConfig("127.0.0.1:1", "job", 1, 2, 1, local_addr="127.0.0.1",
                             conf={"read_timeout": "1"}), connect=False)
        membership._round = Round(1, (), 0)
        membership._round_store = SimpleNamespace(underlying_store=SimpleNamespace(
            add=lambda key, value: cut.wait()))
        return membership

    supervisor, attempt = signalled_at_launch(tmp_path, hanging_membership)
    started = time.monotonic()
    try:
        assert supervisor.run() == 128 + signal.SIGTERM
        assert time.monotonic() - started < 3.0
    finally:
        cut.set()
    assert attempt.stops == 1
    assert runfiles.read_events(tmp_path)[-1]["event"] == "stopped"


class TrainingAttempt(FinishedAttempt):
    """Trains until its stop, which it saves for and exits 0 on."""

    stops, stuck_gpus = 0, {}

    def stop(self, deadline_s):
        self.stops += 1
        return 0


def cut_off_membership(cut):
    """Node 1 of a round of 3 on a store no packet reaches: every call waits for ``cut``."""
    from ftmaster.membership import NodeMembership, NodeRecord, RendezvousConfig, Round

    import torch.distributed.elastic.rendezvous  # noqa: F401 (loaded, as in a running ftmaster)

    def hang(*args):
        return cut.wait()

    membership = NodeMembership(RendezvousConfig("127.0.0.1:1", "job", 1, 3, 1,
                                                 local_addr="127.0.0.1",
                                                 conf={"read_timeout": "1"}), connect=False)
    membership._round = Round(1, tuple(NodeRecord(r, "127.0.0.1", (0, 1), 1) for r in range(3)), 1)
    membership._round_store = SimpleNamespace(underlying_store=SimpleNamespace(
        add=hang, set=hang, get=hang, check=hang))
    membership.handler = SimpleNamespace(num_nodes_waiting=hang)
    return membership


@pytest.mark.parametrize("replicated", [False, True])
def test_a_stop_signal_while_trainings_poll_of_a_hung_store_waits_stops_the_ranks_at_once(
        tmp_path, replicated):
    """The store's host blackholed (a cut link, no reset) while training ran: each poll of
    the peers and of the memory agreement waited out the store's timeout (read_timeout + 5 s,
    65 s by default) before a SIGTERM was acted on. SLURM's SIGKILL, 30 s after it, came
    first: the ranks were never asked to save, and nothing recorded the stop."""
    import threading

    from ftmaster.launch import check_layout
    from ftmaster.replication import ReplicationConfig
    from ftmaster.states import State, Trigger
    from test_launch_parts import MODEL

    cut = threading.Event()
    membership = cut_off_membership(cut)
    replication = SimpleNamespace(config=ReplicationConfig(tmp_path / "memory", tmp_path, 1),
                                  take_results=list, close=lambda: None) if replicated else None
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, FailingMonitor(), membership, replication=replication)
    attempt, signalled_at = TrainingAttempt(), []

    def launched():
        supervisor.attempt, supervisor.round = attempt, membership._round
        supervisor._progress = (None, time.monotonic())
        threading.Timer(0.3, lambda: (signalled_at.append(time.monotonic()),
                                      supervisor.request_stop(signal.SIGTERM))).start()
        return Trigger.LAUNCHED

    supervisor._handlers[State.PLANNING] = lambda: Trigger.PLANNED
    supervisor._handlers[State.RELAUNCHING] = launched
    try:
        assert supervisor.run() == 128 + signal.SIGTERM
        assert time.monotonic() - signalled_at[0] < 1.5
    finally:
        cut.set()
    assert attempt.stops == 1  # asked to save and exit
    events = [e["event"] for e in runfiles.read_events(tmp_path)]
    assert events[-1] == "stopped" and "store_lost" not in events


def test_a_stop_signal_while_the_merger_says_it_merges_nothing_on_a_hung_store_ends_it_at_once(
        tmp_path):
    """Rank 0's node, with no dumps of its own after a failed round, tells the others at once
    that it merges nothing: on a store no packet reaches that word took no stop, and a
    SIGTERM during it waited out the store's timeout (65 s by default), past SLURM's grace."""
    import threading

    from ftmaster.launch import check_layout
    from ftmaster.monitor.backends.bounded import Abandoned
    from test_launch_parts import MODEL

    cut = threading.Event()
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor(), cut_off_membership(cut))
    supervisor.replicas = SimpleNamespace()  # --replica-recovery
    signalled_at = []
    threading.Timer(0.3, lambda: (signalled_at.append(time.monotonic()),
                                  supervisor.request_stop(signal.SIGTERM))).start()
    try:
        with pytest.raises(Abandoned):
            supervisor._merge_dumps_across_nodes(None, True, supervisor.membership._round)
        assert time.monotonic() - signalled_at[0] < 1.0
    finally:
        cut.set()


def test_dumps_without_a_cut_are_removed_after_the_kill_not_before(tmp_path, monkeypatch):
    """No merge starts when the reports hold no cut; a rank still writing its dump (stopped
    waiting for, or past the dump timeout) until the kill left its folder in /dev/shm when
    the dumps were removed before the kill."""
    from ftmaster.launch import check_layout
    from ftmaster.replica_recovery import ReplicaRecovery
    from ftmaster.states import Trigger
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, FailingMonitor())
    dumps = tmp_path / "memory" / "replicas" / "attempt_1"
    late = dumps / "rank_2" / "__0_0.distcp"

    class LateWriterAttempt(RankEndingAttempt):
        def kill(self):  # rank 2 wrote on until it was killed
            late.parent.mkdir(parents=True, exist_ok=True)
            late.write_bytes(bytes(64))

    supervisor.attempt = LateWriterAttempt()
    dumps.mkdir(parents=True)
    recovery = supervisor.replicas = ReplicaRecovery(tmp_path, tmp_path / "memory",
                                                     tmp_path / "save", supervisor._event)
    monkeypatch.setattr(recovery, "dump_if_useful", lambda *args: dumps)
    assert supervisor._failure("exit", 16, [0], {"0": 3}) is Trigger.FAILURE
    assert not dumps.exists()
    (fallback,) = [e for e in runfiles.read_events(tmp_path) if e["event"] == "replica_fallback"]
    assert fallback["reason"] == "no survivor reported"


def test_a_stop_signal_during_a_replica_merge_ends_it_at_once(tmp_path, monkeypatch):
    """--replica-recovery on one node: a SIGTERM while the merge of the failed attempt's dumps
    ran was heard only once the merge ended or its timeout (300 s) passed; SLURM SIGKILLs
    ftmaster long before. The merge is killed and cleaned up, and the run ends as the stop."""
    import subprocess
    import sys
    import threading

    from ftmaster import replica_recovery
    from ftmaster.launch import check_layout
    from ftmaster.replica_recovery import Merging, ReplicaRecovery
    from ftmaster.states import State, Trigger, advance
    from test_launch_parts import MODEL

    monkeypatch.setattr(replica_recovery, "MERGE_TIMEOUT_S", 5.0)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, FailingMonitor())
    supervisor.attempt = RankEndingAttempt()
    dumps = tmp_path / "memory" / "replicas" / "attempt_1"
    dumps.mkdir(parents=True)
    merge = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    recovery = supervisor.replicas = ReplicaRecovery(tmp_path, tmp_path / "memory",
                                                     tmp_path / "save", supervisor._event)
    monkeypatch.setattr(recovery, "dump_if_useful", lambda *args: dumps)
    monkeypatch.setattr(recovery, "start_merge",
                        lambda folder, stop: Merging(folder, merge, 0.0))
    threading.Timer(0.3, supervisor.request_stop, (signal.SIGTERM,)).start()
    started = time.monotonic()
    assert supervisor._failure("exit", 16, [0], {"0": 3}) is Trigger.FAILURE
    assert time.monotonic() - started < 3.0
    assert merge.poll() is not None and not dumps.exists()  # killed, its dumps removed
    # FAILED, where nothing trains, then ends the run as the stop
    assert advance(State.FAILED, supervisor._stopped_idle(State.FAILED)) is State.INTERRUPTED
    events = [e["event"] for e in runfiles.read_events(tmp_path)]
    assert events[-2:] == ["failure", "stopped"] and "replica_merge" not in events


def test_a_run_without_peer_copies_lets_go_of_the_marks_an_earlier_run_across_nodes_left(tmp_path):
    """Only peer copies move ``.ftmaster_whole`` and ``.ftmaster_replicated``: left by an
    earlier run in a memory folder given again, they would keep their checkpoint from every
    slot refill and pruning for good."""
    from ftmaster.recovery.checkpoints import (kept_memory_checkpoints, mark_replicated,
                                               mark_whole)
    from test_persist import fake_checkpoint

    memory = tmp_path / "shm"
    fake_checkpoint(memory, 8)
    fake_checkpoint(memory, 10)
    assert mark_whole(memory, 8) and mark_replicated(memory, 8)
    memory_tier_supervisor(tmp_path, memory, tmp_path / "ckpt", scratch=False)
    assert 8 not in kept_memory_checkpoints(memory)


def test_a_look_at_a_save_folder_that_never_answers_is_a_hang_only_after_the_hang_timeout(
        tmp_path, monkeypatch):
    """An idle attempt is hung unless a checkpoint file is being written. The look must not
    hold up the supervisor (which could then neither relaunch nor give up), but slow is not
    stopped: a save loading a parallel file system slows the listing of its own shards, and
    one look past 5 s killed it as hung mid-save. No answer counts as a write as long ago as
    the looks went unanswered."""
    import threading
    import time

    from ftmaster import supervisor as supervisor_module
    from ftmaster.launch import check_layout
    from ftmaster.supervisor import is_hung
    from test_launch_parts import MODEL

    answered = threading.Event()
    monkeypatch.setattr(supervisor_module, "CHECKPOINT_LOOK_S", 0.05)
    monkeypatch.setattr(supervisor_module, "last_checkpoint_write",
                        lambda folder: answered.wait() and time.time())
    command = (*MODEL, "--save", str(tmp_path / "save"))
    config = SupervisorConfig(run_dir=tmp_path / "run", command=command, gpus=(0, 1, 2, 3),
                              first_plan=check_layout(command, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    started = time.monotonic()
    first = supervisor._seconds_since_checkpoint_write()
    assert first is not None and not is_hung(301.0, 300.0, first)
    later = time.monotonic() + 301.0
    monkeypatch.setattr(supervisor_module.time, "monotonic", lambda: later)
    assert is_hung(301.0, 300.0, supervisor._seconds_since_checkpoint_write())  # no look queued
    monkeypatch.undo()
    assert time.monotonic() - started < 1.0
    answered.set()


def test_the_end_of_the_run_says_it_waits_for_a_slow_persist_copy(tmp_path, monkeypatch, caplog):
    """The run's end waits for the last copy to --save, with no limit (the memory tier is
    the node's RAM): on a slow or hung mount ftmaster sat there without a word."""
    import threading

    from ftmaster import persist as persist_module
    from ftmaster import supervisor as supervisor_module
    from ftmaster.recovery.checkpoints import read_tracker
    from test_persist import fake_checkpoint

    memory, disk = tmp_path / "shm", tmp_path / "ckpt"
    fake_checkpoint(memory, 4)
    released = threading.Event()
    copy = persist_module.persist
    monkeypatch.setattr(persist_module, "persist",
                        lambda *args, **kwargs: released.wait(30) and copy(*args, **kwargs))
    monkeypatch.setattr(supervisor_module, "PERSIST_WAIT_NOTICE_S", 0.2)
    supervisor = memory_tier_supervisor(tmp_path, memory, disk)
    threading.Timer(0.5, released.set).start()
    with caplog.at_level("WARNING", logger="ftmaster"):
        supervisor._finish_persisting()
    waits = [r.getMessage() for r in caplog.records if "still copying" in r.getMessage()]
    assert waits and f"iteration 4 is on disk in {disk}" in waits[0]
    assert read_tracker(disk) == 4


@pytest.mark.parametrize("heartbeat, again", [(25, False), (15, True), (None, True)])
def test_an_armed_slow_the_killed_run_reached_is_not_armed_again(tmp_path, heartbeat, again):
    """Killed with its supervisor at iteration 25, its last event a save at 10: the attempt
    got past the slowdown armed at 20, yet the ftmaster started again on the run directory
    armed it a second time (its events alone reach 10)."""
    from ftmaster.faults import parse_injection
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL

    spec = "slow:gpu=1,factor=2,at=iter:20"
    runfiles.append_event(tmp_path, "launch", attempt=1, gpus=[0, 1, 2, 3])
    runfiles.append_event(tmp_path, "fault_injected", kind="slow", gpu=1, spec=spec,
                          iteration=20, armed=True)
    runfiles.append_event(tmp_path, "periodic_save", iteration=10)
    if heartbeat is not None:
        runfiles.write_heartbeat(tmp_path, heartbeat, heartbeat * 4)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None),
                              injections=(parse_injection(spec),))
    supervisor = Supervisor(config, QuietMonitor())  # takes the run directory over
    assert bool(supervisor._armed_injections((0, 1, 2, 3))) == again


def test_the_original_layouts_step_is_carried_over_from_the_ftmaster_before(tmp_path):
    """Started again on a layout shrunk by carried-over retirements, a supervisor never runs
    the original layout: with its step only in the memory of the one killed, every straggler
    was kept with 'no step of the original layout measured'."""
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL

    runfiles.append_event(tmp_path, "plan", original_step_s=None)
    runfiles.append_event(tmp_path, "plan", original_step_s=0.61)
    runfiles.append_event(tmp_path, "plan", original_step_s="fast")
    runfiles.append_event(tmp_path, "launch", attempt=2, gpus=[0, 1, 2])
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, QuietMonitor())
    assert supervisor._original_step_s == 0.61
    supervisor.plan = config.first_plan
    supervisor._plan_event([0, 1, 2])
    assert runfiles.read_events(tmp_path)[-1]["original_step_s"] == 0.61


@pytest.mark.parametrize("gap, hung", [(500.0, False), (1.0, True)])
def test_a_suspended_job_is_no_hang_at_its_resume(tmp_path, gap, hung):
    """scontrol suspend stops every process of the step, ftmaster with it; at the resume the
    monotonic clock had run on, and a suspension past --hang-timeout was a hang."""
    from ftmaster.launch import check_layout
    from test_launch_parts import MODEL

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), hang_timeout_s=600)
    supervisor = Supervisor(config, QuietMonitor())
    now = time.monotonic()
    supervisor._progress, supervisor._polled_at = (5, now - 1000.0), now - gap
    assert supervisor._hung() is hung


def test_a_failed_attempts_copy_that_could_not_start_is_due_at_the_next_poll(tmp_path, monkeypatch):
    """An attempt failed while the copy of an older checkpoint was under way: "at once" was
    forgotten, and the newest waited a whole --save-interval of time."""
    import threading

    from ftmaster import persist as persist_module
    from ftmaster.recovery.checkpoints import read_tracker
    from test_persist import fake_checkpoint

    memory, disk = tmp_path / "shm", tmp_path / "ckpt"
    supervisor = memory_tier_supervisor(tmp_path, memory, disk, save_interval=500)
    supervisor.progress = SimpleNamespace(seconds_per_iteration=1.0)  # due every 500 s
    released, copy = threading.Event(), persist_module.persist
    monkeypatch.setattr(persist_module, "persist",
                        lambda *args, **kwargs: released.wait(30) and copy(*args, **kwargs))
    fake_checkpoint(memory, 8, kind="emergency")
    supervisor._persist_when_due()
    assert supervisor.persister.busy
    fake_checkpoint(memory, 12, kind="periodic")
    supervisor._persist_when_due(now=True)  # the attempt failed
    released.set()
    supervisor.persister.wait(10)
    supervisor._persist_when_due()
    assert supervisor.persister.last_requested == 12
    supervisor.persister.wait(10)
    assert read_tracker(disk) == 12


def test_the_end_of_the_run_copies_its_newest_when_the_look_at_save_is_stuck(tmp_path, monkeypatch):
    """The shared look at --save was stuck on an earlier slow read: the end of the run left
    its newest checkpoint in RAM alone, with no copy, no event, no line."""
    import threading

    from ftmaster import persist as persist_module
    from ftmaster import supervisor as supervisor_module
    from ftmaster.recovery.checkpoints import read_tracker
    from test_persist import fake_checkpoint

    memory, disk = tmp_path / "shm", tmp_path / "ckpt"
    fake_checkpoint(memory, 12, kind="emergency")
    monkeypatch.setattr(supervisor_module, "CHECKPOINT_LOOK_S", 0.2)
    supervisor = memory_tier_supervisor(tmp_path, memory, disk)
    stuck = threading.Event()
    with pytest.raises(supervisor_module.CallTimeout):
        supervisor._checkpoint_looks.call(0.1, stuck.wait, 30)
    try:
        supervisor._finish_persisting()
    finally:
        stuck.set()
    assert read_tracker(disk) == 12


def test_an_emergency_save_at_an_iteration_a_discarded_timeline_saved_is_copied_at_once(tmp_path):
    """The kind of each memory checkpoint was kept by iteration for the whole run: after a
    resume set iteration 8 aside, the new timeline's emergency save at 8 read as the old
    periodic one and waited a whole --save-interval of time."""
    from ftmaster.recovery.checkpoints import iteration_dir, read_tracker, set_tracker
    from test_persist import fake_checkpoint

    memory, disk = tmp_path / "shm", tmp_path / "ckpt"
    supervisor = memory_tier_supervisor(tmp_path, memory, disk, save_interval=500)
    supervisor.progress = SimpleNamespace(seconds_per_iteration=1.0)
    fake_checkpoint(memory, 4, kind="periodic")
    fake_checkpoint(memory, 8, kind="periodic")
    supervisor._persist_when_due()
    assert supervisor.persister.last_requested is None  # not due for 500 s
    shutil.rmtree(iteration_dir(memory, 8))  # a resume from 4 set it aside, then
    set_tracker(memory, 4)
    supervisor.persister.resumed_from(4)
    fake_checkpoint(memory, 8, kind="emergency")
    supervisor._persist_when_due()
    assert supervisor.persister.last_requested == 8
    supervisor.persister.wait(10)
    assert read_tracker(disk) == 8


def test_a_memory_tier_that_stopped_answering_does_not_hold_up_the_supervisor(tmp_path,
                                                                              monkeypatch):
    """The memory tier under --save on a network file system (launch's fallback when
    /dev/shm lacks room): its tracker was read on the supervisor's own thread at every poll,
    so a mount that stopped answering stopped hang detection and signal handling with it."""
    import os
    import threading
    import time

    from ftmaster import supervisor as supervisor_module
    from test_persist import fake_checkpoint

    memory, disk = tmp_path / "shm", tmp_path / "ckpt"
    fake_checkpoint(memory, 8)
    tracker = memory / "latest_checkpointed_iteration.txt"
    tracker.unlink()
    os.mkfifo(tracker)  # an open that never returns, as on a hung mount
    monkeypatch.setattr(supervisor_module, "CHECKPOINT_LOOK_S", 0.2)
    supervisor = memory_tier_supervisor(tmp_path, memory, disk)
    poll = threading.Thread(target=supervisor._persist_when_due, daemon=True)
    started = time.monotonic()
    poll.start()
    poll.join(5)
    answered = not poll.is_alive()
    writer = os.open(tracker, os.O_WRONLY | os.O_NONBLOCK)  # lets the stuck look go
    os.write(writer, b"8\n")
    os.close(writer)
    assert answered and time.monotonic() - started < 5
