"""Megatron-LM's rules for training-argument values that no layout can repair.

Megatron-LM refuses each once every rank has started, at the latest at the first iteration
(an AssertionError, a ZeroDivisionError or torch's ValueError on every rank), so a launch or
a relaunch planned for them cannot start. ``ftmaster plan`` and ``ftmaster launch`` apply
them to the argv of any script (:func:`check_script_values`), and the bundled trainer to its
parsed arguments, so that all three refuse the same values with the same line. Each rule is
only as strict as Megatron-LM (NVIDIA/Megatron-LM main d98e8a6, whose files and lines the
rules cite): ftmaster must never refuse a command Megatron-LM accepts. Every error is one
line (a ValueError) naming the flag.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .argv_flags import flag_value, float_flag, int_flag, switched_on


def check_positions(seq_length: int, max_position_embeddings: int) -> None:
    """``validate_args``: the position table must cover a whole sequence."""
    if not max_position_embeddings >= seq_length:
        raise ValueError(f"--max-position-embeddings ({max_position_embeddings}) is smaller "
                         f"than --seq-length ({seq_length})")


def check_learning_rate(lr: float, min_lr: float, *, scheduled: bool = True) -> None:
    """``validate_args`` asserts ``min_lr <= lr``, megatron-core's ``OptimizerParamScheduler``
    ``min_lr >= 0`` when one is ``scheduled``; a NaN fails both."""
    floor = " >= 0" if scheduled else ""
    if not (lr >= min_lr and (min_lr >= 0 or not scheduled)):
        raise ValueError(f"need --lr ({lr}) >= --min-lr ({min_lr}){floor}")


def check_lr_schedule(unit: str, training: int, decay: int | None, warmup: int) -> None:
    """``OptimizerParamScheduler`` asserts a decay of a step or more, and a warm-up shorter
    than it. All three lengths are in ``unit`` (``iters`` or ``samples``, the training
    length's), the same ordering as the scheduler's samples. An absent decay (None) is the
    training length."""
    given = decay is not None
    flag, length = (f"--lr-decay-{unit}", decay) if given else (f"--train-{unit}", training)
    if not length > 0:
        fix = "" if given else f"; give a positive one or --lr-decay-{unit} N"
        raise ValueError(f"the learning rate's decay needs at least one step: {flag} is "
                         f"{length}{fix}")
    if not warmup < length:
        raise ValueError(f"the warm-up --lr-warmup-{unit} ({warmup}) must be shorter than the "
                         f"decay {flag} ({length})")


def check_schedule_unit(unit: str, given: Callable[[str], int | None]) -> None:
    """``validate_args`` asserts the whole schedule in the unit of the training length
    (megatron/training/arguments.py:1276-1302, not with ``--skip-train``): with
    ``--train-iters`` no ``--train-samples``, ``--lr-decay-samples`` or non-zero
    ``--lr-warmup-samples``, and the reverse. ``given(name)``: the integer ``--name`` was
    given, None when absent."""
    other = "samples" if unit == "iters" else "iters"
    mixed = [f"--{name}-{other}" for name in ("train", "lr-decay")
             if given(f"{name}-{other}") is not None]
    if given(f"lr-warmup-{other}"):
        mixed.append(f"--lr-warmup-{other}")
    if mixed:
        raise ValueError(f"with --train-{unit} give the learning rate's schedule in {unit} too, "
                         f"not {' and '.join(mixed)}")


def check_warmup_given_once(unit: str, warmup: int) -> None:
    """With ``--lr-warmup-fraction`` ``validate_args`` asserts ``--lr-warmup-<unit>`` 0, the
    unit of the training length (megatron/training/arguments.py:1285-1287 and 1299-1302)."""
    if warmup:
        raise ValueError(f"give either --lr-warmup-fraction or --lr-warmup-{unit}, not both")


def check_warmup_fraction(fraction: float) -> None:
    """``get_optimizer_param_scheduler`` makes the warm-up this fraction of the decay
    (megatron/training/training.py:2567 and 2582), which ``OptimizerParamScheduler`` asserts
    shorter than it (megatron/core/optimizer_param_scheduler.py:160): a fraction of 1 or more
    fails, and a NaN. A negative one is taken (no warm-up)."""
    if not fraction < 1:
        raise ValueError(f"--lr-warmup-fraction must be below 1 (a warm-up shorter than the "
                         f"decay), got {fraction}")


def check_weight_decay(weight_decay: float) -> None:
    """With the default ``--weight-decay-incr-style constant``, ``validate_args`` makes it the
    scheduler's start and end (megatron/training/arguments.py:1393-1397), and
    ``OptimizerParamScheduler`` asserts ``start_wd >= 0.0``
    (megatron/core/optimizer_param_scheduler.py:168); a NaN fails too."""
    if not weight_decay >= 0:
        raise ValueError(f"--weight-decay must be >= 0, got {weight_decay}")


def check_eval_interval(interval: int) -> None:
    """``get_train_valid_test_num_samples`` sizes the validation data with
    ``args.train_iters // args.eval_interval`` (megatron/training/training.py:5436) as the
    datasets are built, whether or not any evaluation runs: a ZeroDivisionError. Not with
    ``--full-validation`` or ``--skip-train`` (training.py:5429-5433), nor
    ``--perform-rl-step``, which builds no datasets (training.py:5508)."""
    if interval == 0:
        raise ValueError("--eval-interval must not be 0: Megatron-LM divides by it to size the "
                         "validation data")


def check_save_interval(interval: int) -> None:
    """``validate_args`` asserts it with ``--save`` (the bundled trainer without it too)."""
    if not interval > 0:
        raise ValueError(f"--save-interval must be a positive integer, got {interval}")


def check_dropout(flag: str, probability: float) -> None:
    """torch's ``Dropout`` refuses it (a NaN too) as megatron-core builds the model: for
    ``--hidden-dropout`` the embedding's (megatron/core/models/common/embeddings/
    language_model_embedding.py:90), for ``--attention-dropout`` the local attention's
    (megatron/core/transformer/dot_product_attention.py:114) and Transformer Engine's unfused
    attention, which its ``DotProductAttention`` always builds."""
    if not 0 <= probability <= 1:
        raise ValueError(f"{flag} must be a probability between 0 and 1, got {probability}")


def check_log_interval(interval: int) -> None:
    """The first iteration's log (``training_log``, megatron/training/training.py:3539) takes
    ``iteration % args.log_interval``, and passes it to megatron-core's ``Timers.log``, which
    asserts ``normalizer > 0.0`` (megatron/core/timers.py:406). Not with ``--skip-train``,
    which runs no training loop, unless ``--perform-rl-step`` (training.py:2017)."""
    if not interval > 0:
        raise ValueError(f"--log-interval must be a positive integer, got {interval}")


def check_script_values(args: Sequence[str]) -> None:
    """The rules above, for the flags a Megatron-LM argv gives (an absent flag is left to the
    script, which has its own default or refusal)."""
    _check_model_values(args)
    _check_optimizer_values(args)
    _check_interval_values(args)


def _check_model_values(args: Sequence[str]) -> None:
    seq_length = int_flag(args, "--seq-length", positive=False)
    max_positions = int_flag(args, "--max-position-embeddings", positive=False)
    if seq_length is not None and max_positions is not None:
        check_positions(seq_length, max_positions)
    for flag in ("--hidden-dropout", "--attention-dropout"):
        if flag_value(args, flag) is not None:
            check_dropout(flag, float_flag(args, flag, 0.0))


def _check_optimizer_values(args: Sequence[str]) -> None:
    _check_schedule_units(args)
    scheduled = _builds_optimizer(args)
    if flag_value(args, "--lr") is not None:
        check_learning_rate(float_flag(args, "--lr", 0.0), float_flag(args, "--min-lr", 0.0),
                            scheduled=scheduled)
    if scheduled:
        _check_scheduler_values(args)


def _builds_optimizer(args: Sequence[str]) -> bool:
    """``setup_model_and_optimizer`` builds no optimizer, so no ``OptimizerParamScheduler``,
    with ``--skip-train``, unless RL's ``--perform-rl-step`` without ``--no-load-optim``
    (megatron/training/training.py:2679-2682)."""
    if not switched_on(args, "--skip-train"):
        return True
    return switched_on(args, "--perform-rl-step") and not switched_on(args, "--no-load-optim")


def _check_scheduler_values(args: Sequence[str]) -> None:
    for unit in ("iters", "samples"):
        training = int_flag(args, f"--train-{unit}", positive=False)
        if training is not None:
            check_lr_schedule(unit, training, int_flag(args, f"--lr-decay-{unit}", positive=False),
                              int_flag(args, f"--lr-warmup-{unit}", 0, positive=False))
    if flag_value(args, "--lr-warmup-fraction") is not None:
        check_warmup_fraction(float_flag(args, "--lr-warmup-fraction", 0.0))
    constant_decay = flag_value(args, "--weight-decay-incr-style") in (None, "constant")
    if flag_value(args, "--weight-decay") is not None and constant_decay:
        check_weight_decay(float_flag(args, "--weight-decay", 0.0))


def _check_schedule_units(args: Sequence[str]) -> None:
    if switched_on(args, "--skip-train"):
        return

    def given(name: str) -> int | None:
        return int_flag(args, f"--{name}", positive=False)

    for unit in ("iters", "samples"):
        if given(f"train-{unit}"):  # validate_args skips a length of 0 (``if args.train_iters``)
            check_schedule_unit(unit, given)
            if flag_value(args, "--lr-warmup-fraction") is not None:
                check_warmup_given_once(unit, given(f"lr-warmup-{unit}"))


def _check_interval_values(args: Sequence[str]) -> None:
    log_interval = int_flag(args, "--log-interval", positive=False)
    runs_training_loop = not switched_on(args, "--skip-train") or switched_on(
        args, "--perform-rl-step")
    if log_interval is not None and runs_training_loop:
        check_log_interval(log_interval)
    save_interval = int_flag(args, "--save-interval", positive=False)
    if flag_value(args, "--save") is not None and save_interval is not None:
        check_save_interval(save_interval)
    eval_interval = int_flag(args, "--eval-interval", positive=False)
    sized_by_interval = not any(switched_on(args, flag) for flag in
                                ("--full-validation", "--skip-train", "--perform-rl-step"))
    if eval_interval is not None and sized_by_interval:
        check_eval_interval(eval_interval)
