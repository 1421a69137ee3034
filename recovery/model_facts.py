"""The model shape and the original layout, as read from a Megatron-LM argv.

Defaults follow Megatron-LM's ``megatron/training/arguments.py`` (``validate_args`` and the
argument definitions) so that a command means for the planner what it means for Megatron.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from .argv_flags import flag_present, flag_value, int_flag, require_positive, required_int_flag

TP_FLAG = "--tensor-model-parallel-size"
PP_FLAG = "--pipeline-model-parallel-size"
CP_FLAG = "--context-parallel-size"
EP_FLAG = "--expert-model-parallel-size"
ETP_FLAG = "--expert-tensor-parallel-size"
MICRO_BATCH_FLAG = "--micro-batch-size"
GLOBAL_BATCH_FLAG = "--global-batch-size"
EVAL_MICRO_BATCH_FLAG = "--eval-micro-batch-size"
EVAL_GLOBAL_BATCH_FLAG = "--eval-global-batch-size"
STEP_SCHEDULE_FLAG = "--step-batch-size-schedule"


@dataclass(frozen=True)
class ExpertShape:
    """The mixture-of-experts part of the model (``--num-experts`` and friends)."""

    num_experts: int
    """Routed experts per MoE layer; expert parallelism splits them."""
    ffn_hidden_size: int
    """``--moe-ffn-hidden-size`` (Megatron's default: ``--ffn-hidden-size``); expert TP splits it."""
    router_topk: int = 2
    """Experts each token is routed to (``--moe-router-topk``)."""
    shared_expert_size: int = 0
    """``--moe-shared-expert-intermediate-size``; 0 without shared experts."""
    moe_layers: int | None = None
    """Layers that are MoE layers (``--moe-layer-freq``); None: every layer."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "ffn_hidden_size", "router_topk"):
            require_positive(name, getattr(self, name))


@dataclass(frozen=True)
class ModelShape:
    """The model dimensions that limit how it can be split, and size its memory and compute."""

    num_layers: int
    """Transformer layers; pipeline stages split them."""
    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """MLP width; tensor parallelism splits it."""
    num_attention_heads: int
    """Attention heads; tensor parallelism splits them."""
    num_query_groups: int
    """Key/value groups: equal to the heads without grouped-query attention."""
    seq_length: int
    """Tokens per sample."""
    vocab_size: int | None = None
    """The tokenizer's vocabulary when the command says it (memory and compute only)."""
    kv_channels: int | None = None
    """``--kv-channels`` (the head size); None: hidden / heads, as Megatron derives it."""
    swiglu: bool = False
    """``--swiglu``: a gated MLP with three matrices."""
    untied_embeddings: bool = False
    """``--untie-embeddings-and-output-weights``: a separate output layer."""
    vocab_divisible_by: int = 128
    """``--make-vocab-size-divisible-by``; the vocabulary is padded to a multiple of it x TP."""
    position_embeddings: int = 0
    """Rows of a learned absolute position embedding (0 with rope or none)."""
    linear_bias: bool = True
    """False with ``--disable-bias-linear``."""
    experts: ExpertShape | None = None
    """The MoE part; None for a dense model."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "seq_length", "vocab_divisible_by"):
            require_positive(name, getattr(self, name))
        for name in ("vocab_size", "kv_channels"):
            if getattr(self, name) is not None:
                require_positive(name, getattr(self, name))
        # megatron/training/arguments.py validate_args: hidden % heads only without --kv-channels.
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden size {self.hidden_size} is not divisible by "
                             f"{self.num_attention_heads} attention heads (give --kv-channels)")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"{self.num_attention_heads} attention heads are not divisible "
                             f"by {self.num_query_groups} query groups")

    @property
    def head_size(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_parallel: int, assumed_vocab: int) -> int:
        """Megatron's ``_vocab_size_with_padding``: a multiple of divisible-by x TP."""
        multiple = self.vocab_divisible_by * tensor_parallel
        return math.ceil((self.vocab_size or assumed_vocab) / multiple) * multiple


@dataclass(frozen=True)
class OriginalLayout:
    """How the job was split before the failure: what the planner stays close to."""

    tensor_model_parallel_size: int
    """``--tensor-model-parallel-size``."""
    pipeline_model_parallel_size: int
    """``--pipeline-model-parallel-size``."""
    micro_batch_size: int
    """The largest micro-batch the planner will use: a larger one might not fit in memory."""
    global_batch_size: int
    """Kept by every plan unless a tolerance allows another (then within it)."""
    context_parallel_size: int = 1
    """``--context-parallel-size``."""
    expert_model_parallel_size: int = 1
    """``--expert-model-parallel-size``."""
    expert_tensor_parallel_size: int | None = None
    """``--expert-tensor-parallel-size`` when given; None: it follows TP, as in Megatron."""
    eval_micro_batch_size: int | None = None
    """``--eval-micro-batch-size`` when given; None: Megatron uses the micro-batch."""
    eval_global_batch_size: int | None = None
    """``--eval-global-batch-size`` when given; None: Megatron uses the global batch."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "micro_batch_size", "global_batch_size", "context_parallel_size",
                     "expert_model_parallel_size"):
            require_positive(name, getattr(self, name))

    @property
    def model_parallel_size(self) -> int:
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size)

    def describe(self) -> str:
        """The layout and batch, as a message names them."""
        cp, ep = self.context_parallel_size, self.expert_model_parallel_size
        return (f"TP {self.tensor_model_parallel_size} x PP {self.pipeline_model_parallel_size}"
                + (f" x CP {cp}" if cp > 1 else "") + (f", EP {ep}" if ep > 1 else "")
                + f" with micro-batch {self.micro_batch_size} and global batch "
                  f"{self.global_batch_size}")


def default_ffn_hidden_size(hidden: int, swiglu: bool) -> int:
    """megatron/training/arguments.py validate_args: ``int((4 * h * 2 / 3) / 64) * 64`` with
    ``--swiglu``, else ``4 * h``."""
    return int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden


_LAYER_PATTERN = re.compile(r"^\(?((?:\[[01]\]\*\d+\+?)+)\)?(?:\*(\d+))?$")


def moe_layer_count(freq: str | None, num_layers: int) -> int | None:
    """MoE layers for ``--moe-layer-freq``: an int N (every N-th layer, Megatron's
    ``moe_layer_pattern``) or a pattern like ``([0]*1+[1]*15)``; None when not understood.
    ValueError for a pattern of another length than ``num_layers``, which Megatron-LM
    asserts against (ours counted negative dense layers for a longer one)."""
    if freq is None:
        return num_layers
    text = freq.replace(" ", "")
    if text.isdigit() and int(text) > 0:
        return sum(1 for layer in range(num_layers) if layer % int(text) == 0)
    match = _LAYER_PATTERN.match(text)
    if not match:
        return None
    pieces = re.findall(r"\[([01])\]\*(\d+)", match.group(1))
    repeat = int(match.group(2) or 1)
    length = repeat * sum(int(count) for _, count in pieces)
    if length != num_layers:
        raise ValueError(f"--moe-layer-freq {freq} gives {length} layers, where --num-layers "
                         f"is {num_layers}")
    return repeat * sum(int(count) for kind, count in pieces if kind == "1")


def _query_groups(args: Sequence[str], heads: int) -> int:
    # As in Megatron-LM: without --group-query-attention every head is its own group.
    if not flag_present(args, "--group-query-attention"):
        return heads
    # Megatron-LM's --num-query-groups defaults to 1 (multi-query attention)
    return int_flag(args, "--num-query-groups", 1)


def _read_experts(args: Sequence[str], ffn: int, num_layers: int) -> ExpertShape | None:
    experts = int_flag(args, "--num-experts", positive=False)
    if not experts:  # Megatron: --num-experts 0 means a dense model
        return None
    return ExpertShape(
        num_experts=experts,
        ffn_hidden_size=int_flag(args, "--moe-ffn-hidden-size", ffn),
        router_topk=int_flag(args, "--moe-router-topk", 2),
        shared_expert_size=int_flag(args, "--moe-shared-expert-intermediate-size", 0,
                                    positive=False),
        moe_layers=moe_layer_count(flag_value(args, "--moe-layer-freq"), num_layers))


BYTE_LEVEL_VOCAB_SIZE = 257
"""The trainer's ``ByteLevelTokenizer``: 256 bytes and end-of-document."""


def _tokenizer_vocab_size(args: Sequence[str]) -> int | None:
    """The vocabulary the tokenizer builds, which Megatron pads: ``NullTokenizer`` adds its
    end-of-document id to ``--vocab-size`` (Megatron-LM's does too). None: unknown (a
    tokenizer file's)."""
    kind = flag_value(args, "--tokenizer-type")
    if kind is None and flag_present(args, "--mock-data"):
        kind = "NullTokenizer"  # the trainer's default with mock data
    vocab = int_flag(args, "--vocab-size")
    if kind == "NullTokenizer" and vocab is not None:
        return vocab + 1
    if kind == "ByteLevelTokenizer":
        return BYTE_LEVEL_VOCAB_SIZE
    return vocab


def read_model_shape(args: Sequence[str]) -> ModelShape:
    hidden = required_int_flag(args, "--hidden-size")
    heads = required_int_flag(args, "--num-attention-heads")
    layers = required_int_flag(args, "--num-layers")
    swiglu = flag_present(args, "--swiglu")
    ffn = int_flag(args, "--ffn-hidden-size") or default_ffn_hidden_size(hidden, swiglu)
    seq = required_int_flag(args, "--seq-length")
    learned = flag_value(args, "--position-embedding-type") in (None, "learned_absolute")
    return ModelShape(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=_query_groups(args, heads), seq_length=seq,
        vocab_size=_tokenizer_vocab_size(args), kv_channels=int_flag(args, "--kv-channels"),
        swiglu=swiglu, untied_embeddings=flag_present(args, "--untie-embeddings-and-output-weights"),
        vocab_divisible_by=int_flag(args, "--make-vocab-size-divisible-by", 128),
        position_embeddings=(int_flag(args, "--max-position-embeddings", seq) if learned else 0),
        linear_bias=not flag_present(args, "--disable-bias-linear"),
        experts=_read_experts(args, ffn, layers))


def _derived_global_batch(micro_batch: int, model_parallel_label: str,
                          original_world_size: int | None, model_parallel: int) -> int:
    """Megatron's default global batch: micro-batch x DP of the original launch."""
    if original_world_size is None:
        raise ValueError(f"{GLOBAL_BATCH_FLAG} is absent, so it is {MICRO_BATCH_FLAG} "
                         f"{micro_batch} x the data-parallel size of the original launch: give "
                         f"--original-gpus N or add {GLOBAL_BATCH_FLAG}")
    if original_world_size % model_parallel:
        raise ValueError(f"the original {original_world_size} GPUs are not a multiple of "
                         f"{model_parallel_label} = {model_parallel}")
    return micro_batch * (original_world_size // model_parallel)


def read_original_layout(args: Sequence[str], original_world_size: int | None,
                         scheduled_batch: int | None) -> OriginalLayout:
    """The layout of ``args``; ``scheduled_batch`` is the batch a step schedule prescribes."""
    tp, pp = int_flag(args, TP_FLAG, 1), int_flag(args, PP_FLAG, 1)
    cp = int_flag(args, CP_FLAG, 1)
    micro_batch = required_int_flag(args, MICRO_BATCH_FLAG)
    global_batch = int_flag(args, GLOBAL_BATCH_FLAG)
    if global_batch is None:
        global_batch = scheduled_batch or _derived_global_batch(
            micro_batch, "TP x PP x CP" if cp > 1 else "TP x PP", original_world_size,
            tp * pp * cp)
    return OriginalLayout(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        micro_batch_size=micro_batch, global_batch_size=global_batch, context_parallel_size=cp,
        expert_model_parallel_size=int_flag(args, EP_FLAG, 1),
        expert_tensor_parallel_size=int_flag(args, ETP_FLAG),
        eval_micro_batch_size=int_flag(args, EVAL_MICRO_BATCH_FLAG),
        eval_global_batch_size=int_flag(args, EVAL_GLOBAL_BATCH_FLAG))
