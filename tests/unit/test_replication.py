"""Who copies from whom across nodes (pure), and one node's copies from two live peers."""

import shutil
from dataclasses import replace

import pytest

from ftmaster.membership import NodeRecord
from ftmaster.peer_files import PeerServeConfig, PeerServer, new_secret, peer_clients
from ftmaster.recovery.checkpoints import advance_tracker, iteration_dir, read_tracker
from ftmaster.recovery.manifest import MANIFEST_NAME, digest_file, read_manifest, write_manifest
from ftmaster.replication import (Replication, ReplicationConfig, ReplicationFailed, rank_ranges,
                                  writer_rank)
from helpers.trainer import wait_until

SECRET = new_secret()


def nodes(count):
    return tuple(NodeRecord(r, "127.0.0.1", (0, 1), 1000 + r, peer_url=f"http://n{r}:1")
                 for r in range(count))


@pytest.mark.parametrize("name, rank", [("__3_0.distcp", 3), ("__12_objects.distcp", 12),
                                        (".metadata", None), ("common.pt", None),
                                        ("metadata.json", None)])
def test_a_shard_file_names_the_rank_that_wrote_it(name, rank):
    assert writer_rank(name) == rank


@pytest.mark.parametrize("count, me, ranks, replicas, sources, rank0", [
    (2, 0, [2, 2], 1, [(1, range(2, 4))], None),
    (2, 1, [2, 2], 1, [(0, range(0, 2))], 0),
    (4, 3, [2, 2, 2, 2], 1, [(0, range(0, 2))], 0),  # round the ring
    (4, 1, [2, 2, 2, 2], 2, [(2, range(4, 6)), (3, range(6, 8))], 0),
    (3, 0, [2, 0, 2], 1, [(2, range(2, 4))], None),  # a node without ranks holds none
    (3, 1, [2, 0, 2], 1, [(2, range(2, 4))], 0),  # ... but may hold copies
    (2, 0, [2, 2], 3, [(1, range(2, 4))], None),  # more replicas than peers
])
def test_each_node_copies_the_next_nodes_shards_and_the_rest_from_rank_0s(
        tmp_path, count, me, ranks, replicas, sources, rank0):
    replication = Replication(ReplicationConfig(tmp_path / "memory", tmp_path / "run", me, replicas))
    try:
        replication.new_round(SECRET, nodes(count), me, ranks)
        peers = replication._peers
    finally:
        replication.close()
    assert [(node, ranks) for node, _, ranks in peers.sources] == sources
    listed = [client.url for client in peer_clients(tmp_path / "run")]  # what a load reads from
    assert listed == [f"http://n{r}:1" for r in range(count) if r != me]
    assert (None if peers.rank0 is None else peers.rank0[0]) == rank0


@pytest.mark.parametrize("ranks_per_node, ranges", [
    ([2, 2], [range(0, 2), range(2, 4)]), ([2, 0, 3], [range(0, 2), range(2, 2), range(2, 5)])])
def test_each_node_runs_a_contiguous_range_of_global_ranks(ranks_per_node, ranges):
    assert rank_ranges(ranks_per_node) == ranges


def test_replicas_must_be_at_least_one(tmp_path):
    with pytest.raises(ValueError, match="--memory-replicas must be at least 1"):
        ReplicationConfig(tmp_path, tmp_path, 0, replicas=0)


def shard_checkpoint(folders, iteration=4):
    """Node 0 (ranks 0-1) wrote rank 0's files and the manifest, node 1 ranks 2-3's."""
    files = {}
    for node, names in ((0, [".metadata", "common.pt", "__0_0.distcp", "__1_0.distcp"]),
                        (1, ["__2_0.distcp", "__3_0.distcp"])):
        folder = iteration_dir(folders[node], iteration)
        folder.mkdir(parents=True)
        for name in names:
            (folder / name).write_bytes(name.encode() * 1000)
            files[name] = digest_file(folder / name)
    write_manifest(iteration_dir(folders[0], iteration), "periodic", iteration, files)


def test_after_a_save_each_of_two_nodes_holds_a_whole_copy_and_moves_its_tracker(tmp_path):
    folders = [tmp_path / "node0", tmp_path / "node1"]
    shard_checkpoint(folders)
    replications = [Replication(ReplicationConfig(folders[r], tmp_path / f"run{r}", r)) for r in (0, 1)]
    try:
        records = tuple(replace(n, peer_url=replications[n.node_rank].url) for n in nodes(2))
        for r in (0, 1):
            replications[r].new_round(SECRET, records, r, [2, 2])
            replications[r].saved(4)
        results = [[], []]
        wait_until(lambda: all(results[r].extend(replications[r].take_results()) or
                               len(results[r]) == (1, 2)[r] for r in (0, 1)),
                   timeout=30, what="both copies")
    finally:
        for replication in replications:
            replication.close()
    assert [(node, copied.missing) for node, copied in results[0]] == [(1, ())]
    assert {node for node, _ in results[1]} == {0}
    for folder in folders:
        assert read_manifest(iteration_dir(folder, 4)) == read_manifest(iteration_dir(folders[0], 4))
        assert sorted(p.name for p in iteration_dir(folder, 4).iterdir()) == sorted(
            [".metadata", "common.pt", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
             "__3_0.distcp", MANIFEST_NAME])
    assert read_tracker(folders[1]) == 4  # node 0's tracker is the trainer's to move


