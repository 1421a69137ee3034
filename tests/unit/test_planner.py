"""Table tests for the recovery planner, the argv reader/rewriter and the torchrun argv."""

import math

import pytest

from ftmaster.recovery.megatron_args import (ModelShape, OriginalLayout, read_script_args,
                                             resume_from_save, rewrite_argv)
from ftmaster.recovery.planner import (Layout, PlanError, choose_layout,
                                       estimate_bytes_per_gpu, plan_layout)
from ftmaster.recovery.torchrun import torchrun_argv


def train_args(layers=12, hidden=64, heads=4, tp=2, pp=2, mbs=2, gbs=8, extra=()):
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", "32",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), *extra]


GQA = ("--group-query-attention", "--num-query-groups", "2")


# (tp, pp, dp, micro-batch, GPUs used) expected for the surviving GPUs.
@pytest.mark.parametrize("args, gpus, gpus_per_node, mode, expected", [
    pytest.param(train_args(), 4, None, "closest", (2, 2, 1, 2, 4), id="same-count-keeps-layout"),
    pytest.param(train_args(layers=12), 3, None, "closest", (1, 3, 1, 2, 3),
                 id="4to3-tp2pp2-layers-allow-pp3"),
    pytest.param(train_args(layers=8, gbs=12), 3, None, "closest", (1, 1, 3, 2, 3),
                 id="4to3-tp2pp2-layers-forbid-pp3"),
    pytest.param(train_args(layers=8, gbs=8), 3, None, "closest", (2, 1, 1, 2, 2),
                 id="4to3-batch-not-divisible-by-dp3-uses-2-gpus"),
    pytest.param(train_args(tp=1, pp=1, mbs=4, gbs=12), 2, None, "closest", (1, 1, 2, 3, 2),
                 id="micro-batch-lowered-to-divide-batch"),
    pytest.param(train_args(gbs=16), 7, None, "closest", (2, 3, 1, 2, 6), id="prime-7-gpus"),
    pytest.param(train_args(gbs=16), 5, None, "closest", (2, 2, 1, 2, 4), id="prime-5-gpus"),
    pytest.param(train_args(heads=8, tp=1, pp=1, gbs=8), 8, None, "paper", (8, 1, 1, 2, 8),
                 id="paper-max-tp-by-heads"),
    pytest.param(train_args(heads=8, tp=1, pp=1, gbs=8, extra=GQA), 8, None, "paper",
                 (2, 4, 1, 2, 8), id="paper-query-groups-limit-tp-then-max-pp"),
    pytest.param(train_args(heads=8, tp=2, pp=1, gbs=8, extra=GQA), 4, None, "closest",
                 (2, 1, 2, 2, 4), id="closest-gqa"),
    pytest.param(train_args(tp=1, pp=1, gbs=8), 4, None, "paper", (4, 1, 1, 2, 4),
                 id="paper-vs-closest-paper"),
    pytest.param(train_args(tp=1, pp=1, gbs=8), 4, None, "closest", (1, 1, 4, 2, 4),
                 id="paper-vs-closest-closest"),
    pytest.param(train_args(tp=1, pp=1, gbs=8), 8, 2, "paper", (2, 4, 1, 2, 8),
                 id="paper-keeps-node-limit"),
    pytest.param(train_args(layers=4, hidden=96, heads=12, tp=4, pp=1, mbs=1), 6, None,
                 "closest", (3, 1, 2, 1, 6), id="single-node-tp3-nearer-tp4-than-tp6"),
    pytest.param(train_args(layers=4, hidden=96, heads=12, tp=4, pp=1, mbs=1), 6, 4,
                 "closest", (4, 1, 1, 1, 4), id="tp-within-4-gpu-node"),
])
def test_plan_layout_table(args, gpus, gpus_per_node, mode, expected):
    plan = plan_layout(["pretrain_gpt.py", *args], gpus, gpus_per_node, mode=mode)
    assert (plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size,
            plan.data_parallel_size, plan.micro_batch_size, plan.num_gpus_used) == expected
    assert plan.global_batch_size == int(args[args.index("--global-batch-size") + 1])


