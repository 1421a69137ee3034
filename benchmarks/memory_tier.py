"""The memory tier against disk, on the real trainer (2 ranks, TP1 x PP2, CPU + gloo).

    .venv/bin/python benchmarks/memory_tier.py [--hidden 256 512 1024] [--saves 6]

For each model width (8 layers: about 77 MB, 304 MB and 1.2 GB of checkpoint) the trainer
saves every other iteration into one tier, synchronously and with ``--async-save`` (a memory
save is synchronous either way: its copy is the snapshot): the trainer's own events give the
seconds training was blocked and the seconds until the checkpoint was complete. Then a
relaunch loads the newest checkpoint of each tier, and ftmaster's persister copies the newest
memory checkpoint to disk as the supervisor does.

Printed per size, measured just before it: this machine's memcpy (one thread, of 512 MB, and
of the checkpoint's size: the shares are of the first, the goal's reference), its write into
/dev/shm and its fsync'd sequential write to the save disk: one file (the disk's burst rate
on this VM), checkpoint-sized files kept, the same written as a sync save writes them, and
the rate the disk sustains over 8 GB. Then per tier and mode: the
first save of the attempt on its own line (it plans, and a memory save sets its slot up),
the memory tier's other set-up (the second slot's first save), and the medians of the rest;
each as a share of memcpy and of the medium's write rate. Two ranks save in parallel, so a
share of the one-thread memcpy can pass 1. Blocked is rank 0's wall time: it includes rank
0's wait for the other pipeline stage to finish its step and enter the save (the events'
``waited_for_ranks_seconds``), which is also given taken out. A sync disk save's blocked
rates are also listed one by one: on this VM's disk some run at the burst rate, others at
the sustained one.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from emergency_save import disk_write_speed, fsynced_write_speed  # noqa: E402
from ftmaster import runfiles  # noqa: E402
from ftmaster.persist import persist  # noqa: E402
from ftmaster.recovery.checkpoints import read_tracker  # noqa: E402
from ftmaster.recovery.writeback import Writeback  # noqa: E402
from helpers.trainer import SMALL_GPT, layout_args, run_trainer  # noqa: E402

RANKS = 2
SHM = Path("/dev/shm")
SCRATCH_PREFIX = ".memory-tier-bench-"
"""The disk scratch folder's name in the checkout (ignored by git)."""
SCHEDULE = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
            "--override-opt-param-scheduler"]
MODES = [("disk", False), ("disk", True), ("memory", False), ("memory", True)]
CHECKPOINT_BYTES = {256: 77_000_000, 512: 304_300_000, 1024: 1_211_900_000}  # measured


def model_args(hidden: int) -> list[str]:
    args = list(SMALL_GPT)
    args[args.index("--hidden-size") + 1] = str(hidden)
    return args + ["--num-layers", "8", "--ffn-hidden-size", str(4 * hidden)] + layout_args(1, RANKS)


def tier_args(tier: str, save: Path, memory: Path) -> list[str]:
    if tier == "disk":
        return ["--save", str(save), "--save-interval", "2"]
    return ["--save", str(save), "--save-interval", "100000", "--non-persistent-ckpt-type",
            "global", "--non-persistent-global-ckpt-dir", str(memory),
            "--non-persistent-save-interval", "2"]


def saves_of(hidden: int, tier: str, async_save: bool, saves: int, root: Path,
             memory: Path) -> list[dict]:
    """The saves into ``tier`` of one run; the last iteration's (final, on disk) is left out."""
    tag = f"h{hidden}-{tier}-{'async' if async_save else 'sync'}"
    os.sync()  # the previous run's disk writes flushed first: their writeback takes a core here
    save, run_dir = root / tag, root / f"run-{tag}"
    schedule = SCHEDULE + ["--train-iters", str(2 * saves + 1)]
    result = run_trainer(RANKS, model_args(hidden) + schedule + tier_args(tier, save, memory)
                         + (["--async-save"] if async_save else []), timeout=3600,
                         FTMASTER_RUN_DIR=str(run_dir))
    assert result.returncode == 0, result.stdout[-3000:]
    return [e for e in runfiles.read_events(run_dir)
            if e["event"] in ("periodic_save", "emergency_save") and e.get("tier") == tier
            and e["kind"] != "final"]


