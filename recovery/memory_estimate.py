"""Peak GPU memory of one rank of a Megatron-LM layout: what ``torch.cuda.max_memory_allocated``
would report, plus a fixed reserve for what the allocator does not see.

The estimate is the largest of the first, a middle and the last pipeline stage, each the sum of

- **weights, gradients and optimizer state.** Per parameter: the model copy (2 bytes in bf16
  or fp16, 4 in fp32), the main gradient (4 bytes; 2 with ``--grad-reduce-in-bf16``) and the
  Adam state (fp32 master copy, momentum and variance: 12 bytes; 8 in fp32 training, which has
  no master copy). ``--use-distributed-optimizer`` divides the Adam state by DP x CP (expert
  parameters: by the expert data-parallel size), and by that over N with
  ``--num-distributed-optimizer-instances N`` (each instance holds the whole state, sharded
  within it; N as a relaunch runs it), as Megatron-LM's
  ``theoretical_memory_usage.compute_weight_and_optimizer_memory`` does. Parameters: attention
  ``h*kv*(2*heads + 2*groups)`` (GQA shrinks K and V), the MLP ``2*h*f`` or ``3*h*f`` with
  ``--swiglu``, split by TP; experts ``E*(2|3)*h*f_moe / (EP*ETP)``; the embedding on the first
  stage and the output layer on the last (Megatron keeps a copy of a tied embedding there
  when PP > 1; untied, PP 1 holds both), padded as Megatron pads the vocabulary.
- **activations** of the micro-batches in flight, per token of a layer (Korthikanti et al.
  2022, Table 2, generalised): 8h bytes outside the TP regions (layer-norm inputs and outputs)
  plus 2h of dropout masks when ``--hidden-dropout`` > 0, divided by TP only with
  ``--sequence-parallel``; Q, K, V and the attention output (``2*(2q + 2kv)`` with GQA) and
  the MLP (``4f``, ``6f`` with ``--swiglu``), divided by TP. **Attention is assumed to be flash
  or fused** (no ``s^2`` scores: Megatron's default ``--attention-backend auto`` picks them
  on GPU); with ``--attention-backend unfused|local`` the softmax (and, with attention
  dropout, its mask and output) add ``heads*s*(2 + 3)`` bytes per token unless selective
  recomputation drops them. ``--fp8-format`` stores GEMM inputs in one byte. CP divides the
  tokens. Full recomputation keeps only each recomputed block's input (``2h``, /TP with SP)
  plus one block's activations while it is recomputed (``uniform``: blocks of
  ``--recompute-num-layers``; ``block``: that many layers of each chunk). MoE layers hold, per
  token, ``topk/TP * (2h*ETP + (6|4)*f_moe)`` for the routed experts (balanced routing
  assumed). Micro-batches in flight: 1F1B keeps ``min(PP - stage, M)`` on a stage; the
  interleaved schedule ``2*(PP - stage - 1) + (VPP - 1)*group + 1`` model chunks (at most
  ``M*VPP``), which is Megatron's ``1 + (PP-1)/(PP*VPP)`` penalty on the first stage.
- **the loss** on the last stage: 6 bytes per logit of one micro-batch (the fp32 softmax kept
  for the backward pass and the bf16 gradient it becomes), ``tokens * vocab / TP``.

It is calibrated against measured peaks in ``benchmarks/planner_memory_calibration.py``.
A layout fits when the estimate plus ``RESERVE_GIB`` (CUDA context, NCCL buffers and
allocator slack, which ``max_memory_allocated`` does not count) is at most the GPU's memory;
pass a smaller ``--gpu-memory-gb`` for more headroom.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .argv_flags import flag_present, flag_value, float_flag, int_flag, switched_on
from .layout_rules import ModelSplit, most_instances
from .model_facts import ModelShape

GIB = 2**30
RESERVE_GIB = 2.5
"""CUDA context (~0.5 GiB), NCCL communicators and workspaces outside PyTorch's allocator."""
ASSUMED_VOCAB_SIZE = 50257
"""Used when the vocabulary is unknown (no ``--vocab-size``, a tokenizer file): GPT-2's BPE,
Megatron's usual tokenizer."""
RECOMPUTE_GRANULARITIES = ("selective", "full")

