"""Table tests for the recovery planner, the argv reader/rewriter and the torchrun argv."""

import pytest

from ftmaster.recovery.megatron_args import (ExpertShape, ModelShape, OriginalLayout,
                                             flag_value, read_script_args, resume_from_save,
                                             rewrite_argv)
from ftmaster.recovery.planner import Layout, PlanError, plan_layout
from ftmaster.recovery.torchrun import torchrun_argv


def train_args(layers=12, hidden=64, heads=4, tp=2, pp=2, mbs=2, gbs=8, extra=()):
    # A vocabulary of 512 is a multiple of 128 x TP for every TP here: Megatron's padding
    # of the vocabulary does not decide these rows.
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", "32",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
            "--vocab-size", "512", *extra]


GQA = ("--group-query-attention", "--num-query-groups", "2")


# (tp, pp, dp, micro-batch, GPUs used) expected for the surviving GPUs. These models are
# small (under 100M parameters), so the cost model compares compute share and pipeline bubble
# only (see cost_model), and ties go to the layout closest to the original.
@pytest.mark.parametrize("args, gpus, gpus_per_node, options, expected", [
    pytest.param(train_args(), 4, None, {"original_world_size": 4}, (2, 2, 1, 2, 4),
                 id="same-count-keeps-layout-hot-spare"),
    pytest.param(train_args(), 4, None, {}, (2, 1, 2, 2, 4),
                 id="original-unknown-no-bubble-beats-tp2pp2"),
    pytest.param(train_args(layers=12), 3, None, {"mode": "paper"}, (1, 3, 1, 2, 3),
                 id="4to3-layers-allow-pp3"),
    pytest.param(train_args(layers=12), 3, None, {}, (2, 1, 1, 2, 2),
                 id="4to3-pp3-last-stage-also-computes-logits-so-2-gpus-are-faster"),
    pytest.param(train_args(layers=8, gbs=12), 3, None, {}, (1, 1, 3, 2, 3),
                 id="4to3-layers-forbid-pp3"),
    pytest.param(train_args(layers=8, gbs=8), 3, None, {}, (2, 1, 1, 2, 2),
                 id="4to3-batch-not-divisible-by-dp3-uses-2-gpus"),
    pytest.param(train_args(tp=1, pp=1, mbs=4, gbs=12), 2, None, {}, (1, 1, 2, 3, 2),
                 id="micro-batch-lowered-to-divide-batch"),
    pytest.param(train_args(gbs=16), 7, None, {}, (2, 3, 1, 2, 6), id="prime-7-gpus"),
    pytest.param(train_args(gbs=16), 5, None, {}, (2, 1, 2, 2, 4),
                 id="prime-5-gpus-no-bubble-beats-tp2pp2"),
    pytest.param(train_args(heads=8, tp=1, pp=1, gbs=8), 8, None, {"mode": "paper"},
                 (8, 1, 1, 2, 8), id="paper-max-tp-by-heads"),
    pytest.param(train_args(heads=8, tp=1, pp=1, gbs=8, extra=GQA), 8, None, {"mode": "paper"},
                 (8, 1, 1, 2, 8), id="paper-2-query-groups-divide-tp8"),
    pytest.param(train_args(heads=8, tp=2, pp=1, gbs=8, extra=GQA), 4, None, {},
                 (2, 1, 2, 2, 4), id="closest-gqa"),
    pytest.param(train_args(tp=1, pp=1, gbs=8), 4, None, {"mode": "paper"}, (4, 1, 1, 2, 4),
                 id="paper-vs-closest-paper"),
    pytest.param(train_args(tp=1, pp=1, gbs=8), 4, None, {}, (1, 1, 4, 2, 4),
                 id="paper-vs-closest-closest"),
    pytest.param(train_args(tp=1, pp=1, gbs=8), 8, 2, {"mode": "paper"}, (2, 4, 1, 2, 8),
                 id="paper-keeps-node-limit"),
    pytest.param(train_args(layers=4, hidden=96, heads=12, tp=4, pp=1, mbs=1), 6, None, {},
                 (3, 1, 2, 1, 6), id="single-node-tp3-nearer-tp4-than-tp6"),
    pytest.param(train_args(layers=4, hidden=96, heads=12, tp=4, pp=1, mbs=1), 6, 4, {},
                 (4, 1, 1, 1, 4), id="tp-within-4-gpu-node"),
])
def test_plan_layout_table(args, gpus, gpus_per_node, options, expected):
    plan = plan_layout(["pretrain_gpt.py", *args], gpus, gpus_per_node, **options)
    assert (plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size,
            plan.data_parallel_size, plan.micro_batch_size, plan.num_gpus_used) == expected
    assert plan.global_batch_size == int(args[args.index("--global-batch-size") + 1])


