"""Megatron-LM's layout rules, one function per rule, each citing where Megatron encodes it.

Citations are to NVIDIA/Megatron-LM ``main`` at commit d98e8a6 (August 2026); megatron-core
0.16.1 (installed here) has the same rules in the same functions. A layout is valid when all
of these hold:

===========================  =====================================================================
rule                         where Megatron-LM checks it
===========================  =====================================================================
world % (TP*PP*CP) == 0,     megatron/training/arguments.py ``validate_args``;
DP = world / (TP*PP*CP)      megatron/core/parallel_state.py ``initialize_model_parallel``
heads % TP == 0              megatron/core/transformer/transformer_config.py ``TransformerConfig.__post_init__``
query groups a multiple      ``TransformerConfig.__post_init__`` ("must be a multiple or divisor");
or a divisor of TP           megatron/core/transformer/attention.py ``Attention.__init__`` (groups < TP)
kv*(heads+2*groups) % TP     megatron/core/tensor_parallel/layers.py ``ColumnParallelLinear.__init__``
                             (``divide(output_size, world_size)``) for ``SelfAttention.linear_qkv``
ffn % TP == 0                ``RowParallelLinear.__init__`` (``divide(input_size, world_size)``)
                             for ``MLP.linear_fc2``
hidden % heads (no           ``validate_args`` (only when ``--kv-channels`` is absent)
--kv-channels)
swiglu default ffn           ``validate_args``: ``int((4*h*2/3)/64)*64``
layers % PP (with            ``validate_args``; megatron/core/transformer/transformer_block.py
embedding/loss in split)     ``get_num_layers_to_build``
virtual pipeline degree      ``validate_args`` (``--num-layers-per-virtual-pipeline-stage``,
                             ``--num-virtual-stages-per-pipeline-rank``, PP > 1, PP > 2 without
                             p2p overlap); ``get_num_layers_to_build`` (per-rank layers % VPP)
uneven first/last stages     ``TransformerConfig.__post_init__`` (middle layers % middle stages,
                             first/last % VPP, no account-for-* with them)
--pipeline-model-parallel-   ``validate_args``; megatron/core/transformer/pipeline_parallel_layer_layout.py
layout                       ``PipelineParallelLayerLayout.__init__`` (stages % PP, VPP = stages/PP)
interleaved micro-batches    megatron/core/pipeline_parallel/schedules.py
                             ``forward_backward_pipelining_with_interleaving``; group size default
                             PP in megatron/core/model_parallel_config.py ``ModelParallelConfig.__post_init__``
global % (micro * DP)        megatron/core/num_microbatches_calculator.py ``ConstantNumMicroBatchesCalculator``
eval global % (eval micro    ``validate_args``
* DP)
step schedule batches        ``StepBatchsizeNumMicroBatchesCalculator.update`` (consistency check),
                             ``validate_args`` (never with ``--global-batch-size``)
seq % (2*CP) for CP > 1      ``validate_args``
(seq/CP) % TP with SP        megatron/core/tensor_parallel/mappings.py ``_split_along_first_dim``
                             (``scatter_to_sequence_parallel_region`` of the embedding)
experts % EP, EP needs MoE   ``validate_args``; megatron/core/transformer/moe/moe_layer.py ``BaseMoELayer``
world % (ETP*EP*PP)          ``initialize_model_parallel``
moe ffn % ETP                ``ColumnParallelLinear``/``RowParallelLinear`` over the expert-TP group
MoE bias needs ETP == 1      ``TransformerConfig.__post_init__``
(DP*CP) % dist-opt           ``initialize_model_parallel`` (``--num-distributed-optimizer-instances``);
instances, expert DP too     a relaunch lowers the instances to the most the new layout allows
--distribute-saved-          ``validate_args``: TP > 1
activations
--tp-comm-overlap            ``validate_args``: SP is switched off at TP 1, then the overlap asserts
--use-torch-fsdp2            ``validate_args``: PP == 1 and EP == 1
--ckpt-format torch_dcp      ``validate_args``: TP == 1 and PP == 1
--ckpt-format torch          megatron/training/checkpointing.py ``check_checkpoint_args``: without
                             a distributed checkpoint TP and PP must be the checkpoint's; its
                             ``mp_rank_*`` folders name EP too, and its ``model<i>`` keys the
                             virtual stages (all four are kept)
--overlap-param-gather-      ``validate_args``: VPP > 1 (interleaving is kept on)
with-optimizer-step
--overlap-p2p-communication- ``validate_args`` switches the p2p overlap off without interleaving, then
warmup-flush                 ``ModelParallelConfig.__post_init__`` raises (interleaving is kept on)
--recompute-method uniform   megatron-core 0.16's transformer_block.py ``_checkpointed_forward``:
                             groups of --recompute-num-layers tile each chunk (else IndexError).
                             Megatron-LM's main branch clamps the last group (megatron/core/
                             recompute.py); kept, since which core an upstream script runs is not
                             known from its command
--moe-token-dispatcher-type  megatron/core/transformer/moe/token_dispatcher.py ``MoEFlexTokenDispatcher``:
flex                         ETP x EP > 1 with the deepep (default) and ncclep backends
--use-tp-pp-dp-mapping       ``initialize_model_parallel``: with the order tp-cp-ep-pp-dp and PP > 1
                             the expert data-parallel size must equal DP (ETP x EP == TP x CP)
--cpu-offloading             ``TransformerConfig.__post_init__``: PP == 1
--overlap-moe-expert-        ``TransformerConfig.__post_init__``: EP > 1, and VPP > 1 at PP > 1
parallel-comm                (interleaving is kept on)
--defer-embedding-wgrad-     ``ModelParallelConfig.__post_init__``: PP > 1
compute
--hybrid-context-parallel    ``validate_args``: PP == 1; ``initialize_model_parallel``: DP x CP even
--hierarchical-context-      ``validate_args``: CP == product of the sizes (CP is then kept)
parallel-sizes
===========================  =====================================================================

The planner adds one rule of its own: TP groups stay inside a node (each node runs a
multiple of TP ranks, and Megatron's rank order puts TP innermost, so groups never straddle).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

from .argv_flags import flag_present, flag_value, int_flag
from .model_facts import ModelShape, OriginalLayout

FIRST_STAGE_FLAG = "--decoder-first-pipeline-num-layers"
LAST_STAGE_FLAG = "--decoder-last-pipeline-num-layers"
LAYERS_PER_VIRTUAL_STAGE_FLAG = "--num-layers-per-virtual-pipeline-stage"
VIRTUAL_STAGES_FLAG = "--num-virtual-stages-per-pipeline-rank"
PIPELINE_LAYOUT_FLAG = "--pipeline-model-parallel-layout"

# Flags whose rules the planner does not model and that can make a layout invalid: refused,
# because a plan that Megatron then rejects is a failed recovery.
REFUSED_FLAGS = {
    "--tensor-parallel-num-weight-shards": "adds a weight-shard axis to the world size",
    "--expert-tensor-parallel-num-weight-shards": "adds a weight-shard axis to the expert grid",
    "--hybrid-layer-pattern": "hybrid (Mamba) models have their own pipeline segments",
    "--hybrid-override-pattern": "hybrid (Mamba) models have their own pipeline segments",
    "--encoder-num-layers": "encoder-decoder models are not planned",
    "--decoder-num-layers": "encoder-decoder models are not planned",
    "--use-mp-args-from-checkpoint-args": "Megatron-LM then takes the parallel sizes from the "
                                          "checkpoint (with --use-checkpoint-args), undoing "
                                          "every new layout",
}
# Flags that may change validity in ways the planner only approximates: planned, with a warning.
WARNED_FLAGS = {
    "--rampup-batch-size": "the ramp's intermediate batch sizes are not checked (Megatron-LM "
                           "now ignores this deprecated flag)",
    "--multi-latent-attention": "MLA's own divisibility rules and memory are not modelled",
    "--mtp-num-layers": "multi-token-prediction layers are not placed in the pipeline model",
    "--use-megatron-fsdp": "Megatron FSDP sharding is not modelled",
    "--cp-comm-type": "TransformerEngine's head rule for all-to-all context parallelism is "
                      "not modelled",
    "--window-size": "sliding-window attention is not modelled",
}


@dataclass(frozen=True)
class PipelineFlags:
    """The pipeline-shaping flags of the command."""

    first_stage_layers: int | None = None
    """``--decoder-first-pipeline-num-layers``."""
    last_stage_layers: int | None = None
    """``--decoder-last-pipeline-num-layers``."""
    embedding_in_split: bool = False
    """``--account-for-embedding-in-pipeline-split``: the embedding counts as a layer."""
    loss_in_split: bool = False
    """``--account-for-loss-in-pipeline-split``: the loss counts as a layer."""
    layers_per_virtual_stage: int | None = None
    """``--num-layers-per-virtual-pipeline-stage`` (VPP = layers per rank / this)."""
    virtual_stages_per_rank: int | None = None
    """``--num-virtual-stages-per-pipeline-rank`` (VPP itself)."""
    layout: tuple[int, ...] | None = None
    """``--pipeline-model-parallel-layout``: decoder layers of each stage, in stage order."""
    p2p_overlap: bool = True
    """False with ``--no-overlap-p2p-communication`` (then interleaving needs PP > 2)."""
    microbatch_group_size: int | None = None
    """``--microbatch-group-size-per-virtual-pipeline-stage``; None: PP."""

    def __post_init__(self) -> None:
        # validate_args: at most one of the three virtual-pipeline forms.
        forms = [self.layers_per_virtual_stage, self.virtual_stages_per_rank, self.layout]
        if sum(form is not None for form in forms) > 1:
            raise ValueError(f"only one of {LAYERS_PER_VIRTUAL_STAGE_FLAG}, {VIRTUAL_STAGES_FLAG} "
                             f"and {PIPELINE_LAYOUT_FLAG} may be given (Megatron-LM refuses more)")
        uneven = self.first_stage_layers is not None or self.last_stage_layers is not None
        if uneven and self.layers_per_virtual_stage is not None:
            raise ValueError(f"{LAYERS_PER_VIRTUAL_STAGE_FLAG} cannot be used with uneven first/"
                             f"last stages: Megatron-LM asks for {VIRTUAL_STAGES_FLAG}")
        if uneven and (self.embedding_in_split or self.loss_in_split):
            raise ValueError("uneven first/last stages cannot be combined with --account-for-"
                             "embedding/loss-in-pipeline-split (Megatron-LM refuses it)")
        if self.layout is not None and (uneven or self.embedding_in_split or self.loss_in_split):
            raise ValueError(f"{PIPELINE_LAYOUT_FLAG} cannot be combined with other pipeline "
                             "layout flags (Megatron-LM refuses it)")
        for name in ("first_stage_layers", "last_stage_layers", "layers_per_virtual_stage",
                     "virtual_stages_per_rank", "microbatch_group_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be positive, got {value}")


@dataclass(frozen=True)
class RuleFlags:
    """Other flags that add a layout rule (see the module table)."""

    sequence_parallel: bool = False
    """``--sequence-parallel``: the sequence is split across TP."""
    distribute_saved_activations: bool = False
    """``--distribute-saved-activations``: needs TP > 1."""
    tp_comm_overlap: bool = False
    """``--tp-comm-overlap``: needs TP > 1."""
    torch_fsdp2: bool = False
    """``--use-torch-fsdp2``: needs PP 1 and EP 1."""
    torch_dcp: bool = False
    """``--ckpt-format torch_dcp``: needs TP 1 and PP 1."""
    legacy_checkpoint: bool = False
    """``--ckpt-format torch``: keeps the original TP, PP (and its virtual stages) and EP."""
    needs_interleaving: bool = False
    """``--overlap-param-gather-with-optimizer-step`` or
    ``--overlap-p2p-communication-warmup-flush``: needs VPP > 1."""
    flex_dispatcher: bool = False
    """``--moe-token-dispatcher-type flex`` on a backend other than hybridep: ETP x EP > 1."""
    tp_pp_dp_mapping: bool = False
    """``--use-tp-pp-dp-mapping``: at PP > 1, ETP x EP == TP x CP."""
    recompute_group: int = 1
    """``--recompute-method uniform``'s ``--recompute-num-layers``: it divides each pipeline
    chunk's layers (1: no such rule)."""
    cpu_offloading: bool = False
    """``--cpu-offloading`` (or ``--cpu-offloading-num-layers`` > 0): needs PP 1."""
    defer_embedding_wgrad: bool = False
    """``--defer-embedding-wgrad-compute``: needs PP > 1."""
    expert_overlap: bool = False
    """``--overlap-moe-expert-parallel-comm``: needs EP > 1, and VPP > 1 at PP > 1."""
    hybrid_context_parallel: bool = False
    """``--hybrid-context-parallel``: needs PP 1 and an even DP x CP."""
    fixed_context_parallel: bool = False
    """``--hierarchical-context-parallel-sizes``: CP must keep their product."""
    optimizer_instances: int = 1
    """``--num-distributed-optimizer-instances``."""

    def __post_init__(self) -> None:
        if self.optimizer_instances < 1:
            raise ValueError("--num-distributed-optimizer-instances must be positive")


