"""Launch the real trainer under torch.distributed.run and read its log lines."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = str(REPO / "pretrain_gpt.py")

# A small GPT that every layout in the tests can hold: heads, hidden and FFN divide by 2,
# layers by 2, and the vocabulary pads to 128 under TP 1 and 2 alike. A small vocabulary
# lets the loss fall fast on mock data, so a broken resume shows in the loss.
SMALL_GPT = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--mock-data", "--vocab-size", "100", "--make-vocab-size-divisible-by", "64",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--eval-iters", "0", "--distributed-timeout-minutes", "1",
]

ITERATION_LINE = re.compile(
    r"iteration (\d+)/(\d+) \| consumed samples: (\d+) \| elapsed time per iteration \(ms\): "
    r"([\d.]+) \| learning rate: ([\d.E+-]+) \| global batch size: (\d+) \| lm loss: ([\d.E+-]+) \|")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_argv(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), PRETRAIN, *args]


def trainer_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_trainer(nproc: int, args: list[str], timeout: float = 300, **env: str):
    """Run to completion; returns the CompletedProcess with stdout and stderr merged."""
    return subprocess.run(torchrun_argv(nproc, args), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          env=trainer_env(**env), cwd=REPO)


def iterations(log: str) -> dict[int, dict]:
    """Iteration number -> {consumed, loss, elapsed_ms, lr} from Megatron log lines."""
    found = {}
    for match in ITERATION_LINE.finditer(log):
        found[int(match.group(1))] = {
            "consumed": int(match.group(3)), "elapsed_ms": float(match.group(4)),
            "lr": float(match.group(5)), "loss": float(match.group(7))}
    return found
