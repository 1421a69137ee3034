"""Emergency-save costs, measured on the real trainer (CPU + gloo here; CUDA + NCCL on GPUs).

    .venv/bin/python benchmarks/emergency_save.py [--nproc 2] [--hidden 256] [--repeats 3]

Prints medians for:
1. step time with the save-request check enabled (run directory set, no flag) against the
   check disabled (no run directory, no signal handler), in alternating runs;
2. iterations and seconds from writing ``save_now.flag`` to the start of the save;
3. seconds training is blocked by a sync and by an async save, and the write throughput
   (bytes / seconds until durable) against this disk's sequential fsync'd write speed.
"""

from __future__ import annotations

import argparse
import os
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


def check_overhead(args, work: Path) -> None:
    base = model_args(args) + ["--train-iters", str(args.iters)]
    timings, check_us = {"disabled": [], "enabled": []}, []
    for repeat in range(args.repeats):
        for mode in ("disabled", "enabled"):
            env = {"FTMASTER_RUN_DIR": str(work / f"run_{mode}_{repeat}")} if mode == "enabled" else {}
            result = run_trainer(args.nproc, base, timeout=900, **env)
            assert result.returncode == 0, result.stdout[-2000:]
            timings[mode].append(median_step_ms(result.stdout, skip=5))
            measured = re.search(r"save-request check: median ([\d.]+) us", result.stdout)
            if measured:
                check_us.append(float(measured.group(1)))
            print(f"  {mode:8s} run {repeat}: median step {timings[mode][-1]:.2f} ms", flush=True)
    disabled, enabled = (statistics.median(timings[m]) for m in ("disabled", "enabled"))
    check = statistics.median(check_us)
    print(f"step time, check disabled: {disabled:.2f} ms; enabled (no request): {enabled:.2f} ms;"
          f" ratio {enabled / disabled:.4f} ({(enabled / disabled - 1) * 100:+.2f}%)")
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


def disk_write_speed(directory: Path, size: int) -> float:
    """Sequential write of ``size`` bytes with fsync, in bytes per second (median of 3)."""
    block = os.urandom(1 << 20)
    speeds = []
    for _ in range(3):
        path = directory / "ddtest.bin"
        start = time.perf_counter()
        with open(path, "wb") as handle:
            for _ in range(max(1, size // len(block))):
                handle.write(block)
            handle.flush()
            os.fsync(handle.fileno())
        speeds.append(max(1, size // len(block)) * len(block) / (time.perf_counter() - start))
        path.unlink()
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
    parser.add_argument("--repeats", type=int, default=3)
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
