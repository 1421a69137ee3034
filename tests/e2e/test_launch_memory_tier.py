"""ftmaster launch with the memory tier (Megatron-LM's --non-persistent-ckpt-type global): the
emergency save lands in /dev/shm, ftmaster persists it to --save in the background, and the
relaunch resumes from the newest copy, from the disk tier when the memory one is gone."""

import shutil
from pathlib import Path

import pytest

from ftmaster.recovery.argv_flags import flag_value
from ftmaster.recovery.checkpoints import iteration_dir, read_tracker
from helpers.launch import events, run_launch, start_launch, train_args
from helpers.trainer import wait_until

pytestmark = pytest.mark.slow


def demo_args(save):
    """The demo scenario (TP2 x PP2, 30 iterations), with the memory tier on."""
    return train_args(save, 30, 2, 2, 100, "--emergency-save-gap-frac", "0.05",
                      "--non-persistent-ckpt-type", "global", global_batch=24)


INJECT = ("--seed", "2", "--inject", "degrade:gpu=1,at=iter:8", "--inject", "fail:gpu=1,at=iter:16")


def memory_folder(run_dir) -> Path:
    """The folder ftmaster picked in /dev/shm, from the first launch's command."""
    command = events(run_dir, "launch")[0]["command"]
    return Path(flag_value(command, "--non-persistent-global-ckpt-dir"))


def test_the_emergency_save_lands_in_memory_is_persisted_and_resumed_from(tmp_path):
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    result = run_launch(run_dir, 4, demo_args(save), *INJECT)
    folder = memory_folder(run_dir)
    shutil.rmtree(folder, ignore_errors=True)
    assert result.returncode == 0, result.stdout[-4000:]
    assert str(folder).startswith("/dev/shm/ftmaster-run-")
    (saved,) = events(run_dir, "emergency_save")
    assert saved["tier"] == "memory" and 8 <= saved["iteration"] < 16
    persisted = events(run_dir, "persisted")[0]
    assert persisted["iteration"] == saved["iteration"] and persisted["time"] > saved["time"]
    assert persisted["bytes"] == saved["bytes"]
    (failure,) = events(run_dir, "failure")
    assert persisted["time"] < failure["time"]
    (loaded,) = events(run_dir, "checkpoint_loaded")
    assert (loaded["iteration"], loaded["tier"]) == (saved["iteration"], "memory")  # memory on a tie
    assert read_tracker(save) == 30
    assert f"removed the memory tier {folder}" in result.stdout  # everything in it is on disk


def test_with_the_memory_tier_gone_the_relaunch_resumes_from_the_persisted_copy(tmp_path):
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    ftmaster = start_launch(run_dir, 4, demo_args(save), *INJECT)
    try:
        wait_until(lambda: events(run_dir, "failure"), timeout=600, interval=0.05,
                   what="the failure")
        folder = memory_folder(run_dir)
        shutil.rmtree(folder)  # a node reboot, or a container restart, loses /dev/shm
        output, _ = ftmaster.communicate(timeout=600)
    finally:
        if ftmaster.poll() is None:
            ftmaster.kill()
        shutil.rmtree(memory_folder(run_dir), ignore_errors=True)
    assert ftmaster.returncode == 0, output[-4000:]
    (saved,) = events(run_dir, "emergency_save")
    (loaded,) = events(run_dir, "checkpoint_loaded")
    assert (loaded["iteration"], loaded["tier"]) == (saved["iteration"], "disk")
    assert loaded["path"] == str(iteration_dir(save, saved["iteration"]))
    assert read_tracker(save) == 30
