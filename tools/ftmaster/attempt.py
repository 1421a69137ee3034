"""One launch attempt: torchrun and its ranks as real processes, started and stopped safely.

The attempt's argv (:func:`attempt_argv`) runs torchrun under ``ftmaster.guard exec`` and
every rank under ``ftmaster.guard rank`` (see :mod:`ftmaster.guard`), so the whole tree
dies when ftmaster does, and each rank reports its pid and exit status in the attempt's
rank folder. Training output goes to ``RUN_DIR/logs/attempt_<N>.log``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import psutil

from ftmaster import runfiles
from ftmaster.console import gpus_text
from ftmaster.exit_codes import TRAINER_CAUSES
from ftmaster.guard import (RANK_DIR_ENV, dying_with_this_process, error_file_path,
                            naming_this_process, rank_record_path)
from ftmaster.recovery.torchrun import StaticWorld, torchrun_argv
from ftmaster.warm import WarmStarter

EXIT_SIGNAL_FLAG = "--exit-signal-handler"
# How the trainer states an error it diagnosed itself (megatron.training.console.error).
TRAINER_ERROR_PREFIX = "error: "
# The first line of the report torchrun's agent prints when a worker fails.
TORCHRUN_FAILURE_REPORT = re.compile(r"elastic/multiprocessing/api\.py:\d+\] failed \(exitcode")

log = logging.getLogger("ftmaster")


def attempt_argv(command: Sequence[str], nproc: int, python: str = sys.executable,
                 world: StaticWorld | None = None, log_dir: Path | None = None) -> list[str]:
    """``guard exec torchrun ... -m ftmaster.guard rank SCRIPT ARGS`` as one argv list."""
    guarded = ["-m", "ftmaster.guard", "rank", *command]
    return dying_with_this_process(
        torchrun_argv(guarded, nproc, python=python, world=world, log_dir=log_dir), python)


def with_exit_signal_handler(command: Sequence[str]) -> list[str]:
    """``command`` with ``--exit-signal-handler`` appended when absent: SIGTERM then saves."""
    return list(command) if EXIT_SIGNAL_FLAG in command else [*command, EXIT_SIGNAL_FLAG]


def gpu_of_local_rank(gpus: Sequence[int], local_rank: int) -> int:
    """Local rank ``r`` uses the ``r``-th visible device, which is GPU ``gpus[r]``."""
    if not 0 <= local_rank < len(gpus):
        raise ValueError(f"local rank {local_rank} is outside the {len(gpus)} GPUs {list(gpus)}")
    return gpus[local_rank]


def training_output_tail(log_text: str, max_lines: int) -> list[str]:
    """The last ``max_lines`` lines the ranks wrote, without torchrun's failure report.

    torchrun answers a failed worker with a traceback and summary of about 35 lines. Whether
    it gets them out before ftmaster kills it is a race, and when it does they push the
    script's own error out of a short tail; the exit code they carry is in the failure event.
    """
    lines = log_text.splitlines()
    report = next((i for i, line in enumerate(lines) if TORCHRUN_FAILURE_REPORT.search(line)), None)
    return lines[:report][-max_lines:]


@dataclass(frozen=True)
class RankRecord:
    """What a rank guard reported about its training process."""

    local_rank: int
    rank: int
    pid: int
    guard_pid: int
    exit_code: int | None = None
    """None while it runs; negative when it died by that signal."""
    ended_at: float | None = None
    """Unix time it ended."""


@dataclass(frozen=True)
class ExitReport:
    """Why an attempt's ranks ended: the first failed rank decides the cause."""

    cause: str
    """``exit`` (the process died: a GPU, the script or a signal), ``peer`` (it raised because
    a collective lost another process: the failure is elsewhere), or what the trainer's exit
    status says (``nonfinite``, ``storage``, ``no_checkpoint``, ``usage``, ``data``,
    ``peer_read``). Only ``exit`` is put on a GPU."""
    gpus: tuple[int, ...]
    exit_codes: dict[str, int]
    """Exit status by global rank (negative: the signal that killed it)."""
    first_local_rank: int | None
    """The local rank that failed first, whose error is the root cause; None if unknown."""