@dataclass(frozen=True)
class PipelineSplit:
    """One pipeline size and what it implies for the stages."""

    size: int
    """PP."""
    stage_layers: tuple[int, int, int]
    """Transformer layers on the first stage, on the middle stages (the most any has) and on
    the last stage."""
    virtual_size: int
    """The interleaving degree (VPP) the command asks for at this PP; 1: none."""
    can_stop_interleaving: bool
    """Whether the VPP flag may be rewritten to turn interleaving off (not with a layout)."""


@dataclass(frozen=True)
class ModelSplit:
    """TP, CP, EP and the pipeline: everything of a layout except DP and the batch."""

    tensor: int
    """TP."""
    context: int
    """CP."""
    pipeline: PipelineSplit
    """PP and its stages."""
    expert: int = 1
    """EP."""
    expert_tensor: int = 1
    """ETP (the command's, or TP)."""

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.context * self.pipeline.size


# -- reading the flags ----------------------------------------------------------------------

MAX_LAYOUT_LENGTH = 10**6
"""Letters a pipeline layout may expand to, far beyond any model's layers: expanding
``Et*99999999999|L`` ran out of memory."""


def _repeated(pattern: str, text: str) -> str:
    """``text`` with each ``pattern`` match (a piece and its count) repeated, refused before
    it is built when it would exceed :data:`MAX_LAYOUT_LENGTH`."""
    matches = list(re.finditer(pattern, text))
    # float: a count of thousands of digits is inf here, where int() would refuse to parse it
    length = len(text) + sum(len(match.group(1)) * float(match.group(2)) - len(match.group(0))
                             for match in matches)
    if length > MAX_LAYOUT_LENGTH:
        raise ValueError(f"{PIPELINE_LAYOUT_FLAG} expands to more than 10^6 layers")
    return re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), text)


