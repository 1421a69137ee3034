"""Megatron-LM-compatible command-line arguments, validated before anything starts.

Names and meanings follow Megatron-LM, including the flags of its Llama and GPT recipes.
Arguments that are ours are marked so in their help. Any problem raises ``ArgumentError``
with one line naming what is wrong and what to do; ``pretrain_gpt.py`` prints it and exits
with status 2.

Schedules run on samples, as Megatron-LM's do internally: iteration arguments
(``--train-iters``, ``--lr-decay-iters``, ``--lr-warmup-iters``) are multiplied by the global
batch, sample arguments (``--train-samples``, ``--lr-decay-samples``,
``--lr-warmup-samples``) are taken as they are. With ``--train-samples`` training runs until
the consumed samples reach it, whatever the global batch was before a resume: that is how a
relaunch at another global batch (``ftmaster plan --global-batch-tolerance``) ends the run at
the same sample count.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from pathlib import Path

from ftmaster.recovery.checkpoints import NON_PERSISTENT_SUBDIR
from ftmaster.recovery.model_facts import default_ffn_hidden_size
from ftmaster.recovery.training_values import (check_dropout, check_eval_interval,
                                               check_learning_rate, check_log_interval,
                                               check_lr_schedule, check_positions,
                                               check_save_interval, check_schedule_unit,
                                               check_weight_decay)

from .tensorboard import NEEDS_PACKAGE, tensorboard_installed

TOKENIZER_TYPES = ("NullTokenizer", "GPT2BPETokenizer", "ByteLevelTokenizer")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
MAX_DISTRIBUTED_TIMEOUT_MINUTES = 10**7
MIN_DISTRIBUTED_TIMEOUT_MINUTES = 0.1  # 6 s: a store connection, a rank's start
"""19 years, below where torch's timeout in nanoseconds overflows (int64: 1.5e8 minutes)."""


class ArgumentError(ValueError):
    """A bad command line or an impossible combination of arguments."""


class _StrictParser(argparse.ArgumentParser):
    def error(self, message):
        raise ArgumentError(message)


def _add_model_args(parser):
    group = parser.add_argument_group("model")
    group.add_argument("--num-layers", type=int, required=True)
    group.add_argument("--hidden-size", type=int, required=True)
    group.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="default: 4 x hidden; with --swiglu int(8 x hidden / 3 / 64) x 64")
    group.add_argument("--num-attention-heads", type=int, required=True)
    group.add_argument("--kv-channels", type=int, default=None,
                       help="projection size per head; default: hidden / heads")
    group.add_argument("--group-query-attention", action="store_true")
    group.add_argument("--num-query-groups", type=int, default=None)
    group.add_argument("--swiglu", action="store_true")
    group.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    group.add_argument("--norm-epsilon", type=float, default=1e-5)
    group.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "none"),
                       default="learned_absolute")
    group.add_argument("--rotary-base", type=int, default=10000)
    group.add_argument("--rotary-percent", type=float, default=1.0)
    group.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    group.add_argument("--attention-softmax-in-fp32", action="store_true")
    group.add_argument("--transformer-impl", choices=("transformer_engine", "local"),
                       default="transformer_engine",
                       help="Transformer Engine's layers on CUDA when it is installed, else local")
    for fusion in ("masked-softmax", "bias-swiglu", "bias-gelu", "bias-dropout", "rope",
                   "gradient-accumulation"):
        group.add_argument(f"--no-{fusion}-fusion", action="store_false",
                           dest=f"{fusion.replace('-', '_')}_fusion",
                           help="(fused kernels run on CUDA only)")
    group.add_argument("--seq-length", type=int, required=True)
    group.add_argument("--max-position-embeddings", type=int, default=None,
                       help="default: --seq-length")
    group.add_argument("--hidden-dropout", type=float, default=0.1)
    group.add_argument("--attention-dropout", type=float, default=0.1)
    group.add_argument("--init-method-std", type=float, default=0.02)
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--fp16", action="store_true")


