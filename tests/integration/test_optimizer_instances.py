"""Megatron-LM's partial distributed optimizer on the real trainer (CPU + gloo): with N
instances the optimizer state is sharded within each and replicated across them. Training
is the same as with one instance, and the checkpoint reshards to another DP and another N,
or to the plain optimizer."""

import pytest

from helpers.trainer import SMALL_GPT, assert_follows, from_iteration_3, iterations, run_trainer, train

pytestmark = pytest.mark.slow

BASE = SMALL_GPT + ["--micro-batch-size", "1", "--global-batch-size", "12", "--lr", "1e-2",
                    "--seed", "7", "--train-iters", "6"]


def instances(n: int) -> list[str]:
    """N distributed-optimizer instances; 0: the plain optimizer."""
    if n == 0:
        return ["--no-use-distributed-optimizer"]
    return ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", str(n)]


def test_two_instances_train_as_one_and_their_checkpoint_reshards(tmp_path):
    reference = train(4, BASE + instances(1), tmp_path / "one")
    run = run_trainer(4, BASE + instances(2) + ["--save", str(tmp_path / "two"), "--save-interval", "3"])
    assert run.returncode == 0, run.stdout[-3000:]
    assert "DP 4, fp32, distributed (2 instances) optimizer state" in run.stdout
    two = iterations(run.stdout)
    for it in range(1, 7):
        assert two[it]["loss"] == pytest.approx(reference[it]["loss"], rel=1e-5), it
    for nproc, n, optimizer in ((3, 1, "distributed"), (2, 2, "distributed (2 instances)"),
                                (2, 0, "replicated")):
        (tmp_path / f"dp{nproc}-{n}").mkdir()
        resumed = run_trainer(nproc, BASE + instances(n) + [
            "--load", str(from_iteration_3(tmp_path / "two", tmp_path / f"dp{nproc}-{n}"))])
        assert resumed.returncode == 0, resumed.stdout[-3000:]
        assert f"DP {nproc}, fp32, {optimizer} optimizer state" in resumed.stdout
        assert_follows(iterations(resumed.stdout), reference)