def test_4_to_3_gpus_exact_command():
    args = train_args(extra=("--save", "/ckpt", "--lr", "1e-3"))
    plan = plan_layout(["pretrain_gpt.py", *args], gpus_available=3, mode="paper")
    assert plan.command == (
        "pretrain_gpt.py", "--num-layers", "12", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "3",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "512",
        "--save", "/ckpt", "--lr", "1e-3", "--load", "/ckpt")


# A 1.3B model (24 layers, hidden 2048) in fp32 without recomputation: 18 GiB of weights and
# Adam state unsplit, and 2.9 GiB of activations per sample.
BIG = ["pretrain_gpt.py", "--num-layers", "24", "--hidden-size", "2048",
       "--num-attention-heads", "16", "--seq-length", "2048", "--vocab-size", "50257",
       "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
       "--micro-batch-size", "4", "--global-batch-size", "16"]


@pytest.mark.parametrize("memory_gb, expected", [
    pytest.param(None, (1, 1, 2, 4), id="no-memory-limit"),
    pytest.param(40, (1, 1, 2, 4), id="fits-in-40"),
    pytest.param(30, (1, 1, 2, 2), id="memory-lowers-micro-batch"),
    pytest.param(25, (2, 1, 1, 4), id="memory-excludes-unsplit-model"),
    pytest.param(16, (2, 1, 1, 1), id="memory-lowers-micro-batch-of-the-split-model"),
])
def test_memory_estimate_excludes_layouts_that_do_not_fit(memory_gb, expected):
    plan = plan_layout(BIG, 2, gpu_memory_gb=memory_gb)
    assert (plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size,
            plan.data_parallel_size, plan.micro_batch_size) == expected
    assert memory_gb is None or plan.estimated_memory_gib + 2.5 <= memory_gb


@pytest.mark.parametrize("gpus, memory_gb, message", [
    pytest.param(2, 12, "no layout fits 2 GPUs in 12 GiB per GPU: the smallest memory estimate "
                        "is 12.19 GiB (+2.5 GiB reserve) at TP2 PP1 DP1 micro-batch 1 (16 "
                        "attention heads, 16 query groups, FFN 8192 allow TP in {1,2,4,8,16}); "
                        "add GPUs or memory per GPU", id="memory"),
    pytest.param(0, None, "no layout fits 0 GPUs: at least one GPU is needed", id="no-gpus"),
])
def test_nothing_fits_names_the_constraint(gpus, memory_gb, message):
    with pytest.raises(PlanError) as raised:
        plan_layout(BIG, gpus, gpu_memory_gb=memory_gb)
    assert str(raised.value) == message


def test_nothing_fits_because_of_a_rule_names_the_model_and_the_nodes():
    # --distribute-saved-activations needs TP > 1 (validate_args): one GPU cannot run it.
    with pytest.raises(PlanError, match=r"^no layout fits 1 GPUs: no split of the model "
                                        r"\(16 attention heads, .*\[1\]\)$"):
        plan_layout([*BIG, "--distribute-saved-activations"], 1)


