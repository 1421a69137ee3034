"""Table tests, one per Megatron-LM layout rule, each citing the file and function it encodes.

Citations: NVIDIA/Megatron-LM main, commit d98e8a6 (August 2026); megatron-core 0.16.1 has
the same checks in the same functions.
"""


import pytest

from ftmaster.recovery.layout_rules import (ModelSplit, PipelineFlags, RuleFlags,
                                            context_sizes, data_parallel_allows,
                                            expert_sizes, interleaving_allows,
                                            optimizer_instances_for, parse_pipeline_layout,
                                            pipeline_split,
                                            sequence_parallel_allows, tensor_sizes)
from ftmaster.recovery.megatron_args import (ExpertShape, ModelShape, OriginalLayout, flag_value,
                                             read_script_args)
from ftmaster.recovery.planner import PlanError, plan_layout, plan_nodes
from test_planner_megatron_check import megatron_problems

ORIGINAL = OriginalLayout(1, 1, 1, 8)


def shape(**overrides):
    heads = overrides.get("num_attention_heads", 32)
    base = dict(num_layers=12, hidden_size=4096, ffn_hidden_size=16384, num_attention_heads=32,
                num_query_groups=heads, seq_length=4096)
    return ModelShape(**{**base, **overrides})


# -- tensor parallelism -----------------------------------------------------------------------

@pytest.mark.parametrize("model, rules, original, expected", [
    # transformer_config.py TransformerConfig.__post_init__: heads % TP.
    pytest.param(shape(num_attention_heads=12, hidden_size=768, ffn_hidden_size=3072), RuleFlags(),
                 ORIGINAL, [1, 2, 3, 4, 6, 12], id="heads-12"),
    # TransformerConfig.__post_init__: groups a multiple or a divisor of TP (StarCoder's MQA).
    # StarCoder's MQA: one group divides any TP; its QKV width 128*(48+2) = 6400 then
    # rules out 3, 6, 12, 24 and 48 (ColumnParallelLinear below).
    pytest.param(shape(num_attention_heads=48, hidden_size=6144, ffn_hidden_size=24576,
                       num_query_groups=1), RuleFlags(), ORIGINAL, [1, 2, 4, 8, 16],
                 id="mqa-1-group-divides-any-tp"),
    pytest.param(shape(num_query_groups=2, ffn_hidden_size=13696), RuleFlags(), ORIGINAL,
                 [1, 2, 4, 8, 16, 32], id="2-groups-divide-tp-4-to-32"),
    pytest.param(shape(num_query_groups=8, num_attention_heads=64, hidden_size=8192,
                       ffn_hidden_size=28672), RuleFlags(), ORIGINAL, [1, 2, 4, 8, 16, 32, 64],
                 id="8-groups-multiple-or-divisor"),
    # tensor_parallel/layers.py RowParallelLinear.__init__ divide(ffn, TP) for MLP.linear_fc2.
    pytest.param(shape(num_attention_heads=40, hidden_size=5120, ffn_hidden_size=13824),
                 RuleFlags(), ORIGINAL, [1, 2, 4, 8], id="llama2-13b-ffn-13824-forbids-tp5"),
    # ColumnParallelLinear.__init__ divide(kv*(heads+2*groups), TP) for SelfAttention.linear_qkv.
    pytest.param(shape(num_attention_heads=6, hidden_size=60, kv_channels=10, ffn_hidden_size=6,
                       num_query_groups=3), RuleFlags(), ORIGINAL, [1, 3, 6],
                 id="3-groups-forbid-tp2"),
    pytest.param(shape(num_attention_heads=4, hidden_size=12, kv_channels=3, ffn_hidden_size=12,
                       num_query_groups=1), RuleFlags(), ORIGINAL, [1, 2],
                 id="qkv-width-18-forbids-tp4"),
    # arguments.py validate_args: --distribute-saved-activations needs TP > 1.
    pytest.param(shape(), RuleFlags(distribute_saved_activations=True), ORIGINAL,
                 [2, 4, 8, 16, 32], id="distribute-saved-activations"),
    # validate_args: SP is switched off at TP 1, then --tp-comm-overlap asserts on it.
    pytest.param(shape(), RuleFlags(tp_comm_overlap=True), ORIGINAL, [2, 4, 8, 16, 32],
                 id="tp-comm-overlap"),
    # TransformerConfig.__post_init__: MoE with linear biases needs ETP == 1 (ETP follows TP).
    pytest.param(shape(experts=ExpertShape(8, 14336)), RuleFlags(), ORIGINAL, [1],
                 id="moe-bias-needs-etp1"),
    pytest.param(shape(experts=ExpertShape(8, 14336), linear_bias=False),
                 RuleFlags(sequence_parallel=True), ORIGINAL, [1, 2, 4, 8, 16, 32], id="moe-no-bias"),
    pytest.param(shape(experts=ExpertShape(8, 14336)), RuleFlags(sequence_parallel=True),
                 OriginalLayout(1, 1, 1, 8, expert_tensor_parallel_size=1), [1, 2, 4, 8, 16, 32],
                 id="moe-bias-explicit-etp1"),
    # megatron-core's MoELayer.forward raises in training at TP > 1 without SP: planned there,
    # every rank of every attempt failed at its first step
    pytest.param(shape(experts=ExpertShape(8, 14336), linear_bias=False), RuleFlags(), ORIGINAL,
                 [1], id="moe-without-sp-stays-tp1"),
])
def test_tensor_parallel_sizes(model, rules, original, expected):
    assert tensor_sizes(model, original, rules) == expected


