"""Pieces of ftmaster launch: GPU choice and mapping, argv, injections, listener, lock, guards."""

import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import click
import psutil
import pytest

from ftmaster import attempt as attempt_module
from ftmaster import runfiles
from ftmaster.attempt import Attempt, RankRecord, attempt_argv, gpu_of_local_rank, \
    read_rank_records, training_output_tail, wait_until_dead, with_exit_signal_handler
from ftmaster.faults import parse_injection
from ftmaster.guard import RANK_DIR_ENV
from ftmaster.launch import HeldFolders, _claim_checkpoint_folders, _job_identity, _replication, \
    check_layout
from ftmaster.listener import Listener, move_request
from ftmaster.recovery.argv_flags import flag_value
from ftmaster.lock import HOLDERS_DIR, HOLDERS_GUARD, RunDirLock, RunDirLocked, FolderClaim, FolderInUse
from ftmaster.states import State, Trigger
from ftmaster.supervisor import (Injector, Supervisor, SupervisorConfig, is_hung,
                                 last_checkpoint_write)
from helpers.trainer import wait_until

PY = sys.executable


# -- GPUs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("gpus,local_rank,gpu", [
    ((0, 1, 2, 3), 1, 1), ((0, 2, 3), 1, 2), ((0, 2, 3), 2, 3), ((4, 5), 0, 4)])
def test_local_rank_r_runs_on_the_r_th_gpu_of_its_attempt(gpus, local_rank, gpu):
    assert gpu_of_local_rank(gpus, local_rank) == gpu


def test_a_rank_outside_the_attempt_has_no_gpu():
    with pytest.raises(ValueError, match="local rank 3"):
        gpu_of_local_rank((0, 2, 3), 3)


def test_a_replayed_trace_without_some_of_the_jobs_gpus_says_which_at_launch(tmp_path, caplog):
    """GPUs 2 and 3 had no rows: never sampled, they read as healthy for the whole run."""
    from ftmaster.launch import _backend
    from test_monitor_replay import trace_of

    trace = trace_of(tmp_path, (0, 1, 9))
    with caplog.at_level("INFO", logger="ftmaster"):
        _backend(f"replay:{trace}", (0, 1, 2, 3), seed=0).close()
    assert caplog.messages == [
        f"--monitor-backend replay:{trace} records no row of GPUs 2, 3 of the job: their risk "
        "is unknown for the whole run (no alert can come from them), not healthy",
        f"--monitor-backend replay:{trace}: the rows of GPU 9 (not the job's) are not played"]


def test_a_replayed_trace_with_none_of_the_jobs_gpus_is_refused_at_launch(tmp_path):
    from ftmaster.launch import _backend
    from test_monitor_replay import trace_of

    trace = trace_of(tmp_path, (4, 5))
    with pytest.raises(click.ClickException, match=f"^{trace} records GPUs 4, 5, none of the job's"):
        _backend(f"replay:{trace}", (0, 1), seed=0)


# -- argv ------------------------------------------------------------------------------------
def test_attempt_argv_guards_torchrun_and_every_rank():
    assert attempt_argv(["train.py", "--lr", "1e-3"], 3, python="py", log_dir=Path("R/t")) == [
        "py", "-m", "ftmaster.guard", "exec",
        "py", "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--rdzv-conf", "",
        "--nproc-per-node", "3", "--max-restarts", "0", "--log-dir", "R/t",
        "-m", "ftmaster.guard", "rank", "train.py", "--lr", "1e-3"]


def test_exit_signal_handler_is_added_once():
    assert with_exit_signal_handler(["t.py", "--lr", "1"]) == ["t.py", "--lr", "1", "--exit-signal-handler"]
    assert with_exit_signal_handler(["t.py", "--exit-signal-handler", "--lr", "1"]) == \
        ["t.py", "--exit-signal-handler", "--lr", "1"]


TORCHRUN_REPORT = """\
E1122 12:29:39.075000 2314 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 3) local_rank: 0 (pid: 2319) of binary: /work/main/.venv/bin/python
Traceback (most recent call last):
""" + "  frame\n" * 30 + "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"


def test_the_tail_shown_on_a_user_error_is_the_scripts_not_torchruns():
    script_output = "".join(f"line {i}\n" for i in range(40)) + "boom: --lr is missing\n"
    assert training_output_tail(script_output + TORCHRUN_REPORT, 3) == \
        ["line 38", "line 39", "boom: --lr is missing"]
    assert training_output_tail(script_output, 2) == ["line 39", "boom: --lr is missing"]
    assert training_output_tail(TORCHRUN_REPORT, 5) == []


MODEL = ["t.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "12",
         "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def test_check_layout_accepts_the_scripts_own_layout():
    plan = check_layout(MODEL, 4, None, None)
    assert (plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size,
            plan.data_parallel_size, plan.num_gpus_used) == (2, 2, 1, 4)


def test_a_node_local_memory_folder_made_under_umask_002_is_taken_again_by_a_relaunch(tmp_path):
    """Across nodes the folder was made with the process's umask: under 002 (a user's private
    group) it was group-writable, so the relaunch refused it as maybe another user's, and the
    node's newest memory checkpoints were left behind."""
    from ftmaster.persist import with_memory_dir

    args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--vocab-size", "100", "--micro-batch-size", "1",
            "--non-persistent-ckpt-type", "global", "--save", str(tmp_path / "save")]
    shm = tmp_path / "shm"
    shm.mkdir()
    chosen, _ = with_memory_dir(args, tmp_path / "run", shm, node_rank=1)
    folder = Path(flag_value(chosen, "--non-persistent-global-ckpt-dir"))
    config = types.SimpleNamespace(scratch_memory_dir=folder, run_dir=tmp_path / "run")
    membership = types.SimpleNamespace(config=types.SimpleNamespace(node_rank=1),
                                       bind_host="127.0.0.1")
    held = types.SimpleNamespace(will_make=lambda folder: None)
    before = os.umask(0o002)
    try:
        replication = _replication(config, membership,
                                   {"memory_replicas": 1, "replication_rate": 100.0}, held)
    finally:
        os.umask(before)
    replication.close()
    assert with_memory_dir(args, tmp_path / "run", shm, node_rank=1)[0] == chosen


def test_a_node_local_memory_folder_that_cannot_be_made_is_one_line_at_launch(tmp_path):
    not_a_folder = tmp_path / "shm"
    not_a_folder.write_text("")
    config = types.SimpleNamespace(scratch_memory_dir=not_a_folder / "memory", run_dir=tmp_path)
    membership = types.SimpleNamespace(config=types.SimpleNamespace(node_rank=1),
                                       bind_host="127.0.0.1")
    held = types.SimpleNamespace(will_make=lambda folder: None)
    with pytest.raises(click.ClickException) as refused:
        _replication(config, membership, {"memory_replicas": 1, "replication_rate": 0.0}, held)
    assert refused.value.message == (f"cannot serve this node's memory tier from "
                                     f"{not_a_folder / 'memory'} (Not a directory)")


class StubMonitor:
    """The monitor's side of a drain: whether the GPU is still critical."""

    on_alert = None

    def __init__(self, critical):
        self.critical, self.excluded = critical, set()

    def still_critical(self, gpu):
        return self.critical

    def exclude_gpus(self, gpus):
        self.excluded |= set(gpus)

    def lost_gpus(self):
        return frozenset()

    def lost_reasons(self):
        return {}

    def unschedulable_gpus(self):
        return {}


class StubAttempt:
    killed = False
    stuck_gpus = {}

    def kill(self):
        self.killed = True


@pytest.mark.parametrize("critical, trigger", [(True, Trigger.DRAINED), (False, Trigger.RISK_CLEARED)])
def test_a_drain_restarts_without_the_gpu_only_while_its_risk_stays_critical(tmp_path, critical, trigger):
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), policy="drain")
    monitor = StubMonitor(critical)
    supervisor = Supervisor(config, monitor)
    supervisor.attempt = StubAttempt()
    supervisor._drain_gpu, supervisor._drain_since = 1, runfiles.append_event(tmp_path, "drain")["time"]
    assert supervisor._drained() is None  # no save yet: keep training
    runfiles.append_event(tmp_path, "emergency_save", iteration=9)
    assert supervisor._drained() is trigger
    assert (supervisor.attempt.killed, monitor.excluded) == ((True, {1}) if critical else (False, set()))


class StuckAttempt(StubAttempt):
    """A rank that outlives its kill (stuck in the kernel, holding its GPU)."""

    def kill(self):
        self.killed, self.stuck_gpus = True, {2: "process_stuck"}


@pytest.mark.parametrize("ends", ["drained", "killed with a rank stuck",
                                  "stopped by a signal with a rank stuck"])
def test_a_gpu_retired_before_a_plan_is_carried_over_by_the_next_supervisor(tmp_path, ends):
    """Retired, then no plan: the supervisor gave up (its restart budget spent), lost its
    store or was signalled first. A drained GPU, or one held by a rank stuck in the kernel,
    was recorded only by the next plan, so the next supervisor on this boot planned on it."""
    from ftmaster.retirements import carried_over

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), policy="drain")
    supervisor = Supervisor(config, StubMonitor(True))
    runfiles.append_event(tmp_path, "launch", attempt=1, gpus=[0, 1, 2, 3], boot="this-boot")
    if ends == "drained":
        supervisor.attempt = StubAttempt()
        supervisor._drain_gpu = 1
        supervisor._drain_since = runfiles.append_event(tmp_path, "drain")["time"]
        runfiles.append_event(tmp_path, "emergency_save", iteration=9)
        assert supervisor._drained() is Trigger.DRAINED
        expected = {1: "drained: its risk stayed critical after the emergency save"}
    elif ends == "killed with a rank stuck":
        supervisor.attempt = StuckAttempt()
        supervisor._kill_attempt()
        expected = {2: "process_stuck"}
    else:  # a SLURM preemption: the requeued ftmaster planned on the GPU still held
        supervisor.attempt = StuckWhenStopped()
        supervisor.request_stop(signal.SIGTERM)
        assert supervisor._stop() is Trigger.STOPPED
        expected = {2: "process_stuck"}
    assert supervisor.retired == expected
    assert carried_over(runfiles.read_events(tmp_path), "this-boot", (0, 1, 2, 3)) == expected

def test_a_drain_whose_save_was_trainings_last_lets_it_complete(tmp_path):
    """Killing it, then relaunching to train nothing, reported an iteration past the end."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), policy="drain")
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor.attempt = StubAttempt()
    supervisor._drain_gpu, supervisor._drain_since = 1, runfiles.append_event(tmp_path, "drain")["time"]
    runfiles.append_event(tmp_path, "emergency_save", iteration=40)
    runfiles.write_heartbeat(tmp_path, iteration=40, consumed_samples=0, finished=True)
    assert supervisor._drained() is None and not supervisor.attempt.killed


class StoppedAttempt(StubAttempt):
    """An attempt whose ranks had ended (or saved and exited) by the time it was stopped."""

    number = 1

    def stop(self, deadline_s):
        return 0

    def failed_ranks(self):
        return {}


class StuckWhenStopped(StoppedAttempt):
    """Killed at the stop's deadline, one rank outliving the SIGKILL."""

    def stop(self, deadline_s):
        self.stuck_gpus = {2: "process_stuck"}


@pytest.mark.parametrize("save, finished, trigger, event", [
    ({"iteration": 40, "kind": "final"}, True, Trigger.COMPLETED, "complete"),
    ({"iteration": 17, "kind": "exit"}, False, Trigger.STOPPED, "stopped"),
])
def test_a_signal_after_trainings_last_checkpoint_was_durable_completes_the_run(
        tmp_path, save, finished, trigger, event):
    """One that came before ftmaster saw training's exit reported the complete run stopped
    ('interrupted', exit status 143)."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, StubMonitor(False))
    supervisor.attempt = StoppedAttempt()
    supervisor.request_stop(signal.SIGTERM)
    runfiles.append_event(tmp_path, "periodic_save", tier="disk", **save)
    runfiles.write_heartbeat(tmp_path, iteration=save["iteration"], consumed_samples=0,
                             finished=finished)
    assert supervisor._stop() is trigger
    assert runfiles.read_events(tmp_path)[-1]["event"] == event


def test_a_second_signal_during_a_stop_leaves_the_first_as_the_one_that_stopped_the_run(tmp_path):
    """SIGTERM, then a Ctrl-C while training saved: the console said signal 15, the
    'stopped' event and the exit status (130) SIGINT."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, StubMonitor(False))
    supervisor.attempt = StoppedAttempt()
    supervisor.request_stop(signal.SIGTERM)
    supervisor.attempt.stop = lambda deadline_s: supervisor.request_stop(signal.SIGINT) or 0
    assert supervisor._stop() is Trigger.STOPPED
    assert runfiles.read_events(tmp_path)[-1]["signal"] == signal.SIGTERM
    assert supervisor.signum == signal.SIGTERM


class AttemptWithAFailedRank(StoppedAttempt):
    """Local rank 1 was SIGKILLed; torchrun has not noticed yet."""

    gpus = (0, 1, 2, 3)

    def exit_code(self):
        return None

    def failed_ranks(self):
        return {1: RankRecord(1, 1, 101, 100, exit_code=-signal.SIGKILL, ended_at=time.time())}

    def recorded_errors(self, local_ranks):
        return {}


class AttemptWithARankCrashedInItsStop(AttemptWithAFailedRank):
    """Asked to stop, local rank 0 was ended by the SIGTERM before its handler was set, and
    local rank 2 died of a SIGSEGV within it; torchrun ended with 1."""

    def stop(self, deadline_s):
        return 1

    def failed_ranks(self):
        return {0: RankRecord(0, 0, 100, 99, exit_code=-signal.SIGTERM, ended_at=time.time()),
                2: RankRecord(2, 2, 102, 98, exit_code=-signal.SIGSEGV, ended_at=time.time())}


@pytest.mark.parametrize("attempt, seen_by, gpu, exit_code", [
    # The signal was seen first: the run was only 'stopped', with torchrun's exit status 1,
    # and which rank failed, and how, was lost.
    (AttemptWithAFailedRank, "_watch", 1, -signal.SIGKILL),
    # A rank that crashed during the stop was likewise recorded only as 'stopped'.
    (AttemptWithARankCrashedInItsStop, "_stop", 2, -signal.SIGSEGV),
])
def test_a_rank_failing_just_before_or_during_a_stop_is_the_runs_failure_then_the_stop(
        tmp_path, attempt, seen_by, gpu, exit_code):
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, StubMonitor(False))
    supervisor.monitor.refresh = lambda timeout_s: None
    supervisor.attempt = attempt()
    supervisor.request_stop(signal.SIGTERM)
    assert getattr(supervisor, seen_by)() is Trigger.FAILURE  # then the stop, from FAILED
    failure = runfiles.read_events(tmp_path)[-1]
    assert (failure["event"], failure["cause"], failure["gpus"], failure["exit_codes"]) == \
        ("failure", "exit", [gpu], {str(gpu): exit_code})


class AttemptWithARankThatRaised(AttemptWithAFailedRank):
    """Local rank 1 exited with status 1, as a Python error ends it."""

    def failed_ranks(self):
        return {1: RankRecord(1, 1, 101, 100, exit_code=1, ended_at=time.time())}


@pytest.mark.parametrize("attempt, early_exits_in_row", [
    (AttemptWithAFailedRank, 0),  # SIGKILLed: an OOM kill, a fault, never the script's error
    (AttemptWithARankThatRaised, 1),
])
def test_a_rank_killed_before_the_first_iteration_is_no_step_toward_a_crash_loop(
        tmp_path, attempt, early_exits_in_row):
    """Two kills in the first iteration after a resume gave up with "fix the script"."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, StubMonitor(False))
    supervisor.monitor.refresh = lambda timeout_s: None
    supervisor.attempt = attempt()
    assert supervisor._watch() is Trigger.FAILURE
    assert runfiles.read_events(tmp_path)[-1]["before_first_iteration"] is True
    assert supervisor.early_exits_in_row == early_exits_in_row


def test_an_evaluation_step_is_progress_for_the_hang_check(tmp_path, monkeypatch):
    """--eval-iters forward passes write no new iteration: past --hang-timeout the attempt was
    killed as hung, and when the save shares the evaluation's iteration every relaunch
    reached the same evaluation again."""
    from ftmaster import supervisor as supervisor_module

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, StubMonitor(False))
    supervisor.attempt = AttemptWithARankThatRaised()
    now = [1000.0]
    monkeypatch.setattr(supervisor_module.time, "monotonic", lambda: now[0])
    supervisor._track_progress({"iteration": 100, "first_iteration": 1})
    now[0] += 250
    supervisor._track_progress({"iteration": 100, "first_iteration": 1, "evaluated": 40})
    now[0] += 250
    supervisor._track_progress({"iteration": 100, "first_iteration": 1, "evaluated": 80})
    assert supervisor._progress == (100, 1500.0)
    now[0] += 250
    supervisor._track_progress({"iteration": 100, "first_iteration": 1, "evaluated": 80})
    assert supervisor._progress == (100, 1500.0)  # the same step: no progress


def test_an_attempt_that_trains_ends_the_row_of_early_exits(tmp_path):
    """Early exit, then an attempt that trained for days and was drained, then an early exit:
    ftmaster gave up with exit 93, "2 times in a row"."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, StubMonitor(False))
    supervisor.attempt = AttemptWithARankThatRaised()
    supervisor.early_exits_in_row = 1
    supervisor._track_progress({"iteration": 5, "first_iteration": 5})
    assert supervisor.early_exits_in_row == 0


