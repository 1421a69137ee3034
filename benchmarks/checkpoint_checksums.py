"""What checksums cost a save and a load, at several checkpoint sizes.

    .venv/bin/python benchmarks/checkpoint_checksums.py [--hidden 128 256 512] [--saves 5]

For each model width the real trainer (2 ranks, TP1 x PP2, CPU + gloo) saves every iteration,
then a relaunch loads the newest checkpoint. The trainer's own events give, per save, the
seconds its writer processes spent hashing (``checksum_seconds``) and the seconds they spent
writing from open to close (``writer_seconds``), both summed over the same writers, and the
save's wall time until durable; per load, the seconds spent verifying every file's checksum
(spread over the ranks) against the whole load. Printed: medians, and hashing as a share of
the writers' time and of the save's wall time (each writer hashes its own files in parallel,
so the wall-time share uses the hashing per writer).
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from ftmaster import runfiles  # noqa: E402
from helpers.trainer import SMALL_GPT, layout_args, run_trainer  # noqa: E402

RANKS = 2


def model_args(hidden: int) -> list[str]:
    args = list(SMALL_GPT)
    args[args.index("--hidden-size") + 1] = str(hidden)
    return args + ["--num-layers", "8", "--ffn-hidden-size", str(4 * hidden)]


def events(run_dir: Path, *names: str) -> list[dict]:
    return [e for e in runfiles.read_events(run_dir) if e["event"] in names]


def measure(hidden: int, saves: int, root: Path) -> dict:
    save, run_dir = root / f"h{hidden}", root / f"run{hidden}"
    schedule = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
                "--override-opt-param-scheduler", "--save", str(save), "--save-interval", "1"]
    env = {"FTMASTER_RUN_DIR": str(run_dir)}
    trained = run_trainer(RANKS, model_args(hidden) + layout_args(1, RANKS) + schedule
                          + ["--train-iters", str(saves)], timeout=1800, **env)
    assert trained.returncode == 0, trained.stdout[-2000:]
    loaded = run_trainer(RANKS, model_args(hidden) + layout_args(1, RANKS) + schedule
                         + ["--train-iters", str(saves), "--load", str(save)], timeout=1800, **env)
    assert loaded.returncode == 0, loaded.stdout[-2000:]
    done = events(run_dir, "periodic_save", "emergency_save")
    (load,) = events(run_dir, "checkpoint_loaded")
    writers = len(list((save / f"iter_{saves:07d}").glob("*.distcp")))
    hashing = [e["checksum_seconds"] for e in done]
    return {
        "bytes": statistics.median(e["bytes"] for e in done),
        "save_s": statistics.median(e["persist_seconds"] for e in done),
        "hash_s": statistics.median(hashing),
        "writer_share": statistics.median(e["checksum_seconds"] / e["writer_seconds"] for e in done),
        "wall_share": statistics.median(e["checksum_seconds"] / writers / e["persist_seconds"]
                                        for e in done),
        "verify_s": load["verify_seconds"], "load_s": load["seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--saves", type=int, default=5)
    options = parser.parse_args()
    print(f"{'checkpoint':>11s} {'save s':>8s} {'hash s':>8s} {'of writers':>10s} "
          f"{'of save':>8s} {'verify s':>9s} {'load s':>7s} {'of load':>8s}")
    with tempfile.TemporaryDirectory(prefix="ftmaster-checksums-") as tmp:
        for hidden in options.hidden:
            m = measure(hidden, options.saves, Path(tmp))
            print(f"{m['bytes'] / 1e6:8.1f} MB {m['save_s']:8.3f} {m['hash_s']:8.4f} "
                  f"{m['writer_share']:10.2%} {m['wall_share']:8.2%} {m['verify_s']:9.3f} "
                  f"{m['load_s']:7.3f} {m['verify_s'] / m['load_s']:8.1%}")


if __name__ == "__main__":
    main()
