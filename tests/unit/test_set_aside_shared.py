"""A resume whose set-aside of a discarded timeline fails (a read-only or full file system, a
permission) fails on every rank with the same one-line reason: raised on rank 0 alone, it
left the other ranks in the collective that follows until its timeout, reported as a hang."""

import errno
import os
import pathlib
import types

import pytest

from ftmaster.recovery.checkpoints import advance_tracker, iteration_dir, read_tracker
from megatron.training import checkpointing
from helpers.process_group import process_group_of_one


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with process_group_of_one(tmp_path_factory.mktemp("pg")) as world:
        yield world


def complete_looking(save_dir, iteration):
    path = iteration_dir(save_dir, iteration)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"written by a save that finished")
    return path


def resumed_at(checkpointer, iteration, monkeypatch):
    """The load, its reading of a checkpoint stubbed: ``iteration``'s loads, newer ones not."""
    def load_from(path, state, tier):
        if path.name != iteration_dir(pathlib.Path(), iteration).name:
            return "does not load (stub)"
        state.iteration = iteration
        return None

    monkeypatch.setattr(checkpointer, "_load_from", load_from)
    return checkpointer.load(types.SimpleNamespace(iteration=0))


def read_only_rename(self, target):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self), None, str(target))


def test_a_set_aside_that_cannot_rename_fails_the_resume_alike_on_every_rank(
        tmp_path, group, monkeypatch):
    complete_looking(tmp_path, 5)
    newer = complete_looking(tmp_path, 7)
    advance_tracker(tmp_path, 7)
    shared, agree = [], checkpointing.first_problem

    def recorded_first_problem(problem, group):
        shared.append(problem)
        return agree(problem, group)

    monkeypatch.setattr(checkpointing, "first_problem", recorded_first_problem)
    monkeypatch.setattr(pathlib.Path, "rename", read_only_rename)
    events = []
    checkpointer = object.__new__(checkpointing.Checkpointer)  # only what a set-aside reads
    vars(checkpointer).update(
        args=types.SimpleNamespace(save=str(tmp_path), load=str(tmp_path)), memory_dir=None,
        memory_owner=None, group=group, event=lambda name, **fields: events.append(name))

    with pytest.raises(checkpointing.CheckpointMismatch) as refused:
        resumed_at(checkpointer, 5, monkeypatch)

    reason = str(refused.value)
    assert shared == [reason]  # went through the collective the other ranks wait in
    assert "\n" not in reason
    assert "EROFS (Read-only file system" in reason
    assert "iteration 5" in reason
    assert newer.is_dir() and read_tracker(tmp_path) == 7
    assert events == ["checkpoint_skipped", "load_failed"]


def test_a_set_aside_that_fails_partway_records_each_folder_it_moved_and_the_refusal(
        tmp_path, group, monkeypatch):
    """The third of four newer folders cannot be renamed: the two already renamed are in
    events.jsonl where the operator looks for them, and so is the refusal that follows."""
    complete_looking(tmp_path, 5)
    newer = [complete_looking(tmp_path, it) for it in (9, 8, 7, 6)]  # the order renamed in
    advance_tracker(tmp_path, 9)
    rename = pathlib.Path.rename

    def third_is_read_only(self, target):
        return (read_only_rename if self == newer[2] else rename)(self, target)

    monkeypatch.setattr(pathlib.Path, "rename", third_is_read_only)
    events = []
    checkpointer = object.__new__(checkpointing.Checkpointer)  # only what a set-aside reads
    vars(checkpointer).update(
        args=types.SimpleNamespace(save=str(tmp_path), load=str(tmp_path)), memory_dir=None,
        memory_owner=None, group=group, event=lambda name, **fields: events.append((name, fields)))

    with pytest.raises(checkpointing.CheckpointMismatch) as refused:
        resumed_at(checkpointer, 5, monkeypatch)

    moved = [fields for name, fields in events if name == "checkpoint_set_aside"]
    assert [m["path"] for m in moved] == [str(newer[0]), str(newer[1])]
    assert all(pathlib.Path(m["moved_to"]).is_dir() for m in moved)
    assert not newer[0].exists() and not newer[1].exists() and newer[2].is_dir()
    assert events[-1] == ("load_failed", {"path": str(tmp_path), "reason": str(refused.value)})


def a_checkpointer(load_dir, events, **args):
    checkpointer = object.__new__(checkpointing.Checkpointer)  # only what a load reads
    vars(checkpointer).update(
        args=types.SimpleNamespace(save=None, load=str(load_dir), **args), memory_dir=None,
        memory_owner=None, group=None, event=lambda name, **fields: events.append((name, fields)))
    return checkpointer


@pytest.mark.parametrize("refusal", ["optimizer", "schedule", "nothing loads"])
def test_every_refused_resume_says_why_in_one_load_failed_event(tmp_path, group, monkeypatch,
                                                                refusal):
    """A checkpoint the arguments cannot continue (saved without the distributed optimizer,
    another learning-rate schedule) ended the resume with a log line alone: ftmaster report
    and the incident page had no reason for the failed attempt. Each refusal is one
    ``load_failed`` event, with the reason the rank exits with."""
    complete_looking(tmp_path, 5)
    advance_tracker(tmp_path, 5)
    events = []
    checkpointer = a_checkpointer(
        tmp_path, events, use_distributed_optimizer=True, override_opt_param_scheduler=False,
        use_checkpoint_opt_param_scheduler=False)
    checkpointer.group = group
    checkpointer.scheduler = types.SimpleNamespace(state_dict=lambda: {"max_lr": 1e-3})

    def load_from(path, state, tier):
        if refusal == "optimizer":
            checkpointer._check_optimizer({"use_distributed_optimizer": False})
        elif refusal == "schedule":
            checkpointer._check_schedule({"max_lr": 3e-4})
        return "its shards are corrupt (stub)"

    monkeypatch.setattr(checkpointer, "_load_from", load_from)
    with pytest.raises((checkpointing.CheckpointMismatch,
                        checkpointing.NoLoadableCheckpoint)) as refused:
        checkpointer.load(types.SimpleNamespace(iteration=0))

    failed = [fields for name, fields in events if name == "load_failed"]
    assert failed == [{"path": str(tmp_path), "reason": str(refused.value)}]
