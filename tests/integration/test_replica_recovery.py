"""Recovery from surviving replicas, on 4 real CPU ranks (TP1 x PP2 x DP2).

A rank SIGKILLs itself at one of five points of iteration 4; the survivors park or stay
blocked, dump on request, and the merge builds a checkpoint. Every update follows the NaN
guard's agreement on every rank, so a death before it leaves every survivor at iteration 3
and a death after it at 4: the merge must pick exactly that iteration, and its every tensor
must equal the same iteration's checkpoint of an uninterrupted run. Then the refusals: a
plan removed, a plan missing a chunk (the coverage trap: torch checks coverage only with more
than one plan), and DP 1.
"""

import json
import pickle
import shutil

import pytest

from ftmaster.recovery.manifest import digest_file
from ftmaster.recovery.replicas import NoCut, dump_folder, rank_dump_dir, report_path
from helpers.replicas import checkpoint_tensors, dump_after_a_kill, unequal_tensors
from helpers.trainer import SMALL_GPT, layout_args, run_trainer
from megatron.training.replica_merge import merge

pytestmark = pytest.mark.slow

VICTIM = 1  # TP1 x PP2 x DP2: rank 1 is (PP 0, DP 1); rank 0 is its shard's only survivor


def schedule(save, tp=1, pp=2):
    return [*SMALL_GPT, *layout_args(tp, pp), "--micro-batch-size", "2", "--global-batch-size",
            "8", "--train-iters", "8", "--lr", "1e-2", "--seed", "5", "--save", str(save)]