def parse_pipeline_layout(text: str) -> tuple[int, ...]:
    """Decoder layers per stage of a ``--pipeline-model-parallel-layout`` string.

    The expansion follows ``PipelineParallelLayerLayout.parse_str_to_list``: commas are
    cosmetic, ``(...)*n`` and ``x*n`` repeat, ``|`` separates stages; ``E``, ``L``, ``t``,
    ``m`` are embedding, loss, decoder and MTP layers.
    """
    text = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = _repeated(pattern, text)
    stages = text.split("|")
    unknown = set("".join(stages)) - set("ELtm")
    if unknown:
        raise ValueError(f"{PIPELINE_LAYOUT_FLAG} has unknown layer letters "
                         f"{''.join(sorted(unknown))} (known: E, L, t, m)")
    flat = "".join(stages)
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 \
            or flat.count("L") != 1:
        raise ValueError(f"{PIPELINE_LAYOUT_FLAG} must start with one E and end with one L")
    return tuple(stage.count("t") for stage in stages)


def read_pipeline_flags(args: Sequence[str]) -> PipelineFlags:
    layout = flag_value(args, PIPELINE_LAYOUT_FLAG)
    return PipelineFlags(
        first_stage_layers=int_flag(args, FIRST_STAGE_FLAG),
        last_stage_layers=int_flag(args, LAST_STAGE_FLAG),
        embedding_in_split=flag_present(args, "--account-for-embedding-in-pipeline-split"),
        loss_in_split=flag_present(args, "--account-for-loss-in-pipeline-split"),
        layers_per_virtual_stage=int_flag(args, LAYERS_PER_VIRTUAL_STAGE_FLAG),
        virtual_stages_per_rank=int_flag(args, VIRTUAL_STAGES_FLAG),
        layout=None if layout is None else parse_pipeline_layout(layout),
        p2p_overlap=not flag_present(args, "--no-overlap-p2p-communication"),
        microbatch_group_size=int_flag(args, "--microbatch-group-size-per-virtual-pipeline-stage"))


