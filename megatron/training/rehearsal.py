"""Faults injected into a rank, for rehearsing GPU failures on any machine (CPU included).

``ftmaster launch --inject`` (see ``ftmaster.faults``) sets these for an attempt; without
them nothing here does anything. Each fault is what the rank would see on a failing GPU:

- ``FTMASTER_INJECT_NAN=LOCAL_RANK:ITERATION[,...]``: the gradients (and the loss, on a last
  pipeline stage) of that local rank become NaN at that iteration, as silent data corruption
  would make them;
- ``FTMASTER_INJECT_CUDA_ERROR=LOCAL_RANK:XID[,...]``: that local rank fails at start-up with
  the CUDA error the XID brings (its GPU still needs a reset); set, even empty, it also arms
  ``SIGUSR2``: a rank that receives it raises that CUDA error where it is, the XID read from
  ``$FTMASTER_RANK_DIR/cuda_error_<LOCAL_RANK>``. The signal is armed only in rehearsals, so
  a job that uses it for something else is never affected;
- ``FTMASTER_INJECT_KILL=LOCAL_RANK:ITERATION:POINT[,...]``: that local rank SIGKILLs itself
  at that point of that iteration, where a GPU falling off the bus would stop it: ``forward``
  (the schedule starts), ``grad-allreduce`` (the data-parallel gradient all-reduce starts),
  ``grad-norm`` (the norm is taken, the agreement not yet), ``update`` (just applied) or
  ``save-agreement`` (the iteration's save agreement is being waited for) or ``slot-copy``
  (halfway through refilling a memory-tier slot). The replica recovery tests use it to kill
  a rank between any two collectives. Under ftmaster each entry fires once per run
  directory (``$FTMASTER_RUN_DIR/ranks/kill_fired_*``): the relaunch that resumes from
  before it runs on, as after a real GPU's loss, instead of failing the same way again;
- ``FTMASTER_INJECT_STALL=LOCAL_RANK:ITERATION[,...]``: that local rank's async writer of
  the save at that iteration stops itself (``SIGSTOP``) before it writes, as a writer stuck
  on a file system that stopped answering would (:mod:`async_saves` gives it up).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from ftmaster import runfiles
from ftmaster.faults import CUDA_ERROR_ENV, CUDA_ERROR_SIGNAL

NAN_ENV = "FTMASTER_INJECT_NAN"
SLOW_ENV = "FTMASTER_INJECT_SLOW"
"""``LOCAL_RANK:ITERATION:FACTOR[,...]``: that local rank computes FACTOR times slower from
that iteration on (ftmaster's ``slow`` injection at an iteration, armed at launch)."""
SLOW_FILE_PREFIX = "slow_"
"""``$FTMASTER_RANK_DIR/slow_<local rank>``: the factor ftmaster's ``slow`` injection slows
this rank's compute by from now on (due at a time or after an event; read each iteration)."""
KILL_ENV = "FTMASTER_INJECT_KILL"
STALL_ENV = "FTMASTER_INJECT_STALL"
KILL_POINTS = ("forward", "grad-allreduce", "grad-norm", "update", "save-agreement", "slot-copy")
_armed_kills: dict[tuple[int, str], Path | None] = {}
"""(iteration, point) -> the file that says it fired (None outside ftmaster's run directory)."""

# What the CUDA runtime reports when the XID's fault hits a running context.
_ECC_XIDS = frozenset({48, 63, 64, 92, 94, 95, 140})
_CUDA_MESSAGES = {79: "unspecified launch failure (the GPU has fallen off the bus)",
                  119: "unspecified launch failure", 120: "unspecified launch failure",
                  74: "an illegal memory access was encountered"}


def cuda_error_message(xid: int | None) -> str:
    if xid in _ECC_XIDS:
        text = "uncorrectable ECC error encountered"
    else:
        text = _CUDA_MESSAGES.get(xid, "unknown error")
    return f"CUDA error: {text} (rehearsal: XID {xid if xid is not None else '?'} on this GPU)"


def _local_entries(variable: str, local_rank: int, fields: tuple, expected: str) -> list[tuple]:
    """This local rank's entries of ``variable`` (``LOCAL_RANK:FIELD...[,...]``), each field
    through its converter in ``fields``; a malformed entry is one ValueError naming
    ``expected``."""
    spec = os.environ.get(variable, "")
    chosen = []
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        texts = entry.split(":")
        try:
            if len(texts) != len(fields) + 1:
                raise ValueError(entry)
            rank, values = int(texts[0]), tuple(convert(t) for convert, t in zip(fields, texts[1:]))
        except ValueError:
            raise ValueError(f"{variable}={spec!r}: expected {expected}") from None
        if rank == local_rank:
            chosen.append(values)
    return chosen


def per_local_rank(variable: str, local_rank: int) -> frozenset[int]:
    """The values ``variable`` (``LOCAL_RANK:VALUE[,...]``) gives this local rank."""
    return frozenset(value for (value,) in _local_entries(variable, local_rank, (int,),
                                                          "LOCAL_RANK:VALUE[,...]"))


def nan_iterations(local_rank: int) -> frozenset[int]:
    """The iterations at which this local rank poisons its gradients."""
    return per_local_rank(NAN_ENV, local_rank)


def poison_gradients(parameters) -> None:
    """Put a NaN into the first gradient among ``parameters``, as a corrupted GPU would."""
    for param in parameters:
        if param.grad is not None:
            param.grad.view(-1)[0] = float("nan")
            return


def _raise_cuda_error(signum, frame) -> None:
    local_rank = os.environ.get("LOCAL_RANK", "0")
    try:
        xid = int((Path(os.environ.get("FTMASTER_RANK_DIR", ".")) /
                   f"cuda_error_{local_rank}").read_text())
    except (OSError, ValueError):
        xid = None
    raise RuntimeError(cuda_error_message(xid))


def arm_cuda_errors(local_rank: int) -> None:
    """At start-up: fail now if this rank's GPU still carries an injected XID, and in a
    rehearsal, let ``SIGUSR2`` bring the CUDA error of one injected while training."""
    if CUDA_ERROR_ENV not in os.environ:
        return
    broken = per_local_rank(CUDA_ERROR_ENV, local_rank)
    if broken:
        raise RuntimeError(cuda_error_message(min(broken)))
    signal.signal(CUDA_ERROR_SIGNAL, _raise_cuda_error)
    # Blocked from the rank's start by its guard: one sent before now is handled here.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {CUDA_ERROR_SIGNAL})


class Slowdown:
    """An injected ``slow``: how many times slower this rank computes (1 until injected).
    The file is looked at once per iteration (one ``stat``) and read when it changes."""

    def __init__(self, local_rank: int) -> None:
        folder = os.environ.get("FTMASTER_RANK_DIR")
        self.path = None if folder is None else Path(folder) / f"{SLOW_FILE_PREFIX}{local_rank}"
        self.factor = 1.0
        self._seen: int | None = None
        self.armed = _armed_slowdowns(local_rank)
        """(from iteration, factor), from the launch's environment."""

    def current(self, iteration: int) -> float:
        """The factor at ``iteration``."""
        armed = max((factor for start, factor in self.armed if iteration >= start), default=1.0)
        return max(armed, self._from_file())

    def _from_file(self) -> float:
        if self.path is None:
            return 1.0
        try:
            changed = self.path.stat().st_mtime_ns
            if changed != self._seen:
                self.factor, self._seen = max(1.0, float(self.path.read_text())), changed
        except (OSError, ValueError):
            pass  # not injected, or being written: the factor as it was
        return self.factor


def _armed_slowdowns(local_rank: int) -> list[tuple[int, float]]:
    return _local_entries(SLOW_ENV, local_rank, (int, float), "LOCAL_RANK:ITERATION:FACTOR[,...]")


def _kill_point_name(text: str) -> str:
    if text not in KILL_POINTS:
        raise ValueError(text)
    return text


def environment_problem() -> str | None:
    """Why a rehearsal variable a user sets (``FTMASTER_INJECT_KILL``, ``_STALL``) cannot be
    read, or None. Read by every rank at its start (by each async writer), a typo failed each
    with a traceback, which ftmaster took for a failure of every rank, relaunched after."""
    try:
        _kill_entries(local_rank=-1)
        per_local_rank(STALL_ENV, -1)
    except ValueError as error:
        return str(error)
    return None


def _kill_entries(local_rank: int) -> list[tuple]:
    return _local_entries(
        KILL_ENV, local_rank, (int, _kill_point_name),
        f"LOCAL_RANK:ITERATION:POINT[,...] with POINT one of {', '.join(KILL_POINTS)}")


def arm_kill_points(local_rank: int) -> None:
    """At start-up: the (iteration, point) pairs at which this local rank kills itself, less
    those an earlier attempt of the run fired."""
    _armed_kills.clear()
    for iteration, point in _kill_entries(local_rank):
        fired = _fired_kill_path(local_rank, iteration, point)
        if fired is None or not fired.exists():
            _armed_kills[(iteration, point)] = fired


def _fired_kill_path(local_rank: int, iteration: int, point: str) -> Path | None:
    run_dir = os.environ.get(runfiles.RUN_DIR_ENV)
    if not run_dir:
        return None
    return runfiles.ranks_dir(Path(run_dir)) / f"kill_fired_{local_rank}_{iteration}_{point}"


def kill_armed(point: str) -> bool:
    """Whether this rank kills itself at ``point`` at some iteration."""
    return any(armed == point for _, armed in _armed_kills)


def kill_point(point: str, iteration: int) -> None:
    """SIGKILL this process when the rehearsal armed ``point`` at ``iteration``, saying so
    first in the run directory."""
    if (iteration, point) not in _armed_kills:
        return
    fired = _armed_kills[(iteration, point)]
    if fired is not None:
        try:
            fired.parent.mkdir(parents=True, exist_ok=True)
            fired.touch()
        except OSError:
            pass  # unsaid, it fires again in the next attempt: the kill is the rehearsal
    os.kill(os.getpid(), signal.SIGKILL)


def stall_writer(iteration: int) -> None:
    """In an async save's writer process: stop here when the rehearsal stalls this local
    rank's save at ``iteration``."""
    if STALL_ENV in os.environ and iteration in per_local_rank(
            STALL_ENV, int(os.environ.get("LOCAL_RANK", "0"))):
        os.kill(os.getpid(), signal.SIGSTOP)