def test_a_signal_during_a_wait_for_lost_gpus_records_the_stop(tmp_path):
    """The wait saw the signal itself and ended the run with no 'stopped' event: the report
    ran the failure's recovery on into the next launch on the run directory, its RTO and
    failure-to-plan counting the time between the two ftmasters."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), policy="wait",
                              poll_interval_s=0.05)
    supervisor = Supervisor(config, StubMonitor(False))
    supervisor.injected_lost = {1}
    supervisor._handlers.update({State.STARTING: lambda: Trigger.LAUNCHED,
                                 State.RUNNING: lambda: Trigger.FAILURE})
    stop = threading.Timer(0.5, supervisor.request_stop, [signal.SIGTERM])
    stop.start()
    assert supervisor.run() == 128 + signal.SIGTERM
    ends = runfiles.read_events(tmp_path)[-2:]
    assert [(e["event"], e.get("state")) for e in ends] == [("waiting", None), ("stopped", "waiting")]


def test_a_straggler_drain_counts_once_its_gpu_is_retired_not_when_decided(tmp_path):
    """One cut short by another failure used up the drain window and claimed a result."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor.attempt = StubAttempt()
    supervisor._drain_gpu, supervisor._drain_since = 1, runfiles.append_event(tmp_path, "drain")["time"]
    supervisor._drain_reason, supervisor._drain_step_s = "drained: a straggler", 1.3
    assert supervisor.stragglers.drain_allowed(time.time())  # decided, not done
    runfiles.append_event(tmp_path, "emergency_save", iteration=9)
    assert supervisor._drained() is Trigger.DRAINED
    assert not supervisor.stragglers.drain_allowed(time.time())
    assert runfiles.read_events(tmp_path)[-1]["event"] == "straggler_drained"
    supervisor.stragglers.new_attempt((0, 2, 3), 0)
    assert supervisor.stragglers.drained_step_s == 1.3


@pytest.mark.parametrize("drained_ago, allowed", [(100.0, False), (700.0, True)])
def test_a_supervisor_started_again_keeps_the_last_ones_drain_window(tmp_path, drained_ago,
                                                                     allowed):
    """A supervisor started again on the run directory (killed, requeued) drained another
    straggler at once, a second GPU within --straggler-drain-window."""
    runfiles.append_event(tmp_path, "launch", attempt=1, gpus=[0, 1, 2, 3])
    runfiles.append_event(tmp_path, "straggler_drained", gpu=1)
    events = runfiles.read_events(tmp_path)
    events[-1]["time"] = time.time() - drained_ago
    runfiles.events_path(tmp_path).write_text("".join(json.dumps(e) + "\n" for e in events))
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True,
                              straggler_drain_window_s=600.0)
    supervisor = Supervisor(config, StubMonitor(True))
    assert supervisor.stragglers.drain_allowed(time.time()) is allowed


def test_a_supervisor_started_again_injects_nothing_the_last_one_injected(tmp_path):
    """Requeued on the same run directory with the same --inject: resumed past iteration 8,
    the fail was due at once and killed GPU 1 again; the nan the last run reached is done too,
    the one it never reached is still to come."""
    from ftmaster.faults import parse_injection

    fail, degrade = parse_injection("fail:gpu=1,at=iter:8"), parse_injection("degrade:gpu=2,at=5s")
    reached_nan, later_nan = parse_injection("nan:gpu=0,at=iter:10"), parse_injection("nan:gpu=0,at=iter:40")
    runfiles.append_event(tmp_path, "launch", attempt=1, gpus=[0, 1, 2, 3])
    for injection in (fail, reached_nan, later_nan):
        runfiles.append_event(tmp_path, "fault_injected", kind=injection.kind.value,
                              gpu=injection.gpu, spec=str(injection),
                              iteration=injection.at_iteration, armed=injection is not fail)
    runfiles.append_event(tmp_path, "periodic_save", iteration=20, kind="periodic")
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None),
                              injections=(fail, degrade, reached_nan, later_nan))
    supervisor = Supervisor(config, StubMonitor(True))
    assert supervisor.injector.pending == [degrade, later_nan]


def test_of_two_stragglers_found_at_once_the_slower_is_weighed_and_the_other_said_kept(tmp_path):
    from ftmaster.monitor.stragglers import Straggler
    from ftmaster.stragglers import Found

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    slower, less_slow = (Found(gpu, Straggler(gpu, 13, 8, factor, 2.0, 20.0, 10.0), 1.0, 0.5)
                         for gpu, factor in ((1, 2.83), (2, 2.69)))
    supervisor._weigh_first(slower)
    supervisor._weigh_first(less_slow)
    assert supervisor._straggler_to_drain is slower
    (kept,) = [e for e in runfiles.read_events(tmp_path) if e["event"] == "straggler_kept"]
    assert kept["gpu"] == 2 and "GPU 1 is slower and weighed first" in kept["reason"]


def test_a_straggler_named_while_another_gpu_drains_is_said_kept(tmp_path):
    """GPU 1's drain waits for its save; GPU 2 is named meanwhile. It was weighed by no one
    and dropped at the relaunch without a word: the report said 'reported', under
    --drain-stragglers."""
    from ftmaster.monitor.stragglers import Straggler
    from ftmaster.stragglers import Found

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor._drain_gpu = 1  # decided: the agreed save is under way
    supervisor._weigh_first(Found(2, Straggler(2, 16, 10, 1.9, 2.0, 19.0, 10.0), 1.0, 0.5))
    (kept,) = [e for e in runfiles.read_events(tmp_path) if e["event"] == "straggler_kept"]
    assert kept["gpu"] == 2 and "GPU 1 is being drained" in kept["reason"]


def test_a_straggler_named_on_the_gpu_being_drained_is_not_said_kept(tmp_path):
    """GPU 2's risk drain waits for its save (a hot GPU is slow too), and GPU 2 is named a
    straggler meanwhile: the console and the report said 'keeping GPU 2: GPU 2 is being
    drained', a GPU kept and drained in one line."""
    from ftmaster.monitor.stragglers import Straggler
    from ftmaster.stragglers import Found

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor._drain_gpu = 2  # its risk drain: the save is under way
    supervisor._weigh_first(Found(2, Straggler(2, 16, 10, 1.9, 2.0, 19.0, 10.0), 1.0, 0.5))
    assert not [e for e in runfiles.read_events(tmp_path) if e["event"] == "straggler_kept"]


def name_slow_rank(watch, gpus, rank, until=20):
    """Heartbeats in which ``rank`` computes 2x its peers from iteration 5: the watch's
    tracker names it (and holds it named while it stays slow)."""
    watch.new_attempt(gpus, 0)
    for it in range(1, until):
        ms = [20.0 if r == rank and it - 1 >= 5 else 10.0 for r in range(len(gpus))]
        watch.observe({"iteration": it, "time": float(it),
                       "compute": {"stages": [0] * len(gpus), "ms": {str(it - 1): ms}}})
    assert watch.tracker.still_slow(rank)


@pytest.mark.parametrize("silent_one", ["kept behind", "weighed next"])
def test_a_straggler_whose_figures_stopped_still_counts_slow_when_the_next_is_weighed(
        tmp_path, silent_one):
    """GPU 2 (1.8x) waits behind GPU 1 (2x), or is the one weighed; its figures stop. The
    queue dropped it once it was not "still slow", so a later drain of GPU 1 counted GPU 2
    healthy among the GPUs left (unknown is never healthy)."""
    from ftmaster.monitor.stragglers import StragglerConfig
    from ftmaster.stragglers import StragglerWatch

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    watch = supervisor.stragglers = StragglerWatch(StragglerConfig(), True, 600)
    watch.new_attempt([0, 1, 2, 3], 0)
    figures, found = {}, {}

    def step(it, gpu1, gpu2):
        figures[str(it)] = [40.0, gpu1, gpu2, 39.0]
        beat = {"iteration": it, "first_iteration": 1, "time": 1000.0 + it,
                "compute": {"stages": [0, 0, 0, 0], "replicas": [0, 1, 2, 3],
                            "ms": {k: v for k, v in figures.items() if int(k) <= it - 2}}}
        found.update((f.gpu, f) for f in watch.observe(beat))
    for it in range(1, 20):
        step(it, 80.0 if it >= 8 else 40.0, 72.0 if it >= 8 else 40.0)
    assert set(found) == {1, 2}
    if silent_one == "kept behind":
        supervisor._stragglers_behind = [found[2]]
    for it in range(20, 32):  # GPU 1 fast again, GPU 2 silent
        step(it, 40.0, None)
    assert watch.tracker.not_known_fast(2) and not watch.tracker.still_slow(2)
    if silent_one == "kept behind":
        assert supervisor._next_behind() is None
    else:
        supervisor.attempt = types.SimpleNamespace(gpus=[0, 1, 2, 3])
        supervisor._straggler_to_drain = found[2]
        assert supervisor._drain_straggler() is None
    assert supervisor._slowest_staying([0, 2, 3]).gpu == 2


def test_a_straggler_on_a_shrunk_layout_is_weighed_on_the_original_layouts_step(tmp_path):
    """The job ran 1.0 s/iteration on its 4 GPUs, lost GPU 3, and runs 3; then GPU 1 slows
    it. The planner's measured step is the original layout's: calibrated on the 3 GPUs' own
    step instead, the estimate for the 2 GPUs left came out scaled by the wrong layout, and
    a job slowed to between the two estimates was decided the wrong way."""
    from ftmaster.monitor.stragglers import Straggler
    from ftmaster.recovery.planner import plan_layout
    from ftmaster.stragglers import Found

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    three = plan_layout(MODEL, 3, original_world_size=4, measured_step_s=1.0)
    right, wrong = (plan_layout(MODEL, 2, original_world_size=4, measured_step_s=measured)
                    .estimated_step_seconds for measured in (1.0, three.estimated_step_seconds))
    assert wrong != pytest.approx(right)
    slowed = (right + wrong) / 2
    supervisor.plan, supervisor.retired, supervisor._original_step_s = three, {3: "lost"}, 1.0
    supervisor.attempt = types.SimpleNamespace(gpus=(0, 1, 2), stuck_gpus={})
    name_slow_rank(supervisor.stragglers, (0, 1, 2), 1)
    supervisor.stragglers.remeasured = lambda found: found  # the step is the table's
    supervisor._straggler_to_drain = Found(1, Straggler(1, 20, 14, 1.8, None, 18.0, 10.0, 18.0),
                                           slowed, three.estimated_step_seconds)
    drained = supervisor._drain_straggler() is Trigger.CRITICAL_GPU
    assert drained is (right < slowed)
    (decided,) = [e for e in runfiles.read_events(tmp_path)
                  if e["event"] in ("drain", "straggler_kept")]
    line = decided["decided_by" if drained else "reason"]
    assert f"estimates {right:.3f} s/iteration on the 2 GPUs left" in line
    assert "calibrated on the original layout's 1.000 s/iteration" in line


def test_a_straggler_drain_is_weighed_without_a_gpu_lost_but_not_yet_retired(tmp_path):
    """GPU 3, left idle by the 3-GPU layout, was lost (retired only by the next plan): the
    cost model weighed the 3 GPUs 0, 2 and 3 left, where the relaunch would get 2."""
    from ftmaster.monitor.stragglers import Straggler
    from ftmaster.recovery.planner import plan_layout
    from ftmaster.stragglers import Found

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor.plan = plan_layout(MODEL, 3, original_world_size=4, measured_step_s=1.0)
    supervisor._original_step_s, supervisor.injected_lost = 1.0, {3}
    supervisor.attempt = types.SimpleNamespace(gpus=(0, 1, 2), stuck_gpus={})
    name_slow_rank(supervisor.stragglers, (0, 1, 2), 1)
    supervisor.stragglers.remeasured = lambda found: found  # the step is the table's
    supervisor._straggler_to_drain = Found(1, Straggler(1, 20, 14, 1.8, None, 18.0, 10.0, 18.0),
                                           2.0, 1.0)
    supervisor._drain_straggler()
    (decided,) = [e for e in runfiles.read_events(tmp_path)
                  if e["event"] in ("drain", "straggler_kept")]
    assert "on the 2 GPUs left" in decided.get("decided_by", decided.get("reason"))


def test_a_straggler_kept_for_the_drain_window_is_weighed_once_it_is_over(tmp_path):
    """Kept while a drain is recent (said once), weighed when the window ends if still slow;
    before, it was kept for the rest of the attempt however slow it stayed."""
    from ftmaster.monitor.stragglers import Straggler
    from ftmaster.stragglers import Found

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True,
                              straggler_drain_window_s=600.0)
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor.attempt = types.SimpleNamespace(gpus=(0, 1, 2, 3), stuck_gpus={})
    name_slow_rank(supervisor.stragglers, (0, 1, 2, 3), 2)
    supervisor.stragglers.drained(time.time(), 1.0)  # a drain a moment ago
    found = Found(2, Straggler(2, 12, 5, 2.0, None, 20.0, 10.0, 20.0), 2.0, 1.0)
    supervisor._straggler_to_drain = found
    assert supervisor._drain_straggler() is None and supervisor._drain_straggler() is None
    kept = [e for e in runfiles.read_events(tmp_path) if e["event"] == "straggler_kept"]
    assert len(kept) == 1 and "weighed again once that is over" in kept[0]["reason"]
    assert supervisor._straggler_to_drain is found
    supervisor.stragglers.drained(time.time() - 601.0, 1.0)  # the window is over
    supervisor._drain_straggler()
    said = [e for e in runfiles.read_events(tmp_path) if e["event"] in ("drain", "straggler_kept")]
    assert len(said) == 2  # the window's, then the cost model's decision
    assert "the cost model estimates" in (said[1].get("decided_by") or said[1]["reason"])


def test_a_straggler_the_cost_model_kept_is_weighed_again_as_its_slowdown_shows(tmp_path):
    """Named early, a 2x straggler on 4 CPU ranks measured 1.40x; the job ran 1.054
    s/iteration against 1.109 estimated on the 3 GPUs left, so it was kept, and never weighed
    again while it held the job at 1.3 s/iteration to the attempt's end. Kept once (said
    once), it is weighed again REWEIGH_ITERATIONS later, and drained then."""
    import dataclasses

    from ftmaster.monitor.stragglers import Straggler
    from ftmaster.recovery.planner import plan_layout
    from ftmaster.stragglers import Found
    from ftmaster.supervisor import REWEIGH_ITERATIONS

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor._original_step_s = 1.0
    supervisor.attempt = types.SimpleNamespace(gpus=(0, 1, 2, 3), stuck_gpus={})
    name_slow_rank(supervisor.stragglers, (0, 1, 2, 3), 1)
    estimate = plan_layout(MODEL, 3, original_world_size=4,
                           measured_step_s=1.0).estimated_step_seconds
    measured = iter([0.95 * estimate, 1.2 * estimate])
    supervisor.stragglers.remeasured = lambda found: dataclasses.replace(
        found, step_s=next(measured))
    # Calibrated on the step before the slowdown alone: its typical compute is its peers'.
    named = Found(1, Straggler(1, 19, 5, 1.4, None, 14.0, 10.0, 10.0), None, 1.0)
    supervisor._straggler_to_drain = named
    assert supervisor._drain_straggler() is None  # kept: 0.95x the estimate
    assert supervisor._drain_straggler() is None  # not weighed again before its time
    assert supervisor._straggler_to_drain is named
    for it in range(20, 20 + REWEIGH_ITERATIONS):  # still slow
        supervisor.stragglers.observe({"iteration": it, "time": float(it), "compute": {
            "stages": [0] * 4, "ms": {str(it - 1): [10.0, 20.0, 10.0, 10.0]}}})
    assert supervisor._drain_straggler() is Trigger.CRITICAL_GPU  # 1.2x the estimate now
    said = [e["event"] for e in runfiles.read_events(tmp_path)
            if e["event"] in ("drain", "straggler_kept")]
    assert said == ["straggler_kept", "drain"]


