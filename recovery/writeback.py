"""Writing large files at the disk's pace: each chunk's writeback starts as soon as it is
written, and the writer waits for the chunk a few tens of megabytes behind.

Left to itself, the kernel lets a fast writer dirty gigabytes of page cache, then throttles
its ``write`` calls in bursts while the disk catches up, and the final ``fsync`` writes what
is left: measured here, two 600 MB files written back to back reached 0.6-2.3 GB/s that way
and 1.8-3.0 GB/s paced. PostgreSQL's ``checkpoint_flush_after`` and RocksDB's
``bytes_per_sync`` do the same with the same call, ``sync_file_range(2)``, which Python's
``os`` lacks. Where it is missing (not Linux), or a file system ignores it (tmpfs), nothing
changes.

A failed writeback is raised as the ``OSError`` it is. The wait reports it, and reports it
only once: it advances the file's error cursor (``file_fdatawait_range``), so the ``fsync``
that ends the file would return 0 for data that never reached the disk. A file or kernel
that does not support the call (``EINVAL``, ``ESPIPE``, ``ENOSYS``, ``EOPNOTSUPP``) is no
failure: that file is written unpaced.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

_START = 2  # SYNC_FILE_RANGE_WRITE
_WAIT = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER
STEP = 8 << 20
LAG = 32 << 20
_UNSUPPORTED = {errno.EINVAL, errno.ESPIPE, errno.ENOSYS, errno.EOPNOTSUPP}


def _sync_file_range():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_CALL = _sync_file_range()


class Writeback:
    """Paces one file written from its start, in order; :meth:`written` after each write,
    with the file's data flushed to the kernel up to ``end``."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._started = self._waited = 0
        self._unsupported = False

    def due(self, end: int) -> bool:
        return _CALL is not None and not self._unsupported and end - self._started >= STEP

    def written(self, end: int) -> None:
        """Raises the ``OSError`` of a failed writeback."""
        if not self.due(end):
            return
        if not self._call(self._started, end - self._started, _START):
            return
        self._started = end
        if self._started - self._waited > LAG:
            if not self._call(self._waited, self._started - LAG - self._waited, _WAIT):
                return
            self._waited = self._started - LAG

    def _call(self, offset: int, length: int, flags: int) -> bool:
        """Whether the call was made; False when this file cannot be paced."""
        if _CALL(self._fd, offset, length, flags) == 0:
            return True
        code = ctypes.get_errno()
        if code in _UNSUPPORTED:
            self._unsupported = True
            return False
        raise OSError(code, f"writeback of bytes {offset}-{offset + length} failed: "
                            f"{os.strerror(code)}")
