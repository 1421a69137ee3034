"""The memory tier's refilled slots on the real trainer (CPU + gloo): what a refill writes is
what a regular save writes, it loads under other layouts, a rank killed mid-copy leaves
nothing loadable behind, a relaunch on a new layout sets new slots up, and the tier holds at
most two checkpoints and the one being written."""

import shutil
import threading
import uuid
from pathlib import Path

import pytest

from ftmaster import runfiles
from ftmaster.recovery.checkpoints import (checkpoint_problem, iteration_dir, read_tracker,
                                           tracker_path)
from ftmaster.recovery.manifest import digest_problem, read_manifest
from helpers.replicas import unequal_tensors
from helpers.trainer import SMALL_GPT, kill_session, layout_args, run_trainer, start_trainer

pytestmark = pytest.mark.slow

SCHEDULE = ["--micro-batch-size", "2", "--global-batch-size", "12", "--lr", "1e-2",
            "--lr-warmup-iters", "2", "--seed", "7"]


@pytest.fixture
def shm_dir():
    folder = Path(f"/dev/shm/ftmaster-test-{uuid.uuid4().hex[:8]}")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def every_iteration_in_memory(folder: Path) -> list[str]:
    return ["--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir",
            str(folder), "--non-persistent-save-interval", "1"]


def memory_saves(run_dir: Path) -> list[dict]:
    return [e for e in runfiles.read_events(run_dir)
            if e["event"] == "periodic_save" and e["tier"] == "memory"]


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


class PeakSize:
    """The largest size a folder reaches while a run goes on, sampled every 20 ms."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.peak, self._done = folder, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            try:
                self.peak = max(self.peak, folder_bytes(self.folder))
            except OSError:  # a file removed between the listing and its stat
                pass

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def standalone(source: Path, target: Path) -> Path:
    """A save folder holding only ``source``, tracked."""
    shutil.copytree(source, iteration_dir(target, int(source.name.removeprefix("iter_"))))
    tracker_path(target).write_text(f"{int(source.name.removeprefix('iter_'))}\n")
    return target


def loaded_and_saved_again(nproc: int, tp: int, pp: int, source: Path, root: Path) -> Path:
    """Load ``source`` (iteration 5, tracked alone) under a layout and save it at once, as
    loaded: a final save at the iteration loaded, nothing trained in between."""
    load, save, run_dir = standalone(source, root / "load"), root / "save", root / "run"
    result = run_trainer(nproc, SMALL_GPT + SCHEDULE + layout_args(tp, pp) + [
        "--train-iters", "5", "--use-checkpoint-opt-param-scheduler", "--load", str(load),
        "--save", str(save), "--save-interval", "100"], FTMASTER_RUN_DIR=str(run_dir))
    assert result.returncode == 0, result.stdout[-3000:]
    (loaded,) = [e for e in runfiles.read_events(run_dir) if e["event"] == "checkpoint_loaded"]
    assert (loaded["iteration"], loaded["path"]) == (5, str(iteration_dir(load, 5)))
    return iteration_dir(save, 5)


def test_a_refilled_slot_is_a_regular_checkpoint_that_loads_under_other_layouts(tmp_path, shm_dir):
    save, run_dir = tmp_path / "save", tmp_path / "run"
    process = start_trainer(2, SMALL_GPT + SCHEDULE + layout_args(1, 2) + every_iteration_in_memory(shm_dir)
                            + ["--train-iters", "7", "--save", str(save), "--save-interval", "100"],
                            tmp_path / "train.log", FTMASTER_RUN_DIR=str(run_dir))
    peak = PeakSize(shm_dir)
    try:
        assert process.wait(timeout=300) == 0, (tmp_path / "train.log").read_text()[-3000:]
    finally:
        kill_session(process)
        peak = peak.stop()
    saves = memory_saves(run_dir)
    assert [(e["iteration"], e["slot"], e["structure"]) for e in saves][:4] == [
        (1, "new", "new"), (2, "new", "same"), (3, "refilled", "same"), (4, "refilled", "same")]
    assert 5 in [e["iteration"] for e in saves if e["slot"] == "refilled"]
    # Rank 0's wait for the other stage to enter the save is a part of its blocked time.
    assert all(0 <= e["waited_for_ranks_seconds"] <= e["seconds"] for e in saves), saves
    checkpoint = max(e["bytes"] for e in saves)
    assert peak <= 3 * checkpoint * 1.05, (peak, checkpoint)  # two, and the one being written
    # The same training, its iteration 5 saved the regular way (on CPU it is deterministic).
    reference = tmp_path / "reference"
    result = run_trainer(2, SMALL_GPT + SCHEDULE + layout_args(1, 2) + [
        "--train-iters", "7", "--save", str(reference), "--save-interval", "5"])
    assert result.returncode == 0, result.stdout[-3000:]
    refilled, regular = iteration_dir(shm_dir, 5), iteration_dir(reference, 5)
    assert unequal_tensors(refilled, regular) == []
    # Loaded under other layouts and saved again as loaded, it is the regular save's state.
    for name, (nproc, tp, pp) in {"tp1pp1": (1, 1, 1), "dp3": (3, 1, 1)}.items():
        assert unequal_tensors(loaded_and_saved_again(nproc, tp, pp, refilled, tmp_path / name),
                               regular) == [], name


def test_a_rank_killed_mid_copy_leaves_no_loadable_slot_and_a_new_layout_sets_up_anew(tmp_path, shm_dir):
    save, run_dir = tmp_path / "save", tmp_path / "run"
    args = SMALL_GPT + SCHEDULE + every_iteration_in_memory(shm_dir) + ["--save", str(save),
                                                                        "--load", str(save)]
    killed = run_trainer(2, args + layout_args(1, 2) + ["--train-iters", "8", "--save-interval", "100"],
                         FTMASTER_RUN_DIR=str(run_dir), FTMASTER_INJECT_KILL="1:4:slot-copy")
    assert killed.returncode != 0
    assert read_tracker(shm_dir) == 3
    torn = iteration_dir(shm_dir, 4)  # iteration 2's slot, renamed for the copy
    assert torn.is_dir() and not iteration_dir(shm_dir, 2).exists()
    assert checkpoint_problem(torn) is not None
    tracker_path(shm_dir).write_text("garbage\n")  # every folder is a candidate now
    relaunch = tmp_path / "relaunch"
    result = run_trainer(2, args + layout_args(1, 1) + ["--train-iters", "8", "--save-interval", "100"],
                         FTMASTER_RUN_DIR=str(relaunch))
    assert result.returncode == 0, result.stdout[-3000:]
    events = runfiles.read_events(relaunch)
    assert [e["iteration"] for e in events if e["event"] == "checkpoint_skipped"] == [4]
    (loaded,) = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert (loaded["iteration"], loaded["tier"]) == (3, "memory")
    saves = memory_saves(relaunch)
    assert [(e["iteration"], e["slot"], e["structure"]) for e in saves][:4] == [
        (4, "new", "new"), (5, "new", "same"), (6, "refilled", "same"), (7, "refilled", "same")]
    newest = iteration_dir(shm_dir, read_tracker(shm_dir))
    manifest = read_manifest(newest)
    assert checkpoint_problem(newest) is None
    assert digest_problem(newest, manifest, manifest.files) is None
