"""Save requests: local triggers, one agreement per iteration, and the gap filter.

Triggers only set local state, as in Megatron's ``dist_signal_handler``:

* SIGTERM (with ``--exit-signal-handler``): save at the next iteration, then exit 0;
* ``FLAG_DIR/save_now.flag``: an emergency save request from the monitor.

All ranks combine their local state with one MAX all-reduce of a small int tensor, so every
rank reaches the same decision at the same iteration: a collective save started by some
ranks only would hang. The same all-reduce carries each rank's compute time of the previous
iteration in a slot of its own (the others hold 0), so the maximum is every rank's figure
(``step_timing``: what straggler detection reads) at no extra collective. The all-reduce runs on a gloo group over CPU tensors, is issued when
an iteration starts and is waited for when it ends, so it overlaps the iteration's compute
and never synchronises a GPU stream. A flag seen during iteration ``k`` is therefore acted on
at the end of ``k + 1`` at the latest.

A flag that is empty, malformed or unreadable still counts: its existence is the request.
The save answers the flag file as it is when the ranks decide (a rank that sampled before
the flag appeared still knows which file it answered); that same file (same inode and mtime)
is not a new request, while a flag written after the decision is, and is honoured next.
A save of the run's last state (the final save, an exit save on SIGTERM or at
``--exit-interval``, a save at the last iteration) answers the flag as it is when that save
starts, whether its request still waits out the gap filter, was agreed or not yet seen: no
later save would answer it, and left behind it would have the next run on that folder save
unasked (:meth:`SaveRequests.answer_with_last_save`).

The gap filter (the paper's rule) lets an emergency save happen only when
``iteration - last_checkpoint_iteration >= ceil(gap_frac x save_interval)``. A request that
arrives too early stays pending and is honoured at the first eligible iteration; a periodic
save, or an interval save into the memory tier, satisfies it too. Without ``--save-interval``
the minimum gap is one iteration, counted from the last save or from the start;
``gap_frac = 0`` disables the filter.
"""

from __future__ import annotations

import collections
import os
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ftmaster.recovery.gap_filter import minimum_gap


@dataclass(frozen=True)
class Decision:
    """What all ranks agreed to do after this iteration."""

    save: bool = False
    emergency: bool = False  # the save answers a flag request
    exit: bool = False  # SIGTERM: save, then leave the loop
    memory: bool = False  # the memory tier's interval save (--non-persistent-save-interval)
    deferred_until: int | None = None  # a pending request waits for this iteration, reported once


@dataclass(frozen=True)
class Triggers:
    """The agreed state of every rank's triggers."""

    sigterm: bool
    flag: bool


