"""Read the facts the planner needs from a Megatron-LM argv, and rewrite the layout flags.

Both work on the SCRIPT ARGS after ``--`` as a plain list of strings, in either
``--flag value`` or ``--flag=value`` form. The trainer's parser does not allow abbreviations,
so a flag is matched by its full name only; when a flag is repeated the last one wins, as in
argparse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

TP_FLAG = "--tensor-model-parallel-size"
PP_FLAG = "--pipeline-model-parallel-size"
MICRO_BATCH_FLAG = "--micro-batch-size"
GLOBAL_BATCH_FLAG = "--global-batch-size"


def _require_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")


@dataclass(frozen=True)
class ModelShape:
    """The model dimensions that limit how it can be split across GPUs."""

    num_layers: int
    """Transformer layers; pipeline stages split them evenly."""
    hidden_size: int
    """Model width; tensor parallelism splits it."""
    ffn_hidden_size: int
    """MLP width (Megatron's default is 4 x hidden); tensor parallelism splits it."""
    num_attention_heads: int
    """Attention heads; tensor parallelism splits them."""
    num_query_groups: int
    """Key/value groups: equal to the heads without grouped-query attention."""
    seq_length: int
    """Tokens per sample; only the memory estimate uses it."""
    vocab_size: int | None = None
    """``--vocab-size`` when given; only the memory estimate uses it."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "seq_length"):
            _require_positive(name, getattr(self, name))
        if self.vocab_size is not None:
            _require_positive("vocab_size", self.vocab_size)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden size {self.hidden_size} is not divisible by "
                             f"{self.num_attention_heads} attention heads")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"{self.num_attention_heads} attention heads are not divisible "
                             f"by {self.num_query_groups} query groups")


@dataclass(frozen=True)
class OriginalLayout:
    """How the job was split before the failure: what the planner stays close to."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    micro_batch_size: int
    """The largest micro-batch the planner will use: a larger one might not fit in memory."""
    global_batch_size: int
    """Kept unchanged by every plan, so the optimisation follows the same trajectory."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "micro_batch_size", "global_batch_size"):
            _require_positive(name, getattr(self, name))


@dataclass(frozen=True)
class ScriptFacts:
    """Everything the planner and the rewriter read from one training argv."""

    shape: ModelShape
    original: OriginalLayout
    global_batch_given: bool
    """False when ``--global-batch-size`` was absent and derived from the original layout."""
    save: str | None
    load: str | None


class LayoutFlags(Protocol):
    """What ``rewrite_argv`` needs from a plan."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    micro_batch_size: int
    global_batch_size: int


def _occurrences(args: Sequence[str], flag: str) -> list[tuple[int, str | None]]:
    """(index of the flag, its value) for every occurrence; the value is None when missing."""
    found = []
    for index, token in enumerate(args):
        if token == flag:
            value = args[index + 1] if index + 1 < len(args) else None
            found.append((index, None if value is None or value.startswith("--") else value))
        elif token.startswith(flag + "="):
            found.append((index, token[len(flag) + 1:]))
    return found


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag`` in ``args``, or None when the flag is absent."""
    found = _occurrences(args, flag)
    if not found:
        return None
    value = found[-1][1]
    if value is None:
        raise ValueError(f"{flag} needs a value")
    return value


def _int_flag(args: Sequence[str], flag: str, default: int | None = None) -> int:
    text = flag_value(args, flag)
    if text is None:
        if default is None:
            raise ValueError(f"the training arguments need {flag} N")
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{flag} must be an integer, got {text!r}") from None
    _require_positive(flag, value)
    return value


def _query_groups(args: Sequence[str], heads: int) -> int:
    # As in the trainer: without --group-query-attention every head is its own group.
    if "--group-query-attention" not in args:
        return heads
    if flag_value(args, "--num-query-groups") is None:
        raise ValueError("--group-query-attention needs --num-query-groups N")
    return _int_flag(args, "--num-query-groups")


def _global_batch(args: Sequence[str], micro_batch: int, model_parallel: int,
                  original_world_size: int | None) -> int:
    """``--global-batch-size``, or micro-batch x DP of the original launch, as Megatron derives."""
    if flag_value(args, GLOBAL_BATCH_FLAG) is not None:
        return _int_flag(args, GLOBAL_BATCH_FLAG)
    if original_world_size is None:
        raise ValueError(f"{GLOBAL_BATCH_FLAG} is absent, so it is micro-batch x data-parallel "
                         "size of the original launch: give the original GPU count or add "
                         f"{GLOBAL_BATCH_FLAG}")
    if original_world_size % model_parallel:
        raise ValueError(f"the original {original_world_size} GPUs are not a multiple of "
                         f"TP x PP = {model_parallel}")
    return micro_batch * (original_world_size // model_parallel)


def read_script_args(args: Sequence[str], original_world_size: int | None = None) -> ScriptFacts:
    """Extract the model shape, the original layout and the checkpoint folders.

    ``original_world_size`` (the GPU count of the original launch) is only needed when
    ``--global-batch-size`` is absent, because Megatron then derives it from the layout.
    Raises ValueError with a one-line message for a missing or non-integer value.
    """
    hidden = _int_flag(args, "--hidden-size")
    heads = _int_flag(args, "--num-attention-heads")
    shape = ModelShape(
        num_layers=_int_flag(args, "--num-layers"),
        hidden_size=hidden,
        ffn_hidden_size=_int_flag(args, "--ffn-hidden-size", default=4 * hidden),
        num_attention_heads=heads,
        num_query_groups=_query_groups(args, heads),
        seq_length=_int_flag(args, "--seq-length"),
        vocab_size=_int_flag(args, "--vocab-size") if flag_value(args, "--vocab-size") else None,
    )
    tp = _int_flag(args, TP_FLAG, default=1)
    pp = _int_flag(args, PP_FLAG, default=1)
    micro_batch = _int_flag(args, MICRO_BATCH_FLAG)
    original = OriginalLayout(tp, pp, micro_batch,
                              _global_batch(args, micro_batch, tp * pp, original_world_size))
    return ScriptFacts(shape=shape, original=original,
                       global_batch_given=flag_value(args, GLOBAL_BATCH_FLAG) is not None,
                       save=flag_value(args, "--save"), load=flag_value(args, "--load"))


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    """Replace every occurrence of ``flag`` in the form it was written, or append it."""
    found = _occurrences(args, flag)
    if not found:
        return [*args, flag, value]
    for index, old_value in found:
        if args[index] == flag:
            if old_value is None:
                raise ValueError(f"{flag} needs a value")
            args[index + 1] = value
        else:
            args[index] = f"{flag}={value}"
    return args


def rewrite_argv(script_args: Sequence[str], plan: LayoutFlags) -> list[str]:
    """The training arguments for ``plan``; every other argument stays verbatim and in order.

    Rewrites TP, PP and micro-batch in place (appended when absent). Adds ``--load SAVE``
    when ``--load`` is absent and ``--save`` is present, so the relaunch resumes. Adds
    ``--global-batch-size`` when it was absent: Megatron would otherwise derive it again from
    the new data-parallel size and silently change the batch.
    """
    args = list(script_args)
    args = _set_flag(args, TP_FLAG, str(plan.tensor_model_parallel_size))
    args = _set_flag(args, PP_FLAG, str(plan.pipeline_model_parallel_size))
    args = _set_flag(args, MICRO_BATCH_FLAG, str(plan.micro_batch_size))
    if flag_value(args, GLOBAL_BATCH_FLAG) is None:
        args += [GLOBAL_BATCH_FLAG, str(plan.global_batch_size)]
    save = flag_value(args, "--save")
    if save is not None and flag_value(args, "--load") is None:
        args += ["--load", save]
    return args


def resume_from_save(args: Sequence[str], save_has_checkpoint: bool) -> list[str]:
    """The arguments of a relaunch: ``--load`` is the ``--save`` folder once that holds a
    checkpoint, even where ``--load`` named another folder (the weights the run started
    from), which would otherwise be reloaded and everything trained since thrown away."""
    save = flag_value(args, "--save")
    if save is None or not save_has_checkpoint:
        return list(args)
    return _set_flag(list(args), "--load", save)
