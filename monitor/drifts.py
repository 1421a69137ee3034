"""Slow drifts toward a limit: the time left at the current slope.

A GPU whose temperature creeps toward its slowdown point, whose power creeps toward its cap
or whose clock sinks toward a floor over 20-30 minutes shows no single bad sample until the
end. What gives it away is the trend: at the slope it keeps, it reaches the limit in so many
minutes. The trend is the GPU's own: its signal less its peers' median (with no peer, the
signal itself), taken under load only, so that what every GPU does at once (a phase of
heavier work, a warm-up, the room's temperature) and a checkpoint's dip are no part of it.
:func:`time_left` fits it over the last ``window_s`` and only calls it a trend when it is
one:

- over the window it rises (toward the limit) by at least ``min_slope`` of the limit's scale
  per minute (power: ``power_min_slope``) and by ``min_t`` standard errors of the fitted
  slope (noise near a limit is no trend); or by ``min_t`` only, when its second half alone
  rises by ``min_slope`` (and ``late_min_t`` of that fit's errors) and the GPU's level has
  left its own usual level, the median of the ``excursion_lookback_s`` before the window (a
  drift that began within the window);
- its second half rises too, and not clearly slower than its first (below ``steady`` times
  its pace by more than ``settle_sigmas`` standard errors): a step that settles (a
  first-order approach to a new level) slows down, a drift does not (it keeps its pace or
  speeds up; one nearing a cap that clips its noise slows within the noise).

A trend must have held through most of the last ``persist_s`` before it counts
(:class:`Persistence`): the fits of a sliding window follow noise for a sample or two, a
drift for minutes. A checkpoint's dip, in which nothing is fitted, does not start it afresh:
the fits from before it count once load is back.

The time left is then the time the GPU takes to cover its distance to the limit at the
second half's slope, speeding up as it did from the first half to the second (a drift that
accelerates gets there sooner than its slope says). Once the GPU has left its usual level,
that slope is carried to the window's end at that acceleration (``slope_lead``: a fit's
slope is its middle's) and takes in ``peer_rise`` of its peers' own rise too: the distance
is its whole signal's, which a warming fleet lifts with the rest (a healthy GPU in a
warm-up, at its usual level against its peers, keeps its own part's slope). And
:func:`drift_severity` ramps from 0 at ``horizon_s[0]`` left to 1 at ``horizon_s[1]``: with
the defaults a drift alerts with about 10 minutes left by its estimate, a quarter or more of
a 20-30 minute drift's span. The estimate runs long for a drift that accelerates (its first
half is nearly flat, and the halves understate how fast it speeds up), hence the margin.
Pure functions of the points and a :class:`DriftConfig`.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class DriftConfig:
    """When a slow drift toward a limit is a risk."""

    window_s: float = 1200.0
    """Span of loaded samples the trend is fitted over (two halves of 10 minutes). Power
    swings by tens of watts from one sample to the next: over 10 minutes at 15 s sampling,
    a drift to the cap in 25 minutes stands 3-4 standard errors out, over 20 minutes 8-11
    (``benchmarks/slow_drifts.py`` on 120 drifts, with the severity full at 8 minutes: 116
    in time over 20 minutes, 114 over 15; 1 false-alarm episode against 3, and on the
    earlier failure types none against 2)."""
    min_coverage: float = 0.8
    """Share of the window the samples must span before a trend counts."""
    min_slope: float = 0.0025
    """Least rise per minute over the window, as a share of the limit (0.22 C/min at 87 C)."""
    power_min_slope: float = 0.002
    """``min_slope`` for power, as a share of its cap (0.8 W/min at 400 W). One power sample
    swings by tens of watts, so ``min_t`` is what tells a trend from noise there. Power drifts
    that accelerate stayed under ``min_slope`` until less than a quarter of their span was
    left (seeds 321, 400, 894 and 1025 of ``benchmarks/slow_drifts.py``, 22-25%); at this
    floor they alert with 27-28% left, and seeds 0-1039 keep their ten false-alarm episodes
    (0.001-0.0015 added two: seeds 205 and 322). Temperature keeps ``min_slope``: its floor
    at 0.001 added 24 false-alarm episodes on seeds 760-1039."""
    min_t: float = 4.5
    """Least slope over the window, in standard errors of its fit."""
    late_min_t: float = 4.5
    """A trend slower than ``min_slope`` over the window still counts when its second half
    alone rises by ``min_slope`` and by this many standard errors of that half's fit, and the
    GPU has left its usual level (``excursion_*``): a drift that began within the window (its
    first half flat or falling) is as real as one that fills it. 0: no such trend."""
    excursion_lookback_s: float = 2400.0
    """Loaded time before the window whose median is the GPU's usual level (of its part
    against its peers), for ``late_min_t``; it must be covered by ``min_coverage``."""
    excursion_sigmas: float = 2.5
    """The window's end level (its fit's) must stand above that usual level, toward the
    limit, by this many standard deviations of the look-back (its noise and wander)..."""
    power_spread_block_s: float = 60.0
    """For power, the look-back's spread is that of its means over consecutive stretches this
    long. The end level it is compared with is a fit's, far steadier than one sample, and one
    power sample swings by tens of watts (4% of the cap) about a level that wanders far less:
    the samples' own spread set the bar 2-3x too high (an accelerating power drift to the cap,
    seed 230 of ``benchmarks/slow_drifts.py``, alerted with 13% of its span left; by the
    means', with 28%). Temperature
    keeps its samples' spread: a degree of noise is about its level's wander, and the bar is
    what keeps a hot GPU's rise in a warm-up quiet. 0: the samples' own spread for power too."""
    excursion_share: float = 0.4
    """...and by this share of the distance to the limit it started from (the rise plus the
    distance left)."""
    peer_rise: float = 1.0
    """Share of the peers' own rise toward the limit (their median's slope over the second
    half, when it rises) added to the GPU's slope for its time left: the trend is the GPU's
    part against its peers, but the distance is its whole signal's, which rises with theirs
    too (a fleet warming). Only once the GPU has left its usual level (``excursion_*``): in
    a warm-up a healthy hot GPU's own part wanders up too. Only the estimate: whether there
    is a trend stays the GPU's own part's business. For the clock floor, itself a share of
    the peers' clock, only the rest of their fall closes the gap. 0: the GPU's part alone."""
    slope_lead: float = 0.25
    """How far past the second half's middle, in windows, its slope is carried at the
    acceleration from the first half's: a fit's slope is that of its middle, so 0.25 gives
    the slope at the window's end, where the distance is measured from. Only once the GPU
    has left its usual level (``excursion_*``): a healthy GPU's part in a warm-up speeds up
    now and then too. 0: the second half's slope as it is."""
    steady: float = 0.75
    """The second half's slope over the first's, at least: below, the rise is settling."""
    settle_sigmas: float = 2.0
    """...when the halves' slopes differ by this many of their standard errors: a slowdown
    within the noise of two 10-minute fits is no evidence of settling (a drift nearing a cap
    that clips its noise slows a little too)."""
    min_peers: int = 2
    """Fewest peers whose median a GPU's trends are taken against; with fewer, its own signal.
    Against one peer, that peer's own trouble (its utilisation collapsing, its throttling)
    reads here as its mirror image: a rise toward the limits."""
    peers_changed_s: float = 60.0
    """How long a new count of sampled peers must last before the trends start afresh (a
    GPU lost or back moves the peers' median; one missing sample does not)."""
    load_settle_s: float = 30.0
    """Unbroken load after a dip before power and clock count again. They follow the load
    within a sample; temperature, with its thermal lag, waits for the adaptive config's
    ``settle_s``. A stall of a few samples or a checkpoint then costs the power and clock
    trends half a minute, not five."""
    rebound_tolerance_c: float = 1.0
    """Temperature counts again after a break in load once it is back within this of its
    level before the break (or after the adaptive config's ``settle_s``): a GPU stalled
    for 45 s cools by a degree or so and is back within a minute."""
    every_s: float = 10.0
    """Least time between two fits of one GPU's trends (sampled faster, they are fitted no
    more often: a fit walks the window's points)."""
    persist_s: float = 90.0
    """How long a trend must have held before it counts."""
    held_share: float = 0.5
    """The share of that time's evaluations in which it held."""
    min_held: int = 4
    """...and in at least this many of them: sampled every 30 s, a hot GPU's noise passes
    two fits of four now and then."""
    horizon_s: tuple[float, float] = (1200.0, 600.0)
    """Time left at which the severity starts (0) and is full (1)."""
    temperature_limit_c: float = 87.0
    """Where a GPU slows down for heat (the thermal runaway's throttle point in the traces;
    NVML's slowdown threshold on data-centre GPUs is near it)."""
    clock_floor: float = 0.7
    """The clock limit, as a share of the GPU's usual loaded clock."""

    def __post_init__(self) -> None:
        if not self.window_s > 0 or not 0 < self.min_coverage <= 1:
            raise ValueError("the drift window must be positive and its coverage in (0, 1]")
        if self.min_slope < 0 or self.power_min_slope < 0:
            raise ValueError(f"the least slopes must not be negative, got {self.min_slope} and "
                             f"{self.power_min_slope} (power)")
        if self.load_settle_s < 0 or self.rebound_tolerance_c < 0:
            raise ValueError("the drift's load settle and rebound tolerance must not be "
                             f"negative, got {self.load_settle_s} s and {self.rebound_tolerance_c} C")
        if not self.horizon_s[0] > self.horizon_s[1] >= 0:
            raise ValueError(f"the drift horizon must fall from start to full, got {self.horizon_s}")
        if self.late_min_t < 0 or self.excursion_lookback_s <= 0 or self.excursion_sigmas < 0 \
                or not 0 <= self.excursion_share < 1:
            raise ValueError("the second half's t and the excursion's sigmas must not be negative, "
                             "its look-back must be positive and its share in [0, 1), got "
                             f"{self.late_min_t}, {self.excursion_sigmas}, "
                             f"{self.excursion_lookback_s} s and {self.excursion_share}")
        if self.power_spread_block_s < 0:
            raise ValueError(f"the power spread's stretches must not be negative, got "
                             f"{self.power_spread_block_s} s")
        if not 0 <= self.slope_lead <= 0.25:
            raise ValueError(f"the slope's lead must be in [0, 0.25] windows, got {self.slope_lead}")
        if not 0 <= self.peer_rise <= 1:
            raise ValueError(f"the peers' rise share must be in [0, 1], got {self.peer_rise}")
        if not 0 < self.clock_floor < 1:
            raise ValueError(f"the clock floor must be a share in (0, 1), got {self.clock_floor}")


