"""The torchrun argv that starts one training attempt on a single node."""

from __future__ import annotations

import sys
from typing import Sequence


def torchrun_argv(command: Sequence[str], nproc_per_node: int, *,
                  python: str = sys.executable) -> list[str]:
    """``[python, -m, torch.distributed.run, ..., SCRIPT, *args]`` as an argv list.

    ``--standalone`` lets the rendezvous bind a free local port itself (``localhost:0``), so
    two attempts, or two jobs, on one machine never race for a fixed master port.
    ``--max-restarts 0`` because the supervisor, not torchrun, decides what a restart is: a
    torchrun restart would reuse the layout of the GPU that was just lost.
    """
    if nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be a positive integer, got {nproc_per_node}")
    if not command:
        raise ValueError("the training command is empty: give SCRIPT and its arguments")
    return [python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc_per_node), "--max-restarts", "0", *command]