# What a rank raises when a collective loses the process at its other end (gloo, NCCL).
PEER_LOST = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|NCCL communicator was "
                       r"aborted|DistNetworkError|remote process exited", re.IGNORECASE)


def classify_exits(failed: dict[int, RankRecord], gpus: Sequence[int],
                   errors: dict[int, str] | None = None) -> ExitReport:
    """The cause of failed ranks (by local rank), from the errors local ranks recorded, failed
    or still running; GPUs only for a plain ``exit``.

    When one rank fails, its peers fail after it (a reset connection, torchrun's SIGTERM), so
    the first to end is the root cause; when even that one lost a peer, the root cause is on
    another node. The GPUs named are the first rank's and those of any other rank that failed
    on its own: a rank that lost a peer, or was stopped by SIGTERM, failed because of another,
    however close behind it ended (a slow machine brings their ends within one poll).
    """
    errors = errors or {}
    codes = {str(rec.rank): rec.exit_code for rec in failed.values()}
    if not failed:
        return ExitReport("exit", (), codes, None)
    first = _root_cause(failed, errors)
    cause = TRAINER_CAUSES.get(failed[first].exit_code if first in failed else None, "exit")
    if cause == "exit" and PEER_LOST.search(errors.get(first, "")):
        cause = "peer"
    on_their_own = {r for r in failed if not _failed_because_of_another(failed[r], errors.get(r))}
    involved = tuple(sorted(gpus[r] for r in on_their_own | {first})) if cause == "exit" else ()
    return ExitReport(cause, involved, codes, first)


def _root_cause(failed: dict[int, RankRecord], errors: dict[int, str]) -> int:
    """The local rank that ended first, unless it lost a peer and a local rank evidently failed
    on its own: a rank that raises records its error, then may take seconds to close its
    connections and end (a busy machine), so the peer it left can end first, even while the
    rank that raised still runs."""
    by_end = sorted(failed, key=lambda r: (failed[r].ended_at or float("inf"), r))
    if PEER_LOST.search(errors.get(by_end[0], "")):
        for local_rank in by_end:
            if _evidently_failed_on_its_own(failed[local_rank], errors.get(local_rank)):
                return local_rank
        raised_and_runs = [r for r in sorted(errors)
                           if r not in failed and not PEER_LOST.search(errors[r])]
        if raised_and_runs:
            return raised_and_runs[0]
    return by_end[0]


def _evidently_failed_on_its_own(record: RankRecord, error: str | None) -> bool:
    """Not because of another, with an error or a killing signal to show for it: a bare exit
    status may hide a lost peer."""
    return not _failed_because_of_another(record, error) and (
        error is not None or (record.exit_code or 0) < 0)


def _failed_because_of_another(record: RankRecord, error: str | None) -> bool:
    """A lost peer, or torchrun's SIGTERM to a rank that had raised nothing of its own: a rank
    that recorded its own error and was stopped in its slow exit failed on its own."""
    if error is not None:
        return bool(PEER_LOST.search(error))
    return record.exit_code == -signal.SIGTERM


def failed_despite_the_stop(failed: dict[int, RankRecord], errors: dict[int, str],
                            killed_at_deadline: bool) -> dict[int, RankRecord]:
    """The failed ranks (by local rank) of an attempt ftmaster stopped, when one of them failed
    on its own while the stop was under way; else none. A stop ends a rank with its SIGTERM
    (the trainer saves and exits 0; before its handler is set the signal ends it) and, past
    its deadline (``killed_at_deadline``), its SIGKILL. Any other end raced the stop: another
    signal (a SIGSEGV, the OOM killer's SIGKILL), an error, an exit status of the trainer's
    (its exit save failed). The peers such a rank left stay with it, for the root cause."""
    stop_ends = {-signal.SIGTERM, -signal.SIGKILL} if killed_at_deadline else {-signal.SIGTERM}
    raced = {r: rec for r, rec in failed.items() if rec.exit_code not in stop_ends}
    on_its_own = any(not PEER_LOST.search(errors.get(r, "")) for r in raced)
    return raced if on_its_own else {}


