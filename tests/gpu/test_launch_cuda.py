"""ftmaster launch on real GPUs with the NVML monitor: every attempt's CUDA_VISIBLE_DEVICES
names GPUs by UUID, a killed rank is relaunched from the newest checkpoint, and the run
finishes with its last checkpoint. Skips with fewer than 2 GPUs or without a driver."""

import os
import signal

import psutil
import pytest

from ftmaster import runfiles
from ftmaster.recovery.checkpoints import read_tracker
from helpers.gpu import gpu_count, job_gpu, needs_driver, needs_gpus
from helpers.launch import attempt_log, events, start_launch, train_args
from helpers.trainer import wait_until, worker_with_local_rank

# Its waits add up to 25 minutes (a first CUDA start compiles and loads kernels): past the
# suite's 10-minute default, pytest-timeout would end a slow but healthy launch.
pytestmark = [pytest.mark.gpu, needs_gpus(2), needs_driver(), pytest.mark.timeout(1800)]


def test_a_killed_rank_on_a_gpu_is_relaunched_from_the_checkpoint(tmp_path):
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    nproc = min(gpu_count(), 4)
    ftmaster = start_launch(run_dir, nproc, train_args(save, 40, 1, 1, 10, "--bf16"),
                            "--monitor-backend", "nvml", "--monitor-interval", "1")
    try:
        wait_until(lambda: (runfiles.read_heartbeat(run_dir) or {}).get("iteration", 0) >= 15,
                   timeout=600, interval=0.2, what="iteration 15")
        torchrun = next(p for p in psutil.Process(ftmaster.pid).children()
                        if "torch.distributed.run" in " ".join(p.cmdline()))
        victim = worker_with_local_rank(torchrun, 1)
        visible = victim.environ()["CUDA_VISIBLE_DEVICES"].split(",")
        os.kill(victim.pid, signal.SIGKILL)
        output, _ = ftmaster.communicate(timeout=900)
    finally:
        if ftmaster.poll() is None:
            ftmaster.kill()
    assert ftmaster.returncode == 0, output[-4000:]
    assert read_tracker(save) == 40
    assert len(events(run_dir, "launch")) == 2
    assert events(run_dir, "resumed")[0]["iteration"] > 10
    first_log = attempt_log(run_dir, 1)
    assert f"training on {nproc} cuda" in first_log
    assert len(visible) == nproc and all(entry.startswith("GPU-") for entry in visible), visible


@needs_gpus(4)
@pytest.mark.parametrize("layout, extra, global_batch, optimizer", [
    ((1, 2), (), 8, "replicated"),
    ((1, 1), ("--num-distributed-optimizer-instances", "2"), 24, "distributed (2 instances)"),
], ids=["pp2-plain-optimizer", "dp4-two-optimizer-instances"])
def test_replica_recovery_on_gpus_merges_the_survivors_state(tmp_path, layout, extra,
                                                             global_batch, optimizer):
    """NCCL, unlike gloo, may leave the survivors blocked in a collective (no error) and a
    dump's device-to-host copies queued behind it: this is the check that the dump still
    comes within the window and the relaunch resumes from the merged checkpoint. With two
    distributed-optimizer instances the optimizer (on by default with CUDA) stays on and its
    overlapped parameter gather is off; the survivors dump their optimizer slices, the merge
    puts the shards of both instances together, and the relaunch on DP 3 (one instance)
    loads it."""
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    args = train_args(save, 20, *layout, 100, "--bf16", *extra, "--non-persistent-ckpt-type",
                      "global", "--non-persistent-global-ckpt-dir", str(tmp_path / "memory"),
                      "--replica-recovery", global_batch=global_batch)
    ftmaster = start_launch(run_dir, 4, args, "--monitor-backend", "nvml", "--monitor-interval",
                            "1", "--inject", f"fail:gpu={job_gpu(1, 4)},at=iter:16")
    try:
        output, _ = ftmaster.communicate(timeout=900)
    finally:
        if ftmaster.poll() is None:
            ftmaster.kill()
    assert ftmaster.returncode == 0, output[-4000:]
    assert f"bf16, {optimizer} optimizer state" in attempt_log(run_dir, 1)
    (merged,) = events(run_dir, "replica_merge")
    assert merged["iteration"] in (16, 17) and merged["shards"] == 2
    assert events(run_dir, "checkpoint_loaded")[0]["iteration"] == merged["iteration"]


def test_warm_workers_relaunch_on_gpus_named_by_uuid_and_ftmaster_never_touches_cuda(tmp_path):
    """The relaunch after a killed rank runs on warm workers: they imported torch before any
    CUDA context existed, get CUDA_VISIBLE_DEVICES (GPU UUIDs) with their rank, and train on
    CUDA; neither ftmaster nor a waiting worker ever loads the CUDA driver library."""
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    nproc = min(gpu_count(), 4)
    ftmaster = start_launch(run_dir, nproc, train_args(save, 30, 1, 1, 5, "--bf16"),
                            "--monitor-backend", "nvml", "--monitor-interval", "1",
                            "--inject", f"fail:gpu={job_gpu(1, nproc)},at=iter:12")
    try:
        wait_until(lambda: events(run_dir, "startup"), timeout=600, interval=0.2,
                   what="the first attempt's first iteration")
        waiting = [p for p in psutil.Process(ftmaster.pid).children()
                   if "ftmaster.warm" in " ".join(p.cmdline())]
        assert waiting, "no warm worker waits beside the first attempt"
        for process in [psutil.Process(ftmaster.pid), *waiting]:
            assert "libcuda.so" not in open(f"/proc/{process.pid}/maps").read(), process
        output, _ = ftmaster.communicate(timeout=900)
    finally:
        if ftmaster.poll() is None:
            ftmaster.kill()
    assert ftmaster.returncode == 0, output[-4000:]
    assert read_tracker(save) == 30
    first, relaunch = events(run_dir, "startup")[:2]
    assert first["warm"] is False and relaunch["warm"] is True
    assert f"training on {nproc - 1} cuda" in attempt_log(run_dir, 2)
    visible = [line for line in attempt_log(run_dir, 2).splitlines() if "CUDA_VISIBLE_DEVICES" in line]
    assert visible and all("GPU-" in line for line in visible), visible
