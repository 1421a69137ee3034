"""Process guards that make "no orphan training process, ever" hold, even after a SIGKILL.

torchrun starts every worker in a session of its own, so killing torchrun's process group
misses the workers, and a torchrun that dies by SIGKILL leaves them training. ftmaster
therefore starts each attempt as a chain in which every process dies with its parent::

    ftmaster ─> guard exec ─exec─> torchrun ─> guard rank ─> pretrain_gpt.py (one per rank)

Each link asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), and
checks afterwards that the parent is still the one it was started by, so a parent that died
in between is not missed. That parent is named in ``$FTMASTER_GUARD_PARENT`` by the one who
started it (ftmaster for ``exec``, the ``exec`` guard, which becomes torchrun, for ``rank``):
read after the interpreter started, ``getppid()`` would already name init.

- ``python -m ftmaster.guard exec CMD...`` sets the signal, then ``exec``s CMD. The setting
  survives ``exec``, so torchrun dies when ftmaster does.
- ``python -m ftmaster.guard rank SCRIPT ARGS...`` (torchrun's ``-m`` entry) sets it on
  itself, starts ``python -u SCRIPT ARGS`` with the same setting, forwards SIGTERM and SIGINT
  to it, and exits with its status (128 + N when it died by signal N).

The rank guard also writes ``$FTMASTER_RANK_DIR/local_rank_<R>.json`` (when that variable is
set): ``local_rank``, ``rank``, ``pid`` (the training process), ``guard_pid`` and, once the
process has ended, ``exit_code`` (negative for a signal, as ``subprocess`` reports it) and
``ended_at`` (unix time). The supervisor uses it to map a dead rank to its GPU, to find the
rank that failed first, and to inject faults into the right process. The training process
writes an uncaught exception to ``$FTMASTER_RANK_DIR/error_<R>.json`` (torch elastic's error
file format, through ``TORCHELASTIC_ERROR_FILE``), which the guard then also copies to where
torchrun expects it, so both report the root cause.

This module is started once per rank, so it imports nothing heavy.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from ftmaster.runfiles import atomic_write_text
from ftmaster.faults import CUDA_ERROR_ENV, CUDA_ERROR_SIGNAL

PR_SET_PDEATHSIG = 1
RANK_DIR_ENV = "FTMASTER_RANK_DIR"
GUARD_PARENT_ENV = "FTMASTER_GUARD_PARENT"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
USAGE = "usage: python -m ftmaster.guard exec CMD... | rank SCRIPT ARGS..."


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """Ask for ``sig`` when the parent dies; if it already died, take ``sig`` now."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)


def exit_with_parent(expected_parent: int) -> None:
    """Ask to exit, through Python's exit handlers, when the parent dies, and only then.

    For a multiprocessing Manager's server: it listens on a socket in a ``pymp-*`` folder of
    its own in /tmp, which its exit handlers remove. Killed with its rank (SIGKILL), it left
    one folder behind per rank lost, and a long-lived node collected them. A SIGTERM sent to
    every process of a job step (SLURM's warning, ``scancel --signal=TERM``, systemd) while
    its rank lives is not its end: the rank's exit save still needs it."""
    def exit_if_orphaned(signum: int, _frame: object) -> None:
        if os.getppid() != expected_parent:
            sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, exit_if_orphaned)
    die_with_parent(expected_parent, signal.SIGTERM)


_forking_pid: int | None = None


def _remember_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def forked_children_die_with_this_process() -> None:
    """Make every child this process later forks (``os.fork``, multiprocessing's fork context)
    ask for SIGKILL when its parent dies.

    The training process is the last link of the chain above, but torch_dist's checkpoint
    writers are forked from it, and a fork clears ``PR_SET_PDEATHSIG``: a rank killed during a
    save would leave its writers behind, blocked forever. ``subprocess`` children are not
    covered (the hooks run only in forks that return to Python); they are started with a
    ``preexec_fn`` where it matters. The signal follows the forking *thread*, so this is for
    processes that fork from threads that live as long as they do, as the trainer's do.
    """
    os.register_at_fork(before=_remember_forking_pid,
                        after_in_child=lambda: die_with_parent(_forking_pid))


