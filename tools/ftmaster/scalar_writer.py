"""A TensorBoard writer that never ends the run it describes.

tensorboard writes from a thread of its own, and once one of its writes fails (a full disk
under the folder) every later call raises that error again. Scalars are never worth the
run: the first failure is said in one line, and the scalars stop there. Both writers use it:
the trainer's (:mod:`megatron.training.tensorboard`), whose raise would end training, and
ftmaster's own (:mod:`ftmaster.board`), whose raise ended the monitor's step or the
supervisor.

A folder that stops answering (a hung NFS home) is no better: tensorboard's own queue holds
ten records, and then every ``add_scalar`` blocks, under a lock its ``flush`` holds too, so
the monitor's thread stopped sampling and the supervisor stopped in its next event. The calls
run on a thread of this writer's: a scalar is queued without waiting, and a full queue, or a
flush or close that does not finish within ``WAIT_S``, stops the scalars as a failure does.
"""

from __future__ import annotations

import contextlib
import errno
import queue
import threading
from typing import Any, Callable

FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
"""A file system with no room left for the writer (or a quota, or a file size limit)."""


QUEUED = 10_000
"""Scalars that may wait for the writer's thread (a few minutes of a run's scalars)."""
WAIT_S = 10.0
"""How long a flush or close waits for the writer's thread before the scalars stop."""


class GuardedWriter:
    """``SummaryWriter``'s ``add_scalar``, ``flush`` and ``close`` over ``inner``, run on a
    thread of its own, each a no-op once one failed; ``say`` is given the one line."""

    def __init__(self, inner: Any, what: str, say: Callable[[str], None]) -> None:
        self.inner, self.what, self.say = inner, what, say
        self.stopped = False
        self._said = threading.Lock()
        self._calls: queue.Queue = queue.Queue(QUEUED)
        threading.Thread(target=self._serve, name="ftmaster-scalars", daemon=True).start()

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
        if self.stopped:
            return
        try:
            self._calls.put_nowait(("add_scalar", (tag, value, step), None))
        except queue.Full:
            self._stop(TimeoutError(f"the folder does not keep up ({QUEUED} scalars waiting)"))

    def flush(self) -> None:
        self._wait_for("flush")

    def close(self) -> None:
        if self.stopped:  # the thread still ends
            with contextlib.suppress(queue.Full):
                self._calls.put_nowait(("close", (), None))
            return
        self._wait_for("close")
        self.stopped = True

    def _wait_for(self, method: str) -> None:
        """``method`` once the scalars queued before it are written, waited for ``WAIT_S``."""
        if self.stopped:
            return
        done = threading.Event()
        try:
            self._calls.put((method, (), done), timeout=WAIT_S)
        except queue.Full:
            done = None
        if done is None or not done.wait(WAIT_S):
            self._stop(TimeoutError(f"{method} did not finish within {WAIT_S:g} s (the folder "
                                    "stopped answering?)"))

    def _serve(self) -> None:
        while True:
            method, args, done = self._calls.get()
            if not self.stopped:
                try:
                    getattr(self.inner, method)(*args)
                except Exception as error:  # whatever the file system raised: the run goes on
                    self._stop(error)
            if done is not None:
                done.set()
            if method == "close":
                return

    def _stop(self, error: Exception) -> None:
        with self._said:  # the caller's thread and the writer's may both get here
            if self.stopped:
                return
            self.stopped = True
        self.say(f"{self.what} stop here: {type(error).__name__}: {error}")
