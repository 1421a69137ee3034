"""A memory checkpoint copied from a peer's ftmaster over loopback (:mod:`ftmaster.peer_files`).

    .venv/bin/python benchmarks/peer_copy.py [--sizes-mb 77 304 1212] [--repeats 3] [--rate-mb 200]

Each size is a checkpoint of 4 shard files with its manifest in /dev/shm (random bytes), the
sizes of the memory-tier benchmark's 77 MB, 304 MB and 1.2 GB states. Printed per size, the
median over the repeats of: one copy without a rate limit (verified on arrival, into
/dev/shm), as GB/s and as a share of this machine's one-thread memcpy measured just before;
and one with ``--replication-rate`` set, as a share of that rate. Server and client share
this machine's 2 cores, so loopback is the floor of what a network link would give.

``--persist`` also times persisting that checkpoint to a folder on disk (``--save-dir``, by
default the system's temp folder), as the node of rank 0 does across nodes: from a whole
local copy, and from a copy holding half the shards, the other half fetched from the peer
that holds it (:func:`ftmaster.persist.persist` with a fetch); medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy

from ftmaster.peer_files import PeerClient, PeerServeConfig, PeerServer, copy_checkpoint, new_secret
from ftmaster.persist import persist
from ftmaster.recovery.checkpoints import iteration_dir
from ftmaster.recovery.manifest import digest_file, write_manifest

SHARDS = 4


def memcpy_gb_s(nbytes: int) -> float:
    source = numpy.random.bytes(nbytes)
    target = numpy.empty(nbytes, dtype=numpy.uint8)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        target[:] = numpy.frombuffer(source, dtype=numpy.uint8)
        times.append(time.perf_counter() - started)
    return nbytes / min(times) / 1e9


def make_checkpoint(tier: Path, nbytes: int) -> None:
    folder = iteration_dir(tier, 2)
    folder.mkdir(parents=True)
    files = {}
    for shard in range(SHARDS):
        name = f"__{shard}_0.distcp"
        left = nbytes // SHARDS
        with open(folder / name, "wb") as handle:
            while left:
                left -= handle.write(os.urandom(min(64 << 20, left)))
        files[name] = digest_file(folder / name)
    write_manifest(folder, "periodic", 2, files)


def timed_copies(url: str, secret: str, into: Path, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        shutil.rmtree(into, ignore_errors=True)
        seconds.append(copy_checkpoint(PeerClient(url, secret), 2, into).seconds)
    shutil.rmtree(into, ignore_errors=True)
    return seconds


def measure(size_mb: int, repeats: int, rate_mb: float) -> None:
    nbytes = size_mb * 1_000_000
    secret = new_secret()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as scratch:
        tier, into = Path(scratch) / "peer", Path(scratch) / "mine"
        make_checkpoint(tier, nbytes)
        memcpy = memcpy_gb_s(min(nbytes, 512 << 20))
        for rate in (None, rate_mb * 1e6):
            server = PeerServer(PeerServeConfig(tier, secret, rate_bytes_s=rate))
            try:
                median = statistics.median(timed_copies(server.url, secret, into, repeats))
            finally:
                server.close()
            speed = nbytes / median / 1e9
            if rate is None:
                print(f"{size_mb:>5} MB  unlimited: {median:.3f} s, {speed:.2f} GB/s "
                      f"= {speed / memcpy:.2f} of memcpy ({memcpy:.1f} GB/s)", flush=True)
            else:
                print(f"{size_mb:>5} MB  rate {rate_mb:.0f} MB/s: {median:.3f} s, "
                      f"{speed * 1e3:.0f} MB/s = {speed * 1e9 / rate:.2f} of the limit", flush=True)


def timed_persists(memory: Path, save_dir: Path, repeats: int, fetch=None) -> list[float]:
    seconds = []
    for _ in range(repeats):
        shutil.rmtree(save_dir, ignore_errors=True)
        seconds.append(persist(memory, save_dir, 2, fetch).seconds)
    shutil.rmtree(save_dir, ignore_errors=True)
    return seconds


def measure_persist(size_mb: int, repeats: int, save_root: str | None) -> None:
    nbytes, secret = size_mb * 1_000_000, new_secret()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as scratch, \
            tempfile.TemporaryDirectory(dir=save_root) as disk:
        whole, half, peer = (Path(scratch) / name for name in ("whole", "half", "peer"))
        make_checkpoint(whole, nbytes)
        for tier in (half, peer):
            shutil.copytree(iteration_dir(whole, 2), iteration_dir(tier, 2))
        for shard in range(SHARDS):  # this node holds the first half, its peer the rest
            (iteration_dir(half if shard >= SHARDS // 2 else peer, 2) / f"__{shard}_0.distcp").unlink()
        server = PeerServer(PeerServeConfig(peer, secret))
        client = PeerClient(server.url, secret)
        try:
            local = statistics.median(timed_persists(whole, Path(disk) / "save", repeats))
            fetched = statistics.median(timed_persists(
                half, Path(disk) / "save", repeats,
                lambda name, dest, expected: client.fetch(f"iter_0000002/{name}", dest, expected)))
        finally:
            server.close()
        print(f"{size_mb:>5} MB  persist from a whole copy: {local:.3f} s "
              f"({nbytes / local / 1e9:.2f} GB/s); half fetched from the peer: {fetched:.3f} s "
              f"({nbytes / fetched / 1e9:.2f} GB/s) = {fetched / local:.2f}x the time", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[77, 304, 1212])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate-mb", type=float, default=200.0)
    parser.add_argument("--persist", action="store_true",
                        help="also time persisting, from a whole copy and from half a copy")
    parser.add_argument("--save-dir", default=None, help="where --persist writes (a disk)")
    options = parser.parse_args()
    for size in options.sizes_mb:
        measure(size, options.repeats, options.rate_mb)
        if options.persist:
            measure_persist(size, options.repeats, options.save_dir)


if __name__ == "__main__":
    main()
