"""Save requests: local triggers, one agreement per iteration, and the gap filter.

Triggers only set local state, as in Megatron's ``dist_signal_handler``:

* SIGTERM (with ``--exit-signal-handler``): save at the next iteration, then exit 0;
* ``RUN_DIR/flags/save_now.flag``: an emergency save request from the monitor.

Every iteration all ranks combine their local state with one MAX all-reduce of a two-int
tensor, so every rank reaches the same decision at the same iteration: a collective save
started by some ranks only would hang. A flag that is empty, malformed or unreadable still
counts: its existence is the request.

The gap filter (the paper's rule) lets an emergency save happen only when
``iteration - last_checkpoint_iteration >= ceil(gap_frac x save_interval)``. A request that
arrives too early stays pending and is honoured at the first eligible iteration; a periodic
save satisfies it too. Without ``--save-interval`` the minimum gap is one iteration, counted
from the last save or from the start.
"""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch


def minimum_gap(gap_frac: float, save_interval: int | None) -> int:
    if not save_interval:
        return 1
    return max(1, math.ceil(gap_frac * save_interval))


@dataclass(frozen=True)
class Decision:
    """What all ranks agreed to do after this iteration."""

    save: bool = False
    emergency: bool = False  # the save answers a flag request
    exit: bool = False  # SIGTERM: save, then leave the loop
    deferred_until: int | None = None  # a pending request waits for this iteration


class SaveRequests:
    """Local triggers plus the collective that turns them into one decision on every rank."""

    def __init__(self, flag_path: Path | None, handle_sigterm: bool, gap_frac: float,
                 save_interval: int | None, can_save: bool):
        self.flag_path = flag_path
        self.gap = minimum_gap(gap_frac, save_interval)
        self.save_interval = save_interval
        self.can_save = can_save
        self._signal_received = False
        self._flag_identity: tuple[int, int] | None = None
        self._deferral_reported = False
        self._buffer = torch.zeros(2, dtype=torch.int32,
                                   device="cuda" if torch.cuda.is_available() else "cpu")
        if handle_sigterm:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    @property
    def active(self) -> bool:
        """False when no trigger can ever fire, so the per-iteration collective is skipped."""
        return self.flag_path is not None or signal.getsignal(signal.SIGTERM) == self._on_sigterm

    def _on_sigterm(self, signum, frame) -> None:
        self._signal_received = True

    def _flag_seen(self) -> bool:
        try:
            status = os.stat(self.flag_path)
        except OSError:
            self._flag_identity = None
            return False
        self._flag_identity = (status.st_ino, status.st_mtime_ns)
        return True

    def _agree(self) -> tuple[bool, bool]:
        self._buffer[0] = int(self._signal_received)
        self._buffer[1] = int(self.flag_path is not None and self._flag_seen())
        torch.distributed.all_reduce(self._buffer, op=torch.distributed.ReduceOp.MAX)
        exit_now, flagged = self._buffer.tolist()
        return bool(exit_now), bool(flagged)

    def decide(self, iteration: int, last_checkpoint_iteration: int) -> Decision:
        """Called by every rank after each iteration; the answer is the same everywhere."""
        periodic = bool(self.can_save and self.save_interval
                        and iteration % self.save_interval == 0)
        if not self.active:
            return Decision(save=periodic)
        exit_now, flagged = self._agree()
        if exit_now:
            return Decision(save=self.can_save, exit=True)
        if not (flagged and self.can_save):
            return Decision(save=periodic)
        eligible_at = last_checkpoint_iteration + self.gap
        if periodic or iteration >= eligible_at:
            self._deferral_reported = False
            return Decision(save=True, emergency=not periodic)
        report = not self._deferral_reported
        self._deferral_reported = True
        return Decision(deferred_until=eligible_at if report else None)

    def consume(self) -> None:
        """After a successful save: remove the flag that was answered, not a newer one."""
        if self.flag_path is None or self._flag_identity is None:
            return
        try:
            status = os.stat(self.flag_path)
            if (status.st_ino, status.st_mtime_ns) == self._flag_identity:
                os.unlink(self.flag_path)
        except OSError:
            pass
        self._flag_identity = None