@pytest.mark.parametrize("options, message", [
    ({"mode": "fastest"}, "mode must be one of closest, paper, got 'fastest'"),
    ({"gpus_per_node": 0}, "GPUs per node must be a positive integer, got 0"),
    ({"gpu_memory_gb": 0}, "GPU memory must be positive, got 0 GiB"),
    ({"global_batch_tolerance_pct": 60}, "the global batch tolerance must be within 0 and 50 "
                                         "percent, got 60"),
    ({"consumed_samples": -1}, "consumed samples cannot be negative, got -1"),
    ({"measured_step_s": 1.0}, "--measured-step-s 1 needs --original-gpus N, the GPU count that "
                               "step was measured on"),
])
def test_bad_planner_options(options, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        plan_layout(BIG, 4, **options)


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
    pytest.param(["--step-batch-size-schedule", "0:12 1M:24", "--micro-batch-size", "1"],
                 ["--step-batch-size-schedule", "0:12 1M:24", "--micro-batch-size", "3",
                  "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "3"],
                 id="never-a-global-batch-with-a-step-schedule"),
])
def test_rewrite_argv_exact(args, expected):
    assert rewrite_argv(args, Layout(1, 3, 1, 3, 12)) == expected


@pytest.mark.parametrize("args, layout, flag, expected", [
    pytest.param(["--num-layers", "12", "--num-layers-per-virtual-pipeline-stage", "1"],
                 Layout(1, 3, 1, 1, 12, virtual_pipeline_size=4),
                 "--num-layers-per-virtual-pipeline-stage", "1", id="vpp-chunk-still-valid"),
    pytest.param(["--num-layers", "12", "--num-layers-per-virtual-pipeline-stage", "1"],
                 Layout(1, 2, 1, 1, 12, virtual_pipeline_size=1),
                 "--num-layers-per-virtual-pipeline-stage", "6", id="vpp-turned-off"),
    pytest.param(["--num-layers", "12", "--num-virtual-stages-per-pipeline-rank", "4"],
                 Layout(1, 3, 1, 1, 12, virtual_pipeline_size=2),
                 "--num-virtual-stages-per-pipeline-rank", "2", id="vpp-degree-lowered"),
    pytest.param(["--num-layers", "12", "--decoder-first-pipeline-num-layers", "2",
                  "--decoder-last-pipeline-num-layers=2"], Layout(1, 1, 1, 1, 12),
                 "--decoder-last-pipeline-num-layers", None, id="uneven-stages-dropped-at-pp1"),
    pytest.param(["--num-layers", "12", "--decoder-first-pipeline-num-layers", "2"],
                 Layout(1, 2, 1, 1, 12), "--decoder-first-pipeline-num-layers", "2",
                 id="uneven-stages-kept-at-pp2"),
    pytest.param(["--num-layers", "12", "--context-parallel-size", "2"],
                 Layout(1, 1, 1, 1, 12, context_parallel_size=1),
                 "--context-parallel-size", "1", id="context-parallel-rewritten"),
    pytest.param(["--num-layers", "12"], Layout(1, 1, 1, 1, 12),
                 "--context-parallel-size", None, id="context-parallel-not-added"),
    pytest.param(["--num-layers", "12", "--eval-global-batch-size", "6"],
                 Layout(1, 1, 3, 1, 12, eval_micro_batch_size=2),
                 "--eval-micro-batch-size", "2", id="eval-micro-batch-added"),
    # A repeated store_true flag still counts one layer: (11 + 1) layers on the one stage.
    pytest.param(["--num-layers", "11", "--num-layers-per-virtual-pipeline-stage", "3",
                  "--account-for-embedding-in-pipeline-split",
                  "--account-for-embedding-in-pipeline-split"], Layout(1, 1, 1, 1, 12),
                 "--num-layers-per-virtual-pipeline-stage", "12", id="vpp-repeated-account-flag"),
])
def test_rewrite_argv_changes_only_what_the_layout_needs(args, layout, flag, expected):
    assert flag_value(rewrite_argv(args, layout), flag) == expected


