"""How a node-loss recovery's membership cost grows with the node count: the rendezvous round,
the store's traffic and the plan, at 2, 16, 128 and 512 simulated nodes.

    .venv/bin/python benchmarks/membership_scale.py [--nodes 2 16 128 512] [--keep-alive 1]

A simulated node is an ftmaster :class:`NodeMembership` (torch elastic's c10d dynamic
rendezvous handler, its own store connection and keep-alive thread) without training, on a
thread; node 0's hosts the TCPStore on loopback. Per node count, in a fresh process:

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


def join_all(members, gpus, limit_s: float) -> float | None:
    """Every member joins one round, each on its thread; the slowest one's seconds, or None
    when not every member had joined within ``limit_s`` (the count joined is printed)."""
    ended, errors = [], []
    start = time.monotonic()

    def join(member) -> None:
        try:
            member.join(gpus)
            ended.append(time.monotonic() - start)
        except Exception as error:  # reported, not raised on a thread
            errors.append(repr(error))
    threads = [threading.Thread(target=join, args=(m,), daemon=True) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, start + limit_s - time.monotonic()))
    if errors:
        raise SystemExit(f"{len(errors)} node(s) failed to join: {errors[0]}")
    if len(ended) < len(members):
        print(f"{len(ended)} of {len(members)} nodes joined within {limit_s:g} s", file=sys.stderr,
              flush=True)
        return None
    return max(ended)


def measure(nodes: int, keep_alive: int, limit_s: float) -> dict:
    """One node count, in this process."""
    from ftmaster.membership import NodeMembership, RendezvousConfig, free_port
    from ftmaster.recovery.planner import plan_nodes

    traffic = StoreTraffic()
    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    conf = {"last_call_timeout": str(LAST_CALL_S), "keep_alive_interval": str(keep_alive),
            "keep_alive_max_attempt": str(KEEP_ALIVE_MAX), "join_timeout": "600",
            "read_timeout": "120"}

    def member(rank: int) -> NodeMembership:
        return NodeMembership(RendezvousConfig(endpoint, "scale", 1, nodes, rank,
                                               local_addr="127.0.0.1",
                                               conf={**conf, "is_host": str(int(rank == 0))}))
    start = time.monotonic()
    members = [member(0)] + [member(rank) for rank in range(1, nodes)]
    connect_s = time.monotonic() - start
    gpus = list(range(GPUS_PER_NODE))
    first_s = join_all(members, gpus, limit_s)
    first_ops, first_bytes = traffic.take()
    if first_s is None:
        return {"nodes": nodes, "connect_s": connect_s, "round1_s": None, "round1_ops": first_ops,
                "round1_bytes": first_bytes}
    members[-1].stop_keep_alive()  # the node dies
    second_s = join_all(members[:-1], gpus, limit_s) if nodes > 1 else 0.0
    second_ops, second_bytes = traffic.take()
    plan_start = time.perf_counter()
    plan_nodes(MODEL, [GPUS_PER_NODE] * (nodes - 1), original_world_size=GPUS_PER_NODE * nodes)
    plan_s = time.perf_counter() - plan_start
    return {"nodes": nodes, "connect_s": connect_s, "round1_s": first_s, "round1_ops": first_ops,
            "round1_bytes": first_bytes, "round2_s": second_s,
            "round2_ops": second_ops, "round2_bytes": second_bytes, "plan_s": plan_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 16, 128, 512])
    parser.add_argument("--keep-alive", type=int, default=1)
    parser.add_argument("--limit", type=float, default=300.0,
                        help="seconds a round may take before the count is stopped")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child's node count
    options = parser.parse_args()
    if options.one:
        print(json.dumps(measure(options.one, options.keep_alive, options.limit)), flush=True)
        os._exit(0)  # the rendezvous threads of a round that never completed still block
    print(f"{'nodes':>6s} {'connect s':>10s} {'round 1 s':>10s} {'ops':>8s} {'MB':>8s} "
          f"{'round 2 s':>10s} {'ops':>8s} {'MB':>8s} {'plan ms':>8s}")
    for nodes in options.nodes:
        child = subprocess.run([sys.executable, __file__, "--one", str(nodes), "--keep-alive",
                                str(options.keep_alive), "--limit", str(options.limit)],
                               capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parents[1])
        if child.returncode != 0:
            print(f"{nodes:6d} failed: {child.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(child.stdout.strip().splitlines()[-1])
        if r["round1_s"] is None:
            print(f"{nodes:6d} {r['connect_s']:10.2f} {child.stderr.strip().splitlines()[-1]}; "
                  f"{r['round1_ops']} ops, {r['round1_bytes'] / 1e6:.2f} MB so far", flush=True)
            continue
        print(f"{nodes:6d} {r['connect_s']:10.2f} {r['round1_s']:10.2f} {r['round1_ops']:8d} "
              f"{r['round1_bytes'] / 1e6:8.2f} {r['round2_s']:10.2f} {r['round2_ops']:8d} "
              f"{r['round2_bytes'] / 1e6:8.2f} {r['plan_s'] * 1e3:8.1f}", flush=True)


if __name__ == "__main__":
    main()
