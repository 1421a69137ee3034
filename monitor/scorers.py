"""Risk scorers: ``paper`` (the published six-factor sum) and ``adaptive`` (the default).

A scorer sees one sample per present GPU at a time (``update``) and returns an
:class:`Assessment` per GPU: a score in [0, 1], the reasons behind it, and the hard reasons
among them. Whether a score becomes an alert is :mod:`ftmaster.monitor.alerts`' business.

A sample whose temperature, power and utilisation are all unknown scores
``UNKNOWN_SCORE`` (0.5) with reason ``telemetry_unknown``: visibly not healthy, yet no
checkpoint request on missing data alone.

**paper** reproduces section III.C: ``score = sum(w_i * r_i)`` with weights temperature .25,
memory .15, errors .25, power .10, utilization_drop .15, temp_rise .10 over a rolling window
of the last 60 samples per GPU. The paper does not give its normalisations; ours are:

- temperature: ``(T - 50) / (90 - 50)``, clipped to [0, 1];
- memory: ``memory_used / memory_total``;
- errors: 1 when the cumulative uncorrectable-error count rose within the window, but only
  with ``errors_term=True``. The published collector never filled that column, so the term
  is 0 by default, which caps the score at 1 - 0.25 = 0.75: below the paper's 0.95
  threshold, so as published it never alerts;
- power: coefficient of variation of power over the window, ``/ 0.25``, clipped;
- utilization_drop: ``(window mean - now) / window mean``, clipped;
- temp_rise: temperature rise over the last 6 samples in C/min, ``/ 5``, clipped.

**adaptive** treats hard signals (:func:`ftmaster.monitor.signals.hard_reasons`) as critical
at once (score 1.0) and scores soft signals against each GPU's own history and its peers':

- temperature: the GPU's temperature minus the median of the other GPUs (so warm-up,
  checkpoints and evals, which move every GPU, cancel out), compared with that residual's own
  slow baseline (so a hot but steady GPU is fine). A rising residual (C/min over a few
  minutes) that is also well above its baseline scores; a very large excess alone scores up
  to ``level_cap``, below the threshold;
- throttling: the share of recent samples with hardware/thermal throttle bits, minus the
  peers' share;
- power instability: the spread (IQR) of power while utilisation is steady, beyond the
  peers' spread and the GPU's own usual spread, as a fraction of the power limit;
- utilisation collapse: the share of recent samples in which this GPU sat far below its
  peers' median utilisation (needs at least one peer);
- single-bit ECC acceleration: corrected errors in the last 10 minutes beyond twice the rate
  of the 30 minutes before.

Soft signals are off while a GPU warms up (its first ``warmup_s``), combine as
``1 - prod(1 - s_i)``, and the score falls at most ``score_decay_per_min`` per minute, which
with the alert policy's re-arm margin gives the hysteresis. Every detector is a pure function
of features and config.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields, replace
from typing import Iterable, Protocol

from ftmaster.monitor.drifts import (DriftConfig, PeerCount, Persistence, drift_severity,
                                     time_left)
from ftmaster.monitor.sample import GpuSample
from ftmaster.monitor.signals import BAD_THROTTLE_MASK, hard_reasons, remember_counters

UNKNOWN_SCORE = 0.5
UNKNOWN_REASON = "telemetry_unknown"
SCORER_NAMES = ("adaptive", "paper")
REASON_FLOOR = 0.25  # soft signals weaker than this are not named as reasons
UNKNOWN_POWER_LIMIT_W = 700.0  # a GPU whose limit was never read: an H100 SXM's


@dataclass(frozen=True)
class Assessment:
    score: float
    reasons: tuple[str, ...] = ()
    hard_reasons: tuple[str, ...] = ()

    @property
    def unknown(self) -> bool:
        """Whether nothing was read (``UNKNOWN_SCORE``): a score of no GPU state at all."""
        return self.reasons == (UNKNOWN_REASON,)


class Scorer(Protocol):
    name: str

    def update(self, samples: list[GpuSample]) -> dict[int, Assessment]: ...

    def forget(self, gpu: int) -> None: ...


def ramp(x: float, lo: float, hi: float) -> float:
    """0 at or below ``lo``, 1 at or above ``hi``, linear between."""
    if x <= lo:
        return 0.0
    return 1.0 if x >= hi else (x - lo) / (hi - lo)


def _no_telemetry(sample: GpuSample) -> bool:
    return sample.temperature is None and sample.power_draw is None and sample.gpu_utilization is None


HELD_SIGNALS = ("temperature", "power_draw", "gpu_utilization", "ecc_sbe")
"""The signals whose failed read takes a severity to 0 (the corrected errors' acceleration
is only judged on a sample that read their count): the score holds while one is unread."""


def _read_signals(sample: GpuSample) -> frozenset[str]:
    """Which of :data:`HELD_SIGNALS` this sample read."""
    return frozenset(name for name in HELD_SIGNALS if getattr(sample, name) is not None)


# ---------------------------------------------------------------------------------------- #
# paper
# ---------------------------------------------------------------------------------------- #
PAPER_WEIGHTS = {"temperature": 0.25, "memory": 0.15, "errors": 0.25, "power": 0.10,
                 "utilization_drop": 0.15, "temp_rise": 0.10}


@dataclass(frozen=True)
class PaperConfig:
    window_samples: int = 60
    """Rolling window per GPU, in samples (the paper keeps the last 60)."""
    temp_cool_c: float = 50.0
    """Temperature at which the temperature factor is 0."""
    temp_hot_c: float = 90.0
    """Temperature at which the temperature factor is 1."""
    power_cv_full: float = 0.25
    """Coefficient of variation of power at which the power factor is 1."""
    rise_samples: int = 6
    """How many samples back the temperature rise rate is measured."""
    temp_rise_full_c_per_min: float = 5.0
    """Temperature rise rate at which the temp_rise factor is 1."""
    errors_term: bool = False
    """Fill the errors factor from the uncorrectable-error count (the paper left it at 0)."""

    def __post_init__(self) -> None:
        if self.window_samples < 2 or self.rise_samples < 1:
            raise ValueError("paper scorer: window_samples must be >= 2 and rise_samples >= 1")
        if self.temp_hot_c <= self.temp_cool_c:
            raise ValueError("paper scorer: temp_hot_c must be above temp_cool_c")
        if self.power_cv_full <= 0 or self.temp_rise_full_c_per_min <= 0:
            raise ValueError("paper scorer: power_cv_full and temp_rise_full_c_per_min must be > 0")


def paper_factors(history: list[GpuSample], cfg: PaperConfig) -> dict[str, float]:
    """The six normalised factors for the newest sample in ``history`` (unknown -> 0)."""
    now = history[-1]
    factors = dict.fromkeys(PAPER_WEIGHTS, 0.0)
    if now.temperature is not None:
        factors["temperature"] = ramp(now.temperature, cfg.temp_cool_c, cfg.temp_hot_c)
    if now.memory_used is not None and now.memory_total:
        factors["memory"] = min(1.0, max(0.0, now.memory_used / now.memory_total))
    if cfg.errors_term:
        counts = [s.errors for s in history if s.errors is not None]
        factors["errors"] = 1.0 if len(counts) > 1 and counts[-1] > counts[0] else 0.0
    powers = [s.power_draw for s in history if s.power_draw is not None]
    if len(powers) > 1:
        mean = sum(powers) / len(powers)
        if mean > 0:
            # hypot scales as it sums: squaring an absurd reading (a corrupt cell) overflowed
            std = math.hypot(*(p - mean for p in powers)) / math.sqrt(len(powers))
            factors["power"] = ramp(std / mean, 0.0, cfg.power_cv_full)
    utils = [s.gpu_utilization for s in history if s.gpu_utilization is not None]
    if utils and now.gpu_utilization is not None:
        mean = sum(utils) / len(utils)
        if mean > 0:
            factors["utilization_drop"] = ramp((mean - now.gpu_utilization) / mean, 0.0, 1.0)
    back = history[-1 - cfg.rise_samples] if len(history) > cfg.rise_samples else history[0]
    minutes = (now.timestamp - back.timestamp) / 60.0
    if minutes > 0 and now.temperature is not None and back.temperature is not None:
        rate = (now.temperature - back.temperature) / minutes
        factors["temp_rise"] = ramp(rate, 0.0, cfg.temp_rise_full_c_per_min)
    return factors


class PaperScorer:
    name = "paper"

    def __init__(self, config: PaperConfig | None = None) -> None:
        self.config = config or PaperConfig()
        self._history: dict[int, deque[GpuSample]] = {}

    def forget(self, gpu: int) -> None:
        self._history.pop(gpu, None)

    def update(self, samples: list[GpuSample]) -> dict[int, Assessment]:
        out = {}
        for sample in samples:
            if _no_telemetry(sample):
                out[sample.gpu_id] = Assessment(UNKNOWN_SCORE, (UNKNOWN_REASON,))
                continue
            history = self._history.setdefault(sample.gpu_id, deque(maxlen=self.config.window_samples))
            history.append(sample)
            factors = paper_factors(list(history), self.config)
            score = sum(PAPER_WEIGHTS[k] * v for k, v in factors.items())
            reasons = tuple(sorted((k for k, v in factors.items() if v >= 0.5),
                                   key=lambda k: -factors[k]))
            out[sample.gpu_id] = Assessment(round(score, 4), reasons)
        return out


# ---------------------------------------------------------------------------------------- #
# adaptive
# ---------------------------------------------------------------------------------------- #
@dataclass(frozen=True)
class AdaptiveConfig:
    warmup_s: float = 300.0
    """Seconds under load (or 3x that in all) before a GPU's soft signals count; meanwhile
    its baselines simply follow it."""
    baseline_tau_s: float = 1200.0
    """Time constant of the per-GPU temperature baselines; they are frozen while suspicious."""
    loaded_util: float = 70.0
    """Utilisation (%) from which a GPU counts as loaded."""
    settle_s: float = 300.0
    """Seconds of unbroken load before temperatures count towards the loaded baseline (a GPU
    still warming back up after a checkpoint dip would drag it down)."""
    trend_window_s: float = 240.0
    """Window over which the temperature trend (slope of the residual) is fitted."""
    level_window_s: float = 60.0
    """Window whose mean residual temperature is compared with the baseline."""
    slope_c_per_min: tuple[float, float] = (0.6, 1.8)
    """Residual temperature slope (C/min) at which the trend starts to count / counts fully."""
    trend_excess_c: tuple[float, float] = (2.0, 6.0)
    """Excess over baseline (C) that a rising trend needs: starts / full."""
    level_excess_c: tuple[float, float] = (8.0, 20.0)
    """Excess over baseline (C) that scores on its own, up to level_cap."""
    level_cap: float = 0.85
    """Most that a high but not rising temperature can score alone (below the threshold)."""
    throttle_window_s: float = 180.0
    """Window for the share of samples with hardware/thermal throttle bits."""
    throttle_excess: tuple[float, float] = (0.25, 0.7)
    """That share minus the peers' share: starts / full."""
    power_window_s: float = 120.0
    """Window for power spread and utilisation steadiness."""
    power_spread: tuple[float, float] = (0.03, 0.08)
    """Power IQR beyond the larger of the peers' and the GPU's own usual IQR, as a fraction
    of the power limit: starts / full."""
    spread_points: int = 16
    """Fewest samples a spread (IQR) is taken over; the window grows at long intervals."""
    steady_util_range: float = 15.0
    """Utilisation range (points) above which power changes are load changes, not instability."""
    collapse_gap: float = 50.0
    """Points below the peers' median utilisation that count as collapsed."""
    collapse_window_s: float = 120.0
    """Window for the share of collapsed samples."""
    collapse_share: tuple[float, float] = (0.6, 0.95)
    """Share of collapsed samples: starts / full."""
    sbe_window_s: float = 600.0
    """Recent window for corrected-error counts; the reference is the 3 windows before."""
    sbe_excess: tuple[float, float] = (3.0, 12.0)
    """Recent corrected errors beyond twice the reference rate (+1): starts / full."""
    min_coverage: float = 0.6
    """Share of a window that samples must span before its feature is trusted."""
    score_decay_per_min: float = 0.25
    """Fastest fall of the score per minute (rises are immediate)."""
    drift: DriftConfig = DriftConfig()
    """Slow drifts of temperature, power and clock toward their limits (``drifts``)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, DriftConfig):
                continue  # checked in its own __post_init__
            if isinstance(value, tuple):
                if not (len(value) == 2 and 0 <= value[0] < value[1]):
                    raise ValueError(f"adaptive scorer: {f.name} must be (lo, hi) with 0 <= lo < hi, "
                                     f"got {value}")
            elif not value > 0:
                raise ValueError(f"adaptive scorer: {f.name} must be > 0, got {value}")
        if self.level_cap >= 1 or self.min_coverage > 1:
            raise ValueError("adaptive scorer: level_cap must be < 1 and min_coverage <= 1")


class Window:
    """(time, value) points within the last ``span_s`` seconds, but never fewer than
    ``keep`` points: at long sampling intervals a statistic needs the extra span."""

    __slots__ = ("span_s", "keep", "times", "values")

    def __init__(self, span_s: float, keep: int = 0) -> None:
        self.span_s = span_s
        self.keep = keep
        self.times: deque[float] = deque()
        self.values: deque[float] = deque()

    def push(self, t: float, value: float) -> None:
        if self.keep and len(self.times) >= 2 and \
                t - self.times[-1] > max(self.span_s, 3 * (self.times[-1] - self.times[-2])):
            # Reads back after an outage: the points kept from before it (``keep`` holds
            # them however old) would make one spread of two levels, an instability.
            self.times.clear()
            self.values.clear()
        self.times.append(t)
        self.values.append(value)
        while len(self.times) > self.keep and self.times[0] < t - self.span_s:
            self.times.popleft()
            self.values.popleft()

    def trusted(self, min_coverage: float, min_points: int = 4) -> bool:
        return (len(self.times) >= min_points
                and self.times[-1] - self.times[0] >= min_coverage * self.span_s)

    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    def mean_since(self, t: float) -> float | None:
        """The mean of the points from ``t`` on; None without one (the reads since failed)."""
        total, count = 0.0, 0
        for when, value in zip(reversed(self.times), reversed(self.values)):
            if when < t:
                break
            total += value
            count += 1
        return total / count if count else None

    def slope_per_min(self) -> float:
        n = len(self.times)
        t0 = self.times[0]
        mean_t = sum(t - t0 for t in self.times) / n
        mean_v = self.mean()
        sxx = sxy = 0.0
        for t, v in zip(self.times, self.values):
            dt = t - t0 - mean_t
            sxx += dt * dt
            sxy += dt * (v - mean_v)
        return 60.0 * sxy / sxx if sxx > 0 else 0.0

    def iqr(self) -> float:
        ordered = sorted(self.values)
        n = len(ordered)
        return ordered[(3 * n) // 4] - ordered[n // 4]


class LoadedWindow:
    """(time, value) points within the last ``span_s`` seconds of loaded time: the minutes a
    checkpoint or an evaluation keeps a GPU idle do not push a drift's earlier points out,
    and the trend is still fitted against the clock (a drift goes on while the GPU idles).
    ``before_times``, ``before``: the points of the ``past_s`` of loaded time before those.
    ``peers``: the peers' median at each of ``times`` (0 with none)."""

    __slots__ = ("span_s", "past_s", "times", "values", "peers", "_loaded", "before_times",
                 "before", "_before_loaded")

    def __init__(self, span_s: float, past_s: float = 0.0) -> None:
        self.span_s, self.past_s = span_s, past_s
        self.times: deque[float] = deque()
        self.values: deque[float] = deque()
        self.peers: deque[float] = deque()
        self._loaded: deque[float] = deque()
        self.before_times: deque[float] = deque()
        self.before: deque[float] = deque()
        self._before_loaded: deque[float] = deque()

    def push(self, t: float, value: float, loaded_s: float, peer: float = 0.0) -> None:
        """A point at ``t``, when the GPU had been loaded for ``loaded_s`` in all; ``peer``:
        its peers' median then."""
        self.times.append(t)
        self.values.append(value)
        self.peers.append(peer)
        self._loaded.append(loaded_s)
        while self._loaded[0] < loaded_s - self.span_s:
            if self.past_s > 0:
                self.before_times.append(self.times[0])
                self.before.append(self.values[0])
                self._before_loaded.append(self._loaded[0])
            self.times.popleft()
            self.values.popleft()
            self.peers.popleft()
            self._loaded.popleft()
        while self._before_loaded and self._before_loaded[0] < loaded_s - self.span_s - self.past_s:
            self.before_times.popleft()
            self.before.popleft()
            self._before_loaded.popleft()