def test_a_straggler_whose_replica_mate_is_slow_too_is_kept_until_the_mate_is_fast(tmp_path):
    """TP2 x DP2, GPUs 0 and 1 one replica, both slow: either may be the one the other waits
    for (the one named first was drained, however healthy). Said once; weighed once the mate
    is fast again."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor.attempt = types.SimpleNamespace(gpus=(0, 1, 2, 3), number=1, stuck_gpus={})
    supervisor.stragglers.new_attempt((0, 1, 2, 3), 0)

    def beats(first, last, slow):
        for it in range(first, last):
            ms = [20.0 if r in slow and it - 1 >= 5 else 10.0 for r in range(4)]
            supervisor._watch_stragglers({"iteration": it, "time": float(it), "compute": {
                "stages": [0] * 4, "replicas": [0, 0, 1, 1], "ms": {str(it - 1): ms}}})

    beats(1, 20, slow={0, 1})
    named = [e for e in runfiles.read_events(tmp_path) if e["event"] == "straggler"]
    assert [(e["gpu"], e["slow_mates"]) for e in named] == [(0, [1]), (1, [0])]
    # the figures here reach the heartbeat one iteration on: training was past the naming's
    assert all(e["named_at_iteration"] == e["iteration"] + 1 for e in named)
    supervisor.stragglers.remeasured = lambda found: found
    assert supervisor._drain_straggler() is None and supervisor._drain_straggler() is None
    (kept,) = [e for e in runfiles.read_events(tmp_path) if e["event"] == "straggler_kept"
               and "replica" in e["reason"]]
    assert "of its model replica is slow too" in kept["reason"]
    assert "cannot tell which one holds the job up" in kept["reason"]
    assert not [e for e in runfiles.read_events(tmp_path) if e["event"] == "drain"]
    weighed = supervisor._straggler_to_drain
    beats(20, 40, slow={weighed.straggler.rank})  # the mate is fast again
    supervisor._straggler_to_drain = weighed
    supervisor._drain_straggler()
    decided = [e for e in runfiles.read_events(tmp_path) if e["event"] == "drain"
               or (e["event"] == "straggler_kept" and "cost model" in e["reason"])]
    assert len(decided) == 1 and decided[0]["gpu"] == weighed.gpu


def test_a_stragglers_slow_mates_are_named_by_gpu_in_its_event(tmp_path):
    """Ranks are the attempt's: after GPU 1 left, rank 1 runs on GPU 2."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor.stragglers.new_attempt((0, 2, 3), 0)
    for it in range(1, 20):
        ms = [40.0 if r < 2 and it - 1 >= 5 else 10.0 for r in range(3)]
        supervisor._watch_stragglers({"iteration": it, "time": float(it), "compute": {
            "stages": [0] * 3, "replicas": [0, 0, 1], "ms": {str(it - 1): ms}}})
    named = [e for e in runfiles.read_events(tmp_path) if e["event"] == "straggler"]
    assert [(e["gpu"], e["slow_mates"], e["slow_mate_gpus"]) for e in named] == [
        (0, [1], [2]), (2, [0], [0])]


def test_across_nodes_a_straggler_is_named_and_never_weighed(tmp_path):
    """--drain-stragglers drains on one node only: across nodes one straggler was said kept
    because another was 'weighed first', when none ever is."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor.membership = object()
    supervisor.stragglers.new_attempt((0, 1, 2, 3), 0)
    for it in range(1, 20):
        ms = [20.0 if r in (1, 2) and it - 1 >= 5 else 10.0 for r in range(4)]
        supervisor._watch_stragglers({"iteration": it, "time": float(it), "compute": {
            "stages": [0] * 4, "ms": {str(it - 1): ms}}})
    said = [e["event"] for e in runfiles.read_events(tmp_path)]
    assert said.count("straggler") == 2 and "straggler_kept" not in said
    assert supervisor._straggler_to_drain is None


def test_a_straggler_kept_behind_a_slower_one_is_weighed_once_that_one_is_let_go(tmp_path):
    """GPUs 1 (3x) and 2 (2x) slow: GPU 1 is weighed first, GPU 2 kept. GPU 1 then runs fast
    again and is let go; GPU 2, still slow and named, was never weighed for the rest of the
    attempt however long it held the job back."""
    from ftmaster.monitor.stragglers import Straggler
    from ftmaster.stragglers import Found

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor.attempt = types.SimpleNamespace(gpus=(0, 1, 2, 3), stuck_gpus={})
    watch = supervisor.stragglers
    watch.new_attempt((0, 1, 2, 3), 0)
    for it in range(1, 40):  # GPU 1 slow from 5 to 20, GPU 2 from 5 on
        ms = [10.0, 30.0 if 5 <= it - 1 < 20 else 10.0, 20.0 if it - 1 >= 5 else 10.0, 10.0]
        watch.observe({"iteration": it, "time": float(it),
                       "compute": {"stages": [0] * 4, "ms": {str(it - 1): ms}}})
    assert not watch.tracker.still_slow(1) and watch.tracker.still_slow(2)
    slower, less_slow = (Found(gpu, Straggler(gpu, 11, 5, factor, None, 10.0 * factor, 10.0),
                               1.0, 0.5) for gpu, factor in ((1, 3.0), (2, 2.0)))
    supervisor._weigh_first(slower)
    supervisor._weigh_first(less_slow)
    assert supervisor._drain_straggler() is None  # GPU 1: fast again, let go
    assert supervisor._straggler_to_drain is less_slow


def test_a_straggler_fast_again_before_it_is_weighed_is_let_go(tmp_path):
    from ftmaster.monitor.stragglers import Straggler
    from ftmaster.stragglers import Found

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor.attempt = types.SimpleNamespace(gpus=(0, 1, 2, 3))
    watch = supervisor.stragglers
    name_slow_rank(watch, (0, 1, 2, 3), 2)
    for it in range(20, 40):  # fast again
        watch.observe({"iteration": it, "time": float(it),
                       "compute": {"stages": [0] * 4, "ms": {str(it - 1): [10.0] * 4}}})
    assert not watch.tracker.still_slow(2)
    supervisor._straggler_to_drain = Found(2, Straggler(2, 12, 5, 2.0, None, 20.0, 10.0, 20.0),
                                           2.0, 1.0)
    assert supervisor._drain_straggler() is None and supervisor._straggler_to_drain is None
    assert not [e for e in runfiles.read_events(tmp_path) if e["event"] in ("drain", "straggler_kept")]


def test_a_layout_whose_ranks_have_no_peers_says_once_that_no_straggler_can_be_named(
        tmp_path, caplog):
    """TP1 x PP2 x DP1 on 2 GPUs: each pipeline stage holds one rank, so no rank has a peer to
    be compared with. With GPU 1 slowed 2x under --drain-stragglers nothing was said at all,
    as if it were healthy."""
    pipeline = [*MODEL[:-3], "1", *MODEL[-2:]]  # TP1 x PP2
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(pipeline), gpus=(0, 1),
                              first_plan=check_layout(pipeline, 2, None, None),
                              drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor.stragglers.new_attempt((0, 1), 0)
    with caplog.at_level("INFO", logger="ftmaster"):
        for it in range(1, 20):
            supervisor._watch_stragglers({"iteration": it, "time": float(it), "compute": {
                "stages": [0, 1], "replicas": [0, 0],
                "ms": {str(it - 1): [10.0, 20.0 if it > 5 else 10.0]}}})
    said = [m for m in caplog.messages if "no straggler can be named" in m]
    assert len(said) == 1, caplog.messages
    assert "each pipeline stage has one rank" in said[0]
    assert caplog.records[0].levelname == "WARNING"  # --drain-stragglers can do nothing


class AnnouncingMembership:
    """Announcements between the nodes' supervisors, as the job's store holds them."""

    def __init__(self):
        self.said, self.waited_for = {}, []

    def announce(self, name, value, stop=None):
        self.said[name] = value

    def announcement(self, name, timeout_s, stop=None):
        self.waited_for.append(name)
        return self.said.get(name)


def test_a_node_that_dumped_waits_for_the_merge_only_from_a_merger_that_can_say_it(tmp_path):
    """The new round's rank 0 is on node 0, which fell back (a hang with no culprit) and has
    no dump: it says so at once, where node 1, which dumped as a peer, waited 320 s for a word
    that never came. A node whose rank 0 is on a node that was not in the failed round (node
    2, back from a restart) is not waited for at all."""
    from ftmaster.membership import NodeRecord, Round

    nodes = tuple(NodeRecord(rank, f"node{rank}", (0, 1), 1000 + rank) for rank in range(3))
    store = AnnouncingMembership()
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisors = [Supervisor(config, StubMonitor(False)) for _ in range(2)]
    for supervisor in supervisors:
        supervisor.membership, supervisor.replicas = store, object()
    failed = Round(3, nodes[:2], 0)
    supervisors[0]._merge_dumps_across_nodes(nodes[0], True, failed)
    assert store.said == {"replica_merge/3": "none"}
    for merger, waited in ((nodes[0], ["replica_merge/3"]), (nodes[2], [])):
        store.waited_for.clear()
        supervisors[1]._dumped = (3, tmp_path / "dumps", failed.nodes, (2, 2))
        (tmp_path / "dumps").mkdir()
        supervisors[1]._merge_dumps_across_nodes(merger, False, failed)
        assert store.waited_for == waited and not (tmp_path / "dumps").exists()


def test_policy_drain_keeps_a_gpu_without_which_no_layout_fits(tmp_path):
    """2.53 GiB a GPU: the 4 GPUs fit, 3 do not. Draining one gave the job up."""
    from ftmaster.monitor.daemon import Alert

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), policy="drain",
                              gpu_memory_gb=2.53, max_restarts=3)
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor.attempt = types.SimpleNamespace(gpus=(0, 1, 2, 3), stuck_gpus={})
    supervisor._alerts.append(Alert(1, 1.0, ("xid_79",), 0.0))
    assert supervisor._critical_gpu() is None
    (cancelled,) = [e for e in runfiles.read_events(tmp_path) if e["event"] == "drain_cancelled"]
    assert cancelled["gpu"] == 1 and "no layout fits 3 GPUs" in cancelled["reason"]


class RoundMembership:
    """A rendezvous whose every round is ``joined``; it keeps how the job ended."""

    def __init__(self, joined, max_nodes):
        self.joined, self.ended = joined, []
        self.try_started_at = float("-inf")
        self.config = types.SimpleNamespace(join_timeout_s=5.0, max_nodes=max_nodes, node_rank=0,
                                            endpoint="store:29400")

    def join(self, gpus, warm, peer_url, consumed_samples):
        self.consumed_samples = consumed_samples
        return self.joined

    def end_job(self, outcome, stop=None):
        self.ended.append(outcome)


class PlanningMonitor(StubMonitor):
    def refresh(self, timeout_s):
        pass


def two_nodes(gpus):
    """The first round of two nodes launched with ``gpus`` GPUs each, seen from node 0."""
    from ftmaster.membership import NodeRecord, Round

    return Round(1, tuple(NodeRecord(rank, f"node{rank}", tuple(range(gpus)), 1000 + rank,
                                     launch_gpus=gpus) for rank in range(2)), 0)


# Megatron's default global batch: micro-batch x DP of the original launch.
NO_GLOBAL_BATCH = tuple(MODEL[:11]) + tuple(MODEL[13:])


def test_a_restarted_ftmasters_first_plan_spends_no_restart(tmp_path):
    """Started again on a run directory whose earlier ftmaster retired a GPU, it plans before
    its first launch: that plan counted as a restart, so --max-restarts 1 gave up at the
    first failure ("restart budget spent: 1 of --max-restarts 1")."""
    from ftmaster.launch import check_layout
    from ftmaster.retirements import boot_id

    runfiles.append_event(tmp_path, "plan", boot=boot_id(),
                          gpus_retired=[{"gpu": 3, "reason": "xid_79"}])
    runfiles.append_event(tmp_path, "launch", attempt=1, gpus=[0, 1, 2])
    runfiles.append_event(tmp_path, "stopped", attempt=1, signal=15)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), max_restarts=1)
    supervisor = Supervisor(config, PlanningMonitor(False))
    assert list(supervisor.retired) == [3]
    assert supervisor._plan() is Trigger.PLANNED
    assert supervisor.restarts == 0


def test_arguments_the_planner_refuses_across_nodes_end_the_job_in_one_line(tmp_path):
    """Across nodes no check at launch reads the arguments as the planner does: the first
    round's plan is the first. Two nodes of 3 GPUs at TP 2 x PP 2 without --global-batch-size
    (6 GPUs: no DP) raised the planner's ValueError, a traceback on every node."""
    from ftmaster import exit_codes
    from ftmaster.states import State, exit_status

    membership = RoundMembership(two_nodes(3), max_nodes=2)
    config = SupervisorConfig(run_dir=tmp_path, command=NO_GLOBAL_BATCH, gpus=(0, 1, 2),
                              first_plan=None)
    supervisor = Supervisor(config, PlanningMonitor(False), membership)
    assert supervisor._plan() is Trigger.NO_LAYOUT
    gave_up = runfiles.read_events(tmp_path)[-1]
    assert gave_up["event"] == "gave_up" and "not a multiple of TP x PP = 4" in gave_up["reason"]
    assert len(membership.ended) == 1  # the other nodes end alike
    assert exit_status(State.GAVE_UP, None, supervisor._requeue_helps) == exit_codes.DO_NOT_REQUEUE


def seat_in_a_silent_round(node_gpus, me):
    """Node ``me`` of a second round with peer copies (nodes of ``node_gpus`` GPUs), whose
    rendezvous store holds no other node's word and never will: every wait for one polls."""
    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous  # noqa: F401 (at the first store call: seconds)

    from ftmaster.membership import NodeMembership, NodeRecord, RendezvousConfig, Round

    nodes = tuple(NodeRecord(rank, f"node{rank}", tuple(range(gpus)), 1000 + rank,
                             peer_url=f"http://node{rank}:1", launch_gpus=gpus)
                  for rank, gpus in enumerate(node_gpus))
    joined = Round(2, nodes, me, secret="secret")
    membership = NodeMembership(RendezvousConfig("127.0.0.1:1", "job", 1, len(nodes), me,
                                                 local_addr="127.0.0.1"), connect=False)
    membership._round_store = types.SimpleNamespace(underlying_store=dist.HashStore())
    membership.join = lambda gpus, warm, peer_url, consumed_samples: joined
    return membership, joined


def stopped_while_planning(supervisor, after_s):
    """``supervisor._plan()`` with a SIGTERM ``after_s`` into it: its trigger, and the
    seconds it took once stopped."""
    stopped_at = []

    def sigterm():
        stopped_at.append(time.monotonic())
        supervisor.request_stop(signal.SIGTERM)

    stopping = threading.Timer(after_s, sigterm)
    stopping.start()
    try:
        return supervisor._plan(), time.monotonic() - stopped_at[0]
    finally:
        stopping.cancel()


def test_a_stop_while_a_node_waits_for_the_replica_merge_stops_it_at_once(tmp_path, monkeypatch):
    """Node 1 dumped its ranks' state in a failed round and, in the next, waited for the
    merge on rank 0's node for up to 320 s; a SIGTERM (scancel, a time limit) changed nothing
    until then, past SLURM's grace period: SIGKILLed with no 'stopped' event."""
    from ftmaster.states import advance, exit_status

    monkeypatch.setattr("ftmaster.supervisor.MERGE_TIMEOUT_S", 3.0)
    monkeypatch.setattr("ftmaster.supervisor.DUMP_TIMEOUT_S", 0.0)
    membership, joined = seat_in_a_silent_round((2, 2), me=1)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1),
                              first_plan=None)
    replication = types.SimpleNamespace(url="http://node1:1", new_round=lambda *args: None)
    supervisor = Supervisor(config, PlanningMonitor(False), membership, replication=replication)
    (tmp_path / "dumps").mkdir()
    supervisor._dumped = (1, tmp_path / "dumps", joined.nodes, (2, 2))
    trigger, seconds = stopped_while_planning(supervisor, after_s=0.3)
    assert trigger is Trigger.SIGNALLED and seconds < 1.0
    events = runfiles.read_events(tmp_path)
    assert [e["event"] for e in events] == ["round", "stopped"]
    assert events[-1]["state"] == "planning"
    assert exit_status(advance(State.PLANNING, trigger), supervisor.signum) == 143
    assert not (tmp_path / "dumps").exists()  # dropped as after the wait


