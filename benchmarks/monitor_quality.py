"""Failure-prediction quality of the risk scorers on held-out labelled traces.

Generates ``--traces`` varied traces (``ftmaster.monitor.tracegen``) from seeds that were not
used while developing the scorers (1000 and up), replays each through the monitor with each
scorer, and prints recall (failures with precursors alerted before they happened), median
lead, false-alarm episodes per 100 GPU-hours and precision (definitions in
``ftmaster.monitor.evaluate``). Goals for adaptive: recall >= 85 %, median lead >= 2 min,
<= 1 false-alarm episode per 100 GPU-hours.

    .venv/bin/python benchmarks/monitor_quality.py [--traces 40] [--first-seed 1000]
"""

import argparse
import tempfile
from collections import Counter
from pathlib import Path

from ftmaster.monitor import tracegen
from ftmaster.monitor.alerts import AlertConfig
from ftmaster.monitor.evaluate import evaluate
from ftmaster.monitor.scorers import AdaptiveScorer, PaperScorer

CONFIGS = (
    ("adaptive @0.95", AdaptiveScorer, 0.95),
    ("paper @0.95", PaperScorer, 0.95),
    ("paper @0.10 (prototype)", PaperScorer, 0.10),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=40)
    parser.add_argument("--first-seed", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        specs = [tracegen.random_spec(seed) for seed in range(args.first_seed, args.first_seed + args.traces)]
        traces = [tracegen.write_trace(spec, Path(tmp)) for spec in specs]
        kinds = Counter(f.kind for spec in specs for f in spec.failures)
        print(f"{len(specs)} traces (seeds {args.first_seed}..{args.first_seed + args.traces - 1}): "
              f"GPUs {sorted(Counter(s.num_gpus for s in specs).items())}, intervals "
              f"{sorted(Counter(s.interval_s for s in specs).items())}, hot GPU in "
              f"{sum(any(t.temp_offset_c for t in s.traits) for s in specs)}; failures {dict(kinds)}")
        for label, scorer, threshold in CONFIGS:
            r = evaluate(traces, scorer, AlertConfig(threshold=threshold))
            print(f"{label:24s} recall {r['recall']:.1%} ({r['predicted']}/{r['precursor_failures']}), "
                  f"precision {r['precision']:.1%}, median lead {r['median_lead_s'] / 60:.1f} min, "
                  f"false-alarm episodes {r['false_episodes']} = {r['false_per_100_gpu_hours']:.2f} "
                  f"per 100 GPU-h over {r['gpu_hours']:.0f} GPU-h, {r['samples']} samples")


if __name__ == "__main__":
    main()
