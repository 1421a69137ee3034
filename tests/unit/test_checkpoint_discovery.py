"""Finding the newest loadable checkpoint: tracker rule, bad trackers, truncation, missing
files, manifests and checksums."""

import dataclasses
import json
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ftmaster.recovery.checkpoints import (
    Candidates,
    checkpoint_problem,
    find_loadable_checkpoint,
    folder_written_at,
    holds_checkpoints,
    iteration_dir,
    loading_candidates,
    tracker_path,
    unfinished_saves,
)
from ftmaster.recovery.manifest import (
    MANIFEST_NAME,
    DigestingWriter,
    FileDigest,
    digest_bytes,
    digest_file,
    digest_problem,
    item_problem,
    read_manifest,
    write_manifest,
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


@pytest.mark.parametrize("tracked", [True, False])
def test_a_folder_this_user_cannot_enter_is_skipped_not_a_traceback(save_dir, monkeypatch,
                                                                    tracked):
    """Another user's iter_* folder (umask 077): Path.is_file raises EACCES, which was rank
    0's traceback in the checkpoint search (root here ignores modes: the call is made to)."""
    for iteration in (20, 30):
        path = iteration_dir(save_dir, iteration)
        write_manifest(path, "periodic", iteration,
                       {entry.name: digest_file(entry) for entry in path.iterdir()})
    if not tracked:
        tracker_path(save_dir).unlink()
    shut = iteration_dir(save_dir, 30)
    is_file = Path.is_file

    def refused(path):
        if path.parent == shut:
            raise PermissionError(13, "Permission denied", str(path))
        return is_file(path)

    monkeypatch.setattr(Path, "is_file", refused)
    assert checkpoint_problem(shut) == "cannot be read (Permission denied)"
    assert find_loadable_checkpoint(save_dir).iteration == 20


@pytest.mark.parametrize("victim", ["common.pt", "metadata.json", ".metadata"])
def test_missing_side_file_is_reported(save_dir, victim):
    (iteration_dir(save_dir, 30) / victim).unlink()
    assert checkpoint_problem(iteration_dir(save_dir, 30)) == f"{victim} is missing"
    assert find_loadable_checkpoint(save_dir).iteration == 20


def test_garbled_metadata_is_unreadable_not_fatal(save_dir):
    (iteration_dir(save_dir, 30) / ".metadata").write_bytes(b"\x00garbage")
    assert "unreadable" in checkpoint_problem(iteration_dir(save_dir, 30))


def _rewrite_metadata(path, change):
    """Unpickle ``path``'s ``.metadata``, let ``change`` damage it, pickle it back."""
    metadata_file = path / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    change(metadata)
    metadata_file.write_bytes(pickle.dumps(metadata))


def _set_entries(**fields):
    return lambda metadata: metadata.storage_data.update(
        {index: dataclasses.replace(info, **fields) for index, info in metadata.storage_data.items()})


@pytest.mark.parametrize("damage, reason", [
    (_set_entries(relative_path=7), "names shard 7, not a file of its folder"),
    (_set_entries(relative_path=None), "names shard None, not a file of its folder"),
    (_set_entries(relative_path="../iter_0000020/__0_0.distcp"),
     "names shard '../iter_0000020/__0_0.distcp', not a file of its folder"),
    (_set_entries(offset="0", length=16), "has a byte range '0' + 16 in shard __0_0.distcp"),
    (_set_entries(length=-1), "has a byte range 0 + -1 in shard __0_0.distcp"),
    (lambda metadata: setattr(metadata, "storage_data", None),
     "has storage data None, not a table of shards"),
    (lambda metadata: metadata.storage_data.update({key: "junk" for key in metadata.storage_data}),
     "names shard None, not a file of its folder"),
])
def test_a_damaged_metadata_that_unpickles_is_not_valid_and_says_why(save_dir, damage, reason):
    path = iteration_dir(save_dir, 30)
    _rewrite_metadata(path, damage)
    assert checkpoint_problem(path) == f".metadata is damaged: it {reason}"
    choice = find_loadable_checkpoint(save_dir)
    assert choice.iteration == 20 and choice.skipped[0][0] == 30


def test_a_metadata_damaged_after_a_check_is_checked_afresh(save_dir):
    """The unpickle a check keeps for the next (rank 0 checks the checkpoint it resumes twice)
    serves only the same bytes."""
    path = iteration_dir(save_dir, 30)
    assert checkpoint_problem(path) is None
    _rewrite_metadata(path, _set_entries(length=-1))
    assert checkpoint_problem(path) == \
        ".metadata is damaged: it has a byte range 0 + -1 in shard __0_0.distcp"


def test_a_metadata_unlike_its_manifest_is_refused_before_it_is_unpickled(save_dir, monkeypatch):
    """The structure check unpickles ``.metadata`` only once its bytes are the manifest's."""
    path = iteration_dir(save_dir, 30)
    write_manifest(path, "periodic", 30, {entry.name: digest_file(entry) for entry in path.iterdir()})
    metadata = path / ".metadata"
    metadata.write_bytes(metadata.read_bytes().replace(b"weight", b"weighT"))  # same size
    unpickled, unpickle = [], pickle.loads
    monkeypatch.setattr(pickle, "loads", lambda data: unpickled.append(data) or unpickle(data))
    assert checkpoint_problem(path).startswith(".metadata checksum mismatch (xxh3_64 ")
    assert unpickled == []
    assert find_loadable_checkpoint(save_dir).iteration == 20


@pytest.mark.parametrize("tracker", ["garbage\n", "", "-3\n", "4_0\n", "+40\n", "\u0664\u0660\n"])
def test_an_unusable_tracker_is_never_a_fresh_start(save_dir, tracker):
    tracker_path(save_dir).write_text(tracker)
    choice = find_loadable_checkpoint(save_dir)
    assert choice.iteration == 30
    assert "trying every iter_* folder, newest first" in choice.describe()
    assert holds_checkpoints(save_dir)


def test_without_a_tracker_only_complete_folders_are_checkpoints(save_dir):
    tracker_path(save_dir).unlink()
    assert loading_candidates(save_dir).iterations == ()  # no manifest: unfinished saves
    assert not holds_checkpoints(save_dir)
    assert unfinished_saves(save_dir) == []  # whole but for a manifest: not a killed save's
    for iteration in (30, 10):  # killed before their .metadata
        (iteration_dir(save_dir, iteration) / ".metadata").unlink()
    assert unfinished_saves(save_dir) == [30, 10]
    write_manifest(iteration_dir(save_dir, 20), "periodic", 20, {})
    candidates = loading_candidates(save_dir)
    assert candidates.iterations == (20,) and "is missing: trying the complete" in candidates.notes[0]
    assert holds_checkpoints(save_dir) and unfinished_saves(save_dir) == [30, 10]


def test_an_unusable_tracker_scans_past_a_newer_broken_folder(save_dir):
    tracker_path(save_dir).write_text("garbage")
    write_checkpoint(save_dir, 40)
    (iteration_dir(save_dir, 40) / ".metadata").unlink()  # an unfinished save
    assert loading_candidates(save_dir).iterations == (40, 30, 20, 10)
    choice = find_loadable_checkpoint(save_dir)
    assert choice.iteration == 30 and choice.skipped == ((40, ".metadata is missing"),)


def test_a_folder_that_cannot_be_listed_has_no_candidates_and_says_so(save_dir, tmp_path,
                                                                      monkeypatch):
    """Another user's memory folder, or EIO/ESTALE on NFS: iterdir's OSError was rank 0's
    traceback in the search, with every other rank waiting in its broadcast. Now the folder
    holds no candidate and a note, which the load refuses on (never a fresh start)."""
    memory = tmp_path / "memory"
    memory.mkdir()
    listed = Path.iterdir

    def refused(path):
        if path == memory:
            raise PermissionError(13, "Permission denied")
        return listed(path)

    monkeypatch.setattr(Path, "iterdir", refused)
    assert loading_candidates(memory) == Candidates(memory, (), (
        f"{memory} cannot be read (Permission denied)",))
    choice = find_loadable_checkpoint(save_dir, memory)
    assert choice.iteration == 30 and f"{memory} cannot be read" in choice.describe()


def test_a_save_folder_that_cannot_be_checked_before_a_fresh_start_is_one_refusal(
        tmp_path, monkeypatch):
    """An OSError there was rank 0's traceback, the other ranks waiting in first_problem."""
    from helpers.process_group import process_group_of_one
    from megatron.training import checkpointing

    def unsearchable(folder):
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr(checkpointing, "holds_checkpoints", unsearchable)
    checkpointer = checkpointing.Checkpointer.__new__(checkpointing.Checkpointer)
    checkpointer.args = SimpleNamespace(save=str(tmp_path / "save"))
    checkpointer.memory_owner, checkpointer.group = None, None
    with process_group_of_one(tmp_path), pytest.raises(checkpointing.CheckpointMismatch) as refusal:
        checkpointer.prepare_fresh_start()
    assert str(refusal.value).startswith(f"{tmp_path / 'save'} cannot be checked before a fresh "
                                         "start (EACCES")


def with_args(path, marker):
    torch.save({"iteration": marker, "args": {"marker": marker}}, path / "common.pt")
    return path


@pytest.mark.parametrize("damage", ["unreadable", "unlike its manifest"])
def test_the_args_read_before_a_load_are_those_of_the_checkpoint_it_takes(save_dir, damage):
    """30's common.pt damaged: the load falls back to 20, but the model was built from no
    checkpoint's args (its optimizer, padded vocabulary and layers chosen afresh)."""
    from megatron.training.checkpointing import checkpoint_args

    for iteration in (10, 20, 30):
        with_args(iteration_dir(save_dir, iteration), iteration)
    common = iteration_dir(save_dir, 30) / "common.pt"
    if damage == "unreadable":
        common.write_bytes(b"not a pickle")
    else:
        folder = iteration_dir(save_dir, 30)
        write_manifest(folder, "periodic", 30,
                       {entry.name: digest_file(entry) for entry in folder.iterdir()})
        with_args(folder, 31)  # readable, but not what was saved
    assert checkpoint_args(str(save_dir)) == {"marker": 20}


def test_the_args_of_a_node_local_memory_checkpoint_whose_shards_peers_hold(save_dir, tmp_path,
                                                                            monkeypatch):
    """The node's copy lacks the shards its peers hold, which the load reads from them: the
    args came from disk's older checkpoint instead, another optimizer's, say."""
    from megatron.training.checkpointing import checkpoint_args

    for iteration in (10, 20, 30):
        with_args(iteration_dir(save_dir, iteration), iteration)
    memory = tmp_path / "memory"
    folder = with_args(write_checkpoint(memory, 40), 40)
    for shard in folder.glob("*.distcp"):
        shard.unlink()  # on a peer
    tracker_path(memory).write_text("40\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("FTMASTER_RUN_DIR", str(run_dir))
    assert checkpoint_args(str(save_dir), memory) == {"marker": 30}  # no peers: not loadable
    (run_dir / "peers.json").write_text(json.dumps({"peers": ["http://127.0.0.1:1"],
                                                    "secret": "s"}))
    assert checkpoint_args(str(save_dir), memory) == {"marker": 40}


def test_nothing_at_all_is_a_fresh_start(tmp_path):
    assert loading_candidates(tmp_path) == Candidates(tmp_path, ())
    assert loading_candidates(tmp_path / "absent").iterations == ()
    assert not holds_checkpoints(tmp_path)
    assert find_loadable_checkpoint(tmp_path).iteration is None


def test_a_tracker_alone_or_a_complete_folder_alone_holds_checkpoints(tmp_path):
    tracker_path(tmp_path).write_text("7\n")
    assert holds_checkpoints(tmp_path) and unfinished_saves(tmp_path) == []
    tracker_path(tmp_path).unlink()
    iteration_dir(tmp_path, 3).mkdir()
    assert not holds_checkpoints(tmp_path)
    write_manifest(iteration_dir(tmp_path, 3), "emergency", 3, {})
    assert holds_checkpoints(tmp_path)


def test_a_folder_was_written_when_its_newest_entry_was_and_an_unreadable_one_raises(tmp_path):
    """Each caller decides what an unknown time means (the trainer: no write; the
    supervisor: written now), so the helper itself never guesses."""
    folder = tmp_path / "iter_0000004"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"x")
    os.utime(folder / "__0_0.distcp", (3000.0, 3000.0))
    os.utime(folder, (1000.0, 1000.0))
    assert folder_written_at(folder) == 3000.0
    with pytest.raises(OSError):
        folder_written_at(tmp_path / "iter_0000005")


def test_tracker_pointing_at_deleted_folder_reports_it(save_dir):
    tracker_path(save_dir).write_text("50\n")
    choice = find_loadable_checkpoint(save_dir)
    assert choice.iteration == 30
    assert "the tracker names iteration 50, whose folder is missing" in choice.describe()


def test_a_manifest_catches_a_wrong_size_with_stats_and_a_same_size_change_with_digests(save_dir):
    path = iteration_dir(save_dir, 30)
    files = {entry.name: digest_file(entry) for entry in path.iterdir()}
    write_manifest(path, "periodic", 30, files)
    manifest = read_manifest(path)
    assert (manifest.kind, manifest.iteration, dict(manifest.files)) == ("periodic", 30, files)
    assert checkpoint_problem(path) is None
    assert digest_problem(path, manifest, sorted(files)) is None

    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)  # same size, other bytes
    shard.write_bytes(bytes(data))
    assert checkpoint_problem(path) is None  # the structure cannot tell
    problem = digest_problem(path, manifest, sorted(files))
    assert problem.startswith(f"{shard.name} checksum mismatch (xxh3_64 ")

    shard.write_bytes(bytes(data) + b"x")
    assert checkpoint_problem(path) == f"{shard.name} has {len(data) + 1} bytes, the manifest says {len(data)}"


