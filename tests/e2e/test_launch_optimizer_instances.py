"""ftmaster launch with Megatron-LM's partial distributed optimizer: a GPU lost from DP 4 with
two instances leaves DP 3, which two do not divide; the relaunch runs one instance, says so,
and resumes the two-instance checkpoint."""

import pytest

from helpers.launch import attempt_log, events, run_launch, train_args
from helpers.trainer import iterations

pytestmark = pytest.mark.slow


def test_a_relaunch_on_a_dp_the_instances_do_not_divide_runs_fewer_and_says_so(tmp_path):
    run_dir = tmp_path / "run"
    args = train_args(tmp_path / "ckpt", 10, 1, 1, 5, "--use-distributed-optimizer",
                      "--num-distributed-optimizer-instances", "2", global_batch=24)
    result = run_launch(run_dir, 4, args, "--inject", "fail:gpu=3,at=iter:7")
    assert result.returncode == 0, result.stdout[-4000:]
    assert "DP 4, fp32, distributed (2 instances) optimizer state" in attempt_log(run_dir, 1)
    (plan,) = events(run_dir, "plan")
    assert plan["num_gpus_used"] == 3
    said = ("--num-distributed-optimizer-instances 2 does not divide the new layout's "
            "data-parallel size: the relaunch runs 1")
    assert said in plan["warnings"] and said in result.stdout
    relaunched = attempt_log(run_dir, 2)
    assert "DP 3, fp32, distributed optimizer state" in relaunched
    assert "loaded checkpoint from" in relaunched and max(iterations(relaunched)) == 10
