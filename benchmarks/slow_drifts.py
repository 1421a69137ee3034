"""Slow drifts: lead time as a share of each drift's span, and false alarms on look-alikes.

    .venv/bin/python benchmarks/slow_drifts.py [--traces 30] [--first-seed 0] [--existing 40]
                                               [--set FIELD=VALUE ...]

The trace set is generated (``ftmaster.monitor.tracegen.drift_spec``): each trace has one GPU
drifting to a limit over 20-30 minutes (temperature to 87 C, power to its cap, clock down
40%; linear, accelerating or in stairs) and failing there, and benign look-alikes on other
GPUs (a step to heavier work, a slow warm-up to a new level, a swing of the room's
temperature), over the usual healthy noise and checkpoint dips. Each trace is replayed
through the adaptive scorer; a drift's lead share is the time from its first true alert to
the failure over the drift's span (goal: at least 25%). False alarms are alert episodes
outside any failure's window, per 100 GPU-hours; each is listed by its trace's seed and GPU,
to be replayed on its own (``--first-seed SEED --traces 1``). A drift closes the gap its GPU
had to its limit when it began, so each short one is printed with that room (temperature and
power drifts; a clock drift always falls by the same share) beside the median of its kind: a
GPU that benign look-alikes had already taken near its limit rises little, and its drift
stays in its noise longer.

``--existing N`` also replays the first N traces of ``benchmarks/monitor_quality.py``'s set
(the failure types from before, its seeds 1000 on) and prints their recall and false alarms:
the drift detector must not lower the one nor raise the other. The detector was tuned with
these in view, so they are no held-out check: ``monitor_quality.py --first-seed 7000`` is. ``--set`` replays with fields of the drift detector's
:class:`~ftmaster.monitor.drifts.DriftConfig` changed (``--set excursion_share=0.3``), to
weigh a change of its thresholds on the same traces (a pair as ``--set horizon_s=1500,750``).
"""

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from ftmaster.monitor import tracegen
from ftmaster.monitor.alerts import AlertConfig
from ftmaster.monitor.anomalies import DRIFT_TEMPERATURE_LIMIT_C
from ftmaster.monitor.drifts import DriftConfig
from ftmaster.monitor.evaluate import evaluate, judge, replay
from ftmaster.monitor.scorers import AdaptiveConfig, AdaptiveScorer

GOAL = 0.25
PROGRESS_EVERY = 20
"""Traces between two progress lines on stderr (a trace takes a second or two)."""
ROOM_BEFORE_S = 300.0
"""The stretch before a drift whose loaded samples give the level it started from."""
ROOM_UNITS = {"temperature": "C", "power": "W"}


def drift_config(settings: list[str]) -> DriftConfig:
    """The default :class:`DriftConfig` with ``FIELD=VALUE`` settings (a pair of numbers
    for a pair: ``horizon_s=1500,750``); SystemExit naming a bad one."""
    defaults = DriftConfig()
    settable = sorted(field.name for field in dataclasses.fields(DriftConfig)
                      if isinstance(getattr(defaults, field.name), (int, float, tuple)))
    changed = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        if name not in settable or not value:
            raise SystemExit(f"--set {setting!r}: expected FIELD=VALUE, FIELD one of "
                             f"{', '.join(settable)}")
        try:
            changed[name] = _setting(getattr(defaults, name), value)
        except ValueError:
            raise SystemExit(f"--set {setting!r}: {value!r} is not "
                             f"{_expected(getattr(defaults, name))}") from None
    try:
        return dataclasses.replace(defaults, **changed)
    except ValueError as error:
        raise SystemExit(f"--set: {error}") from None


def _setting(default, value: str):
    """``value`` read as ``default``'s type: a number, or as many comma-separated numbers as
    a tuple of them holds."""
    if not isinstance(default, tuple):
        return type(default)(value)
    parts = value.split(",")
    if len(parts) != len(default):
        raise ValueError(value)
    return tuple(type(item)(part) for item, part in zip(default, parts))


def _expected(default) -> str:
    return f"{len(default)} comma-separated numbers" if isinstance(default, tuple) else "a number"


def room_at_start(spec: tracegen.TraceSpec, failure: dict, signal: str,
                  loaded_util: float) -> float | None:
    """What the drifting signal had left to its limit as the drift began: the median over
    its GPU's loaded samples in the ``ROOM_BEFORE_S`` before; None for a clock drift."""
    if signal not in ROOM_UNITS:
        return None
    start = failure["precursor_start"]
    steps = itertools.takewhile(lambda step: not step or step[0].timestamp < start,
                                tracegen.generate(spec))
    levels = [DRIFT_TEMPERATURE_LIMIT_C - s.temperature if signal == "temperature"
              else s.power_limit - s.power_draw
              for step in steps for s in step
              if s.gpu_id == failure["gpu"] and s.timestamp >= start - ROOM_BEFORE_S
              and (s.gpu_utilization or 0.0) >= loaded_util]
    return statistics.median(levels) if levels else None


