"""Each rank's compute time per iteration, for ftmaster's straggler detection.

A rank's compute is the time from the start of its iteration until it enters the gradient
reduction (the schedule's ``finalize_model_grads``): a slow rank gets there late and its
peers wait for it inside the reduction, so their compute stays short while every rank's
iteration lasts as long as the slowest one's. With pipeline stages the compute also holds
the waits for activations from the neighbouring stage; peers are compared only within a
stage, where those waits are alike.

On CUDA the host only queues kernels, so the time is taken between two CUDA events on the
current stream and read one iteration later: no added synchronisation. By then they have
usually completed (the loss and the NaN guard synchronise), but not always: with
``--clip-grad 0`` and the guard off nothing synchronises a first pipeline stage, which
computes no loss. An iteration the device has not finished has no figure.

On CPU, the CPU time of the rank's thread (``time.thread_time``): on a host with more ranks
than cores, time off the core is the host's contention, not the rank's compute. The clock
less the thread's wait on a run queue still counted the rest of it (a lock or a read that
another thread, itself waiting for a core, held up): on the project's 2-core machine under
load 11-16, healthy ranks of 2 and 3 read up to 1.62x their peers over a window of 4 and one
was named at 1.35x; by CPU time at most 1.18x. A rehearsal's ``slow`` sleeps, which takes no
CPU time: its sleep is added to the figure (:meth:`ComputeTimer.slow_down`).

On CUDA the compute also holds what the rank waits for inside its model replica: its
tensor-parallel partners in every layer's all-reduce, its neighbouring stages' activations
and gradients (on CPU the thread waits for them off its core, uncounted). A slow GPU slows its replica mates' figures too, so the heartbeat says each rank's replica (its
data-parallel index), and the supervisor does not take one of two slow mates for the culprit
(``ftmaster.monitor.stragglers``).

The figures of every rank travel with the save agreement (one all-reduce per iteration that
runs anyway, ``save_requests``), one iteration late, and local rank 0 puts them in the
heartbeat (:meth:`ComputeFigures.heartbeat`).
"""

from __future__ import annotations

import collections
import time

import torch

KEPT = 16
"""Iterations of figures in the heartbeat: the supervisor polls it, and misses none while it
polls at least once every 16 iterations."""


class ComputeTimer:
    """The compute of the iteration under way, and of the one before it."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._start = self._entered = None
        self._host_start = 0.0
        self._previous: tuple | None = None

    def _mark(self):
        if not self.cuda:
            return time.thread_time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        """An iteration starts: the last one's marks become readable."""
        # An iteration that never reached the reduction (an evaluation) has no figure.
        self._previous = None if self._entered is None else (self._start, self._entered)
        self._start, self._entered, self._host_start = self._mark(), None, time.perf_counter()

    def reduction_entered(self) -> None:
        if self._start is not None and self._entered is None:
            self._entered = self._mark()

    def seconds_so_far(self) -> float:
        """The compute of the iteration under way until now, as its figure will count it (the
        device drained first on CUDA; never on the measured path)."""
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter() - self._host_start
        return 0.0 if self._start is None else self._mark() - self._start

    def slow_down(self, factor: float) -> None:
        """A rehearsal's slowdown: sleep F - 1 times the compute so far, so that the figure is
        F times its own."""
        if self._start is None:
            return
        seconds = (factor - 1) * self.seconds_so_far()
        time.sleep(seconds)
        if not self.cuda:  # CUDA's events hold the sleep; the thread's CPU time does not
            self._start -= seconds

    def previous_microseconds(self) -> int:
        """The last complete iteration's compute; 0 when unknown."""
        if self._previous is None:
            return 0
        start, entered = self._previous
        if self.cuda:
            # elapsed_time raises (cudaErrorNotReady) before the device reached the event.
            return max(1, int(start.elapsed_time(entered) * 1000)) if entered.query() else 0
        return max(1, int((entered - start) * 1e6))


class ComputeFigures:
    """Every rank's compute per iteration, as the agreements bring them (rank 0's view)."""

    def __init__(self, stage: list[int], replica: list[int]) -> None:
        self.stage = stage
        """Each global rank's pipeline stage."""
        self.replica = replica
        """Each global rank's model replica (data-parallel index)."""
        self._kept: collections.OrderedDict[int, list[int]] = collections.OrderedDict()

    def record(self, iteration: int, microseconds: list[int]) -> None:
        """The figures of ``iteration`` (0: that rank's is unknown)."""
        if any(microseconds):
            self._kept[iteration] = microseconds
            while len(self._kept) > KEPT:
                self._kept.popitem(last=False)

    def heartbeat(self) -> dict | None:
        """``{"stages": [...], "replicas": [...], "ms": {iteration: [ms per rank, None
        unknown]}}``."""
        if not self._kept:
            return None
        return {"stages": self.stage,
                "replicas": self.replica,
                "ms": {str(it): [round(us / 1000, 3) if us else None for us in values]
                       for it, values in self._kept.items()}}