def test_a_shard_the_metadata_names_but_the_manifest_does_not_is_never_loaded_unchecked(save_dir):
    path = iteration_dir(save_dir, 30)
    shard = next(path.glob("*.distcp"))
    files = {entry.name: digest_file(entry) for entry in path.iterdir() if entry != shard}
    write_manifest(path, "periodic", 30, files)
    assert checkpoint_problem(path) == \
        f"shard {shard.name} is not in {MANIFEST_NAME}, so its checksum cannot be checked"
    choice = find_loadable_checkpoint(save_dir)
    assert choice.iteration == 20 and choice.skipped[0][0] == 30


@pytest.mark.parametrize("damage", [
    lambda data: data[:100],                                   # truncated
    lambda data: b"",                                          # emptied
    lambda data: data.replace(b'"files"', b'"fil\xffs"'),     # a byte flipped
    lambda data: data.replace(b'"files"', b'"filgs"'),         # a bit: read as before checksums
    lambda data: data.replace(b"xxh3_64", b"sha1"),            # a checksum this build cannot check
    lambda data: data.replace(b'"bytes": ', b'"bytes": 1e999', 1),  # a size no int can hold
    lambda data: b"[" * 100_000,                               # nested past the parser's depth
    lambda data: data.replace(b'"files": {"', b'"files": {"../', 1),  # a file outside its folder
])
def test_a_damaged_manifest_is_never_a_checkpoint_without_one(save_dir, damage):
    path = iteration_dir(save_dir, 30)
    files = {entry.name: digest_file(entry) for entry in path.iterdir()}
    write_manifest(path, "periodic", 30, files)
    manifest = path / MANIFEST_NAME
    manifest.write_bytes(damage(manifest.read_bytes()))
    assert checkpoint_problem(path) == \
        f"{MANIFEST_NAME} is unreadable, so the checksums cannot be checked"
    choice = find_loadable_checkpoint(save_dir)
    assert choice.iteration == 20 and choice.skipped[0][0] == 30


