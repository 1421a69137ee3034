"""Choose TP/PP/DP and the micro-batch for the GPUs that survive a failure.

Pure functions: no I/O, no clock, the same answer for the same input.

A layout is valid when Megatron can run it and it keeps the optimisation unchanged:

- TP divides the attention heads, the query groups, the hidden size and the FFN size;
- TP stays within one node: it divides the GPUs per node, when the job spans nodes (TP groups
  are consecutive ranks, so they then never straddle a node boundary). Only counts are
  known here: this assumes the GPUs used fill nodes of that size in rank order;
- PP divides the layers;
- DP divides the global batch, which never changes; the micro-batch is then the largest
  divisor of global batch / DP that is at most the original micro-batch (a larger one might
  not fit in memory);
- with a per-GPU memory size, the estimate of ``estimate_bytes_per_gpu`` fits in it (the
  micro-batch is lowered further when that makes it fit).

A plan may use fewer GPUs than are available: 7 GPUs rarely split a model and a batch evenly.

Mode ``closest`` (default) ranks valid layouts by, in order:

1. more GPUs used;
2. the smallest change from the original layout, measured as
   ``|log2(TP/TP0)| + |log2(PP/PP0)|``: halving a dimension is as large a change as
   doubling it, because each changes the per-GPU model share by the same factor;
3. the larger micro-batch (fewer, larger steps: the original's throughput profile);
4. the larger TP x PP, which keeps per-GPU memory lowest: a relaunch that runs out of memory
   is a failed recovery, one that runs a little slower is not;
5. the larger TP (fewer pipeline stages, so a smaller pipeline bubble).

Since GPUs used, TP and PP fix DP, and the micro-batch follows from DP, this order is total.

Mode ``paper`` follows section III.E of the paper: maximise TP (heads % TP == 0), then PP
(GPUs % PP == 0), with TP x PP x DP = GPUs. That rule ignores the query groups, the hidden and
FFN sizes, the node boundary, the layer count, the global batch and memory, and it always uses
every GPU. Without those constraints Megatron refuses to start or the batch changes, so this
mode keeps every constraint above and only replaces the ranking: more GPUs used, then the
larger TP, then the larger PP.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterator, Sequence

from .megatron_args import ModelShape, OriginalLayout, read_script_args, rewrite_argv

MODES = ("closest", "paper")

# Mixed-precision Adam as in Megatron without the distributed optimizer: 2 bytes of
# half-precision weight, 4 of fp32 gradient, 4 + 4 + 4 of fp32 master weight, momentum and
# variance.
BYTES_PER_PARAMETER = 18
# Used for the embedding when --vocab-size is absent: GPT-2's BPE, Megatron's usual tokenizer.
ASSUMED_VOCAB_SIZE = 50257
GIB = 2**30


class PlanError(ValueError):
    """No layout fits; the message names the constraint that ruled them out."""


@dataclass(frozen=True)
class Layout:
    """One way to split the job: what the planner ranks."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    micro_batch_size: int
    global_batch_size: int

    @property
    def num_gpus(self) -> int:
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.data_parallel_size)