@dataclass
class Features:
    """What the detectors read about one GPU (None: not enough data)."""

    slope: float | None = None  # residual temperature, C/min
    excess: float | None = None  # temperature above both its baselines (peer-relative, loaded), C
    throttle_share: float | None = None
    power_spread: float | None = None  # IQR / power limit
    util_range: float | None = None
    collapse_share: float | None = None
    sbe_excess: float | None = None
    drift_left_s: float | None = None  # seconds to a limit at a steady trend, the nearest


def drift_left(track: "_Track", s: GpuSample, peer_clock: float | None,
               cfg: DriftConfig, warm: bool) -> float | None:
    """The nearest limit at the GPU's own loaded trends: slowdown temperature, power cap,
    clock floor (a share of its peers' clock, or of its own usual one with no peer).
    Temperature only once the GPU is ``warm`` again after a dip: before, its window holds the
    trend from before the dip while the GPU still climbs back to its level."""
    usual_clock = peer_clock if peer_clock is not None else track.clock_baseline
    # Against its peers the clock floor is a share of their clock, and moves with it.
    clock_follows = cfg.clock_floor if peer_clock is not None else 0.0
    clock_floor = None if usual_clock is None else cfg.clock_floor * usual_clock
    # (window, now, limit, rising, the share of the peers the limit follows, spread's block,
    # least slope)
    limits = ((track.drift_temp, s.temperature if warm else None, cfg.temperature_limit_c,
               True, 0.0, 0.0, cfg.min_slope),
              (track.drift_power, s.power_draw, s.power_limit, True, 0.0, cfg.power_spread_block_s,
               cfg.power_min_slope),
              (track.drift_clock, s.sm_clock, clock_floor, False, clock_follows, 0.0, cfg.min_slope))
    left = [time_left(window.times, window.values, limit - now, limit, cfg, rising,
                      (window.before_times, window.before), window.peers, follows, block, floor)
            for window, now, limit, rising, follows, block, floor in limits
            if limit is not None and now is not None and window.times]
    known = [seconds for seconds in left if seconds is not None]
    return min(known) if known else None