def _fit(times: np.ndarray, values: np.ndarray) -> tuple[float, float] | None:
    """The least-squares slope per second and its standard error."""
    n = len(times)
    if n < 4:
        return None
    dt = times - times.sum() / n
    sxx = float(dt @ dt)
    if sxx <= 0:
        return None
    dv = values - values.sum() / n
    slope = float(dt @ dv) / sxx
    residual = dv - slope * dt
    return slope, (float(residual @ residual) / (n - 2) / sxx) ** 0.5


def time_left(times: Sequence[float], values: Sequence[float], distance: float, scale: float,
              cfg: DriftConfig, rising: bool = True,
              before: tuple[Sequence[float], Sequence[float]] | None = None,
              peers: Sequence[float] | None = None, limit_follows: float = 0.0,
              spread_block_s: float = 0.0, min_slope: float | None = None) -> float | None:
    """Seconds until the GPU covers ``distance`` to its limit (``rising``: a limit above it;
    else below, and ``distance`` negative) at the trend of ``values`` (its own part of the
    signal); None when there is no trend toward it, or it is past the limit already (the
    level detectors' business). ``scale``: the limit's magnitude, for ``min_slope``.
    ``before``: the (times, values) of the ``excursion_lookback_s`` before the window, for
    ``late_min_t`` (none: no excursion is known, and only the whole window's slope counts).
    ``peers``: the peers' median at each of ``times``, whose rise over the second half adds
    ``peer_rise`` of itself to the slope the distance is covered at, once the GPU has left
    its usual level (``before``). ``limit_follows``: the share of the peers' level the limit
    itself moves with (the clock floor, a share of the peers' clock), so that their rise closes
    the distance by only the rest of it. ``spread_block_s``: the stretches over whose means
    the look-back's spread is taken (0: its samples'). ``min_slope``: the least slope's share
    of ``scale`` for this limit (None: ``cfg.min_slope``)."""
    if (distance <= 0) == rising or len(times) < 8 or \
            times[-1] - times[0] < cfg.min_coverage * cfg.window_s:
        return None
    toward = 1.0 if rising else -1.0
    fits = _WindowFits.of(times, values, toward)
    if fits is None or not fits.rises_unsettled(cfg):
        return None
    floor = (cfg.min_slope if min_slope is None else min_slope) * abs(scale) / 60.0
    if fits.whole < floor and not fits.late_rises(floor, cfg):
        return None
    left_usual = _excursion(before, times, values, toward * fits.whole, distance, toward, cfg,
                            spread_block_s)
    if fits.whole < floor and not left_usual:
        return None
    slope, acceleration = fits.closing_pace(peers, left_usual, cfg, 1.0 - limit_follows)
    if acceleration <= 0:
        return abs(distance) / slope
    return (-slope + (slope * slope + 2 * acceleration * abs(distance)) ** 0.5) / acceleration