# Flags that change memory in ways the estimate ignores: a warning names them when a memory
# size is given.
MEMORY_UNMODELLED_FLAGS = (
    "--use-precision-aware-optimizer", "--main-grads-dtype", "--main-params-dtype",
    "--exp-avg-dtype", "--exp-avg-sq-dtype", "--optimizer-cpu-offload", "--fp8-param-gather",
    "--fine-grained-activation-offloading", "--recompute-modules", "--cpu-offloading",
    "--use-torch-fsdp2", "--use-megatron-fsdp", "--offload-modules", "--moe-layer-recompute",
)


@dataclass(frozen=True)
class MemoryFlags:
    """The flags of the command that change per-GPU memory."""

    sequence_parallel: bool = False
    """``--sequence-parallel``: layer-norm and dropout activations split across TP."""
    distributed_optimizer: bool = False
    """``--use-distributed-optimizer``: Adam's state split across DP x CP."""
    optimizer_instances: int = 1
    """``--num-distributed-optimizer-instances``: the state split across DP x CP / N."""
    recompute: str | None = None
    """None, ``selective`` or ``full`` (``--recompute-granularity``, ``--recompute-activations``)."""
    recompute_method: str | None = None
    """``uniform`` or ``block`` with full recomputation."""
    recompute_layers: int = 1
    """``--recompute-num-layers``."""
    flash_attention: bool = True
    """False with ``--attention-backend unfused`` or ``local``: attention scores are stored."""
    hidden_dropout: bool = True
    """``--hidden-dropout`` > 0 (Megatron's default 0.1): dropout masks are stored."""
    attention_dropout: bool = True
    """``--attention-dropout`` > 0 (default 0.1): only matters without flash attention."""
    model_bytes: int = 4
    """Bytes of the model's parameters: 2 with ``--bf16``/``--fp16``, else 4 (fp32)."""
    grad_bytes: int = 4
    """Bytes of a main gradient: 2 with ``--grad-reduce-in-bf16``."""
    fp8: bool = False
    """``--fp8-format``: GEMM inputs are kept in one byte."""

    def __post_init__(self) -> None:
        if self.recompute not in (None, *RECOMPUTE_GRANULARITIES):
            raise ValueError(f"--recompute-granularity must be selective or full, "
                             f"got {self.recompute!r}")
        if self.recompute == "full" and self.recompute_method not in ("uniform", "block"):
            raise ValueError("--recompute-granularity full needs --recompute-method uniform "
                             "or block (Megatron-LM refuses it otherwise)")
        if self.recompute_layers < 1:
            raise ValueError("--recompute-num-layers must be positive")

    @property
    def optimizer_bytes(self) -> int:
        """Adam's state per parameter: master copy, momentum, variance (no master in fp32)."""
        return 12 if self.model_bytes == 2 else 8


def read_memory_flags(args: Sequence[str]) -> MemoryFlags:
    granularity = flag_value(args, "--recompute-granularity")
    if granularity is None and flag_present(args, "--recompute-activations"):
        granularity = "selective"  # validate_args
    backend = flag_value(args, "--attention-backend") or "auto"
    half = flag_present(args, "--bf16") or flag_present(args, "--fp16")
    return MemoryFlags(
        sequence_parallel=flag_present(args, "--sequence-parallel"),
        distributed_optimizer=switched_on(args, "--use-distributed-optimizer"),
        optimizer_instances=int_flag(args, "--num-distributed-optimizer-instances", 1),
        recompute=granularity,
        recompute_method=flag_value(args, "--recompute-method"),
        recompute_layers=int_flag(args, "--recompute-num-layers", 1),
        # megatron-core's local layer spec attends with DotProductAttention: unfused
        flash_attention=backend not in ("unfused", "local")
        and flag_value(args, "--transformer-impl") != "local",
        hidden_dropout=float_flag(args, "--hidden-dropout", 0.1) > 0,
        attention_dropout=float_flag(args, "--attention-dropout", 0.1) > 0,
        model_bytes=2 if half else 4,
        grad_bytes=2 if flag_present(args, "--grad-reduce-in-bf16") else 4,
        fp8=flag_present(args, "--fp8-format"))