def replica_args(root, tp=1, pp=2):
    return [*schedule(root / "save", tp, pp), "--save-interval", "100", "--exit-signal-handler",
            "--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir",
            str(root / "memory"), "--replica-recovery"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, a checkpoint at every iteration up to 5."""
    save = tmp_path_factory.mktemp("reference") / "save"
    result = run_trainer(4, [*schedule(save), "--save-interval", "1", "--exit-interval", "5"])
    assert result.returncode == 0, result.stdout[-3000:]
    return save


def killed_at(root, point, tp=1, pp=2):
    folder = dump_folder(root / "memory", 1)
    reports = dump_after_a_kill(4, replica_args(root, tp, pp), root / "log.txt", root / "run",
                                folder, VICTIM, f"4:{point}")
    return folder, reports


@pytest.fixture(scope="module")
def forward_dumps(tmp_path_factory):
    return killed_at(tmp_path_factory.mktemp("forward"), "forward")


def copied(folder, tmp_path):
    copy = tmp_path / "dump"
    shutil.copytree(folder, copy)
    return copy


@pytest.mark.parametrize("point, cut", [("forward", 3), ("grad-allreduce", 3), ("grad-norm", 3),
                                        ("update", 4), ("save-agreement", 4)])
def test_a_kill_at_any_point_merges_the_exact_checkpoint_of_the_last_agreed_iteration(
        point, cut, reference, forward_dumps, tmp_path):
    folder, reports = forward_dumps if point == "forward" else killed_at(tmp_path, point)
    assert sorted(r.rank for r in reports) == [0, 2, 3]
    assert {r.iteration for r in reports} == {cut}, [(r.rank, r.iteration, r.refused) for r in reports]
    merged = merge(copied(folder, tmp_path), tmp_path / "merged")
    assert (merged.iteration, merged.shards) == (cut, 2)
    assert unequal_tensors(merged.path, reference / f"iter_{cut:07d}") == []


def test_a_merge_missing_the_only_plan_of_a_shard_refuses(forward_dumps, tmp_path):
    folder = copied(forward_dumps[0], tmp_path)
    (rank_dump_dir(folder, 0) / ".metadata").unlink()
    with pytest.raises(NoCut, match="rank 0's dump lacks .metadata"):
        merge(folder, tmp_path / "merged")
    assert not (tmp_path / "merged").exists() or not any((tmp_path / "merged").iterdir())


def test_a_plan_that_lost_a_chunk_is_caught_by_the_coverage_check(forward_dumps, tmp_path):
    """Rank 0's half of a layer tensor (PP 0's layers) is gone from its plan while rank 2's
    half is there, and the report matches the plan (as if the dump itself had been wrong):
    only the merge's own coverage check stands between this and a checkpoint that would load
    PP 0's layers with the template's values."""
    folder = copied(forward_dumps[0], tmp_path)
    plan_path = rank_dump_dir(folder, 0) / ".metadata"
    plan = pickle.loads(plan_path.read_bytes())
    fqn, entry = next((k, v) for k, v in sorted(plan.state_dict_metadata.items())
                      if hasattr(v, "chunks") and k.startswith("decoder.layers."))
    dropped = entry.chunks.pop()
    plan.storage_data = {i: s for i, s in plan.storage_data.items()
                         if not (i.fqn == fqn and tuple(i.offset) == tuple(dropped.offsets))}
    plan_path.write_bytes(pickle.dumps(plan))
    report = report_path(folder, 0)
    body = json.loads(report.read_text())
    found = digest_file(plan_path)
    body["files"][".metadata"] = {"bytes": found.bytes, "digest": found.digest}
    report.write_text(json.dumps(body))
    with pytest.raises(NoCut, match=f"do not cover the model: {fqn}"):
        merge(folder, tmp_path / "merged")


def test_dp_1_has_no_replica_and_the_merge_says_so(tmp_path):
    folder, reports = killed_at(tmp_path, "forward", tp=2, pp=2)
    assert len(reports) == 3
    with pytest.raises(NoCut, match=r"DP 1: no shard has a replica"):
        merge(folder, tmp_path / "merged")


# ---- the distributed optimizer with two instances (TP1 x PP1 x DP4) ----------------------
# Instance 0 is ranks 0 and 1 (optimizer shards 0 and 1), instance 1 ranks 2 and 3.

def distributed(args):
    return [*args, "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]


@pytest.fixture(scope="module")
def distributed_reference(tmp_path_factory):
    save = tmp_path_factory.mktemp("distributed-reference") / "save"
    result = run_trainer(4, distributed([*schedule(save, 1, 1), "--save-interval", "1",
                                         "--exit-interval", "5"]))
    assert result.returncode == 0, result.stdout[-3000:]
    return save


def distributed_dumps(root, kill):
    folder = dump_folder(root / "memory", 1)
    reports = dump_after_a_kill(4, distributed(replica_args(root, 1, 1)), root / "log.txt",
                                root / "run", folder, VICTIM, kill)
    return folder, reports


def test_the_distributed_optimizers_shards_merge_into_the_exact_checkpoint(
        distributed_reference, tmp_path):
    """Rank 1 (instance 0, optimizer shard 1) dies after the update of iteration 4: rank 3
    holds the same shard in instance 1, so the merge takes shard 0 from rank 0 and shard 1
    from rank 3, and every tensor, the optimizer's included, is the regular save's."""
    folder, reports = distributed_dumps(tmp_path, "4:update")
    assert [(r.rank, r.instance, r.optimizer_shard, r.optimizer_shards) for r in reports] == [
        (0, 0, 0, 2), (2, 1, 0, 2), (3, 1, 1, 2)]
    merged = merge(copied(folder, tmp_path), tmp_path / "merged")
    assert (merged.iteration, merged.shards) == (4, 2)
    reference = distributed_reference / "iter_0000004"
    assert unequal_tensors(merged.path, reference) == []
    assert any(key.startswith("optimizer.state.exp_avg.") for key in checkpoint_tensors(merged.path))


def test_a_shard_lost_in_both_instances_refuses_the_merge(tmp_path):
    """Ranks 1 and 3 hold optimizer shard 1, one in each instance: rank 1 dies in iteration 4
    and rank 3 before the dump, so no survivor has the shard, and the merge says so in one
    line."""
    folder = dump_folder(tmp_path / "memory", 1)
    reports = dump_after_a_kill(4, distributed(replica_args(tmp_path, 1, 1)), tmp_path / "log.txt",
                                tmp_path / "run", folder, VICTIM, "4:forward", also_lost=(3,))
    assert sorted(r.rank for r in reports) == [0, 2]
    with pytest.raises(NoCut, match=r"^shard \(TP 0, PP 0, optimizer shard 1\) has no survivor "
                                    r"at iteration 3, nor a complete cut at an earlier one$"):
        merge(folder, tmp_path / "merged")
