"""The planner at scale (issue 15): the global-batch tolerance, sample-exact schedules, the
idle-GPU warning and hot spares."""

import math

import pytest

from ftmaster.recovery.batch_schedule import change_global_batch
from ftmaster.recovery.megatron_args import flag_value
from ftmaster.recovery.planner import plan_layout, plan_nodes
from test_planner_megatron_check import LLAMA3_70B, command, megatron_problems

LLAMA3_70B_TP8_PP8 = command(**LLAMA3_70B, tp=8, pp=8, mbs=1, gbs=2048,
                             extra=("--sequence-parallel", "--lr-warmup-iters", "2000",
                                    "--lr-decay-iters", "900", "--save", "/ckpt"))
TRAIN_ITERS = 1000  # command() writes --train-iters 1000


def test_one_node_lost_of_16384_with_a_1_percent_tolerance_keeps_99_percent_busy():
    plan = plan_layout(LLAMA3_70B_TP8_PP8, 16376, 8, global_batch_tolerance_pct=1,
                       original_world_size=16384)
    assert plan.num_gpus_used >= 0.99 * 16376
    assert abs(plan.global_batch_size - 2048) <= 20
    assert megatron_problems(list(plan.command[1:]), plan.num_gpus_used, plan.ranks_per_node) == []
    assert not any(w.startswith("the exact global batch") for w in plan.warnings)


def test_with_memory_the_same_case_keeps_a_realistic_pipeline():
    plan = plan_layout(LLAMA3_70B_TP8_PP8, 16376, 8, global_batch_tolerance_pct=1,
                       original_world_size=16384, gpu_memory_gb=80)
    assert plan.num_gpus_used >= 0.99 * 16376 and plan.estimated_memory_gib + 2.5 <= 80
    assert plan.throughput_vs_original > 0.95


def test_the_exact_rule_stands_with_tolerance_0_and_says_what_a_tolerance_would_buy():
    exact = plan_layout(LLAMA3_70B_TP8_PP8, 16376, 8, original_world_size=16384)
    assert exact == plan_layout(LLAMA3_70B_TP8_PP8, 16376, 8, original_world_size=16384,
                                global_batch_tolerance_pct=0)
    assert exact.global_batch_size == 2048 and exact.num_gpus_used == 10240
    idle = [w for w in exact.warnings if w.startswith("the exact global batch")]
    assert len(idle) == 1 and "\n" not in idle[0]
    assert "leaves 6136 of 16376 GPUs (37.5%) idle; --global-batch-tolerance 0.5 would use" in idle[0]


def test_a_small_job_is_told_the_tolerance_that_fills_its_gpus():
    """The README's case: 3 of 4 GPUs left with batch 16, where a tolerance of 10 trains DP3 at
    batch 15. The warning stopped looking at 5% and said no tolerance would fix it."""
    args = ["t.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
            "--train-iters", "20"]
    exact = plan_layout(args, 3, original_world_size=4)
    idle = [w for w in exact.warnings if w.startswith("the exact global batch")]
    assert idle == ["the exact global batch 16 leaves 1 of 3 GPUs (33.3%) idle; "
                    "--global-batch-tolerance 10 would use 3 with global batch 15"]


def test_a_spare_node_keeps_the_original_layout_whatever_the_tolerance():
    plan = plan_layout(LLAMA3_70B_TP8_PP8, 16392, 8, global_batch_tolerance_pct=5,
                       original_world_size=16384)
    assert (plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size,
            plan.data_parallel_size, plan.global_batch_size, plan.num_gpus_used) == (8, 8, 256, 2048, 16384)
    assert plan.reason == "the original layout fits (hot spare)" and plan.idle_gpus == 8
    assert plan.ranks_per_node.count(8) == 2048 and plan.ranks_per_node.count(0) == 1


def test_a_changed_batch_must_buy_throughput():
    # One head: TP stays 1. On 8 GPUs the exact batch 16 already runs DP 8, so a tolerance
    # changes nothing; on 12 GPUs the exact batch leaves 4 idle and a batch of 12 (25%) fills them.
    args = ["t.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "1",
            "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "1",
            "--global-batch-size", "16", "--train-iters", "100"]
    assert plan_layout(args, 8, global_batch_tolerance_pct=10).global_batch_size == 16
    wider = plan_layout(args, 12, global_batch_tolerance_pct=25)
    assert (wider.global_batch_size, wider.num_gpus_used) == (12, 12)


# -- the rewritten command ends at the same sample count, with the same LR schedule ---------

def scheduler_steps(args):
    """Megatron-LM's training.get_optimizer_param_scheduler, re-implemented: the steps (in
    samples) of warm-up, decay and weight-decay increase, which must match the checkpoint's."""
    gbs = int(flag_value(args, "--global-batch-size"))
    if flag_value(args, "--train-iters") is not None:
        decay = int(flag_value(args, "--lr-decay-iters") or flag_value(args, "--train-iters")) * gbs
        return (int(flag_value(args, "--lr-warmup-iters") or 0) * gbs, decay,
                int(flag_value(args, "--train-iters")) * gbs)
    samples = int(flag_value(args, "--train-samples"))
    return (int(flag_value(args, "--lr-warmup-samples") or 0),
            int(flag_value(args, "--lr-decay-samples") or samples), samples)


