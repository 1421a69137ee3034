"""--exit-signal-handler: on SIGTERM every rank saves at the same iteration and exits 0."""

import signal
import subprocess
import time

import psutil
import pytest

from ftmaster.recovery.checkpoints import checkpoint_problem, iteration_dir, read_tracker
from helpers.trainer import REPO, SMALL_GPT, torchrun_argv, trainer_env

pytestmark = pytest.mark.slow


def wait_for_line(process, needle, deadline):
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"never saw {needle!r}:\n{''.join(seen[-40:])}")


def test_sigterm_saves_on_every_rank_and_exits_zero(tmp_path):
    save = tmp_path / "save"
    process = subprocess.Popen(
        torchrun_argv(2, SMALL_GPT + [
            "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
            "--train-iters", "10000", "--lr", "1e-3", "--save", str(save),
            "--exit-signal-handler"]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=trainer_env(),
        cwd=REPO)
    try:
        wait_for_line(process, "iteration 3/10000", time.monotonic() + 180)
        for worker in psutil.Process(process.pid).children():
            worker.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, rest[-3000:]
    saved_at = read_tracker(save)
    assert saved_at is not None and saved_at >= 3
    assert f"exiting on SIGTERM after iteration {saved_at}" in rest
    assert checkpoint_problem(iteration_dir(save, saved_at)) is None
