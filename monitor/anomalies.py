"""Injectable telemetry anomalies and the overlay that applies them to any backend's samples.

Each anomaly is a pure change to one sample as a function of the time since it began, so the
same code writes the sim backend's faults, the trace generator's precursors and, laid over a
real backend, ``--inject degrade`` on real GPUs (their telemetry worsens in software).

Kinds: thermal runaway, ECC single-bit burst, power oscillation, throttling, utilisation
collapse, XID, double-bit error, pending page retirement, recovery action, device lost.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field, replace

from ftmaster.faults import Fault, Injection
from ftmaster.monitor.sample import GpuSample
from ftmaster.monitor.signals import HW_POWER_BRAKE, HW_SLOWDOWN, HW_THERMAL


@dataclass(frozen=True, kw_only=True)
class Anomaly:
    """Base: ``delay_samples`` samples after onset pass before the anomaly shows."""

    delay_samples: int = 0

    def apply(self, sample: GpuSample, elapsed_s: float) -> GpuSample | None:
        """Change ``sample`` in place (or return None: the GPU is gone)."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class ThermalRunaway(Anomaly):
    """Cooling degrades: temperature climbs linearly; past 87 C the GPU thermally throttles."""

    rate_c_per_min: float = 3.0
    max_rise_c: float = 45.0

    def apply(self, sample: GpuSample, elapsed_s: float) -> GpuSample:
        if sample.temperature is not None:
            sample.temperature += min(self.max_rise_c, self.rate_c_per_min * elapsed_s / 60.0)
            if sample.temperature >= 87.0:
                _throttle(sample, HW_THERMAL, clock_factor=0.75)
        return sample


@dataclass(frozen=True, kw_only=True)
class EccBurst(Anomaly):
    """Corrected (single-bit) errors at an exponentially growing rate: the count doubles
    every ``doubling_s`` seconds on top of ``initial`` extra errors."""

    doubling_s: float = 60.0
    initial: int = 1

    def apply(self, sample: GpuSample, elapsed_s: float) -> GpuSample:
        if sample.ecc_sbe is not None:
            sample.ecc_sbe += int(self.initial * 2.0 ** min(40.0, elapsed_s / self.doubling_s))
        return sample


@dataclass(frozen=True, kw_only=True)
class PowerOscillation(Anomaly):
    """Power swings by +-``amplitude_frac`` of the draw (a failing regulator). Two
    incommensurate periods so that no sampling interval aliases it to a constant."""

    amplitude_frac: float = 0.35
    period_s: float = 13.7

    def apply(self, sample: GpuSample, elapsed_s: float) -> GpuSample:
        if sample.power_draw is not None:
            phase = 2.0 * math.pi * elapsed_s / self.period_s
            swing = 0.7 * math.sin(phase) + 0.3 * math.sin(phase * 2.71828 + 1.0)
            sample.power_draw = max(0.0, sample.power_draw * (1.0 + self.amplitude_frac * swing))
        return sample


@dataclass(frozen=True, kw_only=True)
class Throttling(Anomaly):
    """Hardware slowdown (or power brake) holds the clocks down."""

    mask: int = HW_SLOWDOWN | HW_POWER_BRAKE
    clock_factor: float = 0.55

    def apply(self, sample: GpuSample, elapsed_s: float) -> GpuSample:
        _throttle(sample, self.mask, self.clock_factor)
        if sample.power_draw is not None:
            sample.power_draw *= 0.8
        return sample


@dataclass(frozen=True, kw_only=True)
class UtilizationCollapse(Anomaly):
    """This GPU stops doing work while its peers go on (a stuck kernel, a stopped rank)."""

    level: float = 2.0

    def apply(self, sample: GpuSample, elapsed_s: float) -> GpuSample:
        if sample.gpu_utilization is not None:
            sample.gpu_utilization = self.level
        if sample.memory_utilization is not None:
            sample.memory_utilization = min(sample.memory_utilization, self.level)
        if sample.power_draw is not None:
            sample.power_draw *= 0.35
        return sample


@dataclass(frozen=True, kw_only=True)
class StoppedRank(UtilizationCollapse):
    """A ``hang`` rehearsal's rank, stopped: its GPU idles until the rank is gone (its attempt
    ended), not for the rest of the run."""

    level: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Xid(Anomaly):
    """An XID event, reported in the first sample once the anomaly shows."""

    code: int = 79

    def apply(self, sample: GpuSample, elapsed_s: float) -> GpuSample:
        sample.xid = self.code
        return sample


