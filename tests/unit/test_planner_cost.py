"""The cost model's ranking (issue 15, item 1): compute share, bubble, TP and DP traffic."""

import math

import pytest

from ftmaster.recovery.cost_model import Hardware, StepEstimate, calibrated
from ftmaster.recovery.planner import plan_layout

# A 10B-class model (48 layers, hidden 4096) on 16k-token sequences: compute dominates.
MODEL = ["t.py", "--num-layers", "48", "--hidden-size", "4096", "--num-attention-heads", "32",
         "--ffn-hidden-size", "11008", "--swiglu", "--seq-length", "16384", "--vocab-size", "32000",
         "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--micro-batch-size", "1"]


def layout(tp=1, pp=1, gbs=16, extra=()):
    return [*MODEL, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
            str(pp), "--global-batch-size", str(gbs), *extra]


def samples_per_second(args, gpus, gpus_per_node=8, **options):
    """The cost model's throughput of the command's own layout on ``gpus`` GPUs."""
    plan = plan_layout(args, gpus, gpus_per_node, original_world_size=gpus, **options)
    assert plan.reason == "the original layout fits (hot spare)"
    return plan.global_batch_size / plan.estimated_step_seconds


@pytest.mark.parametrize("faster, slower, why", [
    # 1F1B bubble: (PP - 1) / (M + PP - 1): 64 micro-batches amortise it better than 8.
    ((layout(pp=8, gbs=128), 16), (layout(pp=8, gbs=16), 16), "more micro-batches, smaller bubble"),
    # Interleaving divides the bubble by VPP.
    ((layout(pp=4, gbs=32, extra=("--num-layers-per-virtual-pipeline-stage", "3")), 32),
     (layout(pp=4, gbs=32), 32), "interleaved 1F1B"),
    # Per-GPU compute share: twice the GPUs at the same bubble.
    ((layout(pp=2, gbs=64), 32), (layout(pp=2, gbs=64), 16), "more data parallelism"),
    # Gradient reduction inside a node (NVLink) beats one across nodes (InfiniBand).
    ((layout(gbs=8, extra=("--seq-length", "1024")), 8, 8),
     (layout(gbs=8, extra=("--seq-length", "1024")), 8, 2), "DP group inside a node"),
])
def test_cost_model_ranking(faster, slower, why):
    assert samples_per_second(*faster) > samples_per_second(*slower), why


def test_overlapping_the_gradient_reduction_hides_it():
    plain = [token for token in layout(gbs=8, extra=("--seq-length", "1024"))
             if token != "--overlap-grad-reduce"]
    overlapped = layout(gbs=8, extra=("--seq-length", "1024"))
    assert samples_per_second(overlapped, 8, 2) > samples_per_second(plain, 8, 2)
    opted_out = [*overlapped, "--no-overlap-grad-reduce"]  # the trainer's opt-out, last wins
    assert samples_per_second(opted_out, 8, 2) == samples_per_second(plain, 8, 2)


def test_tensor_parallelism_costs_communication_inside_the_node():
    # Same GPUs, same per-GPU compute: TP8 pays 8 collectives per layer and micro-batch
    # that DP8 with a hidden gradient reduction does not.
    assert samples_per_second(layout(gbs=8), 8) > samples_per_second(layout(tp=8, gbs=8), 8)


def test_fewer_gpus_are_faster_than_a_deeper_pipeline_with_few_micro_batches():
    """24 single-GPU nodes, global batch 16: PP3 x DP8 uses all 24 but each replica runs only
    2 micro-batches through 3 stages (bubble 2/4); PP1 x DP16 uses 16, with no bubble."""
    deeper = samples_per_second(layout(pp=3), 24, 1)
    shallow = samples_per_second(layout(pp=1), 16, 1)
    assert shallow > deeper * 1.1
    plan = plan_layout(layout(pp=2), 24, 1)
    assert (plan.pipeline_model_parallel_size, plan.data_parallel_size, plan.num_gpus_used) == (1, 16, 16)
    assert plan.idle_gpus == 8 and plan.reason == "the highest estimated throughput"
    assert plan_layout(layout(pp=2), 24, 1, mode="paper").num_gpus_used == 24


def test_ties_go_to_the_layout_closest_to_the_original():
    # TP1 x DP8 and TP8 x DP1 on a tiny model: compute share only (see cost_model), equal;
    # the original TP wins either way.
    tiny = ["t.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
            "--seq-length", "32", "--vocab-size", "1024", "--micro-batch-size", "1",
            "--global-batch-size", "8"]
    for tp in (1, 8):
        plan = plan_layout([*tiny, "--tensor-model-parallel-size", str(tp)], 8)
        assert plan.tensor_model_parallel_size == tp


@pytest.mark.parametrize("measured, expected_flops", [
    # Measured 2x the modelled compute + communication: the compute rate halves
    # (the communication keeps its bandwidth).
    (2 * 10.0 + 1.0, 200e12),
    # Measured below the modelled communication alone: every rate scales.
    (0.5, 400e12 * 11 / 0.5),
])
def test_calibration_from_a_measured_step(measured, expected_flops):
    predicted = StepEstimate(compute_seconds=10.0, communication_seconds=1.0, bubble_fraction=0.1)
    hardware = calibrated(Hardware(), predicted, measured)
    assert math.isclose(hardware.flops, expected_flops, rel_tol=1e-9)


