"""A load checks each item of a torch_dist shard as it reads it: the real DCP reader, one
process, against a manifest of item checksums; and unpickles ``.metadata`` once."""

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ftmaster.recovery.checkpoints import COMMON_FILE, CONFIG_FILE, checkpoint_problem
from ftmaster.recovery.manifest import (Manifest, digest_bytes, digest_file, digest_problem,
                                        write_manifest)
from megatron.training.checksums import ChecksumMismatch, VerifyingReader, reads_for_load
from megatron.training.checkpointing import describe_error
from helpers.process_group import process_group_of_one

STATE = {"weight": torch.arange(4096, dtype=torch.float32), "bias": torch.ones(300)}


@pytest.fixture
def saved(tmp_path):
    """A real torch_dist folder and the manifest its writer would have left: each item's
    checksum taken from the bytes ``.metadata`` points at."""
    dcp.save(STATE, checkpoint_id=str(tmp_path), no_dist=True)
    storage = dcp.FileSystemReader(str(tmp_path)).read_metadata().storage_data
    items = {}
    for info in storage.values():
        with open(tmp_path / info.relative_path, "rb") as shard:
            shard.seek(info.offset)
            items.setdefault(info.relative_path, {})[info.offset] = digest_bytes(
                shard.read(info.length))
    files = {name: digest_file(tmp_path / name) for name in items}
    return tmp_path, Manifest("periodic", 1, files, items)


def load(path, manifest):
    counter = [0]
    state = {name: torch.zeros_like(tensor) for name, tensor in STATE.items()}
    dcp.load(state, storage_reader=VerifyingReader(str(path), manifest, counter), no_dist=True)
    return state, counter[0]


def test_every_item_is_checked_once_and_loads_as_saved(saved):
    path, manifest = saved
    state, verified = load(path, manifest)
    assert all(torch.equal(state[name], STATE[name]) for name in STATE)
    assert verified == manifest.total_bytes
    assert all(manifest.items_cover(name) for name in manifest.files)


