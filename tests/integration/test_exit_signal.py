"""--exit-signal-handler: on SIGTERM every rank saves at the same iteration and exits 0."""

import signal
import subprocess
import sys

import psutil
import pytest

from ftmaster import runfiles
from ftmaster.recovery.checkpoints import checkpoint_problem, iteration_dir, read_tracker
from helpers.trainer import (PRETRAIN, REPO, SMALL_GPT, kill_session, start_trainer,
                             trainer_env, wait_until)

pytestmark = pytest.mark.slow


def test_sigterm_saves_on_every_rank_and_exits_zero(tmp_path):
    """One rank signalled is enough (the ranks agree to stop); its last heartbeat says that
    training did not finish, so that a supervisor that did not send the signal resumes it."""
    save, log, run_dir = tmp_path / "save", tmp_path / "train.log", tmp_path / "run"
    process = start_trainer(2, SMALL_GPT + [
        "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
        "--train-iters", "10000", "--lr", "1e-3", "--save", str(save),
        "--exit-signal-handler"], log, FTMASTER_RUN_DIR=str(run_dir))
    try:
        wait_until(lambda: "iteration 3/10000" in log.read_text(), 180, what="iteration 3")
        psutil.Process(process.pid).children()[-1].send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=120)
    finally:
        kill_session(process)
    output = log.read_text()
    assert returncode == 0, output[-3000:]
    saved_at = read_tracker(save)
    assert saved_at is not None and saved_at >= 3
    assert f"exiting on SIGTERM after iteration {saved_at}" in output
    assert checkpoint_problem(iteration_dir(save, saved_at)) is None
    heartbeat = runfiles.read_heartbeat(run_dir)
    assert (heartbeat["iteration"], heartbeat["finished"]) == (saved_at, False)


def test_a_rank_killed_by_sigkill_leaves_no_helper_process(tmp_path):
    """With --async-save, torch_dist's write-result server is a spawned interpreter per rank
    (without it the results stay in the rank); it must not outlive a rank that dies without
    cleaning up, as every rank on a lost GPU does."""
    log = tmp_path / "train.log"
    process = start_trainer(1, SMALL_GPT + [
        "--micro-batch-size", "2", "--train-iters", "10000", "--lr", "1e-3",
        "--save", str(tmp_path / "save"), "--async-save"], log)
    try:
        wait_until(lambda: "iteration 2/10000" in log.read_text(), 180, what="iteration 2")
        (worker,) = psutil.Process(process.pid).children()
        helpers = worker.children(recursive=True)
        assert helpers, "expected the write-result server among the rank's children"
        worker.kill()
        gone, alive = psutil.wait_procs(helpers, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        kill_session(process)


SIGNALLED_AT = """
import os, runpy, signal, sys
from megatron.training import training
step = training.Trainer.train_step
def train_step(self):
    loss = step(self)
    if self.state.iteration == {iteration}:  # after this iteration's agreement was sampled
        os.kill(os.getpid(), signal.SIGTERM)
    return loss
training.Trainer.train_step = train_step
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def test_sigterm_agreed_at_the_last_iteration_finishes_training(tmp_path):
    """A SIGTERM during iteration 4 of 5 is agreed at the end of 5, the last: the exit save is
    training's last checkpoint, and the heartbeat says training finished, so a supervisor
    that did not send the signal does not take it for a stop and relaunch."""
    save, run_dir, script = tmp_path / "save", tmp_path / "run", tmp_path / "signalled.py"
    script.write_text(SIGNALLED_AT.format(iteration=4, script=PRETRAIN))
    result = subprocess.run(
        [sys.executable, str(script), *SMALL_GPT, "--micro-batch-size", "2", "--train-iters",
         "5", "--lr", "1e-3", "--save", str(save), "--exit-signal-handler"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env=trainer_env(FTMASTER_RUN_DIR=str(run_dir)))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "exiting on SIGTERM after iteration 5" in result.stdout
    assert read_tracker(save) == 5
    heartbeat = runfiles.read_heartbeat(run_dir)
    assert (heartbeat["iteration"], heartbeat["finished"]) == (5, True)


def test_the_exit_save_answers_a_request_still_waiting_out_the_gap(tmp_path):
    """Without ftmaster (--emergency-save-flag-dir), a request waiting out the gap filter at a
    SIGTERM is answered by the exit save: its flag is removed, or the next run on the folder
    would save unasked."""
    save, script = tmp_path / "save", tmp_path / "signalled.py"
    flag = tmp_path / "flags" / runfiles.SAVE_NOW_FLAG
    runfiles.write_flag(flag, source="test")
    script.write_text(SIGNALLED_AT.format(iteration=2, script=PRETRAIN))
    result = subprocess.run(
        [sys.executable, str(script), *SMALL_GPT, "--micro-batch-size", "2", "--train-iters",
         "10", "--lr", "1e-3", "--save", str(save), "--save-interval", "100",
         "--exit-signal-handler", "--emergency-save-flag-dir", str(flag.parent)],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=trainer_env())
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "exiting on SIGTERM after iteration 3" in result.stdout
    assert "emergency checkpoint" not in result.stdout and read_tracker(save) == 3
    assert not flag.exists()
