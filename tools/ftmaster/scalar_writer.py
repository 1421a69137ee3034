"""A TensorBoard writer that never ends the run it describes.

tensorboard writes from a thread of its own, and once one of its writes fails (a full disk
under the folder) every later call raises that error again. Scalars are never worth the
run: the first failure is said in one line, and the scalars stop there. Both writers use it:
the trainer's (:mod:`megatron.training.tensorboard`), whose raise would end training, and
ftmaster's own (:mod:`ftmaster.board`), whose raise ended the monitor's step or the
supervisor.
"""

from __future__ import annotations

from typing import Any, Callable


class GuardedWriter:
    """``SummaryWriter``'s ``add_scalar``, ``flush`` and ``close`` over ``inner``, each a no-op
    once one failed; ``say`` is given the one line."""

    def __init__(self, inner: Any, what: str, say: Callable[[str], None]) -> None:
        self.inner, self.what, self.say = inner, what, say
        self.stopped = False

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._call(self.inner.add_scalar, tag, value, step)

    def flush(self) -> None:
        self._call(self.inner.flush)

    def close(self) -> None:
        self._call(self.inner.close)
        self.stopped = True

    def _call(self, method: Callable[..., object], *args: Any) -> None:
        if self.stopped:
            return
        try:
            method(*args)
        except Exception as error:  # whatever the file system raised: the run goes on
            self.stopped = True
            self.say(f"{self.what} stop here: {type(error).__name__}: {error}")
