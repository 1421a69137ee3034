"""How a node-loss recovery's membership cost grows with the node count: the rendezvous round,
the store's traffic and the plan, at 2, 16, 128 and 512 simulated nodes.

    .venv/bin/python benchmarks/membership_scale.py [--nodes 2 16 128 512] [--keep-alive 1]

A simulated node is an ftmaster :class:`NodeMembership` (torch elastic's c10d dynamic
rendezvous handler, its own store connection and keep-alive thread) without training, on a
thread; ``--processes P`` spreads the nodes over P worker processes (so that one interpreter's
GIL is not what is measured); node 0's hosts the TCPStore on loopback. Per node count, with
fresh processes:

1. every node joins round 1 (``join``: the handler's round plus ftmaster's node records);
2. node N-1 dies: its keep-alive stops (a SIGKILLed node sends nothing more);
3. the survivors join round 2 at once, as their failed collectives make them do, and wait
   until the dead node's keep-alive expires (``keep_alive_interval`` x ``keep_alive_max_attempt``)
   and the last call (``last_call_timeout``) passes;
4. the plan for the survivors' GPUs (8 each) is computed once.

Reported: each round's wall time (slowest node), the store operations on the rendezvous state
(torch's ``C10dRendezvousBackend.get_state``/``set_state``: one key holding every node, read and
compare-and-set whole) and their bytes, and the plan's time. Round 2 holds fixed waits (the
dead node's keep-alive expiry and the last call, partly overlapping: about 4 s with the
defaults here); what grows beyond them is what the node count costs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LAST_CALL_S, KEEP_ALIVE_MAX = 2, 3
GPUS_PER_NODE = 8
MODEL = ["pretrain_gpt.py", "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads",
         "32", "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size",
         "1", "--global-batch-size", "4096", "--tensor-model-parallel-size", "8",
         "--pipeline-model-parallel-size", "1", "--train-iters", "1000", "--lr", "1e-4",
         "--vocab-size", "32000", "--mock-data", "--bf16"]


class StoreTraffic:
    """Counts torch's reads and compare-and-sets of the rendezvous state, with their bytes."""

    def __init__(self) -> None:
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend)
        self.ops = self.bytes = 0
        self.lock = threading.Lock()
        get_state, set_state = C10dRendezvousBackend.get_state, C10dRendezvousBackend.set_state
        traffic = self

        def counted_get(backend):
            result = get_state(backend)
            traffic.add(len(result[0]) if result else 0)
            return result

        def counted_set(backend, state, token=None):
            result = set_state(backend, state, token)
            traffic.add(len(state) + (len(result[0]) if result else 0))
            return result
        C10dRendezvousBackend.get_state, C10dRendezvousBackend.set_state = counted_get, counted_set

    def add(self, size: int) -> None:
        with self.lock:
            self.ops += 1
            self.bytes += size

    def take(self) -> tuple[int, int]:
        with self.lock:
            counted, self.ops, self.bytes = (self.ops, self.bytes), 0, 0
        return counted


def join_all(members, gpus, start_at: float, limit_s: float) -> list[float]:
    """Every member joins one round at ``start_at`` (wall clock), each on its thread; the
    seconds each took, for those that had joined within ``limit_s``."""
    ended, errors = [], []
    time.sleep(max(0.0, start_at - time.time()))

    def join(member) -> None:
        try:
            member.join(gpus)
            ended.append(time.time() - start_at)
        except Exception as error:  # reported, not raised on a thread
            errors.append(repr(error))
    threads = [threading.Thread(target=join, args=(m,), daemon=True) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, start_at + limit_s - time.time()))
    if errors:
        raise SystemExit(f"{len(errors)} node(s) failed to join: {errors[0]}")
    return list(ended)


def worker(options) -> None:
    """Simulated nodes ``first``..``last - 1`` in this process, one thread each; the rounds
    start when the orchestrator's files in ``sync`` say so."""
    from ftmaster.membership import NodeMembership, RendezvousConfig

    traffic, sync = StoreTraffic(), Path(options.sync)
    conf = {"last_call_timeout": str(LAST_CALL_S), "keep_alive_interval": str(options.keep_alive),
            "keep_alive_max_attempt": str(KEEP_ALIVE_MAX), "join_timeout": "600",
            "read_timeout": "120"}
    start = time.monotonic()
    members = [NodeMembership(RendezvousConfig(
        options.endpoint, "scale", 1, options.nodes, rank, local_addr="127.0.0.1",
        conf={**conf, "is_host": str(int(rank == 0))})) for rank in range(options.first, options.last)]
    tell(sync / f"ready.{options.first}", {"connect_s": time.monotonic() - start})
    gpus = list(range(GPUS_PER_NODE))
    for round_number in (1, 2):
        start_at = wait_for(sync / f"go{round_number}", options.limit + 600)["at"]
        if round_number == 2 and options.last == options.nodes:
            members.pop().stop_keep_alive()  # the last node dies
        ended = join_all(members, gpus, start_at, options.limit)
        ops, size = traffic.take()
        tell(sync / f"round{round_number}.{options.first}",
             {"ended": ended, "ops": ops, "bytes": size})
    # Node 0 hosts the store: every worker stays until the orchestrator is done and kills it.
    wait_for(sync / "done", options.limit + 600)
    os._exit(0)  # the rendezvous threads of a round that never completed still block


