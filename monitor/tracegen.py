"""Labelled synthetic multi-GPU traces, for replaying the monitor against known failures.

Every trace is drawn from a seed (:func:`random_spec`) and varies in GPU count, sampling
interval (0.5 s to 30 s), length, noise levels, warm-up ramps, synchronised checkpoint dips
and evals across all GPUs, hot-but-steady GPUs, benign sporadic ECC corrections, single-sample
temperature spikes, spurious throttle bits and short single-GPU data stalls. The healthy
physics is the sim backend's (:class:`ftmaster.monitor.backends.sim.Fleet`).

Some GPUs fail. Most failures have a precursor, of one of the kinds in ``PRECURSOR_KINDS``
with a randomly drawn strength and length (minutes), built from the same anomalies that
``--inject`` uses; the rest fail suddenly. A failing GPU reports its fatal XID (if any) at the
failure time and is gone from the next sample on.

Output: ``trace_<seed>.csv`` in the exact ``gpu_metrics.csv`` format (``failure_risk``
empty) and ``trace_<seed>.labels.json``::

    {"seed", "num_gpus", "interval_s", "duration_s", "start_time",
     "failures": [{"gpu", "failure_time", "has_precursor", "precursor_start", "kind"}]}

with times in unix seconds (``precursor_start`` is null without a precursor).
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ftmaster.monitor.anomalies import (DRIFT_SHAPES, DRIFT_SIGNALS, AmbientSwing, Anomaly,
                                        AnomalyOverlay, DoubleBitError, Drift, EccBurst, LoadStep,
                                        PagesPending, PowerOscillation, ThermalRunaway, Throttling,
                                        UtilizationCollapse, Xid)
from ftmaster.monitor.backends.sim import Fleet, GpuTraits
from ftmaster.monitor.sample import GpuSample, to_row
from ftmaster.monitor.schema import CSV_COLUMNS
from ftmaster.monitor.signals import HW_POWER_BRAKE, HW_SLOWDOWN, SW_THERMAL

START_TIME = 1_750_000_000.0
PRECURSOR_KINDS = ("thermal_runaway", "ecc_degradation", "throttling", "power_oscillation",
                   "utilization_collapse", "thermal_throttle")
MAX_SAMPLES = 40_000  # keeps one trace to a few seconds of replay


@dataclass(frozen=True)
class FailurePlan:
    gpu: int
    time_s: float  # failure time, seconds after the trace starts
    kind: str  # a PRECURSOR_KINDS entry, or "sudden"
    precursor_s: float  # 0 for sudden failures
    anomalies: tuple[Anomaly, ...]  # laid over the GPU from the precursor's start
    final: tuple[Anomaly, ...]  # laid over the GPU at the failure sample (fatal XID, DBE, ...)


@dataclass(frozen=True)
class Episode:
    """Benign anomalies laid over a GPU from ``start_s`` on, with no failure: a look-alike."""

    gpu: int
    start_s: float
    kind: str
    anomalies: tuple[Anomaly, ...]


@dataclass(frozen=True)
class TraceSpec:
    seed: int
    num_gpus: int
    interval_s: float
    duration_s: float
    warmup_s: float
    base_load: float
    checkpoint_every_s: float
    checkpoint_len_s: float
    eval_every_s: float | None
    eval_len_s: float
    traits: tuple[GpuTraits, ...]
    failures: tuple[FailurePlan, ...]
    spike_prob: float  # per sample and GPU: a one-sample temperature spike
    spurious_throttle_prob: float  # per sample and GPU: a one-sample HW slowdown bit
    stall_prob: float  # per sample and GPU: a short data stall on that GPU alone
    episodes: tuple[Episode, ...] = ()


def random_spec(seed: int) -> TraceSpec:
    """A varied trace, fully determined by ``seed``."""
    rng = random.Random(f"trace:{seed}")
    num_gpus = rng.choice((1, 2, 4, 4, 8, 8, 8))
    interval = rng.choice((0.5, 1.0, 2.0, 5.0, 10.0, 10.0, 15.0, 30.0))
    hours = rng.choice((2, 4, 6, 8, 12))
    duration = min(hours * 3600.0, MAX_SAMPLES * interval / num_gpus)
    duration = max(duration, 1800.0)
    warmup = rng.uniform(60, 480)
    traits = tuple(_random_traits(rng) for _ in range(num_gpus))
    if rng.random() < 0.6:  # one hot but steady GPU
        hot = rng.randrange(num_gpus)
        traits = traits[:hot] + (_with_offset(traits[hot], rng.uniform(8, 18)),) + traits[hot + 1:]
    return TraceSpec(
        seed=seed, num_gpus=num_gpus, interval_s=interval, duration_s=duration, warmup_s=warmup,
        base_load=rng.uniform(0.88, 0.98),
        checkpoint_every_s=rng.uniform(600, 3600), checkpoint_len_s=rng.uniform(20, 180),
        eval_every_s=rng.choice((None, rng.uniform(600, 2400))), eval_len_s=rng.uniform(60, 240),
        traits=traits, failures=_random_failures(rng, num_gpus, interval, duration, warmup),
        spike_prob=rng.uniform(0, 0.002), spurious_throttle_prob=rng.uniform(0, 0.002),
        stall_prob=rng.uniform(0, 0.001),
    )


def _random_traits(rng: random.Random) -> GpuTraits:
    return GpuTraits(temp_noise_c=rng.uniform(0.3, 1.2), wander_c=rng.uniform(0.3, 1.2),
                     power_noise_frac=rng.uniform(0.015, 0.05), power_cap_prob=rng.uniform(0, 0.2),
                     benign_sbe_per_hour=rng.uniform(0.5, 4) if rng.random() < 0.3 else 0.0,
                     thermal_tau_s=rng.uniform(60, 130))


def _with_offset(traits: GpuTraits, offset: float) -> GpuTraits:
    return GpuTraits(**{**traits.__dict__, "temp_offset_c": offset})


def _random_failures(rng: random.Random, num_gpus: int, interval: float, duration: float,
                     warmup: float) -> tuple[FailurePlan, ...]:
    count = min(num_gpus, rng.choice((0, 1, 1, 2)))
    plans = []
    for gpu in rng.sample(range(num_gpus), count):
        kinds = [k for k in PRECURSOR_KINDS if num_gpus > 1 or k != "utilization_collapse"]
        kind = rng.choice(kinds) if rng.random() < 0.8 else "sudden"
        precursor_s, anomalies, final = _precursor(rng, kind)
        earliest = warmup + 600 + precursor_s
        if earliest >= duration - 2 * interval:
            continue
        when = math.floor(rng.uniform(earliest, duration - 2 * interval) / interval) * interval
        plans.append(FailurePlan(gpu, when, kind, precursor_s, anomalies, final))
    return tuple(plans)


def _precursor(rng: random.Random, kind: str) -> tuple[float, tuple[Anomaly, ...], tuple[Anomaly, ...]]:
    """(precursor length, its anomalies, what shows at the failure sample) for one kind."""
    fatal = (Xid(code=rng.choice((79, 79, 48, 94))),) if rng.random() < 0.7 else ()
    if kind == "sudden":
        return 0.0, (), fatal
    if kind == "thermal_runaway":
        rate = rng.uniform(1.0, 5.0)
        return rng.uniform(15, 30) / rate * 60, (ThermalRunaway(rate_c_per_min=rate),), fatal
    if kind == "ecc_degradation":
        length = rng.uniform(600, 1800)
        doubling = length / math.log2(rng.uniform(200, 3000))
        ending = rng.choice(((DoubleBitError(), Xid(code=48)), (PagesPending(), Xid(code=63))))
        return length, (EccBurst(doubling_s=doubling),), ending
    if kind == "throttling":
        mask = rng.choice((HW_SLOWDOWN, HW_POWER_BRAKE, HW_SLOWDOWN | HW_POWER_BRAKE))
        return rng.uniform(180, 900), (Throttling(mask=mask, clock_factor=rng.uniform(0.4, 0.8)),), fatal
    if kind == "power_oscillation":
        oscillation = PowerOscillation(amplitude_frac=rng.uniform(0.15, 0.4), period_s=rng.uniform(4, 40))
        return rng.uniform(180, 900), (oscillation,), fatal
    if kind == "utilization_collapse":
        return rng.uniform(120, 600), (UtilizationCollapse(level=rng.uniform(0, 8)),), fatal
    rate = rng.uniform(1.0, 3.0)  # thermal_throttle: heat and software thermal slowdown together
    return (rng.uniform(12, 25) / rate * 60,
            (ThermalRunaway(rate_c_per_min=rate), Throttling(mask=SW_THERMAL, clock_factor=0.8)), fatal)


def _load(spec: TraceSpec, t: float, jitter: float) -> float:
    """The shared training load at ``t`` (seconds in), seen by one GPU ``jitter`` s late."""
    t -= jitter
    if t < spec.warmup_s:
        return 0.1 + (spec.base_load - 0.1) * max(0.0, t) / spec.warmup_s
    since = t - spec.warmup_s
    if since % spec.checkpoint_every_s >= spec.checkpoint_every_s - spec.checkpoint_len_s:
        return 0.04
    if spec.eval_every_s and since % spec.eval_every_s >= spec.eval_every_s - spec.eval_len_s:
        return 0.6
    return spec.base_load


def generate(spec: TraceSpec, start_time: float = START_TIME) -> Iterator[list[GpuSample]]:
    """The trace's samples, one list per sampling instant."""
    rng = random.Random(f"noise:{spec.seed}")
    fleet = Fleet(range(spec.num_gpus), spec.seed, dict(enumerate(spec.traits)))
    overlay = AnomalyOverlay(seed=spec.seed)
    # Ranks enter a checkpoint or eval together, give or take a second or two.
    jitters = [rng.uniform(0, 2.0) for _ in range(spec.num_gpus)]
    alive = set(range(spec.num_gpus))
    stalled: dict[int, float] = {}
    steps = int(spec.duration_s / spec.interval_s)
    for step in range(steps + 1):
        t = step * spec.interval_s
        for failure in spec.failures:
            onset = failure.time_s - failure.precursor_s
            if failure.precursor_s > 0 and onset <= t < onset + spec.interval_s:
                overlay.inject(failure.gpu, *failure.anomalies)
        for episode in spec.episodes:
            if episode.start_s <= t < episode.start_s + spec.interval_s:
                overlay.inject(episode.gpu, *episode.anomalies)
        dying = [f for f in spec.failures if f.time_s <= t < f.time_s + spec.interval_s]
        for failure in dying:
            overlay.inject(failure.gpu, *failure.final)
        loads = {}
        for gpu in sorted(alive):
            if rng.random() < spec.stall_prob:
                stalled[gpu] = t + rng.uniform(1, 3) * spec.interval_s
            load = _load(spec, t, jitters[gpu]) + rng.gauss(0, 0.01)
            loads[gpu] = 0.2 if stalled.get(gpu, -1.0) > t else min(1.0, max(0.0, load))
        batch = overlay.apply(fleet.step(start_time + t, spec.interval_s, loads))
        for sample in batch:
            _add_noise(sample, spec, rng)
        if dying and not any(f.final for f in dying):
            batch = [s for s in batch if s.gpu_id not in {f.gpu for f in dying}]
        alive -= {f.gpu for f in dying}
        yield batch


