"""ftmaster launch against what no relaunch on other GPUs can cure, end to end on CPU: a NaN
loss, a full disk, and its own SIGKILL."""

import os
import signal

import pytest

from ftmaster import runfiles
from ftmaster.recovery.checkpoints import iteration_dir, list_iterations, read_tracker
from ftmaster.recovery.manifest import digest_problem, read_manifest
from helpers.launch import (attempt_log, events, processes_mentioning, run_launch, start_launch,
                            train_args)
from helpers.trainer import wait_until
from helpers.tmpfs import small_tmpfs

pytestmark = pytest.mark.slow


def only(run_dir, name):
    found = events(run_dir, name)
    assert len(found) == 1, f"expected one {name} event, got {found}"
    return found[0]


def test_a_nan_loss_relaunches_from_the_newest_valid_checkpoint_on_the_same_gpus(tmp_path):
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    result = run_launch(run_dir, 2, train_args(save, 12, 1, 1, 3), "--inject", "nan:gpu=1,at=iter:7",
                        "--progress-interval", "1")
    assert result.returncode == 0, result.stdout[-4000:]
    failure = only(run_dir, "failure")
    assert (failure["attempt"], failure["cause"], failure["gpus"], failure["iteration"]) == \
        (1, "nonfinite", [], 6)
    assert [e["iteration"] for e in events(run_dir, "nonfinite")] == [7]
    assert "non-finite loss at iteration 7: stopped before the update, nothing saved" in result.stdout
    assert [e["gpus"] for e in events(run_dir, "launch")] == [[0, 1], [0, 1]]  # no GPU blamed
    (loaded,) = events(run_dir, "checkpoint_loaded")
    assert loaded["iteration"] == 6
    # The same layout reads every item once, each checked as it was read; the files checked
    # in full beforehand are only the small ones.
    shards = sum(p.stat().st_size for p in iteration_dir(save, 6).glob("*.distcp"))
    assert loaded["verified_on_read"] == shards
    saved = [e["iteration"] for e in events(run_dir, "periodic_save")]
    assert saved == [3, 6, 9, 12]  # nothing from the failed iteration 7
    assert only(run_dir, "complete")["iteration"] == 12
    assert "progress: iteration" in result.stdout


@pytest.fixture
def tiny_disk(tmp_path):
    """A tmpfs that holds two of these checkpoints and no more (root only)."""
    with small_tmpfs(tmp_path / "tiny", "7m") as folder:
        yield folder


def test_a_full_disk_is_named_on_the_console_never_blamed_on_a_gpu_nor_retried(tiny_disk, tmp_path):
    run_dir, save = tmp_path / "run", tiny_disk / "ckpt"
    result = run_launch(run_dir, 2, train_args(save, 8, 1, 1, 2))
    assert result.returncode == 93, result.stdout[-4000:]  # NVIDIA's "do not requeue"
    assert "do not requeue: a requeue would fail the same way (exit status 93)" in result.stdout
    assert "ENOSPC (No space left on device)" in result.stdout
    assert str(iteration_dir(save, 8)) in result.stdout
    failure = only(run_dir, "failure")
    assert (failure["cause"], failure["gpus"]) == ("storage", [])
    assert len(events(run_dir, "launch")) == 1  # a relaunch would only hit the same full disk
    assert "storage error" in only(run_dir, "gave_up")["reason"]
    assert "on GPU" not in result.stdout.split("attempt 1 failed")[1].splitlines()[0]
    assert read_tracker(save) == max(list_iterations(save))
    for iteration in list_iterations(save):
        manifest = read_manifest(iteration_dir(save, iteration))
        assert digest_problem(iteration_dir(save, iteration), manifest, sorted(manifest.files)) is None


def test_a_supervisor_started_again_continues_the_attempts_of_a_killed_one(tmp_path):
    """GPU 1 fails at iteration 6 and is retired; the relaunch on GPUs 0 and 2 saves at 10,
    then ftmaster is SIGKILLed. The one started again on the run directory continues the
    attempt numbers, resumes from --save, and retires GPU 1 again before its first launch: a
    fresh monitor would see no fault on it (an injected one here; on GPUs, a drained straggler
    or a hung rank's GPU)."""
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    args = train_args(save, 40, 1, 1, 5, global_batch=12)  # DP 3 and DP 2 divide it
    first = start_launch(run_dir, 3, args, "--inject", "fail:gpu=1,at=iter:6")
    try:
        wait_until(lambda: len(events(run_dir, "launch")) == 2 and (read_tracker(save) or 0) >= 10,
                   timeout=300, interval=0.2, what="the relaunch's checkpoint at 10")
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        wait_until(lambda: not processes_mentioning(f"{tmp_path}/"), timeout=30,
                   what="the killed ftmaster's trainers to die with it")
    finally:
        if first.poll() is None:
            first.kill()
    resumed_from = read_tracker(save)
    result = run_launch(run_dir, 3, args)
    assert result.returncode == 0, result.stdout[-4000:]
    launches = events(run_dir, "launch")
    assert [(e["attempt"], e["gpus"]) for e in launches] == [(1, [0, 1, 2]), (2, [0, 2]), (3, [0, 2])]
    failures = events(run_dir, "failure")
    assert [(f["attempt"], f["cause"]) for f in failures][1:] == [(2, "supervisor_lost")]
    assert failures[1]["iteration"] >= resumed_from
    replanned = events(run_dir, "plan")[-1]
    assert replanned["boot"] is not None and replanned["time"] > failures[1]["time"]
    assert [r["gpu"] for r in replanned["gpus_retired"]] == [1]
    assert replanned["gpus_retired"][0]["reason"].startswith("retired by the ftmaster before this one")
    assert "retiring GPU 1: retired by the ftmaster before this one" in result.stdout
    assert events(run_dir, "checkpoint_loaded")[-1]["iteration"] == resumed_from
    assert f"loaded checkpoint from {iteration_dir(save, resumed_from)}" in attempt_log(run_dir, 3)
    assert "loaded checkpoint" not in attempt_log(run_dir, 1)  # logs are not mixed
    assert only(run_dir, "complete")["iteration"] == 40
    assert runfiles.read_heartbeat(run_dir)["finished"]