def tell(path: Path, body: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(body))
    partial.rename(path)


def wait_for(path: Path, limit_s: float, workers=()) -> dict | None:
    """The file's content once it exists; None after ``limit_s`` or once a worker has died."""
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
            return None
        time.sleep(0.05)
    return json.loads(path.read_text())


def measure(nodes: int, keep_alive: int, limit_s: float, processes: int) -> dict:
    """One node count: ``processes`` worker processes share the nodes; node 0 (the store's
    host) is started first."""
    from ftmaster.membership import free_port
    from ftmaster.recovery.planner import plan_nodes

    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    bounds = [nodes * i // processes for i in range(processes + 1)]
    chunks = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    with tempfile.TemporaryDirectory(prefix="ftmaster-scale-") as sync_dir:
        sync = Path(sync_dir)
        workers = []
        try:
            for index, (first, last) in enumerate(chunks):
                workers.append(subprocess.Popen(
                    [sys.executable, __file__, "--worker", "--nodes", str(nodes), "--first",
                     str(first), "--last", str(last), "--endpoint", endpoint, "--sync", sync_dir,
                     "--keep-alive", str(keep_alive), "--limit", str(limit_s)]))
                if index == 0 and wait_for(sync / "ready.0", 120) is None:
                    raise SystemExit("node 0 did not start its store within 120 s")
            ready = [wait_for(sync / f"ready.{first}", 300, workers) for first, _ in chunks]
            if None in ready:
                raise SystemExit(f"{ready.count(None)} worker(s) did not start their nodes")
            result = {"nodes": nodes, "processes": len(chunks),
                      "connect_s": max(r["connect_s"] for r in ready)}
            for round_number, expected in ((1, nodes), (2, nodes - 1)):
                tell(sync / f"go{round_number}", {"at": time.time() + 1.0})
                reports = [wait_for(sync / f"round{round_number}.{first}", limit_s + 60, workers)
                           for first, _ in chunks]
                ended = [s for r in reports if r for s in r["ended"]]
                result.update({f"round{round_number}_joined": len(ended),
                               f"round{round_number}_s": max(ended) if len(ended) == expected else None,
                               f"round{round_number}_ops": sum(r["ops"] for r in reports if r),
                               f"round{round_number}_bytes": sum(r["bytes"] for r in reports if r)})
                if len(ended) < expected:
                    return result
        finally:
            for process in workers:
                process.kill()
                process.wait()
    plan_start = time.perf_counter()
    plan_nodes(MODEL, [GPUS_PER_NODE] * (nodes - 1), original_world_size=GPUS_PER_NODE * nodes)
    return {**result, "plan_s": time.perf_counter() - plan_start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 16, 128, 512])
    parser.add_argument("--keep-alive", type=int, default=1)
    parser.add_argument("--processes", type=int, default=1,
                        help="worker processes sharing the simulated nodes (threads in each)")
    parser.add_argument("--limit", type=float, default=300.0,
                        help="seconds a round may take before the count is stopped")
    # A worker's own arguments (see worker()).
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--last", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--sync", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        options.nodes = options.nodes[0]
        worker(options)
    print(f"{'nodes':>6s} {'procs':>6s} {'connect s':>10s} {'round 1 s':>10s} {'ops':>8s} "
          f"{'MB':>8s} {'round 2 s':>10s} {'ops':>8s} {'MB':>8s} {'plan ms':>8s}", flush=True)
    for nodes in options.nodes:
        r = measure(nodes, options.keep_alive, options.limit, min(options.processes, nodes))
        print(f"{nodes:6d} {r['processes']:6d} {r['connect_s']:10.2f} "
              + " ".join(_round(r, n) for n in (1, 2))
              + (f" {r['plan_s'] * 1e3:8.1f}" if "plan_s" in r else ""), flush=True)


def _round(r: dict, number: int) -> str:
    if f"round{number}_joined" not in r:
        return f"{'-':>10s} {'':8s} {'':8s}"
    seconds = r[f"round{number}_s"]
    shown = (f"{seconds:10.2f}" if seconds is not None
             else f"{r[f'round{number}_joined']:>4d} joined")
    return (f"{shown:>10s} {r[f'round{number}_ops']:8d} "
            f"{r[f'round{number}_bytes'] / 1e6:8.2f}")


if __name__ == "__main__":
    main()