def test_a_measured_step_time_calibrates_the_plan():
    args = layout(pp=4, gbs=32)
    plan = plan_layout(args, 32, 8, original_world_size=32, measured_step_s=123.0)
    assert math.isclose(plan.estimated_step_seconds, 123.0, rel_tol=1e-4)
    replanned = plan_layout(args, 31, 8, original_world_size=32, measured_step_s=123.0)
    speed = replanned.global_batch_size / replanned.estimated_step_seconds
    assert math.isclose(replanned.throughput_vs_original, speed / (32 / 123.0), rel_tol=1e-3)


def test_a_measured_step_time_needs_a_layout_megatron_would_run():
    with pytest.raises(ValueError, match=r"^--measured-step-s 1 is a step of the command's "
                                         r"TP 1 x PP 5 with micro-batch 1 and global batch 16, "
                                         r"which Megatron would not run on --original-gpus 30: "):
        plan_layout(layout(pp=5), 32, 8, original_world_size=30, measured_step_s=1.0)


@pytest.mark.parametrize("factor", [0.8, 1.5, 3.0])
def test_calibration_reproduces_a_step_whose_gradient_reduction_is_partly_hidden(factor):
    """Data parallelism across nodes with --overlap-grad-reduce: part of the reduction hides
    behind the backward pass, and how much depends on the compute rate being calibrated."""
    args = layout(gbs=8, extra=("--seq-length", "1024"))
    modelled = plan_layout(args, 8, 2, original_world_size=8).estimated_step_seconds
    measured = modelled * factor
    plan = plan_layout(args, 8, 2, original_world_size=8, measured_step_s=measured)
    assert math.isclose(plan.estimated_step_seconds, measured, rel_tol=1e-4)


def test_a_moe_layer_pattern_without_moe_layers_costs_what_the_dense_model_costs():
    """``moe_layers`` 0 was read as "not given", so every layer was costed as a MoE layer."""
    from ftmaster.recovery.cost_model import split_cost, total_parameters
    from ftmaster.recovery.layout_rules import ModelSplit, PipelineSplit
    from ftmaster.recovery.memory_estimate import MemoryFlags
    from ftmaster.recovery.model_facts import read_model_shape

    dense = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "8",
             "--seq-length", "128", "--vocab-size", "1024"]
    no_moe_layers = read_model_shape([*dense, "--num-experts", "8", "--moe-layer-freq", "([0]*4)"])
    split = ModelSplit(1, 1, PipelineSplit(1, (4, 4, 4), 1, True))
    assert total_parameters(no_moe_layers, 1024) == total_parameters(read_model_shape(dense), 1024)
    assert (split_cost(no_moe_layers, MemoryFlags(), split, 1024).stage_flops
            == split_cost(read_model_shape(dense), MemoryFlags(), split, 1024).stage_flops)


def test_an_untied_output_layer_at_pp1_is_reduced_with_the_other_gradients():
    """At PP 1 an untied model holds the embedding and the output layer: both gradients are
    reduced over DP (the memory estimate counts both; the cost model counted one)."""
    from ftmaster.recovery.cost_model import split_cost
    from ftmaster.recovery.layout_rules import ModelSplit, PipelineSplit
    from ftmaster.recovery.memory_estimate import MemoryFlags
    from ftmaster.recovery.model_facts import read_model_shape

    base = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "8",
            "--seq-length", "128", "--vocab-size", "32000"]
    split = ModelSplit(2, 1, PipelineSplit(1, (4, 4, 4), 1, True))
    tied = split_cost(read_model_shape(base), MemoryFlags(), split, 32000)
    untied = split_cost(read_model_shape([*base, "--untie-embeddings-and-output-weights"]),
                        MemoryFlags(), split, 32000)
    assert untied.gradient_bytes - tied.gradient_bytes == 32000 * 1024 / 2 * 4


@pytest.mark.parametrize("measured", [1e-300, 5e-324])
def test_a_step_time_too_short_to_calibrate_on_is_refused_in_one_line(measured):
    """Scaled by modelled / measured, the rates overflowed to infinity; every step was then
    0 s and samples/s divided by it (ZeroDivisionError from ftmaster plan) (found in review)."""
    with pytest.raises(ValueError, match="too short"):
        plan_layout(layout(pp=4, gbs=32), 31, 8, original_world_size=32, measured_step_s=measured)


@pytest.mark.parametrize("pattern", ["([1]*8)", "([1]*2)", "([0]*1+[1]*2)*2"])
def test_a_moe_layer_pattern_of_another_length_than_the_model_is_refused(pattern):
    """Megatron-LM asserts the pattern's length is --num-layers: a longer one was read as
    more MoE layers than the model has, and counted negative dense layers."""
    from ftmaster.recovery.model_facts import read_model_shape

    args = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "8",
            "--seq-length", "128", "--vocab-size", "1024", "--num-experts", "8",
            "--moe-layer-freq", pattern]
    with pytest.raises(ValueError, match=rf"--moe-layer-freq .* gives \d+ layers, where "
                                         rf"--num-layers is 4"):
        read_model_shape(args)
