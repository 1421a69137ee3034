"""Recovery time of ``ftmaster launch`` against a cold start, on the real trainer (CPU + gloo).

    .venv/bin/python benchmarks/recovery_time.py [--repeats 3] [--fail-at 12] [--save-interval 5]

Each repeat runs the small test GPT at TP2 x PP2 on 4 ranks with periodic checkpoints, kills
the rank on GPU 1 (``--inject fail:gpu=1,at=iter:K``) and lets ftmaster recover on 3 GPUs.
Phases, from ``events.jsonl`` and from the moment the benchmark sees the relaunch's log line
``loaded checkpoint`` (polled every 20 ms):

    kill ─detect─> failure ─plan─> plan ─relaunch─> launch ─start+load─> loaded ─first─> resumed

A cold start is a fresh launch (no checkpoint) of the layout the relaunch uses (TP1 x PP1 x
DP3 on 3 ranks): its ``launch`` event to its first heartbeat. Lost iterations per failure are
the iteration at the failure minus the iteration of the checkpoint the relaunch loaded.
Prints the median of every phase, the cold start, their ratio and the lost iterations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from ftmaster import runfiles  # noqa: E402
from helpers.launch import events, launch_argv, train_args  # noqa: E402
from helpers.trainer import REPO, trainer_env  # noqa: E402

POLL_S = 0.02
PHASES = ("detect", "plan", "relaunch", "start_and_load", "first_iteration", "total")


def run_watching(argv: list[str], run_dir: Path, log_needle: str, attempt: int) -> dict:
    """Run ftmaster to its end; returns when ``log_needle`` first showed in the attempt log
    and the first heartbeat time seen for that attempt."""
    seen: dict = {}
    log = runfiles.logs_dir(run_dir) / f"attempt_{attempt}.log"
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=trainer_env(), cwd=REPO)
    while process.poll() is None:
        if "loaded" not in seen and log.exists() and log_needle in log.read_text(errors="replace"):
            seen["loaded"] = time.time()
        heartbeat = runfiles.read_heartbeat(run_dir)
        if "first_heartbeat" not in seen and heartbeat and log.exists():
            seen["first_heartbeat"] = heartbeat["time"]
        time.sleep(POLL_S)
    if process.returncode != 0:
        raise SystemExit(f"ftmaster exited {process.returncode}; see {run_dir}")
    return seen


def one_recovery(workdir: Path, fail_at: int, save_interval: int, iters: int) -> dict:
    run_dir = workdir / "run"
    argv = launch_argv(run_dir, 4, train_args(workdir / "ckpt", iters, 2, 2, save_interval),
                       "--inject", f"fail:gpu=1,at=iter:{fail_at}")
    seen = run_watching(argv, run_dir, "loaded checkpoint", attempt=2)
    (injected,), (failure,), (plan,) = (events(run_dir, n) for n in ("fault_injected", "failure", "plan"))
    relaunch, (resumed,) = events(run_dir, "launch")[1], events(run_dir, "resumed")
    return {
        "detect": failure["time"] - injected["time"],
        "plan": plan["time"] - failure["time"],
        "relaunch": relaunch["time"] - plan["time"],
        "start_and_load": seen["loaded"] - relaunch["time"],
        "first_iteration": resumed["time"] - seen["loaded"],
        "total": resumed["time"] - injected["time"],
        "relaunch_to_first_iteration": resumed["time"] - relaunch["time"],
        "lost_iterations": failure["iteration"] - (resumed["iteration"] - 1),
    }


def one_cold_start(workdir: Path, iters: int) -> float:
    run_dir = workdir / "run"
    argv = launch_argv(run_dir, 3, train_args(workdir / "ckpt", iters, 1, 1, 1000))
    seen = run_watching(argv, run_dir, "training from iteration", attempt=1)
    return seen["first_heartbeat"] - events(run_dir, "launch")[0]["time"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fail-at", type=int, default=12)
    parser.add_argument("--save-interval", type=int, default=5)
    parser.add_argument("--iters", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="also write the samples as JSON")
    args = parser.parse_args()
    recoveries, colds = [], []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="ftm-recovery-") as tmp:
            recoveries.append(one_recovery(Path(tmp), args.fail_at, args.save_interval, args.iters))
        with tempfile.TemporaryDirectory(prefix="ftm-cold-") as tmp:
            colds.append(one_cold_start(Path(tmp), 3))
        print(f"repeat {repeat + 1}: recovery {recoveries[-1]['total']:.1f} s, "
              f"cold start {colds[-1]:.1f} s", flush=True)
    medians = {key: statistics.median(r[key] for r in recoveries) for key in recoveries[0]}
    cold = statistics.median(colds)
    for phase in PHASES + ("relaunch_to_first_iteration",):
        print(f"{phase:28s} {medians[phase]:8.2f} s")
    print(f"{'cold start (3 ranks)':28s} {cold:8.2f} s")
    print(f"{'recovery / cold start':28s} {medians['total'] / cold:8.2f}")
    print(f"{'lost iterations per failure':28s} {medians['lost_iterations']:8.1f}")
    if args.out:
        args.out.write_text(json.dumps({"recoveries": recoveries, "cold_starts": colds,
                                        "medians": medians, "cold_start": cold}, indent=2))


if __name__ == "__main__":
    main()