class SaveRequests:
    """Local triggers plus the collective that turns them into one decision on every rank."""

    def __init__(self, flag_path: Path | None, handle_sigterm: bool, gap_frac: float,
                 save_interval: int | None, can_save: bool, group=None,
                 memory_interval: int | None = None, ranks: int = 0, rank: int = 0):
        self.flag_path = flag_path
        self.handle_sigterm = handle_sigterm
        self.gap = minimum_gap(gap_frac, save_interval)
        self.save_interval = save_interval
        self.memory_interval = memory_interval
        self.can_save = can_save
        self._signal_received = False
        self._answered_identity: tuple[int, int] | None = None
        self._answered_at: int | None = None
        """The iteration of the save that answers ``_answered_identity``: an older save's end
        (an async periodic one still in flight as the answer started) leaves the flag."""
        self._deferral_reported = False
        self._buffer = torch.zeros(2 + ranks, dtype=torch.int64)
        self._rank = rank
        self.compute_us: list[int] = []
        """Every rank's compute time (microseconds, 0: unknown) of the iteration before the
        last agreed one; empty until an agreement carried them."""
        self._pending_work = None
        self._group = group
        # Seconds the loop spent on the check per iteration (sampling, issuing, waiting).
        self.check_seconds: collections.deque[float] = collections.deque(maxlen=4096)
        if self.active and group is None:
            # A CPU group: the agreement never waits on a GPU stream.
            self._group = torch.distributed.new_group(backend="gloo")
        if handle_sigterm:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    @property
    def active(self) -> bool:
        """False when no trigger can ever fire; then no collective runs at all."""
        return self.flag_path is not None or self.handle_sigterm

    def _on_sigterm(self, signum, frame) -> None:
        self._signal_received = True

    def _flag_identity(self) -> tuple[int, int] | None:
        if self.flag_path is None:
            return None
        try:
            status = os.stat(self.flag_path)
        except OSError:
            return None
        return status.st_ino, status.st_mtime_ns

    def _new_request_seen(self) -> bool:
        seen = self._flag_identity()
        return seen is not None and seen != self._answered_identity

    def start_agreement(self, compute_us: int = 0) -> None:
        """Sample local triggers and start the all-reduce; call when an iteration starts,
        with this rank's compute time of the iteration before (0: unknown)."""
        if not self.active or self._pending_work is not None:
            return
        start = time.perf_counter()
        self._buffer.zero_()
        self._buffer[0] = int(self._signal_received)
        self._buffer[1] = int(self._new_request_seen())
        if len(self._buffer) > 2:
            self._buffer[2 + self._rank] = compute_us
        self._pending_work = torch.distributed.all_reduce(
            self._buffer, op=torch.distributed.ReduceOp.MAX, group=self._group, async_op=True)
        self._issue_seconds = time.perf_counter() - start

    def _finish_agreement(self) -> Triggers:
        if self._pending_work is None:
            return Triggers(False, False)
        start = time.perf_counter()
        self._pending_work.wait()
        self._pending_work = None
        self.check_seconds.append(self._issue_seconds + time.perf_counter() - start)
        sigterm, flag, *self.compute_us = self._buffer.tolist()
        return Triggers(bool(sigterm), bool(flag))

    def decide(self, iteration: int, last_checkpoint_iteration: int) -> Decision:
        """Called by every rank after each iteration; the answer is the same everywhere."""
        periodic = self._due(self.save_interval, iteration)
        memory = self._due(self.memory_interval, iteration) and not periodic
        triggers = self._finish_agreement()
        if triggers.sigterm:
            return Decision(save=self.can_save, exit=True)
        if not (triggers.flag and self.can_save):
            return Decision(save=periodic or memory, memory=memory)
        eligible_at = last_checkpoint_iteration + self.gap
        if periodic or memory or iteration >= eligible_at:
            self._deferral_reported = False
            # The flag as it is now, not as this rank sampled it: another rank may have seen
            # it first, and the save that starts now answers whatever was written before it.
            self._answered_identity, self._answered_at = self._flag_identity(), iteration
            return Decision(save=True, emergency=not (periodic or memory), memory=memory)
        report = not self._deferral_reported
        self._deferral_reported = True
        return Decision(deferred_until=eligible_at if report else None)

    def _due(self, interval: int | None, iteration: int) -> bool:
        return bool(self.can_save and interval and iteration % interval == 0)

    def answer_with_last_save(self, iteration: int) -> None:
        """Every rank, as a save of the run's last state (at ``iteration``) starts: that save
        answers the flag as it is now; a flag written after is kept (:meth:`consume`). With
        no flag now, the answer of an earlier save still in flight is kept."""
        seen = self._flag_identity()
        if seen is not None and seen != self._answered_identity:  # the same: the earlier answer
            self._answered_identity, self._answered_at = seen, iteration

    def consume(self, iteration: int) -> None:
        """After the save at ``iteration`` is durable, or failed (each node's local rank 0, for
        its node's flag folder): remove the flag it answered, not a newer one, nor one a newer
        save answers."""
        if self._answered_identity is None or (
                self._answered_at is not None and iteration < self._answered_at):
            return
        if self._flag_identity() == self._answered_identity:
            try:
                os.unlink(self.flag_path)
            except OSError:
                pass


def median_microseconds(seconds) -> float | None:
    return statistics.median(seconds) * 1e6 if seconds else None