@pytest.mark.parametrize("args, has_checkpoint, expected", [
    (["--load", "/base", "--save", "/run"], True, ["--load", "/run", "--save", "/run"]),
    (["--load=/base", "--save", "/run"], True, ["--load=/run", "--save", "/run"]),
    (["--load", "/base", "--save", "/run"], False, ["--load", "/base", "--save", "/run"]),
    (["--save", "/run"], True, ["--save", "/run", "--load", "/run"]),
    (["--load", "/base"], True, ["--load", "/base"]),  # nothing saved, nothing to resume
    # a fine-tune's flags for the weights it started from: the run's own Adam is its own
    (["--load", "/base", "--no-load-optim", "--save", "/run", "--no-load-rng"], True,
     ["--load", "/run", "--save", "/run"]),
    # Megatron-LM's fine-tune start: iteration 0, or a pinned step, of the weights it began from
    (["--load", "/base", "--finetune", "--ckpt-step", "5000", "--save", "/run"], True,
     ["--load", "/run", "--save", "/run"]),
    (["--load", "/base", "--ckpt-step=5000", "--save", "/run"], True, ["--load", "/run", "--save", "/run"]),
    (["--load", "/base", "--no-load-optim", "--save", "/run"], False,
     ["--load", "/base", "--no-load-optim", "--save", "/run"]),
    # resuming its own folder, the user asked for a fresh Adam: as given
    (["--load", "/run", "--no-load-optim", "--save", "/run"], True,
     ["--load", "/run", "--no-load-optim", "--save", "/run"]),
])
def test_a_relaunch_resumes_from_save_once_it_holds_a_checkpoint(args, has_checkpoint, expected):
    assert resume_from_save(args, has_checkpoint) == expected


@pytest.mark.parametrize("args, load_is_save, saved_there, expected", [
    # a rollback in place (--load X --save X --ckpt-step 500): once the run saved there, every
    # recovery reloaded iteration 500 and threw away what it had trained since
    (["--load", "/run", "--save", "/run", "--ckpt-step", "500"], False, True,
     ["--load", "/run", "--save", "/run"]),
    (["--load", "/run", "--save", "/run", "--ckpt-step", "500"], False, False,
     ["--load", "/run", "--save", "/run", "--ckpt-step", "500"]),
    # the same folder written otherwise: a fine-tune that failed before its first save
    # reloaded its starting weights with their optimizer and iteration count
    (["--load", "/run/", "--finetune", "--save", "/run"], True, False,
     ["--load", "/run/", "--finetune", "--save", "/run"]),
    (["--load", "/run/", "--finetune", "--save", "/run"], True, True,
     ["--load", "/run/", "--save", "/run"]),
])
def test_starting_flags_in_the_save_folder_go_once_the_run_saved_there(args, load_is_save,
                                                                       saved_there, expected):
    assert resume_from_save(args, True, load_is_save=load_is_save,
                            saved_there=saved_there) == expected


def test_rewrite_argv_refuses_flag_without_value():
    with pytest.raises(ValueError, match="^--micro-batch-size needs a value$"):
        rewrite_argv(["--micro-batch-size"], Layout(1, 1, 1, 1, 1))


def test_read_script_args_both_forms_and_defaults():
    facts = read_script_args(["--num-layers=4", "--hidden-size", "64",
                              "--num-attention-heads=8", "--seq-length", "16",
                              "--micro-batch-size", "2", "--group-query-attention",
                              "--num-query-groups=4", "--save", "/s", "--vocab-size", "100",
                              "--position-embedding-type", "rope"],
                             original_world_size=6)
    assert facts.shape == ModelShape(4, 64, 256, 8, 4, 16, 100)
    assert facts.original == OriginalLayout(1, 1, 2, 12)  # global batch = 2 x DP 6, derived
    assert (facts.global_batch_given, facts.save, facts.load) == (False, "/s", None)