def samples_at_the_end(original, rewritten, consumed):
    """The trainer's contract: resume at ``consumed`` and run until --train-samples."""
    total = int(flag_value(rewritten, "--train-samples"))
    batch = int(flag_value(rewritten, "--global-batch-size"))
    return consumed + math.ceil((total - consumed) / batch) * batch


@pytest.mark.parametrize("resume_iteration", [0, 1, 417, 999])
def test_a_planned_batch_change_ends_at_the_same_samples_and_keeps_the_schedule(resume_iteration):
    plan = plan_layout(LLAMA3_70B_TP8_PP8, 16376, 8, global_batch_tolerance_pct=1,
                       original_world_size=16384)
    original, rewritten = LLAMA3_70B_TP8_PP8[1:], list(plan.command[1:])
    assert plan.global_batch_size != 2048
    assert scheduler_steps(rewritten) == scheduler_steps(original)
    consumed = resume_iteration * 2048
    end = samples_at_the_end(original, rewritten, consumed)
    assert TRAIN_ITERS * 2048 <= end < TRAIN_ITERS * 2048 + plan.global_batch_size
    assert "--train-iters" not in rewritten and "--lr-warmup-iters" not in rewritten


@pytest.mark.parametrize("args, expected", [
    pytest.param(["--train-iters", "100", "--lr-decay-iters=80", "--lr-warmup-iters", "5",
                  "--global-batch-size", "64", "--lr", "1"],
                 ["--train-samples", "6400", "--lr-decay-samples=5120", "--lr-warmup-samples",
                  "320", "--global-batch-size", "63", "--lr", "1"], id="iterations-to-samples-in-place"),
    pytest.param(["--train-samples", "6400", "--global-batch-size", "64"],
                 ["--train-samples", "6400", "--global-batch-size", "63"], id="already-samples"),
    pytest.param(["--train-iters", "100", "--lr-wsd-decay-iters", "10"],
                 ["--train-samples", "6400", "--lr-wsd-decay-samples", "640",
                  "--global-batch-size", "63"], id="derived-batch-pinned"),
])
def test_change_global_batch(args, expected):
    assert change_global_batch(args, 64, 63) == expected


def test_an_explicit_zero_of_a_samples_flag_does_not_undo_the_rename():
    """Megatron-LM takes --lr-warmup-samples 0 beside --lr-warmup-iters: left after the
    rename, the later 0 won, the warm-up was gone, and every relaunch at the new batch
    failed the scheduler's check against the checkpoint."""
    args = ["--train-iters", "100", "--lr-warmup-iters", "5", "--lr-warmup-samples", "0"]
    assert change_global_batch(args, 64, 63) == [
        "--train-samples", "6400", "--lr-warmup-samples", "320", "--global-batch-size", "63"]


def test_with_a_tolerance_a_relaunch_back_at_the_original_batch_stays_in_samples():
    """Each plan starts from the original command: 8 -> 7 GPUs trained at batch 511, and the
    plan on 4 GPUs, back at 512, put --train-iters 1000 back, so the run ended short of the
    samples it was to train (and of its learning rate's decay)."""
    args = ["t.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "4",
            "--global-batch-size", "512", "--train-iters", "1000", "--lr-decay-iters", "1000"]
    plans = [plan_layout(args, gpus, original_world_size=8, global_batch_tolerance_pct=5)
             for gpus in (7, 4)]
    assert [plan.global_batch_size for plan in plans] == [511, 512]
    for plan in plans:
        assert flag_value(plan.command, "--train-samples") == "512000"
        assert flag_value(plan.command, "--lr-decay-samples") == "512000"
        assert "--train-iters" not in plan.command
    exact = plan_layout(args, 4, original_world_size=8)  # no tolerance: as given
    assert flag_value(exact.command, "--train-iters") == "1000"


def test_a_malformed_iteration_count_is_named_in_the_error():
    with pytest.raises(ValueError, match=r"^--lr-warmup-iters must be an integer, got '1.5'$"):
        change_global_batch(["--train-iters", "10", "--lr-warmup-iters", "1.5"], 64, 63)


def test_tolerance_on_a_derived_global_batch_pins_the_new_one():
    args = ["t.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "1",
            "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "1",
            "--train-iters", "10"]
    plan = plan_nodes(args, [7], original_world_size=8, global_batch_tolerance_pct=15)
    assert (plan.global_batch_size, plan.num_gpus_used) == (7, 7)
    assert flag_value(plan.command, "--global-batch-size") == "7"
    assert flag_value(plan.command, "--train-samples") == "80"  # 10 iterations of 8


@pytest.mark.timeout(20)  # it plans in milliseconds; before, it ran for minutes
def test_a_huge_node_with_a_tolerance_is_planned_without_walking_every_dp_size():
    # Each split's DP sizes were walked down from what the node allows, 10^8 here, though
    # no DP above the largest allowed batch can divide one: the idle warning's tolerance
    # ladder ran for minutes.
    small = ["x.py", "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads",
             "32", "--seq-length", "2048", "--micro-batch-size", "1", "--global-batch-size", "64"]
    plan = plan_layout(small, 10**8)
    assert plan.global_batch_size == 64
