"""A load checks each item of a torch_dist shard as it reads it: the real DCP reader, one
process, against a manifest of item checksums; and unpickles ``.metadata`` once."""

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException

from ftmaster.recovery.manifest import Manifest, digest_bytes, digest_file
from megatron.training.checksums import ChecksumMismatch, VerifyingReader, reads_for_load
from megatron.training.checkpointing import describe_error

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
    store = torch.distributed.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def metadata_unpickles(monkeypatch) -> list[str]:
    """The ``.metadata`` files unpickled from now on, one entry per unpickle."""
    unpickled, load = [], pickle.load

    def counting(file, *args, **kwargs):
        if Path(getattr(file, "name", "")).name == ".metadata":
            unpickled.append(file.name)
        return load(file, *args, **kwargs)

    monkeypatch.setattr(pickle, "load", counting)
    return unpickled


@pytest.mark.parametrize("checksummed", [True, False], ids=["item-checksums", "no-manifest"])
def test_a_load_in_two_parts_unpickles_metadata_once(saved, process_group, monkeypatch,
                                                     checksummed):
    """megatron-core's fully parallel load (more than one data-parallel rank) loads the
    sharded objects, then the tensors, each with a reader its load strategy asks for: one
    unpickle of ``.metadata`` serves both, and every item is still checked as read."""
    path, manifest = saved
    unpickled = metadata_unpickles(monkeypatch)
    strategy = TorchDistLoadShardedStrategy()
    with reads_for_load(manifest if checksummed else None, []) as counter:
        parts = [strategy.load({name: ShardedTensor.from_rank_offsets(
            name, torch.zeros_like(STATE[name]))}, path) for name in ("bias", "weight")]
    assert [part[name] for part, name in zip(parts, ("bias", "weight"))] == [
        pytest.approx(STATE["bias"]), pytest.approx(STATE["weight"])]
    assert counter[0] == (manifest.total_bytes if checksummed else 0)
    assert unpickled == [str(path / ".metadata")]
