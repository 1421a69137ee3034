"""ftmaster launch with --global-batch-tolerance: after a GPU loss the relaunch takes a
global batch within the tolerance to use every GPU left, the schedule moves to samples, and
the run ends at the same sample count. (Without the tolerance the exact rule idles a GPU and
says so: the TP2 replica-recovery launch, tests/e2e/test_launch_replica_recovery.py.)"""

import pytest

from helpers.launch import attempt_log, events, run_launch, train_args
from helpers.trainer import iterations

pytestmark = pytest.mark.slow

ITERS, BATCH = 20, 16  # DP4 x micro-batch 2 x 2; on 3 GPUs an exact 16 fits only DP2


def test_a_relaunch_within_the_batch_tolerance_uses_every_gpu_left(tmp_path):
    run_dir, batch = tmp_path / "run", 15
    result = run_launch(run_dir, 4, train_args(tmp_path / "ckpt", ITERS, 1, 1, 5,
                                               global_batch=BATCH),
                        "--global-batch-tolerance", "10", "--inject", "fail:gpu=3,at=iter:7")
    assert result.returncode == 0, result.stdout[-4000:]
    (plan,) = events(run_dir, "plan")
    assert (plan["num_gpus_used"], plan["global_batch_size"]) == (3, batch)
    idle = "leaves 1 of 3 GPUs"
    assert not any(idle in w for w in plan["warnings"]) and idle not in result.stdout
    resumed = iterations(attempt_log(run_dir, 2))
    last = resumed[max(resumed)]
    # the same samples in all, give or take the last (new) batch
    assert ITERS * BATCH <= last["consumed"] < ITERS * BATCH + batch
    assert {line["global_batch"] for line in resumed.values()} == {batch}
