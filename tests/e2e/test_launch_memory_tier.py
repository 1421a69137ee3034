"""ftmaster launch with the memory tier (Megatron-LM's --non-persistent-ckpt-type global): the
emergency save lands in /dev/shm, ftmaster persists it to --save in the background, and the
relaunch resumes from the newest copy, from the disk tier when the memory one is gone."""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from ftmaster.recovery.argv_flags import flag_value
from ftmaster.recovery.checkpoints import iteration_dir, read_tracker
from helpers.launch import events, start_launch, train_args
from helpers.trainer import wait_until

pytestmark = pytest.mark.slow


def demo_args(save):
    """The demo scenario (TP2 x PP2, 30 iterations), with the memory tier on."""
    return train_args(save, 30, 2, 2, 100, "--emergency-save-gap-frac", "0.05",
                      "--non-persistent-ckpt-type", "global", global_batch=24)


# GPU 1 fails once the emergency save is on disk too, however fast the machine trains. The
# second failure is the test's own kill, after it has deleted the memory folder. An injection
# at an iteration raced the test: the supervisor applies injections before it copies the
# trainer's events, so GPU 2 could fail before the test saw the load, and the folder could go
# between the supervisor's check and the next load (CI once saw three failures).
INJECT = ("--seed", "2", "--inject", "degrade:gpu=1,at=iter:8",
          "--inject", "fail:gpu=1,at=iter:16,after=persisted")


def memory_folder(run_dir) -> Path:
    """The folder ftmaster picked in /dev/shm, from the first launch's command."""
    command = events(run_dir, "launch")[0]["command"]
    return Path(flag_value(command, "--non-persistent-global-ckpt-dir"))


def kill_rank_on(run_dir: Path, gpu: int) -> None:
    """SIGKILL the newest attempt's rank on ``gpu``, a real crash."""
    launch = events(run_dir, "launch")[-1]
    record = run_dir / "ranks" / f"attempt_{launch['attempt']}" / \
        f"local_rank_{launch['gpus'].index(gpu)}.json"
    os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)


def test_the_newest_copy_is_resumed_from_memory_then_from_disk_once_memory_is_gone(tmp_path):
    """The emergency save lands in memory and is persisted before GPU 1 fails; the relaunch
    resumes from memory. Then the memory folder is deleted (a node reboot, or a container
    restart, loses /dev/shm) before GPU 2 fails: the next relaunch resumes from the persisted
    copy of the same checkpoint."""
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    ftmaster = start_launch(run_dir, 4, demo_args(save), *INJECT)
    try:
        wait_until(lambda: events(run_dir, "checkpoint_loaded"), timeout=600, interval=0.05,
                   what="the first relaunch's load")
        folder = memory_folder(run_dir)
        assert str(folder).startswith("/dev/shm/ftmaster-run-")
        shutil.rmtree(folder)
        kill_rank_on(run_dir, gpu=2)
        output, _ = ftmaster.communicate(timeout=600)
    finally:
        if ftmaster.poll() is None:
            ftmaster.kill()
        shutil.rmtree(memory_folder(run_dir), ignore_errors=True)
    assert ftmaster.returncode == 0, output[-4000:]
    (saved,) = events(run_dir, "emergency_save")
    assert saved["tier"] == "memory" and 8 <= saved["iteration"]
    persisted = events(run_dir, "persisted")[0]
    assert persisted["iteration"] == saved["iteration"] and persisted["time"] > saved["time"]
    assert persisted["bytes"] == saved["bytes"]
    failures = events(run_dir, "failure")
    assert len(failures) == 2, failures
    first_failure, second_failure = failures
    assert persisted["time"] < first_failure["time"] and second_failure["gpus"] == [2]
    from_memory, from_disk = events(run_dir, "checkpoint_loaded")
    assert (from_memory["iteration"], from_memory["tier"]) == (saved["iteration"], "memory")
    assert (from_disk["iteration"], from_disk["tier"]) == (saved["iteration"], "disk")
    assert from_disk["path"] == str(iteration_dir(save, saved["iteration"]))
    (lost,) = events(run_dir, "memory_tier_lost")  # said on the console, not silent
    assert (lost["iteration"], lost["path"]) == (saved["iteration"], str(folder))
    assert read_tracker(save) == 30


def test_a_supervisor_killed_while_it_persists_leaves_the_disk_tracker_as_it_was(tmp_path):
    """SIGKILL of ftmaster itself half way through a copy (77 MB checkpoints): no iteration
    folder appears in --save and its tracker names only what was there before."""
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    args = train_args(save, 40, 1, 2, 5, "--non-persistent-ckpt-type", "global",
                      "--non-persistent-save-interval", "2")
    args[args.index("--hidden-size") + 1] = "256"
    args[args.index("--num-layers") + 1] = "8"
    ftmaster = start_launch(run_dir, 2, args)
    try:
        partial = wait_until(lambda: next((f for f in save.glob(".iter_*.partial-*/*") if
                                           f.stat().st_size > 0), None),
                             timeout=300, interval=0.002, what="a copy under way").parent
        tracker_before = read_tracker(save)
        ftmaster.kill()
        ftmaster.wait(30)
    finally:
        if ftmaster.poll() is None:
            ftmaster.kill()
        shutil.rmtree(memory_folder(run_dir), ignore_errors=True)
    copied = int(partial.name[len(".iter_"):].split(".")[0])
    assert partial.exists() and not iteration_dir(save, copied).exists()  # never put in place
    assert read_tracker(save) == tracker_before and (tracker_before or 0) < copied
