"""A TensorBoard writer that never ends the run it describes.

tensorboard writes from a thread of its own, and once one of its writes fails (a full disk
under the folder) every later call raises that error again. Scalars are never worth the
run: the first failure is said in one line, and the scalars stop there. Both writers use it:
the trainer's (:mod:`megatron.training.tensorboard`), whose raise would end training, and
ftmaster's own (:mod:`ftmaster.board`), whose raise ended the monitor's step or the
supervisor.
"""

from __future__ import annotations

import errno
from typing import Any, Callable

FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
"""A file system with no room left for the writer (or a quota, or a file size limit)."""


class GuardedWriter:
    """``SummaryWriter``'s ``add_scalar``, ``flush`` and ``close`` over ``inner``, each a no-op
    once one failed; ``say`` is given the one line."""

    def __init__(self, inner: Any, what: str, say: Callable[[str], None]) -> None:
        self.inner, self.what, self.say = inner, what, say
        self.stopped = False

    @classmethod
    def opened(cls, make: Callable[[], Any], what: str, say: Callable[[str], None],
               full_only: bool = False) -> "GuardedWriter":
        """The writer ``make`` builds, or a stopped one, the failure said, when that fails:
        ``SummaryWriter`` writes its file's first record at once, on a full disk too.
        ``full_only``: any other failure (a folder it may not write) is raised, for a launch
        to refuse."""
        try:
            return cls(make(), what, say)
        except OSError as error:
            if full_only and error.errno not in FULL:
                raise
            writer = cls(None, what, say)
            writer._stop(error)
            return writer

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._call("add_scalar", tag, value, step)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._call("close")
        self.stopped = True

    def _call(self, method: str, *args: Any) -> None:
        if self.stopped:
            return
        try:
            getattr(self.inner, method)(*args)
        except Exception as error:  # whatever the file system raised: the run goes on
            self._stop(error)

    def _stop(self, error: Exception) -> None:
        self.stopped = True
        self.say(f"{self.what} stop here: {type(error).__name__}: {error}")
