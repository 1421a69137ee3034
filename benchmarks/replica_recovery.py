"""Recovery from surviving replicas against recovery from the newest checkpoint: iterations
lost (RPO) and the time from the fault to the first resumed iteration (RTO), in phases.

    .venv/bin/python benchmarks/replica_recovery.py [--repeats 3] [--save-interval 10] [--hidden 64]

The same job both ways: 4 CPU ranks, TP1 x PP2 x DP2, 20 iterations, the memory tier on,
``--inject fail:gpu=1,at=iter:16``; the relaunch runs on the 3 GPUs left.

- **replicas**: ``--replica-recovery``, ``--save-interval 100`` (no checkpoint before the fault);
- **checkpoint**: ``--save-interval N`` (default 10), no replica recovery.

Phases, from ftmaster's events: detection (fault -> ``failure``), dump (-> ``replica_dump``:
asking the survivors and waiting for their reports), merge (-> ``replica_merge``: the kill of
the old attempt, then the merge in a fresh interpreter), plan (-> ``plan``), launch
(-> ``launch``), start and load (-> ``checkpoint_loaded``), first iteration (-> ``resumed``).
Lost iterations: the failure's last completed iteration minus the one loaded (never below 0).
Medians over the repeats.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from ftmaster import runfiles  # noqa: E402
from helpers.launch import run_launch, train_args  # noqa: E402

PHASES = ("detection", "dump", "merge", "plan", "launch", "start and load", "first iteration")


def first_after(events: list[dict], name: str, after: float) -> dict | None:
    return next((e for e in events if e["event"] == name and e["time"] >= after), None)


def measure(events: list[dict]) -> dict[str, float]:
    fault = first_after(events, "fault_injected", 0)
    failure = first_after(events, "failure", fault["time"])
    marks = [fault, failure]
    for name in ("replica_dump", "replica_merge", "plan", "launch", "checkpoint_loaded", "resumed"):
        marks.append(first_after(events, name, failure["time"]) or marks[-1])  # absent: 0 s
    timings = dict(zip(PHASES, (b["time"] - a["time"] for a, b in zip(marks, marks[1:]))))
    loaded = first_after(events, "checkpoint_loaded", failure["time"])
    timings["lost iterations"] = max(0, failure["iteration"] - loaded["iteration"])
    dumped = first_after(events, "replica_dump", failure["time"])
    timings["dumped MB"] = (dumped or {}).get("bytes", 0) / 1e6
    return timings


def run(root: Path, replicas: bool, save_interval: int, hidden: int) -> dict[str, float]:
    memory = ["--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir",
              str(root / "memory")]
    extra = [*memory, "--replica-recovery"] if replicas else memory
    args = train_args(root / "ckpt", 20, 1, 2, 100 if replicas else save_interval, *extra,
                      "--seed", "4", global_batch=8)
    args[args.index("--hidden-size") + 1] = str(hidden)
    result = run_launch(root / "run", 4, args, "--inject", "fail:gpu=1,at=iter:16")
    assert result.returncode == 0, result.stdout[-3000:]
    return measure(runfiles.read_events(root / "run"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save-interval", type=int, default=10,
                        help="the checkpoint recovery's --save-interval")
    parser.add_argument("--hidden", type=int, default=64, help="--hidden-size of the model")
    options = parser.parse_args()
    runs = {"replicas": [], "checkpoint": []}
    with tempfile.TemporaryDirectory(prefix="ftmaster-replicas-") as tmp:
        for repeat in range(options.repeats):
            for name in runs:
                root = Path(tmp) / f"{name}{repeat}"
                runs[name].append(run(root, name == "replicas", options.save_interval, options.hidden))
    rows = [*PHASES, "lost iterations", "dumped MB"]
    medians = {name: {row: statistics.median(r[row] for r in rs) for row in rows}
               for name, rs in runs.items()}
    print(f"{'median':20s} {'replicas':>10s} {'checkpoint':>10s}")
    for row in rows:
        print(f"{row:20s} {medians['replicas'][row]:10.2f} {medians['checkpoint'][row]:10.2f}")
    totals = {name: sum(m[p] for p in PHASES) for name, m in medians.items()}
    print(f"{'RTO from the fault':20s} {totals['replicas']:10.2f} {totals['checkpoint']:10.2f}")
    print(f"replicas / checkpoint RTO: {totals['replicas'] / totals['checkpoint']:.2f} "
          f"({options.repeats} repeats, checkpoint every {options.save_interval} iterations, "
          f"hidden {options.hidden})")


if __name__ == "__main__":
    main()