def _add_parallel_args(parser):
    group = parser.add_argument_group("parallelism")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    group.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    group.add_argument("--use-distributed-optimizer", action="store_true", default=None,
                       help="shard optimizer state over data-parallel ranks (ZeRO-1); default on "
                            "with CUDA")
    group.add_argument("--no-use-distributed-optimizer", action="store_false",
                       dest="use_distributed_optimizer", help="ours: the opt-out")
    group.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                       help="Megatron-LM's partial distributed optimizer: the optimizer state is "
                            "sharded within each of N instances and replicated across them "
                            "(needs the distributed optimizer; DP x CP must divide by N)")
    group.add_argument("--overlap-grad-reduce", action="store_true", default=None,
                       help="default on with CUDA and the distributed optimizer")
    group.add_argument("--no-overlap-grad-reduce", action="store_false",
                       dest="overlap_grad_reduce", help="ours: the opt-out")
    group.add_argument("--overlap-param-gather", action="store_true", default=None,
                       help="needs the distributed optimizer; default on with it on CUDA")
    group.add_argument("--no-overlap-param-gather", action="store_false",
                       dest="overlap_param_gather", help="ours: the opt-out")
    group.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                       help="accepted: ftmaster always saves the distributed optimizer fully "
                            "reshardable, so a checkpoint resumes under any TP/PP/DP")
    group.add_argument("--distrib-optim-fully-reshardable-mem-efficient", action="store_true",
                       help="gather the optimizer state to DP rank 0 over gloo to save, rather "
                            "than on every DP rank")
    group.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    group.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    group.add_argument("--recompute-num-layers", type=int, default=None)


def _add_training_args(parser):
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=int, required=True)
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="default: micro-batch size x data-parallel size")
    group.add_argument("--train-iters", type=int, default=None)
    group.add_argument("--train-samples", type=int, default=None)
    group.add_argument("--lr", type=float, required=True)
    group.add_argument("--min-lr", type=float, default=0.0)
    group.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear")
    group.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    group.add_argument("--lr-decay-samples", type=int, default=None,
                       help="default: --train-samples")
    group.add_argument("--lr-warmup-iters", type=int, default=0)
    group.add_argument("--lr-warmup-samples", type=int, default=0)
    group.add_argument("--override-opt-param-scheduler", action="store_true",
                       help="on resume, follow the LR/WD schedule of these arguments")
    group.add_argument("--use-checkpoint-opt-param-scheduler", action="store_true",
                       help="on resume, keep the checkpoint's LR/WD schedule")
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                       dest="check_for_nan_in_loss_and_grad",
                       help="do not stop an iteration whose loss or gradient norm is NaN/Inf "
                            "before its update (the check is on by default, as in Megatron-LM)")
    group.add_argument("--exit-interval", type=int, default=None,
                       help="exit (after a checkpoint, with --save) when the iteration is a "
                            "multiple of this")
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--log-interval", type=int, default=100)
    group.add_argument("--tensorboard-dir", default=None,
                       help="write TensorBoard scalars here (Megatron-LM's names), from the last "
                            "rank; a relaunch continues the same curves")
    group.add_argument("--tensorboard-log-interval", type=int, default=1)
    group.add_argument("--tensorboard-queue-size", type=int, default=1000,
                       help="events queued before the writer flushes them to disk")
    group.add_argument("--eval-iters", type=int, default=100)
    group.add_argument("--eval-interval", type=int, default=1000)


def _add_data_args(parser):
    group = parser.add_argument_group("data")
    group.add_argument("--mock-data", action="store_true")
    group.add_argument("--data-path", nargs="+", default=None)
    group.add_argument("--split", default="969,30,1")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    group.add_argument("--vocab-size", type=int, default=None)
    group.add_argument("--vocab-file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--data-cache-path", default=None)