def read_rule_flags(args: Sequence[str]) -> RuleFlags:
    return RuleFlags(
        sequence_parallel=flag_present(args, "--sequence-parallel"),
        distribute_saved_activations=flag_present(args, "--distribute-saved-activations"),
        tp_comm_overlap=flag_present(args, "--tp-comm-overlap"),
        torch_fsdp2=flag_present(args, "--use-torch-fsdp2"),
        torch_dcp=flag_value(args, "--ckpt-format") == "torch_dcp",
        legacy_checkpoint=flag_value(args, "--ckpt-format") == "torch",
        needs_interleaving=(flag_present(args, "--overlap-param-gather-with-optimizer-step")
                            or flag_present(args, "--overlap-p2p-communication-warmup-flush")),
        flex_dispatcher=(flag_value(args, "--moe-token-dispatcher-type") == "flex"
                         and flag_value(args, "--moe-flex-dispatcher-backend") != "hybridep"),
        tp_pp_dp_mapping=flag_present(args, "--use-tp-pp-dp-mapping"),
        recompute_group=(int_flag(args, "--recompute-num-layers", 1)
                         if flag_value(args, "--recompute-method") == "uniform" else 1),
        cpu_offloading=(flag_present(args, "--cpu-offloading")
                        or (int_flag(args, "--cpu-offloading-num-layers", 0, positive=False) or 0) > 0),
        defer_embedding_wgrad=flag_present(args, "--defer-embedding-wgrad-compute"),
        expert_overlap=flag_present(args, "--overlap-moe-expert-parallel-comm"),
        hybrid_context_parallel=flag_present(args, "--hybrid-context-parallel"),
        fixed_context_parallel=flag_present(args, "--hierarchical-context-parallel-sizes"),
        optimizer_instances=int_flag(args, "--num-distributed-optimizer-instances", 1))