def _add_noise(sample: GpuSample, spec: TraceSpec, rng: random.Random) -> None:
    if sample.temperature is not None and rng.random() < spec.spike_prob:
        sample.temperature += rng.uniform(4, 8)
    if sample.throttle_reasons is not None and rng.random() < spec.spurious_throttle_prob:
        sample.throttle_reasons |= HW_SLOWDOWN


def labels(spec: TraceSpec, start_time: float = START_TIME) -> dict:
    return {
        "seed": spec.seed, "num_gpus": spec.num_gpus, "interval_s": spec.interval_s,
        "duration_s": spec.duration_s, "start_time": start_time,
        "failures": [{"gpu": f.gpu, "failure_time": start_time + f.time_s,
                      "has_precursor": f.precursor_s > 0,
                      "precursor_start": start_time + f.time_s - f.precursor_s if f.precursor_s > 0 else None,
                      "kind": f.kind} for f in spec.failures],
        "episodes": [{"gpu": e.gpu, "start_time": start_time + e.start_s, "kind": e.kind}
                     for e in spec.episodes],
    }


def write_trace(spec: TraceSpec, directory: Path) -> tuple[Path, Path]:
    """Write ``trace_<seed>.csv`` and ``trace_<seed>.labels.json``; returns both paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    csv_path = directory / f"trace_{spec.seed}.csv"
    labels_path = directory / f"trace_{spec.seed}.labels.json"
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for batch in generate(spec):
            writer.writerows(to_row(s) for s in batch)
    labels_path.write_text(json.dumps(labels(spec), indent=1) + "\n")
    return csv_path, labels_path


# ---- slow drifts and their look-alikes -------------------------------------------------------

DRIFT_KINDS = tuple(f"{signal}_drift" for signal in DRIFT_SIGNALS)
BENIGN_KINDS = ("load_step", "slow_warmup", "ambient_swing")


def drift_spec(seed: int) -> TraceSpec:
    """A labelled trace for slow drifts, from ``seed``: 4-8 GPUs sampled every 5-15 s for
    3 hours, the usual healthy noise, checkpoint dips and hot GPUs; one GPU drifts to its limit
    over 20-30 minutes (a drift kind, of a shape in ``DRIFT_SHAPES``) and fails there, and
    the fleet goes through benign look-alikes (a step to heavier work, a slow warm-up to a new
    level, a swing of the room's temperature) that must stay quiet. They come to every GPU
    at once, as the phases of synchronous training and the room do, each GPU's a little
    different. Up to three of them stack: in 30 of seeds 0-1039 they hold a healthy GPU at
    87 C or more for 5 to 88 minutes (peaks up to 97.5 C), and in 36 more touch it for less,
    so a level near a limit is no alarm by itself. Seeds from 0 and up."""
    rng = random.Random(f"drift:{seed}")
    base = random_spec(10_000 + seed)
    num_gpus = rng.choice((4, 8))
    interval = rng.choice((5.0, 10.0, 15.0))
    duration = 3 * 3600.0
    # Cooler than the sim's 80 C under load, as a well-cooled rack runs them, so that a drift
    # to 87 C climbs well above the degree or two a GPU's cooling wanders by: over the
    # temperature drifts of seeds 480-759, 24 C at the median and under 12 C in 3 of 85. The
    # least, 4.6 C (seed 713), came after three benign warm-ups lifted the fleet at once; the
    # drift detector does not tell that one from the GPU's wander in time.
    rack = rng.uniform(-15, -5)
    traits = tuple(_with_offset(_random_traits(rng), rack) for _ in range(num_gpus))
    victim = rng.randrange(num_gpus)
    if rng.random() < 0.5:  # a hot but steady GPU (below 87 C), not the one that drifts
        hot = rng.choice([gpu for gpu in range(num_gpus) if gpu != victim])
        traits = traits[:hot] + (_with_offset(traits[hot], rack + rng.uniform(4, 10)),) + traits[hot + 1:]
    kind = rng.choice(DRIFT_KINDS)
    span = rng.uniform(20, 30) * 60
    drift = Drift(signal=kind.removesuffix("_drift"), duration_s=span,
                  shape=rng.choice(DRIFT_SHAPES), step_s=rng.uniform(120, 300))
    when = math.floor(rng.uniform(3600 + span, duration - 600) / interval) * interval
    failure = FailurePlan(victim, when, kind, span, (drift,), (Xid(code=rng.choice((79, 48))),))
    episodes = tuple(e for _ in range(rng.randint(1, 3)) for e in _benign(rng, num_gpus, duration))
    return TraceSpec(
        seed=seed, num_gpus=num_gpus, interval_s=interval, duration_s=duration,
        warmup_s=rng.uniform(60, 300), base_load=base.base_load,
        checkpoint_every_s=rng.uniform(900, 3600), checkpoint_len_s=rng.uniform(20, 120),
        eval_every_s=None, eval_len_s=0.0, traits=traits, failures=(failure,),
        spike_prob=base.spike_prob, spurious_throttle_prob=base.spurious_throttle_prob,
        stall_prob=base.stall_prob, episodes=episodes)


def _benign(rng: random.Random, num_gpus: int, duration: float) -> list[Episode]:
    kind = rng.choice(BENIGN_KINDS)
    start = rng.uniform(1200, duration - 3600)
    if kind == "ambient_swing":
        swing = AmbientSwing(amplitude_c=rng.uniform(2, 4), period_s=rng.uniform(2400, 7200))
        return [Episode(gpu, start, kind, (swing,)) for gpu in range(num_gpus)]
    tau = rng.uniform(60, 180) if kind == "load_step" else rng.uniform(400, 900)
    rise, power = rng.uniform(3, 8), rng.uniform(0.02, 0.05)  # stacked, past 87 C (drift_spec)
    return [Episode(gpu, start, kind, (LoadStep(rise_c=rise * rng.uniform(0.8, 1.2),
                                                power_frac=power * rng.uniform(0.8, 1.2),
                                                tau_s=tau),)) for gpu in range(num_gpus)]