def memory_warnings(args: Sequence[str]) -> tuple[str, ...]:
    return tuple(f"{flag}: its effect on memory is not modelled by the estimate"
                 for flag in MEMORY_UNMODELLED_FLAGS if flag_present(args, flag))


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's memory as a function of DP and the micro-batches: coefficients."""

    dense_parameters: float
    """Parameters replicated across data parallelism (sharded by TP or not at all)."""
    expert_parameters: float
    """Routed-expert parameters (their optimizer shards over the expert data-parallel size)."""
    layer_bytes_per_sample: float
    """Activation bytes of one full layer for one sample."""
    checkpoint_bytes_per_sample: float
    """Bytes of a recomputed block's stored input, per sample."""
    layers: int
    """Transformer layers on the stage."""
    stage_rank: int
    """0 for the first stage, PP - 1 for the last (the in-flight count depends on it)."""
    fixed_bytes_per_sample: float
    """Embedding inputs per in-flight micro-batch (first stage), per sample."""
    loss_bytes_per_sample: float
    """Logits and their gradient for one micro-batch (last stage), per sample."""


def _bias(shape: ModelShape, width: int) -> int:
    return width if shape.linear_bias else 0


def _attention_parameters(shape: ModelShape) -> int:
    q = shape.head_size * shape.num_attention_heads
    kv = shape.head_size * shape.num_query_groups
    return shape.hidden_size * (2 * q + 2 * kv) + _bias(shape, q + 2 * kv + shape.hidden_size)


def _mlp_parameters(shape: ModelShape, ffn: int) -> int:
    up = 2 if shape.swiglu else 1
    return shape.hidden_size * ffn * (up + 1) + _bias(shape, ffn * up + shape.hidden_size)


def layer_parameters(shape: ModelShape, split: ModelSplit) -> tuple[float, float, float]:
    """(dense layer, MoE layer without routed experts, routed experts) parameters per GPU."""
    tp = split.tensor
    attention = _attention_parameters(shape) / tp
    norms = 4 * shape.hidden_size
    dense = attention + _mlp_parameters(shape, shape.ffn_hidden_size) / tp + norms
    experts = shape.experts
    if experts is None:
        return dense, dense, 0.0
    shared = _mlp_parameters(shape, experts.shared_expert_size) / tp if experts.shared_expert_size else 0
    moe = attention + shared + norms + shape.hidden_size * experts.num_experts
    routed = (experts.num_experts * _mlp_parameters(shape, experts.ffn_hidden_size)
              / (split.expert * split.expert_tensor))
    return dense, moe, routed


def _moe_layers_on(shape: ModelShape, layers: int) -> float:
    experts = shape.experts
    if experts is None:
        return 0.0
    share = 1.0 if experts.moe_layers is None else experts.moe_layers / shape.num_layers
    return layers * share


def layer_activation_bytes(shape: ModelShape, flags: MemoryFlags, split: ModelSplit) -> float:
    """Activation bytes one layer keeps for one token, averaged over dense and MoE layers."""
    h, tp = shape.hidden_size, split.tensor
    q = shape.head_size * shape.num_attention_heads
    kv = shape.head_size * shape.num_query_groups
    gemm_input = 1 if flags.fp8 else 2
    outside = 4 * h + 2 * gemm_input * h + (2 * h if flags.hidden_dropout else 0)
    outside /= tp if flags.sequence_parallel else 1
    attention = 2 * (2 * q + 2 * kv) + (q if flags.fp8 else 0)
    if not flags.flash_attention and flags.recompute != "selective":
        attention += shape.num_attention_heads * shape.seq_length * (
            5 if flags.attention_dropout else 2)
    dense_mlp = _mlp_activation(shape, shape.ffn_hidden_size, flags)
    experts = shape.experts
    if experts is None:
        return outside + (attention + dense_mlp) / tp
    routed = experts.router_topk / tp * (2 * h * split.expert_tensor
                                         + _mlp_activation(shape, experts.ffn_hidden_size, flags))
    shared = _mlp_activation(shape, experts.shared_expert_size, flags) / tp
    moe = routed + shared + 8 * experts.num_experts / tp
    share = _moe_layers_on(shape, shape.num_layers) / shape.num_layers
    return outside + attention / tp + share * moe + (1 - share) * dense_mlp / tp