@pytest.mark.parametrize("stopped_in", ["gathering", "merging"])
def test_a_stop_while_rank_0s_node_merges_the_dumps_stops_it_and_leaves_no_checkpoint(
        tmp_path, monkeypatch, stopped_in):
    """Rank 0's node gathers every node's dumps, then merges them, for up to 300 s; a SIGTERM
    changed nothing until then, past SLURM's grace period: SIGKILLed with no 'stopped'
    event. Stopped, the merge is killed and cleaned up as one past its timeout: no dumps, no
    half-built checkpoint in the memory tier, the tracker untouched."""
    import subprocess
    import sys

    from ftmaster.replica_recovery import Merging, ReplicaRecovery
    from ftmaster.replication import Replication, ReplicationConfig

    memory, released = tmp_path / "memory", threading.Event()
    staging = memory / ".iter_0000016.replica-0123abcd"
    merges = []

    def start_merge(folder, stop):  # a merge that builds its checkpoint for 3 s, and says nothing
        merges.append(subprocess.Popen([sys.executable, "-c", (
            "import pathlib, sys, time; p = pathlib.Path(sys.argv[1]); p.mkdir(parents=True); "
            "(p / '__0_0.distcp').write_bytes(bytes(64)); time.sleep(3)"), str(staging)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return Merging(folder, merges[-1], time.monotonic())

    def fetch_all(folder, nodes, ranks_per_node, stop):  # a peer that sends for 3 s
        released.wait(3.0 if stopped_in == "gathering" else 0.0)
        return []

    def gather_dumps(*args):  # Replication's own, around that fetch
        return Replication.gather_dumps(types.SimpleNamespace(_gather_dumps=fetch_all), *args)

    membership, joined = seat_in_a_silent_round((2, 2), me=0)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1),
                              first_plan=None)
    replication = types.SimpleNamespace(url="http://node0:1", new_round=lambda *args: None,
                                        gather_dumps=gather_dumps,
                                        config=ReplicationConfig(memory, tmp_path / "run", 0))
    supervisor = Supervisor(config, PlanningMonitor(False), membership, replication=replication)
    supervisor.replicas = ReplicaRecovery(tmp_path, memory, tmp_path / "save", supervisor._event)
    monkeypatch.setattr(supervisor.replicas, "start_merge", start_merge)
    dumps = memory / "replicas" / "round_1"
    dumps.mkdir(parents=True)
    supervisor._dumped = (1, dumps, joined.nodes, (2, 2))
    try:
        trigger, seconds = stopped_while_planning(supervisor, after_s=0.5)
    finally:
        released.set()
    assert trigger is Trigger.SIGNALLED and seconds < 1.0
    assert [e["event"] for e in runfiles.read_events(tmp_path)] == ["round", "stopped"]
    assert not dumps.exists() and not staging.exists()
    assert all(merge.poll() is not None for merge in merges)  # none left building
    assert sorted(p.name for p in memory.iterdir()) == ["replicas"]  # no iter_*, no tracker


@pytest.mark.parametrize("me", [0, 1], ids=["deciding", "told"])
def test_a_stop_while_the_nodes_agree_on_their_memory_checkpoint_stops_at_once(tmp_path,
                                                                              monkeypatch, me):
    """Once a round formed, the node of rank 0 waited up to 30 s for every node's holdings
    and the others up to 60 s for its decision; a SIGTERM changed nothing until then."""
    from ftmaster.replication import ReplicationConfig

    monkeypatch.setattr("ftmaster.replication.AGREE_TIMEOUT_S", 3.0)
    membership, joined = seat_in_a_silent_round((2, 2), me)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1),
                              first_plan=None)
    replication = types.SimpleNamespace(url=f"http://node{me}:1", new_round=lambda *args: None,
                                        config=ReplicationConfig(tmp_path / "memory",
                                                                 tmp_path / "run", me))
    supervisor = Supervisor(config, PlanningMonitor(False), membership, replication=replication)
    trigger, seconds = stopped_while_planning(supervisor, after_s=0.3)
    assert trigger is Trigger.SIGNALLED and seconds < 1.0
    assert [e["event"] for e in runfiles.read_events(tmp_path)] == ["round", "stopped"]


@pytest.mark.parametrize("me", [0, 1], ids=["rank0s-node", "another-node"])
def test_a_catch_up_given_up_fails_the_round_instead_of_resuming_from_an_older_checkpoint(
        tmp_path, me):
    """The round agreed on iteration 4, whole on the other node; a peer's fetch failed all
    three tries. Launched anyway, the ranks could not load 4 here and every rank fell back to
    2, and that load set aside every node's copy of 4 as newer than what it resumed from (the
    next memory save pruned them): the newest state, whole on the other node, lost for one
    flaky peer. The round fails here instead, says why, and tells the others, and the next
    round agrees and catches up anew, within the restart budget."""
    from ftmaster.replication import Agreed, ReplicationConfig, ReplicationFailed
    from ftmaster.states import advance

    membership, joined = seat_in_a_silent_round((2, 2), me)
    membership._round = joined
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1),
                              first_plan=None, max_restarts=3)
    failed = ReplicationFailed(4, "http://node1:1/iter_0000004/common.pt: timed out")
    replication = types.SimpleNamespace(
        url=f"http://node{me}:1", new_round=lambda *args: None,
        config=ReplicationConfig(tmp_path / "memory", tmp_path / "run", me),
        catch_up=lambda agreed, chooses, stop: [failed])
    supervisor = Supervisor(config, PlanningMonitor(False), membership, replication=replication)
    supervisor.agreement = types.SimpleNamespace(
        publish=lambda number: None,
        decide=lambda number, node_ranks, decides, decider_busy_s: Agreed(4, "digest", {}))
    trigger = supervisor._plan()
    assert trigger is Trigger.FAILURE and supervisor.plan is None  # nothing launches
    events = {e["event"]: e for e in runfiles.read_events(tmp_path)}
    assert events["catch_up_failed"]["iteration"] == 4 and events["catch_up_failed"]["round"] == 2
    assert "timed out" in events["catch_up_failed"]["reason"]
    assert membership.announcement("failed/2", 0.0) == f"{me} catch_up"  # the others stop
    assert supervisor._decide() is Trigger.RETRY
    assert advance(advance(State.PLANNING, trigger), Trigger.RETRY) is State.PLANNING


def test_a_catch_up_that_fails_again_for_the_same_checkpoint_launches_rather_than_give_up(
        tmp_path):
    """A peer this node cannot reach (a port its network drops) fails every catch-up: each
    round failed in turn for the same checkpoint until --max-restarts was spent, and the job
    gave up at its first GPU failure, where it had resumed from an older checkpoint. A second
    round that fails for the checkpoint the last one failed for is launched instead."""
    from ftmaster.membership import Round
    from ftmaster.replication import Agreed, ReplicationConfig, ReplicationFailed

    membership, joined = seat_in_a_silent_round((2, 2), 1)
    rounds = iter([joined, Round(3, joined.nodes, 1, secret="secret")])

    def join(gpus, warm, peer_url, consumed_samples):
        membership._round = next(rounds)
        return membership._round

    membership.join = join
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1),
                              first_plan=None, max_restarts=3)
    replication = types.SimpleNamespace(
        url="http://node1:1", new_round=lambda *args: None,
        config=ReplicationConfig(tmp_path / "memory", tmp_path / "run", 1),
        catch_up=lambda agreed, chooses, stop: [ReplicationFailed(4, "connection refused")])
    supervisor = Supervisor(config, PlanningMonitor(False), membership, replication=replication)
    supervisor.agreement = types.SimpleNamespace(
        publish=lambda number: None,
        decide=lambda number, node_ranks, decides, decider_busy_s: Agreed(4, "digest", {}))
    assert supervisor._plan() is Trigger.FAILURE
    assert supervisor._plan() is Trigger.PLANNED and supervisor.plan is not None
    failed = [e["round"] for e in runfiles.read_events(tmp_path) if e["event"] == "catch_up_failed"]
    assert failed == [2]


def test_a_stop_between_catch_up_tries_stops_the_node_and_fails_no_round(tmp_path):
    """A SIGTERM while the catch-up waits to try a failing peer again ended the tries with a
    'failure': the round failed here (a catch_up_failed event, an error line) and told every
    other node to stop and form a new round, for a signal that stopped this node alone."""
    from ftmaster.peer_files import PeerError
    from ftmaster.replication import Agreed, Replication, ReplicationConfig

    membership, joined = seat_in_a_silent_round((2, 2), 1)
    membership._round = joined
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1),
                              first_plan=None)
    supervisor = None

    def stalled_peer(agreed, peers, chooses, done):
        supervisor.request_stop(signal.SIGTERM)  # the signal comes while the peer fails
        raise PeerError("http://node0:1/iter_0000004/common.pt: timed out")

    tries = types.SimpleNamespace(_folder_lock=threading.Lock(), _catch_up=stalled_peer)
    replication = types.SimpleNamespace(
        url="http://node1:1", new_round=lambda *args: None,
        config=ReplicationConfig(tmp_path / "memory", tmp_path / "run", 1),
        catch_up=lambda agreed, chooses, stop: Replication.catch_up(types.SimpleNamespace(
            _peers=object(), _catch_up_tries=lambda *args: Replication._catch_up_tries(
                tries, *args)), agreed, chooses, stop))
    supervisor = Supervisor(config, PlanningMonitor(False), membership, replication=replication)
    supervisor.agreement = types.SimpleNamespace(
        publish=lambda number: None,
        decide=lambda number, node_ranks, decides, decider_busy_s: Agreed(4, "digest", {}))
    assert supervisor._plan() is Trigger.SIGNALLED
    events = [e["event"] for e in runfiles.read_events(tmp_path)]
    assert events == ["round", "memory_agreed", "stopped"]
    assert membership.announcement("failed/2", 0.0) is None  # the others go on


def test_a_stop_while_a_spare_reads_the_jobs_outcome_from_a_store_that_hangs_stops_at_once(
        tmp_path):
    """A spare (no ranks this round) polls the store for the job's outcome: with the store's
    node cut off (no packet, no reset) that read was bounded by nothing of ftmaster's and
    looked at no stop, so a SIGTERM waited for torch's own timeout, past SLURM's grace."""
    from ftmaster.membership import NodeMembership, RendezvousConfig
    from ftmaster.states import advance, exit_status

    cut = threading.Event()  # the reply that comes only with torch's own timeout, 3 s here
    membership = NodeMembership(RendezvousConfig("127.0.0.1:1", "job", 1, 2, 1,
                                                 local_addr="127.0.0.1"), connect=False)
    membership._round_store = types.SimpleNamespace(underlying_store=types.SimpleNamespace(
        check=lambda keys: cut.wait(3.0) and False))
    membership.handler = types.SimpleNamespace(num_nodes_waiting=lambda: 0)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1),
                              first_plan=None)
    supervisor = Supervisor(config, PlanningMonitor(False), membership)
    stopped_at = []
    threading.Timer(0.3, lambda: (stopped_at.append(time.monotonic()),
                                  supervisor.request_stop(signal.SIGTERM))).start()
    try:
        trigger = supervisor._standby()
        assert trigger is Trigger.SIGNALLED and time.monotonic() - stopped_at[0] < 1.0
    finally:
        cut.set()
    stopped = runfiles.read_events(tmp_path)[-1]
    assert stopped["event"] == "stopped" and stopped["state"] == "standby"
    assert exit_status(advance(State.STANDBY, trigger), supervisor.signum) == 143


def test_a_spare_whose_round_lost_a_node_joins_a_new_round(tmp_path):
    """A spare watched only for the job's outcome and for nodes waiting to join: when the one
    node that trained died for good, nobody ever joined, and the spare (the store's host
    under SLURM) waited until the time limit."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1),
                              first_plan=None, poll_interval_s=0.01)
    supervisor = Supervisor(config, PlanningMonitor(False))
    polls = []
    supervisor.membership = types.SimpleNamespace(outcome=lambda stop: None,
                                                  peers_waiting=lambda stop: False,
                                                  node_dropped=lambda stop: len(polls) > 2)
    supervisor._persist_when_due = lambda: polls.append(1)  # a spare node 0 persists too
    assert supervisor._standby() is Trigger.PEERS_WAITING and len(polls) == 3


@pytest.mark.parametrize("outcome, status", [
    ("complete", 0),
    ("gave up on node 0: the script failed; do not requeue: a requeue would fail the same way "
     "(exit status 93)", 93)])
def test_a_stop_while_a_node_waits_for_the_others_to_read_the_jobs_end_stops_the_wait_at_once(
        tmp_path, monkeypatch, outcome, status):
    """A node that learned how the job ended says it read it, then waited up to 30 s for
    every node of the round to say so too; a SIGTERM changed nothing until then, SLURM's
    grace period (30 s by default) over: SIGKILLed before it recorded the end. The end is
    the job's: the stop changes nothing in it, and is never a requeue (75)."""
    from datetime import timedelta

    import torch.distributed as dist

    from ftmaster.membership import NodeMembership, NodeRecord, RendezvousConfig, Round
    from ftmaster.states import advance, exit_status

    monkeypatch.setattr("ftmaster.membership.ACK_TIMEOUT_S", 3.0)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5),
                          wait_for_workers=False)
    membership = NodeMembership(RendezvousConfig("127.0.0.1:1", "job", 1, 2, 1,
                                                 local_addr="127.0.0.1"), connect=False)
    nodes = tuple(NodeRecord(rank, f"node{rank}", (0, 1), 1000 + rank) for rank in range(2))
    membership._round = Round(2, nodes, 1)  # node 0 never acknowledges
    membership._round_store = types.SimpleNamespace(underlying_store=store)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1),
                              first_plan=None)
    supervisor = Supervisor(config, PlanningMonitor(False), membership)
    stopped_at = []
    stopping = threading.Timer(0.3, lambda: (stopped_at.append(time.monotonic()),
                                             supervisor.request_stop(signal.SIGTERM)))
    stopping.start()
    try:
        trigger = supervisor._job_ended(outcome)
    finally:
        stopping.cancel()
    assert stopped_at and time.monotonic() - stopped_at[0] < 1.0
    assert store.get("ftmaster.job.ack/1") == b"1"  # said before the wait
    assert runfiles.read_events(tmp_path)[-1]["event"] in ("complete", "gave_up")
    assert exit_status(advance(State.STANDBY, trigger), supervisor.signum,
                       supervisor._requeue_helps) == status


def test_policy_drain_across_nodes_weighs_the_gpus_left_on_every_node_of_the_round(tmp_path):
    """Two nodes of 4 GPUs at TP 4 x PP 2 without --global-batch-size: the check planned this
    node's GPUs alone as the job (4 GPUs, no multiple of 8), and the planner's ValueError
    ended ftmaster with a traceback while training ran. The next round has 7 GPUs."""
    from ftmaster.monitor.daemon import Alert

    command = (*NO_GLOBAL_BATCH[:-4], "--tensor-model-parallel-size", "4",
               "--pipeline-model-parallel-size", "2")
    config = SupervisorConfig(run_dir=tmp_path, command=command, gpus=(0, 1, 2, 3),
                              first_plan=None, policy="drain")
    supervisor = Supervisor(config, StubMonitor(True), RoundMembership(two_nodes(4), 2))
    supervisor.round = two_nodes(4)
    supervisor.attempt = types.SimpleNamespace(gpus=(0, 1, 2, 3), stuck_gpus={})
    supervisor._alerts.append(Alert(1, 1.0, ("xid_79",), 0.0))
    assert supervisor._critical_gpu() is Trigger.CRITICAL_GPU


