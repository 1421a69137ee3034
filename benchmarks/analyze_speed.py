"""How long ``ftmaster analyze`` takes on a generated trace, and its peak memory.

    .venv/bin/python benchmarks/analyze_speed.py            # 8 GPUs x 3 h at 1 s (goal < 30 s)
    .venv/bin/python benchmarks/analyze_speed.py --week     # 8 GPUs x 7 days at 1 s (~4.8 M rows)
    .venv/bin/python benchmarks/analyze_speed.py --nodes 3  # 3 nodes x 8 GPUs x 3 h against
                                                            # 1 node x 24 GPUs (goal: < 2x)

The trace comes from the monitor's generator and is scored by a monitor replay (see
``tests/helpers/synth_run.py``); the week is 56 copies of the 3-hour trace, back to back.
With ``--nodes N`` the run has N ``node_<R>`` folders (node 1 loses a GPU, the others record
it as a peer failure) and is timed against one node with N times the GPUs, the same rows.

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

from ftmaster import runfiles  # noqa: E402
from helpers.synth_run import (failing_spec, repeat_csv, write_nodes_run_dir,  # noqa: E402
                               write_run_dir)

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


def write_trace(run_dir: Path, nodes: int, gpus: int, copies: int) -> None:
    if nodes == 1:
        repeat_csv(write_run_dir(run_dir, failing_spec(gpus=gpus, hours=3.0)), copies)
        return
    specs = [failing_spec(gpus=gpus, hours=3.0, failing_gpu=3 if node == 1 else None, seed=node)
             for node in range(nodes)]
    for folder in write_nodes_run_dir(run_dir, specs):
        repeat_csv(runfiles.metrics_csv_path(folder), copies)


def generate(run_dir: Path, nodes: int, gpus: int, copies: int) -> None:
    """Write the trace in a child process: the memory it takes must not count against the
    analyze processes, which Linux would otherwise charge via fork (ru_maxrss is inherited)."""
    child = multiprocessing.get_context("spawn").Process(target=write_trace,
                                                         args=(run_dir, nodes, gpus, copies))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit("generating the trace failed")


def prepare(tmp: Path, nodes: int, gpus: int, copies: int) -> Path:
    """A generated run of ``nodes`` x ``gpus``; prints its size."""
    start = time.perf_counter()
    run_dir = tmp / f"run_{nodes}x{gpus}"
    generate(run_dir, nodes, gpus, copies)
    csvs = list(run_dir.glob("node_*/gpu_metrics.csv")) or [runfiles.metrics_csv_path(run_dir)]
    rows = sum(sum(1 for _ in open(path)) - 1 for path in csvs)
    size = sum(path.stat().st_size for path in csvs) / 2**20
    print(f"generated {nodes} node(s) x {gpus} GPUs: {rows} rows ({size:.0f} MiB) in "
          f"{time.perf_counter() - start:.1f} s")
    return run_dir


def summarize(label: str, results: list[tuple[float, float]]) -> float:
    seconds = [r[0] for r in results]
    print(f"analyze {label}: median {statistics.median(seconds):.2f} s "
          f"(runs: {', '.join(f'{s:.2f}' for s in seconds)}), "
          f"peak RSS {max(r[1] for r in results):.0f} MiB")
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--week", action="store_true", help="a 7-day trace instead of 3 hours")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--nodes", type=int, default=1,
                        help="node folders; above 1, timed against one node of the same rows")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.nodes < 1 or args.gpus < 1:
        parser.error("--nodes and --gpus must be at least 1")
    copies = WEEK_COPIES if args.week else 1
    hours = 3 * copies
    with tempfile.TemporaryDirectory(prefix="analyze_speed.") as tmp:
        if args.nodes == 1:
            runs = {f"{args.gpus} GPUs x {hours} h": prepare(Path(tmp), 1, args.gpus, copies)}
        else:  # the same rows, merged from several nodes and on one
            runs = {f"{args.nodes} nodes x {args.gpus} GPUs x {hours} h":
                    prepare(Path(tmp), args.nodes, args.gpus, copies),
                    f"1 node x {args.nodes * args.gpus} GPUs x {hours} h":
                    prepare(Path(tmp), 1, args.nodes * args.gpus, copies)}
        results = {label: [] for label in runs}
        for repeat in range(args.repeats):  # interleaved, so that load on the host hits both
            for label, run_dir in runs.items():
                results[label].append(run_once(run_dir, run_dir.parent / f"out_{run_dir.name}_{repeat}"))
        medians = [summarize(label, timings) for label, timings in results.items()]
    if args.nodes > 1:
        pairs = [m[0] / s[0] for m, s in zip(*results.values())]
        print(f"{args.nodes} nodes against 1 node, same rows: {medians[0] / medians[1]:.2f}x the "
              f"median time (per interleaved pair: median {statistics.median(pairs):.2f}x)")


if __name__ == "__main__":
    main()