def test_a_changed_byte_in_an_item_stops_the_load_with_the_item_named(saved):
    path, manifest = saved
    name = next(iter(manifest.items))
    offset, item = max(manifest.items[name].items())
    shard = path / name
    data = bytearray(shard.read_bytes())
    data[offset + item.bytes // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as raised:
        load(path, manifest)
    (failure, _trace), = raised.value.failures.values()
    assert isinstance(failure, ChecksumMismatch)
    assert describe_error(raised.value).startswith(
        f"{name} checksum mismatch in the item at byte {offset} (xxh3_64 ")


def test_an_item_the_manifest_does_not_know_is_refused(saved):
    path, manifest = saved
    name = next(iter(manifest.items))
    lacking = Manifest("periodic", 1, manifest.files, {name: dict(list(manifest.items[name].items())[1:])})
    with pytest.raises(CheckpointException) as raised:
        load(path, lacking)
    assert describe_error(raised.value) == f"{name} has no item at byte 0 in the manifest"


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """megatron-core's load strategy asks for the rank: a gloo group of one."""
    with process_group_of_one(tmp_path_factory.mktemp("pg")):
        yield


def metadata_unpickles(monkeypatch) -> list[Metadata]:
    """The ``.metadata`` unpickled from now on (by ``pickle.load`` or ``pickle.loads``), one
    entry per unpickle."""
    unpickled = []

    def counting(unpickle):
        def counted(*args, **kwargs):
            result = unpickle(*args, **kwargs)
            if isinstance(result, Metadata):
                unpickled.append(result)
            return result
        return counted

    monkeypatch.setattr(pickle, "load", counting(pickle.load))
    monkeypatch.setattr(pickle, "loads", counting(pickle.loads))
    return unpickled


def load_in_two_parts(path) -> None:
    """Load as megatron-core's fully parallel load does (more than one data-parallel rank):
    the sharded objects, then the tensors, each with a reader its strategy asks for."""
    strategy = TorchDistLoadShardedStrategy()
    parts = [strategy.load({name: ShardedTensor.from_rank_offsets(
        name, torch.zeros_like(STATE[name]))}, path) for name in ("bias", "weight")]
    assert [part[name] for part, name in zip(parts, ("bias", "weight"))] == [
        pytest.approx(STATE["bias"]), pytest.approx(STATE["weight"])]


@pytest.mark.parametrize("checksummed", [True, False], ids=["item-checksums", "no-manifest"])
def test_a_load_in_two_parts_unpickles_metadata_once(saved, process_group, monkeypatch,
                                                     checksummed):
    """One unpickle of ``.metadata`` serves both parts, and every item is still checked as
    read."""
    path, manifest = saved
    unpickled = metadata_unpickles(monkeypatch)
    with reads_for_load(manifest if checksummed else None, []) as counter:
        load_in_two_parts(path)
    assert counter[0] == (manifest.total_bytes if checksummed else 0)
    assert len(unpickled) == 1


def with_side_files(path: Path) -> Path:
    """The torch_dist folder made a checkpoint the structure check accepts."""
    torch.save({}, path / COMMON_FILE)
    (path / CONFIG_FILE).write_text("{}")
    return path


def test_the_structure_checks_and_the_load_unpickle_metadata_once(saved, process_group,
                                                                   monkeypatch):
    """A relaunch's rank 0 checks the structure of the checkpoint it resumes when it reads
    the saved arguments, again just before the load, then loads it: one unpickle serves all."""
    path, manifest = saved
    unpickled = metadata_unpickles(monkeypatch)
    assert [checkpoint_problem(with_side_files(path)), checkpoint_problem(path)] == [None, None]
    with reads_for_load(manifest, []):
        load_in_two_parts(path)
    assert len(unpickled) == 1


def test_a_metadata_changed_after_its_check_is_what_the_load_reads(saved, process_group):
    """The load reads the ``.metadata`` there is, not the one checked before: here rewritten
    to point at a shard that is not there, which the load then fails to find."""
    path, manifest = saved
    assert checkpoint_problem(with_side_files(path)) is None
    metadata = pickle.loads((path / ".metadata").read_bytes())
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = dataclasses.replace(info, relative_path="gone.distcp")
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointException, match="gone.distcp"):
        with reads_for_load(None, []):
            load_in_two_parts(path)


def replaced_metadata(path: Path) -> bytes:
    """``path``'s ``.metadata`` as another writer might leave it: still one a load can follow,
    marked so that an unpickle of it shows."""
    metadata = pickle.loads((path / ".metadata").read_bytes())
    metadata.replaced_after_its_check = True
    return pickle.dumps(metadata)


@pytest.mark.parametrize("with_items", [True, False], ids=["item-checksums", "file-checksums"])
def test_a_metadata_replaced_after_its_checks_fails_the_load_unpickled(saved, process_group,
                                                                      monkeypatch, caplog,
                                                                      with_items):
    """What the load unpickles is what it compared with the manifest: a ``.metadata``
    replaced between the checks before the load and the load's own read of it is a checksum
    mismatch, as a damaged shard is, and its bytes are never unpickled. The reason is that
    mismatch alone, not within torch's words ("metadata is None; global metadata read
    failed: ..."), and torch logs no traceback of it."""
    path, manifest = saved
    files = {**manifest.files, ".metadata": digest_file(path / ".metadata")}
    manifest = Manifest("periodic", 1, files, manifest.items if with_items else {})
    write_manifest(with_side_files(path), "periodic", 1, files, manifest.items)
    assert checkpoint_problem(path) is None
    assert digest_problem(path, manifest, [".metadata"]) is None
    (path / ".metadata").write_bytes(replaced_metadata(path))
    unpickled = metadata_unpickles(monkeypatch)
    with pytest.raises(CheckpointException) as raised:
        with reads_for_load(manifest, []):
            load_in_two_parts(path)
    assert describe_error(raised.value).startswith(".metadata checksum mismatch (")
    assert "Global metadata is not found" not in caplog.text
    assert not any(hasattr(metadata, "replaced_after_its_check") for metadata in unpickled)
