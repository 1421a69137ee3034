"""Emergency-save costs, measured on the real trainer (CPU + gloo here; CUDA + NCCL on GPUs).

    .venv/bin/python benchmarks/emergency_save.py [--nproc 2] [--hidden 256] [--repeats 3]

Prints medians for:
1. step time with nothing watched (no run directory, no signal handler), with the
   save-request check alone (a flag folder), and with the check plus the run directory's
   heartbeat, as under ftmaster, in alternating runs (no request is made);
2. iterations and seconds from writing ``save_now.flag`` to the start of the save;
3. seconds training is blocked by a sync and by an async save, and the write throughput
   (bytes / seconds until durable) against this disk's sequential fsync'd write speed.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from ftmaster import runfiles  # noqa: E402
from helpers.trainer import iterations, kill_session, run_trainer, start_trainer, wait_until  # noqa: E402


def model_args(args) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", str(args.hidden), "--num-attention-heads", "8",
            "--seq-length", "128", "--mock-data", "--vocab-size", "1000",
            "--pipeline-model-parallel-size", str(args.nproc), "--micro-batch-size", "2",
            "--global-batch-size", "8", "--lr", "1e-4", "--log-interval", "1",
            "--eval-iters", "0"]


def median_step_ms(log: str, skip: int) -> float:
    logged = iterations(log)
    return statistics.median(entry["elapsed_ms"] for it, entry in logged.items() if it > skip)


def overhead_modes(work: Path, repeat: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Per mode, the extra arguments and environment: nothing watched; the save-request check
    alone (a flag folder, no run directory); the check plus the run directory's per-iteration
    heartbeat, as under ftmaster."""
    return {
        "disabled": ([], {}),
        "check": (["--emergency-save-flag-dir", str(work / f"flags_{repeat}")], {}),
        "check+heartbeat": ([], {"FTMASTER_RUN_DIR": str(work / f"run_{repeat}")}),
    }


def check_overhead(args, work: Path) -> None:
    """Each repeat runs every mode once, in a shuffled order; the ratio to the unwatched run of
    the same repeat pairs away the slow drift of a shared machine, and the spread of those
    ratios shows how far this machine can resolve a difference at all."""
    base = model_args(args) + ["--train-iters", str(args.iters)]
    order, timings, check_us = random.Random(0), [], []
    for repeat in range(args.repeats):
        modes = list(overhead_modes(work, repeat).items())
        order.shuffle(modes)
        steps = {}
        for mode, (extra, env) in modes:
            result = run_trainer(args.nproc, base + extra, timeout=900, **env)
            assert result.returncode == 0, result.stdout[-2000:]
            steps[mode] = median_step_ms(result.stdout, skip=5)
            measured = re.search(r"save-request check: median ([\d.]+) us", result.stdout)
            if measured:
                check_us.append(float(measured.group(1)))
        timings.append(steps)
        print(f"  repeat {repeat}: " + ", ".join(f"{m} {steps[m]:.1f} ms" for m, _ in modes), flush=True)
    disabled = statistics.median(t["disabled"] for t in timings)
    print(f"step time, nothing watched: median {disabled:.2f} ms over {args.repeats} runs")
    for mode in [m for m in timings[0] if m != "disabled"]:
        ratios = sorted(t[mode] / t["disabled"] for t in timings)
        quartiles = statistics.quantiles(ratios, n=4)
        print(f"  {mode}: median paired ratio {statistics.median(ratios):.4f} "
              f"({(statistics.median(ratios) - 1) * 100:+.2f}%), quartiles "
              f"{(quartiles[0] - 1) * 100:+.2f}% .. {(quartiles[2] - 1) * 100:+.2f}%")
    check = statistics.median(check_us)
    print(f"the check itself (stat + overlapped gloo all-reduce, timed in the loop): median "
          f"{check:.1f} us per iteration = {check / 1000 / disabled * 100:.3f}% of a step")


def save_runs(args, work: Path, async_save: bool) -> list[dict]:
    """Drop ``repeats`` flags into one run; returns per request: latency and save costs."""
    tag = "async" if async_save else "sync"
    run_dir, save, log = work / f"run_{tag}", work / f"save_{tag}", work / f"{tag}.log"
    extra = ["--save", str(save), "--emergency-save-gap-frac", "0", "--train-iters", "100000"]
    process = start_trainer(args.nproc, model_args(args) + extra + (["--async-save"] if async_save else []),
                            log, FTMASTER_RUN_DIR=str(run_dir))
    results = []
    try:
        for request in range(args.repeats):
            results.append(one_request(run_dir, request, 8 + 12 * request))
    finally:
        kill_session(process)
    return results


def one_request(run_dir: Path, request: int, at_iteration: int) -> dict:
    beat = lambda: (runfiles.read_heartbeat(run_dir) or {}).get("iteration", 0)  # noqa: E731
    wait_until(lambda: beat() >= at_iteration, 600, what=f"iteration {at_iteration}")
    seen_at, written = beat(), time.time()
    runfiles.write_flag(runfiles.save_now_flag_path(run_dir), source="benchmark", request=request)
    event = wait_until(lambda: [e for e in runfiles.read_events(run_dir)
                                if e["event"] == "emergency_save" and e["started_at"] >= written],
                       600, what="the emergency save")[0]
    return {"iterations": event["iteration"] - seen_at, "latency_s": event["started_at"] - written,
            "blocked_s": event["seconds"], "durable_s": event["persist_seconds"],
            "bytes": event["bytes"]}


def fsynced_write_speed(path: Path, size: float, block_bytes: int = 1 << 20) -> float:
    """One sequential write of ``size`` bytes into ``path``, fsynced, in bytes per second."""
    block = os.urandom(block_bytes)
    blocks = max(1, int(size) // len(block))
    start = time.perf_counter()
    with open(path, "wb") as handle:
        for _ in range(blocks):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    return blocks * len(block) / (time.perf_counter() - start)


def disk_write_speed(directory: Path, size: float) -> float:
    """Sequential write of ``size`` bytes with fsync, in bytes per second (median of 3)."""
    speeds = []
    for _ in range(3):
        speeds.append(fsynced_write_speed(directory / "ddtest.bin", size))
        (directory / "ddtest.bin").unlink()
    return statistics.median(speeds)


def report_saves(name: str, results: list[dict]) -> float:
    med = {key: statistics.median(r[key] for r in results) for key in results[0]}
    throughput = med["bytes"] / med["durable_s"]
    print(f"{name}: flag -> save start {med['iterations']:.0f} iterations, "
          f"{med['latency_s']:.3f} s; blocked {med['blocked_s']:.3f} s; durable after "
          f"{med['durable_s']:.3f} s; {med['bytes'] / 1e6:.1f} MB at {throughput / 1e6:.1f} MB/s")
    return med["bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3,
                        help="overhead repeats (each runs every mode) and emergency saves per mode")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftmaster-bench-") as tmp:
        work = Path(tmp)
        print(f"== check overhead ({args.repeats} alternating runs of {args.iters} iterations, "
              f"PP{args.nproc}, hidden {args.hidden}) ==", flush=True)
        check_overhead(args, work)
        print("== emergency saves ==", flush=True)
        size = report_saves("sync ", save_runs(args, work, async_save=False))
        report_saves("async", save_runs(args, work, async_save=True))
        print(f"disk sequential write (fsync) of {size / 1e6:.1f} MB: "
              f"{disk_write_speed(work, size) / 1e6:.1f} MB/s")


if __name__ == "__main__":
    main()
