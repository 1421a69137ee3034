"""GPUs that fail but stay visible, rehearsed end to end on CPU: an XID that kills its rank and
needs a reset, and a wedged driver that blocks every telemetry read of one GPU."""

import pytest

from ftmaster.recovery.checkpoints import checkpoint_problem, iteration_dir, read_tracker
from helpers.launch import attempt_log, events, run_launch, train_args

pytestmark = pytest.mark.slow


def only(run_dir, name):
    found = events(run_dir, name)
    assert len(found) == 1, f"expected one {name} event, got {found}"
    return found[0]


def test_an_xid_retires_its_gpu_and_no_later_attempt_uses_it(tmp_path):
    """The issue's scenario: TP2 x PP2 on 4 GPUs, XID 95 on GPU 1 at iteration 8."""
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    result = run_launch(run_dir, 4, train_args(save, 30, 2, 2, 100),
                        "--inject", "xid:gpu=1,code=95,at=iter:8")
    assert result.returncode == 0, result.stdout[-4000:]

    alerts = [e for e in events(run_dir, "risk_alert") if e["gpu"] == 1]
    assert "xid_95" in alerts[0]["reasons"]
    failure = only(run_dir, "failure")
    assert (failure["attempt"], failure["gpus"]) == (1, [1])
    assert {"gpu": 1, "reason": "xid_95"} in failure["unfit_gpus"]
    assert "CUDA error: uncorrectable ECC error encountered (rehearsal: XID 95" in attempt_log(run_dir, 1)
    plan = only(run_dir, "plan")
    assert plan["gpus_retired"] == [{"gpu": 1, "reason": "xid_95"}]
    assert (plan["gpus_available"], plan["num_gpus_used"]) == ([0, 2, 3], 3)
    assert all(1 not in e["gpus"] for e in events(run_dir, "launch")[1:])
    assert only(run_dir, "complete")["iteration"] == 30
    assert read_tracker(save) == 30 and checkpoint_problem(iteration_dir(save, 30)) is None
    assert "retiring GPU 1: xid_95" in result.stdout


def test_a_wedged_gpu_is_reported_lost_and_retired_while_training_goes_on(tmp_path):
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    # A wedge is reported after 3 samples and 3 read deadlines (1 s each): about 30
    # iterations of this size on 2 CPU ranks, well within the 100.
    result = run_launch(run_dir, 2, train_args(save, 100, 1, 1, 10, global_batch=24),
                        "--inject", "wedge:gpu=1,at=iter:5")
    assert result.returncode == 0, result.stdout[-4000:]
    lost = [e for e in events(run_dir, "risk_alert") if "device_lost" in e["reasons"]]
    assert [(e["gpu"], e["reasons"]) for e in lost] == [(1, ["device_lost", "wedged"])]
    failure = only(run_dir, "failure")
    assert (failure["cause"], failure["gpus"]) == ("device_lost", [1])
    assert only(run_dir, "plan")["gpus_retired"] == [{"gpu": 1, "reason": "wedged"}]
    assert events(run_dir, "launch")[1]["gpus"] == [0]
    assert only(run_dir, "complete")["iteration"] == 100
