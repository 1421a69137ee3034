"""The memory estimate: calibrated against measured peaks, never refusing known-good layouts,
and each flag moving it the way Megatron-LM's memory moves."""

import importlib.util
from pathlib import Path

import pytest

from ftmaster.recovery.planner import plan_layout

_spec = importlib.util.spec_from_file_location(
    "planner_memory_calibration",
    Path(__file__).parents[2] / "benchmarks" / "planner_memory_calibration.py")
calibration = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(calibration)

CALIBRATION_ERROR = 0.05


@pytest.mark.parametrize("name, args, gpus, measured, source", calibration.MEASURED,
                         ids=[row[0] for row in calibration.MEASURED])
def test_the_estimate_is_within_5_percent_of_megatron_lms_measured_peaks(name, args, gpus,
                                                                          measured, source):
    assert abs(calibration.estimate_gib(args, gpus) / measured - 1) <= CALIBRATION_ERROR


@pytest.mark.parametrize("name, args, gpus", calibration.KNOWN_GOOD,
                         ids=[row[0] for row in calibration.KNOWN_GOOD])
def test_known_good_production_layouts_are_not_refused_on_80_gb(name, args, gpus):
    assert calibration.fits(args, gpus)


def test_the_issues_281_gib_layout_now_fits():
    # Llama-3-70B at TP8 x PP8 on 80 GB was "no layout fits, 281 GiB" with s^2 scores kept.
    name, args, gpus = calibration.KNOWN_GOOD[0]
    assert calibration.estimate_gib(args, gpus) < 40


BASE = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
        "--ffn-hidden-size", "11008", "--seq-length", "8192", "--vocab-size", "32000",
        "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16",
        "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "4",
        "--hidden-dropout", "0", "--attention-dropout", "0"]


def memory(*extra, gpus=32, base=BASE):
    return calibration.estimate_gib([*base, *extra], gpus)


@pytest.mark.parametrize("extra, direction", [
    pytest.param(("--sequence-parallel",), "less", id="sequence-parallel-splits-layer-norms"),
    pytest.param(("--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"), "less", id="full-recompute"),
    pytest.param(("--recompute-granularity", "full", "--recompute-method", "block",
                  "--recompute-num-layers", "4"), "less", id="block-recompute"),
    pytest.param(("--use-distributed-optimizer",), "less", id="distributed-optimizer"),
    pytest.param(("--swiglu",), "more", id="swiglu-three-matrices"),
    pytest.param(("--group-query-attention", "--num-query-groups", "8"), "less", id="gqa"),
    pytest.param(("--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size", "1"),
                 "more", id="untied-output-layer-at-pp1"),
    pytest.param(("--context-parallel-size", "2"), "less", id="context-parallel"),
    pytest.param(("--num-layers-per-virtual-pipeline-stage", "1"), "more", id="interleaving-in-flight"),
    pytest.param(("--attention-backend", "unfused"), "more", id="unfused-keeps-s2-scores"),
    pytest.param(("--transformer-impl", "local"), "more", id="local-layers-attend-unfused"),
    pytest.param(("--attention-backend", "unfused", "--recompute-granularity", "selective"),
                 "same", id="selective-recompute-drops-the-scores"),
    pytest.param(("--fp8-format", "hybrid"), "less", id="fp8-gemm-inputs"),
    pytest.param(("--hidden-dropout", "0.1"), "more", id="dropout-masks"),
    pytest.param(("--use-distributed-optimizer", "--no-use-distributed-optimizer"), "same",
                 id="the-later-opt-out-wins"),
])
def test_each_flag_moves_the_estimate(extra, direction):
    before, after = memory(), memory(*extra)
    expected = {"less": after < before, "more": after > before, "same": after == before}
    assert expected[direction], (before, after)


def test_the_distributed_optimizer_shards_adam_over_dp_times_cp():
    # Per parameter: 2 (bf16) + 4 (fp32 gradient) + 12 (Adam) / (DP x CP) bytes.
    small = [*BASE[:-4], "--hidden-dropout", "0", "--attention-dropout", "0"]
    at_dp2 = memory("--use-distributed-optimizer", gpus=32, base=small)
    at_dp8 = memory("--use-distributed-optimizer", gpus=128, base=small)
    plain = memory(gpus=32, base=small)
    assert plain > at_dp2 > at_dp8