def test_a_peer_that_is_gone_is_a_failed_copy_not_a_crash(tmp_path):
    folders = [tmp_path / "node0", tmp_path / "node1"]
    shard_checkpoint(folders)
    replication = Replication(ReplicationConfig(folders[0], tmp_path / "run0", 0, timeout_s=2))
    gone = PeerServer(PeerServeConfig(folders[1], SECRET))
    url = gone.url
    gone.close()
    try:
        replication.new_round(SECRET, (replace(nodes(2)[0], peer_url=replication.url),
                                       replace(nodes(2)[1], peer_url=url)), 0, [2, 2])
        replication.saved(4)
        failed = wait_until(lambda: replication.take_results(), timeout=30, what="the failure")
    finally:
        replication.close()
    assert isinstance(failed[0], ReplicationFailed) and failed[0].iteration == 4
    assert "refused" in failed[0].reason
    assert not (iteration_dir(folders[0], 4) / "__2_0.distcp").exists()


def test_a_node_that_rejoins_catches_up_on_the_checkpoint_rank_0_will_load(tmp_path):
    """Node 1 comes back with nothing: before the launch it copies what node 0's memory
    tracker names, every file, from node 0; asked again, it copies nothing."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    shard_checkpoint(folders)
    for name in ("__2_0.distcp", "__3_0.distcp"):  # node 0's copy is whole
        (iteration_dir(folders[1], 4) / name).rename(iteration_dir(folders[0], 4) / name)
    write_manifest(iteration_dir(folders[0], 4), "periodic", 4,
                   {p.name: digest_file(p) for p in iteration_dir(folders[0], 4).iterdir()
                    if p.name != MANIFEST_NAME})
    advance_tracker(folders[0], 4)
    replications = [Replication(ReplicationConfig(folders[r], tmp_path / f"run{r}", r)) for r in (0, 1)]
    try:
        records = tuple(replace(n, peer_url=replications[n.node_rank].url) for n in nodes(2))
        for r in (0, 1):
            replications[r].new_round(SECRET, records, r, [2, 2])
        assert replications[0].catch_up() == []  # rank 0's own node
        ((node, copied),) = replications[1].catch_up()
        again = replications[1].catch_up()
        used = replications[1].used_bytes()
    finally:
        for replication in replications:
            replication.close()
    assert (node, copied.iteration, copied.missing) == (0, 4, ())
    assert read_tracker(folders[1]) == 4 and again == []
    assert read_manifest(iteration_dir(folders[1], 4)) == read_manifest(iteration_dir(folders[0], 4))
    assert used == sum(p.stat().st_size for p in folders[1].rglob("*") if p.is_file())


@pytest.mark.parametrize("rank0_holds", ["its own shards", "nothing"])
def test_rank_0s_node_catches_up_on_a_newer_whole_copy_a_peer_holds(tmp_path, rank0_holds):
    """Copies still on their way when a GPU failed, or node 0 replaced after a requeue: node 1
    tracks a whole iteration 4, so node 0 makes it whole too before its rank 0 picks."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    shard_checkpoint(folders)
    mine, theirs = (iteration_dir(folder, 4) for folder in folders)
    for path in mine.iterdir():
        shutil.copy(path, theirs)
    advance_tracker(folders[1], 4)
    if rank0_holds == "nothing":
        shutil.rmtree(folders[0])
    else:
        advance_tracker(folders[0], 4)  # the trainer's rank 0 moved it with the manifest
    replications = [Replication(ReplicationConfig(folders[r], tmp_path / f"run{r}", r)) for r in (0, 1)]
    try:
        records = tuple(replace(n, peer_url=replications[n.node_rank].url) for n in nodes(2))
        for r in (0, 1):
            replications[r].new_round(SECRET, records, r, [2, 2])
        caught_up = replications[0].catch_up()
    finally:
        for replication in replications:
            replication.close()
    assert [(node, copied.iteration, copied.missing) for node, copied in caught_up] == [(1, 4, ())]
    assert read_tracker(folders[0]) == 4
    assert sorted(p.name for p in mine.iterdir()) == sorted(p.name for p in theirs.iterdir())
