"""A node lost on 2 nodes: recovered from a peer's copy in memory against from disk; and the
step time with peer copies on and off.

    .venv/bin/python benchmarks/multinode_memory.py [--repeats 3] [--keep-alive 1]

2 ftmaster nodes on loopback, 2 CPU ranks each, TP2 x PP2 (node 1 alone holds pipeline stage
1), 30 iterations:

- **memory**: the memory tier in node-local folders with peer copies, a save every 2
  iterations (``--non-persistent-save-interval 2``), none to disk before the end;
- **disk**: saves to ``--save`` every 2 iterations, no memory tier;
- **shared memory, no copies**: one memory folder both nodes name (the same /dev/shm, as on
  one host), so no copy is made: the step-time control for ``memory``.

Node 1's ftmaster is SIGKILLed once node 0 reached iteration 10. Printed: the medians of each
RTO phase on node 0 (``multinode_recovery.phases``), the iterations lost (the failure's
iteration less the one loaded), the tier loaded; and the median step time over iterations
4-9 of the first attempt (before the kill, as node 1's last stage logs it) for each mode,
as a ratio to the control.
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from multinode_recovery import PHASES, kill_node_1, phases  # noqa: E402
from ftmaster import runfiles  # noqa: E402
from ftmaster.recovery.argv_flags import flag_value  # noqa: E402
from helpers.launch import train_args  # noqa: E402
from helpers.trainer import iterations  # noqa: E402

MEMORY = ["--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "2"]
DIR_FLAG = "--non-persistent-global-ckpt-dir"


def mode_args(mode: str, root: Path) -> list[str]:
    save = root / "ckpt"
    if mode == "disk":
        return train_args(save, 30, 2, 2, 2)
    args = train_args(save, 30, 2, 2, 100, *MEMORY)
    if mode == "shared memory, no copies":
        args += ["--non-persistent-global-ckpt-dir", f"/dev/shm/ftmaster-bench-{uuid.uuid4().hex[:8]}"]
    return args


def memory_folders(root: Path) -> set[str]:
    """The memory folders both nodes' launches named (node 1's outlives its SIGKILL)."""
    return {flag_value(e["command"], DIR_FLAG) for node in (0, 1)
            for e in runfiles.read_events(root / "run" / f"node_{node}")
            if e["event"] == "launch" and flag_value(e["command"], DIR_FLAG)}


def one_run(mode: str, root: Path, keep_alive: int) -> dict:
    try:
        events, fault_at = kill_node_1(root, keep_alive, args=mode_args(mode, root))
    finally:
        for folder in memory_folders(root):
            shutil.rmtree(folder, ignore_errors=True)
    failure = next(e for e in events if e["event"] == "failure" and e["time"] >= fault_at)
    loaded = next(e for e in events if e["event"] == "checkpoint_loaded" and e["time"] >= fault_at)
    # the last pipeline stage logs the iterations: node 1's ranks in the first attempt
    steps = iterations((root / "run" / "node_1" / "logs" / "attempt_1.log").read_text())
    return {**phases(events, fault_at), "lost": failure["iteration"] - loaded["iteration"],
            "tier": loaded["tier"],
            "step_ms": statistics.median(steps[it]["elapsed_ms"] for it in range(4, 10) if it in steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep-alive", type=int, default=1)
    options = parser.parse_args()
    modes = ("memory", "disk", "shared memory, no copies")
    runs = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="ftmaster-multinode-memory-") as tmp:
        for repeat in range(options.repeats):
            for index, mode in enumerate(modes):
                runs[mode].append(one_run(mode, Path(tmp) / f"{index}-{repeat}", options.keep_alive))
                print(f"{mode}: {runs[mode][-1]}", flush=True)
    print(f"\n{'median':24s}" + "".join(f"{mode:>26s}" for mode in modes))
    for key in (*PHASES, "lost", "step_ms"):
        print(f"{key:24s}" + "".join(f"{statistics.median(r[key] for r in runs[m]):26.2f}"
                                     for m in modes))
    totals = {m: statistics.median(sum(r[p] for p in PHASES) for r in runs[m]) for m in modes}
    print(f"{'RTO total':24s}" + "".join(f"{totals[m]:26.2f}" for m in modes))
    print(f"tiers loaded: " + "; ".join(f"{m}: {[r['tier'] for r in runs[m]]}" for m in modes))
    control = statistics.median(r["step_ms"] for r in runs["shared memory, no copies"])
    print(f"step time, copies on / off: "
          f"{statistics.median(r['step_ms'] for r in runs['memory']) / control:.2f}")


if __name__ == "__main__":
    main()