def test_kv_channels_lets_hidden_not_divide_heads():
    # validate_args: hidden % heads is asserted only when --kv-channels is absent (Gemma-7B).
    with pytest.raises(ValueError, match="give --kv-channels"):
        shape(hidden_size=3000, num_attention_heads=16, ffn_hidden_size=24576)
    odd = shape(hidden_size=3000, num_attention_heads=16, ffn_hidden_size=24576, kv_channels=256)
    assert odd.head_size == 256 and tensor_sizes(odd, ORIGINAL, RuleFlags()) == [1, 2, 4, 8, 16]
    gemma = shape(hidden_size=3072, num_attention_heads=16, ffn_hidden_size=24576, kv_channels=256)
    assert gemma.head_size == 256  # not 3072 / 16 = 192


def test_swiglu_default_ffn_is_megatrons():
    # validate_args: int((4 * h * 2 / 3) / 64) * 64 without --ffn-hidden-size.
    plan = plan_layout(["t.py", "--num-layers", "2", "--hidden-size", "4096",
                        "--num-attention-heads", "32", "--seq-length", "64", "--micro-batch-size",
                        "1", "--global-batch-size", "8", "--swiglu", "--vocab-size", "512"], 1)
    assert plan.num_gpus_used == 1
    assert read_script_args(list(plan.command[1:])).shape.ffn_hidden_size == 10880


# -- pipelines ------------------------------------------------------------------------------

LAYERS_12 = shape()


@pytest.mark.parametrize("flags, pp, expected", [
    # validate_args / transformer_block.get_num_layers_to_build: layers % PP.
    pytest.param(PipelineFlags(), 3, (3, (4, 4, 4), 1), id="even"),
    pytest.param(PipelineFlags(), 5, None, id="12-layers-not-by-5"),
    # --account-for-embedding/loss-in-pipeline-split: (layers + 1 + 1) % PP; the embedding and
    # the loss take a layer's place on the first and last stage (get_num_layers_to_build).
    pytest.param(PipelineFlags(embedding_in_split=True, loss_in_split=True), 7, (7, (1, 2, 1), 1),
                 id="embedding-and-loss-in-split"),
    pytest.param(PipelineFlags(embedding_in_split=True, loss_in_split=True), 3, None,
                 id="14-not-by-3"),
    # --num-layers-per-virtual-pipeline-stage: VPP = layers per rank / N (validate_args).
    pytest.param(PipelineFlags(layers_per_virtual_stage=1), 3, (3, (4, 4, 4), 4), id="vpp-n-form"),
    pytest.param(PipelineFlags(layers_per_virtual_stage=3), 4, (4, (3, 3, 3), 1), id="vpp-n-is-a-rank"),
    pytest.param(PipelineFlags(layers_per_virtual_stage=4), 2, (2, (6, 6, 6), 2),
                 id="vpp-chunk-lowered-to-divide-6"),
    # validate_args: interleaving needs PP > 1, and PP > 2 with --no-overlap-p2p-communication.
    pytest.param(PipelineFlags(layers_per_virtual_stage=1), 2, (2, (6, 6, 6), 6), id="vpp-pp2-with-overlap"),
    pytest.param(PipelineFlags(layers_per_virtual_stage=1, p2p_overlap=False), 2, (2, (6, 6, 6), 1),
                 id="vpp-pp2-without-overlap-off"),
    pytest.param(PipelineFlags(layers_per_virtual_stage=1), 1, (1, (12, 12, 12), 1), id="vpp-pp1-off"),
    # --num-virtual-stages-per-pipeline-rank: VPP itself; layers per rank % VPP.
    pytest.param(PipelineFlags(virtual_stages_per_rank=4), 2, (2, (6, 6, 6), 3), id="vpp-v-lowered"),
    # TransformerConfig.__post_init__: uneven first/last stages; middle layers % middle stages.
    pytest.param(PipelineFlags(first_stage_layers=2, last_stage_layers=2), 3, (3, (2, 8, 2), 1),
                 id="uneven-3"),
    pytest.param(PipelineFlags(first_stage_layers=2, last_stage_layers=2), 4, (4, (2, 4, 2), 1),
                 id="uneven-4"),
    pytest.param(PipelineFlags(first_stage_layers=2, last_stage_layers=2), 5, None,
                 id="uneven-8-middle-not-by-3"),
    pytest.param(PipelineFlags(first_stage_layers=2, last_stage_layers=2), 2, None,
                 id="uneven-pp2-leaves-8-layers-without-a-stage"),
    pytest.param(PipelineFlags(first_stage_layers=2), 2, (2, (2, 10, 10), 1), id="uneven-first-only"),
    pytest.param(PipelineFlags(first_stage_layers=2, last_stage_layers=2), 1, (1, (12, 12, 12), 1),
                 id="uneven-flags-dropped-at-pp1"),
    pytest.param(PipelineFlags(first_stage_layers=2, last_stage_layers=4, virtual_stages_per_rank=2),
                 4, (4, (2, 3, 4), 1), id="uneven-vpp-off-when-middle-3-layers-odd"),
    pytest.param(PipelineFlags(first_stage_layers=2, last_stage_layers=2, virtual_stages_per_rank=2),
                 4, (4, (2, 4, 2), 2), id="uneven-vpp-2"),
    # PipelineParallelLayerLayout.__init__: stages % PP; VPP = stages / PP.
    pytest.param(PipelineFlags(layout=parse_pipeline_layout("Et*3|(t*3|)*2,t*3L")), 4,
                 (4, (3, 3, 3), 1), id="layout-4-stages-pp4"),
    pytest.param(PipelineFlags(layout=parse_pipeline_layout("Et*3|(t*3|)*2,t*3L")), 2,
                 (2, (6, 6, 6), 2), id="layout-4-stages-pp2-vpp2"),
    pytest.param(PipelineFlags(layout=parse_pipeline_layout("Et*3|(t*3|)*2,t*3L")), 3, None,
                 id="layout-4-stages-not-by-3"),
    pytest.param(PipelineFlags(layout=parse_pipeline_layout("Et*3|(t*3|)*2,t*3L")), 1, None,
                 id="layout-pp1-would-interleave-4"),
])
def test_pipeline_split(flags, pp, expected):
    split = pipeline_split(LAYERS_12, flags, pp)
    assert (None if split is None else (split.size, split.stage_layers, split.virtual_size)) == expected


