"""Zero loss across nodes: 2 ftmaster nodes on loopback, each with its own memory folder in
/dev/shm (none shared), peer copies between them, and node 1 lost."""

import contextlib
import os
import shutil
import signal
from pathlib import Path

import pytest

from ftmaster.recovery.argv_flags import flag_value
from ftmaster.recovery.checkpoints import iteration_dir
from helpers.launch import train_args
from helpers.multinode import Nodes
from helpers.replicas import unequal_tensors
from helpers.trainer import run_trainer, wait_until

pytestmark = pytest.mark.slow

DIR_FLAG = "--non-persistent-global-ckpt-dir"
MEMORY_TIER = ("--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "2")


def memory_folder(nodes: Nodes, node_rank: int) -> Path:
    return Path(flag_value(nodes.events(node_rank, "launch")[0]["command"], DIR_FLAG))


@contextlib.contextmanager
def two_nodes(nodes: Nodes, ending: tuple[int, ...] = (0, 1), started: tuple[int, ...] = (0, 1)):
    """The ``ending`` nodes must end well; whatever happens, none outlives the test, nor its
    memory."""
    try:
        yield nodes
        for node_rank in ending:
            assert nodes.wait(node_rank) == 0, nodes.output(node_rank)[-4000:]
    finally:
        nodes.kill_all()
        for node_rank in started:
            if nodes.events(node_rank, "launch"):
                shutil.rmtree(memory_folder(nodes, node_rank), ignore_errors=True)


def test_a_lost_node_is_resumed_from_its_peers_copy_and_catches_up_when_it_rejoins(tmp_path):
    """TP2 x PP2 over 2 nodes: node 1 alone holds pipeline stage 1. Its ftmaster is SIGKILLed
    once node 0 holds a copy of an iteration >= 10; node 0 relaunches alone (TP2 x PP1) from
    its own folder, stage 1 read from the copy, which is the uninterrupted run's checkpoint
    tensor for tensor. Then node 1 comes back: before the launch of the round that takes it
    in, it copies the files of the checkpoint rank 0 will load that its ranks open locally,
    and both nodes load it from memory, node 1's ranks reading their shards from node 0.

    Node 1 is slowed first (a sleep in its compute), so that a copy lands within an
    iteration of its save on this busy machine; node 0 once it runs alone, so that node 1's
    restart finds it still training."""
    save, reference = tmp_path / "ckpt", tmp_path / "reference"
    with two_nodes(Nodes(tmp_path, 2, train_args(save, 40, 2, 2, 100, *MEMORY_TIER))) as nodes:
        nodes.start_all(2, ("--inject", "slow:gpu=0,factor=4,at=iter:16,after=resumed"),
                        ("--inject", "slow:gpu=0,factor=4,at=iter:1"))
        wait_until(lambda: any(e["iteration"] >= 10 for e in nodes.events(0, "replicated")),
                   timeout=300, interval=0.05, what="node 0's copy of an iteration >= 10")
        os.kill(nodes.processes[1].pid, signal.SIGKILL)  # its trainers die with it
        wait_until(lambda: nodes.events(0, "failure"), timeout=120, what="node 0's failure")
        # Node 0 waits for node 1's keep-alive to expire before it relaunches: what its
        # folder holds now is what it resumes from (later saves prune it).
        held = shutil.copytree(memory_folder(nodes, 0), tmp_path / "node0-memory")
        wait_until(lambda: nodes.events(0, "resumed"), timeout=120, what="node 0 alone")
        nodes.start(1)  # the node is back, with its folder as it was left
    assert memory_folder(nodes, 0) != memory_folder(nodes, 1)
    assert memory_folder(nodes, 0).name.startswith("ftmaster-run-node0-")
    failure = nodes.events(0, "failure")[0]
    loaded = nodes.events(0, "checkpoint_loaded")[0]
    iteration = loaded["iteration"]
    assert loaded["tier"] == "memory"
    assert loaded["path"] == str(iteration_dir(memory_folder(nodes, 0), iteration))
    assert failure["iteration"] - iteration <= 2
    copies = [e for e in nodes.events(0, "replicated") if e["iteration"] == iteration]
    assert copies and copies[0]["from_node"] == 1 and copies[0]["bytes"] > 0
    assert not nodes.events(0, "replication_failed") and not nodes.events(1, "replication_failed")
    assert nodes.events(0, "complete")[0]["iteration"] == 40

    # The rejoin: node 1 caught up on the checkpoint both nodes then loaded from memory
    both = [nodes.events(r, "checkpoint_loaded")[-1] for r in (0, 1)]
    assert [(e["tier"], e["path"]) for e in both] == [
        ("memory", str(iteration_dir(memory_folder(nodes, r), both[0]["iteration"])))
        for r in (0, 1)]
    assert both[0]["iteration"] == both[1]["iteration"] > iteration
    relaunch = nodes.events(1, "launch")[-1]
    caught_up = [e for e in nodes.events(1, "replicated")
                 if e["iteration"] == both[1]["iteration"] and e["time"] < relaunch["time"]]
    assert caught_up and caught_up[0]["from_node"] == 0 and caught_up[0]["bytes"] > 0
    assert both[1]["peer_bytes"] > 0  # node 1's ranks read their shards from node 0's copy

    # The uninterrupted run, saved at that iteration only and stopped there
    result = run_trainer(4, train_args(reference, 40, 2, 2, iteration, "--exit-interval",
                                       str(iteration)))
    assert result.returncode == 0, result.stdout[-3000:]
    assert unequal_tensors(iteration_dir(held, iteration), iteration_dir(reference, iteration)) == []


def test_replica_recovery_merges_the_survivors_dumps_of_every_node(tmp_path):
    """TP1 x PP2 x DP2 over 2 nodes (node 0 runs stage 0, node 1 stage 1, each with both of
    its replicas), no checkpoint since the start: GPU 1 of node 0 fails at iteration 16. Rank
    0 (node 0) and ranks 2 and 3 (node 1) dump into their own node's memory; node 0, rank 0's
    node in the next round, gathers node 1's dumps and merges; node 1 copies the merged
    checkpoint before the launch, and both load it. It equals the uninterrupted run's
    checkpoint of that iteration, tensor for tensor."""
    save, reference = tmp_path / "ckpt", tmp_path / "reference"
    args = train_args(save, 20, 1, 2, 1000, "--seed", "4", "--non-persistent-ckpt-type",
                      "global", "--replica-recovery")
    with two_nodes(Nodes(tmp_path, 2, args)) as nodes:
        nodes.start_all(2, ("--inject", "fail:gpu=1,at=iter:16"))
        merged = wait_until(lambda: nodes.events(0, "replica_merge"), timeout=300,
                            interval=0.05, what="the merge")[0]
        held = shutil.copytree(merged["path"], tmp_path / "merged")  # removed at the end
    failure = nodes.events(0, "failure")[0]
    dumps = [nodes.events(r, "replica_dump")[0] for r in (0, 1)]
    assert [d["ranks"] for d in dumps] == [[0], [2, 3]]
    (gathered,) = nodes.events(0, "replica_gathered")
    assert gathered["from_node"] == 1 and gathered["bytes"] > 0
    assert failure["iteration"] >= 16 and merged["shards"] == 2
    # The newest iteration every replica holds: none older than the failure, none past what the
    # ranks reached (a node's failure names the last iteration it saw; the ranks may have run a
    # poll's worth further before they were stopped).
    reached = max(nodes.events(r, "failure")[0]["iteration"] for r in (0, 1))
    assert failure["iteration"] <= merged["iteration"] <= reached + 1
    loaded = [nodes.events(r, "checkpoint_loaded")[0] for r in (0, 1)]
    assert [(e["iteration"], e["tier"]) for e in loaded] == [(merged["iteration"], "memory")] * 2
    assert loaded[1]["path"].startswith(str(memory_folder(nodes, 1)))
    assert nodes.events(0, "complete")[0]["iteration"] == 20

    done = run_trainer(4, [*train_args(reference, 20, 1, 2, merged["iteration"], "--seed", "4"),
                           "--exit-interval", str(merged["iteration"])])
    assert done.returncode == 0, done.stdout[-3000:]
    assert unequal_tensors(held, iteration_dir(reference, merged["iteration"])) == []


def persisted_while_running(nodes: Nodes, iteration: int) -> bool:
    """Whether node 0 persisted a checkpoint and saved ``iteration``; a run that ended first
    fails the test at once, with node 0's persist attempts, rather than at the wait's end."""
    ended = {rank: p.returncode for rank, p in nodes.processes.items() if p.poll() is not None}
    if ended or nodes.events(0, "complete"):
        tried = [e for name in ("persisted", "persist_superseded", "persist_failed")
                 for e in nodes.events(0, name)]
        raise AssertionError(f"the run ended (exit codes {ended}) before node 0 persisted and "
                             f"saved iteration {iteration}; its persists: {tried}")
    return bool(nodes.events(0, "persisted")) and any(
        e["iteration"] >= iteration for e in nodes.events(0, "periodic_save"))


def test_three_nodes_with_one_replica_persist_and_resume_from_the_nodes_that_hold_each_file(
        tmp_path):
    """3 nodes x 1 CPU rank at DP3, one replica: each node holds its own shards and its next
    peer's, so no node's folder is whole. Node 0 persists from the nodes that hold what it
    lacks. Node 1 is SIGKILLed: nodes 0 and 2 hold every file of the newest checkpoints
    between them, agree on one through the store, and both resume from memory at DP2, each
    reading from the other the shards it lacks."""
    save = tmp_path / "ckpt"
    # Persists are due every --save-interval steps' worth of time (the first at once). At 40,
    # no disk save comes before the end: at 20 one could land before node 1 was killed (the
    # first persist waits up to 2 s for the nodes' holdings, 20 iterations on a fast run),
    # and the resume then came from disk, newer than any memory checkpoint.
    args = train_args(save, 40, 1, 1, 40, *MEMORY_TIER, global_batch=12)
    with two_nodes(Nodes(tmp_path, 1, args, nnodes="2:3"), ending=(0, 2),
                   started=(0, 1, 2)) as nodes:
        nodes.start_all(3, (), ("--inject", "slow:gpu=0,factor=3,at=iter:1"))
        wait_until(lambda: persisted_while_running(nodes, 8), timeout=300, interval=0.05,
                   what="node 0's persist, and its save of iteration 8")
        os.kill(nodes.processes[1].pid, signal.SIGKILL)  # its trainer dies with it
        assert not nodes.events(0, "complete"), "the run ended before node 1 was killed"
    first_round = [p for p in nodes.events(0, "plan") if p["round"] == 1]
    assert first_round and first_round[0]["nodes"] == [0, 1, 2]
    failure = nodes.events(0, "failure")[0]
    persisted = [e for e in nodes.events(0, "persisted") if e["time"] < failure["time"]]
    assert persisted and all(e["fetched_bytes"] > 0 for e in persisted)  # never whole on node 0
    agreed = [nodes.events(r, "memory_agreed")[-1] for r in (0, 2)]
    assert agreed[0]["round"] == agreed[1]["round"] >= 2
    # One memory save of lag at most (every 2 iterations): rank 1's shards live on only in
    # node 0's copy, which lands within an iteration or two of the save on this machine
    assert agreed[0]["iteration"] == agreed[1]["iteration"] >= failure["iteration"] - 4
    loaded = [nodes.events(r, "checkpoint_loaded")[0] for r in (0, 2)]
    assert [(e["iteration"], e["tier"]) for e in loaded] == [(agreed[0]["iteration"], "memory")] * 2
    # Neither holds it whole (node 0 lacks rank 2's shards, node 2 rank 1's): their loads read
    # the items they lack from the other, each checked against the manifest
    assert all(e["peer_bytes"] > 0 for e in loaded), loaded
    assert not [e for r in (0, 2) for e in nodes.events(r, "persist_failed")]
    assert nodes.events(0, "complete")[0]["iteration"] == 40
