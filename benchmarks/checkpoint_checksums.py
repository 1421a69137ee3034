"""What checksums cost a save and a load, at several checkpoint sizes.

    .venv/bin/python benchmarks/checkpoint_checksums.py [--hidden 128 256 512] [--saves 5]

For each model width the real trainer (2 ranks, TP1 x PP2, CPU + gloo) saves every iteration,
then relaunches load the newest checkpoint. The trainer's own events give, per save, the
seconds its writer processes spent hashing (``checksum_seconds``: each file and each item in
it) and the seconds they spent writing from open to close (``writer_seconds``), both summed
over the same writers, and the save's wall time until durable. Printed: medians, and hashing
as a share of the writers' time and of the save's wall time (each writer hashes its own files
in parallel, so the wall-time share uses the hashing per writer).

Each checkpoint is then loaded twice: as written, each item checked as it is read, and from a
copy whose manifest has lost its item checksums, so every file is checked in full before the
load reads it again (how every load worked before items existed). For each: the bytes the
ranks read from the start of verification to the end of the load as the kernel counts them
(``rchar``, per byte of checkpoint), the verification pass and the whole load. Run as root,
the page cache is dropped before each load, so the load reads from the medium.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from ftmaster import runfiles  # noqa: E402
from ftmaster.recovery.manifest import read_manifest, write_manifest  # noqa: E402
from helpers.trainer import SMALL_GPT, layout_args, run_trainer  # noqa: E402

RANKS = 2


def model_args(hidden: int) -> list[str]:
    args = list(SMALL_GPT)
    args[args.index("--hidden-size") + 1] = str(hidden)
    return args + ["--num-layers", "8", "--ffn-hidden-size", str(4 * hidden)]


def events(run_dir: Path, *names: str) -> list[dict]:
    return [e for e in runfiles.read_events(run_dir) if e["event"] in names]


def trainer_args(hidden: int, save: Path, saves: int) -> list[str]:
    return model_args(hidden) + layout_args(1, RANKS) + [
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--override-opt-param-scheduler", "--save", str(save), "--save-interval", "1",
        "--train-iters", str(saves)]


def measure(hidden: int, saves: int, root: Path) -> dict:
    save, run_dir = root / f"h{hidden}", root / f"run{hidden}"
    trained = run_trainer(RANKS, trainer_args(hidden, save, saves), timeout=1800,
                          FTMASTER_RUN_DIR=str(run_dir))
    assert trained.returncode == 0, trained.stdout[-2000:]
    done = events(run_dir, "periodic_save", "emergency_save")
    writers = len(list((save / f"iter_{saves:07d}").glob("*.distcp")))
    files_only = root / f"h{hidden}-files-first"
    shutil.copytree(save, files_only)
    newest = files_only / f"iter_{saves:07d}"
    manifest = read_manifest(newest)
    write_manifest(newest, manifest.kind, manifest.iteration, manifest.files)
    loads = {how: load(trainer_args(hidden, folder, saves) + ["--load", str(folder)],
                       root / f"run{hidden}-{folder.name}")
             for how, folder in (("on read", save), ("files first", files_only))}
    return {
        "bytes": statistics.median(e["bytes"] for e in done),
        "save_s": statistics.median(e["persist_seconds"] for e in done),
        "hash_s": statistics.median(e["checksum_seconds"] for e in done),
        "writer_share": statistics.median(e["checksum_seconds"] / e["writer_seconds"] for e in done),
        "wall_share": statistics.median(e["checksum_seconds"] / writers / e["persist_seconds"]
                                        for e in done),
        "loads": loads,
    }


def load(args: list[str], run_dir: Path) -> dict:
    if not drop_page_cache():
        print("(not root: the page cache is kept, loads may read from memory)", file=sys.stderr)
    loaded = run_trainer(RANKS, args, timeout=1800, FTMASTER_RUN_DIR=str(run_dir))
    assert loaded.returncode == 0, loaded.stdout[-2000:]
    (event,) = events(run_dir, "checkpoint_loaded")
    return event


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--saves", type=int, default=5)
    options = parser.parse_args()
    print(f"{'checkpoint':>11s} {'save s':>8s} {'hash s':>8s} {'of writers':>10s} "
          f"{'of save':>8s}   load: {'checked':>11s} {'read/size':>9s} {'verify s':>9s} "
          f"{'load s':>7s}")
    with tempfile.TemporaryDirectory(prefix="ftmaster-checksums-") as tmp:
        for hidden in options.hidden:
            m = measure(hidden, options.saves, Path(tmp))
            print(f"{m['bytes'] / 1e6:8.1f} MB {m['save_s']:8.3f} {m['hash_s']:8.4f} "
                  f"{m['writer_share']:10.2%} {m['wall_share']:8.2%}")
            for how, e in m["loads"].items():
                print(f"{'':>54s}{how:>11s} {e['read_bytes'] / e['bytes']:9.2f} "
                      f"{e['verify_seconds']:9.3f} {e['seconds']:7.3f}")


if __name__ == "__main__":
    main()