@pytest.mark.parametrize("flags, pp, vpp, micro_batches, allowed", [
    # schedules.py forward_backward_pipelining_with_interleaving: group (default PP, from
    # model_parallel_config.py ModelParallelConfig.__post_init__) in [PP, M], and M % group
    # either 0 or at least PP.
    (PipelineFlags(), 4, 2, [8], True),
    (PipelineFlags(), 4, 2, [6], False),
    (PipelineFlags(), 4, 2, [2], False),
    (PipelineFlags(), 4, 1, [3], True),  # no interleaving: no rule
    (PipelineFlags(microbatch_group_size=5), 4, 2, [9], True),  # 9 % 5 = 4 >= PP
    (PipelineFlags(microbatch_group_size=5), 4, 2, [7], False),  # 7 % 5 = 2 < PP
    (PipelineFlags(microbatch_group_size=3), 4, 2, [12], False),  # group < PP
    (PipelineFlags(), 4, 2, [8, 6], False),  # evaluation's count too
])
def test_interleaved_schedule_micro_batches(flags, pp, vpp, micro_batches, allowed):
    assert interleaving_allows(flags, pp, vpp, micro_batches) is allowed


def test_plans_turn_interleaving_off_when_the_micro_batches_forbid_it():
    # One attention head: TP stays 1, so paper mode's "then the larger PP" picks the pipeline.
    args = ["t.py", "--num-layers", "12", "--hidden-size", "64", "--num-attention-heads", "1",
            "--seq-length", "32", "--vocab-size", "512", "--pipeline-model-parallel-size", "4",
            "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "1",
            "--global-batch-size", "12"]
    plan = plan_layout(args, 3, mode="paper")  # PP3: 12 micro-batches, 12 % 3 == 0: VPP 4
    assert (plan.pipeline_model_parallel_size, plan.virtual_pipeline_model_parallel_size) == (3, 4)
    plan = plan_layout([*args[:-1], "10"], 2, mode="paper")  # PP2 with 10: 10 % 2 == 0, VPP 6
    assert plan.virtual_pipeline_model_parallel_size == 6
    plan = plan_layout([*args[:-1], "9"], 3, mode="paper")  # 9 % 3 == 0 at PP3
    assert plan.virtual_pipeline_model_parallel_size == 4
    plan = plan_layout([*args[:-1], "10"], 4, mode="paper")  # PP4 needs M % 4: off, rewritten
    assert (plan.pipeline_model_parallel_size, plan.virtual_pipeline_model_parallel_size) == (4, None)
    assert flag_value(plan.command, "--num-layers-per-virtual-pipeline-stage") == "3"


# -- context, sequence and expert parallelism ------------------------------------------------

