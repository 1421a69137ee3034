"""Locks that keep two runs apart.

- One ftmaster per run directory: an exclusive ``flock`` on ``RUN_DIR/ftmaster.lock``.
- One job per checkpoint folder (``--save``, a memory tier's folder given to it): every node
  of a job may write it, another job may not (:class:`FolderClaim`).

The kernel drops a ``flock`` when its holder dies, SIGKILL included, so a stale lock file
never blocks a new run. The files say who holds them, for the error messages only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

LOCK_NAME = "ftmaster.lock"
HOLDERS_DIR = ".ftmaster_jobs"
HOLDERS_GUARD = ".ftmaster_jobs.lock"
GUARD_WAIT_S = 120.0  # held for a listing and a file or two per launch; longer: a hung mount
WITHDRAW_WAIT_S = 2.0  # a refused launch's tidying waits no longer: it may leave the folders
# Where the filesystem has no locks (Lustre without -o flock, some FUSE mounts).
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}
PROBE_HOLD_S = 0.5
"""How long a run directory's lock is tried before it counts as held: a probe (:func:`run_dir_in_use`,
``ftmaster report``) holds it shared for an open and a close."""


class RunDirLocked(RuntimeError):
    """Another ftmaster holds the run directory."""


class RunDirLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None
        self.unlocked_because: str | None = None
        """Why no lock is held, on a file system without locks (the caller warns)."""

    def acquire(self) -> None:
        """Take the lock or raise :class:`RunDirLocked` naming the holder; OSError if
        unwritable. On a file system without locks, goes on without one (``unlocked_because``).
        A lock file removed while this waited for it (a refused launch takes away the run
        directory it made) is let go, and the one at the path now taken: held, the removed
        file let a third launch lock a new one, two ftmasters on one run directory."""
        while True:
            # made again when a refused launch took away the run directory it had made
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                _lock_within(fd, PROBE_HOLD_S)
            except OSError as error:
                self._not_locked(fd, error)
                return
            if _is_at(fd, self.path):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        self._fd = fd

    def _not_locked(self, fd: int, error: OSError) -> None:
        """``fd`` closed, then RunDirLocked naming the holder, ``error`` itself, or (no locks
        on this file system) ``unlocked_because`` said."""
        holder = _run_dir_holder(os.read(fd, 512).decode(errors="replace")) \
            if error.errno == errno.ETIMEDOUT else ""
        os.close(fd)
        if holder:
            raise RunDirLocked(f"another ftmaster ({holder}) is using {self.path.parent}; "
                               "wait for it to end or give another --run-dir") from None
        if error.errno not in NO_LOCKS:
            raise error
        self.unlocked_because = error.strerror

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _run_dir_holder(text: str, name_host: bool = False) -> str:
    """``pid N``, and its host when asked or when that is another one (a run directory on a
    shared filesystem: the pid alone names no process here, or an unrelated one)."""
    pid, _, host = text.strip().partition(" ")
    if host and (name_host or host != socket.gethostname()):
        return f"pid {pid} on host {host}"
    return f"pid {pid or 'unknown'}"


def run_dir_in_use(run_dir: Path) -> bool:
    """Whether a live ftmaster holds ``run_dir``'s lock (a probe: nothing is created or
    removed); a lock that cannot be probed (no locks there) counts as held."""
    try:
        return _locked(Path(run_dir) / LOCK_NAME)
    except OSError:
        return True


def run_dir_holder(run_dir: Path) -> str | None:
    """Who holds ``run_dir``'s lock (``pid N on host H``, as its file says); None when nobody
    does: its ftmaster ended, or was killed, since the kernel drops a dead holder's flock.
    A probe (:func:`_held`) that can never take a live holder's lock. OSError when it cannot
    tell: no lock file (a copied run directory), one this user cannot read, or no locks on
    that file system."""
    fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY)
    try:
        if not _held(fd):
            return None
        return _run_dir_holder(os.read(fd, 512).decode(errors="replace"), name_host=True)
    finally:
        os.close(fd)


class FolderInUse(RuntimeError):
    """Another job's ftmaster is alive and writes the same checkpoint folder."""