@dataclass(frozen=True)
class _WindowFits:
    """A window's least-squares fits, their slopes per second toward the limit: over the
    whole window and over each half."""

    times: np.ndarray
    toward: float
    whole: float
    early: float
    late: float
    whole_error: float
    early_error: float
    late_error: float

    @classmethod
    def of(cls, times: Sequence[float], values: Sequence[float], toward: float) -> "_WindowFits | None":
        # Arrays: the fits run at every evaluation of every GPU's three windows, and walked in
        # Python they were most of a replay's time.
        t = np.fromiter(times, float, len(times))
        v = np.fromiter(values, float, len(values))
        second = t >= cls.middle_of(times)
        fits = [_fit(t, v), _fit(t[~second], v[~second]), _fit(t[second], v[second])]
        if None in fits:
            return None
        (whole, whole_error), (early, early_error), (late, late_error) = fits
        return cls(t, toward, toward * whole, toward * early, toward * late,
                   whole_error, early_error, late_error)

    @staticmethod
    def middle_of(times: Sequence[float]) -> float:
        return times[-1] - (times[-1] - times[0]) / 2

    def rises_unsettled(self, cfg: DriftConfig) -> bool:
        """Whether the window rises by ``min_t`` of its errors, its second half rises too, and
        not as a step settles (clearly slower than its first)."""
        noise = (self.early_error ** 2 + self.late_error ** 2) ** 0.5
        settling = self.late < cfg.steady * self.early and \
            self.early - self.late > cfg.settle_sigmas * noise
        return self.whole >= cfg.min_t * self.whole_error and self.late > 0 and not settling

    def late_rises(self, floor: float, cfg: DriftConfig) -> bool:
        """Whether the second half alone rises at ``floor``, by ``late_min_t`` of its error."""
        return cfg.late_min_t > 0 and self.late >= floor and \
            self.late >= cfg.late_min_t * self.late_error

    def closing_pace(self, peers: Sequence[float] | None, left_usual: bool, cfg: DriftConfig,
                     peers_closing: float) -> tuple[float, float]:
        """The slope the distance is covered at, and its acceleration: constant, from the
        first half's slope to the second's (half a window apart); once the GPU has left its
        usual level, carried ``slope_lead`` on and with ``peer_rise`` of the ``peers``'
        rise over the second half, of which ``peers_closing`` closes the distance."""
        span = self.times[-1] - self.times[0]
        slope = max(self.late, self.whole)
        acceleration = max(0.0, (slope - self.early) / (span / 2))
        if not left_usual:
            return slope, acceleration
        slope += acceleration * cfg.slope_lead * span
        if peers is not None and cfg.peer_rise > 0 and len(peers) == len(self.times):
            second = self.times >= self.middle_of(self.times)
            theirs = _fit(self.times[second], np.fromiter(peers, float, len(peers))[second])
            if theirs is not None:
                slope += cfg.peer_rise * peers_closing * max(0.0, self.toward * theirs[0])
        return slope, acceleration


