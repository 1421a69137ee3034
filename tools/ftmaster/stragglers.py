"""The supervisor's straggler watch: the ranks' compute figures from the heartbeat, the
detector (:mod:`ftmaster.monitor.stragglers`), and the step times a drain decision weighs.

By default a straggler is reported (console, ``straggler`` event, ``ftmaster report``). With
``--drain-stragglers`` the supervisor drains its GPU (an agreed save, then a relaunch without
it) when the planner's cost model says the GPUs left run faster than the job runs now with
the straggler; never below the planner's minimum and never more than one GPU per window
(:meth:`StragglerWatch.drain_allowed`). The model is calibrated on the step the same layout
would take without the slowdown (:meth:`Found.calibration_s`), the lesser of two measures of
it, neither exact: the step before the slowdown runs high while a run still warms up, and
the step now less the straggler's typical extra compute runs high or low by how long the
other ranks wait for it (on CPU ranks sharing cores that is not its extra compute). On 4 CPU
ranks slowed 2x: 0.76 s from the second against 0.62 s from the first (the GPU was kept,
wrongly, when the second alone decided), then 0.47 and 0.60 s against 0.61 and 0.76 s.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

from ftmaster.monitor.stragglers import (Straggler, StragglerConfig, StragglerTracker,
                                        has_peers, positive_figure)
from ftmaster.recovery.planner import PlanError

KEPT_BEATS = 256
"""Heartbeats kept per attempt for step times (the detector's window is far shorter)."""
WARMUP_ITERATIONS = 3
"""An attempt's first iterations are left out (start-up, allocator and cache warm-up)."""


@dataclass(frozen=True)
class Found:
    """A straggler on this node's GPU ``gpu``."""

    gpu: int
    straggler: Straggler
    step_s: float | None
    """The job's step time since the straggler slowed it; None until measured."""
    healthy_step_s: float | None
    """The job's step time before it; None when it was never measured healthy."""

    def extra_s(self) -> float:
        """What the straggler typically computes per iteration beyond its peers (0 at most)."""
        typical = self.straggler.typical_ms or self.straggler.compute_ms
        return max(0.0, (typical - self.straggler.peers_ms) / 1000)

    def without_extra_s(self) -> float | None:
        """The job's step now, less what the straggler typically computes beyond its peers."""
        if self.step_s is None:
            return None
        extra = self.extra_s()
        return self.step_s - extra if self.step_s > extra > 0 else None

    def calibration_s(self) -> float | None:
        """The step the same layout would take without the slowdown: the lesser of the two
        measures of it (see the module docstring)."""
        known = [s for s in (self.healthy_step_s, self.without_extra_s()) if s is not None]
        return min(known) if known else None


class StragglerWatch:
    """Per attempt: the tracker, the heartbeats' (iteration, time) pairs, and the drains."""

    def __init__(self, config: StragglerConfig, drain: bool, drain_window_s: float) -> None:
        self.config, self.drain, self.drain_window_s = config, drain, drain_window_s
        self._last_drain: float | None = None
        self._slowed_step_s: float | None = None
        self.drained_step_s: float | None = None
        """In the attempt after a drain: the slowed step time, to report beside its own."""
        self.new_attempt((), 0)

    def new_attempt(self, gpus: Sequence[int], rank_offset: int) -> None:
        self.gpus, self.rank_offset = tuple(gpus), rank_offset
        self.drained_step_s, self._slowed_step_s = self._slowed_step_s, None
        self.tracker = StragglerTracker(self.config)
        self.unslowed_step_s: float | None = None
        """The attempt's step without its stragglers (the least of their
        :meth:`Found.calibration_s`); None while none was named."""
        self._beats: dict[int, float] = {}
        self._first: int | None = None
        self.peerless: bool | None = None
        """Whether no rank of this attempt has a peer (:func:`has_peers`); None until its
        heartbeat says each rank's stage."""

    def observe(self, heartbeat: dict | None) -> list[Found]:
        """One heartbeat; the stragglers it revealed. What it holds that is not what the
        trainer writes (``step_timing``) is unknown: it names no one and ends nothing."""
        if not heartbeat or not isinstance(heartbeat.get("iteration"), int):
            return []
        iteration = heartbeat["iteration"]
        at = heartbeat.get("time", time.time())
        if iteration not in self._beats and (seconds := positive_figure(at)) is not None:
            self._beats[iteration] = seconds
            while len(self._beats) > KEPT_BEATS:  # in iteration order: the oldest go
                del self._beats[next(iter(self._beats))]
        self._first = _first_completed(heartbeat) if self._first is None else self._first
        compute = heartbeat.get("compute")
        compute = compute if isinstance(compute, dict) else {}
        stages = _per_rank(compute.get("stages"))
        if self.peerless is None and len(stages) > 1:
            self.peerless = not has_peers(stages)
        rows = compute.get("ms")
        figures = {it: dict(enumerate(values)) for key, values in
                   (rows.items() if isinstance(rows, dict) else ())
                   if (it := _iteration(key)) is not None and isinstance(values, list)
                   and it >= self._first + WARMUP_ITERATIONS}
        return [f for f in map(self._found, self.tracker.observe(
            figures, stages, _per_rank(compute.get("replicas"))))
                if f is not None]

    @property
    def last_iteration(self) -> int | None:
        """The newest iteration this attempt's heartbeats reached; None before the first."""
        return max(self._beats, default=None)

    def gpu_of(self, rank: int) -> int | None:
        """The GPU of this node that ``rank`` runs on; None for another node's rank."""
        local = rank - self.rank_offset
        return self.gpus[local] if 0 <= local < len(self.gpus) else None

    def describe_ranks(self, ranks: Sequence[int]) -> str:
        """``GPU 1``, or ``rank 5 (another node's)``, for each of ``ranks``."""
        return ", ".join(f"GPU {gpu}" if (gpu := self.gpu_of(rank)) is not None
                         else f"rank {rank} (another node's)" for rank in ranks)

    def _found(self, straggler: Straggler) -> Found | None:
        """The straggler, if it is one of this node's ranks: every node's heartbeat carries
        every rank's figures (all are peers to compare), but only the node that holds a GPU
        names it, reports it and may drain it, so a straggler is one event, not one per node."""
        gpu = self.gpu_of(straggler.rank)
        if gpu is None:
            return None
        # A heartbeat is written as its iteration ends: the step up to ``since``'s is slow.
        found = Found(gpu, straggler, self.step_seconds(since=straggler.since),
                      self.step_seconds(until=straggler.since - 1))
        if (unslowed := found.calibration_s()) is not None:
            self.unslowed_step_s = min(unslowed, self.unslowed_step_s or unslowed)
        return found

    def step_seconds(self, since: int | None = None, until: int | None = None,
                     least: int = 2) -> float | None:
        """The median seconds per iteration between heartbeats of this attempt (after its
        warm-up), within ``[since, until]``; None with fewer than ``least`` steps between
        them."""
        start = (self._first or 0) + WARMUP_ITERATIONS
        beats = sorted((it, t) for it, t in self._beats.items() if it >= max(start, since or start)
                       and (until is None or it <= until))
        steps = [(t2 - t1) / (i2 - i1) for (i1, t1), (i2, t2) in zip(beats, beats[1:]) if i2 > i1]
        return round(statistics.median(steps), 4) if len(steps) >= least else None

    def remeasured(self, found: Found) -> Found:
        """``found`` with the job's step time since the slowdown measured again: a drain is
        weighed on every step seen so far, not on those seen when the straggler was named."""
        step_s = self.step_seconds(since=found.straggler.since)
        return found if step_s is None else dataclasses.replace(found, step_s=step_s)

    def drain_allowed(self, now: float) -> bool:
        """At most one drain per window."""
        return self._last_drain is None or now - self._last_drain >= self.drain_window_s

    def drained(self, now: float, step_s: float | None) -> None:
        self._last_drain, self._slowed_step_s = now, step_s


def _first_completed(heartbeat: dict) -> int:
    """The attempt's first completed iteration, which its warm-up counts from: the one the
    trainer names (a poll may first read a later heartbeat, and the warm-up would then also
    swallow healthy iterations), else the one this heartbeat ends."""
    iteration, first = heartbeat["iteration"], heartbeat.get("first_iteration")
    named = isinstance(first, int) and not isinstance(first, bool) and 0 < first <= iteration
    return first if named else iteration


def _iteration(key) -> int | None:
    """A heartbeat's iteration key (``"12"``), or None (``int`` refuses 5000 digits)."""
    return (int(key) if isinstance(key, str) and key.isascii() and key.isdigit()
            and len(key) <= 18 else None)


def _per_rank(values) -> dict[int, int]:
    """A per-rank list of whole numbers (stages, replicas) as rank -> value; a rank whose
    entry is not one is unknown."""
    if not isinstance(values, list):
        return {}
    return {rank: value for rank, value in enumerate(values)
            if isinstance(value, int) and not isinstance(value, bool)}


@dataclass(frozen=True)
class DrainDecision:
    drain: bool
    line: str
    """The one line that says which estimate decided."""
    estimated_step_s: float | None = None


def decide_drain(found: Found, gpus_left: int, estimate, calibration: float | None,
                 global_batch: int, held_back_by: Found | None = None) -> DrainDecision:
    """Whether the job runs faster without ``found``'s GPU, whose step time with it is
    measured at ``global_batch``. ``estimate()`` is the planner on the GPUs left, calibrated on
    ``calibration``, the original layout's step without the slowdown: a Plan, PlanError when
    they cannot run the job, or ValueError when the cost model cannot be calibrated on it.
    Uncalibrated, the model's seconds are not this host's: kept."""
    gpu = found.gpu
    if calibration is None:
        return DrainDecision(False, f"keeping GPU {gpu}: no step of the original layout "
                                    f"without the slowdown is measured to calibrate the cost "
                                    f"model on")
    no_estimate = (f"keeping GPU {gpu}: the cost model has no step estimate for "
                   f"{_left(gpus_left)}")
    try:
        plan = estimate()
    except PlanError as error:
        return DrainDecision(False, f"keeping GPU {gpu}: {_left(gpus_left)} cannot run the "
                                    f"job ({error})")
    except ValueError as error:
        return DrainDecision(False, f"{no_estimate} ({error})")
    if plan.estimated_step_seconds is None:
        return DrainDecision(False, no_estimate)
    return _weighed(found, plan, gpus_left, calibration, global_batch, held_back_by)


def _left(gpus: int) -> str:
    return "the GPU left" if gpus == 1 else f"the {gpus} GPUs left"


def _weighed(found: Found, plan, gpus_left: int, calibration: float,
             global_batch: int, other: Found | None) -> DrainDecision:
    """The step now against the estimate for the job's own global batch: with
    --global-batch-tolerance the GPUs left may train another, and a run ends at a number of
    samples (batch 15 at 1.25 s/iteration is 1.333 s for 16). Both in milliseconds, as the
    line says them: a gain it cannot show is no reason for a restart. ``other``: the slowest
    other straggler among the GPUs left, still slow; they would run at its pace, the estimate
    plus what it computes beyond its peers (GPUs at 2.0x and 1.9x: the first was drained on a
    healthy estimate, and the job then ran slower than before)."""
    now, left, batch = found.step_s, plan.estimated_step_seconds, plan.global_batch_size
    held_back = 0.0 if other is None else other.extra_s()
    at_job_batch = left * global_batch / batch
    compared = at_job_batch + held_back
    faster, tie = round(compared, 3) < round(now, 3), round(compared, 3) == round(now, 3)
    layout = (f"TP{plan.tensor_model_parallel_size} x PP{plan.pipeline_model_parallel_size} "
              f"x DP{plan.data_parallel_size}"
              + ("" if batch == global_batch else f", global batch {batch}"))
    figures = [("", left, f" s/iteration on {_left(gpus_left)} ({layout})")]
    if batch != global_batch:
        figures.append((": ", at_job_batch, f" s for the job's {global_batch} samples"))
    if held_back:
        figures.append((f", plus the {held_back:.3f} s GPU {other.gpu} computes beyond its peers "
                        f"({other.straggler.slowdown:.2f}x): ", compared, " s/iteration"))
    # "the same" goes with the figure compared, the last one the line gives
    estimated = "".join(f"{before}{'the same ' if tie and i == len(figures) - 1 else ''}"
                        f"{value:.3f}{after}" for i, (before, value, after) in enumerate(figures))
    return DrainDecision(faster, (
        f"{'draining' if faster else 'keeping'} GPU {found.gpu}: the job runs {now:.3f} "
        f"s/iteration with it ({found.straggler.slowdown:.2f}x its peers' compute); the cost "
        f"model estimates {estimated}, calibrated on the original layout's {calibration:.3f} "
        f"s/iteration without the slowdown"), left)
