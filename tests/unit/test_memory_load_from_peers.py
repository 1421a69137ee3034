"""The load of a node-local memory checkpoint whose shards this node lacks reads them from the
peers ftmaster lists: the real torch_dist load, reader and peer client, in a gloo group of one.

A peer that fails while it is read from says nothing of the checkpoint: the attempt ends (the
next round agrees anew on what the live nodes hold). Falling back to an older checkpoint set
aside every node's copy of the newest as a discarded timeline, and the next memory save
pruned them: the newest state, whole on the live nodes, lost for one peer's hiccup. A shard
every peer answers it does not hold is a checkpoint that cannot be loaded: the older one is
resumed, as before."""

import contextlib
import json
import re
import socket
import threading
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

from ftmaster.peer_files import PeerServeConfig, PeerServer, new_secret, write_peer_list
from ftmaster.recovery.checkpoints import (COMMON_FILE, CONFIG_FILE, DCP_METADATA_FILE,
                                           advance_tracker, iteration_dir, read_tracker)
from ftmaster.recovery.manifest import digest_bytes, digest_file, write_manifest
from megatron.training import checkpointing
from helpers.process_group import process_group_of_one


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with process_group_of_one(tmp_path_factory.mktemp("pg")) as world:
        yield world


def template() -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64))}


def memory_checkpoint(memory_dir, iteration: int) -> None:
    """A real torch_dist checkpoint of ``w`` (all ``iteration``) with its item checksums."""
    folder = iteration_dir(memory_dir, iteration)
    folder.mkdir(parents=True)
    dcp.save({"w": torch.full((64,), float(iteration))}, checkpoint_id=str(folder), no_dist=True)
    torch.save({}, folder / COMMON_FILE)
    (folder / CONFIG_FILE).write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
         "common_backend": "torch", "common_backend_version": 1}))
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    items = {}
    for info in metadata.storage_data.values():
        data = (folder / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        items.setdefault(info.relative_path, {})[info.offset] = digest_bytes(data)
    files = {path.name: digest_file(path) for path in folder.iterdir()}
    write_manifest(folder, "periodic", iteration, files, items)
    advance_tracker(memory_dir, iteration)


def node_local_checkpointer(memory_dir, group, events: list):
    """A checkpointer of one node with a node-local memory tier: the real load, but for the
    model (one tensor, ``w``)."""
    checkpointer = object.__new__(checkpointing.Checkpointer)
    args = types.SimpleNamespace(save=None, load=str(memory_dir / "disk"), no_load_optim=True,
                                 no_load_rng=True, tensor_model_parallel_size=1,
                                 pipeline_model_parallel_size=1)
    vars(checkpointer).update(
        args=args, memory_dir=memory_dir, node_local_memory=True, memory_owner=0, group=group,
        own_states=checkpointing.OwnStates(),
        event=lambda name, **fields: events.append((name, fields)),
        _state_dict=lambda state, **how: template(),
        _load_strategy=lambda path: TorchDistLoadShardedStrategy(),
        _apply=lambda loaded, state, *how: setattr(state, "iteration", int(loaded["w"][0])))
    return checkpointer


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def peer_that_hangs_up():
    """A peer that takes each request's connection and closes it without an answer."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        with contextlib.suppress(OSError):  # the listener shut down
            while True:
                listener.accept()[0].close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()


FAILING_PEERS = {
    "refuses": (lambda: contextlib.nullcontext(f"http://127.0.0.1:{closed_port()}"),
                "Connection refused"),
    # closed before or after the request went out, as the race goes
    "hangs-up": (peer_that_hangs_up, "without response|reset by peer|Broken pipe"),
}


@pytest.fixture
def newest_lacks_its_shards(tmp_path, monkeypatch):
    """Iterations 4 and 6 in this node's memory tier, 6 without its shards (they are on the
    peers); the run folder the trainer reads the peers from."""
    memory_dir, run_dir = tmp_path / "memory", tmp_path / "run"
    for iteration in (4, 6):
        memory_checkpoint(memory_dir, iteration)
    newest = iteration_dir(memory_dir, 6)
    for shard in newest.glob("*.distcp"):
        shard.unlink()
    assert (newest / DCP_METADATA_FILE).is_file()
    run_dir.mkdir()
    monkeypatch.setenv("FTMASTER_RUN_DIR", str(run_dir))
    return memory_dir, run_dir


@pytest.mark.parametrize("peer", FAILING_PEERS)
def test_a_peer_that_fails_during_the_read_ends_the_attempt_and_keeps_the_newest(
        newest_lacks_its_shards, group, peer):
    memory_dir, run_dir = newest_lacks_its_shards
    failing_peer, its_error = FAILING_PEERS[peer]
    events = []
    checkpointer = node_local_checkpointer(memory_dir, group, events)
    with failing_peer() as url:
        write_peer_list(run_dir, new_secret(), [url])
        with pytest.raises(checkpointing.PeerReadFailed) as failed:
            checkpointer.load(types.SimpleNamespace(iteration=0))

    reason = str(failed.value)
    assert "\n" not in reason and "iter_0000006" in reason and re.search(its_error, reason)
    assert [name for name, _ in events] == ["load_failed"]
    assert events[0][1] == {"path": checkpointer.args.load, "reason": reason}
    assert iteration_dir(memory_dir, 6).is_dir() and read_tracker(memory_dir) == 6
    assert not list(memory_dir.glob("*discarded*"))


def test_shards_every_peer_answers_it_lacks_fall_back_to_the_older_checkpoint(
        newest_lacks_its_shards, group, tmp_path):
    memory_dir, run_dir = newest_lacks_its_shards
    secret = new_secret()
    empty = tmp_path / "peer"
    empty.mkdir()
    server = PeerServer(PeerServeConfig(empty, secret))
    try:
        write_peer_list(run_dir, secret, [server.url])
        events = []
        state = types.SimpleNamespace(iteration=0)
        assert node_local_checkpointer(memory_dir, group, events).load(state)
    finally:
        server.close()

    assert state.iteration == 4
    skipped = [fields for name, fields in events if name == "checkpoint_skipped"]
    assert [s["iteration"] for s in skipped] == [6] and "404" in skipped[0]["reason"]
    assert not iteration_dir(memory_dir, 6).exists() and read_tracker(memory_dir) == 4
