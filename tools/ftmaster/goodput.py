"""Expected goodput of a training run under Poisson GPU failures: periodic-only against
proactive (predicted-failure) checkpointing, analytically and by Monte Carlo.

Model
-----
The job runs on ``gpus`` GPUs; each fails as a Poisson process with rate 1/MTBF while the job
runs, and any GPU failure stops the job, so the job fails at rate ``L = gpus / MTBF``. Failures
are counted in running time only (the clock stops during a restart, which costs ``restart_s``).
Progress is measured in compute seconds: ``W = save_interval * iteration_s`` of compute
separate two periodic saves. A save blocks training for ``C = save_block_s`` and becomes
durable ``P = save_persist_s`` after it starts (P >= C). A failure restores the newest durable
checkpoint; the lost work of a failure is the running time since that checkpoint's snapshot
(recomputed compute plus the saves taken in between), as in Young (1974) and Daly (2006).

Periodic-only. A failure lands at a uniform phase x of the cycle of length ``T = W + C``
(first order in ``L*T``). The newest checkpoint is usable when x >= P, otherwise the one before
it is, so ``E[lost] = T/2 + P``. Per unit of useful compute the committed saves cost ``C/W``,
and every failure wastes ``lost + restart``; with failures at rate L per running second::

    goodput = (1 - L * E[lost]) / ((1 + C/W) * (1 + L * restart_s))

Its maximum is at ``W* ~ sqrt(2 C / L) = sqrt(2 C MTBF_job)`` (Young) when C << MTBF_job,
which :func:`young_daly_interval_s` gives and the tests check.

That form is first order in ``L*T``: as the save cost approaches the job's MTBF it falls to
zero goodput while the job still makes progress. Without a predictor the model is solved
exactly instead (:func:`exact_periodic`), by renewal at the moments a save becomes durable:
from one, the job must run ``b = W + C`` without a failure to reach the next; a failure
restores the last durable snapshot, after which it must run ``a = W + P`` (compute, then
until the next save is durable) without one, retried as often as it takes. Failures count
running time only, so with ``R = restart_s``::

    running per interval = (1 - exp(-L b)) exp(L a) / L,  failures per interval = L * that
    goodput = W L exp(-L a) / ((1 - exp(-L b)) (1 + L R))

Its best W solves ``exp(L (W + C)) (1 - L W) = 1`` whatever P is, Daly's exact optimum
(Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart
dumps", FGCS 22(3)): ``W* = MTBF_job (1 + W0(-exp(-(1 + C / MTBF_job))))`` with W0 the
principal branch of Lambert's W (:func:`daly_exact_interval_s`).

Proactive. A fraction ``recall`` of failures is announced ``lead_s`` before it happens;
false alarms arrive at ``false_alarm_rate`` per GPU-hour. An alert requests an emergency save,
which the trainer takes at the next iteration boundary, but not before
``gap = max(1, ceil(gap_frac * save_interval))`` iterations since the last save (gap_frac 0:
no filter beyond the next iteration): an early request is
deferred to that point (``save_deferred``), and a periodic save answers it too.

* False alarms cost extra saves. After a save, the next emergency save comes ``max(g, X)``
  later, X ~ Exp(false-alarm rate); the expected count per cycle ``m`` is the renewal count of
  those intervals within W, summed exactly. Extra saves add ``m * C / W`` of overhead and make
  checkpoints younger: unpredicted failures lose ``C/2 + age + P``, where ``age`` is the mean
  time since the last save with saves at the effective rate ``m / W`` (W/2 when m = 0).
* An announced failure at phase y of its cycle (uniform on [0, W)) has its alert at phase
  ``y - lead_s``, possibly in the cycle before. The emergency save starts ``d`` after the
  alert: the wait for the iteration boundary (uniform on [0, iteration_s]), or longer when
  the gap filter defers it to g after the periodic save; a periodic save that comes first
  answers it instead. The failure loses the time since the newest usable snapshot: the
  emergency one (``lead_s - d``, usable when ``d + P <= lead_s``) or the periodic one
  (``y + C``, usable when ``y + C >= P``, else the one before). This part is averaged
  numerically over y and the wait. It treats false alarms as rare (their saves' effect on
  the gap filter is left out), which the simulation does not.

The Monte Carlo simulation (:func:`simulate`) plays the same rules event by event without the
first-order approximations, for many runs at once (numpy arrays across runs), so it also
checks them. A save still persisting when the next one starts is superseded by it (one save
in flight, as Megatron's async queue finalises one before the next).

Two tiers. With ``memory_interval`` >= 1 every save goes first to a memory tier (host RAM,
``/dev/shm``), as ftmaster's design A does: one every ``memory_interval`` iterations
(Megatron-LM's ``--non-persistent-save-interval``, a divisor of ``save_interval`` here so
that every disk interval looks alike) blocks training ``C_mem = memory_save_s`` and is
complete when the block ends. The supervisor copies the save at each multiple of
``save_interval`` to disk in the background, durable ``P = persist_s`` after its block
ends; a copy due while the previous one still runs is skipped, so one disk interval in
``m = ceil((C_mem + P) / T)`` gets one (T: a disk interval's running time). A failure that
leaves host RAM (a GPU or process failure: the copy in ``/dev/shm`` outlives the rank)
restores the newest memory save; a node crash, a share ``s = node_failure_share`` of the
failures, loses host RAM and restores the newest durable disk copy. After the former the
supervisor persists the restored copy while the job relaunches (taken as durable when
training resumes: ``persist_s`` <= ``restart_s``). With W_m the compute between memory
saves, N = m save_interval / memory_interval saves between two disk copies and D = N W_m,
first order in the failure rate as above::

    E[lost | memory survives] = W_m / 2 + C_mem
    E[lost | node crash]      = D / 2 + C_mem (N + 1) / 2 + (W_m + C_mem) y0 / W_m

The middle term is the memory saves' blocks since the copied snapshot (running time a node
crash throws away too); y0 is the compute phase before which that copy is not yet durable
(it is ``P`` after its block, while each later save adds ``W_m + C_mem``). The saves cost
``C_mem / W_m``. Minimising gives, while C_mem and W_m are small against the job's MTBF,
Young's form with the MTBF of the failures the memory tier survives
(:func:`memory_young_daly_interval_s`)::

    W_m* ~ sqrt(2 C_mem MTBF_job / (1 - s) * (1 + s m W / (2 MTBF_job)))

With s = 1 no memory save between disk copies pays; with s = 0 and free memory saves a
failure loses half a memory interval on average and at most one. The two-tier model has no
predictor (recall and false alarms 0): how the gap filter and emergency saves combine with
memory saves is the trainer's choice, not modelled yet.

The paper (reference 002, Table III) gives only a worst-case overhead: every allowed
emergency save is taken and no failure happens; :func:`table_iii_overhead_s` reproduces it.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, replace

import numpy as np

from ftmaster import runfiles
from ftmaster.recovery.gap_filter import GAP_DIGITS

HOUR = 3600.0


MAX_SAVE_INTERVAL = 10**12
"""Iterations, far beyond any run's; the two-tier model lists the interval's divisors (a
million trial divisions at this bound)."""

MAX_INPUT = 10**12
"""The most GPUs, seconds, hours or false alarms per GPU-hour an input may be, and the
reciprocal of the least MTBF, iteration time or run length: far beyond any run's, and within
float range through the model's arithmetic (an MTBF of 10^308 or 10^-323 hours made the job's
failure rate 0 or infinite, then a division by zero; 10^400 GPUs are no float; an iteration
of 10^-300 s had the table print a 300-digit wall time)."""

_IN_RANGE = "beyond any real run; the model's arithmetic overflows past it"


@dataclass(frozen=True)
class GoodputInputs:
    """One training run and its fault-tolerance settings; every time is in seconds."""

    gpus: int = 1024
    """GPUs in the job; any one failing stops the job."""
    gpu_mtbf_hours: float = 50_000.0
    """Mean time between failures of one GPU, in hours (1 / per-GPU failure rate)."""
    iteration_s: float = 2.0
    """Wall time of one training iteration."""
    save_block_s: float = 20.0
    """How long training is blocked by one checkpoint save."""
    save_persist_s: float = 60.0
    """Time from the start of a save until it is durable (>= save_block_s)."""
    restart_s: float = 600.0
    """Time from a failure until training runs again: detection, re-plan, relaunch, load."""
    recall: float = 0.5
    """Fraction of failures the predictor announces in advance."""
    lead_s: float = 120.0
    """How long before an announced failure its alert arrives."""
    false_alarm_rate: float = 1e-4
    """Alerts not followed by a failure, per GPU-hour."""
    save_interval: int = 1000
    """Iterations between periodic saves (Megatron's --save-interval)."""
    gap_frac: float = 0.25
    """Emergency saves wait max(1, ceil(gap_frac * save_interval)) iterations after a save."""
    run_hours: float = 720.0
    """Failure-free, save-free compute time of the whole run."""
    memory_interval: int = 0
    """Iterations between memory-tier saves (--non-persistent-save-interval); 0: the optimum.

    0 leaves it unset: the model has a single tier, and ``ftmaster goodput`` shows the two
    tiers at the optimal interval."""
    memory_save_s: float = 5.0
    """How long training is blocked by one save into the memory tier (host RAM, /dev/shm).

    Default: a quarter of save_block_s's default, the ratio of /dev/shm to disk write
    bandwidth measured on the project's VM (1.5 GB/s against 371 MB/s)."""
    persist_s: float = 60.0
    """Time the background copy of a memory checkpoint to disk takes until durable.

    Default: the default disk save's time until durable, since the copy writes the same bytes
    to the same disk."""
    node_failure_share: float = 0.12
    """Share of failures that lose the memory tier, node crashes (Llama 3: 50 of 419).

    Default: the rows of Llama 3's Table 5 (arXiv:2407.21783; 419 unexpected interruptions on
    16,384 H100s in 54 days) that take a host down or off the network: unplanned host
    maintenance 32, NIC 7, power supply 3, server chassis 2, IO expansion board 2, CPU 2,
    system memory 2, i.e. 50 of 419. GPU, software and switch failures leave host RAM."""

    def __post_init__(self) -> None:
        _require(isinstance(self.gpus, int) and 1 <= self.gpus <= MAX_INPUT,
                 f"gpus must be an integer from 1 to 10^12 ({_IN_RANGE})")
        _require(isinstance(self.save_interval, int) and 1 <= self.save_interval <= MAX_SAVE_INTERVAL,
                 "save_interval must be an integer from 1 to 10^12")
        _require(isinstance(self.memory_interval, int) and self.memory_interval >= 0,
                 "memory_interval must be an integer >= 0 (0: unset)")
        if self.memory_interval and self.save_interval % self.memory_interval:
            raise ValueError(f"memory_interval ({reprlib.repr(self.memory_interval)}) must divide "
                             f"save_interval ({self.save_interval}), as every disk copy is of a "
                             f"memory save: "
                             f"{_nearest_divisor(self.save_interval, self.memory_interval)} does")
        for name in ("gpu_mtbf_hours", "iteration_s", "run_hours"):
            _require(runfiles.is_finite_number(getattr(self, name))
                     and 1 / MAX_INPUT <= getattr(self, name) <= MAX_INPUT,
                     f"{name} must be a number from 10^-12 to 10^12 ({_IN_RANGE})")
        for name in ("save_block_s", "save_persist_s", "restart_s", "lead_s",
                     "false_alarm_rate", "memory_save_s", "persist_s"):
            _require(runfiles.is_finite_number(getattr(self, name)) and 0 <= getattr(self, name) <= MAX_INPUT,
                     f"{name} must be a finite number >= 0, at most 10^12 ({_IN_RANGE})")
        for name in ("recall", "gap_frac", "node_failure_share"):
            _require(runfiles.is_finite_number(getattr(self, name)) and 0 <= getattr(self, name) <= 1,
                     f"{name} must be between 0 and 1")
        _require(self.save_persist_s >= self.save_block_s,
                 "save_persist_s (until durable) must be >= save_block_s (blocked)")

    @property
    def failure_rate_s(self) -> float:
        """Job failures per running second."""
        return self.gpus / (self.gpu_mtbf_hours * HOUR)

    @property
    def false_alarm_rate_s(self) -> float:
        """Job-level false alarms per running second."""
        return self.gpus * self.false_alarm_rate / HOUR

    @property
    def gap_s(self) -> float:
        """Compute seconds an emergency save waits after the last save (the trainer's rule)."""
        return float(gap_iterations(self.gap_frac, self.save_interval)) * self.iteration_s

    @property
    def tiered(self) -> bool:
        """Whether saves go to the memory tier first (see the module docstring)."""
        return self.memory_interval >= 1

    def periodic_only(self) -> GoodputInputs:
        """The same run with no predictor: no alerts, no false alarms."""
        return replace(self, recall=0.0, false_alarm_rate=0.0)

    def single_tier(self) -> GoodputInputs:
        """The same run saving straight to disk, as without the memory tier."""
        return replace(self, memory_interval=0)

    def two_tier(self, memory_interval: int) -> GoodputInputs:
        """The same run with no predictor, saving to memory every ``memory_interval``."""
        return replace(self.periodic_only(), memory_interval=memory_interval)


def gap_iterations(gap_frac, save_interval):
    """The trainer's gap filter (``minimum_gap`` in recovery/gap_filter.py): an
    emergency save waits this many iterations after the last save; at least the next one, so
    gap_frac 0 turns the filter off. Broadcasts over arrays."""
    return np.maximum(1, np.ceil(np.round(np.multiply(gap_frac, save_interval), GAP_DIGITS)))


def _nearest_divisor(number: int, near: int) -> int:
    return min(divisors(number), key=lambda d: (abs(d - near), d))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# ---- analytic model --------------------------------------------------------------------------

def _poisson_tail(mean: np.ndarray, n: int) -> np.ndarray:
    """P(Poisson(mean) >= n), i.e. P(Gamma(n, 1) <= mean); 1 for n == 0."""
    if n == 0:
        return np.ones_like(mean)
    terms = np.exp(-mean)
    cdf = terms.copy()
    for j in range(1, n):
        terms = terms * mean / j
        cdf += terms
    return np.clip(1.0 - cdf, 0.0, 1.0)


def false_alarm_saves_per_cycle(cycle_s, gap_s, rate_s, max_terms: int = 200):
    """Expected emergency saves within one periodic cycle caused by Poisson false alarms.

    Saves follow each other by D = max(g, X), X ~ Exp(rate). The count in [0, W) is
    sum_n P(S_n < W) with S_n = n g + Gamma(J, rate), J ~ Binomial(n, exp(-rate g)).
    Past ``max_terms`` possible saves per cycle the elementary renewal W / E[D] is used.
    """
    cycle_s = np.asarray(cycle_s, dtype=float)
    gap_s = np.broadcast_to(np.asarray(gap_s, dtype=float), cycle_s.shape)
    if rate_s <= 0:
        return np.zeros_like(cycle_s)
    n_max = np.ceil(cycle_s / gap_s).astype(int)
    renewal = cycle_s / (gap_s + np.exp(-rate_s * gap_s) / rate_s)
    exact = np.zeros_like(cycle_s)
    keep = np.exp(-rate_s * gap_s)  # P(X > g): that interval adds an Exp(rate) part
    for n in range(1, min(int(n_max.max()), max_terms) + 1):
        slack = np.maximum(cycle_s - n * gap_s, 0.0)
        for j in range(n + 1):
            weight = math.comb(n, j) * keep ** j * (1 - keep) ** (n - j)
            exact += np.where(cycle_s > n * gap_s, weight * _poisson_tail(rate_s * slack, j), 0)
    return np.where(n_max > max_terms, renewal, exact)


def _expected_loss(x: GoodputInputs, cycle_s, gap_s, extra_saves, announced: bool):
    """Expected lost time of a failure, averaged numerically (see the module docstring) over
    its phase y in the periodic cycle, the wait for the iteration boundary and the age of the
    last false-alarm save. Three trailing quadrature axes are added, then averaged away."""
    block, persist = x.save_block_s, x.save_persist_s
    cycle = np.asarray(cycle_s)[..., None, None, None]
    gap = np.asarray(gap_s)[..., None, None, None]
    rate = np.asarray(extra_saves)[..., None, None, None] / cycle
    y = _midpoints(96)[:, None, None] * cycle  # failure phase, compute s
    wait = _midpoints(4)[:, None] * x.iteration_s
    with np.errstate(divide="ignore"):  # no false alarms: that save is infinitely old
        spare = -np.log(1 - _midpoints(8)) / rate  # Exp quantiles: last false-alarm save's age
    periodic = np.where(y + block >= persist, y + block, y + cycle + 2 * block)
    spare_ok = np.where((spare < y) & (spare + block >= persist), spare + block, np.inf)
    newest = np.minimum(periodic, spare_ok)
    if announced:
        newest = np.minimum(newest, _emergency_age(x, cycle, gap, y, wait, spare))
    return newest.mean(axis=(-3, -2, -1))


def _midpoints(count: int) -> np.ndarray:
    return (np.arange(count) + 0.5) / count


def _emergency_age(x: GoodputInputs, cycle, gap, y, wait, spare):
    """Age at failure of the emergency save its alert asked for; inf where unusable."""
    lead = x.lead_s
    alert = y - lead
    age = np.maximum(np.where(alert < 0, alert + cycle, alert), 0.0)  # since last periodic
    age = np.where(spare >= lead, np.minimum(age, spare - lead), age)  # ... or false-alarm
    delay = np.maximum(wait, gap - age)  # the gap filter defers an early request
    answered = (delay < lead) & ((alert >= 0) | (age + delay < cycle))
    return np.where(answered & (lead - delay >= x.save_persist_s), lead - delay, np.inf)


def analytic(x: GoodputInputs, save_interval=None, gap_frac=None) -> dict:
    """Expected outcome; ``save_interval`` / ``gap_frac`` may be arrays to sweep (broadcast).

    Returns goodput (useful compute / wall), wall_hours, failures (expected count),
    lost_hours (running time thrown away since restored snapshots), lost_per_failure_s,
    restart_hours and save_hours (blocked by saves that were kept), as floats or arrays.
    With the memory tier on (:func:`two_tier_analytic`) there is nothing to sweep.
    """
    if x.tiered:
        _require(save_interval is None and gap_frac is None,
                 "the two-tier model sweeps the memory interval only: see "
                 "optimal_memory_interval")
        return two_tier_analytic(x)
    if x.recall == 0 and x.false_alarm_rate == 0:
        return exact_periodic(x, save_interval, gap_frac)
    k = np.asarray(x.save_interval if save_interval is None else save_interval, dtype=float)
    frac = np.asarray(x.gap_frac if gap_frac is None else gap_frac, dtype=float)
    cycle = k * x.iteration_s
    gap = gap_iterations(frac, k) * x.iteration_s
    block = x.save_block_s
    extra = false_alarm_saves_per_cycle(*np.broadcast_arrays(cycle, gap), x.false_alarm_rate_s)
    lost = (1 - x.recall) * _expected_loss(x, cycle, gap, extra, announced=False)
    if x.recall > 0:
        lost = lost + x.recall * _expected_loss(x, cycle, gap, extra, announced=True)
    committed = 1 + (1 + extra) * block / cycle  # running time per unit of useful compute
    return _squeeze(_outcome(x, lost, committed))


def _outcome(x: GoodputInputs, lost, committed) -> dict:
    """The run's totals from the expected loss of a failure (running seconds) and the running
    time per unit of useful compute (1 + the saves' blocked share)."""
    rate = x.failure_rate_s
    survive = 1 - rate * lost
    goodput = np.where(survive > 0, survive / (committed * (1 + rate * x.restart_s)), 0.0)
    work = x.run_hours * HOUR
    with np.errstate(over="ignore"):  # the branch np.where discards where survive <= 0
        running = np.where(survive > 0, work * committed / np.maximum(survive, 1e-300), np.inf)
    failures = rate * running
    return {
        "goodput": goodput, "wall_hours": (running + failures * x.restart_s) / HOUR,
        "failures": failures, "lost_hours": failures * lost / HOUR,
        "lost_per_failure_s": lost,
        "restart_hours": failures * x.restart_s / HOUR,
        "save_hours": work * (committed - 1) / HOUR,
    }


def exact_periodic(x: GoodputInputs, save_interval=None, gap_frac=None) -> dict:
    """Periodic-only on one tier, exactly (the module docstring's renewal form): the keys of
    :func:`analytic`. ``gap_frac`` is accepted for the sweeps and changes nothing here."""
    k, _ = np.broadcast_arrays(
        np.asarray(x.save_interval if save_interval is None else save_interval, dtype=float),
        np.asarray(x.gap_frac if gap_frac is None else gap_frac, dtype=float))
    rate, work = x.failure_rate_s, x.run_hours * HOUR
    compute = k * x.iteration_s
    steady, retry = compute + x.save_block_s, compute + x.save_persist_s  # b and a
    reach = -np.expm1(-rate * steady)  # P(a failure before the next save is durable)
    goodput = compute * rate * np.exp(-rate * retry) / (reach * (1 + rate * x.restart_s))
    with np.errstate(over="ignore"):  # past float range the run never ends: inf, reported so
        retries = np.expm1(rate * retry)  # expected failures after the first, per interval
        failures = work / compute * reach * (1 + retries)
        # the time since the restored snapshot: P plus the truncated wait for the first
        # failure, then the truncated waits of the retries (counted from the restart)
        lost = reach * (x.save_persist_s + _truncated_mean(rate, steady)
                        + retries * _truncated_mean(rate, retry)) / (reach * (1 + retries))
    running = failures / rate
    return _squeeze({"goodput": goodput,
                     "wall_hours": (running + failures * x.restart_s) / HOUR,
                     "failures": failures, "lost_hours": failures * lost / HOUR,
                     "lost_per_failure_s": lost,
                     "restart_hours": failures * x.restart_s / HOUR,
                     "save_hours": (running - work - failures * lost) / HOUR})


def _truncated_mean(rate: float, span):
    """E[X | X < span] for X ~ Exp(rate)."""
    with np.errstate(over="ignore"):
        return 1 / rate - span / np.expm1(rate * span)


FIRST_ORDER_LIMIT = 0.25
"""Largest share of the job's MTBF a save interval with its save may span for the
first-order model: there it is within about 2% of the exact periodic-only goodput (0.4% at
0.11, 2.1% at 0.27, 40% at 1.3)."""


def first_order_breakdown(x: GoodputInputs) -> str | None:
    """Why the first-order (proactive) model does not hold for ``x``; None when it does."""
    exposure = x.failure_rate_s * (x.save_interval * x.iteration_s + x.save_block_s
                                   + x.save_persist_s)
    if exposure <= FIRST_ORDER_LIMIT:
        return None
    return (f"a save interval with its save spans {exposure:.3g} of the job's MTBF, over the "
            f"first-order model's {FIRST_ORDER_LIMIT:g}: the proactive model has no estimate "
            f"here (the Monte Carlo plays its rules; periodic-only is solved exactly)")


def lambert_w0(value: float) -> float:
    """The principal branch of Lambert's W on [-1/e, 0] (Halley's iteration; no SciPy here)."""
    _require(-1 / math.e <= value <= 0, "lambert_w0 is defined here on [-1/e, 0]")
    w = -1 + math.sqrt(2 * (1 + math.e * value))  # the series at the branch point
    for _ in range(50):
        e = math.exp(w)
        f = w * e - value
        if f == 0 or w == -1:
            break
        step = f / (e * (w + 1) - (w + 2) * f / (2 * w + 2))
        w -= step
        if abs(step) < 1e-15 * max(1.0, abs(w)):
            break
    return w


def daly_exact_interval_s(x: GoodputInputs) -> float:
    """Daly's exact optimum: the compute between saves of highest periodic-only goodput."""
    mtbf = 1 / x.failure_rate_s
    return mtbf * (1 + lambert_w0(-math.exp(-(1 + x.save_block_s / mtbf))))


def _squeeze(values: dict) -> dict:
    return {key: (float(v) if np.ndim(v) == 0 else np.asarray(v)) for key, v in values.items()}


def young_daly_interval_s(x: GoodputInputs) -> float:
    """Young's optimal compute time between saves, sqrt(2 C MTBF_job)."""
    return math.sqrt(2 * x.save_block_s / x.failure_rate_s)


FINE_POINTS = 401
"""Most intervals the fine search tries: every integer near the coarse optimum up to this many,
else this many evenly spread over the same 16% of the interval (0.04% apart)."""


def optimal_interval(x: GoodputInputs, tune_gap: bool = False) -> dict:
    """The save interval (iterations), and optionally gap fraction, of highest analytic goodput.

    A log grid finds the neighbourhood, then the integer intervals around it are tried
    (every one, up to :data:`FINE_POINTS`).
    """
    fracs = np.linspace(0.05, 1.0, 20) if tune_gap else np.array([x.gap_frac])
    # Up to 20 job MTBFs (Young's optimum is far below), and no further than the whole run
    # (an interval beyond it never saves) or the longest interval the model takes.
    upper = max(10.0, min(min(20 * x.gpu_mtbf_hours * HOUR / x.gpus, x.run_hours * HOUR)
                          / x.iteration_s, MAX_SAVE_INTERVAL))
    # Neighbours at most 8% apart, as the fine search reaches; a bounded count however long
    # the MTBF (an array per point is several MB).
    points = max(200, math.ceil(math.log(upper) / math.log(1.08)) + 1)
    coarse = np.unique(np.geomspace(1, upper, points).astype(int))
    k, frac = _best(x, coarse, fracs)
    low, high = max(1, int(k * 0.92)), min(int(k * 1.08) + 2, MAX_SAVE_INTERVAL)
    fine = np.unique(np.linspace(low, high, min(high - low + 1, FINE_POINTS)).round().astype(int))
    k, frac = _best(x, fine, np.array([frac]))
    return {"save_interval": k, "gap_frac": frac,
            "goodput": float(analytic(x, k, frac)["goodput"])}


def _best(x: GoodputInputs, intervals: np.ndarray, fracs: np.ndarray) -> tuple[int, float]:
    grid = analytic(x, intervals[:, None], fracs[None, :])["goodput"]
    row, col = np.unravel_index(np.argmax(grid), grid.shape)
    return int(intervals[row]), float(fracs[col])


# ---- two tiers -------------------------------------------------------------------------------

def divisors(number: int) -> list[int]:
    """The divisors of ``number``, ascending: the memory intervals a save interval allows."""
    small = [d for d in range(1, math.isqrt(number) + 1) if number % d == 0]
    return sorted(set(small + [number // d for d in small]))


def _require_no_predictor(x: GoodputInputs) -> None:
    _require(x.recall == 0 and x.false_alarm_rate == 0,
             "the two-tier model has no predictor: give recall 0 and false_alarm_rate 0 "
             "(GoodputInputs.two_tier does)")


def disk_copy_stride(x: GoodputInputs, memory_interval):
    """Disk intervals per durable copy: a copy due while the previous one still runs is
    skipped, so one interval in this many gets one (1 when the copier keeps up)."""
    saves = x.save_interval / np.asarray(memory_interval)  # per disk interval
    running = x.save_interval * x.iteration_s + saves * x.memory_save_s
    return np.maximum(1, np.ceil((x.memory_save_s + x.persist_s) / running)).astype(int)


def _two_tier_outcome(x: GoodputInputs, memory_interval) -> dict:
    """The module docstring's two-tier expectations; ``memory_interval`` (divisors of the
    save interval) may be an array to sweep."""
    block, persist = x.memory_save_s, x.persist_s
    step = np.asarray(memory_interval) * x.iteration_s  # W_m, compute between memory saves
    stride = disk_copy_stride(x, memory_interval)
    saves = stride * x.save_interval / np.asarray(memory_interval)  # N, between disk copies
    span = saves * step  # D
    # The copy is durable persist_s after its save's block ends; the save l later ends its
    # block l (W_m + C_mem) after that, so the copy becomes durable in the gap after save
    # ``first - 1``, or as save ``first`` begins.
    first = np.ceil(persist / (step + block))
    undurable = np.where(first > 0, np.minimum(persist - (first - 1) * block, first * step), 0.0)
    rank_loss = step / 2 + block
    node_loss = span / 2 + block * (saves + 1) / 2 + (step + block) * undurable / step
    share = x.node_failure_share
    lost = (1 - share) * rank_loss + share * node_loss
    result = _squeeze({**_outcome(x, lost, 1 + block / step),
                       "lost_per_rank_failure_s": rank_loss, "lost_per_node_crash_s": node_loss})
    result["disk_copy_interval"] = (stride if np.ndim(stride) else int(stride)) * x.save_interval
    return result


def two_tier_analytic(x: GoodputInputs) -> dict:
    """Expected outcome with the memory tier on (``x.memory_interval`` >= 1): the keys of
    :func:`analytic`, plus the lost work of a failure the memory tier survives
    (lost_per_rank_failure_s) and of a node crash (lost_per_node_crash_s), and the iterations
    between durable disk copies (disk_copy_interval)."""
    _require(x.tiered, "memory_interval must be >= 1 for the two-tier model")
    _require_no_predictor(x)
    return _two_tier_outcome(x, x.memory_interval)


def optimal_memory_interval(x: GoodputInputs) -> dict:
    """The memory interval of highest analytic goodput among the divisors of save_interval
    (save_interval itself: no memory save between disk copies), the disk interval as given."""
    _require_no_predictor(x)
    candidates = np.array(divisors(x.save_interval))
    best = int(candidates[np.argmax(_two_tier_outcome(x, candidates)["goodput"])])
    outcome = _two_tier_outcome(x, best)
    return {"memory_interval": best, "goodput": outcome["goodput"],
            "lost_per_failure_s": outcome["lost_per_failure_s"]}


def memory_young_daly_interval_s(x: GoodputInputs) -> float:
    """First-order optimal compute time between memory saves: Young's form with the MTBF of
    the failures the memory tier survives, corrected for node crashes (module docstring; m
    taken without memory saves between disk copies). Infinite when every failure is a node
    crash: then no memory save between disk copies pays."""
    share = x.node_failure_share
    if share >= 1:
        return math.inf
    mtbf = 1 / x.failure_rate_s
    between_copies = int(disk_copy_stride(x, x.save_interval)) * x.save_interval * x.iteration_s
    correction = 1 + share * between_copies / (2 * mtbf)
    return math.sqrt(2 * x.memory_save_s * mtbf / (1 - share) * correction)


# ---- Monte Carlo -----------------------------------------------------------------------------

# Event kinds, in the order ties are broken: a failure wins over anything at the same instant,
# and a disk interval's save over a memory-only one.
FAIL, ALERT, FALSE_ALARM, PERIODIC, EMERGENCY, MEMORY, END = range(7)


class _Runs:
    """State of many independent runs, one array element per run, advanced event by event."""

    def __init__(self, x: GoodputInputs, runs: int, rng: np.random.Generator):
        self.x, self.rng, self.n = x, rng, runs
        zeros = np.zeros(runs)
        self.t = zeros.copy()  # running time (restarts excluded)
        self.p = zeros.copy()  # progress, compute seconds
        self.last_save = zeros.copy()  # progress of the last save started
        self.durable_p, self.durable_t = zeros.copy(), zeros.copy()  # restore point
        self.pend_p, self.pend_t = zeros.copy(), zeros.copy()  # save in flight: snapshot
        self.pend_at = np.full(runs, np.inf)  # ... and when it becomes durable
        # The memory tier: its newest complete save, and the one being written.
        self.mem_p, self.mem_t = zeros.copy(), zeros.copy()
        self.mem_pend_p, self.mem_pend_t = zeros.copy(), zeros.copy()
        self.mem_pend_at = np.full(runs, np.inf)
        self.request_at = np.full(runs, np.inf)  # progress of a pending emergency save
        self.next_fail = self._exp(x.failure_rate_s, zeros)
        self.announced = rng.random(runs) < x.recall
        self.next_false = self._exp(x.false_alarm_rate_s, zeros)
        self.from_disk = self._restores_from_disk()
        self.done = np.zeros(runs, dtype=bool)
        self.failures, self.lost, self.saves = zeros.copy(), zeros.copy(), zeros.copy()
        self.crashes, self.crash_lost, self.worst_lost = zeros.copy(), zeros.copy(), zeros.copy()

    def _restores_from_disk(self) -> np.ndarray:
        """Whether each run's next failure restores from disk: always with one tier, on a
        node crash with two. Drawn only with two, so that single-tier runs replay the random
        numbers they did before the memory tier existed."""
        if not self.x.tiered:
            return np.ones(self.n, dtype=bool)
        return self.rng.random(self.n) < self.x.node_failure_share

    def _exp(self, rate: float, start: np.ndarray) -> np.ndarray:
        if rate <= 0:
            return np.full(start.shape, np.inf)
        return start + self.rng.exponential(1 / rate, start.shape)

    def next_events(self) -> tuple[np.ndarray, np.ndarray]:
        x, t, p = self.x, self.t, self.p
        cycle = x.save_interval * x.iteration_s
        boundary = (np.floor(p / cycle + 1e-9) + 1) * cycle
        alert = np.where(self.announced, np.maximum(self.next_fail - x.lead_s, t), np.inf)
        # An alarm that came while a save blocked training is heard once training runs again;
        # taken at its own time it would move progress backwards.
        false_alarm = np.maximum(self.next_false, t)
        memory = np.full(self.n, np.inf)
        if x.tiered:
            step = x.memory_interval * x.iteration_s
            memory = t + (np.floor(p / step + 1e-9) + 1) * step - p
        times = np.stack([self.next_fail, alert, false_alarm,
                          t + boundary - p, t + self.request_at - p, memory,
                          t + x.run_hours * HOUR - p])
        kind = np.argmin(times, axis=0)
        return kind, times[kind, np.arange(self.n)]

    def advance(self, mask: np.ndarray, when: np.ndarray) -> None:
        """Compute runs uninterrupted from t to ``when`` on the masked runs."""
        self.p = np.where(mask, self.p + when - self.t, self.p)
        self.t = np.where(mask, when, self.t)

    def promote(self, mask: np.ndarray, when: np.ndarray) -> None:
        """A save in flight that is durable (disk) or complete (memory) by ``when`` becomes a
        restore point."""
        ready = mask & (self.pend_at <= when)
        self.durable_p = np.where(ready, self.pend_p, self.durable_p)
        self.durable_t = np.where(ready, self.pend_t, self.durable_t)
        self.pend_at = np.where(ready, np.inf, self.pend_at)
        if not self.x.tiered:
            return
        ready = mask & (self.mem_pend_at <= when)
        self.mem_p = np.where(ready, self.mem_pend_p, self.mem_p)
        self.mem_t = np.where(ready, self.mem_pend_t, self.mem_t)
        self.mem_pend_at = np.where(ready, np.inf, self.mem_pend_at)

    def fail(self, mask: np.ndarray, when: np.ndarray) -> None:
        """A node crash restores the newest durable disk copy, any other failure the newest
        complete memory save, which the supervisor persists while the job relaunches."""
        self.promote(mask, when)
        from_disk = mask & self.from_disk
        restore_p = np.where(from_disk, self.durable_p, self.mem_p)
        lost = np.where(mask, when - np.where(from_disk, self.durable_t, self.mem_t), 0.0)
        crash = from_disk & self.x.tiered
        self.failures += mask
        self.lost += lost
        self.crashes += crash
        self.crash_lost += np.where(crash, lost, 0.0)
        self.worst_lost = np.maximum(self.worst_lost, lost)
        self.t = np.where(mask, when, self.t)
        self.p = np.where(mask, restore_p, self.p)
        self.last_save = np.where(mask, restore_p, self.last_save)
        self.durable_p = np.where(mask, restore_p, self.durable_p)
        self.mem_p = np.where(mask, restore_p, self.mem_p)
        self.durable_t = np.where(mask, when, self.durable_t)  # lost time counts from here
        self.mem_t = np.where(mask, when, self.mem_t)
        self.pend_at = np.where(mask, np.inf, self.pend_at)
        self.mem_pend_at = np.where(mask, np.inf, self.mem_pend_at)
        self.request_at = np.where(mask, np.inf, self.request_at)
        self.next_fail = np.where(mask, self._exp(self.x.failure_rate_s, when), self.next_fail)
        self.announced = np.where(mask, self.rng.random(self.n) < self.x.recall, self.announced)
        if self.x.tiered:
            self.from_disk = np.where(mask, self._restores_from_disk(), self.from_disk)

    def request(self, mask: np.ndarray) -> None:
        """An emergency request: the next iteration boundary, deferred by the gap filter."""
        it = self.x.iteration_s
        at = np.maximum(np.ceil(self.p / it - 1e-9) * it, self.last_save + self.x.gap_s)
        self.request_at = np.where(mask & np.isinf(self.request_at), at, self.request_at)

    def save(self, mask: np.ndarray, when: np.ndarray, to_disk: np.ndarray) -> None:
        """A save on the masked runs; ``to_disk`` marks those a disk copy is due for. Single
        tier: straight to disk, superseding a save still persisting. Two tiers: to memory,
        copied to disk when due and the copier is idle."""
        x = self.x
        self.advance(mask, when)
        self.promote(mask, when)
        if x.tiered:
            block, durable_in = x.memory_save_s, x.memory_save_s + x.persist_s
            self.mem_pend_p = np.where(mask, self.p, self.mem_pend_p)
            self.mem_pend_t = np.where(mask, when, self.mem_pend_t)
            self.mem_pend_at = np.where(mask, when + block, self.mem_pend_at)
            copy = mask & to_disk & np.isinf(self.pend_at)
        else:
            block, durable_in, copy = x.save_block_s, x.save_persist_s, mask
        self.pend_p = np.where(copy, self.p, self.pend_p)
        self.pend_t = np.where(copy, when, self.pend_t)
        self.pend_at = np.where(copy, when + durable_in, self.pend_at)
        self.t = np.where(mask, when + block, self.t)
        self.last_save = np.where(mask, self.p, self.last_save)
        self.request_at = np.where(mask, np.inf, self.request_at)
        self.saves += mask

    def step(self) -> None:
        kind, when = self.next_events()
        live = ~self.done
        on = {k: live & (kind == k) for k in range(END + 1)}
        self.fail(on[FAIL], when)
        self.advance(on[ALERT] | on[FALSE_ALARM], when)
        self.announced = np.where(on[ALERT], False, self.announced)  # one alert per failure
        self.next_false = np.where(on[FALSE_ALARM],
                                   self._exp(self.x.false_alarm_rate_s, when), self.next_false)
        self.request(on[ALERT] | on[FALSE_ALARM])
        self.save(on[PERIODIC] | on[EMERGENCY] | on[MEMORY], when, on[PERIODIC] | on[EMERGENCY])
        self.advance(on[END], when)
        self.done |= on[END]


MAX_EVENTS_PER_RUN = 1_000_000  # a step costs about 80 us for 200 runs: over a minute


def expected_events_per_run(x: GoodputInputs) -> float:
    """About how many events one simulated run plays: saves, alarms, and the failures the
    model expects over the wall time (restarts and rework included: where failures outpace
    progress they have no end, and each simulated run would play its whole event budget)."""
    cycle_s = x.save_interval * x.iteration_s
    memory = 1 / (x.memory_interval * x.iteration_s) if x.tiered else 0.0
    # where the first-order (proactive) model has no estimate, periodic-only's exact one
    # stands in: a predictor's saves make what a failure restores newer, not older
    model = x.periodic_only() if first_order_breakdown(x) else x
    failures = float(np.max(analytic(model)["failures"]))
    return x.run_hours * HOUR * (1 / cycle_s + memory + x.false_alarm_rate_s) + failures


def simulate(x: GoodputInputs, runs: int = 200, seed: int = 0,
             max_events: int = 10_000_000) -> dict:
    """Monte Carlo of ``runs`` independent runs: means, the standard error of goodput, the
    lost work per failure (over every failure of every run) and the worst one."""
    _require(isinstance(runs, int) and runs >= 2,
             "runs must be an integer >= 2 (the standard error needs two)")
    if x.tiered:
        _require_no_predictor(x)
    events = expected_events_per_run(x)
    _require(math.isfinite(events),
             "the Monte Carlo would never end: failures outpace progress (the model's goodput "
             "is 0: a run fails, on average, before it saves); skip the simulation (--runs 0)")
    _require(events <= MAX_EVENTS_PER_RUN,
             f"the Monte Carlo would play about {events:.2g} events per run, over its limit "
             f"of {MAX_EVENTS_PER_RUN:.0e} (a periodic save per save_interval x iteration_s "
             f"= {x.save_interval * x.iteration_s:g} s over {x.run_hours:g} h, plus memory "
             "saves, failures and false alarms); lengthen the save or memory interval, shorten "
             "run_hours, or skip the simulation (--runs 0)")
    state = _Runs(x, runs, np.random.default_rng(seed))
    for _ in range(max_events):
        if state.done.all():
            break
        state.step()
    else:
        raise RuntimeError("simulation did not finish: failures outpace progress")
    work = x.run_hours * HOUR
    wall = state.t + state.failures * x.restart_s
    goodput = work / wall
    saved = state.t - work - state.lost  # running time neither computing nor thrown away
    result = {"goodput": float(goodput.mean()),
              "goodput_stderr": float(goodput.std(ddof=1) / math.sqrt(runs)),
              "wall_hours": float(wall.mean() / HOUR), "failures": float(state.failures.mean()),
              "lost_hours": float(state.lost.mean() / HOUR),
              "lost_per_failure_s": _per(state.lost.sum(), state.failures.sum()),
              "worst_lost_s": float(state.worst_lost.max()),
              "restart_hours": float(state.failures.mean() * x.restart_s / HOUR),
              "save_hours": float(saved.mean() / HOUR)}
    if x.tiered:
        result["lost_per_rank_failure_s"] = _per(state.lost.sum() - state.crash_lost.sum(),
                                                 state.failures.sum() - state.crashes.sum())
        result["lost_per_node_crash_s"] = _per(state.crash_lost.sum(), state.crashes.sum())
    return result


def _per(total: float, count: float) -> float | None:
    """A mean over events; None (unknown) when there were none."""
    return float(total / count) if count else None


# ---- the paper's worst case ------------------------------------------------------------------

# Reference 002, Table III: seconds of checkpointing over a GPT-3 175B-style schedule
# (500,000 iterations, save interval 10,000): baseline, with a 50% gap, with a 25% gap.
PAPER_TABLE_III = {"857M": (476, 952, 1904), "1.7B": (1624, 3248, 6496),
                   "7.1B": (7358, 14716, 29432)}
PAPER_TRAIN_ITERS = 500_000
PAPER_SAVE_INTERVAL = 10_000


def table_iii_overhead_s(checkpoint_s: float, gap_frac: float | None,
                         train_iters: int = PAPER_TRAIN_ITERS,
                         save_interval: int = PAPER_SAVE_INTERVAL) -> float:
    """The paper's worst case: alerts never stop and no failure happens, so a save is taken
    every gap (:func:`gap_iterations`; every ``save_interval`` without a predictor,
    ``gap_frac=None``); overhead = checkpoints x average checkpoint time."""
    spacing = save_interval if gap_frac is None else gap_iterations(gap_frac, save_interval)
    return round(train_iters / spacing) * checkpoint_s


def paper_checkpoint_s(model: str) -> float:
    """The average checkpoint time behind Table III's baseline column (476 s / 50 = 9.52 s)."""
    baseline = PAPER_TABLE_III[model][0]
    return baseline / (PAPER_TRAIN_ITERS / PAPER_SAVE_INTERVAL)