def _add_checkpoint_args(parser):
    group = parser.add_argument_group("checkpointing")
    group.add_argument("--save", default=None)
    group.add_argument("--load", default=None)
    group.add_argument("--save-interval", type=int, default=None)
    group.add_argument("--async-save", action="store_true")
    group.add_argument("--async-save-timeout", type=float, default=None, metavar="SECONDS",
                       help="ours: an async save whose writers have not finished after this "
                            "long is stopped and fails, so that a writer stuck on the file "
                            "system holds up no later save (default: 10x the longest async "
                            "save so far, at least 600, and this rank's share of a checkpoint "
                            "at 10 MB/s)")
    group.add_argument("--ckpt-format", choices=("torch_dist",), default="torch_dist")
    group.add_argument("--ckpt-assume-constant-structure", action="store_true",
                       help="Megatron-LM's: keep the save plan from save to save without checking "
                            "(by default it is kept only while every rank's state keeps its "
                            "structure)")
    group.add_argument("--no-load-optim", action="store_true")
    group.add_argument("--no-load-rng", action="store_true")
    group.add_argument("--exit-signal-handler", action="store_true")
    group.add_argument("--emergency-save-gap-frac", type=float, default=0.25,
                       help="ours: an emergency save needs at least ceil(frac x save interval) "
                            "iterations since the last checkpoint; 0 disables the filter")
    group.add_argument("--emergency-save-flag-dir", default=None,
                       help="ours: folder watched for save_now.flag (default: "
                            "$FTMASTER_RUN_DIR/flags)")
    group.add_argument("--non-persistent-ckpt-type", choices=("global", "local", "in_memory"),
                       default=None, help="global: a memory tier of checkpoints in the same "
                                          "layout, its own tracker (local, in_memory: refused)")
    group.add_argument("--non-persistent-global-ckpt-dir", default=None,
                       help="the memory tier's folder (default: SAVE/non_persistent, as in "
                            "Megatron-LM; ftmaster launch picks one in /dev/shm)")
    group.add_argument("--non-persistent-save-interval", type=int, default=None,
                       help="a save into the memory tier every N iterations")
    group.add_argument("--replica-recovery", action="store_true",
                       help="ours: when a rank dies, its surviving data-parallel replicas dump "
                            "their state and ftmaster merges a checkpoint of the last completed "
                            "iteration (needs the memory tier and DP >= 2; with the distributed "
                            "optimizer, --num-distributed-optimizer-instances 2 or more)")
    group.add_argument("--keep-emergency", type=int, default=None,
                       help="ours: keep only the newest N emergency checkpoints that a newer "
                            "regular checkpoint supersedes (default: keep all)")


def build_parser() -> argparse.ArgumentParser:
    parser = _StrictParser(prog="pretrain_gpt.py", allow_abbrev=False,
                           description="Megatron-LM-compatible GPT pretraining on megatron-core.")
    _add_model_args(parser)
    _add_parallel_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    _add_checkpoint_args(parser)
    return parser


def parse_args(argv: list[str], world_size: int | None = None) -> argparse.Namespace:
    """Parse and validate ``argv``; ``world_size`` defaults to ``$WORLD_SIZE`` or 1."""
    args = build_parser().parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    _fill_defaults(args)
    try:
        validate_args(args)
    except OSError as error:  # a path that cannot be looked at: a name too long, no permission
        raise ArgumentError(f"{error.filename}: {error.strerror}") from None
    return args


def _real(path) -> str:
    """``path`` with its links resolved; a symlink loop stays as it is (``Path.resolve`` raised
    RuntimeError there, a traceback)."""
    return os.path.realpath(path)


def _fill_defaults(args):
    if not args.add_bias_linear:  # Megatron-LM's validate_args: no bias to fuse into GeLU
        args.bias_gelu_fusion = False
    if args.ffn_hidden_size is None and args.hidden_size:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    elif args.num_query_groups is None:
        args.num_query_groups = 1  # Megatron-LM's default: multi-query attention
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    args.data_parallel_size = args.world_size // model_parallel if model_parallel > 0 else 0
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.tokenizer_type is None and args.mock_data:
        args.tokenizer_type = "NullTokenizer"
    args.virtual_pipeline_model_parallel_size = _virtual_stages(args)
    # kept: left to its default, the optimizer may follow a plain checkpoint (optimizer_choice)
    args.distributed_optimizer_by_default = args.use_distributed_optimizer is None
    if args.distributed_optimizer_by_default:
        args.use_distributed_optimizer = default_distributed_optimizer(args)
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # Megatron-LM's validate_args: nothing to split
    _samples_from_iterations(args)


def _virtual_stages(args) -> int | None:
    """Model chunks per pipeline rank; None for one, as Megatron-LM's validate_args makes it:
    a VPP of 1 selected the interleaved schedule with one chunk, which refused PP 1 and
    micro-batch counts the plain schedule runs (``ftmaster plan`` writes such flags when a
    relaunch drops the pipeline)."""
    stages = _asked_virtual_stages(args)
    return None if stages == 1 else stages


def _asked_virtual_stages(args) -> int | None:
    """Model chunks per pipeline rank (Megatron-LM's two ways to ask for them); None when
    none are asked for, or the layers do not divide into them."""
    if args.num_virtual_stages_per_pipeline_rank:
        return args.num_virtual_stages_per_pipeline_rank
    per_stage = args.num_layers_per_virtual_pipeline_stage
    pp = args.pipeline_model_parallel_size
    if per_stage and pp and args.num_layers and args.num_layers % (pp * per_stage) == 0:
        return args.num_layers // pp // per_stage
    return None