def test_resumed_names_the_first_iteration_even_when_the_poll_saw_a_later_one(tmp_path):
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, StubMonitor(False))
    supervisor.attempt = StubAttempt()
    supervisor.attempt.number = 2
    runfiles.write_heartbeat(tmp_path, iteration=53, consumed_samples=0, first_iteration=52)
    assert supervisor._track_progress(runfiles.read_heartbeat(tmp_path)) == 53
    (resumed,) = [e for e in runfiles.read_events(tmp_path) if e["event"] == "resumed"]
    assert (resumed["attempt"], resumed["iteration"]) == (2, 52)


def test_a_gpu_a_stuck_rank_still_holds_is_not_planned_on(tmp_path):
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, StubMonitor(False))
    supervisor.attempt = StubAttempt()
    supervisor.attempt.stuck_gpus = {2: "process_stuck"}
    assert supervisor._unfit_gpus() == {2: "process_stuck"}


def test_check_layout_derives_a_missing_global_batch_as_megatron_does():
    at = MODEL.index("--global-batch-size")
    plan = check_layout(MODEL[:at] + MODEL[at + 2:], 8, None, None)
    assert (plan.data_parallel_size, plan.micro_batch_size, plan.global_batch_size) == (2, 2, 4)


@pytest.mark.parametrize("gpus,message", [
    (6, "TP 2 x PP 2 with micro-batch 2 and global batch 12 does not fit 6 GPUs; the planner "
        "suggests TP 2 x PP 1 x DP 3"),
    (2, "does not fit 2 GPUs"),
])
def test_check_layout_refuses_a_layout_that_does_not_fit(gpus, message):
    with pytest.raises(click.ClickException, match=message):
        check_layout(MODEL, gpus, None, None)


DENSE = ["t.py", "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "16"]


@pytest.mark.parametrize("extra, message", [
    # Megatron refuses each of these on 4 GPUs; TP, PP and the batch alone are fine
    (["--context-parallel-size", "2", "--seq-length", "66"], r"TP 1 x PP 1 x CP 2 with .* suggests "
     r"TP 1 x PP 1 x DP 4"),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3"],
     r"TP 1 x PP 2, VPP 3 with micro-batch 1 .* suggests TP 1 x PP 2 x DP 2, VPP 2"),
    (["--num-experts", "8", "--expert-model-parallel-size", "3"], r"TP 1 x PP 1, EP 3 with .* x DP 4, EP 4"),
    (["--expert-model-parallel-size", "2"], r"TP 1 x PP 1, EP 2 with .* suggests TP 1 x PP 1 x DP 4 with"),
    # what differs is named on both sides, not the same layout offered back
    (["--eval-micro-batch-size", "3"], r"TP 1 x PP 1, eval micro-batch 3 with .* suggests TP 1 x "
     r"PP 1 x DP 4, eval micro-batch 2 with"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     r"TP 1 x PP 2, 3 layers per virtual stage with .* x DP 2, 2 layers per virtual stage with"),
])
def test_check_layout_refuses_a_context_expert_or_virtual_size_megatron_would(extra, message):
    with pytest.raises(click.ClickException, match="invalid layout: " + message):
        check_layout(DENSE + extra, 4, None, None)