def error_summary(error_file: Path, traceback_lines: int = 4) -> str | None:
    """The exception a rank recorded (torch elastic's error file), with the innermost frames
    of its traceback; None when it left no readable file."""
    try:
        message = json.loads(Path(error_file).read_text())["message"]
        text, stack = message["message"], message.get("extraInfo", {}).get("py_callstack", "")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    frames = [line for line in stack.splitlines() if line.startswith('  File "')]
    where = "\n".join(frames[-traceback_lines:])
    return f"{text}\n{where}" if where else text


def read_rank_records(rank_dir: Path, nproc: int) -> dict[int, RankRecord]:
    """The records written so far, by local rank; a missing or torn one is just absent."""
    records = {}
    for local_rank in range(nproc):
        try:
            body = json.loads(rank_record_path(rank_dir, local_rank).read_text())
            records[local_rank] = RankRecord(**body)
        except (OSError, ValueError, TypeError):
            continue
    return records


class SessionProcess(subprocess.Popen):
    """torchrun in a session of its own."""

    def kill_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass
        self.wait()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def inherited_environment() -> dict[str, str]:
    """This process's environment for an attempt, without torchrun's ``PET_<OPTION>``
    variables: torchrun takes any option its argv leaves out from them (a Kubeflow
    PyTorchJob sets ``PET_NNODES``, ``PET_RDZV_BACKEND``...), and flags such as
    ``PET_STANDALONE`` or ``PET_NO_PYTHON`` cannot be switched off from the argv."""
    return {name: value for name, value in os.environ.items() if not name.startswith("PET_")}


