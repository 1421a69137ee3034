"""Megatron-LM's partial distributed optimizer on the real trainer (CPU + gloo): with N
instances the optimizer state is sharded within each and replicated across them. Training
is the same as with one instance, and the checkpoint reshards to another DP and another N."""

import pytest

from helpers.trainer import SMALL_GPT, assert_follows, from_iteration_3, iterations, run_trainer, train

pytestmark = pytest.mark.slow

ARGS = SMALL_GPT + ["--micro-batch-size", "1", "--global-batch-size", "12", "--lr", "1e-2",
                    "--seed", "7", "--train-iters", "6", "--use-distributed-optimizer"]


def instances(n: int) -> list[str]:
    return ["--num-distributed-optimizer-instances", str(n)]


def test_two_instances_train_as_one_and_their_checkpoint_reshards(tmp_path):
    reference = train(4, ARGS + instances(1), tmp_path / "one")
    run = run_trainer(4, ARGS + instances(2) + ["--save", str(tmp_path / "two"), "--save-interval", "3"])
    assert run.returncode == 0, run.stdout[-3000:]
    assert "DP 4, fp32, distributed (2 instances) optimizer state" in run.stdout
    two = iterations(run.stdout)
    for it in range(1, 7):
        assert two[it]["loss"] == pytest.approx(reference[it]["loss"], rel=1e-5), it
    for nproc, n in ((3, 1), (2, 2)):
        (tmp_path / f"dp{nproc}").mkdir()
        resumed = run_trainer(nproc, ARGS + instances(n) + [
            "--load", str(from_iteration_3(tmp_path / "two", tmp_path / f"dp{nproc}"))])
        assert resumed.returncode == 0, resumed.stdout[-3000:]
        assert f"DP {nproc}, fp32, distributed" in resumed.stdout
        assert_follows(iterations(resumed.stdout), reference)
