"""What the collectives of one memory-tier refill cost on their own, on 2 gloo ranks.

    .venv/bin/python benchmarks/save_collectives.py [--items 170] [--repeats 300]

A refill with a kept structure (``megatron/training/checkpointing.py``'s ``_Save``) makes four
collectives on the control group, with these payloads:

- ``structure``: the structure's all-reduce (one int64, ``save_structure``);
- ``folder``: rank 0's answer on the folder, broadcast (``broadcast_object_list``);
- ``agreement``: every rank's report gathered on rank 0 (``gather_object``): a
  :class:`_RankReport` with the digests of 2 shard files of ``--items`` items between them,
  the write results unchanged since the last save;
- ``outcome``: rank 0's :class:`DurableSave`, broadcast.

Each runs on its own behind a barrier, so no rank waits for another to arrive; printed are the
medians over ``--repeats`` of the slower rank and the pickled payloads' sizes. Their sum is
what the refill spends in collectives when the ranks arrive together, so it bounds what
merging or replacing them could save.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.training import checkpointing  # noqa: E402
from megatron.training.checksums import ShardDigest  # noqa: E402
from recovery.manifest import FileDigest  # noqa: E402

RANKS = 2


def report(items: int) -> checkpointing._RankReport:
    def shard(first: int, count: int) -> ShardDigest:
        return ShardDigest(FileDigest(38_000_000, "0123456789abcdef"), 0.01, 0.02,
                           {i: FileDigest(200_000 + i, "fedcba9876543210")
                            for i in range(first, first + count)}, 0.01, 0.02)

    half = items // 2
    return checkpointing._RankReport(None, {"__0_0.distcp": shard(0, half),
                                            "__0_1.distcp": shard(half, items - half)},
                                     0.03, checkpointing._UNCHANGED)


def outcome() -> checkpointing.DurableSave:
    phases = dict.fromkeys(("state-dict", "preprocess", "metadata-exchange", "planning",
                            "write", "finalize", "agreement", "manifest-and-tracker"), 0.001)
    return checkpointing.DurableSave(
        7, Path("/dev/shm/memory/iter_0000007"), "periodic", "memory", time.time(), 0.03,
        77_000_000, 0.01, 0.02, phases, {"hashing": 0.01, "writing": 0.005, "writers": 2},
        True, "refilled")


def collectives(rank: int, items: int) -> dict:
    flag = torch.zeros(1, dtype=torch.int64)
    gathered = [None] * RANKS if rank == 0 else None
    own, result = report(items), outcome() if rank == 0 else None
    return {
        "structure": lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX),
        "folder": lambda: checkpointing.broadcast_from_rank0((None, True, None), None),
        "agreement": lambda: dist.gather_object(own, gathered, dst=0),
        "outcome": lambda: checkpointing.broadcast_from_rank0(result, None),
    }


def worker(rank: int, items: int, repeats: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=RANKS)
    timings = {}
    for name, call in collectives(rank, items).items():
        call()  # warm
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        timings[name] = times
    results.put(timings)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=170,
                        help="items in one rank's shard files (a 77 MB checkpoint's: some 170)")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--port", type=int, default=29560)
    options = parser.parse_args()
    if options.items < 2 or options.repeats < 1:
        parser.error("--items needs at least 2 and --repeats at least 1")
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=worker, args=(rank, options.items, options.repeats,
                                                      options.port, results))
                 for rank in range(RANKS)]
    for process in processes:
        process.start()
    timings = [results.get(timeout=600) for _ in processes]
    for process in processes:
        process.join()
    sizes = {"structure": 8, "folder": len(pickle.dumps((None, True, None))),
             "agreement": len(pickle.dumps(report(options.items))),
             "outcome": len(pickle.dumps(outcome()))}
    total = 0.0
    for name in timings[0]:
        median = statistics.median(max(rank[name][i] for rank in timings)
                                   for i in range(options.repeats))
        total += median
        print(f"{name:10s} {median * 1e3:6.3f} ms  ({sizes[name]:,} bytes pickled)")
    print(f"{'all four':10s} {total * 1e3:6.3f} ms")


if __name__ == "__main__":
    main()
