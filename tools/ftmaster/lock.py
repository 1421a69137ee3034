"""Locks that keep two runs apart.

- One ftmaster per run directory: an exclusive ``flock`` on ``RUN_DIR/ftmaster.lock``.
- One job per checkpoint folder (``--save``, a memory tier's folder given to it): every node
  of a job may write it, another job may not (:class:`FolderClaim`).

The kernel drops a ``flock`` when its holder dies, SIGKILL included, so a stale lock file
never blocks a new run. The files say who holds them, for the error messages only.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import tempfile
import time
from pathlib import Path

LOCK_NAME = "ftmaster.lock"
HOLDERS_DIR = ".ftmaster_jobs"
HOLDERS_GUARD = ".ftmaster_jobs.lock"
GUARD_WAIT_S = 30.0  # the guard is held for a listing of a few files; longer means a hung mount
# Where the filesystem has no locks (Lustre without -o flock, some FUSE mounts).
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}


class RunDirLocked(RuntimeError):
    """Another ftmaster holds the run directory."""


class RunDirLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`RunDirLocked` naming the holder; OSError if unwritable."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirLocked(f"another ftmaster (pid {holder}) is using {self.path.parent}; "
                               "wait for it to end or give another --run-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class FolderInUse(RuntimeError):
    """Another job's ftmaster is alive and writes the same checkpoint folder."""


class FolderClaim:
    """This ftmaster's claim on a checkpoint folder, for its job.

    Two jobs resuming from one ``--save`` would write their timelines into each other's
    checkpoints. The run directory's lock cannot see it (each job has its own), and one lock
    on ``--save`` would refuse a job's other nodes, which share it. So each ftmaster holds a
    ``flock`` on its own file in ``FOLDER/.ftmaster_jobs/``, naming its job; a new one is
    refused while a live file names another job. A file nobody holds any longer (its ftmaster
    died) is removed. The listing and the new file are made under a guard lock, so two
    launches at once cannot both pass.
    """

    def __init__(self, folder: Path, job: str, run_dir: Path, flag: str = "--save") -> None:
        self.folder = Path(folder) / HOLDERS_DIR
        self.job, self.flag = job, flag
        self._record = {"job": job, "host": socket.gethostname(), "pid": os.getpid(),
                        "run_dir": str(run_dir)}
        self.path: Path | None = None
        self._fd: int | None = None

    def acquire(self) -> None:
        """Claim the folder or raise :class:`FolderInUse` naming the other job; OSError when
        the folder cannot be written or locked (``errno`` in :data:`NO_LOCKS`: no locks there)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        guard = os.open(self.folder.parent / HOLDERS_GUARD, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _lock_within(guard, GUARD_WAIT_S)
            other = next((record for record in self._live_records()
                          if record.get("job") != self.job), None)
            if other is not None:
                raise FolderInUse(_in_use_text(self.flag, self.folder.parent, other))
            self._hold_own_file()
        finally:
            os.close(guard)

    def _live_records(self) -> list[dict]:
        """The records of the files someone still holds; the others are removed."""
        records = []
        for path in sorted(self.folder.iterdir()):
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:  # removed meanwhile, or not a file
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                records.append(_read_record(fd, path))
            else:
                path.unlink(missing_ok=True)
            finally:
                os.close(fd)
        return records

    def _hold_own_file(self) -> None:
        fd, path = tempfile.mkstemp(prefix=f"{self._record['host']}.{os.getpid()}.",
                                    dir=self.folder)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, json.dumps(self._record).encode())
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        self._fd, self.path = fd, Path(path)

    def release(self) -> None:
        """Removed before it is unlocked: a launch that opened it meanwhile finds it held."""
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


def _lock_within(fd: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise OSError(errno.ETIMEDOUT, f"its guard lock stayed taken for {seconds:.0f} s")
            time.sleep(0.05)


def _read_record(fd: int, path: Path) -> dict:
    try:
        record = json.loads(os.read(fd, 4096).decode(errors="replace"))
    except ValueError:  # files are written under the guard: this one is not ftmaster's
        record = None
    return record if isinstance(record, dict) else {"job": None, "host": path.name}


def _in_use_text(flag: str, folder: Path, other: dict) -> str:
    who = ", ".join(f"{key} {other[key]}" for key in ("host", "pid", "run_dir") if key in other)
    return (f"{flag} {folder} is written by another run ({who}); give another {flag}, "
            "or stop that run first")
