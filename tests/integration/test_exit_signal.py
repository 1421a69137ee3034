"""--exit-signal-handler: on SIGTERM every rank saves at the same iteration and exits 0."""

import signal

import psutil
import pytest

from ftmaster.recovery.checkpoints import checkpoint_problem, iteration_dir, read_tracker
from helpers.trainer import SMALL_GPT, kill_session, start_trainer, wait_until

pytestmark = pytest.mark.slow


def test_sigterm_saves_on_every_rank_and_exits_zero(tmp_path):
    save, log = tmp_path / "save", tmp_path / "train.log"
    process = start_trainer(2, SMALL_GPT + [
        "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
        "--train-iters", "10000", "--lr", "1e-3", "--save", str(save),
        "--exit-signal-handler"], log)
    try:
        wait_until(lambda: "iteration 3/10000" in log.read_text(), 180, what="iteration 3")
        for worker in psutil.Process(process.pid).children():
            worker.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=120)
    finally:
        kill_session(process)
    output = log.read_text()
    assert returncode == 0, output[-3000:]
    saved_at = read_tracker(save)
    assert saved_at is not None and saved_at >= 3
    assert f"exiting on SIGTERM after iteration {saved_at}" in output
    assert checkpoint_problem(iteration_dir(save, saved_at)) is None