def unmodelled_flag_warnings(args: Sequence[str]) -> tuple[str, ...]:
    """Warnings for flags the planner only approximates; ValueError for refused ones."""
    for flag, reason in REFUSED_FLAGS.items():
        if flag_present(args, flag):
            raise ValueError(f"{flag} is not supported by the planner: {reason}")
    warnings = []
    for flag, reason in WARNED_FLAGS.items():
        if flag == "--cp-comm-type" and (flag_value(args, flag) or "p2p") == "p2p":
            continue
        if flag_present(args, flag):
            warnings.append(f"{flag}: {reason}")
    return tuple(warnings)


# -- tensor, context and expert parallelism -------------------------------------------------

def divisors(n: int) -> list[int]:
    """Ascending; O(sqrt n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tensor_sizes(shape: ModelShape, original: OriginalLayout, rules: RuleFlags) -> list[int]:
    """TP sizes every TP-sharded dimension allows (the module table's TP rows)."""
    heads, groups = shape.num_attention_heads, shape.num_query_groups
    qkv_width = shape.head_size * (heads + 2 * groups)
    sizes = []
    for tp in divisors(heads):
        if groups % tp and tp % groups:
            continue
        if qkv_width % tp or shape.ffn_hidden_size % tp:
            continue
        if shape.experts and shape.experts.shared_expert_size % tp:
            continue
        if tp == 1 and (rules.distribute_saved_activations or rules.tp_comm_overlap):
            continue
        if tp > 1 and rules.torch_dcp:
            continue
        if tp > 1 and shape.experts and not rules.sequence_parallel:
            continue  # megatron-core's MoELayer.forward raises at TP > 1 without SP
        if original.expert_tensor_parallel_size is None and not expert_tensor_allowed(shape, tp):
            continue  # the expert TP follows TP
        sizes.append(tp)
    return sizes


def expert_tensor_allowed(shape: ModelShape, expert_tensor: int) -> bool:
    """moe ffn % ETP; a MoE model with linear biases needs ETP == 1."""
    experts = shape.experts
    if experts is None:
        return True
    if experts.ffn_hidden_size % expert_tensor:
        return False
    return expert_tensor == 1 or not shape.linear_bias


def context_sizes(shape: ModelShape, original: OriginalLayout, rules: RuleFlags) -> list[int]:
    """CP sizes: never above the original (its attention backend must support CP), and
    seq % (2 * CP) == 0 for CP > 1 (validate_args). Hierarchical CP keeps the original."""
    cp0 = original.context_parallel_size
    if rules.fixed_context_parallel:
        return [cp0]
    return [cp for cp in divisors(cp0) if cp == 1 or shape.seq_length % (2 * cp) == 0]


def sequence_parallel_allows(shape: ModelShape, rules: RuleFlags, tp: int, cp: int) -> bool:
    """With SP (and TP > 1) the embedding output's sequence, seq / CP, is split across TP."""
    return not rules.sequence_parallel or tp == 1 or (shape.seq_length // cp) % tp == 0


def expert_sizes(shape: ModelShape, rules: RuleFlags) -> list[int]:
    """EP sizes: divisors of the experts (1 for a dense model or with torch FSDP2)."""
    if shape.experts is None or rules.torch_fsdp2:
        return [1]
    return divisors(shape.experts.num_experts)


# -- pipeline ---------------------------------------------------------------------------------

def largest_divisor_at_most(values: Sequence[int], limit: int) -> int:
    """The largest d <= limit dividing every value (1 always does). Found among the
    divisors, not by counting up to ``limit``: a mistyped 10^12 hung the planner."""
    common = math.gcd(*values) or max(limit, 1)  # every d divides 0
    return max(d for d in divisors(common) if d <= max(limit, 1))


def _interleaving_allowed(flags: PipelineFlags, pp: int) -> bool:
    """validate_args: VPP needs PP > 1, and PP > 2 without p2p overlap."""
    return pp > 2 or (pp == 2 and flags.p2p_overlap)


def _layout_split(flags: PipelineFlags, pp: int) -> PipelineSplit | None:
    stages = flags.layout
    if len(stages) % pp:
        return None
    vpp = len(stages) // pp
    if vpp > 1 and not _interleaving_allowed(flags, pp):
        return None
    per_rank = [sum(stages[rank::pp]) for rank in range(pp)]
    middle = max(per_rank[1:-1], default=per_rank[0])
    return PipelineSplit(pp, (per_rank[0], middle, per_rank[-1]), vpp, False)


def _uneven_split(shape: ModelShape, flags: PipelineFlags, pp: int) -> PipelineSplit | None:
    first, last = flags.first_stage_layers, flags.last_stage_layers
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = shape.num_layers - (first or 0) - (last or 0)
    if middle_stages < 0 or middle_layers < 0 or (middle_layers > 0) != (middle_stages > 0):
        return None
    if middle_stages and middle_layers % middle_stages:
        return None
    per_middle = middle_layers // middle_stages if middle_stages else 0
    counts = [count for count in (first, last, per_middle or None) if count]
    vpp = 1
    if flags.virtual_stages_per_rank and _interleaving_allowed(flags, pp):
        vpp = largest_divisor_at_most(counts, flags.virtual_stages_per_rank)
    stages = (first if first is not None else per_middle, per_middle or (first or last),
              last if last is not None else per_middle)
    return PipelineSplit(pp, stages, vpp, True)


def _even_split(shape: ModelShape, flags: PipelineFlags, pp: int) -> PipelineSplit | None:
    embedding, loss = int(flags.embedding_in_split), int(flags.loss_in_split)
    total = shape.num_layers + embedding + loss
    if total % pp:
        return None
    per_rank = total // pp
    stages = (per_rank - embedding, per_rank, per_rank - loss)
    vpp = 1
    if _interleaving_allowed(flags, pp):
        if flags.layers_per_virtual_stage:
            chunk = largest_divisor_at_most([per_rank], flags.layers_per_virtual_stage)
            vpp = per_rank // chunk
        elif flags.virtual_stages_per_rank:
            vpp = largest_divisor_at_most([per_rank], flags.virtual_stages_per_rank)
    if pp == 1:
        stages = (shape.num_layers,) * 3
    return PipelineSplit(pp, stages, vpp, True)


def pipeline_split(shape: ModelShape, flags: PipelineFlags, pp: int) -> PipelineSplit | None:
    """What PP implies for the stages, or None when Megatron-LM refuses this PP.

    At PP 1 uneven stages and interleaving are meaningless; their flags are rewritten away.
    When the command's VPP does not divide a stage at this PP, the largest VPP at most the
    command's that does is used (the flag is rewritten); interleaving stays off where
    Megatron-LM forbids it.
    """
    if flags.layout is not None:
        return _layout_split(flags, pp)
    if pp > 1 and (flags.first_stage_layers is not None or flags.last_stage_layers is not None):
        return _uneven_split(shape, flags, pp)
    return _even_split(shape, flags, pp)


def pipeline_splits(shape: ModelShape, flags: PipelineFlags, rules: RuleFlags,
                    max_size: int) -> list[PipelineSplit]:
    """Every PP up to ``max_size`` that Megatron-LM accepts for this model and these flags."""
    most_stages = len(flags.layout) if flags.layout else shape.num_layers + 2
    splits = []
    for pp in range(1, min(max_size, most_stages) + 1):
        if pp > 1 and (rules.torch_fsdp2 or rules.torch_dcp or rules.cpu_offloading
                       or rules.hybrid_context_parallel):
            break
        if pp == 1 and rules.defer_embedding_wgrad:
            continue
        split = pipeline_split(shape, flags, pp)
        if split is not None and (rules.needs_interleaving or rules.expert_overlap and pp > 1):
            split = (replace(split, can_stop_interleaving=False) if split.virtual_size > 1
                     else None)
        if split is not None and rules.legacy_checkpoint:
            split = replace(split, can_stop_interleaving=False)
        if split is not None and rules.recompute_group > 1:
            split = _tiled_by_recompute_groups(split, rules.recompute_group)
        if split is not None:
            splits.append(split)
    return splits


def _tiled_by_recompute_groups(split: PipelineSplit, group: int) -> PipelineSplit | None:
    """``split`` if groups of ``group`` layers tile each of its chunks (uniform recompute walks
    a chunk in such groups from its first layer and indexes past its last otherwise), and
    keeps doing so should interleaving stop; else None."""
    def tiled(virtual_size: int) -> bool:
        return all(layers % virtual_size == 0 and layers // virtual_size % group == 0
                   for layers in split.stage_layers if layers)

    if not tiled(split.virtual_size):
        return None
    return split if tiled(1) else replace(split, can_stop_interleaving=False)


def interleaving_allows(flags: PipelineFlags, pp: int, vpp: int,
                        micro_batches: Sequence[int]) -> bool:
    """The interleaved schedule's micro-batch rule, for every count in ``micro_batches``
    (training and evaluation): PP <= group <= M, and M % group is 0 or at least PP."""
    if vpp <= 1:
        return True
    group = flags.microbatch_group_size or pp
    if group < pp:
        return False
    return all(group <= m and (m % group == 0 or m % group >= pp) for m in micro_batches)


def model_splits(shape: ModelShape, original: OriginalLayout, pipeline_flags: PipelineFlags,
                 rules: RuleFlags, capacity: Callable[[int], int]) -> Iterator[ModelSplit]:
    """Every (TP, CP, PP, EP, ETP) that the model and the flags allow, where ``capacity(TP)``
    is the most ranks the nodes can run for that TP."""
    sizes = tensor_sizes(shape, original, rules)
    pipelines = pipeline_splits(shape, pipeline_flags, rules, max(map(capacity, sizes), default=0))
    for tp in sizes:
        max_gpus = capacity(tp)
        etp = original.expert_tensor_parallel_size or tp
        if shape.experts and not expert_tensor_allowed(shape, etp):
            continue
        for cp in context_sizes(shape, original, rules):
            if not sequence_parallel_allows(shape, rules, tp, cp):
                continue
            for pipeline in pipelines:
                if tp * cp * pipeline.size > max_gpus:
                    break
                for ep in expert_sizes(shape, rules):
                    split = ModelSplit(tp, cp, pipeline, ep, etp)
                    if expert_layout_allows(split, original, rules):
                        yield split


def expert_layout_allows(split: ModelSplit, original: OriginalLayout, rules: RuleFlags) -> bool:
    """The rules on a whole split: a legacy checkpoint's TP, PP and EP; the flex dispatcher's
    ETP x EP > 1; the expert overlap's EP > 1; the tp-pp-dp order's expert DP equal to DP at
    PP > 1."""
    if rules.legacy_checkpoint and (
            split.tensor, split.pipeline.size, split.expert) != (
            original.tensor_model_parallel_size, original.pipeline_model_parallel_size,
            original.expert_model_parallel_size):
        return False
    if rules.flex_dispatcher and split.expert_tensor * split.expert == 1:
        return False
    if rules.expert_overlap and split.expert == 1:
        return False
    return not (rules.tp_pp_dp_mapping and split.pipeline.size > 1
                and split.expert_tensor * split.expert != split.tensor * split.context)


def data_parallel_allows(split: ModelSplit, rules: RuleFlags, dp: int) -> bool:
    """world % (ETP*EP*PP) (parallel_state), and an even DP x CP under hybrid CP. The
    distributed-optimizer instances do not constrain DP: a relaunch runs fewer when DP does
    not allow them (:func:`optimizer_instances_for`)."""
    if rules.hybrid_context_parallel and (dp * split.context) % 2:
        return False
    return (split.tensor * split.context * dp) % (split.expert_tensor * split.expert) == 0


def optimizer_instances_for(split: ModelSplit, rules: RuleFlags, dp: int) -> int:
    """The most distributed-optimizer instances, up to ``--num-distributed-optimizer-instances``,
    that ``initialize_model_parallel`` allows: DP x CP, and the expert data-parallel size, must
    divide by them."""
    expert_dp = split.tensor * split.context * dp // (split.expert_tensor * split.expert)
    return most_instances(rules.optimizer_instances, dp * split.context, expert_dp)


def most_instances(asked: int, dp_x_cp: int, expert_dp: int) -> int:
    """The most instances, up to ``asked``, that divide both data-parallel sizes."""
    return largest_divisor_at_most([dp_x_cp, expert_dp], asked)