@dataclass(frozen=True, kw_only=True)
class DoubleBitError(Anomaly):
    """One uncorrectable error: both the volatile and the aggregate counters step up."""

    def apply(self, sample: GpuSample, elapsed_s: float) -> GpuSample:
        if sample.ecc_dbe is not None:
            sample.ecc_dbe += 1
        if sample.errors is not None:
            sample.errors += 1
        return sample


@dataclass(frozen=True, kw_only=True)
class PagesPending(Anomaly):
    def apply(self, sample: GpuSample, elapsed_s: float) -> GpuSample:
        sample.retired_pages_pending = 1
        return sample


@dataclass(frozen=True, kw_only=True)
class RecoveryAction(Anomaly):
    """The driver asks for a recovery action (1 GPU reset, 2 node reboot, 4 drain and reset)."""

    action: int = 1

    def apply(self, sample: GpuSample, elapsed_s: float) -> GpuSample:
        sample.recovery_action = self.action
        return sample


@dataclass(frozen=True, kw_only=True)
class DeviceLost(Anomaly):
    def apply(self, sample: GpuSample, elapsed_s: float) -> None:
        return None


DRIFT_SIGNALS = ("temperature", "power", "clock")
DRIFT_SHAPES = ("linear", "accelerating", "stairs")
DRIFT_TEMPERATURE_LIMIT_C = 87.0
DRIFT_CLOCK_END = 0.6
"""A drifting clock ends at this share of its loaded value (below the monitor's floor)."""


@dataclass(frozen=True, kw_only=True)
class Drift(Anomaly):
    """A slow drift of one signal to its limit, reached after ``duration_s``: temperature to
    87 C (where the GPU throttles for heat), power to its cap, the clock down to
    ``DRIFT_CLOCK_END`` of itself. ``shape``: ``linear``; ``accelerating`` (quadratic: slow
    at first); ``stairs`` (a step every ``step_s``)."""

    signal: str = "temperature"
    duration_s: float = 1500.0
    shape: str = "linear"
    step_s: float = 180.0

    def progress(self, elapsed_s: float) -> float:
        x = min(1.0, max(0.0, elapsed_s / self.duration_s))
        if self.shape == "accelerating":
            return x * x
        if self.shape == "stairs":
            return min(1.0, math.floor(elapsed_s / self.step_s) * self.step_s / self.duration_s)
        return x

    def apply(self, sample: GpuSample, elapsed_s: float) -> GpuSample:
        p = self.progress(elapsed_s)
        if self.signal == "temperature" and sample.temperature is not None:
            sample.temperature += (DRIFT_TEMPERATURE_LIMIT_C - sample.temperature) * p
            if p >= 1.0:
                _throttle(sample, HW_THERMAL, clock_factor=0.75)
        elif self.signal == "power" and None not in (sample.power_draw, sample.power_limit):
            sample.power_draw += max(0.0, sample.power_limit - sample.power_draw) * p
        elif self.signal == "clock" and sample.sm_clock is not None:
            sample.sm_clock *= 1.0 - (1.0 - DRIFT_CLOCK_END) * p
        return sample


@dataclass(frozen=True, kw_only=True)
class LoadStep(Anomaly):
    """Benign: a heavier phase of work from now on. Temperature and power rise by
    ``rise_c`` and ``power_frac`` of the cap with a first-order response of ``tau_s``
    (a slow warm-up when long), and stay there."""

    rise_c: float = 10.0
    power_frac: float = 0.1
    tau_s: float = 90.0

    def apply(self, sample: GpuSample, elapsed_s: float) -> GpuSample:
        reached = 1.0 - math.exp(-elapsed_s / self.tau_s)
        if sample.temperature is not None:
            sample.temperature += self.rise_c * reached
        if None not in (sample.power_draw, sample.power_limit):
            sample.power_draw = min(sample.power_limit,
                                    sample.power_draw + self.power_frac * sample.power_limit * reached)
        return sample


@dataclass(frozen=True, kw_only=True)
class AmbientSwing(Anomaly):
    """Benign: the room's temperature swings by +-``amplitude_c`` over ``period_s``."""

    amplitude_c: float = 4.0
    period_s: float = 3600.0

    def apply(self, sample: GpuSample, elapsed_s: float) -> GpuSample:
        if sample.temperature is not None:
            sample.temperature += self.amplitude_c * math.sin(2 * math.pi * elapsed_s / self.period_s)
        return sample