@dataclass(frozen=True)
class Plan:
    """The layout to relaunch with, and the rewritten training command."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    micro_batch_size: int
    global_batch_size: int
    num_gpus_used: int
    """TP x PP x DP: the ``--nproc-per-node`` of the relaunch; at most the GPUs available."""
    command: tuple[str, ...]
    """``(SCRIPT, *rewritten args)``."""

    def as_json(self) -> dict:
        """The object ``ftmaster plan --json`` prints (DESIGN's contract)."""
        return {**asdict(self), "command": list(self.command)}


def _divisors(n: int) -> list[int]:
    """Ascending; O(sqrt n), since a global batch can be in the millions."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def allowed_tensor_sizes(shape: ModelShape, gpus_per_node: int | None) -> list[int]:
    """TP sizes that split every TP-sharded dimension evenly and stay within one node.

    ``gpus_per_node`` None means a single node: only the GPU count then limits TP.
    """
    sharded = math.gcd(shape.num_attention_heads, shape.num_query_groups, shape.hidden_size,
                       shape.ffn_hidden_size)
    return [tp for tp in _divisors(sharded) if gpus_per_node is None or gpus_per_node % tp == 0]


def estimate_bytes_per_gpu(shape: ModelShape, tp: int, pp: int, micro_batch: int,
                           micro_batches_per_step: int) -> int:
    """A rough per-GPU memory estimate, in bytes, for the busiest (first) pipeline stage.

    It is an estimate, not a measurement: no CUDA context, workspace, fragmentation or
    communication buffers, and no distributed-optimizer sharding. Leave headroom.

    - parameters: per layer ``2h^2 + 2h*kv + 2h*f`` (Q and output projections, K and V with
      ``kv = h * groups / heads``, the two MLP matrices), split by TP; ``L / PP`` layers; plus
      the embedding ``V * h / TP`` (tied with the output layer, Megatron's default) and the
      position embedding ``s * h``; times
      ``BYTES_PER_PARAMETER``.
    - activations: Korthikanti et al. (2022) without sequence parallelism or recomputation,
      ``s*b*h*(10 + 24/TP + 5*a*s/(h*TP))`` bytes per layer, for ``L / PP`` layers and the
      ``min(PP, micro-batches per step)`` micro-batches that 1F1B keeps in flight on stage 1.
    """
    h, f = shape.hidden_size, shape.ffn_hidden_size
    a, s = shape.num_attention_heads, shape.seq_length
    kv = h * shape.num_query_groups // a
    vocab = shape.vocab_size or ASSUMED_VOCAB_SIZE
    layers_per_stage = shape.num_layers // pp
    layer_params = (2 * h * h + 2 * h * kv + 2 * h * f) / tp
    params = layers_per_stage * layer_params + vocab * h / tp + s * h
    layer_activations = s * micro_batch * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    in_flight = min(pp, micro_batches_per_step)
    return int(params * BYTES_PER_PARAMETER + layers_per_stage * in_flight * layer_activations)


def _micro_batch(shape: ModelShape, original: OriginalLayout, tp: int, pp: int, dp: int,
                 memory_bytes: float | None) -> int | None:
    """The largest micro-batch <= the original that divides global batch / DP and fits."""
    samples_per_replica = original.global_batch_size // dp
    for micro_batch in range(min(original.micro_batch_size, samples_per_replica), 0, -1):
        if samples_per_replica % micro_batch:
            continue
        steps = samples_per_replica // micro_batch
        if memory_bytes is None or estimate_bytes_per_gpu(shape, tp, pp, micro_batch,
                                                          steps) <= memory_bytes:
            return micro_batch
    return None


def _shape_layouts(gpus_available: int, gpus_per_node: int | None, shape: ModelShape,
                   original: OriginalLayout) -> Iterator[tuple[int, int, int]]:
    """Every (TP, PP, DP) that the shape, node size, batch and GPU count allow."""
    for tp in allowed_tensor_sizes(shape, gpus_per_node):
        for pp in _divisors(shape.num_layers):
            for dp in _divisors(original.global_batch_size):
                if tp * pp * dp <= gpus_available:
                    yield tp, pp, dp


def valid_layouts(gpus_available: int, gpus_per_node: int | None, shape: ModelShape,
                  original: OriginalLayout, gpu_memory_gb: float | None = None) -> list[Layout]:
    """Every layout that Megatron can run on at most ``gpus_available`` GPUs, unranked."""
    memory_bytes = None if gpu_memory_gb is None else gpu_memory_gb * GIB
    layouts = []
    for tp, pp, dp in _shape_layouts(gpus_available, gpus_per_node, shape, original):
        micro_batch = _micro_batch(shape, original, tp, pp, dp, memory_bytes)
        if micro_batch is not None:
            layouts.append(Layout(tp, pp, dp, micro_batch, original.global_batch_size))
    return layouts


def _closest_key(original: OriginalLayout):
    def key(layout: Layout):
        tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
        change = (abs(math.log2(tp / original.tensor_model_parallel_size))
                  + abs(math.log2(pp / original.pipeline_model_parallel_size)))
        return (-layout.num_gpus, round(change, 9), -layout.micro_batch_size, -tp * pp, -tp)
    return key


def _paper_key(layout: Layout):
    return (-layout.num_gpus, -layout.tensor_model_parallel_size,
            -layout.pipeline_model_parallel_size)


def _tensor_limits(shape: ModelShape, gpus_per_node: int | None) -> str:
    """Which sizes limit TP, and the TP sizes they allow, for error messages."""
    limits = (f"{shape.num_attention_heads} attention heads, {shape.num_query_groups} query "
              f"groups, hidden {shape.hidden_size}, FFN {shape.ffn_hidden_size}")
    if gpus_per_node is not None:
        limits += f", {gpus_per_node} GPUs per node"
    sizes = ",".join(map(str, allowed_tensor_sizes(shape, gpus_per_node)))
    return f"{limits} allow TP in {{{sizes}}}"


def _no_layout_message(gpus_available: int, gpus_per_node: int | None, shape: ModelShape,
                       original: OriginalLayout, gpu_memory_gb: float | None) -> str:
    head = f"no layout fits {gpus_available} GPUs"
    if gpus_available < 1:
        return f"{head}: at least one GPU is needed"
    # TP=PP=DP=1 with micro-batch 1 always passes the shape and batch rules, so memory binds.
    estimate, tp, pp, dp = min(
        (estimate_bytes_per_gpu(shape, tp, pp, 1, original.global_batch_size // dp), tp, pp, dp)
        for tp, pp, dp in _shape_layouts(gpus_available, gpus_per_node, shape, original))
    return (f"{head} in {gpu_memory_gb:g} GiB per GPU: the smallest memory estimate is "
            f"{estimate / GIB:.4g} GiB at TP{tp} PP{pp} DP{dp} micro-batch 1 "
            f"({_tensor_limits(shape, gpus_per_node)}); add GPUs or memory per GPU")


def choose_layout(gpus_available: int, gpus_per_node: int | None, shape: ModelShape,
                  original: OriginalLayout, *, mode: str = "closest",
                  gpu_memory_gb: float | None = None) -> Layout:
    """The best valid layout by ``mode`` (see the module docstring); PlanError when none fits."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ValueError(f"GPUs per node must be a positive integer, got {gpus_per_node}")
    if gpu_memory_gb is not None and gpu_memory_gb <= 0:
        raise ValueError(f"GPU memory must be positive, got {gpu_memory_gb:g} GiB")
    layouts = valid_layouts(gpus_available, gpus_per_node, shape, original, gpu_memory_gb)
    if not layouts:
        raise PlanError(_no_layout_message(gpus_available, gpus_per_node, shape, original,
                                           gpu_memory_gb))
    return min(layouts, key=_closest_key(original) if mode == "closest" else _paper_key)


def plan_layout(command: Sequence[str], gpus_available: int,
                gpus_per_node: int | None = None, *, mode: str = "closest",
                gpu_memory_gb: float | None = None, original_world_size: int | None = None) -> Plan:
    """Plan a relaunch of ``command`` (``[SCRIPT, *args]``) on the surviving GPUs.

    ``original_world_size`` is needed only when ``--global-batch-size`` is absent (see
    ``read_script_args``). Raises ValueError for bad arguments, PlanError when nothing fits.
    """
    if not command:
        raise ValueError("the training command is empty: give SCRIPT and its arguments")
    script, *args = command
    facts = read_script_args(args, original_world_size)
    layout = choose_layout(gpus_available, gpus_per_node, facts.shape, facts.original,
                           mode=mode, gpu_memory_gb=gpu_memory_gb)
    return Plan(layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                layout.data_parallel_size, layout.micro_batch_size, layout.global_batch_size,
                num_gpus_used=layout.num_gpus,
                command=(script, *rewrite_argv(args, layout)))