def test_a_digesting_writer_hashes_what_reaches_the_file(tmp_path):
    target = tmp_path / "out.bin"
    with DigestingWriter(target) as writer:
        writer.write(b"abc")
        writer.write(memoryview(b"defgh"))
        assert writer.tell() == 8
    assert writer.digest() == digest_file(target) == digest_bytes(b"abcdefgh")
    assert writer.open_seconds >= writer.hash_seconds >= 0
    assert not hasattr(writer, "seek")  # a seek would make the digest describe other bytes


def test_a_digesting_writer_hashes_each_item_and_the_manifest_keeps_them(tmp_path):
    target = tmp_path / "__0_0.distcp"
    with DigestingWriter(target) as writer:
        for item in (b"header", b"tensor bytes", b"x"):
            writer.begin_item()
            writer.write(item[:3])
            writer.write(item[3:])
            writer.end_item()
    items = {0: digest_bytes(b"header"), 6: digest_bytes(b"tensor bytes"), 18: digest_bytes(b"x")}
    assert writer.items == items
    write_manifest(tmp_path, "periodic", 7, {target.name: writer.digest()}, {target.name: items})
    manifest = read_manifest(tmp_path)
    assert manifest.items == {target.name: items}
    assert manifest.items_cover(target.name)
    assert item_problem(manifest, target.name, 6, b"tensor bytes") is None
    assert item_problem(manifest, target.name, 6, b"tensor bytez") == (
        f"{target.name} checksum mismatch in the item at byte 6 (xxh3_64 "
        f"{digest_bytes(b'tensor bytez').digest}, the manifest says {items[6].digest})")
    assert item_problem(manifest, target.name, 6, b"tensor") == (
        f"{target.name} checksum mismatch in the item at byte 6 (6 bytes, the manifest says 12)")
    assert item_problem(manifest, target.name, 5, b"x") == (
        f"{target.name} has no item at byte 5 in the manifest")