class Attempt:
    """A started attempt; ``gpus[r]`` is the GPU of local rank ``r``, as ``env`` (with
    ``CUDA_VISIBLE_DEVICES``, see :class:`ftmaster.gpus.JobGpus`) tells CUDA. With a
    ``starter``, every attempt after the first runs its ranks on warm workers when a set is
    ready (``warm`` says whether they did); the others run under torchrun."""

    def __init__(self, run_dir: Path, number: int, command: Sequence[str],
                 gpus: Sequence[int], env: dict[str, str], world: StaticWorld | None = None,
                 starter: WarmStarter | None = None) -> None:
        self.number = number
        self.gpus = tuple(gpus)
        self.command = list(command)
        self.log_path = runfiles.logs_dir(run_dir) / f"attempt_{number}.log"
        self.rank_dir = runfiles.ranks_dir(run_dir) / f"attempt_{number}"
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        self.stuck_gpus: dict[int, str] = {}
        """GPUs whose training process outlived a kill: they may hold memory and a context."""
        self._processes: dict[int, psutil.Process | None] = {}
        """Each rank and guard as first seen (None: gone by then): psutil then tells it from
        a later process that reuses its pid, which a kill long after (ftmaster's end, hours
        of standby on) sent SIGKILL to."""
        self._killed = False
        env = naming_this_process({
            **inherited_environment(), **env, RANK_DIR_ENV: str(self.rank_dir),
            runfiles.RUN_DIR_ENV: str(run_dir), runfiles.LAUNCHED_AT_ENV: repr(self.started_at)})
        # The first launch is cold (DESIGN): the pool starts importing beside it.
        warm = (starter.start(self.command, len(self.gpus), env, self.rank_dir, self.log_path, world)
                if starter is not None and number > 1 else None)
        self.warm = warm is not None
        self.argv = (["warm", *self.command] if self.warm
                     else attempt_argv(self.command, len(self.gpus), world=world,
                                       log_dir=self.rank_dir / "torchrun"))
        self.process = warm if warm is not None else self._start_torchrun(env)

    def _start_torchrun(self, env: dict[str, str]) -> "SessionProcess":
        with open(self.log_path, "ab") as log:
            return SessionProcess(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def ranks(self) -> dict[int, RankRecord]:
        return read_rank_records(self.rank_dir, len(self.gpus))

    def failed_ranks(self) -> dict[int, RankRecord]:
        """Ranks that ended with a non-zero status, by local rank."""
        return {r: rec for r, rec in self.ranks().items() if rec.exit_code not in (None, 0)}

    def exit_code(self) -> int | None:
        return self.process.poll()

    def recorded_errors(self, local_ranks) -> dict[int, str]:
        """The exception message each of these ranks recorded, where it left one."""
        found = {}
        for local_rank in local_ranks:
            try:
                body = json.loads(error_file_path(self.rank_dir, local_rank).read_text())
                found[local_rank] = str(body["message"]["message"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return found

    def root_cause(self, local_rank: int | None, tail_lines: int) -> str:
        """What to show for a failure: the first failed rank's recorded exception, or the
        signal that killed it (its peers' errors in the output are about losing it), else the
        errors the trainer stated itself, else the end of the training output."""
        if local_rank is not None:
            rank = f"local rank {local_rank} (GPU {self.gpus[local_rank]})"
            recorded = error_summary(error_file_path(self.rank_dir, local_rank))
            if recorded is not None:
                return f"{rank} raised {recorded}"
            code = getattr(self.ranks().get(local_rank), "exit_code", None)
            if code is not None and code < 0:
                return (f"{rank} was killed by {_signal_name(-code)} without an error of its own "
                        "(the OOM killer, a user, a failing node); the others lost it")
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"(no training output in {self.log_path})"
        return self._stated(text) or "\n".join(training_output_tail(text, tail_lines))

    def stated_errors(self) -> str | None:
        """The errors the trainer stated itself (its first three, and its last), or None."""
        try:
            return self._stated(self.log_path.read_text(errors="replace"))
        except OSError:
            return None

    @staticmethod
    def _stated(text: str) -> str | None:
        said = [line for line in text.splitlines() if line.startswith(TRAINER_ERROR_PREFIX)]
        if len(said) > 4:  # the last is the one that ended training (a final save that failed)
            said = [*said[:3], f"... ({len(said) - 4} more error line(s) in the log)", said[-1]]
        return "\n".join(said) or None

    @property
    def killed(self) -> bool:
        """Killed by :meth:`kill`: no rank is left, and its records' pids may be other
        processes' (its guards, killed with their ranks, rarely write their ends)."""
        return self._killed

    def pid_on_gpu(self, gpu: int) -> int | None:
        """The training process bound to ``gpu``, or None when it is not (yet) known."""
        if gpu not in self.gpus:
            return None
        record = self.ranks().get(self.gpus.index(gpu))
        return None if record is None or record.exit_code is not None else record.pid

    def stopped_gpus(self) -> list[int]:
        """GPUs whose training process is stopped (SIGSTOP): the likely cause of a hang."""
        stopped = []
        for local_rank, record in self.ranks().items():
            try:
                if psutil.Process(record.pid).status() == psutil.STATUS_STOPPED:
                    stopped.append(self.gpus[local_rank])
            except psutil.Error:
                continue
        return stopped

    def _live_processes(self) -> list[psutil.Process]:
        live = []
        for record in self.ranks().values():
            pids = (record.guard_pid,) if record.exit_code is not None else (record.pid, record.guard_pid)
            for pid in pids:
                if pid not in self._processes:
                    self._processes[pid] = _first_seen(pid, record.ended_at)
                process = self._processes[pid]
                if process is not None and _alive(process) and process not in live:
                    live.append(process)
        return live

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL the whole tree (stopped processes included) and wait until it is gone;
        once it is, killing it again does nothing (its pids may be other processes' by then)."""
        if self._killed and not self.stuck_gpus:
            return
        processes = self._live_processes()
        for process in processes:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(psutil.Error):
                    process.send_signal(sig)  # not to a process that took its pid since
        self.process.kill_group()
        survivors = wait_until_dead(list(dict.fromkeys(processes + self._live_processes())),
                                    timeout)
        self.stuck_gpus, self._killed = self._gpus_of(survivors), True
        if survivors:
            log.warning("attempt %d: process(es) %s survived SIGKILL for %g s (uninterruptible "
                        "sleep, usually in the GPU driver); their %s will not be used again",
                        self.number, sorted(p.pid for p in survivors), timeout,
                        gpus_text(sorted(self.stuck_gpus)))

    def _gpus_of(self, processes: list[psutil.Process]) -> dict[int, str]:
        """The GPUs of training processes among ``processes``, with the reason to retire them."""
        pids = {p.pid for p in processes}
        return {self.gpus[local_rank]: "process_stuck" for local_rank, record in self.ranks().items()
                if record.pid in pids}

    def stop(self, deadline_s: float) -> int | None:
        """SIGTERM every rank (they save and exit), wait up to ``deadline_s``, then SIGKILL.

        Returns torchrun's exit status when it ended in time, else None.
        """
        deadline = time.monotonic() + deadline_s
        self._terminate_every_rank(deadline)
        try:
            return self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.kill()

    def _terminate_every_rank(self, deadline: float) -> None:
        """SIGTERM each rank as soon as its record names it. Right after a launch torchrun may
        not have started every rank yet, and one started after the SIGTERM would train on
        until the deadline. (Signalling torchrun instead is no better: it SIGKILLs its workers
        30 s later, in the middle of their save.) The ranks signalled first do not wait for
        the others' records: one the run directory had no room for never comes, and they
        would have been left the deadline's last instant to save in (the ranks agree to save
        and exit together, so the signalled ones take it along)."""
        signalled: set[int] = set()
        while self.process.poll() is None and time.monotonic() < deadline:
            for local_rank, record in self.ranks().items():
                if local_rank not in signalled and record.exit_code is None:
                    send_signal(record.pid, signal.SIGCONT)
                    send_signal(record.pid, signal.SIGTERM)
                signalled.add(local_rank)
            if len(signalled) >= len(self.gpus):
                return
            time.sleep(0.05)


def wait_until_dead(processes: list[psutil.Process], timeout: float,
                    poll_s: float = 0.01) -> list[psutil.Process]:
    """Wait until every process has ended; a zombie counts as ended. Returns those still alive
    at the deadline (stuck in uninterruptible sleep: even SIGKILL waits for the kernel).

    The ranks are not ftmaster's children, so a killed one stays a zombie until init reaps it,
    and ``psutil.wait_procs`` waits that out (about 2 s, on every recovery). A zombie holds no
    memory, GPU context or port any more: the next attempt can start.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in processes):
        time.sleep(poll_s)
    return [p for p in processes if _alive(p)]


START_TIME_SLACK_S = 2.0
"""psutil's start times count from the boot time in whole seconds (about 0.3 s off here)."""


def _first_seen(pid: int, ended_at: float | None) -> psutil.Process | None:
    """The process of a rank's ``pid``, or None when it is gone. Once a rank has ended, its
    guard exits right after writing so: a process of that pid started after it is another's
    (a pid gone at the first look was looked up again at each later kill, and SIGKILLed
    whoever took it since)."""
    try:
        process = psutil.Process(pid)
        if ended_at is not None and process.create_time() > ended_at + START_TIME_SLACK_S:
            return None
        return process
    except psutil.Error:
        return None


def _alive(process: psutil.Process) -> bool:
    try:  # is_running() is False for a pid another process reuses; True for a zombie
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def send_signal(pid: int, sig: int) -> None:
    """``os.kill`` that ignores a process already gone."""
    try:
        os.kill(pid, sig)
    except OSError:
        pass