def drift_results(seeds: range, folder: Path, config: AdaptiveConfig) -> tuple[list[dict], list[str], float]:
    """Per drift: kind, shape, span, lead share and its room at its start; each false
    episode's trace and GPU; and the GPU-hours."""
    drifts, episodes, gpu_hours = [], [], 0.0
    started = time.monotonic()
    for done, seed in enumerate(seeds):
        if done and done % PROGRESS_EVERY == 0:
            print(f"  replayed {done}/{len(seeds)} traces in {time.monotonic() - started:.0f} s",
                  file=sys.stderr, flush=True)
        spec = tracegen.drift_spec(seed)
        csv_path, labels_path = tracegen.write_trace(spec, folder)
        labels = json.loads(labels_path.read_text())
        alerts, hours, _ = replay(csv_path, AdaptiveScorer(config), AlertConfig())
        gpu_hours += hours
        for gpu in sorted({alert.gpu for alert in alerts}):
            judged = judge([a for a in alerts if a.gpu == gpu], labels["failures"],
                           grace_s=60.0, episode_gap_s=1800.0)
            episodes += [f"seed {seed} GPU {gpu}"] * judged.false_episodes
        for failure, plan in zip(labels["failures"], spec.failures):
            span = failure["failure_time"] - failure["precursor_start"]
            early = [a.time for a in alerts if a.gpu == failure["gpu"]
                     and failure["precursor_start"] <= a.time < failure["failure_time"]]
            lead = failure["failure_time"] - min(early) if early else 0.0
            signal = plan.anomalies[0].signal
            drifts.append({"seed": seed, "kind": plan.kind, "shape": plan.anomalies[0].shape,
                           "span_min": span / 60, "share": lead / span, "signal": signal,
                           "room": room_at_start(spec, failure, signal, config.loaded_util)})
    return drifts, episodes, gpu_hours


def room_text(drift: dict, drifts: list[dict]) -> str:
    """``drift``'s room to its limit at its start, beside the median of its kind's."""
    rooms = [d["room"] for d in drifts if d["kind"] == drift["kind"] and d["room"] is not None]
    if drift["room"] is None or not rooms:
        return ""
    unit = ROOM_UNITS[drift["signal"]]
    return (f"; it started {drift['room']:.1f} {unit} from its limit (its kind's median "
            f"{statistics.median(rooms):.1f} {unit})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=30)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--existing", type=int, default=0, metavar="N",
                        help="also replay N traces of the earlier failure types (seeds 1000 on)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a DriftConfig field changed for the replays (repeatable)")
    options = parser.parse_args()
    config = AdaptiveConfig(drift=drift_config(options.set))
    with tempfile.TemporaryDirectory(prefix="ftmaster-drifts-") as tmp:
        seeds = range(options.first_seed, options.first_seed + options.traces)
        drifts, episodes, gpu_hours = drift_results(seeds, Path(tmp), config)
        by_kind = defaultdict(list)
        for drift in drifts:
            by_kind[(drift["kind"], drift["shape"])].append(drift["share"])
        print(f"{len(drifts)} drifts of 20-30 min in {options.traces} traces (seeds "
              f"{seeds.start}..{seeds.stop - 1}); lead as a share of the drift's span:")
        for (kind, shape), shares in sorted(by_kind.items()):
            print(f"  {kind:18s} {shape:12s} n={len(shares):2d} median {statistics.median(shares):5.0%}"
                  f"  least {min(shares):5.0%}")
        shares = [d["share"] for d in drifts]
        met = sum(share >= GOAL for share in shares)
        print(f"all: median {statistics.median(shares):.0%}, least {min(shares):.0%}; "
              f"{met}/{len(shares)} at or above {GOAL:.0%}")
        for drift in drifts:
            if drift["share"] < GOAL:
                print(f"  short: seed {drift['seed']} ({drift['kind']}, {drift['shape']}): "
                      f"{drift['share']:.1%} of its span left{room_text(drift, drifts)}")
        print(f"false-alarm episodes {len(episodes)} = {100 * len(episodes) / gpu_hours:.2f} per "
              f"100 GPU-h over {gpu_hours:.0f} GPU-h (benign look-alikes included)")
        for episode in episodes:
            print(f"  false: {episode}")
        if options.existing:
            specs = [tracegen.random_spec(seed) for seed in range(1000, 1000 + options.existing)]
            traces = [tracegen.write_trace(spec, Path(tmp) / "existing") for spec in specs]
            r = evaluate(traces, lambda: AdaptiveScorer(config), AlertConfig())
            print(f"earlier failure types ({options.existing} traces, seeds 1000 on): recall "
                  f"{r['recall']:.1%} ({r['predicted']}/{r['precursor_failures']}), median lead "
                  f"{r['median_lead_s'] / 60:.1f} min, false-alarm episodes {r['false_episodes']} "
                  f"= {r['false_per_100_gpu_hours']:.2f} per 100 GPU-h")


if __name__ == "__main__":
    main()
