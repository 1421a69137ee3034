"""Several ftmaster nodes on one machine: real processes joined through torch elastic's c10d
rendezvous on loopback, each with its own node rank and folder in one shared run dir."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ftmaster import runfiles
from helpers.netns import Host
from helpers.trainer import PRETRAIN, REPO, free_port, trainer_env

LOOPBACK = Host("", "127.0.0.1")

# Short enough for tests: a dead node is dropped 3 s after its last keep-alive, a round with
# fewer than the most nodes closes 2 s after the least joined.
FAST_RENDEZVOUS = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"


class Nodes:
    """The ftmaster processes of one multi-node job; each node's output in ``node<R>.out``."""

    def __init__(self, root: Path, nproc: int, args: list[str], *options: str,
                 nnodes: str = "1:2", hosts: tuple[Host, ...] = (), conf: str = FAST_RENDEZVOUS,
                 endpoint: str | None = None) -> None:
        self.root, self.nproc, self.args, self.options = Path(root), nproc, args, options
        self.run_dir = self.root / "run"
        self.port = free_port()
        self.endpoint = endpoint
        self.nnodes, self.hosts, self.conf = nnodes, hosts, conf
        self.processes: dict[int, subprocess.Popen] = {}

    def host(self, node_rank: int) -> Host:
        """Node R's host: its network namespace, or loopback when there are none."""
        return self.hosts[node_rank] if self.hosts else LOOPBACK

    def argv(self, node_rank: int, *extra: str) -> list[str]:
        host = self.host(node_rank)
        prefix = host.prefix if host.name else []
        # Node 0 hosts the c10d store whichever node starts first (on loopback every node
        # matches the endpoint, and torch lets the first one to bind host it).
        conf = self.conf if self.endpoint else f"{self.conf},is_host={int(node_rank == 0)}"
        return [*prefix, sys.executable, "-m", "ftmaster.cli", "launch", "--nnodes", self.nnodes,
                "--nproc-per-node", str(self.nproc), "--node-rank", str(node_rank),
                "--rdzv-endpoint", self.endpoint or f"{self.host(0).addr}:{self.port}",
                "--local-addr", host.addr,
                "--rdzv-conf", conf, "--run-dir", str(self.run_dir),
                "--monitor-backend", "sim", "--monitor-interval", "0.5", *self.options, *extra,
                "--", PRETRAIN, *self.args]

    def start(self, node_rank: int, *extra: str) -> subprocess.Popen:
        """Start one node's ftmaster in a session of its own (so it can be killed whole)."""
        out = open(self.output_path(node_rank), "a")
        # In a namespace of its own a node has one interface for gloo: eth0.
        env = trainer_env(GLOO_SOCKET_IFNAME="eth0") if self.hosts else trainer_env()
        process = subprocess.Popen(self.argv(node_rank, *extra), stdout=out,
                                   stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                   start_new_session=True)
        self.processes[node_rank] = process
        return process

    def start_all(self, count: int = 2, *extra_for: tuple[str, ...]) -> None:
        """Node 0 last: the others wait for the store it hosts (up to ``read_timeout``) and
        join as soon as it is up, so every node is in the first round however long each
        one's start-up takes. Started the other way round, a node slower to start than
        node 0 by ``last_call_timeout`` misses it and joins the next round."""
        for node_rank in (*range(1, count), 0):
            self.start(node_rank, *(extra_for[node_rank] if node_rank < len(extra_for) else ()))

    def output_path(self, node_rank: int) -> Path:
        return self.root / f"node{node_rank}.out"

    def output(self, node_rank: int) -> str:
        return self.output_path(node_rank).read_text()

    def node_dir(self, node_rank: int) -> Path:
        return self.run_dir / f"node_{node_rank}"

    def events(self, node_rank: int, name: str) -> list[dict]:
        return [e for e in runfiles.read_events(self.node_dir(node_rank)) if e["event"] == name]

    def iteration(self, node_rank: int) -> int:
        return (runfiles.read_heartbeat(self.node_dir(node_rank)) or {}).get("iteration", 0)

    def wait(self, node_rank: int, timeout: float = 600) -> int:
        return self.processes[node_rank].wait(timeout=timeout)

    def kill_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
