"""Replay scoring throughput: GPU samples per second through the full monitor path.

Parses a generated 8-GPU trace, scores it with the adaptive scorer and writes
gpu_metrics.csv/events.jsonl like ``ftmaster monitor --backend replay:PATH`` does.
Reports the median of several runs. Goal: >= 1000 samples/s.

    .venv/bin/python benchmarks/monitor_replay_speed.py [--runs 5]
"""

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from ftmaster.monitor import tracegen
from ftmaster.monitor.backends.replay import ReplayBackend
from ftmaster.monitor.daemon import Monitor, MonitorConfig
from ftmaster.monitor.scorers import make_scorer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--scorer", default="adaptive")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # Seed 3 draws 8 GPUs with a hot one and no failure; 5 s sampling for 3 h.
        spec = replace(tracegen.random_spec(3), interval_s=5.0, duration_s=3 * 3600.0)
        trace, _ = tracegen.write_trace(spec, Path(tmp))
        rates = []
        for run in range(args.runs):
            began = time.perf_counter()
            monitor = Monitor(ReplayBackend(trace), Path(tmp) / f"run{run}", scorer=make_scorer(args.scorer),
                              config=MonitorConfig(interval_s=0.0))
            monitor.run_to_end()
            monitor.close()
            rates.append(monitor.samples_seen / (time.perf_counter() - began))
    print(f"replay ({args.scorer}, parse + score + write): {monitor.samples_seen} samples per run, "
          f"median {statistics.median(rates):.0f} samples/s over {args.runs} runs "
          f"(min {min(rates):.0f}, max {max(rates):.0f}); goal >= 1000")


if __name__ == "__main__":
    main()