def _samples_from_iterations(args) -> None:
    """The schedule in samples: iteration arguments times the global batch. As in Megatron-LM's
    validate_args, the schedule is in the unit of the training length."""
    _require((args.train_iters is None) != (args.train_samples is None),
             "give exactly one of --train-iters and --train-samples")
    unit = "samples" if args.train_iters is None else "iters"
    _apply(check_schedule_unit, unit, lambda name: getattr(args, name.replace("-", "_")))
    _validate_schedule_as_given(args, unit)
    batch = args.global_batch_size or 0
    if args.train_samples is None and args.train_iters is not None:
        args.train_samples = args.train_iters * batch
    if args.lr_decay_samples is None:
        args.lr_decay_samples = (args.lr_decay_iters * batch if args.lr_decay_iters
                                 else args.train_samples)
    if not args.lr_warmup_samples:
        args.lr_warmup_samples = args.lr_warmup_iters * batch


def _validate_schedule_as_given(args, unit: str) -> None:
    """The schedule's lengths in the user's unit and values, before the sample forms are
    derived (a derived length would be named as if given)."""
    # A negative decay was blamed on "--train-iters 0"; a negative warm-up was taken (none)
    for name in ("train_iters", "train_samples", "lr_decay_iters", "lr_decay_samples",
                 "lr_warmup_iters", "lr_warmup_samples"):
        value = getattr(args, name)
        _require(value is None or value >= 0, f"--{name.replace('_', '-')} must be >= 0, got {value}")
    _apply(check_lr_schedule, unit, *(getattr(args, f"{name}_{unit}")
                                      for name in ("train", "lr_decay", "lr_warmup")))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentError(message)


def _apply(rule, *values) -> None:
    """One of the rules ``ftmaster plan`` and ``launch`` apply too, refused as here."""
    try:
        rule(*values)
    except ValueError as problem:
        raise ArgumentError(str(problem)) from None


def validate_args(args: argparse.Namespace) -> None:
    """Reject impossible combinations with one line each, before any process group exists."""
    _validate_positive(args)
    _validate_model_numbers(args)
    _validate_adam(args)
    # gloo refused a negative one, timedelta a nan, infinite or too large one, and torch's
    # nanoseconds overflowed past 1.5e8 minutes (its store "timed out after -8e15 ms"):
    # tracebacks at the launch
    # 0 (or a few milliseconds) timed the store's connection out at once: a traceback too
    _require_number(args, "distributed_timeout_minutes",
                    lambda minutes: MIN_DISTRIBUTED_TIMEOUT_MINUTES <= minutes
                    <= MAX_DISTRIBUTED_TIMEOUT_MINUTES,
                    "a number of minutes from 0.1 to 10^7")
    _validate_world_size(args)
    _validate_layout(args)
    _validate_batch(args)
    _validate_schedule(args)
    _validate_data(args)
    _validate_folders_given(args)
    _validate_checkpointing(args)
    _require(args.tensorboard_dir is None or tensorboard_installed(), NEEDS_PACKAGE)
    # The writer makes it on the last rank only, after the model is built: a traceback there
    _require(args.tensorboard_dir is None or _is_writable_dir(Path(args.tensorboard_dir)),
             f"--tensorboard-dir {args.tensorboard_dir} is not writable: choose a directory you "
             f"can write to")


