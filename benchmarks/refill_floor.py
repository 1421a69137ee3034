"""The floor under a memory-tier refill on this machine: the copy and its digests alone.

    .venv/bin/python benchmarks/refill_floor.py [--sizes 77 304 1212] [--repeats 7]

A refill (``megatron/training/memory_slots.py``) cannot be faster than its irreducible part:
each of the 2 ranks copies its half of the checkpoint into its prefaulted file under
/dev/shm (a mapping it keeps) and hashes what it copied, for the file's digest and each
item's (the manifest's and the peer copies' checks), then the ranks agree once (one gloo
all-reduce). Here that part runs on its own, in 2 processes, with the tensors split as the
trainer's are (about 300 tensors per checkpoint), without megatron-core, the state dict, the
metadata, the manifest or the tracker. Printed per size, as the medians of the slower rank:
the refill's copy alone (streaming stores, ``megatron/training/stream_copy.c``), with both
digests taken from each chunk before it is copied (what a refill does), and with the
agreement; then the same with libc's ``memmove``, and ``memmove`` with the digests taken
from the copied bytes (the refill before 2026-11-28); each as a share of a one-thread memcpy
of 512 MB measured in the same run (``benchmarks/memory_tier.py``'s reference, where the goal
is 0.5; until 2026-12-07 the checkpoint's own size was copied here, which below glibc's
non-temporal threshold runs slower and made the 77 MB shares read up to 2.2x too high).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import xxhash

from megatron.training.memory_slots import COPY_CHUNK as CHUNK  # the refill's own
from megatron.training.memory_slots import copy_bytes
from memory_tier import memcpy_speed

REFERENCE_BYTES = 512 << 20
"""memory_tier.py's memcpy reference, against which the goal is set."""

RANKS = 2
TENSORS_PER_RANK = 150
VARIANTS = (  # name, digests, agreement, copy, hashed before the copy
    ("copy", 0, False, copy_bytes, True), ("copy+2 digests", 2, False, copy_bytes, True),
    ("+agreement", 2, True, copy_bytes, True),
    ("memmove", 0, False, ctypes.memmove, True),
    ("memmove+2 digests", 2, False, ctypes.memmove, True),
    ("memmove, then 2 digests of the copy", 2, False, ctypes.memmove, False))


def rank_tensors(rank_bytes: int) -> list[torch.Tensor]:
    """One rank's tensors: a few large ones and many small ones, as a GPT's layers are."""
    weights = [4.0 if index % 3 == 0 else 0.1 for index in range(TENSORS_PER_RANK)]
    scale = rank_bytes / 4 / sum(weights)
    return [torch.randn(max(1, int(weight * scale))) for weight in weights]


def refill(target: torch.Tensor, view: memoryview, tensors: list[torch.Tensor], digests: int,
           copy=copy_bytes, hash_first: bool = True) -> None:
    """The refill's copy: each chunk hashed from the tensor, then copied by ``copy`` (the
    streaming copy, or libc's ``memmove``); or, ``hash_first`` off, copied and then hashed
    from the target (what it did before, 2026-11-27)."""
    offset = 0
    file_hash = xxhash.xxh3_64()
    for tensor in tensors:
        source = tensor.view(torch.uint8)
        source_view = memoryview(source.numpy())
        item_hash = xxhash.xxh3_64()
        hashers = (file_hash, item_hash)[:digests]
        for start in range(0, source.numel(), CHUNK):
            end = min(start + CHUNK, source.numel())
            if hash_first:
                _hash(source_view[start:end], hashers)
            copy(target.data_ptr() + offset + start, source.data_ptr() + start, end - start)
            if not hash_first:
                _hash(view[offset + start:offset + end], hashers)
        offset += source.numel()


def _hash(chunk: memoryview, hashers: tuple) -> None:
    with chunk:
        for hasher in hashers:
            hasher.update(chunk)


def worker(rank: int, size: int, repeats: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=RANKS)
    torch.set_num_threads(1)
    tensors = rank_tensors(size // RANKS)
    nbytes = sum(t.numel() * 4 for t in tensors)
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as handle:
        os.ftruncate(handle.fileno(), nbytes)
        mapping = mmap.mmap(handle.fileno(), nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        target = torch.frombuffer(mapping, dtype=torch.uint8)
        timings = {}
        with memoryview(mapping) as view:
            for name, digests, agree, copy, hash_first in VARIANTS:
                refill(target, view, tensors, digests, copy, hash_first)  # warm
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    refill(target, view, tensors, digests, copy, hash_first)
                    if agree:
                        dist.all_reduce(torch.ones(1))
                    times.append(time.perf_counter() - start)
                timings[name] = times
        del target, view
        mapping.close()
    results.put((rank, timings))
    dist.destroy_process_group()


def floor_of(size: int, repeats: int, port: int) -> dict[str, float]:
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=worker, args=(rank, size, repeats, port, results))
                 for rank in range(RANKS)]
    for process in processes:
        process.start()
    timings = [results.get(timeout=600)[1] for _ in processes]
    for process in processes:
        process.join()
    return {name: statistics.median(max(per_rank[name][i] for per_rank in timings)
                                    for i in range(repeats)) for name in timings[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[77, 304, 1212], metavar="MB")
    parser.add_argument("--repeats", type=int, default=7)
    options = parser.parse_args()
    for index, megabytes in enumerate(options.sizes):
        size = megabytes * 1_000_000
        memcpy = memcpy_speed(REFERENCE_BYTES)
        floor = floor_of(size, options.repeats, 29500 + index)
        shares = ", ".join(f"{name} {seconds * 1e3:.1f} ms ({size / seconds / memcpy:.2f})"
                           for name, seconds in floor.items())
        print(f"{megabytes} MB (memcpy of 512 MB {memcpy / 1e9:.1f} GB/s, this size at that "
              f"rate {size / memcpy * 1e3:.1f} ms): {shares}")


if __name__ == "__main__":
    main()
