"""Finding the newest loadable checkpoint: tracker rule, truncation, missing files."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ftmaster.recovery.checkpoints import (
    checkpoint_problem,
    find_loadable_checkpoint,
    iteration_dir,
    tracker_path,
)


def write_checkpoint(save_dir, iteration):
    """A real torch_dist folder with Megatron's side files (single process, no group)."""
    path = iteration_dir(save_dir, iteration)
    state = {"weight": torch.arange(4096, dtype=torch.float32)}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    torch.save({"iteration": iteration}, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return path


@pytest.fixture
def save_dir(tmp_path):
    for iteration in (10, 20, 30):
        write_checkpoint(tmp_path, iteration)
    tracker_path(tmp_path).write_text("30\n")
    return tmp_path


def test_tracker_iteration_is_chosen(save_dir):
    choice = find_loadable_checkpoint(save_dir)
    assert choice.iteration == 30 and choice.skipped == ()


def test_folder_newer_than_tracker_is_an_unfinished_save(save_dir):
    write_checkpoint(save_dir, 40)  # shards written, tracker never moved
    assert find_loadable_checkpoint(save_dir).iteration == 30


def test_truncated_shard_falls_back_to_previous(save_dir):
    shard = next(iteration_dir(save_dir, 30).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    choice = find_loadable_checkpoint(save_dir)
    assert choice.iteration == 20
    assert choice.skipped[0][0] == 30 and "truncated" in choice.skipped[0][1]
    assert "iter_0000030 skipped" in choice.describe()


@pytest.mark.parametrize("victim", ["common.pt", "metadata.json", ".metadata"])
def test_missing_side_file_is_reported(save_dir, victim):
    (iteration_dir(save_dir, 30) / victim).unlink()
    assert checkpoint_problem(iteration_dir(save_dir, 30)) == f"{victim} is missing"
    assert find_loadable_checkpoint(save_dir).iteration == 20


def test_garbled_metadata_is_unreadable_not_fatal(save_dir):
    (iteration_dir(save_dir, 30) / ".metadata").write_bytes(b"\x00garbage")
    assert "unreadable" in checkpoint_problem(iteration_dir(save_dir, 30))


def test_no_tracker_means_fresh_start(tmp_path):
    write_checkpoint(tmp_path, 10)
    choice = find_loadable_checkpoint(tmp_path)
    assert choice.iteration is None
    assert "no checkpoint tracker" in choice.describe()


def test_tracker_pointing_at_deleted_folder_reports_it(save_dir):
    tracker_path(save_dir).write_text("50\n")
    choice = find_loadable_checkpoint(save_dir)
    assert choice.iteration == 30
    assert (50, "folder is missing") in choice.skipped


def make_kinds(save_dir, kinds, tracked):
    from ftmaster.recovery.checkpoints import write_save_kind

    for iteration, kind in kinds.items():
        iteration_dir(save_dir, iteration).mkdir(parents=True)
        if kind:
            write_save_kind(iteration_dir(save_dir, iteration), kind)
    tracker_path(save_dir).write_text(f"{tracked}\n")


@pytest.mark.parametrize("kinds, tracked, keep, expected", [
    # emergency 5 and 12 are superseded by periodic 20; 25 is newer than any periodic
    ({5: "emergency", 12: "emergency", 20: "periodic", 25: "emergency"}, 25, 0, [12, 5]),
    ({5: "emergency", 12: "emergency", 20: "periodic", 25: "emergency"}, 25, 1, [5]),
    ({5: "emergency", 12: "emergency", 20: "periodic"}, 20, 5, []),
    ({5: "emergency", 10: "emergency"}, 10, 0, []),  # no regular checkpoint yet
    ({5: "emergency", 12: None, 20: "final"}, 20, 0, [5]),  # unmarked folders are never touched
    ({5: "emergency", 20: "periodic"}, 5, 0, []),  # the tracker's checkpoint is never touched
])
def test_prunable_emergency_checkpoints(tmp_path, kinds, tracked, keep, expected):
    from ftmaster.recovery.checkpoints import prunable_emergency_checkpoints

    make_kinds(tmp_path, kinds, tracked)
    assert prunable_emergency_checkpoints(tmp_path, keep) == expected
