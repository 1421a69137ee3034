"""TensorBoard scalars under Megatron-LM's names (``--tensorboard-dir``).

As in Megatron-LM (``training_log``), the last rank writes: it holds the loss. Every
``--tensorboard-log-interval`` iterations: ``learning-rate``, ``batch-size``, ``lm loss``,
``grad-norm``, ``loss-scale`` (fp16 only) and ``iteration-time``; after an evaluation,
``lm loss validation``. Every scalar is keyed by iteration, so a relaunch into the same
folder continues the same curves: every writer marks a restart at its first iteration
(``SummaryWriter``'s ``purge_step``), and TensorBoard's reader drops what earlier attempts
wrote from that step on (the iterations it repeats), so each series holds each iteration
once. A relaunch that found no checkpoint starts again from iteration 1 and marks it too.
Megatron-LM's ``... vs samples`` variants are left out: their steps are samples, which that
mark would purge too. What a relaunch can resume from is flushed with each durable
checkpoint, so a killed attempt leaves no gap before it. A write that fails (a full disk
under the folder) is said in one line and the scalars stop there; training goes on
(:class:`ftmaster.scalar_writer.GuardedWriter`).

The reader takes a folder's event files in name order, and a file's name starts with the
second it was made (then the host, the pid and a per-process count, compared as text): a
writer made in the same second as an earlier attempt's could sort before it, and that
attempt's points would then purge this one's. So a writer is made only once the clock has
passed the newest file's second (:func:`wait_past_earlier_files`).
"""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

from ftmaster.scalar_writer import GuardedWriter

NEEDS_PACKAGE = ("--tensorboard-dir needs the tensorboard package: pip install tensorboard "
                 "(scripts/setup.sh installs ftmaster's tensorboard extra)")


EVENT_FILE_SECOND = re.compile(r"events\.out\.tfevents\.(\d+)\.")
LONGEST_WAIT_S = 2.0
"""Past this, the clock is behind the folder's newest file (another node's, ahead of this
one's): said, not waited for."""


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def _warn(line: str) -> None:
    print(f"warning: {line}", flush=True)


def wait_past_earlier_files(folder: Path, say) -> None:
    """Wait until the clock is past the second of ``folder``'s newest event file."""
    try:
        seconds = [int(match.group(1)) for path in folder.iterdir()
                   if (match := EVENT_FILE_SECOND.match(path.name))]
    except OSError:  # no folder yet, or unreadable: the writer says what is wrong with it
        return
    wait = max(seconds, default=0) + 1 - time.time()
    if wait > LONGEST_WAIT_S:
        say(f"TensorBoard scalars in {folder}: this host's clock is {wait - 1:.0f} s behind an "
            f"earlier attempt's event file; TensorBoard may show that attempt's points over "
            f"this one's")
    elif wait > 0:
        time.sleep(wait)


class Board:
    """The last rank's writer; on every other rank (or without ``--tensorboard-dir``) a no-op."""

    def __init__(self, args, first_iteration: int) -> None:
        self.interval = args.tensorboard_log_interval
        self.writer = None
        import torch  # here: ftmaster launch checks the arguments without importing torch

        if args.tensorboard_dir and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only here

            wait_past_earlier_files(Path(args.tensorboard_dir), _warn)
            self.writer = GuardedWriter.opened(
                lambda: SummaryWriter(log_dir=args.tensorboard_dir,
                                      max_queue=args.tensorboard_queue_size,
                                      purge_step=first_iteration),
                f"TensorBoard scalars in {args.tensorboard_dir}", _warn)

    def due(self, iteration: int) -> bool:
        """Whether this rank writes ``iteration``'s scalars (the caller gathers them only then:
        fp16's loss scale is a device read)."""
        return self.writer is not None and not self.writer.stopped and iteration % self.interval == 0

    def iteration(self, iteration: int, *, loss: float | None, learning_rate: float,
                  batch_size: int, grad_norm: float | None, loss_scale: float | None,
                  seconds: float) -> None:
        for name, value in (("learning-rate", learning_rate), ("batch-size", batch_size),
                            ("lm loss", loss), ("grad-norm", grad_norm), ("loss-scale", loss_scale)):
            if value is not None:
                self.writer.add_scalar(name, value, iteration)
        self.writer.add_scalar("iteration-time", seconds, iteration)

    def validation(self, iteration: int, loss: float | None) -> None:
        if self.writer is not None and loss is not None:
            self.writer.add_scalar("lm loss validation", loss, iteration)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