@pytest.mark.parametrize("model, original, rules, expected", [
    # validate_args: seq % (2 * CP) for CP > 1; never above the command's CP.
    (shape(seq_length=8192), OriginalLayout(1, 1, 1, 8, context_parallel_size=4), RuleFlags(), [1, 2, 4]),
    (shape(seq_length=4098), OriginalLayout(1, 1, 1, 8, context_parallel_size=2), RuleFlags(), [1]),
    (shape(seq_length=8192), OriginalLayout(1, 1, 1, 8), RuleFlags(), [1]),
    # validate_args: CP == prod(--hierarchical-context-parallel-sizes): CP stays.
    (shape(seq_length=8192), OriginalLayout(1, 1, 1, 8, context_parallel_size=4),
     RuleFlags(fixed_context_parallel=True), [4]),
])
def test_context_parallel_sizes(model, original, rules, expected):
    assert context_sizes(model, original, rules) == expected


@pytest.mark.parametrize("seq, tp, cp, sp, allowed", [
    # tensor_parallel/mappings.py _split_along_first_dim: with SP the embedding output's
    # sequence (seq / CP after the CP split) is split across TP.
    (4096, 8, 1, True, True), (4100, 8, 1, True, False), (4100, 8, 1, False, True),
    (4100, 1, 1, True, True),  # SP is off at TP 1 (validate_args)
    (8192, 8, 2, True, True), (4100, 4, 2, True, False),
])
def test_sequence_parallel_splits_the_sequence(seq, tp, cp, sp, allowed):
    assert sequence_parallel_allows(shape(seq_length=seq), RuleFlags(sequence_parallel=sp), tp, cp) is allowed