def load_seconds(hidden: int, disk: Path, memory: Path | None, root: Path) -> tuple[str, float]:
    """A relaunch that trains one more iteration: the tier it loaded from and its seconds. A
    memory load gets an empty disk folder (the run's final checkpoint is on disk, newer)."""
    run_dir = root / f"load-{uuid.uuid4().hex[:6]}"
    if memory is not None:
        disk = root / f"empty-{uuid.uuid4().hex[:6]}"
    newest = read_tracker(memory if memory is not None else disk)
    tier = ([] if memory is None else
            ["--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir", str(memory)])
    result = run_trainer(RANKS, model_args(hidden) + tier + SCHEDULE + [
        "--train-iters", str(newest + 1), "--load", str(disk), "--save", str(disk)],
        timeout=3600, FTMASTER_RUN_DIR=str(run_dir))
    assert result.returncode == 0, result.stdout[-3000:]
    (loaded,) = [e for e in runfiles.read_events(run_dir) if e["event"] == "checkpoint_loaded"]
    return loaded["tier"], loaded["seconds"]


def memcpy_speed(size: int) -> float:
    source = numpy.ones(size, dtype=numpy.uint8)
    target = numpy.empty_like(source)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        numpy.copyto(target, source)
        times.append(time.perf_counter() - start)
    return size / statistics.median(times)


def summary(saves: list[dict]) -> dict:
    return {"blocked_s": statistics.median(e["seconds"] for e in saves),
            "own_s": statistics.median(e["seconds"] - e.get("waited_for_ranks_seconds", 0.0)
                                       for e in saves),
            "complete_s": statistics.median(e["persist_seconds"] for e in saves),
            "bytes": statistics.median(e["bytes"] for e in saves), "count": len(saves),
            "rates": [e["bytes"] / e["seconds"] for e in saves]}


def measure(hidden: int, saves: int, root: Path) -> dict:
    """Per tier and mode: the first save (set-up included), the other set-ups (a memory
    save into a slot not yet set up) and the steady saves; then loads and a persist copy."""
    memory = SHM / f"ftmaster-bench-{uuid.uuid4().hex[:8]}"
    found = {}
    try:
        for tier, async_save in MODES:
            first, *others = saves_of(hidden, tier, async_save, saves, root, memory / f"{async_save}")
            steady = [e for e in others if e.get("slot", "refilled") == "refilled"]
            set_ups = [e for e in others if e.get("slot") == "new"]
            found[(tier, async_save)] = {"first": summary([first]), "steady": summary(steady),
                                         "set_up": summary(set_ups) if set_ups else None}
            print(f"  hidden {hidden} {tier} {'async' if async_save else 'sync'}: "
                  f"{1 + len(others)} saves", flush=True)
        save = root / f"h{hidden}-memory-sync"
        found["load_memory"] = load_seconds(hidden, save, memory / "False", root)
        found["load_disk"] = load_seconds(hidden, root / f"h{hidden}-disk-sync", None, root)
        target = root / f"persist-{hidden}"
        copied = persist(memory / "False", target, read_tracker(memory / "False"))
        found["persist"] = (copied.seconds, copied.bytes)
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    return found


def save_line(name: str, entry: dict, references: tuple[str, ...], speeds: dict[str, float]) -> str:
    """One kind of save: its size, blocked and complete times, and its rates as shares of the
    memcpy rate and of the medium's own (fsync'd) write rates."""
    def shares(rate: float) -> str:
        return ", ".join(f"{rate / speeds[name]:.2f} of {name}" for name in ("memcpy", *references))

    blocked, complete = entry["bytes"] / entry["blocked_s"], entry["bytes"] / entry["complete_s"]
    own = entry["bytes"] / entry["own_s"]
    return (f"    {name:13} x{entry['count']}: {entry['bytes'] / 1e6:7.1f} MB, blocked "
            f"{entry['blocked_s']:7.3f} s ({shares(blocked)}; without waiting for the other "
            f"stage {entry['own_s']:.3f} s, {own / speeds['memcpy']:.2f} of memcpy), complete "
            f"{entry['complete_s']:7.3f} s ({shares(complete)})")


