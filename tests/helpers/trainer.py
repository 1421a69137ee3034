"""Launch the real trainer under torch.distributed.run and read its log lines."""

from __future__ import annotations

import atexit
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from ftmaster.recovery.checkpoints import iteration_dir, tracker_path

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

# Megatron-LM's Llama recipe in miniature: GQA, SwiGLU, RMSNorm, RoPE, no biases, untied
# output, selective recompute; the distributed optimizer, as Megatron-LM users run it.
TINY_LLAMA = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "32",
    "--seq-length", "32", "--max-position-embeddings", "32", "--swiglu",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-base", "500000",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--init-method-std", "0.02",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--recompute-granularity", "selective",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--mock-data", "--vocab-size", "100", "--make-vocab-size-divisible-by", "64",
    "--micro-batch-size", "2", "--global-batch-size", "12", "--train-iters", "6", "--lr", "1e-2",
    "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--seed", "3",
    "--log-interval", "1", "--eval-iters", "0", "--distributed-timeout-minutes", "0.5",
    "--use-distributed-optimizer",
]

# The resume-across-layouts scenario: train at TP2xPP2, resume under each of these.
RESUME_SCHEDULE = ["--micro-batch-size", "2", "--global-batch-size", "12", "--train-iters", "12",
                   "--lr", "1e-2", "--min-lr", "1e-4", "--lr-warmup-iters", "2",
                   "--lr-decay-style", "cosine", "--seed", "7"]
RESUME_LAYOUTS = {  # name: (processes, TP, PP)
    "tp2pp2": (4, 2, 2),
    "tp1pp1": (1, 1, 1),
    "tp1pp2": (2, 1, 2),
    "tp1pp1dp3": (3, 1, 1),
}
SAVE_LINE = re.compile(r"saved \w+ checkpoint at iteration (\d+) to \S+ in ([\d.]+) s \((\d+) bytes\)")
LOAD_LINE = re.compile(r"loaded checkpoint from \S+ at iteration (\d+) in ([\d.]+) s \((\d+) bytes\)")


def layout_args(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


ITERATION_LINE = re.compile(
    r"iteration (\d+)/(\d+) \| consumed samples: (\d+) \| elapsed time per iteration \(ms\): "
    r"([\d.]+) \| learning rate: ([\d.E+-]+) \| global batch size: (\d+) \| lm loss: ([\d.E+-]+) \|")


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_HANDED_OUT: set[int] = set()
"""The ports :func:`free_port` gave this process: one given is free until its torchrun binds
it, seconds later (after torch's imports), and must not be given again meanwhile."""


def _worker_slot() -> tuple[int, int]:
    """This pytest-xdist worker's index and the number of workers ((0, 1) without xdist)."""
    index = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if index.isdigit() and count.isdigit() and int(index) < int(count):
        return int(index), int(count)
    return 0, 1


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: one the kernel hands out (a bind
    to port 0, gloo's connections) could be taken again before torchrun binds it, which
    failed a test with EADDRINUSE while other tests ran beside it. Each xdist worker picks
    from its own share of that range, and never the same port twice: a port is only checked
    free, and two workers' checks could pass for one port in the seconds before either
    torchrun binds it (the likely cause of one more EADDRINUSE, in a suite run on 2026-12-07;
    what else held the port was not recorded)."""
    low = _ephemeral_ports()[0]
    worker, workers = _worker_slot()
    ours = [port for port in range(max(1024, low - 12000) + worker, low, workers)
            if port not in _HANDED_OUT]
    for port in random.sample(ours, min(50, len(ours))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# torch elastic's own folder for every torchrun the tests start, removed when they end:
# left to itself, each torchrun makes a /tmp/torchelastic_* folder and keeps it.
TORCHRUN_LOGS = Path(tempfile.mkdtemp(prefix="ftmaster-tests-torchrun-"))
atexit.register(shutil.rmtree, TORCHRUN_LOGS, True)


def torchrun_argv(nproc: int, args: list[str], nodes: tuple[int, int] | None = None,
                  port: int | None = None) -> list[str]:
    """torchrun of the trainer on loopback; ``nodes``: (node count, this node's rank)."""
    placement = [] if nodes is None else ["--nnodes", str(nodes[0]), "--node-rank", str(nodes[1])]
    return [sys.executable, "-m", "torch.distributed.run", *placement, "--nproc-per-node",
            str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port or free_port()),
            "--log-dir", str(TORCHRUN_LOGS), PRETRAIN, *args]


def trainer_env(**extra: str) -> dict[str, str]:
    """The environment of a test's training or ftmaster process: one thread per rank, and no
    SLURM variables (a CI job run under SLURM would otherwise hand them its rendezvous)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_trainer(nproc: int, args: list[str], timeout: float = 300, **env: str):
    """Run to completion; returns the CompletedProcess with stdout and stderr merged. A run
    past ``timeout`` is killed whole before the test fails: torchrun's workers, in process
    groups of their own, outlived the SIGKILL ``subprocess.run`` gives torchrun alone, and one
    stuck in a loop kept a core busy for the rest of the suite."""
    process = subprocess.Popen(torchrun_argv(nproc, args), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=trainer_env(**env),
                               cwd=REPO, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(process)
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def iterations(log: str) -> dict[int, dict]:
    """Iteration number -> {consumed, loss, elapsed_ms, lr, global_batch} from Megatron log
    lines."""
    found = {}
    for match in ITERATION_LINE.finditer(log):
        found[int(match.group(1))] = {
            "consumed": int(match.group(3)), "elapsed_ms": float(match.group(4)),
            "lr": float(match.group(5)), "global_batch": int(match.group(6)),
            "loss": float(match.group(7))}
    return found


def start_trainer(nproc: int, args: list[str], log: Path, **env: str) -> subprocess.Popen:
    """Start in the background in its own session, stdout and stderr into ``log``.

    A session of its own lets ``kill_session`` reach every process the run started, including
    megatron-core's checkpoint-writer helpers, which outlive a SIGKILLed rank.
    """
    with open(log, "w") as handle:
        return subprocess.Popen(torchrun_argv(nproc, args), stdout=handle,
                                stderr=subprocess.STDOUT, env=trainer_env(**env), cwd=REPO,
                                start_new_session=True)


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL torchrun and every descendant: its workers run in process groups of their own."""
    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    for descendant in descendants:
        try:
            descendant.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def wait_until(predicate, timeout: float, interval: float = 0.02, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; fail the test on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def worker_with_local_rank(torchrun: subprocess.Popen, local_rank: int) -> psutil.Process:
    for child in psutil.Process(torchrun.pid).children():
        if child.environ().get("LOCAL_RANK") == str(local_rank):
            return child
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank}")


def train(nproc, args, save, *extra):
    """Train to the end, saving every 3 iterations; the iteration lines by number."""
    result = run_trainer(nproc, [*args, "--save", str(save), "--save-interval", "3", *extra])
    assert result.returncode == 0, result.stdout[-3000:]
    return iterations(result.stdout)


def from_iteration_3(trained, tmp_path):
    """A copy of the run's checkpoints as they were at iteration 3."""
    save = tmp_path / "resume"
    shutil.copytree(trained, save)
    shutil.rmtree(iteration_dir(save, 6))
    tracker_path(save).write_text("3\n")
    return save


def assert_follows(resumed, reference, band=0.02):
    assert sorted(resumed) == [4, 5, 6]
    for it in (4, 5, 6):
        assert abs(resumed[it]["loss"] - reference[it]["loss"]) <= band * reference[it]["loss"], it
