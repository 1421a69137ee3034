"""Estimated step time of a layout, to rank layouts by throughput rather than GPU count.

A deliberately simple model, one formula per effect:

- **compute share**: the busiest pipeline stage's training FLOPs (3x the forward pass, 4x
  with full recomputation; forward ``2*params`` per token plus ``2*s*q`` for causal attention
  and ``2*h*V`` for the logits on the last stage), split by TP and CP, at the sustained rate
  ``Hardware.flops``.
- **pipeline bubble**: the 1F1B schedule runs ``M + (PP - 1)`` micro-batch slots for M
  micro-batches, the interleaved one ``M + (PP - 1) / VPP``; the bubble fraction is
  ``(PP-1)/VPP / (M + (PP-1)/VPP)``.
- **tensor-parallel communication** inside a node (TP never leaves one): 8 collectives per
  layer and micro-batch (12 with full recomputation), each moving ``(TP-1)/TP * 2*h`` bytes per
  token at ``Hardware.intra_node_bandwidth``; expert all-to-alls (4 per MoE layer, ``topk``
  copies of each token) and pipeline sends (2 per chunk boundary) likewise, across nodes when
  their groups span nodes.
- **data-parallel gradient reduction**: a ring over DP x CP (expert parameters over the
  expert data-parallel group): ``2*(d-1)/d`` x the gradient bytes (reduce-scatter plus the
  parameter all-gather with the distributed optimizer), across nodes when the group spans
  nodes. ``--overlap-grad-reduce`` hides it behind the last micro-batch's backward pass.

Step time = slots x (compute + TP + EP + PP communication per micro-batch) + exposed
gradient reduction. Throughput = global batch / step time.

Models under ``COMMUNICATION_MIN_PARAMETERS`` are compared on compute share and bubble only:
on a GPU their steps are launch-latency bound, and bandwidth terms would rank them by noise.

With a measured step time of the original layout, ``calibrated`` rescales the compute rate
so that the model reproduces it (the communication terms keep their bandwidths; when the
measurement is below the modelled communication alone, every rate is scaled instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from .layout_rules import ModelSplit, PipelineSplit
from .memory_estimate import MemoryFlags, layer_parameters
from .model_facts import ModelShape

COMMUNICATION_MIN_PARAMETERS = 100e6


@dataclass(frozen=True)
class Hardware:
    """Sustained per-GPU rates. Defaults: H100 SXM nodes of 8, NVLink, 8x400 Gb/s InfiniBand."""

    flops: float = 400e12
    """Sustained bf16 training FLOP/s per GPU (about 40% of the H100's dense peak)."""
    intra_node_bandwidth: float = 300e9
    """NCCL bus bandwidth of a collective inside a node, bytes/s."""
    inter_node_bandwidth: float = 40e9
    """NCCL bus bandwidth per GPU across nodes, bytes/s."""

    def __post_init__(self) -> None:
        for name in ("flops", "intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware {name.replace('_', ' ')} must be positive")


@dataclass(frozen=True)
class StepEstimate:
    """A layout's modelled step, split into what scales with the compute rate and the rest."""

    compute_seconds: float
    """Micro-batch slots x compute per micro-batch: includes the bubble."""
    communication_seconds: float
    """TP, EP and pipeline transfers on the critical path plus exposed gradient reduction."""
    bubble_fraction: float
    """Idle share of the pipeline slots."""
    gradient_seconds: float = 0.0
    """The whole gradient reduction, hidden or not."""
    overlap_seconds: float = 0.0
    """Compute the reduction hides behind (``--overlap-grad-reduce``); scales with the rate."""

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.communication_seconds


@dataclass(frozen=True)
class SplitCost:
    """Per-sample costs of one model split (TP, CP, PP, EP), precomputed once per split."""

    stage_flops: float
    """Training FLOPs of the busiest stage for one sample."""
    tensor_bytes: float
    """Bytes each TP collective moves per sample, summed over the stage's collectives."""
    expert_bytes: float
    """All-to-all bytes per sample on the stage."""
    pipeline_bytes: float
    """Bytes sent to neighbouring stages per sample and model chunk."""
    gradient_bytes: float
    """Dense gradient (and parameter all-gather) bytes per GPU per step."""
    expert_gradient_bytes: float
    """Routed-expert gradient bytes per GPU per step."""
    communication: bool
    """False for models under ``COMMUNICATION_MIN_PARAMETERS``."""


def _moe_layers(shape: ModelShape) -> int:
    """MoE layers of the model: every layer without ``--moe-layer-freq`` (None), and a
    pattern may give none (0)."""
    if shape.experts is None:
        return 0
    return shape.num_layers if shape.experts.moe_layers is None else shape.experts.moe_layers


def total_parameters(shape: ModelShape, vocab: int) -> float:
    """Parameters of the whole model (all experts), for the small-model rule."""
    whole = ModelSplit(1, 1, PipelineSplit(1, (shape.num_layers,) * 3, 1, True))
    dense, moe, routed = layer_parameters(shape, whole)
    moe_layers = _moe_layers(shape)
    embeddings = vocab * shape.hidden_size * (2 if shape.untied_embeddings else 1)
    return (shape.num_layers - moe_layers) * dense + moe_layers * (moe + routed) + embeddings


def _forward_flops_per_token(shape: ModelShape) -> tuple[float, float]:
    """(dense layer, MoE layer) forward FLOPs per token: 2 per weight plus causal attention."""
    h, q = shape.hidden_size, shape.head_size * shape.num_attention_heads
    kv = shape.head_size * shape.num_query_groups
    attention = 2 * h * (2 * q + 2 * kv) + 2 * shape.seq_length * q
    up = 3 if shape.swiglu else 2
    dense = attention + 2 * up * h * shape.ffn_hidden_size
    experts = shape.experts
    if experts is None:
        return dense, dense
    routed = experts.router_topk * 2 * up * h * experts.ffn_hidden_size
    shared = 2 * up * h * experts.shared_expert_size
    return dense, attention + routed + shared + 2 * h * experts.num_experts


def split_cost(shape: ModelShape, flags: MemoryFlags, split: ModelSplit, vocab: int) -> SplitCost:
    """The per-sample costs of ``split``; ``vocab`` is the padded vocabulary at its TP."""
    tp, cp, pp = split.tensor, split.context, split.pipeline.size
    tokens = shape.seq_length / cp
    passes = 4 if flags.recompute == "full" else 3
    dense_flops, moe_flops = _forward_flops_per_token(shape)
    moe_share = _moe_layers(shape) / shape.num_layers
    layer_flops = (1 - moe_share) * dense_flops + moe_share * moe_flops
    first, middle, last = split.pipeline.stage_layers
    logits = 2 * shape.hidden_size * vocab
    stage_flops = max(first * layer_flops, middle * layer_flops, last * layer_flops + logits)
    busiest_layers = max(first, middle, last)
    collectives = 12 if flags.recompute == "full" else 8
    tensor_bytes = busiest_layers * collectives * (tp - 1) / tp * 2 * shape.hidden_size * tokens
    moe_layers = busiest_layers * moe_share
    expert_bytes = 0.0
    if split.expert > 1:
        topk = shape.experts.router_topk
        expert_bytes = (moe_layers * 4 * (split.expert - 1) / split.expert * topk
                        * 2 * shape.hidden_size * tokens / tp)
    sp = tp if flags.sequence_parallel else 1
    pipeline_bytes = 2 * 2 * shape.hidden_size * tokens / sp if pp > 1 else 0.0
    dense, moe, routed = layer_parameters(shape, split)
    # The embedding, and at PP 1 an untied output layer beside it (at PP > 1 each end has one).
    vocab_copies = 2 if pp == 1 and shape.untied_embeddings else 1
    per_gpu_dense = (busiest_layers * ((1 - moe_share) * dense + moe_share * moe)
                     + vocab_copies * vocab * shape.hidden_size / tp)
    gather = flags.model_bytes if flags.distributed_optimizer else flags.grad_bytes
    return SplitCost(
        stage_flops=tokens * stage_flops * passes / tp,
        tensor_bytes=tensor_bytes, expert_bytes=expert_bytes, pipeline_bytes=pipeline_bytes,
        gradient_bytes=per_gpu_dense * (flags.grad_bytes + gather) / 2,
        expert_gradient_bytes=moe_layers * routed * (flags.grad_bytes + gather) / 2,
        communication=total_parameters(shape, vocab) >= COMMUNICATION_MIN_PARAMETERS)


def _ring_seconds(group: int, data_bytes: float, bandwidth: float) -> float:
    """A reduce-scatter plus all-gather (or an all-reduce) over ``group`` ranks."""
    return 0.0 if group <= 1 else 2 * (group - 1) / group * data_bytes / bandwidth


def _bandwidth(hardware: Hardware, span: int, node_size: int | None) -> float:
    """Inside a node when the group's ranks (``span`` consecutive ones) fit in one."""
    inside = node_size is None or span <= node_size
    return hardware.intra_node_bandwidth if inside else hardware.inter_node_bandwidth


def estimate_step(cost: SplitCost, split: ModelSplit, hardware: Hardware, *, dp: int,
                  vpp: int, micro_batch: int, micro_batches: int, node_size: int | None,
                  overlap_grad_reduce: bool) -> StepEstimate:
    """The modelled step of ``split`` at this DP, VPP and batch."""
    tp, cp, pp = split.tensor, split.context, split.pipeline.size
    vpp = max(vpp, 1)
    slots = micro_batches + (pp - 1) / vpp
    compute = micro_batch * cost.stage_flops / hardware.flops
    if not cost.communication:
        return StepEstimate(slots * compute, 0.0, (pp - 1) / vpp / slots)
    per_micro_batch = micro_batch * (
        cost.tensor_bytes / hardware.intra_node_bandwidth
        + cost.expert_bytes / _bandwidth(hardware, split.expert_tensor * split.expert, node_size)
        + vpp * cost.pipeline_bytes / _bandwidth(hardware, tp * cp * dp + 1, node_size))
    dense_ranks = tp * cp * dp
    gradients = (_ring_seconds(dp * cp, cost.gradient_bytes,
                               _bandwidth(hardware, dense_ranks, node_size))
                 + _ring_seconds(dense_ranks // (split.expert_tensor * split.expert),
                                 cost.expert_gradient_bytes,
                                 _bandwidth(hardware, dense_ranks, node_size)))
    overlap = 2 / 3 * compute if overlap_grad_reduce else 0.0
    return StepEstimate(slots * compute, slots * per_micro_batch + max(0.0, gradients - overlap),
                        (pp - 1) / vpp / slots, gradients, overlap)


def calibrated(hardware: Hardware, predicted: StepEstimate, measured_seconds: float) -> Hardware:
    """``hardware`` rescaled so that ``predicted`` becomes ``measured_seconds``."""
    if measured_seconds <= 0:
        raise ValueError(f"a measured step time must be positive, got {measured_seconds:g} s")
    exposed = max(0.0, predicted.gradient_seconds - predicted.overlap_seconds)
    fixed = predicted.communication_seconds - exposed
    unhidden = fixed + predicted.gradient_seconds  # with no compute left to hide behind
    if measured_seconds > unhidden * 1.05:
        # measured = k * compute + fixed + max(0, gradients - k * overlap): the hidden part of
        # the reduction shrinks as the compute time k grows, so solve for k piecewise.
        scale = (measured_seconds - fixed) / predicted.compute_seconds
        if scale * predicted.overlap_seconds < predicted.gradient_seconds:
            scale = ((measured_seconds - unhidden)
                     / (predicted.compute_seconds - predicted.overlap_seconds))
        rescaled = replace(hardware, flops=hardware.flops / scale)
    else:
        scale = predicted.seconds / measured_seconds
        rescaled = Hardware(hardware.flops * scale, hardware.intra_node_bandwidth * scale,
                            hardware.inter_node_bandwidth * scale)
    # An infinite rate makes every step 0 s, and throughput a division by zero.
    if not all(math.isfinite(rate) for rate in (rescaled.flops, rescaled.intra_node_bandwidth,
                                                 rescaled.inter_node_bandwidth)):
        raise ValueError(f"a measured step time of {measured_seconds:g} s is too short to "
                         f"calibrate the cost model on")
    return rescaled