def _loaded_for(track: "_Track", t: float) -> float:
    """How long the GPU has been loaded without a break (-inf while it is not)."""
    return -math.inf if track.loaded_since is None else t - track.loaded_since


def _thermally_settled(track: "_Track", s: GpuSample, cfg: AdaptiveConfig) -> bool:
    """Whether the GPU's temperature is back after its last break in load: at the level it
    held when last settled under load, or after ``settle_s``. A stall of a few samples
    barely cooled it, a checkpoint of minutes did."""
    loaded_for = _loaded_for(track, s.timestamp)
    back = (track.warm_level is not None and s.temperature is not None
            and s.temperature >= track.warm_level - cfg.drift.rebound_tolerance_c)
    return loaded_for >= cfg.settle_s or (back and loaded_for >= cfg.drift.load_settle_s)


def temperature_severity(f: Features, cfg: AdaptiveConfig) -> float:
    if f.excess is None:
        return 0.0
    level = cfg.level_cap * ramp(f.excess, *cfg.level_excess_c)
    if f.slope is None:
        return level
    return max(level, ramp(f.slope, *cfg.slope_c_per_min) * ramp(f.excess, *cfg.trend_excess_c))


def throttle_severity(f: Features, peer_share: float, cfg: AdaptiveConfig) -> float:
    return 0.0 if f.throttle_share is None else ramp(f.throttle_share - peer_share, *cfg.throttle_excess)


