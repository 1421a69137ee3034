"""Global-batch schedules: ``--step-batch-size-schedule``, and moving a run to another batch.

A planned change of global batch (``--global-batch-tolerance``) must not change where the run
ends or how its learning rate and weight decay evolve. Megatron-LM's schedules already run on
samples internally (``megatron/training/training.py`` ``get_optimizer_param_scheduler``:
iteration arguments are multiplied by the global batch), so the rewrite expresses the
iteration-based arguments in Megatron-LM's own sample-based names, multiplied by the batch
used so far: ``--train-iters`` -> ``--train-samples``, ``--lr-decay-iters`` ->
``--lr-decay-samples``, ``--lr-warmup-iters`` -> ``--lr-warmup-samples``,
``--lr-wsd-decay-iters`` -> ``--lr-wsd-decay-samples``. The scheduler's step counts (its
checkpointed ``num_steps``, decay and warm-up steps) are then identical before and after,
and the run ends after the same number of samples, plus at most one batch.

Contract for the trainer: with ``--train-samples`` it trains until the consumed samples reach
it (resuming at a different batch: ``ceil((train_samples - consumed) / global_batch)`` more
iterations). Upstream Megatron-LM instead sets ``train_iters = train_samples // global_batch``
(``update_train_iters``), which counts the iterations already run at the old batch as if they
had the new one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .argv_flags import MAX_INT, flag_value, int_flag, remove_flag, set_flag
from .model_facts import GLOBAL_BATCH_FLAG, STEP_SCHEDULE_FLAG

ITERATION_TO_SAMPLE_FLAGS = (
    ("--train-iters", "--train-samples"),
    ("--lr-decay-iters", "--lr-decay-samples"),
    ("--lr-warmup-iters", "--lr-warmup-samples"),
    ("--lr-wsd-decay-iters", "--lr-wsd-decay-samples"),
)
_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


@dataclass(frozen=True)
class StepSchedule:
    """A parsed ``--step-batch-size-schedule``: (threshold in samples, global batch) pairs."""

    entries: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        # StepBatchsizeNumMicroBatchesCalculator._validate_schedule
        if not self.entries or self.entries[0][0] != 0:
            raise ValueError(f"{STEP_SCHEDULE_FLAG} must start at threshold 0")
        thresholds = [threshold for threshold, _ in self.entries]
        if any(b <= a for a, b in zip(thresholds, thresholds[1:])):
            raise ValueError(f"{STEP_SCHEDULE_FLAG} thresholds must be strictly increasing")
        if any(batch < 1 for _, batch in self.entries):
            raise ValueError(f"{STEP_SCHEDULE_FLAG} batch sizes must be positive")
        if any(batch > MAX_INT for _, batch in self.entries):  # as --global-batch-size
            raise ValueError(f"{STEP_SCHEDULE_FLAG} batch sizes must be at most 10^12")

    def batch_at(self, consumed_samples: int) -> int:
        """The global batch in effect after ``consumed_samples`` (``_get_batch_size_for_samples``)."""
        return [batch for threshold, batch in self.entries if consumed_samples >= threshold][-1]

    def consumed_after(self, iterations: int) -> int:
        """The samples ``iterations`` steps consume from the start, each at the batch in
        effect before it (``update_num_microbatches(consumed_samples)`` then a step)."""
        consumed, left = 0, iterations
        for threshold, _ in self.entries[1:]:
            if consumed >= threshold:
                continue
            batch = self.batch_at(consumed)
            steps = -(-(threshold - consumed) // batch)
            if steps >= left:
                break
            consumed, left = consumed + steps * batch, left - steps
        return consumed + left * self.batch_at(consumed)

    def batches_from(self, consumed_samples: int) -> tuple[int, ...]:
        """Every batch the run will still use: each must divide by micro-batch x DP."""
        current = self.batch_at(consumed_samples)
        later = [batch for threshold, batch in self.entries if threshold > consumed_samples]
        return tuple(dict.fromkeys([current, *later]))


def _schedule_number(text: str) -> int:
    """``StepBatchsizeNumMicroBatchesCalculator._parse_numeric_value``: K/M/B/T suffixes."""
    text = text.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if multiplier > 1 else text) * multiplier)
    except (ValueError, OverflowError):  # OverflowError: "inf" and "1e400" parse as floats
        raise ValueError(f"{STEP_SCHEDULE_FLAG} has a bad number {text!r}") from None


def parse_step_schedule(text: str, seq_length: int) -> StepSchedule:
    """Thresholds are tokens (Megatron-LM passes the sequence length) turned into samples."""
    entries = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f"{STEP_SCHEDULE_FLAG} entry {entry!r} is not THRESHOLD:BATCH")
        threshold, batch = entry.split(":", 1)
        entries.append((_schedule_number(threshold) // seq_length, _schedule_number(batch)))
    return StepSchedule(tuple(sorted(entries)))


def read_step_schedule(args: Sequence[str], seq_length: int) -> StepSchedule | None:
    text = flag_value(args, STEP_SCHEDULE_FLAG)
    if text is None:
        return None
    if flag_value(args, GLOBAL_BATCH_FLAG) is not None:
        raise ValueError(f"cannot use both {STEP_SCHEDULE_FLAG} and {GLOBAL_BATCH_FLAG} "
                         "(Megatron-LM refuses it)")
    return parse_step_schedule(text, seq_length)


def _rename(args: Sequence[str], old: str, new: str, value: str) -> list[str]:
    """``args`` with every ``old`` flag renamed ``new`` and given ``value``, in place."""
    renamed, skip = [], False
    for index, token in enumerate(args):
        if skip:
            skip = False
        elif token == old:
            renamed += [new, value]
            skip = index + 1 < len(args) and not args[index + 1].startswith("--")
        elif token.startswith(old + "="):
            renamed.append(f"{new}={value}")
        else:
            renamed.append(token)
    return renamed


def change_global_batch(args: Sequence[str], batch_so_far: int, new_batch: int) -> list[str]:
    """``args`` running at ``new_batch`` from now on, ending at the same sample count."""
    args = list(args)
    for iterations_flag, samples_flag in ITERATION_TO_SAMPLE_FLAGS:
        iterations = int_flag(args, iterations_flag, positive=False)
        if iterations is not None:
            # Megatron-LM takes an explicit 0 of the samples flag beside the iterations one:
            # left after the rename, a later 0 won and undid it
            args = _rename(remove_flag(args, samples_flag), iterations_flag, samples_flag,
                           str(iterations * batch_so_far))
    return set_flag(args, GLOBAL_BATCH_FLAG, str(new_batch))

