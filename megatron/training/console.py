"""Console output from the trainer: one writer per line, flushed, so logs interleave cleanly."""

from __future__ import annotations

import os
import sys

import torch


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def local_rank() -> int:
    """This process's GPU on its node: torchrun's ``LOCAL_RANK``, else ``SLURM_LOCALID`` (one
    process per GPU started by ``srun`` itself), else 0 (a single process)."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def log_rank0(message: str) -> None:
    if _rank() == 0:
        print(message, flush=True)


def log_last_rank(message: str) -> None:
    """Megatron prints iteration lines from the last rank, which holds the loss."""
    if not torch.distributed.is_initialized() or _rank() == torch.distributed.get_world_size() - 1:
        print(message, flush=True)


def error(message: str) -> None:
    error_line(f"error: {message}")


def error_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def error_once_per_node(message: str) -> None:
    """An error every rank found alike: said once on each node (by its local rank 0), since
    each node's ftmaster reads only its own ranks' output."""
    if local_rank() == 0:
        error(message)


def format_iteration_line(iteration: int, train_iters: int, consumed: int, elapsed_ms: float,
                          learning_rate: float, global_batch_size: int,
                          lm_loss: float | None) -> str:
    """Megatron's iteration log line, as in the DESIGN contract."""
    loss = "" if lm_loss is None else f" lm loss: {lm_loss:.6E} |"
    return (f"iteration {iteration}/{train_iters} | consumed samples: {consumed} | "
            f"elapsed time per iteration (ms): {elapsed_ms:.1f} | "
            f"learning rate: {learning_rate:.6E} | global batch size: {global_batch_size} |"
            f"{loss}")
