"""Where a synchronous save's time goes, step by step, at several checkpoint sizes.

    .venv/bin/python benchmarks/save_profile.py [--hidden 256 512 1024] [--saves 4] [--tier disk]

For each model width (8 layers, 2 ranks at TP1 x PP2 as in ``memory_tier.py``: about 77 MB,
304 MB and 1.2 GB) the real trainer saves every iteration, synchronously, into the tier asked
for. Each save's event carries rank 0's wall time per step (``phases``: state dict,
preprocess, the fully parallel wrapper's metadata exchange, DCP planning, the writers from
fork to done, megatron-core's finalize (``.metadata``), the agreement, manifest and
tracker) and the writers' own time by kind (``writer_phases``: serialisation, write calls,
hashing, fsync), summed over the writer processes, which run in parallel.

Printed per size: the first save on its own line (it plans from scratch), for the memory tier
the second slot's set-up (its first save, at the second) on its own line too, then the medians
of the others (the refills); each step as a share of the time training was blocked, and each kind of writer
time as a share of the writers' summed time. ``wait`` is the share rank 0 spent waiting for
the last rank to enter the save (``waited_for_ranks_seconds``), inside its steps (mostly
``prep``: the structure's all-reduce).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ftmaster import runfiles  # noqa: E402
from helpers.trainer import run_trainer  # noqa: E402
from memory_tier import RANKS, SCHEDULE, SHM, model_args  # noqa: E402

STEPS = ("state-dict", "preprocess", "metadata-exchange", "planning", "write", "finalize",
         "agreement", "manifest-and-tracker")
WRITER_KINDS = ("serialisation", "writing", "hashing", "fsync")


def saves(hidden: int, count: int, tier: str, root: Path, shm: Path,
          extra: list[str]) -> list[dict]:
    save, run_dir = root / f"h{hidden}", root / f"run-h{hidden}"
    if tier == "disk":
        where = ["--save", str(save), "--save-interval", "1"]
    else:
        where = ["--save", str(save), "--save-interval", "100000", "--non-persistent-ckpt-type",
                 "global", "--non-persistent-global-ckpt-dir", str(shm / f"memory-h{hidden}"),
                 "--non-persistent-save-interval", "1"]
    result = run_trainer(RANKS, model_args(hidden) + SCHEDULE + where
                         + ["--train-iters", str(count + 1), *extra], timeout=3600,
                         FTMASTER_RUN_DIR=str(run_dir))
    assert result.returncode == 0, result.stdout[-3000:]
    return [e for e in runfiles.read_events(run_dir)
            if e["event"] == "periodic_save" and e["tier"] == tier and e["kind"] == "periodic"]


def line(label: str, events: list[dict]) -> str:
    blocked = statistics.median(e["seconds"] for e in events)
    steps = " ".join(f"{statistics.median(e['phases'].get(s, 0.0) for e in events) / blocked:6.1%}"
                     for s in STEPS)
    writers = [sum(e["writer_phases"][k] for k in WRITER_KINDS) for e in events]
    kinds = " ".join(f"{statistics.median(e['writer_phases'][k] / w for e, w in zip(events, writers)):6.1%}"
                     for k in WRITER_KINDS)
    size = statistics.median(e["bytes"] for e in events)
    wait = statistics.median(e.get("waited_for_ranks_seconds", 0.0) for e in events) / blocked
    return (f"{label:>7s} {size / 1e6:8.1f} {blocked:8.3f} {size / blocked / 1e6:7.0f}  {steps}"
            f" {wait:6.1%}  | {statistics.median(writers):6.2f} {kinds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--tier", choices=("disk", "memory"), default="disk")
    parser.add_argument("--constant-structure", action="store_true",
                        help="train with Megatron-LM's --ckpt-assume-constant-structure: no "
                             "fingerprint of the state's structure, nor its agreement, per save")
    options = parser.parse_args()
    short = {"state-dict": "state", "preprocess": "prep", "metadata-exchange": "exch",
             "planning": "plan", "write": "write", "finalize": "final", "agreement": "agree",
             "manifest-and-tracker": "manif"}
    print(f"{'save':>7s} {'MB':>8s} {'blocked':>8s} {'MB/s':>7s}  "
          + " ".join(f"{short[s]:>6s}" for s in STEPS) + f" {'wait':>6s}"
          + f"  | {'wrk s':>6s} " + " ".join(f"{k[:6]:>6s}" for k in WRITER_KINDS))
    with (tempfile.TemporaryDirectory(prefix="ftmaster-save-profile-") as tmp,
          tempfile.TemporaryDirectory(prefix="ftmaster-save-profile-", dir=SHM) as shm):
        for hidden in options.hidden:
            extra = ["--ckpt-assume-constant-structure"] if options.constant_structure else []
            found = saves(hidden, options.saves + 1, options.tier, Path(tmp), Path(shm), extra)
            print(line("first", found[:1]))
            # the memory tier's second slot is set up at the second save: not a refill
            set_ups = [e for e in found[1:] if e.get("slot") == "new"]
            if set_ups:
                print(line("set-up", set_ups))
            print(line("median", [e for e in found[1:] if e.get("slot", "refilled") == "refilled"]),
                  flush=True)


if __name__ == "__main__":
    main()