def test_read_script_args_megatron_defaults_for_the_recipe_flags():
    facts = read_script_args(["--num-layers", "32", "--hidden-size", "4096",
                              "--num-attention-heads", "32", "--seq-length", "4096",
                              "--micro-batch-size", "1", "--global-batch-size", "8", "--swiglu",
                              "--kv-channels", "256", "--num-experts", "8",
                              "--moe-layer-freq", "([0]*1+[1]*31)", "--disable-bias-linear",
                              "--untie-embeddings-and-output-weights", "--context-parallel-size",
                              "2", "--expert-model-parallel-size", "4"])
    shape = facts.shape
    assert shape.ffn_hidden_size == 10880  # int((4 * 4096 * 2 / 3) / 64) * 64, validate_args
    assert (shape.head_size, shape.swiglu, shape.untied_embeddings, shape.linear_bias) == (256, True, True, False)
    assert shape.position_embeddings == 4096  # learned absolute by default: --max-position-embeddings = seq
    assert shape.experts == ExpertShape(8, 10880, 2, 0, 31)
    assert (facts.original.context_parallel_size, facts.original.expert_model_parallel_size,
            facts.original.expert_tensor_parallel_size) == (2, 4, None)


BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8"]


@pytest.mark.parametrize("args, message", [
    (BASE[2:], "the training arguments need --num-layers N"),
    (BASE + ["--hidden-size=abc"], "--hidden-size must be an integer, got 'abc'"),
    (BASE + ["--num-layers", "0"], "--num-layers must be a positive integer, got 0"),
    (BASE + ["--seq-length"], "--seq-length needs a value"),
    (BASE + ["--hidden-size", "60"],
     "hidden size 60 is not divisible by 8 attention heads (give --kv-channels)"),
    (BASE + ["--group-query-attention", "--num-query-groups", "3"],
     "8 attention heads are not divisible by 3 query groups"),
    (BASE[:-2], "--global-batch-size is absent, so it is --micro-batch-size 2 x the "
                "data-parallel size of the original launch: give --original-gpus N or add "
                "--global-batch-size"),
    (BASE + ["--step-batch-size-schedule", "0:8"],
     "cannot use both --step-batch-size-schedule and --global-batch-size (Megatron-LM refuses it)"),
    (BASE + ["--tensor-parallel-num-weight-shards", "2"],
     "--tensor-parallel-num-weight-shards is not supported by the planner: adds a weight-shard "
     "axis to the world size"),
    (BASE + ["--recompute-granularity", "full"],
     "--recompute-granularity full needs --recompute-method uniform or block (Megatron-LM "
     "refuses it otherwise)"),
    (BASE + ["--num-layers-per-virtual-pipeline-stage", "1", "--num-virtual-stages-per-pipeline-rank", "2"],
     "only one of --num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank "
     "and --pipeline-model-parallel-layout may be given (Megatron-LM refuses more)"),
    (BASE + ["--pipeline-model-parallel-layout", "Et|t|tL"],
     "--pipeline-model-parallel-layout has 3 decoder layers, --num-layers is 4"),
    (BASE + ["--pipeline-model-parallel-layout", "Et*99999999999|L"],
     "--pipeline-model-parallel-layout expands to more than 10^6 layers"),
    (BASE + ["--pipeline-model-parallel-layout", "E(t*1000|)*1000tL"],
     "--pipeline-model-parallel-layout expands to more than 10^6 layers"),
    (BASE + ["--pipeline-model-parallel-layout", "Et*" + "9" * 5000 + "|L"],
     "--pipeline-model-parallel-layout expands to more than 10^6 layers"),
    # float("inf") parses, then int() of it overflows: still a one-line ValueError.
    (BASE[:-2] + ["--step-batch-size-schedule", "0:8 inf:16"],
     "--step-batch-size-schedule has a bad number 'INF'"),
    (BASE[:-2] + ["--step-batch-size-schedule", "0:8 1e400:16"],
     "--step-batch-size-schedule has a bad number '1E400'"),
])
def test_read_script_args_errors(args, message):
    with pytest.raises(ValueError) as raised:
        read_script_args(args)
    assert str(raised.value) == message


def test_torchrun_argv():
    assert torchrun_argv(["pretrain_gpt.py", "--lr", "1"], 3, python="/py") == [
        "/py", "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--rdzv-conf", "",
        "--nproc-per-node", "3", "--max-restarts", "0", "pretrain_gpt.py", "--lr", "1"]
