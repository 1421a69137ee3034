"""How long ``ftmaster analyze`` takes on a generated trace, and its peak memory.

    .venv/bin/python benchmarks/analyze_speed.py            # 8 GPUs x 3 h at 1 s (goal < 30 s)
    .venv/bin/python benchmarks/analyze_speed.py --week     # 8 GPUs x 7 days at 1 s (~4.8 M rows)

The trace comes from the monitor's generator and is scored by a monitor replay (see
``tests/helpers/synth_run.py``); the week is 56 copies of the 3-hour trace, back to back.

Each repetition runs the real command in a fresh process (imports included), so its peak
RSS comes from that process alone (``os.wait4``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.synth_run import failing_spec, repeat_csv, write_run_dir  # noqa: E402

WEEK_COPIES = 7 * 24 // 3


def run_once(run_dir: Path, out: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one ``ftmaster analyze`` process."""
    command = [sys.executable, "-m", "ftmaster.cli", "analyze", str(run_dir), "--out", str(out)]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"ftmaster analyze failed with status {status}")
    return elapsed, usage.ru_maxrss / 1024  # Linux reports KiB


def write_trace(run_dir: Path, gpus: int, copies: int) -> None:
    repeat_csv(write_run_dir(run_dir, failing_spec(gpus=gpus, hours=3.0)), copies)


def generate(run_dir: Path, gpus: int, copies: int) -> None:
    """Write the trace in a child process: the memory it takes must not count against the
    analyze processes, which Linux would otherwise charge via fork (ru_maxrss is inherited)."""
    child = multiprocessing.get_context("spawn").Process(target=write_trace,
                                                         args=(run_dir, gpus, copies))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit("generating the trace failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--week", action="store_true", help="a 7-day trace instead of 3 hours")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    copies = WEEK_COPIES if args.week else 1
    with tempfile.TemporaryDirectory(prefix="analyze_speed.") as tmp:
        start = time.perf_counter()
        csv_path = Path(tmp) / "run" / "gpu_metrics.csv"
        generate(csv_path.parent, args.gpus, copies)
        rows = sum(1 for _ in open(csv_path)) - 1
        print(f"generated {rows} rows ({csv_path.stat().st_size / 2**20:.0f} MiB) "
              f"in {time.perf_counter() - start:.1f} s")
        results = [run_once(csv_path.parent, Path(tmp) / f"out{i}") for i in range(args.repeats)]
    seconds = [r[0] for r in results]
    print(f"analyze {args.gpus} GPUs x {3 * copies} h: median {statistics.median(seconds):.2f} s "
          f"(runs: {', '.join(f'{s:.2f}' for s in seconds)}), "
          f"peak RSS {max(r[1] for r in results):.0f} MiB")


if __name__ == "__main__":
    main()