def _excursion(past: tuple[Sequence[float], Sequence[float]] | None, times: Sequence[float],
               values: Sequence[float], slope: float, distance: float, toward: float,
               cfg: DriftConfig, spread_block_s: float = 0.0) -> bool:
    """Whether the window's end level (its fit's) stands above the GPU's own usual level, the
    median of the look-back ``past`` (which must cover ``min_coverage`` of it), by
    ``excursion_sigmas`` of that look-back's spread (over ``spread_block_s`` means) and by
    ``excursion_share`` of the distance it started from. ``slope``: the window's fitted
    slope (per second, signed)."""
    if not past or len(past[1]) < 8 or \
            past[0][-1] - past[0][0] < cfg.min_coverage * cfg.excursion_lookback_s:
        return False
    end_level = statistics.fmean(values) + slope * (times[-1] - statistics.fmean(times))
    rise = toward * (end_level - statistics.median(past[1]))
    return rise > 0 and rise >= cfg.excursion_sigmas * _block_spread(past, spread_block_s) and \
        rise >= cfg.excursion_share * (rise + abs(distance))


def _block_spread(past: tuple[Sequence[float], Sequence[float]], block_s: float) -> float:
    """The standard deviation of the means of ``past``'s values over consecutive ``block_s``
    stretches; the values' own with fewer than three stretches (or ``block_s`` 0)."""
    values = np.fromiter(past[1], float, len(past[1]))
    if block_s > 0:
        times = np.fromiter(past[0], float, len(past[0]))
        block = ((times - times[0]) // block_s).astype(int)
        counts = np.bincount(block)
        means = np.bincount(block, values)[counts > 0] / counts[counts > 0]
        if len(means) >= 3:
            return float(means.std(ddof=1))
    return float(values.std(ddof=1))


def drift_severity(seconds_left: float | None, cfg: DriftConfig) -> float:
    if seconds_left is None:
        return 0.0
    start, full = cfg.horizon_s
    return min(1.0, max(0.0, (start - seconds_left) / (start - full)))


class Persistence:
    """Whether a GPU's trend has held: in at least ``held_share`` of its evaluations over the
    last ``persist_s``, and in ``min_held`` of them (a drift's fits dip below a test now and
    then; noise's rarely pass one twice in a row), and now."""

    def __init__(self) -> None:
        self.recent: deque[tuple[float, bool]] = deque()

    def confirmed(self, t: float, seconds_left: float | None, cfg: DriftConfig) -> float | None:
        self.recent.append((t, seconds_left is not None))
        while len(self.recent) > 1 and self.recent[1][0] <= t - cfg.persist_s:
            self.recent.popleft()
        if seconds_left is None or t - self.recent[0][0] < cfg.persist_s:
            return None
        held = sum(ok for _, ok in self.recent)
        return seconds_left if held >= max(cfg.min_held, cfg.held_share * len(self.recent)) else None


class PeerCount:
    """How many GPUs the drift windows' residuals are relative to; a new count counts once it
    has lasted (a GPU lost or back), not at one missing sample."""

    def __init__(self) -> None:
        self.count: int | None = None
        self._other_since: float | None = None

    def changed(self, t: float, count: int, lasting_s: float) -> bool:
        """Whether the windows must start afresh at ``t``, sampling ``count`` GPUs."""
        if self.count is None or count == self.count:
            self.count, self._other_since = count, None
            return False
        if self._other_since is None:
            self._other_since = t
        if t - self._other_since < lasting_s:
            return False
        self.count, self._other_since = count, None
        return True
