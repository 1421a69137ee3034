"""One ftmaster per run directory: an exclusive ``flock`` on ``RUN_DIR/ftmaster.lock``.

The kernel drops the lock when its holder dies, SIGKILL included, so a stale lock file never
blocks a new run. The file holds the holder's pid, for the error message only.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = "ftmaster.lock"


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
