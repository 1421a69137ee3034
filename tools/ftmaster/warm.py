"""Warm workers: interpreters that imported torch, megatron-core and the trainer before they
are needed, so a relaunch hands each rank to one instead of starting a new interpreter.

A cold launch runs ``torchrun``, which imports torch (2-4 s here) before it starts the
ranks, and each rank imports torch, megatron-core and the trainer again (5-8 s; 2.7-3.0 s for
a 3-rank relaunch since megatron-core's compile decorators are deferred): most of a
recovery's time. A warm worker is ``python -u -m ftmaster.warm`` started by ftmaster ahead of
time. It imports the model stack, says ``ready`` on its stdout and blocks on its stdin. A launch
writes it one assignment (the rank's environment exactly as torchrun sets it, the argv, the
working folder and the attempt's log), and the worker runs the script as ``__main__`` in the
same process: the imports are already in ``sys.modules``.

Why pre-spawned interpreters rather than torch elastic's ``start_processes`` with the
``forkserver`` start method and ``set_forkserver_preload``: importing torch starts a native
thread (measured: 2 threads in ``/proc/self/task`` after ``import torch``), so a forkserver
that preloads torch forks a multi-threaded process, which POSIX only makes safe for
async-signal-safe calls until ``exec``. An assignment written to a pipe costs as little as a
fork, and every worker here was started by ``exec``.

What a worker holds before its assignment: no CUDA context (``torch.cuda`` is never touched,
CUDA_VISIBLE_DEVICES is only set with the assignment), no process group, no GPU. It says so in
its ready line, which the pool checks. While it waits it runs under ``SCHED_IDLE`` when it can
leave that policy afterwards (root, or ``RLIMIT_NICE`` allows), and its session at nice 19
(the scheduler weighs sessions before processes), so that a fresh set importing beside a
training attempt takes next to no CPU from it.

Everything the supervisor relies on holds as in a cold launch: each worker dies with ftmaster
(``PR_SET_PDEATHSIG``), runs in its own session, has its rank record written (pid, then exit
status and the time it ended, by a thread that waits for it) and writes its uncaught exception
to the rank's error file; :class:`WarmRanks` answers ``poll``/``wait`` as torchrun would.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ftmaster import runfiles
from ftmaster.faults import CUDA_ERROR_ENV, CUDA_ERROR_SIGNAL
from ftmaster.guard import (ERROR_FILE_ENV, RANK_DIR_ENV, die_with_parent, error_file_path,
                            write_rank_record)
from ftmaster.membership import free_port
from ftmaster.recovery.torchrun import StaticWorld

PRELOAD = ("torch", "torch._dynamo", "megatron.core", "megatron.training.training",
           "megatron.training.checkpointing")
"""What a worker imports before it is ready; a module that does not import is skipped (a
script other than ``pretrain_gpt.py`` still gets torch). TorchDynamo because torch's optimizer
imports it at its first ``add_param_group`` (0.5 s of a warm rank's model set-up here, once
megatron-core's import no longer brought it in: ``megatron.training.deferred_compile``)."""
WARM_UP = ("megatron.training.checkpointing.start_writer_results_queue",)
"""Start-up work that holds no GPU, process group or rank, done before the worker is ready:
the async checkpoint writers' result queue, a spawned Manager server (1.3 s of a rank's start
here, and 4 ranks start 4 of them at once). Only for a command that saves asynchronously
(:func:`warm_up_for`)."""
WORKER_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
"""A worker's environment until its rank's replaces it: megatron-core asks
``torch.cuda.is_available()`` as it is imported, which by default initialises the CUDA
driver with ftmaster's ``CUDA_VISIBLE_DEVICES`` (see :func:`_cuda_driver_loaded`); torch asks
NVML instead with this set."""
READY_TIMEOUT_S = 120.0
"""How long a launch waits for a set still importing before it starts cold instead."""
SESSION_GRACE_S = 1.0
"""How long what a killed worker started may take to end on its death signal before it is
killed too."""
MAX_DEATHS_BEFORE_READY = 3
"""Workers that may die before their ready line, with no full set ready in between, until the
pool gives up on warm starts."""

log = logging.getLogger("ftmaster")
try:  # imported before the environment is replaced: it finds argv's memory through it
    from setproctitle import setproctitle as _setproctitle
except ImportError:
    _setproctitle = None


# ---- the worker -------------------------------------------------------------------------------
CAP_SYS_NICE = 23
IDLE_SESSION_NICE = 19
"""A waiting worker's session: the least CPU share there is."""


def _may_leave_idle_policy() -> bool:
    """Whether this process may go back from SCHED_IDLE to SCHED_OTHER: it needs
    ``RLIMIT_NICE`` >= 20 or CAP_SYS_NICE (root in a container may lack it)."""
    import resource
    if resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20:
        return True
    try:
        status = Path("/proc/self/status").read_text()
        effective = int(next(line.split()[1] for line in status.splitlines()
                             if line.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError):
        return False
    return bool(effective >> CAP_SYS_NICE & 1)


def set_session_nice(pid: int, nice: int, deadline_s: float = 5.0) -> bool:
    """The nice value of the process's session as a whole (``/proc/PID/autogroup``).

    With autogroups on (sched(7); the default of most distributions), the scheduler first
    shares the CPU between sessions, each weighed by its session's nice value, and only then
    between the processes of a session. A worker runs in a session of its own, so SCHED_IDLE
    alone made it the lowest only among itself: measured on 2 cores, a 4-rank attempt's
    imports took 13 s beside 4 workers importing, and 6 s without them. A nice of 0 or more
    needs no privilege; writers without CAP_SYS_ADMIN are held to one write per 100 ms across
    the machine (EAGAIN), hence the retries, jittered: every rank of a node and the workers
    started to replace them ask at once. False if it is still not set at ``deadline_s``.
    Nothing to do where there is no autogroup (a cgroup with its own CPU controller shares
    the CPU instead)."""
    path, deadline = Path(f"/proc/{pid}/autogroup"), time.monotonic() + deadline_s
    while True:
        try:
            path.write_text(str(nice))
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(random.uniform(0.05, 0.15))
        except OSError:
            return True


def _idle_priority_reversibly() -> bool:
    """SCHED_IDLE while importing and waiting, when the worker may leave it later; its
    session at the lowest weight either way (it may always go back to nice 0)."""
    set_session_nice(os.getpid(), IDLE_SESSION_NICE)
    if not _may_leave_idle_policy():
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return True
    except OSError:
        return False


def warm_up_for(command: Sequence[str]) -> tuple[str, ...]:
    """The start-up work a worker does for ``command``: the writers' queue only for
    ``--async-save``. Synchronous saves write in the rank and take an in-process queue; a
    Manager started for them would hold some 200 MiB per rank and put a round trip through it
    into every save."""
    return WARM_UP if "--async-save" in command else ()


def _preload(warm_up: Sequence[str]) -> dict:
    """Import the model stack and do ``warm_up``; what the worker holds afterwards."""
    start = time.perf_counter()
    with _compile_deferred():
        for name in PRELOAD:
            try:
                __import__(name)
            except ImportError:
                continue
    for path in warm_up:
        module, _, function = path.rpartition(".")
        if module in sys.modules:
            getattr(sys.modules[module], function)()
    torch = sys.modules.get("torch")
    cuda = bool(torch is not None and torch.cuda.is_initialized()) or _cuda_driver_loaded()
    group = bool(torch is not None and torch.distributed.is_available()
                 and torch.distributed.is_initialized())
    return {"pid": os.getpid(), "import_s": round(time.perf_counter() - start, 3),
            "cuda_initialized": cuda, "process_group": group}


def _cuda_driver_loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether the CUDA driver is in this process. ``cudaGetDeviceCount`` (torch's
    ``cuda.is_available()``) loads and initialises it, and it reads ``CUDA_VISIBLE_DEVICES``
    then, once: the rank's, set later, would be ignored, and the rank run on the GPU of its
    local rank in ftmaster's view (a retired one too). ``torch.cuda.is_initialized()`` does
    not tell: it is torch's own lazy start."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as lines:
            return any("libcuda.so" in line for line in lines)
    except OSError:
        return False


def _compile_deferred() -> contextlib.AbstractContextManager:
    """megatron-core's compile decorators deferred to their first call, as in the trainer's
    own imports (``megatron.training.deferred_compile``), where the trainer is installed."""
    try:
        from megatron.training.deferred_compile import compile_at_first_call
    except ImportError:
        return contextlib.nullcontext()
    return compile_at_first_call()


def _leave_idle_scheduling() -> None:
    """SCHED_OTHER for every thread of this worker and of what WARM_UP started: the policy is
    a thread's, and the threads started while waiting (torch's, an async save's results
    server's, and the ones those start later for each save) stayed at SCHED_IDLE's weight."""
    import psutil

    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            for thread in process.threads():
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    os.sched_setscheduler(thread.id, os.SCHED_OTHER, os.sched_param(0))


def _take_assignment(assignment: dict, idle: bool) -> None:
    """Become the rank: its environment, folder, output, priority and argv."""
    os.environ.clear()
    os.environ.update(assignment["env"])
    os.environ[runfiles.ASSIGNED_AT_ENV] = repr(time.time())
    if CUDA_ERROR_ENV not in os.environ:  # no rehearsal: no handler will unblock it
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {CUDA_ERROR_SIGNAL})
    os.chdir(assignment["cwd"])
    restored = set_session_nice(os.getpid(), 0)
    if idle:
        _leave_idle_scheduling()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and "torch" in sys.modules:  # OpenMP read it at import: too early
        sys.modules["torch"].set_num_threads(int(threads))
    log_fd = os.open(assignment["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.close(null_fd)
    if not restored:  # said in the rank's own log, where a slow rank is looked into
        print(f"warning: this rank's session is left at nice {IDLE_SESSION_NICE} (the kernel "
              f"kept refusing the change): under CPU contention it trains slower",
              file=sys.stderr, flush=True)
    sys.argv = list(assignment["argv"])
    _show_command(assignment["argv"])


def _show_command(argv: Sequence[str]) -> None:
    """In ps, the command a cold rank runs (``python -u SCRIPT ARGS``), so that whoever
    looks for the training processes, or kills them by name, finds these too."""
    if _setproctitle is not None:
        _setproctitle(" ".join([sys.executable, "-u", *argv]))


def _run_script(argv: Sequence[str]) -> None:
    """What ``python -u ARGV...`` runs: a script, or ``-m MODULE``."""
    import runpy
    if argv[0] == "-m":
        sys.argv = list(argv[1:])
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def _private_channel():
    """The pipes to the pool, moved off stdin and stdout to descriptors no child inherits
    (Python's are close-on-exec): a helper that WARM_UP spawns must not hold the assignment
    pipe open after this worker died, nor write before the ready line."""
    assignments = os.fdopen(os.dup(0), "r")
    answers = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    return assignments, answers


def serve() -> None:
    """``python -u -m ftmaster.warm RUN_DIR POOL_PID [WARM_UP...]``: import, do the warm-up
    work named, say ready, run the one rank given. The run folder is only shown (in ps: whose
    worker this is)."""
    # The pool's pid, not getppid(): a pool that died while this interpreter started would
    # leave it reparented, and getppid() would then name the new parent.
    die_with_parent(int(sys.argv[2]))
    # A rehearsed XID may be signalled once the rank is handed over, before the trainer arms
    # its handler: it waits, blocked (for every thread started from here on), until then.
    signal.pthread_sigmask(signal.SIG_BLOCK, {CUDA_ERROR_SIGNAL})
    _show_command(["-m", "ftmaster.warm", *sys.argv[1:]])  # now: it reads the environment once
    idle = _idle_priority_reversibly()
    assignments, answers = _private_channel()
    ready = _preload(sys.argv[3:])
    answers.write(json.dumps(ready) + "\n")
    answers.close()
    line = assignments.readline()
    assignments.close()
    if not line:
        return  # the pool closed: never handed a rank
    assignment = json.loads(line)
    _take_assignment(assignment, idle)
    _run_script(assignment["argv"])


# ---- the pool ---------------------------------------------------------------------------------
@dataclass
class WarmWorker:
    """One waiting interpreter, as the pool sees it."""

    process: subprocess.Popen
    ready: dict | None = None
    """Its ready line once it came: pid, import seconds, whether it holds CUDA or a group."""
    _reader: threading.Thread | None = field(default=None, repr=False)

    def start_reading(self, then: Callable[[], None]) -> None:
        def read() -> None:
            line = self.process.stdout.readline()
            try:
                self.ready = json.loads(line) if line else None
            except ValueError:
                self.ready = None
            then()
        self._reader = threading.Thread(target=read, daemon=True, name="warm-ready")
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def stopped(self) -> bool:
        """Stopped (SIGSTOP, a debugger): a rank handed to it would never start, and its
        peers would wait out the process-group timeout for it."""
        import psutil
        try:
            return psutil.Process(self.process.pid).status() in (psutil.STATUS_STOPPED,
                                                                 psutil.STATUS_TRACING_STOP)
        except psutil.Error:
            return False

    @property
    def usable(self) -> bool:
        """Ready, alive, running and clean: never handed a rank otherwise."""
        return self.alive and self.ready is not None and not self.unclean and not self.stopped

    @property
    def unclean(self) -> bool:
        """Ready holding CUDA or a process group: what its imports did, as they will in
        every worker."""
        return self.ready is not None and bool(self.ready["cuda_initialized"]
                                               or self.ready["process_group"])


class WarmPool:
    """``size`` warm workers kept ready; :meth:`take` hands out a set, and a fresh set starts
    importing at once, so every recovery finds one."""

    def __init__(self, size: int, run_dir: Path, python: str = sys.executable,
                 on_ready: Callable[[dict], None] | None = None,
                 warm_up: Sequence[str] = WARM_UP) -> None:
        if size < 1:
            raise ValueError(f"a warm pool needs at least one worker, got {size}")
        self.size = size
        self.run_dir = Path(run_dir)
        self.log_path = runfiles.logs_dir(self.run_dir) / "warm_workers.log"
        self.on_ready = on_ready
        """Called (from a reader thread) each time the pool holds ``size`` usable workers
        again: the ``warm_ready`` event."""
        self._lock = threading.Lock()
        self._told_ready = False
        self.python = python
        self.warm_up = tuple(warm_up)
        self.workers: list[WarmWorker] = []
        self.replaced = 0
        self.deaths_before_ready = 0
        self.unclean = False
        """Workers were ready holding CUDA or a process group: no more are started."""
        self.cancelled: threading.Event | None = None
        """Set (ftmaster's stop request): a :meth:`take` waiting for a set ends at once."""
        self.spawn_failure: str | None = None
        """Why the last worker the pool tried to start could not be (None: it started)."""
        self.fill()

    @property
    def broken(self) -> bool:
        """Workers keep dying before they are ready (an import that crashes), or are ready
        unclean: stop starting them; launches go cold."""
        return self.deaths_before_ready >= MAX_DEATHS_BEFORE_READY or self.unclean

    def fill(self) -> None:
        """Replace the dead, and start workers until there are ``size``. Started from the
        thread that lives as long as ftmaster (the death signal follows the parent thread)."""
        self._end_stopped()
        dead = [w for w in self.workers if not w.alive]
        for worker in dead:
            log.warning("warm worker %d died while waiting (exit status %s; see %s); replacing it",
                        worker.process.pid, worker.process.returncode, self.log_path)
            self.workers.remove(worker)
            self.replaced += 1
            self.deaths_before_ready += worker.ready is None
        unclean = [w for w in self.workers if w.unclean]
        if unclean:  # never usable: a launch waited its whole timeout for them, every time
            log.warning("warm workers hold CUDA or a process group once imported (pid %s): "
                        "no more warm starts", ", ".join(str(w.process.pid) for w in unclean))
            kill_sessions(unclean)
            self.workers = [w for w in self.workers if w not in unclean]
            self.unclean = True
        if self.broken:
            return
        while len(self.workers) < self.size:
            worker = self._spawn()
            with self._lock:
                self.workers.append(worker)

    def _refill(self) -> None:
        """:meth:`fill` within a take: a worker that cannot be started (a pids limit, no
        memory, a run directory gone read-only) is said once, and the take goes on with the
        workers at hand (a launch then starts cold)."""
        try:
            self.fill()
        except OSError as error:
            if self.spawn_failure is None:
                log.warning("warm workers: a new one could not be started (%s); launches take "
                            "those at hand, or start cold", error)
            self.spawn_failure = str(error)
        else:
            self.spawn_failure = None

    def _end_stopped(self) -> None:
        """Stopped workers are ended and replaced: one that is never continued would hold
        its place, and a launch would wait for it, or hand it a rank."""
        stopped = [w for w in self.workers if w.alive and w.stopped]
        for worker in stopped:
            log.warning("warm worker %d is stopped (SIGSTOP or a debugger) while waiting; "
                        "ending and replacing it", worker.process.pid)
        kill_sessions(stopped)
        self.workers = [w for w in self.workers if w not in stopped]
        self.replaced += len(stopped)

    def _spawn(self) -> WarmWorker:
        """A new worker; what it says before its rank (an import that fails) goes to
        ``RUN_DIR/logs/warm_workers.log``."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as errors:
            process = subprocess.Popen(
                [self.python, "-u", "-m", "ftmaster.warm", str(self.run_dir), str(os.getpid()),
                 *self.warm_up],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True,
                start_new_session=True, env={**os.environ, **WORKER_ENV})
        worker = WarmWorker(process)
        self._told_ready = False
        worker.start_reading(self._check_ready)
        return worker

    def _check_ready(self) -> None:
        with self._lock:
            workers = list(self.workers)
            if self._told_ready or len(workers) < self.size or not all(w.usable for w in workers):
                return
            self._told_ready = True
            self.deaths_before_ready = 0  # imports work: deaths from now on are counted anew
        if self.on_ready is not None:
            self.on_ready({"workers": len(workers),
                           "import_s": max(w.ready["import_s"] for w in workers)})

    def _hurry(self) -> None:
        """A launch waits for workers still importing: they leave SCHED_IDLE (a CPU hog would
        otherwise starve them for as long as it runs)."""
        for worker in self.workers:
            if worker.alive and worker.ready is None:
                set_session_nice(worker.process.pid, 0)
                try:
                    os.sched_setscheduler(worker.process.pid, os.SCHED_OTHER, os.sched_param(0))
                except OSError:
                    pass

    def take(self, count: int, timeout_s: float = READY_TIMEOUT_S) -> list[WarmWorker] | None:
        """``count`` usable workers (waiting for a set still importing), or None when they do
        not come within ``timeout_s``. The pool is filled again at once either way."""
        if count > self.size:
            return None
        deadline = time.monotonic() + timeout_s
        while True:
            self._refill()
            usable = [w for w in self.workers if w.usable]
            if len(usable) >= count:
                taken = usable[:count]
                # a set was ready, whether or not the reader thread saw it whole first
                self.deaths_before_ready = 0
                for worker in taken:
                    self.workers.remove(worker)
                    worker.process.stdout.close()  # its ready line is read; it writes no more
                self._refill()
                return taken
            short = self.spawn_failure is not None and len(self.workers) < count
            if self.broken or short or time.monotonic() >= deadline or self.stop_waiting:
                self._refill()
                return None
            self._hurry()
            time.sleep(0.02)

    @property
    def stop_waiting(self) -> bool:
        return self.cancelled is not None and self.cancelled.is_set()

    def close(self) -> None:
        """SIGKILL every waiting worker: none holds anything to clean up."""
        kill_sessions(self.workers)
        self.workers = []


def kill_sessions(workers: Sequence[WarmWorker], reap_s: float = 2.0,
                  grace_s: float = SESSION_GRACE_S) -> None:
    """SIGKILL each worker, then what it started (its session), and reap the workers that
    end within ``reap_s``. A rank stuck in the driver (uninterruptible sleep) outlives
    SIGKILL: a wait without a deadline hung the supervisor, and :meth:`Attempt.kill` decides
    what such a survivor means (its GPU retired).

    The worker goes first, and its session gets ``grace_s`` to follow it on the death
    signals it was given: an async save's results server ends on its SIGTERM and removes its
    ``/tmp/pymp-*`` folder, which a SIGKILL to the whole session left behind at every kill."""
    for worker in workers:
        with contextlib.suppress(OSError):
            os.kill(worker.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + reap_s
    for worker in workers:
        try:
            worker.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    sessions = {worker.process.pid for worker in workers}
    ends = time.monotonic() + grace_s
    while _session_members(sessions) and time.monotonic() < ends:
        time.sleep(0.02)
    for session in sessions:
        with contextlib.suppress(OSError):
            os.killpg(session, signal.SIGKILL)


def _session_members(sessions: set[int]) -> bool:
    """Whether a process of one of ``sessions`` is still there (zombies are gone already)."""
    import psutil

    for process in psutil.process_iter(["status"]):
        with contextlib.suppress(OSError, psutil.Error):
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(process.pid) in sessions:
                return True
    return False


# ---- one attempt on warm workers --------------------------------------------------------------
def rank_env(base: dict[str, str], local_rank: int, nproc: int, rank_dir: Path, run_id: str,
             world: StaticWorld | None, master_port: int) -> dict[str, str]:
    """A rank's environment as torchrun's agent sets it (``LocalElasticAgent._start_workers``),
    with rank 0 hosting the store (``TORCHELASTIC_USE_AGENT_STORE=False``: there is no agent)
    and the error file in the rank folder."""
    if world is None:
        world = StaticWorld(1, 0, "127.0.0.1", master_port, rank_offset=0, world_size=nproc)
    if world.world_size < world.rank_offset + nproc:
        raise ValueError(f"a warm launch needs the world's size and this node's rank offset, "
                         f"got {world}")
    rank = world.rank_offset + local_rank
    env = {**base,
           "RANK": str(rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(world.node_rank),
           "ROLE_RANK": str(rank), "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc),
           "WORLD_SIZE": str(world.world_size), "GROUP_WORLD_SIZE": str(world.nnodes),
           "ROLE_WORLD_SIZE": str(world.world_size), "MASTER_ADDR": world.master_addr,
           "MASTER_PORT": str(world.master_port), "TORCHELASTIC_RESTART_COUNT": "0",
           "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
           "TORCHELASTIC_USE_AGENT_STORE": "False",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
           ERROR_FILE_ENV: str(error_file_path(rank_dir, local_rank))}
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


class WarmRanks:
    """An attempt's ranks on warm workers, answering as the torchrun process would: ``poll``
    is None while a rank runs, then 0 when every rank succeeded, else 1."""

    def __init__(self, workers: list[WarmWorker], rank_dir: Path, envs: list[dict[str, str]],
                 command: Sequence[str], log_path: Path) -> None:
        """Hand every worker its rank; OSError (and every worker killed) when one could not
        take it: a worker that died after it was picked."""
        self.workers = workers
        try:
            for env in envs:
                Path(env[ERROR_FILE_ENV]).unlink(missing_ok=True)
            for worker, env in zip(workers, envs):
                worker.process.stdin.write(json.dumps({"env": env, "argv": list(command),
                                                       "cwd": os.getcwd(), "log": str(log_path)}) + "\n")
                worker.process.stdin.close()
        except OSError:
            self.kill_group()
            raise
        self._waiters = []
        for local_rank, (worker, env) in enumerate(zip(workers, envs)):
            record = {"local_rank": local_rank, "rank": int(env["RANK"]),
                      "pid": worker.process.pid, "guard_pid": worker.process.pid}
            write_rank_record(rank_dir, record)
            waiter = threading.Thread(target=_record_exit, args=(worker.process, rank_dir, record),
                                      daemon=True, name=f"warm-rank-{local_rank}")
            waiter.start()
            self._waiters.append(waiter)

    def poll(self) -> int | None:
        codes = [w.process.poll() for w in self.workers]
        if any(code is None for code in codes):
            return None
        for waiter in self._waiters:  # the records are written before the end is told
            waiter.join()
        return 0 if all(code == 0 for code in codes) else 1

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("warm ranks", timeout)
            time.sleep(0.01)
        return code

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def kill(self) -> None:
        self.kill_group()

    def kill_group(self) -> None:
        """SIGKILL every rank's session (its forked checkpoint writers included)."""
        kill_sessions(self.workers)


def _record_exit(process: subprocess.Popen, rank_dir: Path, record: dict) -> None:
    code = process.wait()
    write_rank_record(rank_dir, {**record, "exit_code": code, "ended_at": time.time()})


class LaunchCancelled(Exception):
    """A launch that waited for warm workers was given up: ftmaster was asked to stop."""


class WarmStarter:
    """Hands attempts to a :class:`WarmPool` of one worker per GPU of this node; cold (torchrun)
    when no set is ready in time, saying so in one line."""

    def __init__(self, gpus_on_node: int, run_dir: Path, warm_up: Sequence[str],
                 on_ready: Callable[[dict], None] | None = None) -> None:
        self.pool = WarmPool(gpus_on_node, run_dir, on_ready=on_ready, warm_up=warm_up)
        self.run_id = Path(run_dir).name

    def stop_waiting_on(self, stop: threading.Event) -> None:
        """A launch waiting for a set still importing ends its wait once ``stop`` is set (a
        SIGTERM or SIGINT to ftmaster), and :meth:`start` raises :class:`LaunchCancelled`: it
        waited up to 120 s, then started training only to stop it."""
        self.pool.cancelled = stop

    def start(self, command: Sequence[str], nproc: int, env: dict[str, str], rank_dir: Path,
              log_path: Path, world: StaticWorld | None) -> WarmRanks | None:
        workers = self.pool.take(nproc)
        if workers is None and self.pool.stop_waiting:  # nothing to start training for
            raise LaunchCancelled("ftmaster is stopping")
        if workers is None:
            why = ("warm workers hold CUDA or a process group once imported"
                   if self.pool.unclean else
                   f"{self.pool.deaths_before_ready} warm workers died before they were ready"
                   if self.pool.broken else f"no {nproc} warm workers ready within "
                   f"{READY_TIMEOUT_S:g} s")
            log.warning("%s: attempt starts cold, under torchrun", why)
            return None
        try:
            port = free_port("127.0.0.1") if world is None else world.master_port
            envs = [rank_env(env, r, nproc, rank_dir, self.run_id, world, port)
                    for r in range(nproc)]
        except BaseException:  # taken from the pool: no one else would ever end them
            kill_sessions(workers)
            raise
        try:
            return WarmRanks(workers, rank_dir, envs, command, log_path)
        except OSError as error:
            log.warning("a warm worker could not be handed its rank (%s): attempt starts cold, "
                        "under torchrun", error)
            return None

    @property
    def ready_to_start(self) -> bool:
        """False once the pool gave up (workers kept dying before they were ready)."""
        return not self.pool.broken

    def run_module(self, argv: Sequence[str], folder: Path) -> WarmRanks | None:
        """``python -m ...`` on a worker ready now (None if there is none), its output in
        ``folder/output.log``: for a helper on the recovery path, such as the replica merge."""
        workers = self.pool.take(1, timeout_s=0)
        if workers is None:
            return None
        env = {**os.environ, "RANK": "0", ERROR_FILE_ENV: str(error_file_path(folder, 0))}
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:  # taken from the pool, it would wait on, holding torch
            kill_sessions(workers)
            return None
        try:
            return WarmRanks(workers, folder, [env], argv, folder / "output.log")
        except OSError:  # every worker killed
            return None

    def close(self) -> None:
        self.pool.close()


if __name__ == "__main__":
    serve()