class FolderClaim:
    """This ftmaster's claim on a checkpoint folder, for its job.

    Two jobs resuming from one ``--save`` would write their timelines into each other's
    checkpoints. The run directory's lock cannot see it (each job has its own), and one lock
    on ``--save`` would refuse a job's other nodes, which share it. So each ftmaster holds a
    ``flock`` on its own file in ``FOLDER/.ftmaster_jobs/``, whose name starts with a digest
    of its job; a new one is refused while a file of another job is held. The job is read
    from the name, not the contents: on NFS another client may see a file's name well before
    its bytes. A file nobody holds any longer (its ftmaster died) is removed. The listing and
    the new file are made under a guard lock, so two launches at once cannot both pass; only
    other jobs' files, and this job's files from this host (a killed ftmaster's, which no
    other job may ever come to remove), are probed, so a job's nodes add no lock traffic for
    each other.
    """

    def __init__(self, folder: Path, job: str, run_dir: Path, flag: str = "--save") -> None:
        self.folder = Path(folder) / HOLDERS_DIR
        self.flag = flag
        self._key = hashlib.sha1(job.encode()).hexdigest()[:16]
        self._record = {"job": job, "host": socket.gethostname(), "pid": os.getpid(),
                        "run_dir": str(run_dir)}
        self.path: Path | None = None
        self._fd: int | None = None
        self._made: list[Path] = []

    def acquire(self) -> None:
        """Claim the folder or raise :class:`FolderInUse` naming the other job; OSError when
        the folder cannot be written or locked (``errno`` in :data:`NO_LOCKS`: no locks there;
        ``ETIMEDOUT``: the guard stayed taken)."""
        self._made = missing_folders(self.folder.parent)
        guard = self._locked_guard()
        try:
            listed = sorted(self.folder.iterdir())
            # This host's files of this job: one nobody holds is an earlier ftmaster's that died
            # (SIGKILL, a requeue after preemption); no other job's launch would remove it.
            for path in listed:
                if path.name.startswith(f"{self._key}.{self._record['host']}."):
                    _is_held(path)
            other = next((path for path in listed
                          if not path.name.startswith(self._key + ".") and _is_held(path)), None)
            if other is not None:
                raise FolderInUse(_in_use_text(self.flag, self.folder.parent, other))
            self._hold_own_file()
        finally:
            os.close(guard)

    def _hold_own_file(self) -> None:
        fd, path = tempfile.mkstemp(prefix=f"{self._key}.{self._record['host']}.{os.getpid()}.",
                                    dir=self.folder)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, 0o644)  # other users' launches probe it and read who holds it
            os.write(fd, json.dumps(self._record).encode())
            os.fsync(fd)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        self._fd, self.path = fd, Path(path)

    def _locked_guard(self) -> int:
        """The guard, locked. One a withdrawn claim removed while this waited for it guards
        nothing any longer: the file at its name is opened and locked instead; and a folder
        it removed as this made it is made again."""
        guard_path = self.folder.parent / HOLDERS_GUARD
        while True:
            self.folder.mkdir(parents=True, exist_ok=True)
            try:
                guard = _open_shared(guard_path)
            except FileNotFoundError:
                if self.folder.is_dir():  # not a withdrawal's doing (a dangling symlink)
                    raise
                continue
            try:
                _lock_within(guard, GUARD_WAIT_S)
                if _is_at(guard, guard_path):
                    return guard
            except BaseException:
                os.close(guard)
                raise
            os.close(guard)

    def release(self) -> None:
        """Removed before it is unlocked: a launch that opened it meanwhile finds it held."""
        if self._fd is not None:
            with contextlib.suppress(OSError):  # a removal that fails leaves a stale file
                self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None

    def withdraw(self) -> None:
        """Released, for a launch refused after its claim: and when the claim made the
        folder, the holders' folder, the guard and the folder removed again, unless another
        claim holds a file there by now (another node of the job). Under the guard, so no
        other launch lists the holders meanwhile."""
        self.release()
        if not self._made:
            return
        guard_path = self.folder.parent / HOLDERS_GUARD
        try:
            guard = os.open(guard_path, os.O_RDWR)
        except OSError:
            return
        try:
            _lock_within(guard, WITHDRAW_WAIT_S)
            if not _is_at(guard, guard_path):
                return  # another withdrawal removed it: a launch may hold the new one now
            self.folder.rmdir()
            guard_path.unlink()
        except OSError:
            return  # in use again, or no locks there: all of it stays
        finally:
            os.close(guard)
        remove_made(self._made, whole=False)


def missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist, deepest first: what making it
    makes, for :func:`remove_made`."""
    return [folder for folder in (path, *path.parents) if not folder.exists()]


def remove_made(made: list[Path], whole: bool = True) -> None:
    """The folders :func:`missing_folders` named, made since: the deepest with what is in it
    (``whole``, for a folder its maker held locked all along), else only when empty, then
    each parent left empty; one another launch writes by now stays."""
    if made and whole:
        shutil.rmtree(made[0], ignore_errors=True)
        made = made[1:]
    with contextlib.suppress(OSError):
        for folder in made:
            folder.rmdir()


def _is_at(fd: int, path: Path) -> bool:
    """Whether ``fd`` is the file at ``path`` still (not removed, or replaced, since)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _open_shared(path: Path) -> int:
    """A file every user who may write the folder can lock (an exclusive lock over NFS needs
    it open for writing)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    with contextlib.suppress(OSError):  # not ours: its owner made it so already
        os.fchmod(fd, 0o666)
    return fd


def _is_held(path: Path) -> bool:
    """Whether another ftmaster holds this file; one nobody holds is removed."""
    if _locked(path):
        return True
    with contextlib.suppress(OSError):
        path.unlink()
    return False


def _locked(path: Path) -> bool:
    """Whether a process holds a ``flock`` on ``path``; False when it is gone (released
    meanwhile). One this user cannot open is taken as held: its holder cannot be told dead.
    OSError when the file system has no locks."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        return _held(fd)
    finally:
        os.close(fd)


def _held(fd: int) -> bool:
    """Whether another open file holds a ``flock`` on ``fd``'s file: a shared lock, tried
    without waiting, is refused while anyone holds the exclusive one, and when granted lasts
    only until the caller closes ``fd``. OSError when the file system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


def _lock_within(fd: int, seconds: float) -> None:
    deadline, pause = time.monotonic() + seconds, 0.01
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise OSError(errno.ETIMEDOUT, f"its guard lock stayed taken for {seconds:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.5)


def _holder(path: Path) -> str:
    """Who holds a claim file: its record, else what its name says (``KEY.HOST.PID.XXXX``)."""
    try:
        record = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict):  # KEY.HOST.PID.XXXX, where HOST may hold dots
        host, _, pid = path.name.partition(".")[2].rpartition(".")[0].rpartition(".")
        record = {"host": host or "?", "pid": pid or "?"}
    return ", ".join(f"{key} {record[key]}" for key in ("host", "pid", "run_dir") if key in record)


def _in_use_text(flag: str, folder: Path, holder: Path) -> str:
    return (f"{flag} {folder} is written by another run ({_holder(holder)}); give another "
            f"{flag}, or stop that run first (if its host is down, remove {holder})")