def report(hidden: int, found: dict, speeds: dict[str, float]) -> None:
    print(f"hidden {hidden} (memcpy {speeds['memcpy'] / 1e9:.1f} GB/s, of the checkpoint's "
          f"size {speeds['memcpy-same-size'] / 1e9:.1f} GB/s, shm write "
          f"{speeds['shm'] / 1e9:.2f} GB/s, disk fsync'd write {speeds['disk'] / 1e9:.2f} GB/s "
          f"one file, {speeds['disk-kept'] / 1e9:.2f} GB/s checkpoint-sized files kept, "
          f"{speeds['paced-kept'] / 1e9:.2f} GB/s written as a sync save writes them and kept, "
          f"{speeds['sustained'] / 1e9:.2f} GB/s sustained; measured just before):")
    for tier, async_save in MODES:
        entry = found[(tier, async_save)]
        reference = (("memcpy-same-size", "shm") if tier == "memory"
                     else ("disk", "disk-kept", "paced-kept", "sustained"))
        print(f"  {tier} {'async' if async_save else 'sync'}:")
        print(save_line("first", entry["first"], reference, speeds))
        if entry["set_up"]:
            print(save_line("other set-up", entry["set_up"], reference, speeds))
        print(save_line("median" if tier == "disk" else "refill median", entry["steady"],
                        reference, speeds))
        if tier == "disk" and not async_save:
            print("    each, blocked: " + " ".join(
                f"{rate / 1e9:.2f}" for rate in entry["steady"]["rates"]) + " GB/s")
    for tier in ("disk", "memory"):
        sync, asynchronous = found[(tier, False)]["steady"], found[(tier, True)]["steady"]
        print(f"  {tier}: async blocks {asynchronous['blocked_s'] / sync['blocked_s']:.2f}x of sync")
    for sync in (False, True):
        disk, memory = found[("disk", sync)]["steady"], found[("memory", sync)]["steady"]
        print(f"  {'async' if sync else 'sync'}: memory/disk blocked "
              f"{memory['blocked_s'] / disk['blocked_s']:.2f}x, complete "
              f"{memory['complete_s'] / disk['complete_s']:.2f}x")
    (memory_tier, memory_s), (disk_tier, disk_s) = found["load_memory"], found["load_disk"]
    print(f"  load: {memory_s:.3f} s from {memory_tier}, {disk_s:.3f} s from {disk_tier} "
          f"(memory/disk {memory_s / disk_s:.2f}x)")
    seconds, size = found["persist"]
    print(f"  persist copy: {size / 1e6:.1f} MB in {seconds:.3f} s = {size / seconds / 1e6:.1f} MB/s "
          f"({size / seconds / speeds['disk']:.2f} of the disk's fsync'd write)")


def kept_files_write_speed(directory: Path, size: int, count: int) -> float:
    """Sequential writes of ``count`` files of ``size`` bytes, each fsynced and kept until the
    last is written, as a run's checkpoints are: the median rate. On this VM's disk it falls
    from the one-file rate once a few GB are written (0.4-2.6 GB/s, measured 2026-11-26)."""
    speeds = [fsynced_write_speed(directory / f"kept-{index}.bin", size, 8 << 20)
              for index in range(count)]
    for index in range(count):
        (directory / f"kept-{index}.bin").unlink()
    return statistics.median(speeds)


def _paced_writer(path: Path, size: int, rounds: int, barrier, results) -> None:
    """One of the parallel writers of :func:`paced_writers_speed`: ``rounds`` files, each
    written in 512 KiB blocks with the save's pacing, fsynced, and kept."""
    block = os.urandom(512 << 10)
    for round_ in range(rounds):
        barrier.wait()
        start = time.perf_counter()
        with open(f"{path}-{round_}", "wb") as handle:
            pacing = Writeback(handle.fileno())
            for written in range(len(block), size + 1, len(block)):
                handle.write(block)
                if pacing.due(written):
                    handle.flush()
                    pacing.written(written)
            handle.flush()
            os.fsync(handle.fileno())
        barrier.wait()  # the round ends with its slowest writer, as a save does
        results.put((round_, time.perf_counter() - start))


