"""The memory tier on the real trainer (CPU + gloo): cheap saves into /dev/shm every few
iterations bound what a killed rank loses, and resume resharded; a memory tier too small for
a checkpoint sends its saves to disk and training goes on."""

import shutil
import uuid

import pytest

from ftmaster import runfiles
from ftmaster.recovery.checkpoints import (advance_tracker, iteration_dir, list_iterations,
                                           read_tracker)
from helpers.tmpfs import small_tmpfs
from helpers.trainer import (RESUME_SCHEDULE, SMALL_GPT, iterations, kill_session, layout_args,
                             run_trainer, start_trainer, wait_until, worker_with_local_rank)

pytestmark = pytest.mark.slow


@pytest.fixture
def shm_dir():
    """A fresh folder in /dev/shm (node memory), removed afterwards."""
    folder = f"/dev/shm/ftmaster-test-{uuid.uuid4().hex[:8]}"
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def memory_tier(folder: str, interval: int = 2) -> list[str]:
    return ["--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir", folder,
            "--non-persistent-save-interval", str(interval)]


def test_a_killed_rank_loses_at_most_the_memory_interval_and_resumes_resharded(tmp_path, shm_dir):
    args = SMALL_GPT + RESUME_SCHEDULE + ["--save-interval", "100"]
    reference = iterations(run_trainer(4, args + layout_args(2, 2)).stdout)
    args += ["--save", str(tmp_path / "save"), "--load", str(tmp_path / "save")]  # as Megatron-LM users do
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    process = start_trainer(4, args + layout_args(2, 2) + memory_tier(shm_dir), log,
                            FTMASTER_RUN_DIR=str(run_dir))
    try:
        # Well before the end (12), so that the final disk save cannot land before the kill
        wait_until(lambda: (runfiles.read_heartbeat(run_dir) or {}).get("iteration", 0) >= 7,
                   timeout=300, interval=0.05, what="iteration 7")
        worker_with_local_rank(process, 3).kill()
        killed_after = runfiles.read_heartbeat(run_dir)["iteration"]
        process.wait(timeout=120)
    finally:
        kill_session(process)
    assert read_tracker(tmp_path / "save") is None  # nothing reached the disk tier
    resumed = run_trainer(1, args + layout_args(1, 1) + memory_tier(shm_dir))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    loaded = int(resumed.stdout.split("loaded checkpoint from ")[1].split(" at iteration ")[1].split()[0])
    assert f"loaded checkpoint from {iteration_dir(shm_dir, loaded)}" in resumed.stdout
    assert killed_after - loaded <= 2
    after = iterations(resumed.stdout)
    for it in range(loaded + 1, 13):
        assert abs(after[it]["loss"] - reference[it]["loss"]) <= 0.02 * reference[it]["loss"], it
    assert read_tracker(tmp_path / "save") == 12  # the final save is on disk


@pytest.fixture
def tiny_memory_tier(tmp_path):
    """A 1 MB tmpfs: a real full memory tier (mounting needs root)."""
    with small_tmpfs(tmp_path / "tiny", "1m") as folder:
        yield folder


def test_a_memory_tier_too_small_sends_its_saves_to_disk(tmp_path, tiny_memory_tier):
    folder = tiny_memory_tier
    run_dir, save = tmp_path / "run", tmp_path / "save"
    result = run_trainer(2, SMALL_GPT + RESUME_SCHEDULE + layout_args(1, 2) + memory_tier(str(folder), 4)
                         + ["--save", str(save), "--save-interval", "100", "--train-iters", "9"],
                         FTMASTER_RUN_DIR=str(run_dir))
    assert result.returncode == 0, result.stdout[-3000:]
    failed = [e for e in runfiles.read_events(run_dir) if e["event"] == "save_failed"]
    assert [(e["iteration"], e["tier"]) for e in failed] == [(4, "memory"), (8, "memory")]
    assert "No space left on device" in failed[0]["reason"]
    # known too small: not even started
    assert "needs about" in failed[1]["reason"] and "10% more to spare" in failed[1]["reason"]
    assert list_iterations(save) == [9, 8, 4] and read_tracker(save) == 9
    assert list_iterations(folder) == []


def test_a_final_save_at_the_iteration_resumed_from_memory_leaves_the_disk_copy_alone(
        tmp_path, shm_dir):
    """--train-iters lowered to the memory checkpoint a relaunch resumes from, which disk holds
    too (persisted by the supervisor): the final save wrote over that complete disk copy in
    place, and a failure partway tore the only copy on disk. Here the disk copy is the
    --exit-interval save, and the memory one its copy, as a persist makes them alike."""
    save, run_dir = tmp_path / "save", tmp_path / "run"
    args = SMALL_GPT + RESUME_SCHEDULE + layout_args(1, 1) + memory_tier(shm_dir, 4) + [
        "--save", str(save), "--load", str(save), "--save-interval", "100"]
    first = run_trainer(1, args + ["--exit-interval", "8"])
    assert first.returncode == 0, first.stdout[-3000:]
    assert read_tracker(shm_dir) == 4  # the stop's state went to disk alone
    shutil.copytree(iteration_dir(save, 8), iteration_dir(shm_dir, 8))
    advance_tracker(shm_dir, 8)
    written = {path.name: path.stat().st_mtime_ns for path in iteration_dir(save, 8).iterdir()}
    lowered = run_trainer(1, args + ["--train-iters", "8", "--override-opt-param-scheduler"],
                          FTMASTER_RUN_DIR=str(run_dir))
    assert lowered.returncode == 0, lowered.stdout[-3000:]
    assert f"loaded checkpoint from {iteration_dir(shm_dir, 8)}" in lowered.stdout
    assert "final checkpoint at iteration 8 not written" in lowered.stdout
    assert {path.name: path.stat().st_mtime_ns
            for path in iteration_dir(save, 8).iterdir()} == written
    assert read_tracker(save) == 8
    [final] = [e for e in runfiles.read_events(run_dir) if e["event"] == "periodic_save"]
    assert (final["kind"], final["tier"], final["already_on_disk"]) == ("final", "disk", True)
