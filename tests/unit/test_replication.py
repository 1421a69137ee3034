"""Who copies from whom across nodes (pure), and one node's copies from two live peers."""

import contextlib
import os
import shutil
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from ftmaster.membership import NodeRecord, free_port
from ftmaster import replication as replication_module
from ftmaster.peer_files import (PeerClient, PeerError, PeerServeConfig, PeerServer, new_secret,
                               peer_clients)
import json

from ftmaster.persist import PersistError, Persister, PersistSuperseded, persist
from ftmaster.recovery.checkpoints import (advance_tracker, checkpoint_problem, is_complete,
                                           iteration_dir, tier_candidates,
                                           kept_memory_checkpoints, mark_replicated, mark_whole,
                                           read_tracker, replicated_here, whole_here)
from ftmaster.recovery.manifest import (HELD_MANIFEST_NAME, MANIFEST_NAME, digest_bytes,
                                        digest_file, digest_problem, read_manifest,
                                        write_manifest)
from ftmaster.replication import (Agreed, MemoryAgreement, Replication, ReplicationConfig,
                                  ReplicationFailed, holdings_of, newest_complete, rank_ranges,
                                  writer_rank)
from helpers.trainer import wait_until
from megatron.training.checkpointing import set_aside_newer
from megatron.training.memory_slots import MemorySlots

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


def shard_checkpoint(folders, iteration=4, items=False):
    """Node 0 (ranks 0-1) wrote rank 0's files and the manifest, node N ranks 2N and 2N+1's;
    with ``items``, each shard is one item with its own checksum (a load checks it as read)."""
    files = {}
    for node, folder in enumerate(folders):
        names = [f"__{2 * node}_0.distcp", f"__{2 * node + 1}_0.distcp"]
        folder = iteration_dir(folder, iteration)
        folder.mkdir(parents=True)
        for name in names + ([".metadata", "common.pt"] if node == 0 else []):
            (folder / name).write_bytes(name.encode() * 1000 + bytes([iteration]))
            files[name] = digest_file(folder / name)
    write_manifest(iteration_dir(folders[0], iteration), "periodic", iteration, files,
                   {name: {0: digest} for name, digest in files.items() if writer_rank(name) is not None}
                   if items else None)


def agreed_on(folders, iteration=4):
    """What the nodes of ``folders`` (node rank: folder) hold, agreed."""
    agreed = newest_complete({r: json.dumps(holdings_of(f)) for r, f in folders.items()})
    assert agreed is not None and agreed.iteration == iteration
    return agreed


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
    # Each node keeps its whole copy from the trainer's next slot refill (on node 0 the
    # tracker names the newest save, whole there or not).
    assert [whole_here(folder) for folder in folders] == [4, 4]


def test_a_round_of_one_node_lets_go_of_the_whole_copy_it_kept(tmp_path):
    """Nothing is copied any more: the mark would keep its checkpoint from refills and pruning
    for the rest of the run."""
    folder = tmp_path / "node0"
    shard_checkpoint([folder])
    assert mark_whole(folder, 4)
    replication = Replication(ReplicationConfig(folder, tmp_path / "run0", 0))
    try:
        replication.new_round(SECRET, nodes(1), 0, [2])
        replication.saved(5)
        wait_until(lambda: whole_here(folder) is None, timeout=10, what="the mark let go")
    finally:
        replication.close()


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