def paced_writers_speed(directory: Path, checkpoint_bytes: int, rounds: int) -> float:
    """What the disk gives a sync save's own pattern: each of the ``RANKS`` writers writes
    its share of a checkpoint at once, paced as :mod:`ftmaster.recovery.writeback` paces
    them and fsynced, and the files are kept round after round as a run keeps its
    checkpoints (on this VM's disk two 600 MB writers took 0.6 s while each round's files
    were removed, and 0.6 s, then 1.1-1.7 s from the second or third round on when they
    were kept: the one-file rate holds for the first GB or two). The median rate over the
    rounds."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(RANKS), context.Queue()
    writers = [context.Process(target=_paced_writer, args=(
        directory / f"paced-{rank}", checkpoint_bytes // RANKS, rounds, barrier, results))
        for rank in range(RANKS)]
    for writer in writers:
        writer.start()
    seconds = {}
    for _ in range(RANKS * rounds):
        round_, elapsed = results.get(timeout=600)
        seconds[round_] = max(seconds.get(round_, 0.0), elapsed)
    for writer in writers:
        writer.join()
    for path in directory.glob("paced-*"):
        path.unlink()
    return checkpoint_bytes / statistics.median(seconds.values())


def sustained_write_speed(directory: Path, total: int = 8 << 30, size: int = 1 << 30) -> float:
    """What the save disk keeps up over GBs: ``total`` bytes in fsync'd files of ``size``,
    kept until the last is written; the median rate of the second half's files. This VM's
    disk takes a few GB at 1.3-2.3 GB/s, then 0.3-0.45 GB/s (measured 2026-11-29: twelve
    1 GB steps in a row at 0.29-0.31 GB/s), and a file written and removed, as the one-file
    reference's three are, is rewritten at the fast rate: the one-file rate is the burst."""
    count = max(2, total // size)
    speeds = [fsynced_write_speed(directory / f"sustained-{index}.bin", size, 8 << 20)
              for index in range(count)]
    for index in range(count):
        (directory / f"sustained-{index}.bin").unlink()
    return statistics.median(speeds[count // 2:])


def machine_speeds(root: Path, checkpoint_bytes: int, saves: int, size: int = 512 << 20) -> dict[str, float]:
    """What the medium does on its own, just before the saves: one-thread memcpy (of 512 MB,
    and of the checkpoint's size: glibc's copy below its non-temporal threshold, 190 MB on
    this VM, reads each target line first and runs at about 6.5 GB/s here against 11), one file
    into /dev/shm, one fsync'd file to the save disk, as many kept checkpoint-sized files
    as the run saves, the same written as a sync save writes them (in parallel, paced), and
    the disk's sustained rate."""
    with tempfile.TemporaryDirectory(dir=SHM) as shm:
        return {"memcpy": memcpy_speed(size), "memcpy-same-size": memcpy_speed(checkpoint_bytes),
                "shm": disk_write_speed(Path(shm), size),
                "disk": disk_write_speed(root, size),
                "paced-kept": paced_writers_speed(root, checkpoint_bytes, saves),
                "disk-kept": kept_files_write_speed(root, checkpoint_bytes, saves),
                "sustained": sustained_write_speed(root)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--saves", type=int, default=6, help="saves per tier and mode")
    args = parser.parse_args()
    if args.saves < 3:  # a memory tier refills only from its third save
        parser.error(f"--saves must be at least 3 (the first save, the second slot's set-up, "
                     f"then refills), got {args.saves}")
    heads = int(SMALL_GPT[SMALL_GPT.index("--num-attention-heads") + 1])
    for hidden in args.hidden:
        if hidden < heads or hidden % heads:  # the trainer would fail after its set-up
            parser.error(f"--hidden must be a positive multiple of the model's {heads} attention "
                         f"heads, got {hidden}")
    # The save disk is the checkout's (a tmpfs /tmp would measure memory); .gitignore names
    # the prefix, so a commit made while this runs cannot take its checkpoints along.
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX,
                                     dir=Path(__file__).resolve().parents[1]) as work:
        root = Path(work)
        for hidden in args.hidden:
            speeds = machine_speeds(root, CHECKPOINT_BYTES.get(hidden, 512 << 20), args.saves)
            report(hidden, measure(hidden, args.saves, root), speeds)


if __name__ == "__main__":
    main()