def _throttle(sample: GpuSample, mask: int, clock_factor: float) -> None:
    if sample.throttle_reasons is not None:
        sample.throttle_reasons |= mask
    if sample.sm_clock is not None:
        sample.sm_clock *= clock_factor


# What ``degrade`` ends in; each is a hard signal the adaptive scorer alerts on at once.
_DEGRADE_ENDINGS = (
    (DoubleBitError(), Xid(code=48)),
    (Xid(code=94),),
    (Xid(code=95),),
    (Xid(code=63), PagesPending()),
    (Xid(code=92),),
    (RecoveryAction(action=1),),
    (RecoveryAction(action=4),),
)


def degrade_plan(seed: int, gpu: int) -> list[Anomaly]:
    """What ``degrade`` does to one GPU, fixed by (seed, gpu): soft precursors (heat,
    throttling, an SBE burst) at once, then a hard signal 2 to 4 samples later, so any scorer
    worth its name alerts within a few samples at any sampling interval."""
    rng = random.Random(f"degrade:{seed}:{gpu}")
    delay = rng.randint(2, 4)
    ending = [replace(a, delay_samples=delay) for a in rng.choice(_DEGRADE_ENDINGS)]
    return [ThermalRunaway(rate_c_per_min=20.0), EccBurst(doubling_s=5.0),
            Throttling(mask=HW_SLOWDOWN, clock_factor=0.7)] + ending


@dataclass
class _Active:
    anomaly: Anomaly
    start: float | None = None  # the first sample time it met
    seen: int = 0  # samples it has met


@dataclass
class AnomalyOverlay:
    """Per-GPU active anomalies laid over a backend's samples.

    Onset is the first sample the anomaly meets after injection, so elapsed time is in the
    samples' own clock (wall time live, recorded time in replay).
    """

    seed: int = 0
    _active: dict[int, list[_Active]] = field(default_factory=dict)

    def inject(self, gpu: int, *anomalies: Anomaly) -> None:
        self._active.setdefault(gpu, []).extend(_Active(a) for a in anomalies)

    def recover(self, gpu: int) -> None:
        """Clear every anomaly on ``gpu``: a lost GPU comes back, a degraded one heals."""
        self._active.pop(gpu, None)

    def end_rank_faults(self) -> None:
        """The ranks are gone (a new attempt): a stopped rank's GPU works again."""
        for gpu, actives in list(self._active.items()):
            self._active[gpu] = [a for a in actives if not isinstance(a.anomaly, StoppedRank)]
            if not self._active[gpu]:
                del self._active[gpu]

    def apply_fault(self, injection: Injection) -> None:
        """``degrade``: :func:`degrade_plan`; ``fail``: device lost; ``hang``: the stopped
        rank leaves its GPU idle; ``xid``: the XID in the next sample; ``recover``: clear the
        GPU. ``wedge`` is the backend's (its reads block), ``nan`` and ``slow`` training's: no
        change."""
        gpu, kind = injection.gpu, injection.kind
        if kind is Fault.DEGRADE:
            self.inject(gpu, *degrade_plan(self.seed, gpu))
        elif kind is Fault.FAIL:
            self.inject(gpu, DeviceLost())
        elif kind is Fault.HANG:
            self.inject(gpu, StoppedRank())
        elif kind is Fault.XID:
            self.inject(gpu, Xid(code=injection.code))
        elif kind is Fault.RECOVER:
            self.recover(gpu)

    def apply(self, samples: list[GpuSample]) -> list[GpuSample]:
        if not self._active:
            return samples
        out = []
        for sample in samples:
            changed = self._apply_one(sample) if sample.gpu_id in self._active else sample
            if changed is not None:
                out.append(changed)
        return out

    def _apply_one(self, sample: GpuSample) -> GpuSample | None:
        result: GpuSample | None = copy.copy(sample)
        for active in self._active[sample.gpu_id]:
            if active.start is None:
                active.start = sample.timestamp
            active.seen += 1
            if result is None or active.seen <= active.anomaly.delay_samples:
                continue
            if isinstance(active.anomaly, Xid) and active.seen > active.anomaly.delay_samples + 1:
                continue  # an XID is an event: reported once
            result = active.anomaly.apply(result, sample.timestamp - active.start)
        return result