def test_optimizer_instances_hold_n_times_the_sharded_adam_state():
    # 12 bytes of Adam state per parameter over DP x CP / N: at DP 8 (128 GPUs, TP4 x PP4),
    # two instances hold what one holds at DP 4, and 8 instances what no sharding holds.
    small = [*BASE[:-4], "--hidden-dropout", "0", "--attention-dropout", "0",
             "--use-distributed-optimizer"]
    two = memory("--num-distributed-optimizer-instances", "2", gpus=128, base=small)
    assert two == pytest.approx(memory(gpus=64, base=small), rel=0.02)
    assert two > memory(gpus=128, base=small)
    full_replicas = memory("--num-distributed-optimizer-instances", "8", gpus=128, base=small)
    assert full_replicas > two


def test_the_first_stage_holds_pp_micro_batches_and_the_estimate_drops_them_with_few():
    # 1F1B keeps min(PP, micro-batches) in flight on the first stage (Megatron-LM's
    # theoretical_memory_usage.compute_activation_memory does the same).
    few = memory(gpus=32, base=[*BASE[:BASE.index("--global-batch-size")], "--global-batch-size",
                                "2", *BASE[BASE.index("--global-batch-size") + 2:]])
    assert few < memory()


def test_micro_batch_is_lowered_to_fit_and_plans_report_the_estimate():
    plan = plan_layout(["t.py", *BASE, "--micro-batch-size", "4"], 32, 8, gpu_memory_gb=24)
    assert plan.micro_batch_size < 4 and plan.estimated_memory_gib + 2.5 <= 24


def test_a_data_parallel_size_with_fewer_optimizer_instances_is_not_pruned():
    # One attention head and a prime layer count leave only TP1 x PP1. At DP 8 four instances
    # shard Adam over 2 ranks and micro-batch 1 needs ~29 GiB; at DP 5 no instance count
    # divides, so one instance shards it over 5 and ~21 GiB fits. DP 8 not fitting must not
    # end the search.
    args = ["t.py", "--num-layers", "31", "--hidden-size", "2560", "--num-attention-heads", "1",
            "--seq-length", "1024", "--micro-batch-size", "1", "--global-batch-size", "40",
            "--bf16", "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "4",
            "--recompute-granularity", "full", "--recompute-method", "uniform"]
    plan = plan_layout(args, 8, gpu_memory_gb=28)
    assert plan.data_parallel_size == 5 and plan.estimated_memory_gib + 2.5 <= 28


@pytest.mark.parametrize("tokenizer", [("--mock-data", "--vocab-size", "128"),
                                       ("--tokenizer-type", "NullTokenizer", "--vocab-size", "512"),
                                       ("--tokenizer-type", "ByteLevelTokenizer")])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_padded_vocabulary_is_the_one_the_trainer_builds(tokenizer, tp):
    """NullTokenizer's vocabulary is --vocab-size plus its end-of-document id (Megatron-LM's
    is too), the byte-level one's 257: the planner padded --vocab-size, or GPT-2's 50257."""
    import argparse

    from megatron.training.arguments import padded_vocab_size
    from megatron.training.tokenizer import build_tokenizer

    from ftmaster.recovery.memory_estimate import ASSUMED_VOCAB_SIZE
    from ftmaster.recovery.model_facts import read_model_shape

    args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", *tokenizer]
    kind = args[args.index("--tokenizer-type") + 1] if "--tokenizer-type" in args else "NullTokenizer"
    vocab = int(args[args.index("--vocab-size") + 1]) if "--vocab-size" in args else None
    trainer = padded_vocab_size(build_tokenizer(kind, vocab).vocab_size, argparse.Namespace(
        make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp))
    assert read_model_shape(args).padded_vocab_size(tp, ASSUMED_VOCAB_SIZE) == trainer