@pytest.mark.parametrize("items, covers", [
    ({0: (4, "a"), 4: (6, "b")}, True),
    ({0: (4, "a")}, False),              # the file's tail is in no item
    ({0: (4, "a"), 5: (5, "b")}, False),  # a gap
    ({}, False),
])
def test_items_cover_a_file_only_when_they_tile_it(tmp_path, items, covers):
    items = {offset: FileDigest(size, digest) for offset, (size, digest) in items.items()}
    write_manifest(tmp_path, "periodic", 1, {"f.distcp": digest_bytes(b"0123456789")},
                   {"f.distcp": items} if items else None)
    assert read_manifest(tmp_path).items_cover("f.distcp") is covers


def test_a_manifest_without_checksums_still_gives_the_kind(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"kind": "emergency"}))
    manifest = read_manifest(tmp_path)
    assert (manifest.kind, manifest.files) == ("emergency", {})
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    assert read_manifest(tmp_path) is None


def make_kinds(save_dir, kinds, tracked):
    for iteration, kind in kinds.items():
        iteration_dir(save_dir, iteration).mkdir(parents=True)
        if kind:
            write_manifest(iteration_dir(save_dir, iteration), kind, iteration, {})
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


def test_an_iteration_past_seven_digits_is_found_under_its_megatron_name(tmp_path):
    """Megatron names iteration 10,000,000 iter_10000000 ({:07d} is a minimum width)."""
    write_checkpoint(tmp_path, 9_999_990)
    write_checkpoint(tmp_path, 10_000_000)
    tracker_path(tmp_path).write_text("10000000\n")
    (tmp_path / "iter_00000020").mkdir()  # not a name any save gives: not iteration 20
    (tmp_path / "iter_0000030\n").mkdir()  # nor is this one ("$" took its newline)
    assert loading_candidates(tmp_path).iterations == (10_000_000, 9_999_990)
    assert find_loadable_checkpoint(tmp_path).path == tmp_path / "iter_10000000"


@pytest.mark.parametrize("final, ended", [("whole", 40), ("torn", None), ("empty", None)])
def test_the_schedules_last_checkpoint_counts_only_when_a_load_would_take_it(tmp_path, final,
                                                                            ended):
    """A lost store ends a node as complete when --save holds --train-iters' checkpoint: a
    torn one there (a truncated shard, a folder with nothing in it) counted too, though a
    requeue would load iteration 30 and train on to 40."""
    from ftmaster.recovery.checkpoints import schedule_on_disk

    write_checkpoint(tmp_path, 30)
    path = write_checkpoint(tmp_path, 40)
    if final == "torn":
        shard = next(path.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    if final == "empty":
        for entry in path.iterdir():
            entry.unlink()
    tracker_path(tmp_path).write_text("40\n")
    assert schedule_on_disk(["--train-iters", "40", "--save", str(tmp_path)]) == ended