def test_check_layout_takes_the_scripts_own_context_expert_and_virtual_sizes():
    plan = check_layout(DENSE + ["--context-parallel-size", "2", "--num-experts", "4",
                                 "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                 "2", "--num-virtual-stages-per-pipeline-rank", "2"], 8, None, None)
    assert (plan.context_parallel_size, plan.expert_model_parallel_size,
            plan.virtual_pipeline_model_parallel_size, plan.data_parallel_size) == (2, 2, 2, 2)


# -- injections ------------------------------------------------------------------------------
def test_injections_fire_once_and_recover_waits_for_its_gpu_to_be_lost():
    fail, recover, hang = (parse_injection(s) for s in
                           ("fail:gpu=1,at=iter:5", "recover:gpu=1,at=2s", "hang:gpu=0,at=10s"))
    injector = Injector((fail, recover, hang))
    assert injector.take_due(None, 100.0, frozenset()) == [hang]  # no iteration yet: no iter:K
    assert injector.take_due(4, 100.0, frozenset()) == []  # recover: GPU 1 is not lost
    assert injector.take_due(5, 100.0, frozenset()) == [fail]
    assert injector.take_due(5, 100.0, frozenset({1})) == [recover]
    assert injector.pending == []


def test_an_injection_after_an_event_waits_until_the_supervisor_saw_it():
    fail = parse_injection("fail:gpu=1,at=iter:12,after=emergency_save")
    injector = Injector((fail,))
    injector.saw({"event": "risk_alert"})
    assert injector.take_due(30, 100.0, frozenset()) == []
    injector.saw({"event": "emergency_save"})
    assert injector.take_due(30, 100.0, frozenset()) == [fail]


def test_an_armed_injection_the_attempt_never_reached_is_handed_to_the_next():
    nan, slow = parse_injection("nan:gpu=1,at=iter:20"), parse_injection("slow:gpu=0,at=iter:8,factor=2")
    injector = Injector((nan, slow))
    assert injector.take_armed([0, 1]) == [nan, slow]
    injector.trained(12)  # the attempt died at iteration 12: past the slowdown, not the NaN
    assert injector.take_armed([0, 1]) == [nan]
    assert injector.unfired() == [nan]
    injector.saw({"event": "nonfinite", "iteration": 20})  # the poisoned step, then its end
    assert injector.unfired() == []
    assert injector.take_armed([0, 1]) == []
    assert injector.pending == []


def test_a_nan_for_an_iteration_the_attempt_resumed_past_is_said_never_to_have_fired():
    """--load at 100 and nan at iter:12: the trainer poisons iteration 12 alone, which it
    never trained, and the run ended with no "never fired" warning."""
    nan = parse_injection("nan:gpu=0,at=iter:12")
    injector = Injector((nan,))
    assert injector.take_armed([0, 1]) == [nan]
    injector.trained(101, first=101)
    injector.trained(150, first=101)
    assert injector.unfired() == [nan]


def test_an_armed_injection_for_a_gpu_left_out_waits_for_an_attempt_on_it():
    nan = parse_injection("nan:gpu=1,at=iter:20")
    injector = Injector((nan,))
    assert injector.take_armed([0, 1]) == [nan]
    assert injector.take_armed([0]) == []  # ended at once; the next attempt runs without GPU 1
    assert injector.take_armed([0, 1]) == [nan]


@pytest.mark.parametrize("spec", ["slow:gpu=1,factor=2,at=5s", "hang:gpu=1,at=5s"])
def test_a_ranks_fault_for_a_gpu_no_rank_trains_on_says_it_was_not_injected(tmp_path, spec, caplog):
    """A relaunch without GPU 1: the fault was said 'injected' and recorded, and did nothing."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, StubMonitor(False))
    supervisor.monitor.pending_injections = []
    supervisor.attempt = StoppedAttempt()
    supervisor.attempt.gpus = (0, 2)
    with caplog.at_level("INFO", logger="ftmaster"):
        assert supervisor._apply(parse_injection(spec))  # dropped, as for a retired GPU
    assert "fault_injected" not in [e["event"] for e in runfiles.read_events(tmp_path)]
    assert f"not injected: {spec}: no rank trains on GPU 1" in caplog.messages



@pytest.mark.parametrize("spec, lost, xids", [
    ("fail:gpu=1,at=5s", {1}, {}), ("hang:gpu=1,at=5s", set(), {}),
    ("xid:gpu=1,code=79,at=5s", set(), {1: 79})])
def test_a_fault_due_while_waiting_signals_no_pid_of_the_killed_attempt(tmp_path, spec, lost,
                                                                         xids):
    """A fault that came due while the supervisor waited for GPUs was sent to the killed
    attempt's rank pids (its guards, killed with their ranks, rarely record the ranks' end),
    which may be other processes' by then."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, StubMonitor(False))
    supervisor.monitor.pending_injections = []
    supervisor.monitor.health = types.SimpleNamespace(unschedulable_xids={79})
    supervisor.attempt = StoppedAttempt()
    supervisor.attempt.gpus = (0, 1, 2, 3)
    supervisor.attempt.pid_on_gpu = lambda gpu: pytest.fail("a killed attempt's pid was asked for")
    supervisor.attempt.kill()
    assert supervisor._apply(parse_injection(spec))
    assert (supervisor.injected_lost, supervisor.injected_xids) == (lost, xids)

# -- listener --------------------------------------------------------------------------------
def test_move_request_moves_the_body_and_logs_the_request(tmp_path):
    assert move_request(tmp_path) is None
    runfiles.write_flag(runfiles.trigger_flag_path(tmp_path), gpu=3, score=0.97, reasons=["xid_79"])
    event = move_request(tmp_path)
    assert (event["source"], event["gpu"]) == ("monitor", 3)
    assert not runfiles.trigger_flag_path(tmp_path).exists()
    assert runfiles.read_flag(runfiles.save_now_flag_path(tmp_path))["reasons"] == ["xid_79"]
    assert [e["event"] for e in runfiles.read_events(tmp_path)] == ["checkpoint_request"]


def test_an_unreadable_trigger_is_a_request_too(tmp_path):
    runfiles.flags_dir(tmp_path).mkdir()
    runfiles.trigger_flag_path(tmp_path).write_text("{not json")
    event = move_request(tmp_path)
    assert (event["source"], event["gpu"]) == ("unknown", None)
    assert runfiles.save_now_flag_path(tmp_path).exists()


@pytest.mark.parametrize("body", [b'{"gpu": 1, "reasons": ["\xff"]}', b"[" * 100_000])
def test_a_trigger_that_is_not_utf8_or_json_at_all_is_a_request_too(tmp_path, body):
    """It raised out of the listener's thread, which ended: no later request was moved."""
    runfiles.flags_dir(tmp_path).mkdir()
    runfiles.trigger_flag_path(tmp_path).write_bytes(body)
    event = move_request(tmp_path)
    assert (event["source"], event["gpu"]) == ("unknown", None)
    assert runfiles.save_now_flag_path(tmp_path).read_bytes() == body


def test_an_attempt_inherits_no_torchrun_option_from_the_environment(monkeypatch):
    monkeypatch.setenv("PET_STANDALONE", "1")
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    monkeypatch.setenv("PETS", "kept")
    env = attempt_module.inherited_environment()
    assert "PET_STANDALONE" not in env and "PET_RDZV_BACKEND" not in env
    assert env["PETS"] == "kept" and env["PATH"] == os.environ["PATH"]


@pytest.mark.parametrize("body", [b'{"folder": "\xff"}', b"[" * 100_000])
def test_read_flag_never_raises_for_a_flag_it_cannot_read(tmp_path, body):
    """Every reader relies on it: the listener's thread, and each rank's replica-dump thread,
    which polls its request flag and would end, never dumping, on a raise."""
    flag = tmp_path / "dump.flag"
    flag.write_bytes(body)
    assert runfiles.read_flag(flag) == {"unreadable": True}


@pytest.mark.timeout(20)
def test_a_fifo_for_a_flag_is_a_request_not_a_wait_for_a_writer(tmp_path):
    """A FIFO moved to save_now.flag held the listener's read until some writer came, and
    every later request (a real GPU alert) with it."""
    flag = tmp_path / "save_now.flag"
    os.mkfifo(flag)
    assert runfiles.read_flag(flag) == {"unreadable": True}


def test_the_listener_outlives_any_error_of_one_poll(tmp_path, monkeypatch, caplog):
    polls = []

    def move(run_dir):
        polls.append(run_dir)
        if len(polls) == 1:
            raise ValueError("a flag the reader chokes on")
        return None

    monkeypatch.setattr("ftmaster.listener.move_request", move)
    listener = Listener(tmp_path, interval_s=0.01)
    listener.start()
    try:
        wait_until(lambda: len(polls) >= 3, timeout=5, what="polls after the error")
    finally:
        listener.stop()
    assert "cannot move the checkpoint trigger: ValueError: a flag the reader chokes on" in caplog.text


def test_listener_moves_a_trigger_within_one_second(tmp_path):
    listener = Listener(tmp_path)
    listener.start()
    try:
        for gpu in (1, 2):
            written = time.monotonic()
            runfiles.write_flag(runfiles.trigger_flag_path(tmp_path), gpu=gpu)
            save_now = runfiles.save_now_flag_path(tmp_path)
            wait_until(lambda: (runfiles.read_flag(save_now) or {}).get("gpu") == gpu, timeout=5,
                       what=f"save_now.flag for GPU {gpu}")
            assert time.monotonic() - written < 1.0
    finally:
        listener.stop()
    assert [e["gpu"] for e in runfiles.read_events(tmp_path)] == [1, 2]


# -- lock ------------------------------------------------------------------------------------
def test_a_second_lock_on_the_same_run_dir_is_refused(tmp_path):
    with RunDirLock(tmp_path):
        with pytest.raises(RunDirLocked, match=f"another ftmaster \\(pid {os.getpid()}\\)"):
            RunDirLock(tmp_path).acquire()
    with RunDirLock(tmp_path):  # released: free again
        pass


def test_a_lock_held_from_another_host_names_that_host(tmp_path):
    """A run directory on a shared filesystem: the holder's pid alone pointed at no process,
    or at an unrelated one, on the host where the launch was refused."""
    holder = subprocess.Popen([PY, "-c", "import socket, sys, time; "
                               "socket.gethostname = lambda: 'node-b.cluster'; "
                               "from ftmaster.lock import RunDirLock; "
                               "RunDirLock(sys.argv[1]).acquire(); print('locked', flush=True); "
                               "time.sleep(60)", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirLocked, match=f"\\(pid {holder.pid} on host node-b.cluster\\)"):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_holder_is_free(tmp_path):
    holder = subprocess.Popen([PY, "-c", "import sys, time; from ftmaster.lock import RunDirLock; "
                               "RunDirLock(sys.argv[1]).acquire(); print('locked', flush=True); "
                               "time.sleep(60)", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(RunDirLocked, match=f"pid {holder.pid}"):
        RunDirLock(tmp_path).acquire()
    holder.kill()
    holder.wait()
    with RunDirLock(tmp_path):
        pass


def test_a_probe_of_the_lock_does_not_refuse_a_launch(tmp_path):
    """``ftmaster report`` or another launch's scan holds the lock shared for an open and a
    close; a launch starting then was refused, naming the killed holder before it."""
    (tmp_path / "ftmaster.lock").write_text("4242 oldhost\n")
    probe = os.open(tmp_path / "ftmaster.lock", os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
    threading.Timer(0.1, os.close, (probe,)).start()
    with RunDirLock(tmp_path):
        pass


def test_a_run_dir_without_locks_is_used_with_a_warning(tmp_path, monkeypatch, caplog):
    """Lustre without -o flock: the launch was refused as "not writable", leaving the lock
    file's descriptor open and the run directory it made."""
    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr("ftmaster.lock.fcntl.flock", no_locks)
    open_before = len(os.listdir("/proc/self/fd"))
    held = HeldFolders(_launch_config(tmp_path, run="runs/first"), None)
    held.close()
    assert "run directory " + str(tmp_path / "runs/first") + " has no file locks " \
        "(Function not implemented)" in caplog.text
    assert len(os.listdir("/proc/self/fd")) == open_before


def test_a_launch_refused_at_the_run_dirs_lock_leaves_no_folder_it_made(tmp_path, monkeypatch):
    def unwritable(fd, operation):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("ftmaster.lock.fcntl.flock", unwritable)
    with pytest.raises(click.ClickException, match="is not writable \\(Input/output error\\)"):
        HeldFolders(_launch_config(tmp_path, run="runs/first"), None)
    assert not (tmp_path / "runs").exists()


def test_save_is_shared_by_one_jobs_nodes_and_refused_to_another_job(tmp_path):
    save = tmp_path / "ckpt"
    node_0 = FolderClaim(save, "rendezvous job-a", tmp_path / "run" / "node_0")
    node_1 = FolderClaim(save, "rendezvous job-a", tmp_path / "run" / "node_1")
    node_0.acquire()
    node_1.acquire()
    other = FolderClaim(save, "host:/elsewhere", tmp_path / "elsewhere")
    with pytest.raises(FolderInUse, match=f"--save {save} is written by another run "
                       f"\\(host .*, pid {os.getpid()}, run_dir {tmp_path}/run/node_[01]\\)"):
        other.acquire()
    node_0.release()
    with pytest.raises(FolderInUse, match="node_1"):  # one node of the job still holds it
        other.acquire()
    node_1.release()
    assert not list((save / HOLDERS_DIR).iterdir())  # each claim removes its own file
    other.acquire()
    other.release()


def test_a_withdrawn_claim_removes_the_folder_it_made_unless_another_node_claimed_it(tmp_path):
    save = tmp_path / "new" / "ckpt"
    node_0 = FolderClaim(save, "rendezvous job-a", tmp_path / "run" / "node_0")
    node_1 = FolderClaim(save, "rendezvous job-a", tmp_path / "run" / "node_1")
    node_0.acquire()
    node_1.acquire()
    node_0.withdraw()  # refused, its folder made; node 1's launch goes on
    assert [p.name for p in (save / HOLDERS_DIR).iterdir()] == [node_1.path.name]
    node_1.release()
    alone = FolderClaim(save, "host:/elsewhere", tmp_path / "elsewhere")
    shutil.rmtree(tmp_path / "new")
    alone.acquire()
    alone.withdraw()
    assert list(tmp_path.iterdir()) == []


def test_a_withdrawn_claim_keeps_a_folder_that_was_there(tmp_path):
    claim = FolderClaim(tmp_path, "job a", tmp_path / "run")
    claim.acquire()
    claim.withdraw()
    assert sorted(p.name for p in tmp_path.iterdir()) == [HOLDERS_DIR, HOLDERS_GUARD]


def test_a_claim_that_waited_on_a_guard_removed_meanwhile_takes_the_new_one(tmp_path):
    """A withdrawn claim removes the guard it holds; a launch that waited on that file
    would list the holders beside one that opened the new file at its name."""
    import fcntl

    guard = tmp_path / HOLDERS_GUARD
    withdrawing = os.open(guard, os.O_RDWR | os.O_CREAT)
    fcntl.flock(withdrawing, fcntl.LOCK_EX)
    waiter = threading.Thread(target=FolderClaim(tmp_path, "job b", tmp_path / "b").acquire)
    waiter.start()
    time.sleep(0.2)  # it waits on the old guard
    guard.unlink()
    newer = os.open(guard, os.O_RDWR | os.O_CREAT)
    fcntl.flock(newer, fcntl.LOCK_EX)  # another launch now lists the holders
    os.close(withdrawing)
    waiter.join(1.0)
    assert waiter.is_alive()
    os.close(newer)
    waiter.join(5.0)
    assert not waiter.is_alive() and len(list((tmp_path / HOLDERS_DIR).iterdir())) == 1


def test_a_withdrawal_that_waited_on_a_guard_removed_meanwhile_leaves_the_new_one(tmp_path):
    """Two launches that found --save missing withdraw at once (every node of a job refused
    alike): the one that waited on the guard the other removed then removed the new guard
    at its name, the holders' folder and --save, while a third launch held that guard to
    list the holders: it failed, or a fourth listed them beside it."""
    import fcntl

    save = tmp_path / "ckpt"
    claim = FolderClaim(save, "job a", tmp_path / "a")
    claim.acquire()
    guard = save / HOLDERS_GUARD
    other_withdrawal = os.open(guard, os.O_RDWR)
    fcntl.flock(other_withdrawal, fcntl.LOCK_EX)
    withdrawing = threading.Thread(target=claim.withdraw)
    withdrawing.start()
    time.sleep(0.2)  # it released its file and waits on the old guard
    (save / HOLDERS_DIR).rmdir()
    guard.unlink()
    (save / HOLDERS_DIR).mkdir()  # a third launch, listing the holders under the new guard
    listing = os.open(guard, os.O_RDWR | os.O_CREAT)
    fcntl.flock(listing, fcntl.LOCK_EX)
    os.close(other_withdrawal)
    withdrawing.join(5.0)
    try:
        assert not withdrawing.is_alive()
        assert os.path.samestat(os.fstat(listing), os.stat(guard))
        assert (save / HOLDERS_DIR).is_dir()
    finally:
        os.close(listing)


def test_a_claim_whose_folder_a_withdrawal_removed_before_it_opened_the_guard_makes_it_again(
        tmp_path, monkeypatch):
    """Another node's refused launch withdrew the --save it made (the holders' folder, the
    guard, the folder) between this claim making the folders and opening the guard: the
    launch was refused, 'cannot claim --save ... (No such file or directory); give a
    writable --save'."""
    import ftmaster.lock as lock

    save, withdrawn = tmp_path / "ckpt", []
    opened = lock._open_shared

    def withdrawn_first(path):
        if not withdrawn:
            withdrawn.append(path)
            shutil.rmtree(save)
        return opened(path)

    monkeypatch.setattr(lock, "_open_shared", withdrawn_first)
    claim = FolderClaim(save, "job a", tmp_path / "a")
    claim.acquire()
    assert withdrawn and claim.path.exists()
    claim.release()


def test_a_claim_is_known_by_its_name_before_its_contents_can_be_read(tmp_path):
    """Over NFS another client may list a file before it sees its bytes."""
    first = FolderClaim(tmp_path, "job a", tmp_path / "a")
    first.acquire()
    first.path.write_bytes(b"")  # as a client without the bytes yet reads it
    with pytest.raises(FolderInUse, match=f"\\(host {socket.gethostname()}, pid {os.getpid()}\\); "
                       f"give another --save, or stop that run first \\(if its host is down, "
                       f"remove {first.path}\\)"):
        FolderClaim(tmp_path, "job b", tmp_path / "b").acquire()
    same_job = FolderClaim(tmp_path, "job a", tmp_path / "a2")
    same_job.acquire()  # its own job's files are not even read
    same_job.release()
    first.release()


def test_one_slurm_job_step_is_one_job_on_every_node_and_requeue(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "big")
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # a requeued script's srun is step 0 again
    assert _job_identity(tmp_path / "a", None) == _job_identity(tmp_path / "b", None) == \
        "slurm job big/4242 step 0"
    monkeypatch.setenv("SLURM_STEP_ID", "1")  # a second srun in the allocation: another run
    assert _job_identity(tmp_path / "a", None) == "slurm job big/4242 step 1"
    # two launches in one salloc shell or batch script, outside a step, on one --save: two
    # runs writing their timelines into each other's checkpoints, which the claim refuses
    monkeypatch.delenv("SLURM_STEP_ID")
    assert _job_identity(tmp_path / "a", None) != _job_identity(tmp_path / "b", None)
    assert _job_identity(tmp_path / "a", None) == f"slurm job big/4242 {tmp_path / 'a'}"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert _job_identity(tmp_path / "a", None) != _job_identity(tmp_path / "b", None)


def claim_holder(save, job: str) -> subprocess.Popen:
    """Another ftmaster's process, holding its claim on ``save`` for ``job``."""
    holder = subprocess.Popen([PY, "-c", "import sys, time; from ftmaster.lock import FolderClaim; "
                               "FolderClaim(sys.argv[1], sys.argv[2], sys.argv[1]).acquire(); "
                               "print('claimed', flush=True); time.sleep(60)", str(save), job],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "claimed"
    return holder


def test_the_claim_of_a_killed_ftmaster_is_removed(tmp_path):
    save = tmp_path / "ckpt"
    holder = claim_holder(save, "first job")
    with pytest.raises(FolderInUse, match=f"pid {holder.pid}"):
        FolderClaim(save, "second job", tmp_path).acquire()
    holder.kill()
    holder.wait()
    claim = FolderClaim(save, "second job", tmp_path)
    claim.acquire()
    assert [path.name for path in (save / HOLDERS_DIR).iterdir()] == [claim.path.name]
    claim.release()


def test_the_claim_of_a_killed_ftmaster_of_the_same_job_is_removed_by_its_next_launch(tmp_path):
    """A SIGKILLed ftmaster (or a requeued SLURM job) relaunched on the same job: its dead
    claim was never probed (only other jobs' are), so one file piled up per kill."""
    save = tmp_path / "ckpt"
    holder = claim_holder(save, "job a")
    holder.kill()
    holder.wait()
    claim = FolderClaim(save, "job a", tmp_path)
    claim.acquire()
    assert [path.name for path in (save / HOLDERS_DIR).iterdir()] == [claim.path.name]
    claim.release()
    assert not list((save / HOLDERS_DIR).iterdir())


def _launch_config(tmp_path, *args, run="run", memory_dir_picked=None):
    return types.SimpleNamespace(command=("pretrain_gpt.py", *args), run_dir=tmp_path / run,
                                 scratch_memory_dir=memory_dir_picked)


def _claimed(config):
    """The folders a launch claims, released again."""
    claims = list(_claim_checkpoint_folders(config, None))
    for claim in claims:
        claim.release()
    return [(claim.flag, claim.folder.parent) for claim in claims]


def test_launch_claims_the_checkpoint_folders_training_writes(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # one job whatever the run directory
    save, memory = tmp_path / "ckpt", tmp_path / "shm"
    assert _claimed(_launch_config(tmp_path, "--load", str(save))) == []
    tier = ("--save", str(save), "--non-persistent-ckpt-type", "global",
            "--non-persistent-global-ckpt-dir", str(memory))
    assert _claimed(_launch_config(tmp_path, *tier, memory_dir_picked=memory)) == [("--save", save)]
    assert _claimed(_launch_config(tmp_path, *tier[:4])) == [  # Megatron-LM's folder, under --save
        ("--save", save), ("--non-persistent-global-ckpt-dir", save / "non_persistent")]
    claims = list(_claim_checkpoint_folders(_launch_config(tmp_path, *tier), None))
    assert [(claim.flag, claim.folder.parent) for claim in claims] == [
        ("--save", save), ("--non-persistent-global-ckpt-dir", memory)]
    try:
        with pytest.raises(click.ClickException, match="--save .* is written by another run"):
            _claimed(_launch_config(tmp_path, "--save", str(save), run="another_run"))
        with pytest.raises(click.ClickException, match="--non-persistent-global-ckpt-dir "
                           f"{memory} is written by another run .*; give another "
                           "--non-persistent-global-ckpt-dir, or stop that run first"):
            _claimed(_launch_config(tmp_path, *tier[2:], "--save", str(tmp_path / "own"),
                                    run="another_run"))
    finally:
        for claim in claims:
            claim.release()


def test_a_save_folder_without_locks_is_used_with_a_warning(tmp_path, monkeypatch, caplog):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr("ftmaster.lock.fcntl.flock", no_locks)
    assert _claimed(_launch_config(tmp_path, "--save", str(tmp_path / "ckpt"))) == []
    assert "has no file locks (No locks available)" in caplog.text


def test_a_save_folder_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(click.ClickException,
                       match=f"cannot claim --save {tmp_path}/file/ckpt for this run"):
        _claimed(_launch_config(tmp_path, "--save", str(tmp_path / "file" / "ckpt")))


# -- guards: real processes ------------------------------------------------------------------
def test_a_guard_whose_parent_died_before_it_asked_to_die_with_it_dies_at_once():
    """ftmaster started the guard and died while its interpreter started: read then,
    getppid() named init, the check passed, and torchrun trained on as an orphan."""
    started = subprocess.run(
        [PY, "-c", "import os, subprocess, sys\n"
                   "guard = subprocess.Popen([sys.executable, '-m', 'ftmaster.guard', 'exec', "
                   "'sleep', '37'], env={**os.environ, 'FTMASTER_GUARD_PARENT': str(os.getpid())},"
                   " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
                   "print(guard.pid)"], capture_output=True, text=True, check=True)
    orphan = psutil.Process(int(started.stdout))
    try:
        assert wait_until_dead([orphan], timeout=10) == []
    finally:
        if orphan.is_running():
            orphan.kill()


def test_a_stop_terminates_the_ranks_it_knows_without_waiting_for_a_record_that_never_comes():
    """With the run directory out of room a rank's record may never be written: the known
    ranks trained on until the stop's deadline, then were SIGKILLed with no time to save."""
    from ftmaster.attempt import RankRecord

    saver = subprocess.Popen([PY, "-c", "import signal, sys, time\n"
                              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                              "print('ready', flush=True)\ntime.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    assert saver.stdout.readline() == "ready\n"
    attempt = Attempt.__new__(Attempt)
    attempt.gpus, attempt.kill = (0, 1), lambda: None
    attempt.ranks = lambda: {0: RankRecord(0, 0, saver.pid, saver.pid)}  # rank 1's never comes
    attempt.process = types.SimpleNamespace(poll=saver.poll, wait=saver.wait)
    started = time.monotonic()
    try:
        assert attempt.stop(20) == 0  # torchrun's status: here the rank's own
        assert time.monotonic() - started < 10
    finally:
        saver.kill()


SUPERVISED_HANG_UP = """
import os, signal, sys, time, types
from ftmaster.launch import StopSignals, _supervise
# Either way, whatever this test inherited (a suite started under nohup ignores SIGHUP).
signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[1] == "nohup" else signal.SIG_DFL)
stopped = []
def run():
    os.kill(os.getpid(), signal.SIGHUP)
    time.sleep(0.5)
    return stopped[0] if stopped else 0
supervisor = types.SimpleNamespace(request_stop=stopped.append, run=run)
idle = types.SimpleNamespace(start=lambda: None, stop=lambda: None)
print(_supervise(supervisor, idle, idle, StopSignals()))
"""


@pytest.mark.parametrize("disposition, stopped_by", [("default", signal.SIGHUP), ("nohup", 0)])
def test_a_hang_up_stops_training_as_sigterm_does_unless_ignored(disposition, stopped_by):
    """A closed terminal or ssh session ended ftmaster at once, and every rank with it
    (they die with their parent), with no save and no record of the stop."""
    done = subprocess.run([PY, "-c", SUPERVISED_HANG_UP, disposition], capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, str(int(stopped_by))), done.stderr


SIGNAL_WHILE_THE_EVENTS_LOCK_IS_HELD = """
import os, signal, threading, time, types
from ftmaster.launch import StopSignals
stops, stop = StopSignals(), threading.Event()
stops.hand_to(types.SimpleNamespace(request_stop=lambda signum: stop.set()))
with stop._cond:  # as the supervisor's poll (Event.wait) holds it, briefly, many times a second
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)  # a Python handler runs here, in this thread
print(stop.wait(10))
stops.close()
"""


def test_a_stop_signal_never_waits_for_a_lock_the_interrupted_thread_holds():
    """The handler set the supervisor's stop event in the main thread, between two of its
    bytecodes: when those were inside the event's own wait, which holds its lock, ftmaster
    hung for good (CPython issue 126434), its ranks neither told nor saved."""
    done = subprocess.run([PY, "-c", SIGNAL_WHILE_THE_EVENTS_LOCK_IS_HELD],
                          capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr


def test_a_signal_while_the_launch_closes_after_its_outcome_changes_nothing(tmp_path, monkeypatch):
    """The caller's handlers came back before the launch closed its observers, warm workers
    and membership: a SIGTERM there ended a completed run with status 143."""
    from click.testing import CliRunner
    from ftmaster import launch
    from ftmaster.cli import main
    from helpers.trainer import PRETRAIN

    while_closing = []
    observer = types.SimpleNamespace(
        close=lambda: while_closing.append(signal.getsignal(signal.SIGTERM)))
    monkeypatch.setattr(launch, "_observers", lambda *args: [observer])
    monkeypatch.setattr(launch, "Supervisor", lambda *args: types.SimpleNamespace(
        run=lambda: 0, request_stop=lambda signum: None))
    callers = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(main, [
        "launch", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2",
        "--monitor-backend", "sim", "--cold-restart", "--", PRETRAIN, "--num-layers", "2",
        "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "100"])
    assert result.exit_code == 0, result.output
    assert while_closing and while_closing[0] not in (signal.SIG_DFL, callers)
    assert signal.getsignal(signal.SIGTERM) is callers  # nothing left to the caller


def test_a_ctrl_c_before_the_supervisor_exists_stops_the_run_as_one_after(tmp_path, monkeypatch):
    """Before ftmaster's handlers (the first second or two: torch's import, the GPU probe)
    a Ctrl-C was click's "Aborted!" and exit 1, or an abort inside torch's import."""
    from click.testing import CliRunner
    from ftmaster import launch
    from ftmaster.cli import main
    from helpers.trainer import PRETRAIN

    def interrupted_probe(*args):
        os.kill(os.getpid(), signal.SIGINT)
        return probe(*args)

    probe = launch.job_gpus
    monkeypatch.setattr(launch, "job_gpus", interrupted_probe)
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(main, [
        "launch", "--run-dir", str(run_dir), "--nproc-per-node", "2",
        "--monitor-backend", "sim", "--cold-restart", "--", PRETRAIN, "--num-layers", "2",
        "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "100"])
    assert result.exit_code == 128 + signal.SIGINT, result.output
    assert [(e["event"], e["signal"], e["state"]) for e in runfiles.read_events(run_dir)] == \
        [("stopped", signal.SIGINT, "starting")]  # nothing launched


def test_a_ctrl_c_while_ftmaster_imports_the_command_exits_130(monkeypatch):
    from click.testing import CliRunner
    from ftmaster import cli

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    result = CliRunner().invoke(cli.main, ["launch", "--", "train.py"])
    assert (result.exit_code, result.output) == (128 + signal.SIGINT, "")  # not "Aborted!"


SIGTERM_IN_TEARDOWN = """
import os, signal
class SigtermOnTeardown:  # deleted with __main__'s globals, once Python's handlers are gone
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
at_teardown = SigtermOnTeardown()
from ftmaster.cli import main
main(["--version"])
"""


def test_a_sigterm_once_ftmasters_exit_status_is_decided_leaves_it_as_it_is():
    """The interpreter's teardown (half a second once torch is loaded) ran with the default
    handlers: a SIGTERM there made a completed launch's exit status 143."""
    done = subprocess.run([PY, "-c", SIGTERM_IN_TEARDOWN], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_rank_guard_records_the_pid_and_the_signal_that_killed_the_rank(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    env = dict(os.environ, **{RANK_DIR_ENV: str(tmp_path), "LOCAL_RANK": "2", "RANK": "6"})
    guard = subprocess.Popen([PY, "-m", "ftmaster.guard", "rank", str(script)], env=env)
    record = wait_until(lambda: read_rank_records(tmp_path, 3).get(2), timeout=20, what="record")
    assert (record.rank, record.guard_pid, record.exit_code) == (6, guard.pid, None)
    assert psutil.Process(record.pid).ppid() == guard.pid
    os.kill(record.pid, signal.SIGKILL)
    assert guard.wait(timeout=20) == 128 + signal.SIGKILL
    assert read_rank_records(tmp_path, 3)[2].exit_code == -signal.SIGKILL


def test_a_killed_process_left_a_zombie_is_dead_at_once_a_live_one_is_waited_for():
    zombie = subprocess.Popen([PY, "-c", "pass"])
    wait_until(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE, 20, what="zombie")
    sleeper = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    try:
        started = time.monotonic()
        assert wait_until_dead([psutil.Process(zombie.pid)], timeout=10) == []
        assert time.monotonic() - started < 1
        started = time.monotonic()
        survivors = wait_until_dead([psutil.Process(sleeper.pid)], timeout=0.5)
        assert time.monotonic() - started >= 0.5
        assert [p.pid for p in survivors] == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait()
        zombie.wait()


def test_a_rank_that_outlives_its_kill_marks_its_gpu_stuck(tmp_path, monkeypatch):
    """A rank in uninterruptible sleep (the kernel's D state, which SIGKILL waits out) is the
    edge here: it is played by treating one real rank's pid as alive after its kill."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    attempt = Attempt(tmp_path / "run", 1, [str(script)], gpus=(4, 6), env={})
    wait_until(lambda: len(attempt.ranks()) == 2, timeout=60, what="both ranks")
    stuck_pid = attempt.ranks()[1].pid
    real_alive = attempt_module._alive
    monkeypatch.setattr(attempt_module, "_alive",
                        lambda p: p.pid == stuck_pid or real_alive(p))
    attempt.kill(timeout=0.5)
    assert attempt.stuck_gpus == {6: "process_stuck"}


def test_an_attempt_killed_again_later_never_signals_a_process_that_took_a_ranks_pid(tmp_path):
    """The first kill leaves the records without an exit code (the guards die with their
    ranks); ftmaster's end killed the last attempt again, hours of standby later, and
    SIGKILLed whatever process held those pids by then."""
    import json

    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    attempt = Attempt(tmp_path / "run", 1, [str(script)], gpus=(0,), env={})
    wait_until(lambda: len(attempt.ranks()) == 1, timeout=60, what="the rank")
    attempt.kill(timeout=10)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = attempt_module.rank_record_path(attempt.rank_dir, 0)
        body = json.loads(record.read_text())
        assert body.get("exit_code") is None
        record.write_text(json.dumps({**body, "pid": bystander.pid, "guard_pid": bystander.pid}))
        attempt.kill(timeout=1)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_a_kill_again_after_a_stuck_rank_spares_a_process_that_took_an_ended_guards_pid(
        tmp_path, monkeypatch):
    """Rank 1 outlives its kill (stuck in the driver), so the attempt is killed again later
    (ftmaster's end, a stop). Rank 0's guard had ended before the first kill: never seen,
    its pid was looked up afresh at the later kill, and whatever process held it by then was
    sent SIGKILL."""
    import json

    from ftmaster.guard import rank_record_path

    torchrun = attempt_module.SessionProcess(["true"], start_new_session=True)
    torchrun.wait()
    stuck = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["true"])
    gone.wait()

    def record(local_rank, pid, exit_code, ended_at=None):
        rank_record_path(tmp_path, local_rank).write_text(json.dumps(dict(
            local_rank=local_rank, rank=local_rank, pid=pid, guard_pid=pid,
            exit_code=exit_code, ended_at=ended_at)))

    record(0, gone.pid, 1, time.time() - 10)  # ended 10 s before
    record(1, stuck.pid, None)
    attempt = object.__new__(Attempt)
    attempt.number, attempt.gpus, attempt.rank_dir, attempt.process = 1, (0, 1), tmp_path, torchrun
    attempt.stuck_gpus, attempt._processes, attempt._killed = {}, {}, False
    monkeypatch.setattr(attempt_module, "wait_until_dead",
                        lambda processes, timeout: [p for p in processes if p.pid == stuck.pid])
    bystander = None
    try:
        attempt.kill(timeout=0.1)
        assert attempt.stuck_gpus == {1: "process_stuck"}
        bystander = subprocess.Popen(["sleep", "60"])
        record(0, bystander.pid, 1, json.loads(rank_record_path(tmp_path, 0).read_text())["ended_at"])
        attempt.kill(timeout=0.1)  # the pid reused: played by the record naming the bystander's
        time.sleep(0.2)
        assert bystander.poll() is None
    finally:
        for process in (stuck, bystander):
            if process is not None:
                process.kill()
                process.wait()


def test_torch_elastic_keeps_its_folder_with_the_attempt(tmp_path):
    """Without ``--log-dir`` every torchrun leaves a ``torchelastic_*`` folder in the
    temporary directory, one per attempt, for as long as the machine lives."""
    script = tmp_path / "done.py"
    script.write_text("")
    temp = tmp_path / "temp"
    temp.mkdir()
    attempt = Attempt(tmp_path / "run", 1, [str(script)], gpus=(0,), env={"TMPDIR": str(temp)})
    assert attempt.process.wait(timeout=120) == 0
    assert [p.name for p in temp.iterdir() if p.name.startswith("torchelastic_")] == []
    assert list((attempt.rank_dir / "torchrun").glob("*/attempt_0/0"))


def test_the_guarded_chain_dies_when_its_top_is_killed(tmp_path):
    """ftmaster -> guard exec -> (stand-in torchrun) -> guard rank -> rank: SIGKILL the top."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(120)\n")
    stand_in = (f"import subprocess, sys; subprocess.run([sys.executable, '-m', 'ftmaster.guard', "
                f"'rank', {str(script)!r}])")
    top = subprocess.Popen([PY, "-c", f"import os, sys; os.execv(sys.executable, [sys.executable, "
                            f"'-m', 'ftmaster.guard', 'exec', sys.executable, '-c', {stand_in!r}])"],
                           env=dict(os.environ, **{RANK_DIR_ENV: str(tmp_path)}),
                           start_new_session=True)
    rank_pid = wait_until(lambda: read_rank_records(tmp_path, 1).get(0), timeout=20,
                          what="rank record").pid
    rank = psutil.Process(rank_pid)
    assert rank.is_running()
    top.kill()
    top.wait()
    gone, alive = psutil.wait_procs([rank], timeout=20)
    assert not alive, "the rank outlived its killed ancestors"


FORKING_PARENT = """
import multiprocessing, os, sys, time
from ftmaster.guard import forked_children_die_with_this_process
if sys.argv[1] == "guarded":
    forked_children_die_with_this_process()
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,))
child.start()
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_forked_children_die_with_their_parent_only_when_guarded(guarded):
    parent = subprocess.Popen([PY, "-c", FORKING_PARENT, "guarded" if guarded else "plain"],
                              stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        parent.kill()  # SIGKILL: no atexit, no multiprocessing clean-up
        parent.wait()
        gone, _ = psutil.wait_procs([child], timeout=5 if guarded else 0.5)
        assert bool(gone) is guarded
    finally:
        if child.is_running():
            child.kill()


def test_guard_without_a_command_is_a_usage_error():
    result = subprocess.run([PY, "-m", "ftmaster.guard", "rank"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("usage:")


@pytest.mark.parametrize("idle, since_write, hung", [
    (5, None, False),     # within the limit
    (11, None, True),     # no progress, nothing written
    (11, 3, False),       # a save is writing its files
    (100, 50, True),      # wedged during or after a save: written long ago, still hung
    (11, 10, True),       # the last write is exactly one limit old
])
def test_is_hung(idle, since_write, hung):
    assert is_hung(idle, 10, since_write) is hung


def test_last_checkpoint_write_is_the_newest_file_of_the_newest_checkpoint(tmp_path):
    assert last_checkpoint_write(tmp_path) is None
    for iteration, stamp in ((3, 1000.0), (6, 2000.0)):
        folder = tmp_path / f"iter_{iteration:07d}"
        folder.mkdir()
        os.utime(folder, (stamp, stamp))
    shard = tmp_path / "iter_0000006" / "__0_0.distcp"
    shard.write_bytes(b"x")
    os.utime(shard, (2500.0, 2500.0))
    os.utime(shard.parent, (2000.0, 2000.0))
    assert last_checkpoint_write(tmp_path) == 2500.0


def test_a_checkpoint_folder_that_cannot_be_read_counts_as_written_now(tmp_path, monkeypatch):
    """The supervisor's side of "unknown": a save renaming its files, or a file system
    returning errors, must not make a saving rank look hung."""
    import ftmaster.supervisor as supervisor_module

    (tmp_path / "iter_0000006").mkdir()

    def unreadable(folder):
        raise FileNotFoundError(folder)

    monkeypatch.setattr(supervisor_module, "folder_written_at", unreadable)
    before = time.time()
    assert before <= last_checkpoint_write(tmp_path) <= time.time()


def test_replica_recovery_across_nodes_needs_ftmasters_node_local_folders(tmp_path):
    """Each node's survivors dump into its own memory folder, from which the merge gathers
    them: a memory folder given for every node is refused, in one line."""
    from ftmaster.launch import _with_memory_tier
    from ftmaster.membership import RendezvousConfig
    from ftmaster.recovery.cli import InputError

    rendezvous = RendezvousConfig("127.0.0.1:29400", "job", 1, 2, 0)
    argv = ["pretrain_gpt.py", "--save", str(tmp_path), "--non-persistent-ckpt-type", "global",
            "--non-persistent-global-ckpt-dir", str(tmp_path / "m"), "--replica-recovery"]
    with pytest.raises(InputError, match="--replica-recovery across nodes needs ftmaster's "
                                         "node-local memory folders in /dev/shm: give no "
                                         "--non-persistent-global-ckpt-dir$"):
        _with_memory_tier(argv, tmp_path, rendezvous)


@pytest.mark.parametrize("load, removed, picked", [
    ("ckpt", 1, True),  # the folder's room was what /dev/shm lacked: picked again
    ("ckpt", 0, False),
    (None, 0, False),  # a fresh start persists nothing
])
def test_a_launch_takes_over_a_stopped_runs_memory_tier_and_picks_dev_shm_once_it_has_room(
        tmp_path, monkeypatch, load, removed, picked):
    from ftmaster import launch
    from ftmaster.supervisor import SupervisorConfig

    save = tmp_path / "ckpt"
    argv = MODEL + ["--save", str(save), "--non-persistent-ckpt-type", "global"] + (
        ["--load", str(tmp_path / load)] if load else [])
    config = SupervisorConfig(run_dir=tmp_path / "run", command=tuple(argv), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(argv, 4, None, None))  # fell back
    asked, shm = [], tmp_path / "shm" / "ftmaster-run-1"
    monkeypatch.setattr(launch, "persist_left_behind",
                        lambda own, disk, resumes, say: asked.append((own, disk, resumes)) or removed)
    monkeypatch.setattr(launch, "_with_memory_tier", lambda args, run_dir, rendezvous: (
        [*args, "--non-persistent-global-ckpt-dir", str(shm)], shm))
    taken = launch._take_over_left_memory(config, argv,
                                           types.SimpleNamespace(will_make=lambda folder: None))
    assert asked == [(None, save, load is not None)]
    assert (taken.scratch_memory_dir == shm) is picked
    assert (flag_value(taken.command, "--non-persistent-global-ckpt-dir") == str(shm)) is picked
    assert (flag_value(taken.first_plan.command, "--non-persistent-global-ckpt-dir")
            == str(shm)) is picked
    assert (shm / ".ftmaster_owner.json").exists() is picked


WIDE = ["t.py", "--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--seq-length", "2048", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "1"]


@pytest.mark.parametrize("command, gpus_per_node, memory_gb", [
    # TP 4 fits the 4 GPUs of the node, not the nodes of 2 the planner was told of
    (MODEL + ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "1"], 2,
     None),
    # nodes of 3 and 1 GPUs: the second cannot host a TP group of 2
    (MODEL, 3, None),
    # TP 1, all that nodes of 1 allow, fits no memory of 3.7 GiB: the error blamed the memory
    (WIDE, 1, 3.7),
])
def test_check_layout_names_gpus_per_node_when_it_alone_makes_the_layout_unfit(
        command, gpus_per_node, memory_gb):
    """One node runs every rank: the layout fit it, and the error blamed the layout and
    offered another (or blamed the memory) instead of naming --gpus-per-node."""
    check_layout(command, 4, None, memory_gb)
    with pytest.raises(click.ClickException) as refused:
        check_layout(command, 4, gpus_per_node, memory_gb)
    assert refused.value.message.startswith(
        f"--gpus-per-node {gpus_per_node} splits this node's 4 GPUs (--nproc-per-node 4) into "
        f"nodes of {gpus_per_node}")
    assert "\n" not in refused.value.message


def test_check_layout_keeps_a_gpus_per_node_the_layout_fits():
    plan = check_layout(MODEL, 4, 2, None)
    assert (plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size) == (2, 2)


def launch_options(*args):
    """``ftmaster launch``'s options as the command passes them, for ``args``."""
    from ftmaster.launch import launch_command

    return launch_command.make_context("launch", [*args, "--", "t.py"]).params


@pytest.mark.parametrize("nproc, tp", [
    (2, 4),  # no node can host a TP group: the first round trained TP 1 x DP 4 instead
    (6, 4),  # a node runs whole TP groups: TP 4 x DP 3 on 12 GPUs could never be placed
])
def test_across_nodes_nproc_per_node_not_a_multiple_of_tp_is_refused_before_the_rendezvous(
        tmp_path, nproc, tp):
    from ftmaster.gpus import JobGpus
    from ftmaster.launch import supervisor_config
    from ftmaster.membership import RendezvousConfig
    from ftmaster.recovery.cli import InputError

    argv = MODEL[:-4] + ["--tensor-model-parallel-size", str(tp)]
    rendezvous = RendezvousConfig("127.0.0.1:29400", "job", 2, 2, 0)
    options = launch_options("--nproc-per-node", str(nproc), "--run-dir", str(tmp_path / "run"))
    with pytest.raises(InputError) as refused:
        supervisor_config(argv, JobGpus(tuple(range(nproc))), rendezvous, options)
    assert refused.value.message == (
        f"--nproc-per-node {nproc} is not a multiple of --tensor-model-parallel-size {tp}: "
        "across nodes each node runs whole TP groups (Megatron-LM keeps TP within a node), so "
        f"the first round would train another layout; give a TP that divides {nproc}")


def test_across_nodes_nproc_per_node_a_multiple_of_tp_is_taken(tmp_path):
    from ftmaster.gpus import JobGpus
    from ftmaster.launch import supervisor_config
    from ftmaster.membership import RendezvousConfig

    rendezvous = RendezvousConfig("127.0.0.1:29400", "job", 2, 2, 0)
    config = supervisor_config(list(MODEL), JobGpus((0, 1, 2, 3)), rendezvous,
                               launch_options("--nproc-per-node", "4", "--run-dir",
                                              str(tmp_path / "run")))
    assert config.first_plan is None and config.gpus == (0, 1, 2, 3)


def test_across_nodes_gpus_per_node_below_the_nodes_gpus_is_refused_not_ignored(tmp_path):
    """The rounds plan on each node's GPUs as one node: nodes of 2 were never applied, and TP
    4 ran across what the user had said were two nodes."""
    from ftmaster.gpus import JobGpus
    from ftmaster.launch import supervisor_config
    from ftmaster.membership import RendezvousConfig
    from ftmaster.recovery.cli import InputError

    rendezvous = RendezvousConfig("127.0.0.1:29400", "job", 2, 2, 0)
    options = launch_options("--nproc-per-node", "4", "--gpus-per-node", "2", "--run-dir",
                             str(tmp_path / "run"))
    with pytest.raises(InputError) as refused:
        supervisor_config(list(MODEL), JobGpus((0, 1, 2, 3)), rendezvous, options)
    assert refused.value.message == (
        "--gpus-per-node 2 is below this node's 4 GPUs (--nproc-per-node): across nodes the "
        "planner takes each node's GPUs as one node and would not apply it; give no "
        "--gpus-per-node")
    options["gpus_per_node"] = 4  # the node's own size says nothing new: taken
    assert supervisor_config(list(MODEL), JobGpus((0, 1, 2, 3)), rendezvous, options).gpus_per_node == 4


def test_the_events_of_a_catch_up_outlive_a_publish_a_stop_abandons(tmp_path):
    """What a catch-up copied, and what failed, are events before this node publishes its
    holdings: a stop signal abandons that publish on a hung store, which lost them."""
    from ftmaster.monitor.backends.bounded import Abandoned
    from ftmaster.peer_files import Copied
    from ftmaster.replication import ReplicationFailed

    def abandoned(number):
        raise Abandoned("stopped waiting for memory/2/1")

    membership, joined = seat_in_a_silent_round((2, 2), 1)
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1),
                              first_plan=None)
    replication = types.SimpleNamespace(url="http://node1:1", used_bytes=lambda: 10)
    supervisor = Supervisor(config, PlanningMonitor(False), membership, replication=replication)
    supervisor.round, supervisor.agreement = joined, types.SimpleNamespace(publish=abandoned)
    with pytest.raises(Abandoned):
        supervisor._report_replicated([
            ReplicationFailed(4, "timed out"),
            (0, Copied(4, tmp_path / "iter_0000004", 10, 0.5, ()))])
    events = [e["event"] for e in runfiles.read_events(tmp_path)]
    assert events == ["replication_failed", "replicated"]


@pytest.mark.parametrize("on_disk, status", [(40, 0), (30, 75)])
def test_a_node_that_finds_no_store_and_the_schedules_last_checkpoint_on_disk_ends_well(
        tmp_path, monkeypatch, on_disk, status):
    """A node started again after its ftmaster was killed, once the other nodes had completed
    the job and left with the store: it asked for a requeue (exit 75) of a finished job."""
    from ftmaster import launch
    from ftmaster.membership import NodeMembership, RendezvousConfig, StoreLost
    from ftmaster.recovery.checkpoints import tracker_path
    from test_checkpoint_discovery import write_checkpoint

    def store_gone(self):
        raise StoreLost("cannot reach the rendezvous store at 127.0.0.1:1")

    monkeypatch.setattr(NodeMembership, "connect", store_gone)
    save = tmp_path / "ckpt"
    write_checkpoint(save, on_disk)  # whole: a load would take it
    tracker_path(save).write_text(str(on_disk))
    rendezvous = RendezvousConfig("127.0.0.1:1", "job", 1, 2, 1, local_addr="127.0.0.1")
    args = [*MODEL[1:], "--train-iters", "40", "--save", str(save)]
    with pytest.raises(launch.EndedBeforeJoining) as ended:
        launch._membership(rendezvous, 2, args, types.SimpleNamespace(came_early=lambda: False),
                           tmp_path / "run")
    assert ended.value.status == status


def test_a_straggler_named_anew_is_in_line_once_with_its_newest_figures(tmp_path):
    """A GPU slow again after a recovery is named anew: waiting to be weighed, it was said
    'keeping GPU 1: GPU 1 is slower and weighed first'; behind another, it stood in line
    twice, weighed (and said kept) once per time it was named."""
    from ftmaster.monitor.stragglers import Straggler
    from ftmaster.stragglers import Found

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))

    def named(gpu: int, slowdown: float, iteration: int) -> Found:
        return Found(gpu, Straggler(gpu, iteration, iteration - 3, slowdown, 2.0, 20.0, 10.0),
                     1.0, 0.5)

    supervisor._weigh_first(named(1, 2.8, 13))
    newest = named(1, 2.5, 30)
    supervisor._weigh_first(newest)
    assert supervisor._straggler_to_drain is newest
    assert not [e for e in runfiles.read_events(tmp_path) if e["event"] == "straggler_kept"]
    supervisor._weigh_first(named(2, 1.9, 31))
    latest_of_2 = named(2, 2.1, 50)
    supervisor._weigh_first(latest_of_2)
    assert supervisor._stragglers_behind == [latest_of_2]


@pytest.mark.parametrize("upstream, extra, warned", [
    (True, ["--use-distributed-optimizer"], True),
    (True, ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"], False),
    (True, [], False),
    (False, ["--use-distributed-optimizer"], False),  # ftmaster's trainer: always reshardable
])
def test_upstream_megatron_lms_distributed_optimizer_is_told_to_save_fully_reshardable(
        tmp_path, upstream, extra, warned):
    """Upstream's default DP-reshardable optimizer state loads only on the same TP and PP:
    every relaunch on a new layout failed at its load, with nothing said before."""
    from ftmaster.launch import optimizer_reshard_warning
    from helpers.trainer import PRETRAIN

    script = tmp_path / "pretrain_gpt.py"
    script.write_text("import argparse\n")
    path = str(script) if upstream else PRETRAIN
    warning = optimizer_reshard_warning([path, *MODEL, *extra])
    assert (warning is not None) == warned
    # It told users to give --no-load-optim to relaunches, which resume_from_save removes
    # from every relaunch from the run's own checkpoints.
    assert warning is None or "give --no-load-optim" not in warning


def test_a_relaunch_under_a_batch_schedule_plans_from_the_checkpoints_samples(tmp_path):
    """The planner was given no consumed samples: every batch of the schedule, passed ones
    too, had to divide by the new DP. Schedule 0:8, then 24 from 960 tokens (30 samples), on
    6 GPUs with a checkpoint at iteration 10 (8 x 4 + 24 x 6 = 176 samples, past 30): DP 6."""
    from ftmaster.recovery.planner import plan_layout
    from test_persist import fake_checkpoint

    command = ["t.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "100",
               "--step-batch-size-schedule", "0:8 960:24", "--save", str(tmp_path / "ckpt")]
    config = SupervisorConfig(run_dir=tmp_path / "run", command=tuple(command),
                              gpus=tuple(range(8)), first_plan=check_layout(command, 8, None, None))
    supervisor = Supervisor(config, StubMonitor(False))
    assert supervisor._planner_options()["consumed_samples"] is None  # no checkpoint yet
    fake_checkpoint(tmp_path / "ckpt", 10)
    options = supervisor._planner_options()
    assert options["consumed_samples"] == 176
    assert plan_layout(command, 6, original_world_size=8, **options).data_parallel_size == 6


def test_across_nodes_a_round_plans_on_the_samples_of_the_round_not_its_own_look(tmp_path):
    """Each node planned on its own look at --save: a look that saw a newer checkpoint than
    another node's planned other data-parallel sizes. Schedule 0:8, then 24 from 30 samples,
    on two nodes of 3 GPUs: planned as at sample 0 (another node could not tell), DP 4; from
    this node's checkpoint (176 samples), DP 6. This node says what its look found."""
    import dataclasses

    from test_persist import fake_checkpoint

    command = ("t.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "100",
               "--step-batch-size-schedule", "0:8 960:24", "--save", str(tmp_path / "ckpt"))
    fake_checkpoint(tmp_path / "ckpt", 10)
    for theirs, data_parallel in ((None, 4), (176, 6)):
        mine, other = two_nodes(3).nodes
        joined = dataclasses.replace(two_nodes(3), nodes=(
            dataclasses.replace(mine, consumed_samples=176),
            dataclasses.replace(other, consumed_samples=theirs)))
        membership = RoundMembership(joined, max_nodes=2)
        config = SupervisorConfig(run_dir=tmp_path / f"run-{theirs}", command=command,
                                  gpus=(0, 1, 2), first_plan=None)
        supervisor = Supervisor(config, PlanningMonitor(False), membership)
        assert supervisor._plan() is Trigger.PLANNED
        assert membership.consumed_samples == 176
        assert supervisor.plan.data_parallel_size == data_parallel

@pytest.mark.parametrize("final_saved", [True, False])
def test_a_node_that_never_read_the_jobs_end_completes_when_save_holds_its_last_checkpoint(
        tmp_path, final_saved):
    """A spare past --nnodes' maximum, or a late first joiner, finds the rendezvous closed
    with no outcome it can read: a job that completed ended there as a give-up, exit 1 with
    'requeueing may help', which SLURM's requeue of a finished job repeats."""
    from ftmaster.membership import UNTOLD_END
    from ftmaster.recovery.checkpoints import advance_tracker
    from test_checkpoint_discovery import write_checkpoint

    command = (*MODEL, "--train-iters", "20", "--save", str(tmp_path / "ckpt"))
    write_checkpoint(tmp_path / "ckpt", 20 if final_saved else 10)
    advance_tracker(tmp_path / "ckpt", 20 if final_saved else 10)
    membership = RoundMembership(two_nodes(2), max_nodes=2)
    membership.acknowledge = lambda stop: None
    config = SupervisorConfig(run_dir=tmp_path / "run", command=command, gpus=(0, 1),
                              first_plan=None)
    supervisor = Supervisor(config, PlanningMonitor(False), membership)
    ended = supervisor._job_ended(UNTOLD_END)
    last = runfiles.read_events(tmp_path / "run")[-1]
    if final_saved:
        assert ended is Trigger.COMPLETED and (last["event"], last["iteration"]) == ("complete", 20)
    else:
        assert ended is Trigger.GIVE_UP and (last["event"], last["requeue"]) == ("gave_up", True)

def test_a_straggler_drain_weighs_the_slowest_straggler_that_would_stay(tmp_path):
    """The GPUs left run at the pace of the slowest straggler still slow among them."""
    from ftmaster.monitor.stragglers import Straggler
    from ftmaster.stragglers import Found

    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), drain_stragglers=True)
    supervisor = Supervisor(config, StubMonitor(True))
    behind = [Found(gpu, Straggler(gpu, 16, 10, factor, factor, 10.0 * factor, 10.0), 1.0, 0.5)
              for gpu, factor in ((2, 1.5), (3, 1.9), (0, 3.0))]
    supervisor._stragglers_behind = behind
    supervisor.stragglers.tracker.not_known_fast = lambda rank: rank != 0  # GPU 0: fast again
    assert supervisor._slowest_staying([0, 2, 3]) is behind[1]
    assert supervisor._slowest_staying([0, 2]) is behind[0]
    assert supervisor._slowest_staying([0]) is None


def test_a_nodes_join_stops_the_attempt_as_a_failure_marked_rejoin(tmp_path):
    """The report and goodput tell a scale-up from a peer's fault by the failure's reason."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None), scale_up="now")
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor.attempt = types.SimpleNamespace(number=1, kill=lambda: None, stuck_gpus={})
    assert supervisor._rejoin(5) is Trigger.PEERS_WAITING
    (stopped,) = [e for e in runfiles.read_events(tmp_path) if e["event"] == "failure"]
    assert (stopped["cause"], stopped["reason"]) == ("peer", "rejoin")


def test_the_supervisors_save_requests_say_who_and_why_as_the_monitors_do(tmp_path):
    """DESIGN's flag: who asked and why (gpu, reasons); a drain's flag had a lone 'reason'."""
    config = SupervisorConfig(run_dir=tmp_path, command=tuple(MODEL), gpus=(0, 1, 2, 3),
                              first_plan=check_layout(MODEL, 4, None, None))
    supervisor = Supervisor(config, StubMonitor(True))
    supervisor._ask_for_a_save(source="straggler", gpu=1, reason="draining GPU 1: ...")
    flag = runfiles.read_flag(runfiles.trigger_flag_path(tmp_path))
    assert (flag["source"], flag["gpu"], flag["reasons"]) == ("straggler", 1,
                                                              ["draining GPU 1: ..."])


@pytest.mark.parametrize("removed", ["the lock file", "the run directory"])
def test_a_run_directory_lock_removed_while_another_launch_waits_is_not_the_one_it_takes(
        tmp_path, removed):
    """A refused launch takes away the run directory it made, lock file and all, before it
    lets go of the lock; a launch waiting on it then held a file no longer there, and a third
    launch locked a new one: two ftmasters on one run directory."""
    import shutil
    import threading

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = RunDirLock(run_dir)
    first.acquire()
    take_away = (first.path.unlink if removed == "the lock file"
                 else lambda: shutil.rmtree(run_dir))
    removed = threading.Timer(0.1, lambda: (take_away(), first.release()))
    removed.start()
    second = RunDirLock(run_dir)
    second.acquire()  # waits up to PROBE_HOLD_S: the first lets go at 0.1 s
    removed.join()
    try:
        assert first.path.exists()
        assert os.fstat(second._fd).st_ino == first.path.stat().st_ino
        with pytest.raises(RunDirLocked):
            RunDirLock(run_dir).acquire()
    finally:
        second.release()


@pytest.mark.parametrize("trainer", [True, False])
def test_an_xid_rehearsal_holds_its_signal_only_for_the_trainer_that_arms_a_handler(tmp_path,
                                                                                     trainer):
    """The rank holds the XID's signal until the trainer's handler is armed; a script with
    its own parser never arms one, so held, the XID changed nothing and the rank trained on.
    Unheld, the signal kills that script's rank, as a lost GPU would."""
    from ftmaster.faults import CUDA_ERROR_ENV
    from helpers.trainer import PRETRAIN

    script = PRETRAIN if trainer else str(tmp_path / "pretrain_gpt.py")
    if not trainer:
        Path(script).write_text("import argparse\n")
    command = (script, *MODEL[1:])
    config = SupervisorConfig(run_dir=tmp_path, command=command, gpus=(0, 1, 2, 3),
                              first_plan=check_layout(list(command), 4, None, None),
                              injections=(parse_injection("xid:gpu=1,code=95,at=iter:3"),))
    supervisor = Supervisor(config, StubMonitor(False))
    assert (CUDA_ERROR_ENV in supervisor._armed_injections((0, 1, 2, 3))) is trainer


def test_a_launch_refused_at_another_ones_lock_takes_away_nothing_of_it(tmp_path, monkeypatch):
    """Two launches on a run directory that did not exist: the second saw it missing, the
    first made it and took its lock, and the refused second then removed that lock file and
    the run directory, so a third launch locked anew beside the first: two ftmasters."""
    from ftmaster import launch as launch_module
    from ftmaster.lock import LOCK_NAME

    run_dir = tmp_path / "runs" / "first"
    config = types.SimpleNamespace(command=("pretrain_gpt.py",), run_dir=run_dir,
                                   scratch_memory_dir=None)
    first = RunDirLock(run_dir)
    lock_run_dir = launch_module._lock_run_dir

    def first_launch_locks_meanwhile(folder):
        folder.mkdir(parents=True)
        first.acquire()
        return lock_run_dir(folder)

    monkeypatch.setattr(launch_module, "_lock_run_dir", first_launch_locks_meanwhile)
    try:
        with pytest.raises(click.ClickException) as refused:
            HeldFolders(config, None)
        assert refused.value.exit_code == 2 and "another ftmaster" in refused.value.message
        assert (run_dir / LOCK_NAME).exists()
        with pytest.raises(RunDirLocked):
            RunDirLock(run_dir).acquire()
    finally:
        first.release()
