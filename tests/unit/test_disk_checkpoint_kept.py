"""A complete checkpoint on disk is neither torn nor removed by the trainer's own saves: a
disk save at an iteration a persist copy already landed, and the clean-up of a failed save
racing a persist copy of the same iteration."""

import json
import shutil
import threading
import types

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ftmaster.recovery.checkpoints import advance_tracker, iteration_dir, read_tracker
from ftmaster.recovery.manifest import (MANIFEST_NAME, digest_file, digest_problem, read_manifest,
                                        write_manifest)
from megatron.training import checkpointing
from helpers.process_group import process_group_of_one


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with process_group_of_one(tmp_path_factory.mktemp("pg")) as world:
        yield world


def complete_checkpoint(save_dir, iteration, kind="periodic"):
    """A real torch_dist folder with its side files and manifest, as a persist copy lands it."""
    path = iteration_dir(save_dir, iteration)
    dcp.save({"weight": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=str(path),
             no_dist=True)
    torch.save({"iteration": iteration}, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    files = {entry.name: digest_file(entry) for entry in path.iterdir()}
    write_manifest(path, kind, iteration, files)
    return path


class Killed(BaseException):
    """The rank killed (or its disk full) once the save had begun writing."""


def disk_save(save_dir, group, iteration, outcomes, own_states=None, events=None):
    def killed_at_the_shards(sharded_part, path, in_rank):
        raise Killed

    strategy = types.SimpleNamespace(async_save=killed_at_the_shards, distribution_seconds=0.0)
    checkpointer = types.SimpleNamespace(
        group=group, folder_of=lambda tier: save_dir, slots=None, async_saves=None,
        disk_records=None, janitor=checkpointing.Janitor(), memory_owner=None,
        structure=types.SimpleNamespace(strategy_for=lambda sharded: (strategy, True)),
        write_results_relay=checkpointing._WriteResultsRelay(),
        own_states=own_states or checkpointing.OwnStates(),
        event=lambda name, **fields: (events if events is not None else []).append(
            (name, fields)),
        saved=lambda save, outcome: outcomes.append(outcome))
    return checkpointing._Save(checkpointer, iteration, "final", "disk", None)


def test_a_disk_save_at_an_iteration_already_complete_on_disk_leaves_it_whole(tmp_path, group):
    """A final save at a memory checkpoint's iteration the supervisor had persisted wrote
    over it in place: killed partway, the tracker named a torn folder, the only good copy."""
    memory = complete_checkpoint(tmp_path / "memory", 12)  # this run's save, then persisted
    path = iteration_dir(tmp_path, 12)
    shutil.copytree(memory, path)
    advance_tracker(tmp_path, 12)
    own_states = checkpointing.OwnStates()
    own_states.add(12, memory, read_manifest(memory).files)
    outcomes = []
    save = disk_save(tmp_path, group, 12, outcomes, own_states)
    try:
        save.request({"iteration": 12, "args": "the arguments of the relaunch"})
    except Killed:
        pass
    manifest = read_manifest(path)
    assert digest_problem(path, manifest, sorted(manifest.files)) is None
    assert read_tracker(tmp_path) == 12
    [outcome] = outcomes
    assert isinstance(outcome, checkpointing.DurableSave) and outcome.already_on_disk
    assert (outcome.iteration, outcome.kind, outcome.bytes) == (12, "final", manifest.total_bytes)


def test_a_disk_save_over_another_runs_checkpoint_of_its_iteration_sets_it_aside(
        tmp_path, group):
    """--load X --save Y, Y holding another run's complete iteration 12, resumed at 12 from X:
    the save kept Y's checkpoint as this run's and moved Y's tracker to it, so a later resume
    from Y loaded the other run's weights. It is set aside, never written over, and this
    run's state is written."""
    loaded = complete_checkpoint(tmp_path / "load", 12)
    foreign = complete_checkpoint(tmp_path / "save", 12)
    (foreign / "common.pt").write_bytes(b"another run's common state")
    write_manifest(foreign, "periodic", 12, {entry.name: digest_file(entry)
                                             for entry in foreign.iterdir()
                                             if entry.name != MANIFEST_NAME})
    other = read_manifest(foreign)
    own_states = checkpointing.OwnStates()
    own_states.add(12, loaded, read_manifest(loaded).files)
    outcomes, events = [], []
    save = disk_save(tmp_path / "save", group, 12, outcomes, own_states, events)
    with pytest.raises(Killed):  # it went on to write this run's state
        save.request({"iteration": 12, "args": "this run's"})
    [(name, fields)] = events
    assert name == "checkpoint_set_aside" and fields["path"] == str(foreign)
    kept = Path(fields["moved_to"])
    assert kept.name.startswith("iter_0000012.discarded-")
    assert digest_problem(kept, other, sorted(other.files)) is None
    assert not outcomes


def test_a_failed_saves_clean_up_never_removes_a_folder_a_persist_copy_just_tracked(
        tmp_path, monkeypatch):
    """A disk save at 12 wrote its manifest and failed to move the tracker (a full disk); the
    supervisor's copy of memory checkpoint 12 found the folder complete and moved the tracker
    to it just after the clean-up had read the tracker, which then removed the folder the
    tracker named: the next load found no iteration 12 and fell back."""
    from ftmaster.persist import persist

    memory, disk = tmp_path / "memory", tmp_path / "disk"
    complete_checkpoint(memory, 12)
    complete_checkpoint(disk, 10)
    advance_tracker(disk, 10)
    failed = complete_checkpoint(disk, 12)
    read = checkpointing.read_tracker

    def copy_lands_after_the_read(save_dir):
        tracked = read(save_dir)
        copy = threading.Thread(target=persist, args=(memory, disk, 12))
        copy.start()
        copy.join(1.0)  # done, unless it waits for the clean-up's lock
        lands.append(copy)
        return tracked

    lands = []
    monkeypatch.setattr(checkpointing, "read_tracker", copy_lands_after_the_read)
    checkpointing._remove_unless_tracked(failed, 12)
    lands[0].join(10)
    assert read_tracker(disk) == 12
    manifest = read_manifest(failed)
    assert manifest is not None and digest_problem(failed, manifest, sorted(manifest.files)) is None


def test_a_failed_saves_folder_whose_removal_is_cut_short_is_no_candidate(tmp_path, monkeypatch):
    """A first save whose tracker could not be written is removed; a kill partway through
    that removal (ext4 lists the shards before the manifest) left a folder with its manifest
    and short of a shard: with no tracker every load took it as complete, failed on it, and
    refused every relaunch (exit 66), and a fresh start was refused over it."""
    from ftmaster.recovery.checkpoints import holds_checkpoints, list_iterations

    from test_persist import fake_checkpoint

    folder = fake_checkpoint(tmp_path, 2)
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()  # its tracker never landed
    removal = shutil.rmtree

    def killed_after_one_file(path, *args, **kwargs):
        next(p for p in Path(path).iterdir() if p.name != MANIFEST_NAME).unlink()
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(shutil, "rmtree", killed_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        checkpointing._remove_unless_tracked(folder, 2)
    monkeypatch.setattr(shutil, "rmtree", removal)
    assert list_iterations(tmp_path) == [] and not holds_checkpoints(tmp_path)
    checkpointing._remove_unless_tracked(tmp_path / "iter_0000003", 3)  # the next removal
    assert not list(tmp_path.glob("iter_*"))  # takes what the cut one left