def power_severity(f: Features, peer_spread: float, cfg: AdaptiveConfig) -> float:
    if f.power_spread is None or f.util_range is None or f.util_range > cfg.steady_util_range:
        return 0.0
    return ramp(f.power_spread - peer_spread, *cfg.power_spread)


def collapse_severity(f: Features, cfg: AdaptiveConfig) -> float:
    return 0.0 if f.collapse_share is None else ramp(f.collapse_share, *cfg.collapse_share)


def sbe_severity(f: Features, cfg: AdaptiveConfig) -> float:
    return 0.0 if f.sbe_excess is None else ramp(f.sbe_excess, *cfg.sbe_excess)


def others_median(values: dict[int, float]) -> dict[int, float | None]:
    """For each GPU, the median of the other GPUs' values (None when it has no peer)."""
    out: dict[int, float | None] = {}
    for gpu in values:
        rest = sorted(v for g, v in values.items() if g != gpu)
        n = len(rest)
        out[gpu] = None if n == 0 else (rest[n // 2] if n % 2 else 0.5 * (rest[n // 2 - 1] + rest[n // 2]))
    return out


@dataclass(frozen=True)
class Peers:
    """Per GPU, the median temperature, power and clock of the other GPUs under load (None:
    no such peer). A peer that idles or collapses is no reference for a loaded GPU: with it
    in the median, its fall reads here as a rise toward the limits."""

    temperature: dict[int, float | None]
    power: dict[int, float | None]
    clock: dict[int, float | None]
    count: int
    """How many GPUs were sampled (each GPU's peers are the others)."""
    loaded: int
    """How many of them were under load."""

    @classmethod
    def of(cls, samples: list[GpuSample], loaded_util: float) -> "Peers":
        loaded = [s for s in samples
                  if s.gpu_utilization is not None and s.gpu_utilization >= loaded_util]
        medians = (others_median({s.gpu_id: getattr(s, name) for s in loaded
                                  if getattr(s, name) is not None})
                   for name in ("temperature", "power_draw", "sm_clock"))
        return cls(*medians, count=len(samples), loaded=len(loaded))


class _Track:
    """One GPU's rolling state."""

    def __init__(self, cfg: AdaptiveConfig, t: float) -> None:
        self.first = self.last = t
        self.shift = 0.0  # added to its sample times since its clock last stepped back
        self.loaded_s = 0.0  # time spent at or above loaded_util
        self.loaded_since: float | None = None  # start of the current unbroken loaded stretch
        self.warm_level: float | None = None  # its temperature as its last settled load broke
        # Cumulative counters at their last known values: a failed read must not hide a rise.
        self.error_counters: dict[str, int] = {}
        self.last_sbe: int | None = None
        self.last_sbe_at = t  # when it was read
        self.power_limit: float | None = None  # its last known: a failed read moves no cap
        self.read_once: frozenset[str] = frozenset()  # main signals it has ever shown
        self.residual = Window(cfg.trend_window_s)
        self.raw = Window(cfg.level_window_s)
        self.power = Window(cfg.power_window_s, keep=cfg.spread_points)
        self.util = Window(cfg.power_window_s, keep=cfg.spread_points)
        self.throttle = Window(cfg.throttle_window_s)
        self.collapse = Window(cfg.collapse_window_s)
        self.sbe_events: deque[tuple[float, int]] = deque()
        past = cfg.drift.excursion_lookback_s
        self.drift_temp = LoadedWindow(cfg.drift.window_s, past)  # under settled load only
        self.drift_power = LoadedWindow(cfg.drift.window_s, past)
        self.drift_clock = LoadedWindow(cfg.drift.window_s, past)
        self.clock_baseline: float | None = None  # own loaded clock, frozen while drifting
        self.drift_held = Persistence()
        self.drift_peers = PeerCount()  # how many peers the drift windows are relative to
        self.drift_checked: float | None = None  # when the trends were last fitted
        self.drift_left_s: float | None = None  # what that fit found
        self.baseline: float | None = None  # peer-relative temperature level
        self.loaded_baseline: float | None = None  # own temperature level under load
        self.spread_baseline: float | None = None  # own power IQR while utilisation is steady
        self.with_peers: bool | None = None  # whether the residual is relative to peers
        self.score = 0.0


class AdaptiveScorer:
    name = "adaptive"

    def __init__(self, config: AdaptiveConfig | None = None) -> None:
        self.config = config or AdaptiveConfig()
        self._tracks: dict[int, _Track] = {}

    def forget(self, gpu: int) -> None:
        self._tracks.pop(gpu, None)

    def update(self, samples: list[GpuSample]) -> dict[int, Assessment]:
        cfg = self.config
        temps = {s.gpu_id: s.temperature for s in samples if s.temperature is not None}
        utils = {s.gpu_id: s.gpu_utilization for s in samples if s.gpu_utilization is not None}
        peer_temp, peer_util = others_median(temps), others_median(utils)
        peers = Peers.of(samples, cfg.loaded_util)
        features, hard, dts = {}, {}, {}
        samples = [self._on_steady_clock(s) for s in samples]
        for s in samples:
            track = self._tracks.get(s.gpu_id)
            if track is None:
                track = self._tracks[s.gpu_id] = _Track(cfg, s.timestamp)
            hard[s.gpu_id] = hard_reasons(track.error_counters, s)
            remember_counters(track.error_counters, s)
            dts[s.gpu_id] = max(0.0, s.timestamp - track.last)
            self._observe(track, s, peer_temp.get(s.gpu_id), peer_util.get(s.gpu_id),
                          peers_sampled=len(samples) > 1)
            self._observe_drifts(track, s, peers)
            features[s.gpu_id] = self._features(
                track, s, peers.clock.get(s.gpu_id) if self._drift_relative(peers) else None)
        peer_throttle = others_median({g: f.throttle_share for g, f in features.items()
                                       if f.throttle_share is not None})
        peer_spread = others_median({g: f.power_spread for g, f in features.items()
                                     if f.power_spread is not None})
        out = {}
        for s in samples:
            gpu, track = s.gpu_id, self._tracks[s.gpu_id]
            severities = {}
            if self._warm(track, s.timestamp):
                f = features[gpu]
                severities = {
                    "temperature_trend": temperature_severity(f, cfg),
                    "throttling": throttle_severity(f, peer_throttle.get(gpu) or 0.0, cfg),
                    "power_instability": power_severity(
                        f, max(peer_spread.get(gpu) or 0.0, track.spread_baseline or 0.0), cfg),
                    "utilization_collapse": collapse_severity(f, cfg),
                    "sbe_acceleration": sbe_severity(f, cfg),
                    "slow_drift": drift_severity(f.drift_left_s, cfg.drift),
                }
            self._update_baselines(track, s, dts[gpu], severities.get("temperature_trend", 0.0))
            self._update_clock_baseline(track, s, dts[gpu], severities.get("slow_drift", 0.0))
            self._update_spread_baseline(track, features[gpu], dts[gpu],
                                         severities.get("power_instability", 0.0))
            out[gpu] = self._assess(track, s, severities, hard[gpu], dts[gpu])
        return out

    def _on_steady_clock(self, s: GpuSample) -> GpuSample:
        """``s`` at a time that never goes back for its GPU. A wall clock stepped back (NTP)
        made the loaded time negative and left every window holding "later" points: no soft
        signal counted until the clock caught up. Its later times are shifted on by the step."""
        track = self._tracks.get(s.gpu_id)
        if track is None:
            return s
        track.shift = max(track.shift, track.last - s.timestamp)
        return replace(s, timestamp=s.timestamp + track.shift) if track.shift else s

    def _warm(self, track: _Track, t: float) -> bool:
        return track.loaded_s >= self.config.warmup_s or t - track.first >= 3 * self.config.warmup_s

    def _observe(self, track: _Track, s: GpuSample, peer_temp: float | None,
                 peer_util: float | None, peers_sampled: bool = False) -> None:
        t = s.timestamp
        breaking = (s.gpu_utilization is not None and s.gpu_utilization < self.config.loaded_util
                    and _loaded_for(track, t) >= self.config.settle_s and track.raw.times)
        if breaking:  # the level it held, before this sample of the break joins the window
            track.warm_level = track.raw.mean()
        # Peers sampled whose temperatures are unread: its part against them is unknown for a
        # while. Taken as "no peers", a single failed read restarted its scale and relearnt its
        # baseline at its present level, hot or not, twice. An outage longer than the level's
        # window goes over to its own scale, as without peers, or the trend would go unread.
        peers_unread = (peers_sampled and peer_temp is None and bool(track.residual.times)
                        and t - track.residual.times[-1] < self.config.level_window_s)
        if s.temperature is not None:
            if not peers_unread:
                self._observe_residual(track, t, s.temperature, peer_temp)
            track.raw.push(t, s.temperature)
        track.power_limit = s.power_limit or track.power_limit
        if s.power_draw is not None:
            # A limit unknown at this sample is its last known one: the draw over another
            # figure (a default) read as a swing of the power, an alert after 5 such reads.
            track.power.push(t, s.power_draw / (track.power_limit or UNKNOWN_POWER_LIMIT_W))
        if s.gpu_utilization is not None and s.gpu_utilization >= self.config.loaded_util:
            track.loaded_s += t - track.last
            track.loaded_since = t if track.loaded_since is None else track.loaded_since
        elif s.gpu_utilization is not None:
            track.loaded_since = None
        if s.gpu_utilization is not None:
            track.util.push(t, s.gpu_utilization)
            # Only while the peers work: during a fleet-wide dip nobody can be told apart.
            if peer_util is not None and peer_util >= self.config.loaded_util:
                track.collapse.push(t, float(peer_util - s.gpu_utilization >= self.config.collapse_gap))
        if s.throttle_reasons is not None:
            track.throttle.push(t, float(bool(s.throttle_reasons & BAD_THROTTLE_MASK)))
        if s.ecc_sbe is not None:
            if track.last_sbe is not None and s.ecc_sbe > track.last_sbe:
                track.sbe_events.extend(_spread_over(track.last_sbe_at, t, s.ecc_sbe - track.last_sbe,
                                                     self.config.sbe_window_s))
            track.last_sbe, track.last_sbe_at = s.ecc_sbe, t
        while track.sbe_events and track.sbe_events[0][0] < t - 4 * self.config.sbe_window_s:
            track.sbe_events.popleft()

    def _observe_residual(self, track: _Track, t: float, temperature: float,
                          peer_temp: float | None) -> None:
        """Its temperature less its peers' median, or as it is without peers."""
        with_peers = peer_temp is not None
        if track.with_peers is not None and with_peers != track.with_peers:
            # Relative to peers vs absolute are different scales: start the residual afresh.
            track.residual = Window(self.config.trend_window_s)
            track.baseline = None
        track.with_peers = with_peers
        track.residual.push(t, temperature - (peer_temp or 0.0))

    def _observe_drifts(self, track: _Track, s: GpuSample, peers: "Peers") -> None:
        """Under settled load only (the rebound after a checkpoint's dip, each GPU at its own
        pace, is no trend; temperature rebounds for minutes, power and clock within a sample):
        each signal less its peers' median (itself with fewer than ``min_peers``). When
        the peers change (a GPU lost or back), their median jumps: the trends start afresh."""
        cfg = self.config
        if track.drift_peers.changed(s.timestamp, peers.count, cfg.drift.peers_changed_s):
            past = cfg.drift.excursion_lookback_s
            track.drift_temp, track.drift_power, track.drift_clock = (
                LoadedWindow(cfg.drift.window_s, past) for _ in range(3))
        loaded_for = _loaded_for(track, s.timestamp)
        relative = self._drift_relative(peers)
        if relative and peers.loaded - 1 < cfg.drift.min_peers:
            return  # too few peers at work to take the GPU's own part against
        for window, value, peer, settled in (
                (track.drift_temp, s.temperature, peers.temperature,
                 _thermally_settled(track, s, cfg)),
                (track.drift_power, s.power_draw, peers.power, loaded_for >= cfg.drift.load_settle_s),
                (track.drift_clock, s.sm_clock, peers.clock, loaded_for >= cfg.drift.load_settle_s)):
            theirs = peer.get(s.gpu_id) if relative else 0.0
            # No peers' median for it (its utilisation unread this sample, so it is in no
            # one's reference set): its part is unknown, and its raw value is no part of it.
            if value is not None and settled and theirs is not None:
                window.push(s.timestamp, value - theirs, track.loaded_s, theirs)

    def _drift_relative(self, peers: "Peers") -> bool:
        """Whether the drift trends are taken against the peers' median (enough peers)."""
        return peers.count - 1 >= self.config.drift.min_peers

    def _features(self, track: _Track, s: GpuSample, peer_clock: float | None = None) -> Features:
        cfg, t = self.config, s.timestamp
        f = Features()
        if track.residual.times:
            level = track.residual.mean_since(t - cfg.level_window_s)
            if level is not None and track.baseline is not None and track.loaded_baseline is not None:
                # Both must agree: hotter than its peers usually are, and hotter than it itself
                # runs under load. Checkpoint and eval dips only cool, so they never pass the
                # second; the first ignores warm rooms and every fleet-wide ramp.
                f.excess = min(level - track.baseline, track.raw.mean() - track.loaded_baseline)
            if track.residual.trusted(cfg.min_coverage):
                f.slope = track.residual.slope_per_min()
        if track.throttle.trusted(cfg.min_coverage, 3):
            f.throttle_share = track.throttle.mean()
        if track.power.trusted(cfg.min_coverage, cfg.spread_points) and \
                track.util.trusted(cfg.min_coverage, cfg.spread_points):
            f.power_spread = track.power.iqr()
            f.util_range = max(track.util.values) - min(track.util.values)
        if track.collapse.trusted(cfg.min_coverage, 3):
            f.collapse_share = track.collapse.mean()
        if s.ecc_sbe is not None:
            f.sbe_excess = _sbe_excess(track.sbe_events, t, track.first, cfg.sbe_window_s)
        if _loaded_for(track, t) < cfg.drift.load_settle_s:
            # A dip: no trend is read, but the fits that held before it still count (a drift
            # goes on through a checkpoint: starting afresh cost it a whole persist_s)
            track.drift_checked, track.drift_left_s = None, None
        elif track.drift_checked is None or t - track.drift_checked >= cfg.drift.every_s:
            track.drift_checked = t  # slow by nature: a fit every few seconds is enough
            track.drift_left_s = track.drift_held.confirmed(
                t, drift_left(track, s, peer_clock, cfg.drift,
                              warm=_thermally_settled(track, s, cfg)), cfg.drift)
        f.drift_left_s = track.drift_left_s
        return f

    def _update_baselines(self, track: _Track, s: GpuSample, dt: float, temp_severity: float) -> None:
        """Follow the temperature levels, quickly while warming up; frozen while suspicious so
        a slow runaway is not learnt as normal. The loaded baseline learns only under load."""
        if not track.residual.times or temp_severity >= 0.3:
            return
        cfg, t = self.config, s.timestamp
        weight = 1.0 - math.exp(-dt / (cfg.baseline_tau_s if self._warm(track, t) else cfg.level_window_s))
        level = track.residual.mean_since(t - cfg.level_window_s)
        if level is None:
            return  # no temperature read within the level window: nothing to learn
        track.baseline = level if track.baseline is None else track.baseline + (level - track.baseline) * weight
        if track.loaded_since is not None and t - track.loaded_since >= min(cfg.settle_s, track.loaded_s):
            raw = track.raw.mean()
            track.loaded_baseline = raw if track.loaded_baseline is None else \
                track.loaded_baseline + (raw - track.loaded_baseline) * weight

    def _update_clock_baseline(self, track: _Track, s: GpuSample, dt: float, severity: float) -> None:
        """The GPU's usual clock under load, learnt as the temperature baselines are."""
        if (s.sm_clock is None or s.gpu_utilization is None
                or s.gpu_utilization < self.config.loaded_util or severity >= 0.3):
            return
        if track.clock_baseline is None:
            track.clock_baseline = s.sm_clock
            return
        weight = 1.0 - math.exp(-dt / self.config.baseline_tau_s)
        track.clock_baseline += (s.sm_clock - track.clock_baseline) * weight

    def _update_spread_baseline(self, track: _Track, f: Features, dt: float, severity: float) -> None:
        """Learnt at a steady load only: an idle GPU's flat power (an evaluation, a stall) is
        steady too, and learnt there the baseline read the same load's usual spread, back
        after it, as instability (alerts at 1.0 after an hour's idling)."""
        cfg = self.config
        if f.power_spread is None or f.util_range is None or f.util_range > cfg.steady_util_range \
                or severity >= 0.3 or min(track.util.values) < cfg.loaded_util:
            return
        if track.spread_baseline is None:
            track.spread_baseline = f.power_spread
        else:
            track.spread_baseline += (f.power_spread - track.spread_baseline) * (1 - math.exp(-dt / cfg.baseline_tau_s))

    def _assess(self, track: _Track, s: GpuSample, severities: dict[str, float],
                hard: list[str], dt: float) -> Assessment:
        track.last = s.timestamp
        if hard:
            track.score = 1.0
            return Assessment(1.0, tuple(hard), tuple(hard))
        if _no_telemetry(s):
            return Assessment(UNKNOWN_SCORE, (UNKNOWN_REASON,))
        raw = 1.0 - math.prod(1.0 - v for v in severities.values())
        # A read that failed takes its signal's severity to 0: unknown, not healthy, so the
        # score holds until every signal this GPU has shown is read again (a GPU re-armed,
        # and its drain was called off, as its temperature reads began to fail after a
        # thermal alert). One it never shows (no power reading) holds nothing.
        shown = _read_signals(s)
        unread, track.read_once = track.read_once - shown, track.read_once | shown
        decay = 0.0 if unread else self.config.score_decay_per_min * dt / 60.0
        track.score = max(raw, track.score - decay)
        reasons = tuple(k for k, v in sorted(severities.items(), key=lambda kv: -kv[1])
                        if v >= REASON_FLOOR)
        return Assessment(round(track.score, 4), reasons)


def _spread_over(start: float, end: float, count: int, window_s: float) -> list[tuple[float, int]]:
    """A counter's rise since its last read at ``start``, as events: all at ``end`` when the
    reads were close, else spread evenly over the reads' gap, one per ``window_s`` (when they
    came is unknown): all at the end, a steady rate's errors of a 30-minute outage read as a
    burst, an alert."""
    buckets = max(1, math.ceil((end - start) / window_s))
    shares = ((start + (end - start) * (k + 1) / buckets,
               count * (k + 1) // buckets - count * k // buckets) for k in range(buckets))
    return [(when, share) for when, share in shares if share]


def _sbe_excess(events: Iterable[tuple[float, int]], t: float, first: float, window_s: float) -> float:
    """Recent corrected errors beyond twice the reference rate, minus one for noise."""
    recent = earlier = 0
    for when, count in events:
        if when >= t - window_s:
            recent += count
        else:
            earlier += count
    reference_span = min(3 * window_s, max(window_s, t - window_s - first))
    expected = earlier * window_s / reference_span
    return recent - 2.0 * expected - 1.0


def make_scorer(name: str) -> Scorer:
    if name == "adaptive":
        return AdaptiveScorer()
    if name == "paper":
        return PaperScorer()
    raise ValueError(f"unknown scorer {name!r}; choose one of {', '.join(SCORER_NAMES)}")