def test_a_copy_that_got_nothing_from_a_peer_that_pruned_it_is_a_failed_copy(tmp_path):
    """It was a `replicated` event with 0 bytes: a copy said made that made nothing."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    shard_checkpoint(folders)
    for shard in iteration_dir(folders[1], 4).glob("__[23]_0.distcp"):
        shard.unlink()  # its slot refilled since the save
    replication = Replication(ReplicationConfig(folders[0], tmp_path / "run0", 0, timeout_s=2))
    peer = PeerServer(PeerServeConfig(folders[1], SECRET))
    try:
        replication.new_round(SECRET, (replace(nodes(2)[0], peer_url=replication.url),
                                       replace(nodes(2)[1], peer_url=peer.url)), 0, [2, 2])
        replication.saved(4)
        (failed,) = wait_until(lambda: replication.take_results(), timeout=30, what="the failure")
    finally:
        replication.close()
        peer.close()
    assert isinstance(failed, ReplicationFailed) and failed.iteration == 4
    assert failed.reason == "node 1 no longer holds __2_0.distcp, __3_0.distcp"


def copying_node_1(tmp_path):
    """Node 1 (ranks 2-3) about to copy iteration 4 from node 0 (ranks 0-1, rank 0's files)."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    shard_checkpoint(folders)
    replication = Replication(ReplicationConfig(folders[1], tmp_path / "run1", 1, timeout_s=5))
    peer = PeerServer(PeerServeConfig(folders[0], SECRET))
    replication.new_round(SECRET, (replace(nodes(2)[0], peer_url=peer.url),
                                   replace(nodes(2)[1], peer_url=replication.url)), 1, [2, 2])
    return folders[1], replication, peer


def trainer_claims_as_the_copy_checks(monkeypatch, path, found, claim):
    """The trainer (another process) claims a slot just as the copy finds whether ``path`` is
    a file (``found``): it goes ahead at once, or as soon as the tier's lock lets it."""
    is_file, claims = Path.is_file, []

    def checked(self):
        answer = is_file(self)
        if self == path and answer == found and not claims:
            claims.append(threading.Thread(target=claim))
            claims[0].start()
            claims[0].join(0.5)
        return answer

    monkeypatch.setattr(Path, "is_file", checked)
    return claims


def test_a_slot_refilled_as_a_copy_turns_whole_is_never_named_by_the_nodes_tracker(
        tmp_path, monkeypatch):
    """A copy that lasted two memory intervals: the trainer took the slot for its next save
    between the copy's finding its manifest and its moving the tracker, which then named a
    folder gone (and, on a rollback saving that iteration again, one being written)."""
    folder, replication, peer = copying_node_1(tmp_path)
    claims = trainer_claims_as_the_copy_checks(
        monkeypatch, iteration_dir(folder, 4) / MANIFEST_NAME, True,
        lambda: MemorySlots(folder, {2, 3}).claim(4, iteration_dir(folder, 6)))
    try:
        replication._copy(4, replication._peers)
    finally:
        replication.close()
        peer.close()
    claims[0].join()
    tracked = read_tracker(folder)
    assert tracked is None or is_complete(iteration_dir(folder, tracked))


def test_a_copy_whose_slot_the_trainer_refills_fails_and_never_makes_its_folder_again(
        tmp_path, monkeypatch):
    """Taken between the copy's looking for a manifest and its writing the held one, the
    folder was made again around that manifest and filled with the peer's copies: memory no
    checkpoint used, published as a part this node holds."""
    import ftmaster.replication as replication_module

    folder, replication, peer = copying_node_1(tmp_path)
    claims = trainer_claims_as_the_copy_checks(
        monkeypatch, iteration_dir(folder, 4) / MANIFEST_NAME, False,
        lambda: MemorySlots(folder, {2, 3}).claim(4, iteration_dir(folder, 6)))
    fill = replication_module.fill_from_peer

    def fill_once_claimed(*args, **kwargs):
        claims[0].join()  # the claim, let go by the tier's lock, has renamed the folder
        return fill(*args, **kwargs)

    monkeypatch.setattr(replication_module, "fill_from_peer", fill_once_claimed)
    try:
        with pytest.raises(OSError, match="taken by this node's trainer"):
            replication._copy(4, replication._peers)
    finally:
        replication.close()
        peer.close()
    assert not iteration_dir(folder, 4).exists()
    assert sorted(p.name for p in iteration_dir(folder, 6).iterdir()) == [
        "__2_0.distcp", "__3_0.distcp"]


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
        agreed = agreed_on({0: folders[0], 1: folders[1]})
        assert replications[0].catch_up(agreed, True) == []  # rank 0's own node, whole already
        ((node, copied),) = replications[1].catch_up(agreed, False)
        again = replications[1].catch_up(agreed, False)
        used = replications[1].used_bytes()
    finally:
        for replication in replications:
            replication.close()
    assert (node, copied.iteration, copied.missing) == (0, 4, ())
    assert read_tracker(folders[1]) == 4 and again == []
    assert read_manifest(iteration_dir(folders[1], 4)) == read_manifest(iteration_dir(folders[0], 4))
    assert used == sum(p.stat().st_size for p in folders[1].rglob("*") if p.is_file())


def test_a_rejoining_node_never_stamps_a_torn_refill_with_the_agreed_manifest(tmp_path):
    """Node 1 was killed refilling a slot as iteration 4 (no manifest, the older checkpoint's
    bytes at the same names and sizes) and missed the round that saved a new iteration 4.
    Rejoining, it fetched rank 0's files and wrote the agreed manifest over its torn shards:
    its loads then failed their item checks and fell back, setting the agreed checkpoint
    aside on every node."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    shard_checkpoint(folders, items=True)
    torn = iteration_dir(folders[1], 4)
    for name in ("__2_0.distcp", "__3_0.distcp"):  # node 0 holds them now, whole
        shutil.copy(torn / name, iteration_dir(folders[0], 4) / name)
    (torn / "__2_0.distcp").write_bytes(b"X" * (torn / "__2_0.distcp").stat().st_size)
    agreed = agreed_on({0: folders[0], 1: folders[1]})
    replications = [Replication(ReplicationConfig(folders[r], tmp_path / f"run{r}", r)) for r in (0, 1)]
    try:
        records = tuple(replace(n, peer_url=replications[n.node_rank].url) for n in nodes(2))
        for r in (0, 1):
            replications[r].new_round(SECRET, records, r, [2, 2])
        replications[1].catch_up(agreed, True)  # node 1 runs rank 0 now
    finally:
        for replication in replications:
            replication.close()
    manifest = read_manifest(torn)
    assert manifest is not None and read_tracker(folders[1]) == 4
    assert not (torn / "__2_0.distcp").exists()  # a load reads it from node 0
    assert digest_problem(torn, manifest, ["__3_0.distcp"]) is None  # its own, kept


def test_the_memory_used_is_counted_while_the_ranks_prune_a_folder(tmp_path, monkeypatch):
    """A folder pruned between its listing and its own listing is skipped, not a crash (it took
    a supervisor down: FileNotFoundError out of the walk)."""
    shard_checkpoint([tmp_path / "node0"], iteration=4)
    shard_checkpoint([tmp_path / "node0"], iteration=6)
    pruned, listing = iteration_dir(tmp_path / "node0", 4), os.scandir
    left = sum(p.stat().st_size for p in (tmp_path / "node0").rglob("*")
               if p.is_file() and pruned not in p.parents)

    def pruned_meanwhile(path="."):
        if Path(path) == pruned:
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return listing(path)

    monkeypatch.setattr(os, "scandir", pruned_meanwhile)
    replication = Replication(ReplicationConfig(tmp_path / "node0", tmp_path / "run0", 0))
    try:
        used = replication.used_bytes()
    finally:
        replication.close()
    assert used == left


@pytest.mark.parametrize("rank0_holds", ["its own shards", "nothing"])
def test_rank_0s_node_catches_up_on_a_newer_whole_copy_a_peer_holds(tmp_path, rank0_holds):
    """Copies still on their way when a GPU failed, or node 0 replaced after a requeue: node 1
    holds a whole iteration 4, so node 0 makes it whole too before its rank 0 picks."""
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
        caught_up = replications[0].catch_up(agreed_on({0: folders[0], 1: folders[1]}), True)
    finally:
        for replication in replications:
            replication.close()
    assert [(node, copied.iteration, copied.missing) for node, copied in caught_up] == [(1, 4, ())]
    assert read_tracker(folders[0]) == 4
    assert sorted(p.name for p in mine.iterdir()) == sorted(p.name for p in theirs.iterdir())


def held(files, total=3, manifest="m4"):
    return {"manifest": manifest, "total": total, "files": files}


@pytest.mark.parametrize("records, expected", [
    ({0: {"4": held(["a", "b"])}, 1: {"4": held(["c"])}}, (4, {"a": (0,), "b": (0,), "c": (1,)})),
    ({0: {"4": held(["a", "b"])}, 1: {"4": held(["b"])}}, None),  # c is on no live node
    ({0: {"4": held(["a", "b", "c"]), "6": held(["a"], manifest="m6")},
      1: {"6": held(["b", "c"], manifest="m6")}}, (6, {"a": (0,), "b": (1,), "c": (1,)})),
    ({0: {"6": held(["a", "b"], manifest="m6")},  # two timelines' iteration 6 never mix
      1: {"6": held(["c"], manifest="other"), "4": held(["a", "b", "c"])}},
     (4, {"a": (1,), "b": (1,), "c": (1,)})),
    ({0: {"4": held(["a", "b", "c"])}, 1: {"4": held(["c"])}, 2: None},
     (4, {"a": (0,), "b": (0,), "c": (0, 1)})),  # a node that published nothing
    ({0: {"4": held(["a", "b", "c"])}, 1: "not json"}, (4, {"a": (0,), "b": (0,), "c": (0,)})),
    ({0: {"6": held(["a", "b", "c"], manifest="kept by a node on standby")},
      1: {"6": held(["a", "b", "c"], manifest="m6")}, 2: {"6": held(["a"], manifest="m6")}},
     (6, {"a": (1, 2), "b": (1,), "c": (1,)})),  # two complete timelines: the one more hold
    ({}, None),
])
def test_the_newest_checkpoint_whose_every_file_a_live_node_holds_is_complete(records, expected):
    texts = {node: rec if rec is None or isinstance(rec, str) else json.dumps(rec)
             for node, rec in records.items()}
    agreed = newest_complete(texts)
    assert (None if agreed is None else (agreed.iteration, agreed.holders)) == expected
    assert agreed is None or Agreed.from_json(agreed.to_json()) == agreed


def test_the_holdings_read_while_training_are_read_again_once_outdated():
    """Read at most every few seconds, unless a persist found the named checkpoint pruned."""
    published = {"memory/1/0": json.dumps({"4": held(["a", "b", "c"])})}

    class Store:
        def announcement(self, key, timeout_s, stop=None):
            return published.get(key)

    agreement = MemoryAgreement(Store(), replication=None)
    assert agreement.current(1, [0]).iteration == 4
    published["memory/1/0"] = json.dumps({"6": held(["a", "b", "c"], manifest="m6")})
    assert agreement.current(1, [0]).iteration == 4  # not read again yet
    agreement.outdated()
    assert agreement.current(1, [0]).iteration == 6


def test_three_nodes_with_one_replica_no_folder_is_whole_yet_every_checkpoint_is_complete(tmp_path):
    """3 nodes x 2 ranks, one replica: each node holds its own and its next peer's shards, so
    no folder is whole. The holdings still make iteration 4 complete; node 0 persists it from
    the nodes that hold each file; with node 1 lost it is still complete (nodes 0 and 2
    hold every file between them), and node 0's catch-up makes it whole from node 2."""
    folders = [tmp_path / f"node{r}" for r in range(3)]
    shard_checkpoint(folders)
    advance_tracker(folders[0], 4)  # the trainer's rank 0 moves it with the manifest
    replications = [Replication(ReplicationConfig(folders[r], tmp_path / f"run{r}", r)) for r in range(3)]
    try:
        records = tuple(replace(n, peer_url=replications[n.node_rank].url) for n in nodes(3))
        for r in range(3):
            replications[r].new_round(SECRET, records, r, [2, 2, 2])
            replications[r].saved(4)
        results = [[], [], []]
        wait_until(lambda: all(results[r].extend(replications[r].take_results()) or
                               len(results[r]) == (1, 2, 2)[r] for r in range(3)),
                   timeout=30, what="every node's copies")
        assert not any(isinstance(x, ReplicationFailed) for rs in results for x in rs), results
        assert [(iteration_dir(f, 4) / MANIFEST_NAME).exists() for f in folders] == [True, False, False]
        assert [(iteration_dir(f, 4) / HELD_MANIFEST_NAME).exists() for f in folders] == [False, True, True]
        everyone = agreed_on(dict(enumerate(folders)))
        assert everyone.holders["__4_0.distcp"] == (1, 2) and everyone.holders["common.pt"] == (0, 1, 2)
        persisted = persist(folders[0], tmp_path / "save", 4, replications[0].fetcher(everyone))

        for r in (0, 2):  # node 1 is lost: the round's live nodes are 0 and 2
            replications[r].new_round(SECRET, (records[0], records[2]), (0, 1)[r // 2], [2, 2])
        survivors = agreed_on({0: folders[0], 2: folders[2]})
        caught_up = replications[0].catch_up(survivors, True)
    finally:
        for replication in replications:
            replication.close()
    whole = iteration_dir(folders[0], 4)
    assert persisted.bytes == read_manifest(whole).total_bytes
    assert persisted.fetched_bytes == sum(  # ranks 4 and 5's shards: node 0 lacks them
        len(f"__{r}_0.distcp".encode() * 1000) + 1 for r in (4, 5))
    saved = read_manifest(tmp_path / "save" / "iter_0000004")
    assert saved == read_manifest(whole) and all(
        digest_file(tmp_path / "save" / "iter_0000004" / name) == expected
        for name, expected in saved.files.items())
    assert read_tracker(tmp_path / "save") == 4
    assert [(node, copied.missing) for node, copied in caught_up] == [(2, ())]
    assert sorted(p.name for p in whole.iterdir()) == sorted(
        [".metadata", "common.pt", MANIFEST_NAME] + [f"__{r}_0.distcp" for r in range(6)])
    assert read_tracker(folders[0]) == 4


def test_a_checkpoint_a_live_node_no_longer_serves_is_a_failed_catch_up(tmp_path):
    folders = [tmp_path / "node0", tmp_path / "node1"]
    shard_checkpoint(folders)
    manifest = (iteration_dir(folders[0], 4) / MANIFEST_NAME).read_bytes()
    agreed = Agreed(4, digest_bytes(manifest).digest, {"__2_0.distcp": (1,), "__3_0.distcp": (1,)})
    replications = [Replication(ReplicationConfig(folders[r], tmp_path / f"run{r}", r)) for r in (0, 1)]
    try:
        records = tuple(replace(n, peer_url=replications[n.node_rank].url) for n in nodes(2))
        for r in (0, 1):
            replications[r].new_round(SECRET, records, r, [2, 2])
        (iteration_dir(folders[1], 4) / "__3_0.distcp").unlink()  # pruned meanwhile
        (failed,) = [x for x in replications[0].catch_up(agreed, True) if isinstance(x, ReplicationFailed)]
    finally:
        for replication in replications:
            replication.close()
    assert failed.iteration == 4 and "no longer hold every file" in failed.reason
    assert read_tracker(folders[0]) is None


def test_a_failed_catch_up_over_a_discarded_timeline_leaves_a_tier_loads_fall_back_from(tmp_path):
    """Rank 0's node held iteration 4 of a discarded timeline, its tracker on it; the round
    agreed on node 1's iteration 4, which node 1 stops serving during the fill. The old folder
    is set aside and the new one lacks common.pt and a manifest while the tracker still names
    4: a load skips 4 for the next older candidate, no persist copy takes it (nor the agreed
    one, through this node's folder), the next agreement does not count it, and the load's
    setting aside of what is newer than what it resumed brings the tracker back."""
    folders, save = [tmp_path / "node0", tmp_path / "node1"], tmp_path / "save"
    shard_checkpoint(folders)
    mine, theirs = (iteration_dir(folder, 4) for folder in folders)
    for path in mine.iterdir():  # node 1: the agreed timeline's iteration 4, whole
        shutil.copy(path, theirs)
    (mine / "common.pt").write_bytes(b"the discarded timeline's")
    write_manifest(mine, "periodic", 4, {p.name: digest_file(p) for p in mine.iterdir()
                                         if p.name != MANIFEST_NAME})
    shard_checkpoint([folders[0]], iteration=2)
    advance_tracker(folders[0], 4)
    manifest = (theirs / MANIFEST_NAME).read_bytes()
    agreed = Agreed(4, digest_bytes(manifest).digest,
                    {p.name: (1,) for p in theirs.iterdir() if p.name != MANIFEST_NAME})
    replications = [Replication(ReplicationConfig(folders[r], tmp_path / f"run{r}", r)) for r in (0, 1)]
    try:
        records = tuple(replace(n, peer_url=replications[n.node_rank].url) for n in nodes(2))
        for r in (0, 1):
            replications[r].new_round(SECRET, records, r, [2, 2])
        (theirs / "common.pt").unlink()  # pruned meanwhile
        (failed,) = [x for x in replications[0].catch_up(agreed, True)
                     if isinstance(x, ReplicationFailed)]
        with pytest.raises(PersistError, match="no checksummed manifest"):
            persist(folders[0], save, 4, replications[0].fetcher(agreed))
    finally:
        for replication in replications:
            replication.close()
    assert failed.iteration == 4 and read_tracker(folders[0]) == 4
    assert [p.name.startswith("iter_0000004.discarded-") for p in folders[0].iterdir()
            if p.name.startswith("iter_0000004.")] == [True]
    assert not (mine / "common.pt").exists() and not (mine / MANIFEST_NAME).exists()
    assert [c.iteration for c in tier_candidates(save, folders[0]).candidates] == [4, 2]
    assert checkpoint_problem(mine, elsewhere=True) == "common.pt is missing"
    assert Persister(folders[0], save).newest_memory_checkpoint() is None
    assert "4" not in holdings_of(folders[0])
    assert [old for old, _ in set_aside_newer(folders[0], 2)] == [mine]  # the load of 2's
    assert read_tracker(folders[0]) == 2


@pytest.mark.parametrize("peer", ["pruned", "gone"])
def test_a_persist_fetches_the_peers_files_first_and_a_pruned_one_is_superseded(tmp_path, peer):
    """Node 0's pin keeps only its own folder: the files its peers hold are fetched before its
    own are copied. Peers that answer they no longer hold one pruned it after newer
    checkpoints (superseded, not a failure); a peer that does not answer is a failure."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    shard_checkpoint(folders)
    manifest = (iteration_dir(folders[0], 4) / MANIFEST_NAME).read_bytes()
    agreed = Agreed(4, digest_bytes(manifest).digest, {"__2_0.distcp": (1,), "__3_0.distcp": (1,)})
    replications = [Replication(ReplicationConfig(folders[r], tmp_path / f"run{r}", r)) for r in (0, 1)]
    seen_at_fetch = []
    try:
        records = tuple(replace(n, peer_url=replications[n.node_rank].url) for n in nodes(2))
        for r in (0, 1):
            replications[r].new_round(SECRET, records, r, [2, 2])
        fetch = replications[0].fetcher(agreed)

        def watched(name, dest, expected):
            seen_at_fetch.append(sorted(p.name for p in dest.parent.iterdir()))
            fetch(name, dest, expected)

        assert persist(folders[0], tmp_path / "save", 4, watched).fetched_bytes > 0
        assert seen_at_fetch == [[], ["__2_0.distcp"]]
        if peer == "pruned":
            (iteration_dir(folders[1], 4) / "__3_0.distcp").unlink()
        else:
            replications[1].close()
        shutil.rmtree(tmp_path / "save")
        with pytest.raises(PersistError) as raised:
            persist(folders[0], tmp_path / "save", 4, fetch)
    finally:
        for replication in replications:
            replication.close()
    assert isinstance(raised.value, PersistSuperseded) == (peer == "pruned"), raised.value
    assert ("__3_0.distcp" if peer == "pruned" else "__2_0.distcp") in str(raised.value)
    assert read_tracker(tmp_path / "save") is None and not list((tmp_path / "save").iterdir())


def test_a_rejoining_node_copies_what_its_ranks_open_locally_and_leaves_the_shards_to_the_load(
        tmp_path):
    """Item checksums let a load read the shards it lacks from the peers, item by item, only
    those its layout needs: the catch-up copies the checkpoint's own files and its manifest."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    shard_checkpoint(folders, items=True)
    for name in ("__2_0.distcp", "__3_0.distcp"):  # node 0's copy is whole
        shutil.move(iteration_dir(folders[1], 4) / name, iteration_dir(folders[0], 4) / name)
    replications = [Replication(ReplicationConfig(folders[r], tmp_path / f"run{r}", r)) for r in (0, 1)]
    try:
        records = tuple(replace(n, peer_url=replications[n.node_rank].url) for n in nodes(2))
        for r in (0, 1):
            replications[r].new_round(SECRET, records, r, [2, 2])
        ((node, copied),) = replications[1].catch_up(agreed_on({0: folders[0], 1: folders[1]}), False)
    finally:
        for replication in replications:
            replication.close()
    assert (node, copied.iteration) == (0, 4)
    assert sorted(p.name for p in iteration_dir(folders[1], 4).iterdir()) == [
        ".metadata", "common.pt", MANIFEST_NAME]
    assert read_manifest(iteration_dir(folders[1], 4)) == read_manifest(iteration_dir(folders[0], 4))
    assert read_tracker(folders[1]) is None  # a tracker would keep a copy it holds in part


def test_a_node_publishes_its_newest_checkpoints_with_a_manifest_of_either_kind(tmp_path):
    """A save under way (no manifest yet) is no holding, and takes no place among the three."""
    for iteration in (2, 4, 6, 8):
        shard_checkpoint([tmp_path / f"n{iteration}"], iteration)
        shutil.copytree(iteration_dir(tmp_path / f"n{iteration}", iteration),
                        iteration_dir(tmp_path / "memory", iteration))
    (iteration_dir(tmp_path / "memory", 8) / MANIFEST_NAME).rename(
        iteration_dir(tmp_path / "memory", 8) / HELD_MANIFEST_NAME)  # held in part elsewhere
    (iteration_dir(tmp_path / "memory", 8) / "common.pt").unlink()
    iteration_dir(tmp_path / "memory", 10).mkdir()  # a save under way
    held = holdings_of(tmp_path / "memory")
    assert list(held) == ["8", "6", "4"]
    assert held["8"]["total"] == 4 and "common.pt" not in held["8"]["files"]
    assert held["6"]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt"]
    assert mark_replicated(tmp_path / "memory", 2)  # kept: a new round may need it
    assert list(holdings_of(tmp_path / "memory")) == ["8", "6", "4", "2"]


@pytest.mark.parametrize("records, copies, expected", [
    ({0: {"4": held(["a", "b", "c"])}, 1: {"4": held(["a", "b"])}, 2: {"4": held(["c"])}}, 2, 4),
    ({0: {"4": held(["a", "b", "c"])}, 1: {"4": held(["a", "b"])}}, 2, None),  # c: one copy
    ({0: {"4": held(["a", "b", "c"]), "6": held(["a", "b", "c"], manifest="m6")},
      1: {"4": held(["a", "b", "c"]), "6": held(["a"], manifest="m6")}}, 2, 4),
])
def test_a_checkpoint_is_replicated_when_every_file_has_as_many_holders(records, copies, expected):
    agreed = newest_complete({node: json.dumps(rec) for node, rec in records.items()}, copies)
    assert (None if agreed is None else agreed.iteration) == expected


class AnnouncingStore:
    """The announcements of a round, as :class:`NodeMembership` keeps them in the store."""

    def __init__(self) -> None:
        self.said: dict[str, str] = {}

    def announce(self, name, value, stop=None):
        self.said[name] = value

    def announcement(self, name, timeout_s, stop=None):
        return self.said.get(name)


def three_nodes_with_iteration_4_replicated_and_6_not(tmp_path):
    """3 nodes x 2 ranks, one replica: each node holds its own shards of 4 and 6, and a copy
    of the next node's shards (and rank 0's own files) of 4 only."""
    folders = [tmp_path / f"node{r}" for r in range(3)]
    for iteration in (4, 6):
        shard_checkpoint(folders, iteration)
        manifest = iteration_dir(folders[0], iteration) / MANIFEST_NAME
        for node in (1, 2):
            shutil.copy(manifest, iteration_dir(folders[node], iteration) / HELD_MANIFEST_NAME)
    for node in range(3):
        copy_from_peer(folders, 4, node, (node + 1) % 3)
    return folders


def copy_from_peer(folders, iteration, node, peer):
    """What ``node``'s replication copies of ``peer``'s ranks' shards, and of rank 0's files."""
    target = iteration_dir(folders[node], iteration)
    names = [f"__{2 * peer}_0.distcp", f"__{2 * peer + 1}_0.distcp"] + (
        [".metadata", "common.pt"] if node else [])
    for name in names:
        if not (target / name).exists():
            shutil.copy(iteration_dir(folders[0 if name[0] != "_" else peer], iteration) / name,
                        target / name)


def test_with_fewer_replicas_than_peers_each_node_keeps_its_part_of_the_newest_replicated(
        tmp_path, monkeypatch):
    """No folder is ever whole on 3 nodes with one replica, so no ``.ftmaster_whole`` mark
    keeps anything. Every node marks its part of the newest checkpoint whose every file two
    nodes hold (the one a lost node leaves to resume from): the trainer's slot refill passes
    it over until a newer one is replicated, then lets it go."""
    monkeypatch.setattr("ftmaster.replication.AGREEMENT_POLL_S", 0.0)
    folders = three_nodes_with_iteration_4_replicated_and_6_not(tmp_path)
    store = AnnouncingStore()
    agreements = [MemoryAgreement(store, SimpleNamespace(config=ReplicationConfig(
        folders[r], tmp_path / f"run{r}", r))) for r in range(3)]

    def each_node_keeps() -> list[int | None]:
        for r in range(3):
            store.announce(f"memory/1/{r}", json.dumps(holdings_of(folders[r])))
        for r in range(3):  # the deciding node first, as its announcement comes first
            agreements[r].keep_replicated(1, [0, 1, 2], decides=r == 0)
        return [replicated_here(folder) for folder in folders]

    assert each_node_keeps() == [4, 4, 4]
    assert all(4 in kept_memory_checkpoints(folder) for folder in folders)
    assert not MemorySlots(folders[1]).claim(4, iteration_dir(folders[1], 8))  # a fresh folder
    assert iteration_dir(folders[1], 4).is_dir()

    for node in range(3):
        copy_from_peer(folders, 6, node, (node + 1) % 3)
    assert each_node_keeps() == [6, 6, 6]
    assert MemorySlots(folders[2]).claim(4, iteration_dir(folders[2], 10))  # refilled now


def test_a_node_that_holds_no_part_of_the_replicated_checkpoint_lets_go_of_its_mark(tmp_path):
    folders = three_nodes_with_iteration_4_replicated_and_6_not(tmp_path)
    assert mark_replicated(folders[1], 6)
    shutil.rmtree(iteration_dir(folders[1], 4))  # a node that rejoined with nothing of it
    store = AnnouncingStore()
    store.announce("memory_replicated/1", json.dumps(
        {"iteration": 4, "manifest": digest_bytes(
            (iteration_dir(folders[0], 4) / MANIFEST_NAME).read_bytes()).digest}))
    agreement = MemoryAgreement(store, SimpleNamespace(config=ReplicationConfig(
        folders[1], tmp_path / "run1", 1)))
    agreement.keep_replicated(1, [0, 1, 2], decides=False)
    assert replicated_here(folders[1]) is None


class BlackholedAnnouncements:
    """A round's announcements on a store no packet reaches: every call hangs until its
    stop is set (Abandoned), else until the store's timeout (StoreLost)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def _hang(self, stop) -> None:
        from ftmaster.membership import StoreLost
        from ftmaster.monitor.backends.bounded import Abandoned

        if (stop or threading.Event()).wait(self.timeout_s):
            raise Abandoned("stopped")
        raise StoreLost("did not return")

    def announce(self, name, value, stop=None):
        self._hang(stop)

    def announcement(self, name, timeout_s, stop=None):
        self._hang(stop)


@pytest.mark.parametrize("call", ["publish", "current", "keep_replicated_deciding",
                                  "keep_replicated"])
def test_a_stop_ends_the_memory_agreements_store_calls_on_a_store_that_hangs(tmp_path, call):
    """Training publishes and reads the memory holdings through the rendezvous store: on a
    store no packet reaches each call waited out the store's timeout (65 s by default)
    before a SIGTERM could stop the ranks, past SLURM's grace period."""
    import contextlib
    import time

    from ftmaster.monitor.backends.bounded import Abandoned

    stop = threading.Event()
    agreement = MemoryAgreement(BlackholedAnnouncements(timeout_s=5.0), SimpleNamespace(
        config=ReplicationConfig(tmp_path / "memory", tmp_path, 0)), stop)
    calls = {"publish": lambda: agreement.publish(1),
             "current": lambda: agreement.current(1, [0, 1, 2]),
             "keep_replicated_deciding": lambda: agreement.keep_replicated(1, [0, 1, 2], True),
             "keep_replicated": lambda: agreement.keep_replicated(1, [0, 1, 2], False)}
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with contextlib.suppress(Abandoned):
        calls[call]()
    assert time.monotonic() - started < 1.0


def test_a_full_run_directory_leaves_the_peer_list_unwritten_not_the_supervisor_dead(
        tmp_path, caplog):
    """A new round writes the peer list into the node's run folder: on a full one that raised
    OSError out of the round's planning, a traceback where every other write there is said
    and skipped."""
    from helpers.tmpfs import small_tmpfs
    from test_run_dir_room import full

    with small_tmpfs(tmp_path / "run", "1m") as run_dir:
        full(run_dir)
        replication = Replication(ReplicationConfig(tmp_path / "memory", run_dir, 0))
        try:
            replication.new_round(SECRET, nodes(2), 0, [2, 2])
        finally:
            replication.close()
    assert replication._peers.sources  # the round's copies go on
    assert "peers.json" in caplog.text and "No space left" in caplog.text


def test_a_node_serves_no_dumps_an_earlier_ftmaster_left_under_a_round_number_of_this_job(
        tmp_path):
    """Round numbers restart in a requeued job, and a node's memory folder in /dev/shm is the
    run's own, kept across the requeue. Node 1 did not dump in round 2 of this job (say, a
    hang with no culprit there), but its folder held replicas/round_2 of an earlier job,
    killed between its dumps and their merge: node 0's merge of round 2 gathered that earlier
    job's state beside this one's."""
    from ftmaster.replica_recovery import ReplicaRecovery

    folders = [tmp_path / "node0", tmp_path / "node1"]
    dump_rank_2_of_round_2(folders[1], "state.pt")
    # Node 1's ftmaster of this job starts, with replica recovery, on that folder
    ReplicaRecovery(tmp_path / "run1", folders[1], tmp_path / "save", lambda *a, **k: None)
    gathered, dumps = gather_round_2(tmp_path, folders)
    assert [(g.node_rank, g.bytes) for g in gathered] == [(1, 0)]
    assert list(dumps.iterdir()) == []


@pytest.mark.parametrize("name", ["..", "../state.pt", "sub/state.pt"])
def test_a_dump_report_naming_a_file_outside_its_rank_folder_is_refused(tmp_path, name):
    """A peer's dump report names the files its rank dumped; one naming ``..`` passed the
    check that the name is a plain file name (``Path('..').name`` is ``..``). Only the peer's
    server stood between it and a copy into the round's folder itself (it answered 404, and
    the merge's reason named a missing file, not the report)."""
    from ftmaster.recovery.replicas import rank_dump_dir

    folders = [tmp_path / "node0", tmp_path / "node1"]
    dump_rank_2_of_round_2(folders[1], name)
    gathered, dumps = gather_round_2(tmp_path, folders)
    assert len(gathered) == 1 and "outside its dump" in gathered[0].reason
    assert [p.name for p in dumps.iterdir()] in ([], [rank_dump_dir(dumps, 2).name])
    assert not any(p.is_file() for p in dumps.rglob("*"))


@pytest.mark.parametrize("body", [
    '["a list"]', '{"files": ["state.pt"]}', '{"files": {"state.pt": {"bytes": 14}}}',
    '\xff not json', '{"files": {"state.pt": {"bytes": 1e999, "digest": "0"}}}',
    '[' * 100_000 + ']' * 100_000])
def test_a_dump_report_that_is_no_report_fails_that_node_in_one_line(tmp_path, body):
    """A report that was JSON but no object (a peer of another version, or damaged in its
    memory) raised AttributeError out of the gather, into the supervisor."""
    from ftmaster.recovery.replicas import report_path, round_dump_folder

    folders = [tmp_path / "node0", tmp_path / "node1"]
    dump_rank_2_of_round_2(folders[1], "state.pt")
    report_path(round_dump_folder(folders[1], 2), 2).write_bytes(body.encode("latin-1"))
    gathered, _ = gather_round_2(tmp_path, folders)
    assert [g.reason for g in gathered] == ["node 1's dumps: rank 2's report is not a dump report"]


def test_a_gather_abandoned_by_a_stop_leaves_no_dumps_behind_when_its_fetch_returns(
        tmp_path, monkeypatch):
    """A stop abandons the gather while a peer still sends rank 2's report; the supervisor
    went on, its dump folder removed, while the gather's thread, once the report came, made
    the folder again and filled it with rank 2's whole dump: a failed round's dump left in
    the memory tier, its space counted, for a later merge to find."""
    from ftmaster.monitor.backends.bounded import Abandoned

    folders, stop, released = [tmp_path / "node0", tmp_path / "node1"], threading.Event(), \
        threading.Event()
    dump_rank_2_of_round_2(folders[1], "state.pt")
    read = PeerClient.read

    def sent_after_the_stop(self, *args, **kwargs):
        body = read(self, *args, **kwargs)
        stop.set()  # the signal comes while the report is on its way
        released.wait(10)
        return body

    monkeypatch.setattr(PeerClient, "read", sent_after_the_stop)
    with round_2_seats(tmp_path, folders) as (replication, records, dumps):
        with pytest.raises(Abandoned):
            replication.gather_dumps(dumps, records, [2, 2], stop)
        assert not dumps.exists()  # removed as the gather was let go
        released.set()
        for thread in threading.enumerate():
            if thread.name.startswith("ftmaster-replica-gather"):
                thread.join(10)
    assert not dumps.exists()


def test_a_gather_copies_the_files_of_the_ranks_the_merge_takes_alone(tmp_path):
    """TP1 x PP2 x DP2: node 0 holds stage 0 (rank 0; rank 1 died), node 1 stage 1 (ranks 2
    and 3, replicas of one shard). Every report comes over, and rank 2's files, not rank 3's:
    every DP replica's model and optimizer state came over to rank 0's /dev/shm before."""
    from ftmaster.recovery.replicas import rank_dump_dir, report_path, round_dump_folder

    folders = [tmp_path / "node0", tmp_path / "node1"]
    for rank, stage, folder in ((0, 0, folders[0]), (2, 1, folders[1]), (3, 1, folders[1])):
        dump = rank_dump_dir(round_dump_folder(folder, 2), rank)
        dump.mkdir(parents=True)
        (dump / "state.pt").write_bytes(f"rank {rank}'s state".encode())
        report_path(dump.parent, rank).write_text(json.dumps(
            {"rank": rank, "tp": 0, "pp": stage, "dp": rank % 2, "tp_size": 1, "pp_size": 2,
             "dp_size": 2, "iteration": 16, "consumed_samples": 128,
             "files": {"state.pt": digest_file(dump / "state.pt").as_json()}}))
    gathered, dumps = gather_round_2(tmp_path, folders)
    assert [type(g).__name__ for g in gathered] == ["Gathered"]
    assert report_path(dumps, 2).exists() and report_path(dumps, 3).exists()
    assert (rank_dump_dir(dumps, 2) / "state.pt").read_bytes() == b"rank 2's state"
    assert not (rank_dump_dir(dumps, 3) / "state.pt").exists()


def dump_rank_2_of_round_2(memory_dir: Path, listed_as: str) -> None:
    """Rank 2's dump of round 2 in ``memory_dir``: one file, its report naming it ``listed_as``."""
    from ftmaster.recovery.replicas import rank_dump_dir, report_path, round_dump_folder

    dump = rank_dump_dir(round_dump_folder(memory_dir, 2), 2)
    dump.mkdir(parents=True)
    (dump / "state.pt").write_bytes(b"rank 2's state")
    report_path(dump.parent, 2).write_text(json.dumps(
        {"rank": 2, "files": {listed_as: digest_file(dump / "state.pt").as_json()}}))


def gather_round_2(tmp_path: Path, folders: list[Path],
                   stop: threading.Event | None = None) -> tuple[list, Path]:
    """Node 0's gathering of round 2's dumps from node 1 (2 ranks each): what it returned, and
    node 0's dump folder it gathered into."""
    with round_2_seats(tmp_path, folders) as (replication, records, dumps):
        return replication.gather_dumps(dumps, records, [2, 2], stop), dumps


@contextlib.contextmanager
def round_2_seats(tmp_path: Path, folders: list[Path]):
    """Nodes 0 and 1 (2 ranks each) in round 2, their peer servers up: node 0's replication,
    the round's records, and node 0's own dump folder of round 2."""
    from ftmaster.recovery.replicas import round_dump_folder

    replications = [Replication(ReplicationConfig(folders[r], tmp_path / f"run{r}", r))
                    for r in (0, 1)]
    try:
        records = tuple(replace(n, peer_url=replications[n.node_rank].url) for n in nodes(2))
        for r in (0, 1):
            replications[r].new_round(SECRET, records, r, [2, 2])
        dumps = round_dump_folder(folders[0], 2)
        dumps.mkdir(parents=True, exist_ok=True)  # node 0's own dumps may be there
        yield replications[0], records, dumps
    finally:
        for replication in replications:
            replication.close()


def test_a_brief_stall_of_the_peer_rank_0s_node_catches_up_from_is_tried_again(
        tmp_path, monkeypatch):
    """Node 0, rank 0's, lacks the agreed iteration 4, which node 1 holds whole; the first
    fetch from node 1 stalls past its timeout. The failed catch-up left node 0's tier at 2,
    its rank 0 resumed from 2, and that load's setting aside of what is newer renamed node
    1's whole copy of 4 (pruned at the next memory save): the newest state was gone. The
    catch-up is tried again: 4 is loaded, and node 1's copy stays where a relaunch finds it."""
    folders, save = [tmp_path / "node0", tmp_path / "node1"], tmp_path / "save"
    shard_checkpoint(folders)
    mine, theirs = (iteration_dir(folder, 4) for folder in folders)
    for path in mine.iterdir():
        shutil.copy(path, theirs)
    advance_tracker(folders[1], 4)
    shutil.rmtree(mine)
    shard_checkpoint([folders[0]], iteration=2)
    advance_tracker(folders[0], 2)
    agreed = agreed_on({0: folders[0], 1: folders[1]})
    fetch, stalls = PeerClient.fetch, []

    def stalls_once(self, *args, **kwargs):
        if not stalls:
            stalls.append(args)
            raise PeerError(f"{self.url} sent nothing for 30 s")
        return fetch(self, *args, **kwargs)

    monkeypatch.setattr(PeerClient, "fetch", stalls_once)
    monkeypatch.setattr(replication_module, "CATCH_UP_PAUSE_S", 0.0)
    replications = [Replication(ReplicationConfig(folders[r], tmp_path / f"run{r}", r)) for r in (0, 1)]
    try:
        records = tuple(replace(n, peer_url=replications[n.node_rank].url) for n in nodes(2))
        for r in (0, 1):
            replications[r].new_round(SECRET, records, r, [2, 2])
        caught_up = replications[0].catch_up(agreed, True)
    finally:
        for replication in replications:
            replication.close()
    assert stalls and not [x for x in caught_up if isinstance(x, ReplicationFailed)]
    resumed = tier_candidates(save, folders[0]).candidates[0].iteration
    assert resumed == 4 and read_tracker(folders[0]) == 4
    set_aside_newer(folders[1], resumed)  # node 1's owner, once rank 0 loaded
    assert "4" in holdings_of(folders[1]) and read_tracker(folders[1]) == 4


def test_a_catch_up_reads_what_an_unreachable_holder_holds_from_the_next_one(tmp_path):
    """Nodes 1 and 2 hold iteration 4 whole, node 1's server cannot be reached: the catch-up
    ended at node 1 in every try (the round failed, and the checkpoint was set aside) though
    node 2 held every file."""
    folders = [tmp_path / f"node{r}" for r in range(3)]
    shard_checkpoint(folders[:2])
    whole = iteration_dir(folders[0], 4)
    for name in ("__2_0.distcp", "__3_0.distcp"):
        (iteration_dir(folders[1], 4) / name).rename(whole / name)
    write_manifest(whole, "periodic", 4, {p.name: digest_file(p) for p in whole.iterdir()
                                          if p.name != MANIFEST_NAME})
    for r in (1, 2):
        shutil.rmtree(iteration_dir(folders[r], 4), ignore_errors=True)
        shutil.copytree(whole, iteration_dir(folders[r], 4))
    agreed = agreed_on({1: folders[1], 2: folders[2]})
    shutil.rmtree(whole)
    replications = [Replication(ReplicationConfig(folders[r], tmp_path / f"run{r}", r))
                    for r in range(3)]
    try:
        records = tuple(replace(n, peer_url=replications[n.node_rank].url) for n in nodes(3))
        unreachable = replace(records[1], peer_url=f"http://127.0.0.1:{free_port('127.0.0.1')}")
        for r in (1, 2):
            replications[r].new_round(SECRET, records, r, [2, 2, 2])
        replications[0].new_round(SECRET, (records[0], unreachable, records[2]), 0, [2, 2, 2])
        caught_up = replications[0].catch_up(agreed, True)
    finally:
        for replication in replications:
            replication.close()
    assert [node for node, _ in caught_up] == [2], caught_up
    assert read_tracker(folders[0]) == 4


def node_0_lacks_the_agreed_checkpoint(tmp_path: Path) -> tuple[list[Path], Agreed]:
    """Two nodes' tiers, and iteration 4 agreed on while both held it whole; node 0's copy
    gone since."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    shard_checkpoint(folders)
    mine, theirs = (iteration_dir(folder, 4) for folder in folders)
    for path in mine.iterdir():
        shutil.copy(path, theirs)
    agreed = agreed_on({0: folders[0], 1: folders[1]})
    shutil.rmtree(mine)
    return folders, agreed


def test_a_stop_signal_ends_the_catch_ups_tries_at_once(tmp_path, monkeypatch):
    """A peer that keeps failing is tried again, but not past a stop signal: SLURM's SIGKILL
    follows its SIGTERM within a grace period that three tries of a stalled peer outlast."""
    from ftmaster.monitor.backends.bounded import Abandoned

    folders, agreed = node_0_lacks_the_agreed_checkpoint(tmp_path)
    tries, stop = [], threading.Event()

    def always_stalls(self, *args, **kwargs):
        tries.append(args)
        stop.set()  # the signal comes while the first try waits
        raise PeerError(f"{self.url} sent nothing for 30 s")

    monkeypatch.setattr(PeerClient, "fetch", always_stalls)
    replications = [Replication(ReplicationConfig(folders[r], tmp_path / f"run{r}", r)) for r in (0, 1)]
    try:
        records = tuple(replace(n, peer_url=replications[n.node_rank].url) for n in nodes(2))
        for r in (0, 1):
            replications[r].new_round(SECRET, records, r, [2, 2])
        with pytest.raises(Abandoned):  # no failure of the peer's, for a round to fail on
            replications[0].catch_up(agreed, True, stop)
    finally:
        for replication in replications:
            replication.close()
    assert len(tries) == 1


def test_a_stop_during_a_fetch_the_peer_stalls_ends_the_catch_up_within_a_second(tmp_path):
    """Node 1 accepts the connection and then sends nothing: the stop was looked at only
    between tries, so a signal during the stalled fetch waited out the peers' timeout
    (30 s, past SLURM's grace period) before the catch-up ended."""
    import socket
    import time

    from ftmaster.monitor.backends.bounded import Abandoned

    folders, agreed = node_0_lacks_the_agreed_checkpoint(tmp_path)
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nothing is sent
    stop = threading.Event()
    replication = Replication(ReplicationConfig(folders[0], tmp_path / "run0", 0, timeout_s=5.0))
    stopping = threading.Timer(0.3, stop.set)
    try:
        records = (nodes(2)[0], replace(nodes(2)[1],
                                        peer_url=f"http://127.0.0.1:{silent.getsockname()[1]}"))
        replication.new_round(SECRET, records, 0, [2, 2])
        started = time.monotonic()
        stopping.start()
        with pytest.raises(Abandoned):
            replication.catch_up(agreed, True, stop)
        assert time.monotonic() - started < 1.3
    finally:
        stopping.cancel()
        replication.close()
        silent.close()
    assert read_tracker(folders[0]) is None


class SlowDecider(AnnouncingStore):
    """The deciding node announces ``after_s`` into the round: a wait shorter than that
    gives up with nothing."""

    def __init__(self, after_s: float) -> None:
        super().__init__()
        self.after_s = after_s

    def announcement(self, name, timeout_s, stop=None):
        return super().announcement(name, timeout_s, stop) if timeout_s >= self.after_s else None


def test_a_node_that_does_not_decide_waits_as_long_as_the_decider_may_be_busy(tmp_path):
    """Rank 0's node merges the failed round's dumps (up to 320 s) before it decides; a node
    that dumped none gave up after 60 s, read that as "none agreed" and launched without
    the checkpoint every other node loads."""
    from ftmaster.replica_recovery import DUMP_TIMEOUT_S, MERGE_TIMEOUT_S

    busy_s = MERGE_TIMEOUT_S + DUMP_TIMEOUT_S
    store = SlowDecider(after_s=busy_s + 30.0)
    store.announce("memory_agreed/3", Agreed(4, "ab12", {"common.pt": (0, 1)}).to_json())
    agreement = MemoryAgreement(store, SimpleNamespace(config=ReplicationConfig(
        tmp_path / "memory", tmp_path, 1)))
    assert agreement.decide(3, [0, 1], decides=False) is None
    assert agreement.decide(3, [0, 1], decides=False, decider_busy_s=busy_s).iteration == 4


@pytest.mark.parametrize("replica_recovery", [True, False])
def test_with_replica_recovery_a_node_waits_for_the_merge_before_the_agreement(replica_recovery):
    from ftmaster.replica_recovery import DUMP_TIMEOUT_S, MERGE_TIMEOUT_S
    from ftmaster.supervisor import Supervisor

    waits = []
    supervisor = SimpleNamespace(
        agreement=SimpleNamespace(publish=lambda number: None,
                                  decide=lambda *args, decider_busy_s: waits.append(
                                      decider_busy_s)),
        replication=SimpleNamespace(catch_up=lambda *args: []),
        replicas=object() if replica_recovery else None, _event=lambda *a, **k: None,
        _report_replicated=lambda results: None, _stop_requested=threading.Event())
    joined = SimpleNamespace(number=3, nodes=[SimpleNamespace(node_rank=0),
                                              SimpleNamespace(node_rank=1)])
    assert Supervisor._catch_up_on_agreed_memory(supervisor, joined, False) is None
    assert waits == [MERGE_TIMEOUT_S + DUMP_TIMEOUT_S if replica_recovery else 0.0]