def test_4_to_3_gpus_exact_command():
    plan = plan_layout(["pretrain_gpt.py", *train_args(extra=("--save", "/ckpt", "--lr", "1e-3"))],
                       gpus_available=3)
    assert plan.command == (
        "pretrain_gpt.py", "--num-layers", "12", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "3",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--save", "/ckpt",
        "--lr", "1e-3", "--load", "/ckpt")


BIG = ModelShape(num_layers=24, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16,
                 num_query_groups=16, seq_length=2048, vocab_size=50257)
DATA_PARALLEL_ONLY = OriginalLayout(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                    micro_batch_size=4, global_batch_size=16)


@pytest.mark.parametrize("memory_gb, expected", [
    pytest.param(None, Layout(1, 1, 2, 4, 16), id="no-memory-limit"),
    pytest.param(40, Layout(1, 1, 2, 1, 16), id="memory-lowers-micro-batch"),
    pytest.param(30, Layout(2, 1, 1, 2, 16), id="memory-excludes-unsplit-model"),
])
def test_memory_estimate_excludes_small_layouts(memory_gb, expected):
    assert choose_layout(2, None, BIG, DATA_PARALLEL_ONLY, gpu_memory_gb=memory_gb) == expected


def test_memory_estimate_shrinks_with_model_parallelism():
    unsplit = estimate_bytes_per_gpu(BIG, 1, 1, 1, 4)
    assert estimate_bytes_per_gpu(BIG, 2, 1, 1, 4) < unsplit
    assert estimate_bytes_per_gpu(BIG, 1, 2, 1, 4) < unsplit
    assert estimate_bytes_per_gpu(BIG, 1, 1, 2, 4) > unsplit
    # 1.3 B parameters x 18 bytes dominate the unsplit estimate.
    assert math.isclose(unsplit / 2**30, 32.7, rel_tol=0.01)


@pytest.mark.parametrize("gpus, memory_gb, message", [
    pytest.param(2, 12, "no layout fits 2 GPUs in 12 GiB per GPU: the smallest memory estimate "
                        "is 16.87 GiB at TP2 PP1 DP1 micro-batch 1 (16 attention heads, "
                        "16 query groups, hidden 2048, FFN 8192 allow TP in {1,2,4,8,16}); "
                        "add GPUs or memory per GPU", id="memory"),
    pytest.param(0, None, "no layout fits 0 GPUs: at least one GPU is needed", id="no-gpus"),
])
def test_nothing_fits_names_the_constraint(gpus, memory_gb, message):
    with pytest.raises(PlanError) as raised:
        choose_layout(gpus, None, BIG, DATA_PARALLEL_ONLY, gpu_memory_gb=memory_gb)
    assert str(raised.value) == message


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "fastest"}, "mode must be one of closest, paper, got 'fastest'"),
    ({"gpus_per_node": 0}, "GPUs per node must be a positive integer, got 0"),
    ({"gpu_memory_gb": 0}, "GPU memory must be positive, got 0 GiB"),
])
def test_bad_planner_options(kwargs, message):
    options = {"gpus_per_node": None, **kwargs}
    with pytest.raises(ValueError, match=f"^{message}$"):
        choose_layout(4, options.pop("gpus_per_node"), BIG, DATA_PARALLEL_ONLY, **options)


