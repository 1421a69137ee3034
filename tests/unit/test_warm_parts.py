"""Warm workers' kill and hand-over, on real processes standing in for workers (no torch)."""

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from ftmaster import warm
from ftmaster.warm import WarmStarter, WarmWorker, kill_sessions


class StuckInTheDriver:
    """A rank SIGKILL cannot end (uninterruptible sleep): it is never reaped."""

    pid = 2 ** 22 + 1  # no such session: the SIGKILL goes nowhere

    def wait(self, timeout=None):
        if timeout is None:
            raise AssertionError("waited for a process that may never end, without a deadline")
        time.sleep(timeout)
        raise subprocess.TimeoutExpired("rank", timeout)


def test_a_rank_that_outlives_sigkill_does_not_hold_up_the_kill():
    """The supervisor hung there, before its own bounded wait could retire the GPU."""
    started = time.monotonic()
    kill_sessions([WarmWorker(StuckInTheDriver())])
    assert time.monotonic() - started < 5


def sleeping_worker() -> WarmWorker:
    return WarmWorker(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                       start_new_session=True))


def test_workers_taken_for_a_launch_that_failed_before_the_hand_over_are_ended(tmp_path, monkeypatch):
    """Taken from the pool, then a port could not be had: they waited on, holding torch, until
    ftmaster exited."""
    workers = [sleeping_worker(), sleeping_worker()]
    starter = WarmStarter.__new__(WarmStarter)
    starter.pool, starter.run_id = SimpleNamespace(take=lambda nproc: workers), "run"

    def no_port(address):
        raise OSError("no free port")

    monkeypatch.setattr(warm, "free_port", no_port)
    try:
        with pytest.raises(OSError, match="no free port"):
            starter.start(["train.py"], 2, {}, tmp_path, tmp_path / "log", None)
        assert all(worker.process.poll() is not None for worker in workers)
    finally:
        for worker in workers:
            worker.process.kill()


def test_a_worker_taken_for_a_helper_whose_folder_cannot_be_made_is_ended(tmp_path):
    """The replica merge's helper folder under a full or read-only run directory: the worker
    taken from the pool waited on, holding torch, and the error escaped to the supervisor."""
    worker = sleeping_worker()
    starter = WarmStarter.__new__(WarmStarter)
    starter.pool = SimpleNamespace(take=lambda count, timeout_s: [worker])
    (tmp_path / "ranks").write_text("a file where the folder goes")
    try:
        assert starter.run_module(["-m", "json.tool"], tmp_path / "ranks" / "merge_1") is None
        assert worker.process.poll() is not None
    finally:
        worker.process.kill()


