"""Node loss against GPU loss: the time from the fault to the first resumed iteration, in phases.

    .venv/bin/python benchmarks/multinode_recovery.py [--repeats 3] [--keep-alive 1]

- **node loss**: 2 ftmaster nodes on loopback (2 CPU ranks each, TP2 x PP1 x DP2, c10d
  rendezvous); node 1's ftmaster is SIGKILLed at iteration 10 (its ranks die with it); node 0
  replans on its own 2 GPUs (TP2 x DP1).
- **GPU loss**: one ftmaster with 4 ranks, the same job; ``--inject fail:gpu=3,at=iter:10``.

Phases, from the surviving node's events: detection (fault -> ``failure``), rendezvous
(``failure`` -> ``round``: the join, which waits for the dead node's keep-alive to expire and
the last call; none on one node), plan (-> ``plan``), launch (-> ``launch``), start and load
(-> ``checkpoint_loaded``: processes, imports, the load), first iteration (-> ``resumed``).
Medians over the repeats, and node loss / GPU loss as a ratio.
"""

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from ftmaster import runfiles  # noqa: E402
from helpers.launch import run_launch, train_args  # noqa: E402
from helpers.multinode import Nodes  # noqa: E402
from helpers.trainer import wait_until  # noqa: E402

PHASES = ("detection", "rendezvous", "plan", "launch", "start and load", "first iteration")


def first_after(events: list[dict], name: str, after: float) -> float:
    return next(e["time"] for e in events if e["event"] == name and e["time"] >= after)


def phases(events: list[dict], fault_at: float) -> dict[str, float]:
    failure = first_after(events, "failure", fault_at)
    joined = next((e["time"] for e in events if e["event"] == "round" and e["time"] >= failure),
                  failure)
    marks = [fault_at, failure, joined, first_after(events, "plan", failure),
             first_after(events, "launch", failure), first_after(events, "checkpoint_loaded", failure),
             first_after(events, "resumed", failure)]
    return dict(zip(PHASES, (b - a for a, b in zip(marks, marks[1:]))))


def kill_node_1(root: Path, keep_alive: int, *options: str,
                ready: Callable[[Nodes], bool] = lambda nodes: True,
                args: list[str] | None = None) -> tuple[list[dict], float]:
    """2 nodes x 2 ranks at TP2 (or ``args``); node 1 SIGKILLed after iteration 10 (and once
    ``ready``); node 0's events once it finished alone, and the kill's time."""
    root.mkdir(parents=True)
    conf = (f"last_call_timeout=2,keep_alive_interval={keep_alive},keep_alive_max_attempt=3,"
            "join_timeout=120")
    nodes = Nodes(root, 2, args or train_args(root / "ckpt", 30, 2, 1, 5), *options, conf=conf)
    try:
        nodes.start_all(2)
        wait_until(lambda: nodes.iteration(0) >= 10 and ready(nodes), timeout=600, interval=0.05,
                   what="iteration 10")
        fault_at = time.time()
        os.kill(nodes.processes[1].pid, signal.SIGKILL)
        assert nodes.wait(0) == 0, nodes.output(0)[-3000:]
    finally:
        nodes.kill_all()
    return runfiles.read_events(nodes.node_dir(0)), fault_at


def node_loss(root: Path, keep_alive: int) -> dict[str, float]:
    return phases(*kill_node_1(root, keep_alive))


def gpu_loss(root: Path) -> dict[str, float]:
    root.mkdir(parents=True)
    run_dir = root / "run"
    result = run_launch(run_dir, 4, train_args(root / "ckpt", 30, 2, 1, 5),
                        "--inject", "fail:gpu=3,at=iter:10")
    assert result.returncode == 0, result.stdout[-3000:]
    events = runfiles.read_events(run_dir)
    fault_at = next(e["time"] for e in events if e["event"] == "fault_injected")
    return phases(events, fault_at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep-alive", type=int, default=1,
                        help="keep_alive_interval (s); a dead node is dropped after 3 of them")
    options = parser.parse_args()
    runs = {"node loss": [], "GPU loss": []}
    with tempfile.TemporaryDirectory(prefix="ftmaster-multinode-") as tmp:
        for repeat in range(options.repeats):
            runs["node loss"].append(node_loss(Path(tmp) / f"node{repeat}", options.keep_alive))
            runs["GPU loss"].append(gpu_loss(Path(tmp) / f"gpu{repeat}"))
    medians = {name: {p: statistics.median(r[p] for r in rs) for p in PHASES}
               for name, rs in runs.items()}
    print(f"{'phase (median s)':20s} {'node loss':>10s} {'GPU loss':>10s}")
    for phase in PHASES:
        print(f"{phase:20s} {medians['node loss'][phase]:10.2f} {medians['GPU loss'][phase]:10.2f}")
    totals = {name: sum(m.values()) for name, m in medians.items()}
    print(f"{'total':20s} {totals['node loss']:10.2f} {totals['GPU loss']:10.2f}")
    print(f"node loss / GPU loss: {totals['node loss'] / totals['GPU loss']:.2f} "
          f"(keep_alive_interval {options.keep_alive} s, {options.repeats} repeats)")


if __name__ == "__main__":
    main()