def _validate_positive(args):
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "ffn_hidden_size", "num_query_groups",
                 "tensorboard_log_interval", "tensorboard_queue_size",
                 "make_vocab_size_divisible_by"):
        value = getattr(args, name)
        _require(value is not None and value > 0,
                 f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    for name in ("kv_channels", "num_layers_per_virtual_pipeline_stage",
                 "num_virtual_stages_per_pipeline_rank", "recompute_num_layers"):
        value = getattr(args, name)
        _require(value is None or value > 0,
                 f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    _apply(check_log_interval, args.log_interval)
    # a negative one was taken: an exit at multiples of its absolute value
    _require(args.exit_interval is None or args.exit_interval >= 0,
             f"--exit-interval must be >= 0, got {args.exit_interval}")


def _validate_model_numbers(args):
    """Values torch refuses only once the model is built, with a traceback from deep inside
    megatron-core (NaN fails every comparison, so it is refused too)."""
    for name in ("hidden_dropout", "attention_dropout"):
        _apply(check_dropout, f"--{name.replace('_', '-')}", getattr(args, name))
    _require_number(args, "init_method_std", lambda std: 0 <= std < math.inf,
                    "a finite standard deviation >= 0")
    # Taken as given, these made the first loss NaN, blamed on the training ("non-finite loss")
    _require_number(args, "norm_epsilon", lambda eps: 0 <= eps < math.inf, "a finite number >= 0")
    _require_number(args, "rotary_base", lambda base: base > 0, "a positive integer")
    # megatron-core checks only < 1: below 0 it failed building the model, a traceback
    _require_number(args, "rotary_percent", lambda share: share >= 0, "a number >= 0")


def _validate_adam(args):
    """torch's Adam rules, which it raised only as the optimizer was built (a traceback)."""
    for name in ("adam_beta1", "adam_beta2"):
        _require_number(args, name, lambda beta: 0 <= beta < 1, "in [0, 1)")
    _require_number(args, "adam_eps", lambda eps: 0 <= eps < math.inf, "a finite number >= 0")
    _apply(check_weight_decay, args.weight_decay)
    # Megatron-LM takes an infinite one, whose first update leaves every weight non-finite
    _require_number(args, "weight_decay", math.isfinite, "a finite number")


def _require_number(args, name: str, allowed, wanted: str) -> None:
    value = getattr(args, name)
    _require(allowed(value), f"--{name.replace('_', '-')} must be {wanted}, got {value}")


def _validate_world_size(args):
    """First of the layout checks: the data-parallel size and the default global batch
    derive from it, and would otherwise fail with a misleading message."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _require(args.world_size % (tp * pp) == 0,
             f"world size {args.world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) "
             f"parallel size: launch a multiple of {tp * pp} processes")


def _validate_layout(args):
    """Megatron-LM's own rules for the flags this trainer builds (the planner's
    ``ftmaster.recovery.layout_rules`` cites where Megatron-LM checks each)."""
    tp = args.tensor_model_parallel_size
    heads, groups = args.num_attention_heads, args.num_query_groups
    for name in ("num_attention_heads", "ffn_hidden_size"):
        value = getattr(args, name)
        _require(value % tp == 0,
                 f"--{name.replace('_', '-')} ({value}) is not divisible by "
                 f"--tensor-model-parallel-size ({tp})")
    _require(heads % groups == 0,
             f"--num-attention-heads ({heads}) is not divisible by --num-query-groups ({groups})")
    _require(groups % tp == 0 or tp % groups == 0,
             f"--num-query-groups ({groups}) must be a multiple or a divisor of "
             f"--tensor-model-parallel-size ({tp})")
    if args.kv_channels is None:
        _require(args.hidden_size % heads == 0,
                 f"--hidden-size ({args.hidden_size}) is not divisible by --num-attention-heads "
                 f"({heads}); give --kv-channels for another head size")
        args.kv_channels = args.hidden_size // heads
    _validate_pipeline(args)
    # Megatron-LM's _set_random_seed refuses a seed that is not positive (initialize.py:
    # "Seed (0) should be a positive integer."); above, numpy's range for every pipeline
    # rank's seed (--seed + 100 x its rank), where numpy.random.seed raised a traceback once
    # the process group was up
    top = 2**32 - 1 - 100 * (args.pipeline_model_parallel_size - 1)
    _require(1 <= args.seed <= top, f"--seed must be between 1 and {top}, got {args.seed}")
    _apply(check_positions, args.seq_length, args.max_position_embeddings)
    _require(not args.sequence_parallel or args.seq_length % tp == 0,
             f"--sequence-parallel splits the sequence over TP: --seq-length ({args.seq_length}) "
             f"is not divisible by --tensor-model-parallel-size ({tp})")
    _validate_recompute(args)
    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are mutually exclusive")
    # Megatron-LM's validate_args asserts the same.
    _require(not args.overlap_param_gather or args.use_distributed_optimizer,
             "--overlap-param-gather needs the distributed optimizer (it gathers its shards)")
    _validate_optimizer_instances(args)
    _require(not args.fp16 or _cuda_available(),
             "--fp16 needs CUDA (its loss scaling is not tried on CPU); use --bf16 or fp32 on CPU")


def _validate_recompute(args):
    """megatron-core's TransformerConfig refuses full without a method, and its uniform method
    indexes past the chunk's last layer (IndexError) when the groups do not tile it: tracebacks
    once the model is built."""
    method = args.recompute_method
    _require(method is None or args.recompute_granularity == "full",
             "--recompute-method needs --recompute-granularity full")
    _require(method is not None or args.recompute_granularity != "full",
             "--recompute-granularity full needs --recompute-method uniform or block")
    layers = args.num_layers // (args.pipeline_model_parallel_size
                                 * (args.virtual_pipeline_model_parallel_size or 1))
    group = args.recompute_num_layers or 1
    _require(method != "uniform" or layers % group == 0,
             f"--recompute-method uniform recomputes groups of --recompute-num-layers ({group}) "
             f"layers, which must divide the {layers} layers of each pipeline chunk")


def _validate_optimizer_instances(args):
    """Megatron-LM's rules for the partial distributed optimizer: megatron-core's
    ``DistributedDataParallel`` asserts "Partial DistOpt cannot be used without DistOpt", and
    ``parallel_state.initialize_model_parallel`` that DP x CP divides by the instances (CP is
    1 here)."""
    instances, dp = args.num_distributed_optimizer_instances, args.data_parallel_size
    _require(instances >= 1, f"--num-distributed-optimizer-instances must be at least 1, not {instances}")
    _require(instances == 1 or args.use_distributed_optimizer,
             "--num-distributed-optimizer-instances above 1 needs the distributed optimizer "
             "(--use-distributed-optimizer): each instance shards the optimizer state")
    _require(dp % instances == 0,
             f"--num-distributed-optimizer-instances ({instances}) must divide the data-parallel "
             f"size ({dp})")


def _validate_pipeline(args):
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    per_stage = args.num_layers_per_virtual_pipeline_stage
    _require(not (per_stage and args.num_virtual_stages_per_pipeline_rank),
             "give one of --num-layers-per-virtual-pipeline-stage and "
             "--num-virtual-stages-per-pipeline-rank")
    _require(not per_stage or _asked_virtual_stages(args) is not None,
             f"--num-layers ({args.num_layers}) is not divisible by --pipeline-model-parallel-size "
             f"({pp}) x --num-layers-per-virtual-pipeline-stage ({per_stage})")
    chunks = pp * (vpp or 1)
    split = (f"--pipeline-model-parallel-size ({pp})" if not vpp else
             f"the {chunks} pipeline chunks (--pipeline-model-parallel-size {pp} x {vpp} "
             f"virtual stages)")
    _require(args.num_layers % chunks == 0,
             f"--num-layers ({args.num_layers}) is not divisible by {split}")
    _require(not vpp or pp > 1,
             "a virtual pipeline (interleaved schedule) needs --pipeline-model-parallel-size > 1")


def _validate_batch(args):
    _require(args.global_batch_size > 0,
             f"--global-batch-size must be a positive integer, got {args.global_batch_size}")
    per_step = args.micro_batch_size * args.data_parallel_size
    _require(args.global_batch_size % per_step == 0,
             f"--global-batch-size ({args.global_batch_size}) is not divisible by "
             f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
             f"({args.data_parallel_size})")
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    micro_batches = args.global_batch_size // per_step
    # megatron-core's forward_backward_pipelining_with_interleaving (groups of PP micro-batches)
    _require(not vpp or (micro_batches >= pp and micro_batches % pp == 0),
             f"the interleaved schedule needs the {micro_batches} micro-batches per step to be a "
             f"multiple of --pipeline-model-parallel-size ({pp})")


def _validate_schedule(args):
    _apply(check_learning_rate, args.lr, args.min_lr)
    # Megatron-LM takes it, then its first update makes every weight non-finite: a NaN loss
    # at iteration 2, relaunched once before ftmaster gave up
    _require_number(args, "lr", math.isfinite, "a finite number")
    if args.save_interval is not None:
        _apply(check_save_interval, args.save_interval)
    _require(args.eval_iters >= 0, f"--eval-iters must be >= 0, got {args.eval_iters}")
    _apply(check_eval_interval, args.eval_interval)
    _require(args.eval_iters == 0 or args.eval_interval > 0,
             f"--eval-interval must be a positive integer, got {args.eval_interval} "
             f"(or pass --eval-iters 0)")
    _require(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
             "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are "
             "mutually exclusive")


def _validate_data(args):
    _require(args.mock_data != bool(args.data_path),
             "give exactly one of --mock-data or --data-path PREFIX")
    _require(args.tokenizer_type is not None,
             f"--data-path needs --tokenizer-type, the one tools/preprocess_data.py used "
             f"({', '.join(TOKENIZER_TYPES[1:])})")
    _validate_split(args)
    # megatron-core writes its index cache there, and wraps a failure in a bare Exception
    _require(args.data_cache_path is None or _is_writable_dir(Path(args.data_cache_path)),
             f"--data-cache-path {args.data_cache_path} is not a folder you can write to")
    if args.tokenizer_type == "NullTokenizer":
        _require(args.vocab_size is not None and args.vocab_size > 1,
                 "--tokenizer-type NullTokenizer needs --vocab-size N (N > 1)")
    if args.tokenizer_type == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            _require(path is not None and Path(path).is_file(),
                     f"GPT2BPETokenizer needs {flag} pointing to an existing file, got {path}")
    for prefix in _data_prefixes(args.data_path or []):
        for suffix in (".bin", ".idx"):
            _require(Path(prefix + suffix).is_file(),
                     f"--data-path: {prefix + suffix} does not exist; build it with "
                     f"tools/preprocess_data.py")


def _validate_split(args):
    """Megatron's ``--split``: up to three non-negative weights (train, valid, test) separated
    by commas or slashes; training needs a train part, and without a validation part there
    is no evaluation."""
    parts = args.split.replace("/", ",").split(",")
    try:
        # Plain decimals only: megatron-core reads the runs of digits and dots, so 1e2,1 would
        # split 1:2:1 there and 1e2,1,1 would be four numbers (an AssertionError).
        weights = [float(part) for part in parts if re.fullmatch(r"\s*[0-9.]+\s*", part)]
    except ValueError:
        weights = []
    _require(0 < len(weights) == len(parts) <= 3 and all(map(math.isfinite, weights)),
             f"--split must be up to three non-negative numbers such as 969,30,1, got {args.split!r}")
    weights += [0.0] * (3 - len(weights))
    _require(weights[0] > 0, f"--split {args.split!r} leaves no training data")
    if weights[1] == 0:
        # No validation part, no evaluation, as Megatron-LM's do_valid (its validation data
        # loader is None): a pretraining command with --split 100,0,0 and the default
        # --eval-iters runs there unchanged.
        args.eval_iters = 0


def _data_prefixes(data_path: list[str]) -> list[str]:
    """Megatron's --data-path is either ``PREFIX...`` or ``WEIGHT PREFIX WEIGHT PREFIX...``."""
    try:
        float(data_path[0])
    except (ValueError, IndexError):
        return list(data_path)
    _require(len(data_path) % 2 == 0,
             f"a weighted --data-path needs WEIGHT PREFIX pairs, got {len(data_path)} values")
    for weight in data_path[0::2]:
        try:
            value = float(weight)
        except ValueError:
            raise ArgumentError(f"--data-path: {weight!r} is not a weight; a weighted list "
                                f"alternates WEIGHT PREFIX") from None
        _require(math.isfinite(value), f"--data-path weight {weight} is not a finite number")
        _require(value >= 0, f"--data-path weight {weight} is negative")
        # megatron-core's BlendedDataset asserts each weight is above 0, with no message
        _require(value > 0, f"--data-path weight {weight} is 0: leave its prefix out instead")
    return list(data_path[1::2])


def _validate_folders_given(args):
    for name in ("save", "load", "non_persistent_global_ckpt_dir", "tensorboard_dir"):
        # "--save=" would pass as the working directory to some checks and as no folder to others
        _require(getattr(args, name) != "", f"--{name.replace('_', '-')} needs a folder, got an "
                                             f"empty value")


def _validate_checkpointing(args):
    _validate_load(args)
    if args.save is not None:
        _require(_is_writable_dir(Path(args.save)),
                 f"--save directory {args.save} is not writable: choose a directory you can "
                 f"write to")
    _require(not args.async_save or args.save is not None, "--async-save needs --save DIR")
    _require(args.async_save_timeout is None or 0 < args.async_save_timeout < math.inf,
             f"--async-save-timeout must be a positive number of seconds, got "
             f"{args.async_save_timeout}")
    _require(args.keep_emergency is None or args.keep_emergency >= 0,
             f"--keep-emergency must be >= 0, got {args.keep_emergency}")
    # infinite: the save-request filter's ceil(frac x interval) overflowed at start-up
    _require(0 <= args.emergency_save_gap_frac < math.inf,
             f"--emergency-save-gap-frac must be a finite number >= 0, got "
             f"{args.emergency_save_gap_frac}")
    _validate_memory_tier(args)


def _validate_load(args):
    """A ``--load`` that cannot hold checkpoints is a mistake, never a silent fresh start; a
    first run's ``--save X --load X`` names a folder that does not exist yet, as in Megatron-LM."""
    if args.load is None:
        return
    load = Path(args.load)
    _require(not load.exists() or load.is_dir(),
             f"--load {load} is a file: give the checkpoint folder (the one holding "
             f"latest_checkpointed_iteration.txt and iter_*)")
    first_run = args.save is not None and _real(load) == _real(args.save)
    _require(load.is_dir() or first_run,
             f"--load {load} does not exist: give the folder to resume from, or the --save "
             f"folder (which may not exist yet on a first run)")
    # The checkpoint search lists it on rank 0: unreadable, it would raise there mid-start.
    _require(not load.is_dir() or os.access(load, os.R_OK | os.X_OK),
             f"--load {load} cannot be read (no permission to list it): give a folder you can "
             f"read, or have its owner grant read access")


def _validate_memory_tier(args):
    """Megatron-LM's non-persistent checkpoint flags; only ``global`` keeps the layout free
    (``local`` checkpoints cannot be resharded, ``in_memory`` is refused by Megatron-LM too)."""
    kind = args.non_persistent_ckpt_type
    _require(kind in (None, "global"),
             f"--non-persistent-ckpt-type {kind} is not supported: its checkpoints cannot change "
             f"the layout on a relaunch; use global (a torch_dist memory tier)")
    interval = args.non_persistent_save_interval
    _require(interval is None or interval > 0,
             f"--non-persistent-save-interval must be a positive integer, got {interval}")
    _require(not args.replica_recovery or kind == "global",
             "--replica-recovery needs --non-persistent-ckpt-type global: the survivors' dumps "
             "and the checkpoint merged from them go to the memory tier")
    if kind is None:
        _require(interval is None and args.non_persistent_global_ckpt_dir is None,
                 "--non-persistent-save-interval and --non-persistent-global-ckpt-dir need "
                 "--non-persistent-ckpt-type global")
        return
    _require(args.save is not None, "--non-persistent-ckpt-type global needs --save DIR "
                                    "(the memory tier is persisted there)")
    if args.non_persistent_global_ckpt_dir is None:
        args.non_persistent_global_ckpt_dir = str(Path(args.save) / NON_PERSISTENT_SUBDIR)
    folder = Path(args.non_persistent_global_ckpt_dir)
    _require(_real(folder) != _real(args.save),
             "--non-persistent-global-ckpt-dir must not be the --save folder")
    _require(_is_writable_dir(folder), f"--non-persistent-global-ckpt-dir {folder} is not "
                                       f"writable: choose a directory you can write to")


def default_distributed_optimizer(args) -> bool:
    """On with CUDA, as Megatron-LM users run, except under ``--replica-recovery`` with one
    instance (its state, sharded over DP, has no replicas there;
    ``--num-distributed-optimizer-instances 2`` or more replicates it)."""
    replicated = (not getattr(args, "replica_recovery", False)
                  or getattr(args, "num_distributed_optimizer_instances", 1) >= 2)
    return _cuda_available() and replicated


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _is_writable_dir(path: Path) -> bool:
    """Whether ``path`` is, or could be made as, a folder this process writes in. Nothing is
    left behind: a command refused by a later check must not leave a (mistyped) folder, so
    one that does not exist yet is checked at its nearest existing parent
    (:func:`make_checkpoint_folders` makes it once every check passed)."""
    existing = next(folder for folder in (path.absolute(), *path.absolute().parents)
                    if os.path.lexists(folder))
    try:
        longest = os.pathconf(existing, "PC_NAME_MAX")
        # a name too long passed, and every rank failed at the first save's mkdir
        if any(len(os.fsencode(part)) > longest
               for part in path.absolute().relative_to(existing).parts):
            return False
        with tempfile.TemporaryFile(dir=existing):
            return True
    except OSError:
        return False


def make_checkpoint_folders(args: argparse.Namespace) -> None:
    """``--save`` and the memory tier's folder, which the checks above only looked at
    (TensorBoard's writer and megatron-core's index cache make their own)."""
    for folder in (args.save, args.non_persistent_global_ckpt_dir):
        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x TP``."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)