def test_data_parallel_size_is_reported_with_context_parallelism():
    # validate_args: DP = world / (TP * PP * CP).
    args = ["t.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--vocab-size", "512", "--context-parallel-size", "2",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--tensor-model-parallel-size", "2"]
    plan = plan_layout(args, 16, original_world_size=16)
    assert (plan.tensor_model_parallel_size, plan.context_parallel_size, plan.data_parallel_size,
            plan.num_gpus_used) == (2, 2, 4, 16)


MOE = shape(experts=ExpertShape(8, 14336), linear_bias=False)


@pytest.mark.parametrize("model, rules, expected", [
    # validate_args: experts % EP; EP > 1 needs experts (dense model: EP 1).
    (MOE, RuleFlags(), [1, 2, 4, 8]),
    (shape(), RuleFlags(), [1]),
    (MOE, RuleFlags(torch_fsdp2=True), [1]),  # validate_args: FSDP2 needs EP 1
])
def test_expert_parallel_sizes(model, rules, expected):
    assert expert_sizes(model, rules) == expected


@pytest.mark.parametrize("split, rules, dp, allowed", [
    # parallel_state.initialize_model_parallel: world % (ETP * EP * PP).
    (ModelSplit(2, 1, pipeline_split(LAYERS_12, PipelineFlags(), 2), expert=8, expert_tensor=2), RuleFlags(), 8, True),
    (ModelSplit(2, 1, pipeline_split(LAYERS_12, PipelineFlags(), 2), expert=8, expert_tensor=2), RuleFlags(), 4, False),
    (ModelSplit(1, 1, pipeline_split(LAYERS_12, PipelineFlags(), 1), expert=8, expert_tensor=1), RuleFlags(), 4, False),
    # The distributed-optimizer instances do not rule a DP out: a relaunch runs fewer.
    (ModelSplit(1, 1, pipeline_split(LAYERS_12, PipelineFlags(), 1)), RuleFlags(optimizer_instances=4), 2, True),
])
def test_data_parallel_rules(split, rules, dp, allowed):
    assert data_parallel_allows(split, rules, dp) is allowed


@pytest.mark.parametrize("split, asked, dp, instances", [
    # initialize_model_parallel: (DP * CP) and expert DP % --num-distributed-optimizer-instances.
    (ModelSplit(1, 2, pipeline_split(LAYERS_12, PipelineFlags(), 1)), 4, 2, 4),
    (ModelSplit(1, 1, pipeline_split(LAYERS_12, PipelineFlags(), 1)), 4, 2, 2),
    (ModelSplit(1, 1, pipeline_split(LAYERS_12, PipelineFlags(), 1)), 4, 6, 3),
    (ModelSplit(1, 1, pipeline_split(LAYERS_12, PipelineFlags(), 1)), 2, 3, 1),
    # expert DP = TP * CP * DP / (ETP * EP) = 4 * 2 / 8 = 1: one instance only
    (ModelSplit(4, 1, pipeline_split(LAYERS_12, PipelineFlags(), 1), expert=8, expert_tensor=1), 2, 2, 1),
])
def test_optimizer_instances_are_the_most_the_layout_allows(split, asked, dp, instances):
    assert optimizer_instances_for(split, RuleFlags(optimizer_instances=asked), dp) == instances


# -- batches ----------------------------------------------------------------------------------

SMALL = ["t.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "512"]


def test_eval_batches_follow_validate_args():
    # validate_args: eval_global_batch % (eval_micro_batch * DP); the eval micro-batch is
    # lowered (and written) when the new DP needs it, the eval global batch never changes.
    args = [*SMALL, "--micro-batch-size", "2", "--global-batch-size", "24",
            "--eval-global-batch-size", "12", "--eval-micro-batch-size", "4"]
    plan = plan_layout(args, 3, mode="paper")  # 3 GPUs: TP1 PP1 DP3
    assert plan.data_parallel_size == 3
    assert flag_value(plan.command, "--eval-micro-batch-size") == "4"  # 12 % (4 * 3) == 0
    plan = plan_layout(args, 6, mode="paper")
    assert flag_value(plan.command, "--eval-global-batch-size") == "12"
    eval_micro = int(flag_value(plan.command, "--eval-micro-batch-size"))
    assert 12 % (eval_micro * plan.data_parallel_size) == 0


def test_eval_global_batch_limits_data_parallelism():
    args = [*SMALL, "--micro-batch-size", "1", "--global-batch-size", "16", "--eval-global-batch-size", "4"]
    plan = plan_layout(args, 8, mode="paper")
    assert 4 % plan.data_parallel_size == 0


@pytest.mark.parametrize("consumed, batch, divisible_by", [
    # num_microbatches_calculator.py StepBatchsizeNumMicroBatchesCalculator: every batch still
    # to come must divide by micro-batch x DP; thresholds are tokens (seq 32: 3200 = 100 samples).
    (None, 6, 6), (100, 12, 12), (150, 12, 12),
])
def test_step_schedule_batches_from_the_resume_point(consumed, batch, divisible_by):
    args = [*SMALL, "--micro-batch-size", "1", "--step-batch-size-schedule", "0:6 3200:12"]
    plan = plan_layout(args, 12, mode="paper", consumed_samples=consumed)
    assert plan.global_batch_size == batch
    assert divisible_by % plan.data_parallel_size == 0
    assert "--global-batch-size" not in plan.command  # validate_args forbids it with a schedule


def test_with_a_step_schedule_the_eval_batch_is_micro_batch_times_dp():
    # validate_args: the eval global batch defaults to the global batch, which with a schedule
    # (no --global-batch-size allowed) is micro-batch x DP, not the scheduled batch. At DP 4
    # the micro-batch falls to 3: eval global 12 is not divisible by eval micro 2 x DP 4.
    args = [*SMALL, "--micro-batch-size", "4", "--eval-micro-batch-size", "2",
            "--step-batch-size-schedule", "0:24"]
    plan = plan_layout(args, 4)
    assert (plan.data_parallel_size, plan.micro_batch_size) == (4, 3)
    eval_micro = int(flag_value(plan.command, "--eval-micro-batch-size"))
    assert (plan.micro_batch_size * plan.data_parallel_size) % (eval_micro * plan.data_parallel_size) == 0


def test_tolerance_is_not_applied_with_a_step_schedule():
    args = [*SMALL, "--micro-batch-size", "1", "--step-batch-size-schedule", "0:7"]
    plan = plan_layout(args, 6, global_batch_tolerance_pct=20)
    assert plan.global_batch_size == 7 and plan.data_parallel_size == 1
    assert "--global-batch-tolerance is not applied with --step-batch-size-schedule" in plan.warnings


# -- flags that forbid pipelines --------------------------------------------------------------

@pytest.mark.parametrize("flag, gpus, pp_allowed", [
    ("--use-torch-fsdp2", 4, {1}),  # validate_args: FSDP2 needs PP 1
    ("--cpu-offloading", 4, {1}),  # TransformerConfig.__post_init__: no PP with CPU offloading
    ("--hybrid-context-parallel", 4, {1}),  # validate_args
    ("--defer-embedding-wgrad-compute", 4, {2, 4}),  # ModelParallelConfig.__post_init__: PP > 1
])
def test_flags_that_constrain_the_pipeline(flag, gpus, pp_allowed):
    args = [*SMALL, "--micro-batch-size", "1", "--global-batch-size", "4", flag]
    for mode in ("closest", "paper"):
        assert plan_layout(args, gpus, mode=mode).pipeline_model_parallel_size in pp_allowed


def test_torch_dcp_checkpoints_keep_tp_and_pp_at_1():
    # validate_args: --ckpt-format torch_dcp asserts TP <= 1 and PP <= 1. At 6 GPUs and
    # global batch 64, TP3 x DP2 would use them all; TP1 x DP4 is what Megatron-LM runs.
    args = ["t.py", "--num-layers", "4", "--hidden-size", "768", "--num-attention-heads", "12",
            "--seq-length", "1024", "--vocab-size", "512", "--micro-batch-size", "4",
            "--global-batch-size", "64", "--use-torch-fsdp2", "--ckpt-format=torch_dcp",
            "--untie-embeddings-and-output-weights"]
    for mode in ("closest", "paper"):
        plan = plan_layout(args, 6, mode=mode)
        assert (plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size) == (1, 1)


def test_overlapping_the_param_gather_with_the_optimizer_step_keeps_interleaving():
    # validate_args: --overlap-param-gather-with-optimizer-step asserts a virtual pipeline.
    args = ["t.py", "--num-layers", "8", "--hidden-size", "768", "--num-attention-heads", "12",
            "--seq-length", "1024", "--vocab-size", "512", "--micro-batch-size", "1",
            "--global-batch-size", "64", "--pipeline-model-parallel-size", "2",
            "--num-layers-per-virtual-pipeline-stage", "2", "--use-distributed-optimizer",
            "--overlap-grad-reduce", "--overlap-param-gather",
            "--overlap-param-gather-with-optimizer-step"]
    for gpus in (3, 8):
        for mode in ("closest", "paper"):
            plan = plan_layout(args, gpus, mode=mode)
            assert (plan.virtual_pipeline_model_parallel_size or 1) > 1, (gpus, mode)
    with pytest.raises(PlanError):
        plan_layout(args, 1)  # no pipeline at all


def test_overlapping_p2p_in_warmup_and_flush_keeps_interleaving():
    # validate_args switches the p2p overlap off without interleaving, and
    # ModelParallelConfig.__post_init__ then refuses --overlap-p2p-communication-warmup-flush.
    args = [*SMALL[:2], "8", *SMALL[3:], "--micro-batch-size", "1", "--global-batch-size", "8",
            "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
            "--overlap-p2p-communication-warmup-flush"]
    for gpus in (2, 3):
        for mode in ("closest", "paper"):
            plan = plan_layout(args, gpus, original_world_size=2, mode=mode)
            assert (plan.virtual_pipeline_model_parallel_size or 1) > 1, (gpus, mode)
    with pytest.raises(PlanError):
        plan_layout(args, 1, original_world_size=2)


def test_a_legacy_torch_checkpoint_keeps_tp_pp_and_ep():
    # checkpointing.py check_checkpoint_args: without a distributed checkpoint TP and PP are
    # compared with the checkpoint's. TP2 x PP2 on 7 of 8 GPUs was planned as TP2 x PP1 x DP2.
    args = [*SMALL[:2], "8", *SMALL[3:], "--micro-batch-size", "1", "--global-batch-size", "8",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--ckpt-format", "torch"]
    for gpus in (7, 4):
        for mode in ("closest", "paper"):
            plan = plan_layout(args, gpus, original_world_size=8, mode=mode)
            assert (plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size) == (2, 2)
    with pytest.raises(PlanError):
        plan_layout(args, 3, original_world_size=8)
    assert plan_layout([*args[:-1], "torch_dist"], 3, original_world_size=8).num_gpus_used >= 2


MOE_SMALL = [*SMALL, "--micro-batch-size", "1", "--global-batch-size", "12", "--num-experts", "8"]


@pytest.mark.parametrize("backend, expert_split_needed", [
    ((), True), (("--moe-flex-dispatcher-backend", "deepep"), True),
    (("--moe-flex-dispatcher-backend", "ncclep"), True),
    (("--moe-flex-dispatcher-backend", "hybridep"), False)])
def test_the_flex_dispatcher_needs_expert_parallelism(backend, expert_split_needed):
    # token_dispatcher.py MoEFlexTokenDispatcher: the deepep (default) and ncclep backends
    # assert ETP x EP > 1. On 3 GPUs EP 1 x DP 3 was planned; EP 2 on 2 GPUs runs.
    args = [*MOE_SMALL, "--moe-token-dispatcher-type", "flex",
            "--expert-model-parallel-size", "4", *backend]
    plan = plan_layout(args, 3, original_world_size=4)
    assert (plan.expert_model_parallel_size > 1) == expert_split_needed, plan


@pytest.mark.parametrize("pipeline, gpus", [((), 3), ((), 5), (("--pipeline-model-parallel-size",
                          "2", "--num-virtual-stages-per-pipeline-rank", "2"), 7)])
def test_the_expert_all_to_all_overlap_needs_expert_parallelism_and_interleaving(pipeline, gpus):
    # TransformerConfig.__post_init__: --overlap-moe-expert-parallel-comm asserts EP > 1, and a
    # virtual pipeline at PP > 1. On 3 of 8 GPUs EP 1 x DP 3 was planned.
    args = [*SMALL, "--micro-batch-size", "1", "--global-batch-size", "24",
            "--num-experts", "8", "--moe-token-dispatcher-type", "alltoall",
            "--overlap-moe-expert-parallel-comm", "--disable-bias-linear",
            "--expert-model-parallel-size", "4", *pipeline]
    for mode in ("closest", "paper"):
        plan = plan_layout(args, gpus, original_world_size=8, mode=mode)
        assert megatron_problems(list(plan.command[1:]), plan.num_gpus_used) == [], (mode, plan)
        assert plan.expert_model_parallel_size > 1


def test_every_batch_still_to_come_in_a_step_schedule_runs_the_interleaved_schedule():
    # schedules.py forward_backward_pipelining_with_interleaving: M % PP is 0 or at least PP
    # for the later batch too. On 3 of 4 GPUs PP 3 x VPP 2 was planned: 12 micro-batches
    # pass, the schedule's 16 raise after 1M samples.
    args = ["t.py", "--num-layers", "12", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "1024", "--vocab-size", "32000", "--pipeline-model-parallel-size", "4",
            "--num-virtual-stages-per-pipeline-rank", "3", "--micro-batch-size", "1",
            "--step-batch-size-schedule", "0:12 1M:16", "--eval-global-batch-size", "12",
            "--train-samples", "100000"]
    for mode in ("closest", "paper"):
        plan = plan_nodes(args, (3,), original_world_size=4, consumed_samples=0, mode=mode)
        assert megatron_problems(list(plan.command[1:]), plan.num_gpus_used) == [], (mode, plan)


SCHEDULED = ["t.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "1",
             "--step-batch-size-schedule", "0:24 1M:48", "--train-iters", "1000"]


@pytest.mark.parametrize("extra, gpus, added", [
    ((), 6, True),  # micro-batch x DP 8 -> 6: lr_decay_steps 8000 -> 6000 fails the load
    ((), 8, False),  # the original layout: the same steps
    (("--override-opt-param-scheduler",), 6, False),  # the command chose
    (("--use-checkpoint-opt-param-scheduler",), 6, False),
])
def test_a_step_schedule_in_iterations_keeps_the_checkpoints_lr_schedule_on_another_dp(
        extra, gpus, added):
    # validate_args sets the global batch to micro-batch x DP under a step schedule, and
    # get_optimizer_param_scheduler multiplies --train-iters and --lr-decay-iters by it:
    # OptimizerParamScheduler._check_and_set then refused the relaunch's load.
    plan = plan_nodes([*SCHEDULED, *extra], (gpus,), original_world_size=8, consumed_samples=0)
    assert plan.command.count("--use-checkpoint-opt-param-scheduler") == (
        1 if added or "--use-checkpoint-opt-param-scheduler" in extra else 0)
    assert any("--use-checkpoint-opt-param-scheduler added" in w for w in plan.warnings) == added
    samples = ["t.py", *SCHEDULED[1:-2], "--train-samples", "24000"]  # counted in samples
    assert "--use-checkpoint-opt-param-scheduler" not in plan_nodes(
        samples, (gpus,), original_world_size=8, consumed_samples=0).command


def test_hybrid_context_parallel_needs_an_even_dp_x_cp():
    # parallel_state.py initialize_model_parallel asserts an even DP x CP group.
    args = [*SMALL, "--micro-batch-size", "1", "--global-batch-size", "12",
            "--hybrid-context-parallel", "--calculate-per-token-loss"]
    plan = plan_layout(args, 3, original_world_size=4)
    assert plan.data_parallel_size % 2 == 0, plan


def test_the_tp_pp_dp_order_keeps_the_expert_dp_equal_to_dp():
    # initialize.py orders tp-cp-ep-pp-dp under --use-tp-pp-dp-mapping, and
    # initialize_model_parallel then asserts expert DP == DP at PP > 1: ETP x EP == TP x CP.
    args = ["t.py", "--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "8",
            "--seq-length", "64", "--vocab-size", "100", "--micro-batch-size", "1",
            "--global-batch-size", "12", "--num-experts", "4", "--expert-model-parallel-size", "4",
            "--expert-tensor-parallel-size", "1", "--tensor-model-parallel-size", "4",
            "--pipeline-model-parallel-size", "2", "--sequence-parallel", "--disable-bias-linear",
            "--use-tp-pp-dp-mapping"]
    for gpus in (8, 7, 6, 5, 4):
        for mode in ("closest", "paper"):
            plan = plan_layout(args, gpus, original_world_size=8, mode=mode)
            if plan.pipeline_model_parallel_size > 1:
                assert plan.expert_model_parallel_size == (
                    plan.tensor_model_parallel_size * plan.context_parallel_size), (gpus, mode, plan)


def test_tolerance_is_not_applied_with_phase_transitions():
    # checkpointing.py check_checkpoint_args compares the global batch with the checkpoint's
    # under --phase-transition-iterations.
    args = [*SMALL, "--micro-batch-size", "1", "--global-batch-size", "8",
            "--phase-transition-iterations", "100"]
    plan = plan_layout(args, 6, original_world_size=8, global_batch_tolerance_pct=20)
    assert plan.global_batch_size == 8
    assert any(w.startswith("--global-batch-tolerance is not applied with "
                            "--phase-transition-iterations") for w in plan.warnings)


# -- flags the planner does not model ----------------------------------------------------------

@pytest.mark.parametrize("flag, warning", [
    (("--rampup-batch-size", "16", "8", "1000"), "--rampup-batch-size: the ramp's intermediate batch sizes are not checked"),
    (("--multi-latent-attention",), "--multi-latent-attention: MLA's own divisibility rules and memory are not modelled"),
    (("--mtp-num-layers", "1"), "--mtp-num-layers: multi-token-prediction layers are not placed"),
    (("--cp-comm-type", "a2a"), "--cp-comm-type: TransformerEngine's head rule"),
])
def test_unmodelled_flags_are_named_in_a_warning(flag, warning):
    plan = plan_layout([*SMALL, "--micro-batch-size", "1", "--global-batch-size", "4", *flag], 2)
    assert any(w.startswith(warning) for w in plan.warnings), plan.warnings


def test_memory_only_flags_are_named_when_memory_is_checked():
    args = [*SMALL, "--micro-batch-size", "1", "--global-batch-size", "4", "--use-precision-aware-optimizer"]
    assert plan_layout(args, 2).warnings == ()
    assert plan_layout(args, 2, gpu_memory_gb=80).warnings == (
        "--use-precision-aware-optimizer: its effect on memory is not modelled by the estimate",)


def test_a_vocabulary_the_command_does_not_give_is_named_when_memory_is_checked():
    """A tokenizer file (Llama-3's 128256 tokens) was estimated as GPT-2's, GiBs short."""
    args = [*SMALL[:-2], "--micro-batch-size", "1", "--global-batch-size", "4",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/models/llama3"]
    assert plan_layout(args, 2).warnings == ()
    assert plan_layout(args, 2, gpu_memory_gb=80).warnings == (
        "the vocabulary size is not known from the command (a tokenizer file): the memory "
        "estimate assumes 50257 tokens; give --vocab-size for the tokenizer's own",)


@pytest.mark.parametrize("flag", ["--tensor-parallel-num-weight-shards", "--hybrid-layer-pattern",
                                  "--encoder-num-layers", "--use-mp-args-from-checkpoint-args"])
def test_flags_that_could_invalidate_a_plan_are_refused_in_one_line(flag):
    with pytest.raises(ValueError, match=f"^{flag} is not supported by the planner: [^\n]+$"):
        plan_nodes([*SMALL, "--micro-batch-size", "1", "--global-batch-size", "4", flag, "2"], [2])


# -- the partial distributed optimizer ---------------------------------------------------------

@pytest.mark.parametrize("gpus, instances, kept", [(4, 4, 4), (4, 2, 2), (3, 4, 3), (3, 2, 1),
                                                    (6, 4, 3), (2, 4, 2)])
def test_a_relaunch_keeps_the_optimizer_instances_when_dp_allows_else_the_most_it_allows(
        gpus, instances, kept):
    args = [*SMALL, "--micro-batch-size", "1", "--global-batch-size", "12",
            "--use-distributed-optimizer", "--num-distributed-optimizer-instances", str(instances)]
    plan = plan_layout(args, gpus, original_world_size=8)  # was DP 8: TP 1 stays
    assert plan.data_parallel_size == gpus
    command = list(plan.command)
    assert command[command.index("--num-distributed-optimizer-instances") + 1] == str(kept)
    said = (f"--num-distributed-optimizer-instances {instances} does not divide the new layout's "
            f"data-parallel size: the relaunch runs {kept}")
    assert (said in plan.warnings) == (kept != instances), plan.warnings


def test_uniform_recompute_groups_tile_every_pipeline_chunk():
    # transformer_block.py _checkpointed_forward (uniform) walks each chunk in groups of
    # --recompute-num-layers from its first layer: a chunk they do not tile indexes past its
    # last layer (IndexError in the first forward). 12 layers in groups of 3: PP 2 (6 a
    # stage) and PP 4 (3) tile; PP 3 (4 a stage) and PP 6 (2) do not.
    args = [*SMALL[:1], "--num-layers", "12", *SMALL[3:], "--micro-batch-size", "1",
            "--global-batch-size", "12", "--recompute-granularity", "full",
            "--recompute-method", "uniform", "--recompute-num-layers", "3"]
    for gpus in range(1, 13):
        for mode in ("closest", "paper"):
            plan = plan_layout(args, gpus, mode=mode)
            chunk = 12 // plan.pipeline_model_parallel_size // (
                plan.virtual_pipeline_model_parallel_size or 1)
            assert chunk % 3 == 0, (gpus, mode, plan.pipeline_model_parallel_size)


@pytest.mark.parametrize("flag", ["--num-virtual-stages-per-pipeline-rank",
                                  "--num-layers-per-virtual-pipeline-stage",
                                  "--num-distributed-optimizer-instances"])
@pytest.mark.timeout(20)  # it plans in milliseconds; before, it hung
def test_a_huge_count_is_capped_by_what_divides_not_searched_one_by_one(flag):
    # Each of these asks for the largest divisor up to the flag's value; counting up to a
    # mistyped 10^12 hung the planner.
    args = ["x.py", "--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
            "--seq-length", "512", "--micro-batch-size", "1", "--global-batch-size", "16",
            "--pipeline-model-parallel-size", "2", flag, "999999999999"]
    plan = plan_layout(args, 8)
    assert plan.num_gpus_used == 8