def rank_record_path(rank_dir: Path, local_rank: int) -> Path:
    return Path(rank_dir) / f"local_rank_{local_rank}.json"


def error_file_path(rank_dir: Path, local_rank: int) -> Path:
    return Path(rank_dir) / f"error_{local_rank}.json"


def write_rank_record(rank_dir: Path, record: dict) -> None:
    """The rank's record for the supervisor, if the run directory has room: one out of room
    costs the record (the rank's end is then known from its exit alone), never the rank or
    the supervisor, which says itself that the run directory cannot be written."""
    try:
        atomic_write_text(rank_record_path(Path(rank_dir), record["local_rank"]),
                          json.dumps(record) + "\n", durable=False)
    except OSError:
        pass


def _write_record(record: dict) -> None:
    rank_dir = os.environ.get(RANK_DIR_ENV)
    if rank_dir:
        write_rank_record(Path(rank_dir), record)


def _started_by() -> int:
    """The parent that started this guard (see the module docstring); ``getppid()`` when the
    environment does not say (started by hand, or by ``srun``)."""
    named = os.environ.get(GUARD_PARENT_ENV, "")
    return int(named) if named.isdigit() else os.getppid()


def dying_with_this_process(command: Sequence[str], python: str = sys.executable) -> list[str]:
    """``command`` under ``guard exec``, to be started with :func:`naming_this_process` in its
    environment: it then dies with this process, SIGKILL included."""
    return [python, "-m", "ftmaster.guard", "exec", *command]


def naming_this_process(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` naming this process as the parent a guard started from here dies with."""
    return {**env, GUARD_PARENT_ENV: str(os.getpid())}


def run_exec(command: list[str]) -> None:
    die_with_parent(_started_by())
    os.environ[GUARD_PARENT_ENV] = str(os.getpid())  # torchrun's, once exec'd: its ranks' parent
    os.execvp(command[0], command)


def _error_file_env(local_rank: int) -> tuple[dict[str, str], Path | None, str | None]:
    """The child's environment with its error file in the rank folder, that file, and the
    one torchrun expects (to copy it to)."""
    rank_dir = os.environ.get(RANK_DIR_ENV)
    torchrun_file = os.environ.get(ERROR_FILE_ENV)
    if not rank_dir:
        return dict(os.environ), None, torchrun_file
    ours = error_file_path(Path(rank_dir), local_rank)
    ours.unlink(missing_ok=True)
    return {**os.environ, ERROR_FILE_ENV: str(ours)}, ours, torchrun_file


def _start_rank(guard_pid: int, held: set[signal.Signals]) -> None:
    """In the rank's process before its exec: it dies with its guard, and ``held`` signals
    wait (blocked; the mask outlives the exec) until the rank unblocks them."""
    die_with_parent(guard_pid)
    if held:
        signal.pthread_sigmask(signal.SIG_BLOCK, held)


def run_rank(script_args: list[str]) -> int:
    die_with_parent(_started_by())
    guard_pid = os.getpid()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    env, error_file, torchrun_error_file = _error_file_env(local_rank)
    # A rehearsed XID is a SIGUSR2 the rank's handler turns into the CUDA error; it may come
    # before the rank's imports reach that handler, so it waits, blocked, until then.
    held = {CUDA_ERROR_SIGNAL} if CUDA_ERROR_ENV in env else set()
    child = subprocess.Popen([sys.executable, "-u", *script_args], env=env,
                             preexec_fn=lambda: _start_rank(guard_pid, held))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    record = {"local_rank": local_rank, "rank": int(os.environ.get("RANK", "0")),
              "pid": child.pid, "guard_pid": guard_pid}
    _write_record(record)
    code = child.wait()
    _write_record({**record, "exit_code": code, "ended_at": time.time()})
    if error_file is not None and torchrun_error_file and error_file.exists():
        shutil.copyfile(error_file, torchrun_error_file)
    return 128 - code if code < 0 else code


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("exec", "rank"):
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] == "exec":
        run_exec(argv[1:])
    return run_rank(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