@pytest.mark.parametrize("args, expected", [
    pytest.param(["--x", "1", "--tensor-model-parallel-size", "2", "--micro-batch-size=4",
                  "--pipeline-model-parallel-size=2", "--global-batch-size", "8"],
                 ["--x", "1", "--tensor-model-parallel-size", "1", "--micro-batch-size=3",
                  "--pipeline-model-parallel-size=3", "--global-batch-size", "8"],
                 id="in-place-both-forms"),
    pytest.param(["--mock-data", "--global-batch-size=8"],
                 ["--mock-data", "--global-batch-size=8", "--tensor-model-parallel-size", "1",
                  "--pipeline-model-parallel-size", "3", "--micro-batch-size", "3"],
                 id="absent-flags-appended"),
    pytest.param(["--micro-batch-size", "4", "--save", "/s"],
                 ["--micro-batch-size", "3", "--save", "/s", "--tensor-model-parallel-size",
                  "1", "--pipeline-model-parallel-size", "3", "--global-batch-size", "12",
                  "--load", "/s"], id="pin-derived-global-batch-and-load-save"),
    pytest.param(["--global-batch-size", "8", "--save=/s", "--load", "/other",
                  "--tensor-model-parallel-size", "2", "--tensor-model-parallel-size=4",
                  "--data-path", "a", "b", "--pipeline-model-parallel-size", "1",
                  "--micro-batch-size", "1"],
                 ["--global-batch-size", "8", "--save=/s", "--load", "/other",
                  "--tensor-model-parallel-size", "1", "--tensor-model-parallel-size=1",
                  "--data-path", "a", "b", "--pipeline-model-parallel-size", "3",
                  "--micro-batch-size", "3"], id="load-kept-repeats-rewritten"),
])
def test_rewrite_argv_exact(args, expected):
    assert rewrite_argv(args, Layout(1, 3, 1, 3, 12)) == expected


@pytest.mark.parametrize("args, has_checkpoint, expected", [
    (["--load", "/base", "--save", "/run"], True, ["--load", "/run", "--save", "/run"]),
    (["--load=/base", "--save", "/run"], True, ["--load=/run", "--save", "/run"]),
    (["--load", "/base", "--save", "/run"], False, ["--load", "/base", "--save", "/run"]),
    (["--save", "/run"], True, ["--save", "/run", "--load", "/run"]),
    (["--load", "/base"], True, ["--load", "/base"]),  # nothing saved, nothing to resume
])
def test_a_relaunch_resumes_from_save_once_it_holds_a_checkpoint(args, has_checkpoint, expected):
    assert resume_from_save(args, has_checkpoint) == expected


def test_rewrite_argv_refuses_flag_without_value():
    with pytest.raises(ValueError, match="^--micro-batch-size needs a value$"):
        rewrite_argv(["--micro-batch-size"], Layout(1, 1, 1, 1, 1))


def test_read_script_args_both_forms_and_defaults():
    facts = read_script_args(["--num-layers=4", "--hidden-size", "64",
                              "--num-attention-heads=8", "--seq-length", "16",
                              "--micro-batch-size", "2", "--group-query-attention",
                              "--num-query-groups=4", "--save", "/s", "--vocab-size", "100"],
                             original_world_size=6)
    assert facts.shape == ModelShape(4, 64, 256, 8, 4, 16, 100)
    assert facts.original == OriginalLayout(1, 1, 2, 12)  # global batch = 2 x DP 6, derived
    assert (facts.global_batch_given, facts.save, facts.load) == (False, "/s", None)


BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8"]


@pytest.mark.parametrize("args, message", [
    (BASE[2:], "the training arguments need --num-layers N"),
    (BASE + ["--hidden-size=abc"], "--hidden-size must be an integer, got 'abc'"),
    (BASE + ["--num-layers", "0"], "--num-layers must be a positive integer, got 0"),
    (BASE + ["--seq-length"], "--seq-length needs a value"),
    (BASE + ["--hidden-size", "60"], "hidden size 60 is not divisible by 8 attention heads"),
    (BASE + ["--group-query-attention"], "--group-query-attention needs --num-query-groups N"),
    (BASE + ["--group-query-attention", "--num-query-groups", "3"],
     "8 attention heads are not divisible by 3 query groups"),
    (BASE[:-2], "--global-batch-size is absent, so it is micro-batch x data-parallel size of "
                "the original launch: give the original GPU count or add --global-batch-size"),
])
def test_read_script_args_errors(args, message):
    with pytest.raises(ValueError) as raised:
        read_script_args(args)
    assert str(raised.value) == message


def test_torchrun_argv():
    assert torchrun_argv(["pretrain_gpt.py", "--lr", "1"], 3, python="/py") == [
        "/py", "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc-per-node", "3", "--max-restarts", "0", "pretrain_gpt.py", "--lr", "1"]