class RefusedAutogroup:
    """/proc/PID/autogroup refusing its first ``refusals`` writes, as the kernel does to
    writers without CAP_SYS_ADMIN beyond one write per 100 ms across the machine."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.written = refusals, None

    def __call__(self, path):
        return self

    def write_text(self, text):
        if self.refusals > 0:
            self.refusals -= 1
            raise BlockingIOError
        self.written = text


def test_a_rank_keeps_asking_for_its_session_nice_while_the_others_ask_too(monkeypatch):
    """8 ranks and the 8 workers started to replace them all ask at once: after 20 tries a
    rank gave up silently and trained at nice 19."""
    autogroup = RefusedAutogroup(25)
    monkeypatch.setattr(warm, "Path", autogroup)
    assert warm.set_session_nice(1234, 0) and autogroup.written == "0"
    monkeypatch.setattr(warm, "Path", RefusedAutogroup(10 ** 6))
    assert not warm.set_session_nice(1234, 0, deadline_s=0.3)


def test_a_launch_waiting_for_workers_still_importing_ends_its_wait_on_a_stop(tmp_path, monkeypatch):
    """SIGTERM to ftmaster while a relaunch waited for its warm set: the wait went on for up to
    120 s (READY_TIMEOUT_S), then training started only to be stopped; under a scheduler's
    grace period that wait could use up the time the ranks have to save."""
    import threading

    monkeypatch.setattr(warm.WarmPool, "fill", lambda self: None)  # no real workers
    monkeypatch.setattr(warm.WarmPool, "_hurry", lambda self: None)
    starter = WarmStarter.__new__(WarmStarter)
    starter.pool, starter.run_id = warm.WarmPool.__new__(warm.WarmPool), "run"
    pool = starter.pool
    pool.size, pool.workers, pool.deaths_before_ready, pool.cancelled = 2, [], 0, None
    pool.unclean, pool.spawn_failure = False, None
    stop = threading.Event()
    starter.stop_waiting_on(stop)
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(warm.LaunchCancelled):  # the supervisor then launches nothing
        starter.start(["train.py"], 2, {}, tmp_path, tmp_path / "log", None)
    assert time.monotonic() - started < 5


def fake_interpreter(tmp_path, before_ready: str = "", cuda: bool = False) -> str:
    """A stand-in for a worker's interpreter: it runs the shell lines ``before_ready``, says
    it is ready (holding CUDA when ``cuda``, else clean), then waits."""
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\n" + before_ready + "echo '{\"pid\": 1, \"import_s\": 0.1, "
                           f"\"cuda_initialized\": {str(cuda).lower()}, \"process_group\": false}}'\n"
                           "exec sleep 60\n")
    fake_python.chmod(0o755)
    return str(fake_python)


def test_workers_ready_holding_cuda_stop_warm_starts_at_once(tmp_path):
    """A worker whose imports initialised CUDA (or a process group) is never handed a rank,
    but it kept its place in the pool: every relaunch waited the whole READY_TIMEOUT_S for a
    set that could never be ready, then started cold, while the worker held its CUDA context
    beside training."""
    pool = warm.WarmPool(1, tmp_path, python=fake_interpreter(tmp_path, cuda=True))
    worker = pool.workers[0]
    try:
        started = time.monotonic()
        assert pool.take(1, timeout_s=10) is None
        assert time.monotonic() - started < 5
        assert worker.process.poll() is not None and pool.workers == [] and pool.broken
    finally:
        pool.close()
        worker.process.kill()


def test_a_waiting_worker_that_is_stopped_is_replaced_never_handed_a_rank(tmp_path, caplog):
    """A SIGSTOPped worker is alive and was ready, so it was handed a rank: the attempt's
    other ranks waited out the process-group timeout (66 s with a 0.5 min timeout here,
    10 min by default) and the relaunch failed, a restart of the budget spent on it."""
    import os
    import signal

    import psutil

    pool = warm.WarmPool(2, tmp_path, python=fake_interpreter(tmp_path))
    stopped = pool.workers[0]
    taken = []
    try:
        deadline = time.monotonic() + 10
        while not all(w.ready for w in pool.workers) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(stopped.process.pid, signal.SIGSTOP)
        status = psutil.Process(stopped.process.pid).status
        while status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:  # delivered
            time.sleep(0.01)
        taken = pool.take(2, timeout_s=10) or []
        assert len(taken) == 2 and stopped not in taken
        assert stopped.process.poll() is not None  # ended, not left stopped beside training
        assert f"warm worker {stopped.process.pid} is stopped" in caplog.text
    finally:
        pool.close()
        kill_sessions([stopped, *taken])


def test_workers_that_died_before_ready_count_only_until_a_set_is_ready_again(tmp_path):
    """Deaths before the ready line were counted over the whole run: three in all (a worker
    killed while it imported, now and then over days) and warm starts were off for good, as
    if imports crashed, though every set since had been ready."""
    counter = tmp_path / "spawns"
    # spawns 1, 2, 4 and 5 die while importing; 3 and 6 are ready
    taken, broken = taken_from_a_pool_of_one(
        tmp_path, f"echo x >> {counter}\ncase $(wc -l < {counter}) in *[1245]) exit 1;; esac\n",
        times=2)
    assert len(taken) == 2 and not broken


def taken_from_a_pool_of_one(tmp_path, before_ready: str, times: int = 1):
    """The workers ``times`` takes get from a pool of one whose interpreter runs the shell
    lines ``before_ready``, then says it is ready; and whether the pool broke."""
    pool = warm.WarmPool(1, tmp_path, python=fake_interpreter(tmp_path, before_ready))
    taken = []
    try:
        for _ in range(times):
            taken += pool.take(1, timeout_s=10) or []
        return taken, pool.broken
    finally:
        pool.close()
        kill_sessions(taken)


def test_a_worker_imports_with_torch_asking_nvml_and_says_when_the_cuda_driver_is_loaded(
        tmp_path):
    """megatron-core calls torch.cuda.is_available() as it is imported: by default that
    initialises the CUDA driver, which reads CUDA_VISIBLE_DEVICES then and never again, so a
    warm rank ran on the GPU of its local rank in ftmaster's view, a retired one too; and
    torch.cuda.is_initialized() still said the worker was clean."""
    seen = tmp_path / "env"
    taken, _ = taken_from_a_pool_of_one(tmp_path,
                                        f"echo \"$PYTORCH_NVML_BASED_CUDA_CHECK\" > {seen}\n")
    assert len(taken) == 1 and seen.read_text().strip() == "1"
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcudart.so.12\n")
    assert not warm._cuda_driver_loaded(maps)
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.570.1\n")
    assert warm._cuda_driver_loaded(maps)


def test_what_a_killed_worker_started_ends_on_its_death_signal_before_its_session_is_killed(
        tmp_path):
    """An async save's results server (a multiprocessing manager in the worker's session)
    removes its /tmp/pymp-* folder on the SIGTERM its parent's death sends it: the session's
    SIGKILL reached it first, and every kill of a warm rank left a folder behind."""
    cleaned = tmp_path / "cleaned"
    child = (
        "import ctypes, signal, sys, time\n"
        "ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (open({str(cleaned)!r}, 'w').close(), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n")
    parent = ("import subprocess, sys, time\n"
              f"child = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE)\n"
              "child.stdout.readline()\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    worker = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE,
                              start_new_session=True, text=True)
    assert worker.stdout.readline() == "ready\n"
    kill_sessions([WarmWorker(worker)])
    assert cleaned.exists()
    assert not warm._session_members({worker.pid})


def test_a_take_whose_refill_cannot_start_a_worker_still_hands_out_the_set(tmp_path, caplog):
    """The refill after a take could not start a new worker (a pids limit, ENOMEM): the
    error went out of the take with the taken workers out of the pool and alive, holding
    torch until ftmaster exited, and gave the run up. Now the set is handed out, the failure
    said once, and a take the pool cannot serve returns at once (a launch then starts cold)."""
    pool = warm.WarmPool(1, tmp_path, python=fake_interpreter(tmp_path))
    taken = []
    try:
        deadline = time.monotonic() + 10
        while not pool.workers[0].usable and time.monotonic() < deadline:
            time.sleep(0.02)
        pool.python = str(tmp_path / "gone")
        with caplog.at_level("WARNING", logger="ftmaster"):
            taken = pool.take(1, timeout_s=10) or []
            started = time.monotonic()
            assert pool.take(1, timeout_s=10) is None
        assert len(taken) == 1 and taken[0].alive
        assert time.monotonic() - started < 2
        assert caplog.text.count("a new one could not be started") == 1
    finally:
        pool.close()
        kill_sessions(taken)


def test_a_worker_given_its_rank_leaves_sched_idle_in_every_thread():
    """The scheduling policy is a thread's: only the worker's main thread left SCHED_IDLE,
    and the threads it had started (an async save's results server's among them) kept it."""
    script = (
        "import os, threading\n"
        "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
        "started = threading.Event(); release = threading.Event()\n"
        "def wait(): started.set(); release.wait()\n"
        "thread = threading.Thread(target=wait); thread.start(); started.wait()\n"
        "assert os.sched_getscheduler(thread.native_id) == os.SCHED_IDLE\n"
        "from ftmaster.warm import _leave_idle_scheduling\n"
        "_leave_idle_scheduling()\n"
        "print(os.sched_getscheduler(0) == os.SCHED_OTHER,\n"
        "      os.sched_getscheduler(thread.native_id) == os.SCHED_OTHER)\n"
        "release.set()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["True", "True"], done.stderr[-2000:]


@pytest.mark.parametrize("rehearsal", [True, False])
def test_a_worker_holds_an_xid_signal_until_its_rank_arms_the_handler_in_a_rehearsal(
        tmp_path, rehearsal):
    """A rehearsed XID is signalled once the rank is handed over, which a worker took while
    the trainer was still starting: the bare SIGUSR2 killed it, with no CUDA error. A worker
    holds it back (blocked) from its start; outside a rehearsal it lets it go at the hand-over,
    as nothing would unblock it later."""
    log = tmp_path / "log"
    env = {"PATH": "/usr/bin:/bin", **({"FTMASTER_INJECT_CUDA_ERROR": ""} if rehearsal else {})}
    code = ("import signal, sys\n"
            "from ftmaster import warm\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})  # as serve() starts\n"
            f"warm._take_assignment({{'env': {env!r}, 'cwd': {str(tmp_path)!r}, "
            f"'log': {str(log)!r}, 'argv': ['rank.py']}}, idle=False)\n"
            "print(signal.SIGUSR2 in signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert log.read_text().split() == [str(rehearsal)]
