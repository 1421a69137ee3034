"""The two ways to keep interpreters warm, measured: a forkserver with preloaded imports, and
ftmaster's pool of exec'd interpreters waiting on a pipe.

    .venv/bin/python benchmarks/warm_mechanisms.py [--repeats 5]

Both preload the same modules (torch, megatron-core, the trainer). Measured per hand-over:
from the moment a launch hands a rank over to the first line of the rank's code, in wall
time. The forkserver is multiprocessing's (what ``torch.distributed.elastic``'s
``start_processes`` uses with ``start_method="forkserver"``), with
``set_forkserver_preload``; the pool is :class:`ftmaster.warm.WarmPool` with
:class:`ftmaster.warm.WarmRanks`, as a launch uses them. Also printed: how many OS threads
the forkserver has when it forks (a fork copies only the calling thread; any lock another
thread holds stays locked in the child).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = ["torch", "megatron.core", "megatron.training.training"]
RANK_SCRIPT = "import sys, time\nopen(sys.argv[1], 'w').write(repr(time.time()))\n"


def forked_entry(out: str) -> None:
    Path(out).write_text(repr(time.time()))


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def forkserver_handovers(repeats: int, root: Path) -> tuple[list[float], int, float]:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    warm_up = context.Process(target=forked_entry, args=(str(root / "warm-up"),))
    warm_up.start()  # starts the server, which imports PRELOAD once
    warm_up.join()
    from multiprocessing import forkserver
    server_pid = forkserver._forkserver._forkserver_pid
    threads, resident = len(os.listdir(f"/proc/{server_pid}/task")), resident_mb(server_pid)
    seconds = []
    for repeat in range(repeats):
        out = root / f"forked-{repeat}"
        start = time.time()
        child = context.Process(target=forked_entry, args=(str(out),))
        child.start()
        child.join()
        seconds.append(float(out.read_text()) - start)
    return seconds, threads, resident


def pool_handovers(repeats: int, root: Path) -> tuple[list[float], float]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from ftmaster.warm import WarmPool, WarmRanks, rank_env
    from helpers.trainer import wait_until

    script = root / "rank.py"
    script.write_text(RANK_SCRIPT)
    pool = WarmPool(1, root / "run")
    seconds = []
    try:
        for repeat in range(repeats):
            wait_until(lambda: any(w.usable for w in pool.workers), timeout=300,
                       what="a warm worker ready")
            rank_dir, out = root / f"ranks-{repeat}", root / f"pooled-{repeat}"
            rank_dir.mkdir()
            resident = resident_mb(next(w for w in pool.workers if w.usable).process.pid)
            env = rank_env({"PATH": os.environ["PATH"]}, 0, 1, rank_dir, "bench", None, 29999)
            start = time.time()
            ranks = WarmRanks(pool.take(1), rank_dir, [env], [str(script), str(out)],
                              root / f"log-{repeat}")
            ranks.wait(60)
            seconds.append(float(out.read_text()) - start)
    finally:
        pool.close()
    return seconds, resident


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftmaster-warm-mechanisms-") as tmp:
        forked, threads, server_mb = forkserver_handovers(options.repeats, Path(tmp))
        pooled, worker_mb = pool_handovers(options.repeats, Path(tmp))
    print(f"forkserver: hand-over median {statistics.median(forked) * 1e3:7.1f} ms "
          f"(min {min(forked) * 1e3:.1f}); one server of {server_mb:.0f} MB resident, "
          f"{threads} OS thread(s) when it forks, its children share its pages")
    print(f"pool:       hand-over median {statistics.median(pooled) * 1e3:7.1f} ms "
          f"(min {min(pooled) * 1e3:.1f}); {worker_mb:.0f} MB resident per waiting worker")


if __name__ == "__main__":
    main()
