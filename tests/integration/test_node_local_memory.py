"""A node-local memory tier on the real trainer: two torchrun "nodes" of 2 CPU ranks on
loopback, each with a memory folder of its own. Each node's ranks write their shards into
their node's folder, and rank 0 adds the checkpoint's manifest, metadata and tracker to its
own. Peer copies then make each folder whole; node 0's copy is the uninterrupted run's
checkpoint tensor for tensor, and a relaunch on node 0 alone loads it resharded."""

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from ftmaster import runfiles
from ftmaster.peer_files import (PeerClient, PeerServeConfig, PeerServer, copy_checkpoint,
                                 fill_from_peer, new_secret, write_peer_list)
from ftmaster.recovery.checkpoints import checkpoint_problem, iteration_dir, read_tracker
from ftmaster.recovery.manifest import MANIFEST_NAME, read_manifest
from helpers.replicas import unequal_tensors
from helpers.trainer import (REPO, SMALL_GPT, free_port, kill_session, layout_args,
                             run_trainer, torchrun_argv, trainer_env)

pytestmark = pytest.mark.slow

ARGS = SMALL_GPT + ["--micro-batch-size", "2", "--global-batch-size", "12", "--train-iters", "6",
                    "--lr", "1e-2", "--min-lr", "1e-4", "--lr-warmup-iters", "2",
                    "--lr-decay-style", "cosine", "--seed", "7"]


@pytest.fixture
def node_folders():
    """Each node's memory folder in /dev/shm, removed afterwards."""
    folders = [Path(f"/dev/shm/ftmaster-test-{uuid.uuid4().hex[:8]}-node{r}") for r in (0, 1)]
    yield folders
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def memory_tier(folder: Path) -> list[str]:
    return ["--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir",
            str(folder), "--non-persistent-save-interval", "2"]


def run_two_nodes(args_of_node, timeout=300) -> list[str]:
    """torchrun once per node (2 ranks each, static rendezvous on loopback); their outputs."""
    port = free_port()
    processes = [subprocess.Popen(
        torchrun_argv(2, args_of_node(rank), nodes=(2, rank), port=port), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=trainer_env(), cwd=REPO, start_new_session=True)
        for rank in (0, 1)]
    try:
        outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    finally:
        for process in processes:
            kill_session(process)
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    return outputs


def shard_files(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.distcp")}


def test_each_node_holds_its_own_shards_and_peer_copies_make_a_whole_checkpoint(
        tmp_path, node_folders):
    reference = tmp_path / "reference"
    result = run_trainer(4, ARGS + layout_args(2, 2) + ["--save", str(reference),
                                                        "--save-interval", "2"])
    assert result.returncode == 0, result.stdout[-3000:]
    run_two_nodes(lambda rank: ARGS + layout_args(2, 2) + memory_tier(node_folders[rank]) + [
        "--save", str(tmp_path / "disk"), "--save-interval", "100"])

    iteration = read_tracker(node_folders[0])
    assert iteration in (4, 6)
    assert read_tracker(node_folders[1]) is None  # only rank 0 writes a tracker
    mine, peers = (iteration_dir(folder, iteration) for folder in node_folders)
    manifest = read_manifest(mine)
    assert not (peers / MANIFEST_NAME).exists()
    # TP2 x PP2 over 2 nodes: node 1's ranks (stage 1) wrote their shards in its folder only
    own, theirs = shard_files(mine), shard_files(peers)
    assert own and theirs and not own & theirs
    assert own | theirs == {name for name in manifest.files if name.endswith(".distcp")}
    assert "is missing" in checkpoint_problem(mine)

    secret = new_secret()
    servers = [PeerServer(PeerServeConfig(folder, secret)) for folder in node_folders]
    try:
        # Before any copy, node 0 alone (TP2 x PP1) reads the shards it lacks from node 1's
        # server: by ranges, each item checked against the manifest, nothing copied
        alone, run_dir = tmp_path / "node0-alone", tmp_path / "run0"
        shutil.copytree(node_folders[0], alone)  # its own saves go there
        run_dir.mkdir()
        write_peer_list(run_dir, secret, [servers[1].url])
        remote = run_trainer(2, ARGS + layout_args(2, 1) + memory_tier(alone) + [
            "--save", str(tmp_path / "alone-disk"), "--load", str(tmp_path / "alone-disk")],
            FTMASTER_RUN_DIR=str(run_dir))
        assert remote.returncode == 0, remote.stdout[-3000:]
        assert f"loaded checkpoint from {iteration_dir(alone, iteration)} at iteration " \
               f"{iteration}" in remote.stdout
        loaded = [e for e in runfiles.read_events(run_dir) if e["event"] == "checkpoint_loaded"]
        assert loaded[0]["verified_on_read"] >= sum(manifest.files[n].bytes for n in theirs) * 0.9
        # node 1's shards came from its server (an item two ranks need is read by each)
        assert loaded[0]["peer_bytes"] >= sum(manifest.files[n].bytes for n in theirs) * 0.9
        assert not shard_files(iteration_dir(alone, iteration)) & theirs

        filled = fill_from_peer(PeerClient(servers[1].url, secret), iteration, node_folders[0],
                                (mine / MANIFEST_NAME).read_bytes())
        copied = copy_checkpoint(PeerClient(servers[0].url, secret), iteration, node_folders[1])
    finally:
        for server in servers:
            server.close()
    assert filled.missing == ()
    assert filled.bytes == sum(manifest.files[name].bytes for name in theirs)
    assert copied.missing == () and read_manifest(peers) == manifest
    assert checkpoint_problem(mine) is None and checkpoint_problem(peers) is None
    assert unequal_tensors(mine, iteration_dir(reference, iteration)) == []

    # Node 1 is gone: node 0 alone (TP2 x PP1) resumes from its own folder. A copy damaged
    # at rest after it arrived (one flipped bit) is refused, never loaded.
    relaunch = ARGS + layout_args(2, 1) + memory_tier(node_folders[0]) + [
        "--save", str(tmp_path / "after"), "--load", str(tmp_path / "after")]
    copy = mine / sorted(theirs)[0]
    good = copy.read_bytes()
    copy.write_bytes(good[:-100] + bytes([good[-100] ^ 1]) + good[-99:])
    refused = run_trainer(2, relaunch)
    assert refused.returncode != 0
    assert f"skipping checkpoint {mine}" in refused.stdout and "loaded checkpoint" not in refused.stdout
    copy.write_bytes(good)
    resumed = run_trainer(2, relaunch)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"loaded checkpoint from {mine} at iteration {iteration}" in resumed.stdout
