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

The paper (reference 002, Table III) gives only a worst-case overhead: every allowed
emergency save is taken and no failure happens; :func:`table_iii_overhead_s` reproduces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

HOUR = 3600.0


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

    def __post_init__(self) -> None:
        _require(isinstance(self.gpus, int) and self.gpus >= 1, "gpus must be an integer >= 1")
        _require(isinstance(self.save_interval, int) and self.save_interval >= 1,
                 "save_interval must be an integer >= 1")
        for name in ("gpu_mtbf_hours", "iteration_s", "run_hours"):
            _require(_finite(getattr(self, name)) and getattr(self, name) > 0,
                     f"{name} must be a finite number > 0")
        for name in ("save_block_s", "save_persist_s", "restart_s", "lead_s",
                     "false_alarm_rate"):
            _require(_finite(getattr(self, name)) and getattr(self, name) >= 0,
                     f"{name} must be a finite number >= 0")
        for name in ("recall", "gap_frac"):
            _require(_finite(getattr(self, name)) and 0 <= getattr(self, name) <= 1,
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

    def periodic_only(self) -> GoodputInputs:
        """The same run with no predictor: no alerts, no false alarms."""
        return replace(self, recall=0.0, false_alarm_rate=0.0)


def gap_iterations(gap_frac, save_interval):
    """The trainer's gap filter (``minimum_gap`` in megatron/training/save_requests.py): an
    emergency save waits this many iterations after the last save; at least the next one, so
    gap_frac 0 turns the filter off. Broadcasts over arrays."""
    return np.maximum(1, np.ceil(np.multiply(gap_frac, save_interval)))


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


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
    lost_hours (running time thrown away since restored snapshots), restart_hours and
    save_hours (blocked by saves that were kept), as floats or arrays.
    """
    k = np.asarray(x.save_interval if save_interval is None else save_interval, dtype=float)
    frac = np.asarray(x.gap_frac if gap_frac is None else gap_frac, dtype=float)
    cycle = k * x.iteration_s
    gap = gap_iterations(frac, k) * x.iteration_s
    block, rate = x.save_block_s, x.failure_rate_s
    extra = false_alarm_saves_per_cycle(*np.broadcast_arrays(cycle, gap), x.false_alarm_rate_s)
    lost = (1 - x.recall) * _expected_loss(x, cycle, gap, extra, announced=False)
    if x.recall > 0:
        lost = lost + x.recall * _expected_loss(x, cycle, gap, extra, announced=True)
    committed = 1 + (1 + extra) * block / cycle  # running time per unit of useful compute
    survive = 1 - rate * lost
    goodput = np.where(survive > 0, survive / (committed * (1 + rate * x.restart_s)), 0.0)
    work = x.run_hours * HOUR
    running = np.where(survive > 0, work * committed / np.maximum(survive, 1e-300), np.inf)
    failures = rate * running
    return _squeeze({
        "goodput": goodput, "wall_hours": (running + failures * x.restart_s) / HOUR,
        "failures": failures, "lost_hours": failures * lost / HOUR,
        "restart_hours": failures * x.restart_s / HOUR,
        "save_hours": work * (committed - 1) / HOUR,
    })


def _squeeze(values: dict) -> dict:
    return {key: (float(v) if np.ndim(v) == 0 else np.asarray(v)) for key, v in values.items()}


def young_daly_interval_s(x: GoodputInputs) -> float:
    """Young's optimal compute time between saves, sqrt(2 C MTBF_job)."""
    return math.sqrt(2 * x.save_block_s / x.failure_rate_s)


def optimal_interval(x: GoodputInputs, tune_gap: bool = False) -> dict:
    """The save interval (iterations), and optionally gap fraction, of highest analytic goodput.

    A log grid finds the neighbourhood, then every integer interval around it is tried.
    """
    fracs = np.linspace(0.05, 1.0, 20) if tune_gap else np.array([x.gap_frac])
    upper = max(10.0, 20 * x.gpu_mtbf_hours * HOUR / x.gpus / x.iteration_s)
    coarse = np.unique(np.geomspace(1, upper, 200).astype(int))
    k, frac = _best(x, coarse, fracs)
    fine = np.arange(max(1, int(k * 0.92)), int(k * 1.08) + 2)
    k, frac = _best(x, fine, np.array([frac]))
    return {"save_interval": k, "gap_frac": frac,
            "goodput": float(analytic(x, k, frac)["goodput"])}


def _best(x: GoodputInputs, intervals: np.ndarray, fracs: np.ndarray) -> tuple[int, float]:
    grid = analytic(x, intervals[:, None], fracs[None, :])["goodput"]
    row, col = np.unravel_index(np.argmax(grid), grid.shape)
    return int(intervals[row]), float(fracs[col])


# ---- Monte Carlo -----------------------------------------------------------------------------

# Event kinds, in the order ties are broken: a failure wins over anything at the same instant.
FAIL, ALERT, FALSE_ALARM, PERIODIC, EMERGENCY, END = range(6)


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
        self.request_at = np.full(runs, np.inf)  # progress of a pending emergency save
        self.next_fail = self._exp(x.failure_rate_s, zeros)
        self.announced = rng.random(runs) < x.recall
        self.next_false = self._exp(x.false_alarm_rate_s, zeros)
        self.done = np.zeros(runs, dtype=bool)
        self.failures, self.lost, self.saves = zeros.copy(), zeros.copy(), zeros.copy()

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
        times = np.stack([self.next_fail, alert, false_alarm,
                          t + boundary - p, t + self.request_at - p,
                          t + x.run_hours * HOUR - p])
        kind = np.argmin(times, axis=0)
        return kind, times[kind, np.arange(self.n)]

    def advance(self, mask: np.ndarray, when: np.ndarray) -> None:
        """Compute runs uninterrupted from t to ``when`` on the masked runs."""
        self.p = np.where(mask, self.p + when - self.t, self.p)
        self.t = np.where(mask, when, self.t)

    def promote(self, mask: np.ndarray, when: np.ndarray) -> None:
        """A save in flight that is durable by ``when`` becomes the restore point."""
        ready = mask & (self.pend_at <= when)
        self.durable_p = np.where(ready, self.pend_p, self.durable_p)
        self.durable_t = np.where(ready, self.pend_t, self.durable_t)
        self.pend_at = np.where(ready, np.inf, self.pend_at)

    def fail(self, mask: np.ndarray, when: np.ndarray) -> None:
        self.promote(mask, when)
        self.failures += mask
        self.lost += np.where(mask, when - self.durable_t, 0.0)
        self.t = np.where(mask, when, self.t)
        self.p = np.where(mask, self.durable_p, self.p)
        self.last_save = np.where(mask, self.durable_p, self.last_save)
        self.durable_t = np.where(mask, when, self.durable_t)  # lost time counts from here
        self.pend_at = np.where(mask, np.inf, self.pend_at)
        self.request_at = np.where(mask, np.inf, self.request_at)
        self.next_fail = np.where(mask, self._exp(self.x.failure_rate_s, when), self.next_fail)
        self.announced = np.where(mask, self.rng.random(self.n) < self.x.recall, self.announced)

    def request(self, mask: np.ndarray) -> None:
        """An emergency request: the next iteration boundary, deferred by the gap filter."""
        it = self.x.iteration_s
        at = np.maximum(np.ceil(self.p / it - 1e-9) * it, self.last_save + self.x.gap_s)
        self.request_at = np.where(mask & np.isinf(self.request_at), at, self.request_at)

    def save(self, mask: np.ndarray, when: np.ndarray) -> None:
        self.advance(mask, when)
        self.promote(mask, when)
        self.pend_p = np.where(mask, self.p, self.pend_p)
        self.pend_t = np.where(mask, when, self.pend_t)
        self.pend_at = np.where(mask, when + self.x.save_persist_s, self.pend_at)
        self.t = np.where(mask, when + self.x.save_block_s, self.t)
        self.last_save = np.where(mask, self.p, self.last_save)
        self.request_at = np.where(mask, np.inf, self.request_at)
        self.saves += mask

    def step(self) -> None:
        kind, when = self.next_events()
        live = ~self.done
        on = {k: live & (kind == k) for k in range(6)}
        self.fail(on[FAIL], when)
        self.advance(on[ALERT] | on[FALSE_ALARM], when)
        self.announced = np.where(on[ALERT], False, self.announced)  # one alert per failure
        self.next_false = np.where(on[FALSE_ALARM],
                                   self._exp(self.x.false_alarm_rate_s, when), self.next_false)
        self.request(on[ALERT] | on[FALSE_ALARM])
        self.save(on[PERIODIC] | on[EMERGENCY], when)
        self.advance(on[END], when)
        self.done |= on[END]


MAX_EVENTS_PER_RUN = 1_000_000  # a step costs about 80 us for 200 runs: over a minute


def expected_events_per_run(x: GoodputInputs) -> float:
    """About how many events one simulated run plays: periodic saves, failures, alarms."""
    cycle_s = x.save_interval * x.iteration_s
    return x.run_hours * HOUR * (1 / cycle_s + x.failure_rate_s + x.false_alarm_rate_s)


def simulate(x: GoodputInputs, runs: int = 200, seed: int = 0,
             max_events: int = 10_000_000) -> dict:
    """Monte Carlo of ``runs`` independent runs; means and the standard error of goodput."""
    _require(isinstance(runs, int) and runs >= 2,
             "runs must be an integer >= 2 (the standard error needs two)")
    events = expected_events_per_run(x)
    _require(events <= MAX_EVENTS_PER_RUN,
             f"the Monte Carlo would play about {events:.2g} events per run, over its limit "
             f"of {MAX_EVENTS_PER_RUN:.0e} (a periodic save per save_interval x iteration_s "
             f"= {x.save_interval * x.iteration_s:g} s over {x.run_hours:g} h, plus failures "
             "and false alarms); lengthen the save interval, shorten run_hours, or skip the "
             "simulation (--runs 0)")
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
    return {"goodput": float(goodput.mean()),
            "goodput_stderr": float(goodput.std(ddof=1) / math.sqrt(runs)),
            "wall_hours": float(wall.mean() / HOUR), "failures": float(state.failures.mean()),
            "lost_hours": float(state.lost.mean() / HOUR),
            "restart_hours": float(state.failures.mean() * x.restart_s / HOUR),
            "save_hours": float(saved.mean() / HOUR)}


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