def _mlp_activation(shape: ModelShape, ffn: int, flags: MemoryFlags) -> float:
    """fc1's output and the activation's output (fc2's input, one byte in fp8)."""
    fc1_out = 4 * ffn if shape.swiglu else 2 * ffn
    return fc1_out + (1 if flags.fp8 else 2) * ffn


def stage_memories(shape: ModelShape, flags: MemoryFlags, split: ModelSplit,
                   padded_vocab: int) -> tuple[StageMemory, ...]:
    """The first, the second (when PP > 2: with uneven stages it can hold the most
    activations, as it keeps one micro-batch fewer than the first but may have more layers)
    and the last stage."""
    pp = split.pipeline.size
    dense, moe, routed = layer_parameters(shape, split)
    tokens = shape.seq_length / split.context
    layer_bytes = layer_activation_bytes(shape, flags, split) * tokens
    checkpoint = 2 * shape.hidden_size * tokens / (split.tensor if flags.sequence_parallel else 1)
    vocab_part = padded_vocab * shape.hidden_size / split.tensor
    first, middle, last = split.pipeline.stage_layers
    ranks = sorted({0, min(1, pp - 1), pp - 1})
    stages = []
    for rank in ranks:
        layers = first if rank == 0 else last if rank == pp - 1 else middle
        moe_layers = _moe_layers_on(shape, layers)
        params = (layers - moe_layers) * dense + moe_layers * moe
        fixed = loss = 0.0
        if rank == 0:
            params += vocab_part + shape.position_embeddings * shape.hidden_size
            fixed = (8 + (shape.hidden_size if flags.hidden_dropout else 0)) * tokens
        if rank == pp - 1:
            if pp > 1 or shape.untied_embeddings:
                params += vocab_part
            loss = 6 * tokens * padded_vocab / split.tensor
        stages.append(StageMemory(params, moe_layers * routed, layer_bytes, checkpoint, layers,
                                  rank, fixed, loss))
    return tuple(stages)


def _chunks_in_flight(split: ModelSplit, vpp: int, group: int | None, stage_rank: int,
                      micro_batches: int) -> int:
    """Model chunks whose activations a stage holds at its peak (see the module docstring)."""
    pp = split.pipeline.size
    if vpp <= 1:
        return min(pp - stage_rank, micro_batches)
    warmup = 2 * (pp - stage_rank - 1) + (vpp - 1) * (group or pp) + 1
    return min(warmup, micro_batches * vpp)


def _activation_bytes(stage: StageMemory, flags: MemoryFlags, chunks: int, vpp: int) -> float:
    """Bytes of ``chunks`` model chunks of one sample each, with recomputation."""
    chunk_layers = stage.layers / max(vpp, 1)
    full, ckpt = stage.layer_bytes_per_sample, stage.checkpoint_bytes_per_sample
    if flags.recompute != "full" or chunk_layers == 0:
        return chunks * chunk_layers * full
    n = min(flags.recompute_layers, chunk_layers)
    if flags.recompute_method == "uniform":
        return chunks * math.ceil(chunk_layers / n) * ckpt + n * full
    return chunks * (n * ckpt + (chunk_layers - n) * full) + full


def peak_bytes(stage: StageMemory, flags: MemoryFlags, split: ModelSplit, *, dp: int,
               expert_dp: int, vpp: int, group: int | None, micro_batch: int,
               micro_batches: int) -> float:
    """Peak allocated bytes on ``stage`` for this DP and batch."""
    distributed = flags.distributed_optimizer
    per_param = flags.model_bytes + flags.grad_bytes
    optimizer = flags.optimizer_bytes
    instances = most_instances(flags.optimizer_instances, dp * split.context, expert_dp)
    dense_shards = dp * split.context // instances if distributed else 1
    expert_shards = expert_dp // instances if distributed else 1
    weights = (stage.dense_parameters * (per_param + optimizer / dense_shards)
               + stage.expert_parameters * (per_param + optimizer / expert_shards))
    chunks = _chunks_in_flight(split, vpp, group, stage.stage_rank, micro_batches)
    in_flight = min(split.pipeline.size - stage.stage_rank, micro_batches)
    activations = _activation_bytes(stage, flags, chunks, vpp) * micro_batch
    extras = (stage.fixed_bytes_per_sample * in_flight + stage.loss_bytes_per_sample) * micro_batch
    return weights + activations + extras
