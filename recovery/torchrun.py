"""The torchrun argv that starts one training attempt on this node."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
"""How long torchrun's agent lets its workers end after a signal of its own before it
SIGKILLs them (read since pytorch/pytorch#172596, 2026; before it the wait is always 30 s)."""
SHUTDOWN_MARGIN_S = 30


def shutdown_timeout_env(stop_timeout_s: float) -> dict[str, str]:
    """torchrun's wait for its workers after a signal of its own, past ftmaster's deadline.

    A SLURM step, or a systemd unit, signals every process in it, torchrun too: with torch's
    30 s its agent SIGKILLed the ranks in the middle of a save that ``--stop-timeout``
    allowed. Past the deadline, ftmaster's own kill comes first and is the one reported."""
    return {SHUTDOWN_TIMEOUT_ENV: str(math.ceil(stop_timeout_s) + SHUTDOWN_MARGIN_S)}


@dataclass(frozen=True)
class StaticWorld:
    """A generation of a multi-node job, as every node's static torchrun sees it."""

    nnodes: int
    """Nodes that run ranks in this generation (standby spares are not counted)."""
    node_rank: int
    """This node's place among them; ranks are contiguous per node, in this order."""
    master_addr: str
    master_port: int
    rank_offset: int = 0
    """Ranks on the nodes before this one (torchrun learns it in its rendezvous; a launch on
    warm workers has no agent to ask)."""
    world_size: int = 0
    """Ranks on every node; 0 when only torchrun's agents know it."""

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node rank {self.node_rank} is outside {self.nnodes} nodes")


def torchrun_argv(command: Sequence[str], nproc_per_node: int, *,
                  python: str = sys.executable, world: StaticWorld | None = None,
                  log_dir: Path | None = None) -> list[str]:
    """``[python, -m, torch.distributed.run, ..., SCRIPT, *args]`` as an argv list.

    On one node, ``--standalone`` lets the rendezvous bind a free local port itself
    (``localhost:0``), so two attempts, or two jobs, on one machine never race for a fixed
    master port. Across nodes, a plain static torchrun for the generation ftmaster agreed on:
    its node count, this node's rank among them and the master its plan chose; each node may
    run another ``--nproc-per-node`` (torch assigns contiguous ranks by node rank).
    ``--max-restarts 0`` because the supervisor, not torchrun, decides what a restart is: a
    torchrun restart would reuse the layout of the GPU that was just lost. ``--log-dir``
    keeps torch elastic's folder (each rank's ``error.json``) with the attempt: without it,
    every torchrun leaves a ``torchelastic_*`` folder in the system's temporary directory.

    The rendezvous is spelled out whole (``--rdzv-backend static``, its endpoint, an empty
    ``--rdzv-conf``): torchrun takes an option left out from ``PET_<OPTION>`` in the
    environment, which the attempt inherits, and a Kubeflow PyTorchJob, say, sets
    ``PET_RDZV_BACKEND=c10d`` and ``PET_RDZV_ENDPOINT``: that turned each node's static
    torchrun into a c10d rendezvous at the job's endpoint.
    """
    if nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be a positive integer, got {nproc_per_node}")
    if not command:
        raise ValueError("the training command is empty: give SCRIPT and its arguments")
    if world is None:
        nodes = ["--standalone", "--nnodes", "1"]
    else:
        # The endpoint torch makes of --master-addr and --master-port for a static rendezvous.
        nodes = ["--nnodes", str(world.nnodes), "--node-rank", str(world.node_rank),
                 "--rdzv-backend", "static",
                 "--rdzv-endpoint", f"{world.master_addr}:{world.master_port}",
                 "--master-addr", world.master_addr, "--master-port", str(world.master_port)]
    logs = [] if log_dir is None else ["--log-dir", str(log_dir)]
    return [python, "-m", "torch.distributed.run", *nodes, "--rdzv-conf", "",
            "--nproc-per-node", str(nproc_per_node), "--max-restarts", "0", *logs, *command]
