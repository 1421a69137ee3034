"""Read the facts the planner needs from a Megatron-LM argv, and rewrite the layout flags.

Both work on the SCRIPT ARGS after ``--`` as a plain list of strings (see ``argv_flags`` for
the flag forms). The rewrite changes only what a layout needs: TP, PP, the micro-batch, CP and
EP when they change, the virtual-pipeline flag when the pipeline size changes it, uneven-stage
flags at PP 1, the evaluation micro-batch when the data-parallel size forces it, and, with a
planned change of global batch, the batch and the schedule arguments (``batch_schedule``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from .argv_flags import flag_present, flag_value, int_flag, remove_flag, set_flag, switched_on
from .batch_schedule import StepSchedule, change_global_batch, read_step_schedule
from .layout_rules import (FIRST_STAGE_FLAG, LAST_STAGE_FLAG, LAYERS_PER_VIRTUAL_STAGE_FLAG,
                           VIRTUAL_STAGES_FLAG, PipelineFlags, RuleFlags, read_pipeline_flags,
                           read_rule_flags, unmodelled_flag_warnings)
from .memory_estimate import MemoryFlags, read_memory_flags
from .model_facts import (CP_FLAG, EP_FLAG, EVAL_MICRO_BATCH_FLAG, GLOBAL_BATCH_FLAG,
                          MICRO_BATCH_FLAG, PP_FLAG, STEP_SCHEDULE_FLAG, TP_FLAG, ExpertShape,
                          ModelShape, OriginalLayout, read_model_shape, read_original_layout)

__all__ = ["ExpertShape", "LayoutFlags", "ModelShape", "OriginalLayout", "ScriptFacts",
           "flag_value", "read_script_args", "resume_from_save", "rewrite_argv"]


@dataclass(frozen=True)
class ScriptFacts:
    """Everything the planner and the rewriter read from one training argv."""

    shape: ModelShape
    original: OriginalLayout
    global_batch_given: bool
    """False when ``--global-batch-size`` was absent and derived (or comes from a schedule)."""
    save: str | None
    load: str | None
    pipeline: PipelineFlags = PipelineFlags()
    rules: RuleFlags = RuleFlags()
    memory: MemoryFlags = MemoryFlags()
    step_schedule: StepSchedule | None = None
    """``--step-batch-size-schedule``, thresholds in samples."""
    overlap_grad_reduce: bool = False
    phase_transitions: bool = False
    """``--phase-transition-iterations``: the global batch must stay the checkpoint's."""
    warnings: tuple[str, ...] = ()
    """Flags the planner only approximates, named."""


class LayoutFlags(Protocol):
    """What ``rewrite_argv`` needs from a plan."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    micro_batch_size: int
    global_batch_size: int
    context_parallel_size: int
    expert_model_parallel_size: int
    virtual_pipeline_size: int
    eval_micro_batch_size: int | None


def _check_layout_string(shape: ModelShape, pipeline: PipelineFlags) -> None:
    # PipelineParallelLayerLayout.validate_layer_layout: decoder layers must add up.
    if pipeline.layout is not None and sum(pipeline.layout) != shape.num_layers:
        raise ValueError(f"--pipeline-model-parallel-layout has {sum(pipeline.layout)} decoder "
                         f"layers, --num-layers is {shape.num_layers}")


def read_script_args(args: Sequence[str], original_world_size: int | None = None, *,
                     consumed_samples: int | None = None) -> ScriptFacts:
    """Extract the model shape, the original layout, the layout-relevant flags and folders.

    ``original_world_size`` (the GPU count of the original launch) is only needed when
    ``--global-batch-size`` is absent, because Megatron then derives it from the layout.
    ``consumed_samples`` places the run in a ``--step-batch-size-schedule``. Raises
    ValueError with a one-line message for a missing, malformed or refused argument.
    """
    warnings = unmodelled_flag_warnings(args)
    shape = read_model_shape(args)
    pipeline = read_pipeline_flags(args)
    _check_layout_string(shape, pipeline)
    schedule = read_step_schedule(args, shape.seq_length)
    scheduled = None if schedule is None else schedule.batch_at(consumed_samples or 0)
    return ScriptFacts(
        shape=shape, original=read_original_layout(args, original_world_size, scheduled),
        global_batch_given=flag_value(args, GLOBAL_BATCH_FLAG) is not None,
        save=flag_value(args, "--save"), load=flag_value(args, "--load"),
        pipeline=pipeline, rules=read_rule_flags(args), memory=read_memory_flags(args),
        step_schedule=schedule, overlap_grad_reduce=switched_on(args, "--overlap-grad-reduce"),
        phase_transitions=flag_present(args, "--phase-transition-iterations"), warnings=warnings)


def _rewrite_virtual_pipeline(args: list[str], pp: int, vpp: int) -> list[str]:
    """The VPP flag for ``vpp`` at ``pp``, only when the command's value no longer gives it."""
    per_rank_layers_flag = flag_value(args, LAYERS_PER_VIRTUAL_STAGE_FLAG)
    if per_rank_layers_flag is not None:
        layers = int_flag(args, "--num-layers", 1)
        embedding_and_loss = sum(  # each a layer once, however often it is repeated
            flag_present(args, flag) for flag in ("--account-for-embedding-in-pipeline-split",
                                                  "--account-for-loss-in-pipeline-split"))
        chunk = (layers + embedding_and_loss) // pp // vpp
        return args if chunk == int(per_rank_layers_flag) else set_flag(
            args, LAYERS_PER_VIRTUAL_STAGE_FLAG, str(chunk))
    if flag_value(args, VIRTUAL_STAGES_FLAG) not in (None, str(vpp)):
        return set_flag(args, VIRTUAL_STAGES_FLAG, str(vpp))
    return args


def _set_if_changed(args: list[str], flag: str, value: int, default: int) -> list[str]:
    current = int_flag(args, flag, default)
    return args if current == value else set_flag(args, flag, str(value))


def rewrite_argv(script_args: Sequence[str], plan: LayoutFlags, *,
                 original_global_batch: int | None = None,
                 batch_may_change: bool = False) -> list[str]:
    """The training arguments for ``plan``; every other argument stays verbatim and in order.

    Rewrites TP, PP and micro-batch in place (appended when absent). Adds ``--load SAVE``
    when ``--load`` is absent and ``--save`` is present, so the relaunch resumes. Adds
    ``--global-batch-size`` when it was absent (Megatron would otherwise derive it again from
    the new data-parallel size and silently change the batch), except with a step schedule,
    with which Megatron-LM forbids it. When the plan's global batch differs from
    ``original_global_batch``, or may differ in some relaunch (``batch_may_change``: a
    tolerance), the schedule arguments move to samples (``batch_schedule``): a relaunch back
    at the original batch after one at another, in iterations again, ended short of the
    samples the run was to train, and of its learning rate's decay.
    """
    args = list(script_args)
    args = set_flag(args, TP_FLAG, str(plan.tensor_model_parallel_size))
    args = set_flag(args, PP_FLAG, str(plan.pipeline_model_parallel_size))
    args = set_flag(args, MICRO_BATCH_FLAG, str(plan.micro_batch_size))
    args = _set_if_changed(args, CP_FLAG, plan.context_parallel_size, 1)
    args = _set_if_changed(args, EP_FLAG, plan.expert_model_parallel_size, 1)
    pp = plan.pipeline_model_parallel_size
    if pp == 1:
        args = remove_flag(remove_flag(args, FIRST_STAGE_FLAG), LAST_STAGE_FLAG)
    args = _rewrite_virtual_pipeline(args, pp, plan.virtual_pipeline_size)
    if plan.eval_micro_batch_size is not None:
        args = set_flag(args, EVAL_MICRO_BATCH_FLAG, str(plan.eval_micro_batch_size))
    batch = plan.global_batch_size
    if original_global_batch is not None and (batch != original_global_batch or batch_may_change):
        args = change_global_batch(args, original_global_batch, batch)
    elif flag_value(args, GLOBAL_BATCH_FLAG) is None and flag_value(args, STEP_SCHEDULE_FLAG) is None:
        args += [GLOBAL_BATCH_FLAG, str(batch)]
    save = flag_value(args, "--save")
    if save is not None and flag_value(args, "--load") is None:
        args += ["--load", save]
    return args


INSTANCES_FLAG = "--num-distributed-optimizer-instances"


def set_optimizer_instances(args: Sequence[str], instances: int) -> tuple[list[str], str | None]:
    """``args`` running ``instances`` distributed-optimizer instances, and the line that says
    so when that is fewer than they asked for (None when unchanged)."""
    asked = int_flag(args, INSTANCES_FLAG, 1)
    if instances == asked:
        return list(args), None
    return (set_flag(args, INSTANCES_FLAG, str(instances)),
            f"{INSTANCES_FLAG} {asked} does not divide the new layout's data-parallel size: "
            f"the relaunch runs {instances}")


SCHEDULER_CHOICE_FLAGS = ("--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler")


def keep_checkpoint_lr_schedule(args: Sequence[str], samples_per_step_kept: bool
                                ) -> tuple[list[str], str | None]:
    """``args`` resuming the checkpoint's learning-rate schedule, and the line that says so.

    With a step schedule Megatron-LM sets the global batch to micro-batch x DP (``validate_args``),
    and with ``--train-iters`` it counts the schedule's steps in that batch
    (``get_optimizer_param_scheduler``: ``lr_decay_iters * global_batch_size``, the warm-up and
    the weight-decay steps too). A relaunch at another micro-batch x DP then fails its load:
    ``OptimizerParamScheduler._check_and_set`` refuses a decay that differs from the
    checkpoint's. The checkpoint's values are the original run's schedule, so the relaunch keeps
    them (``--use-checkpoint-opt-param-scheduler``), unless the command chose already.
    """
    if (samples_per_step_kept or flag_value(args, STEP_SCHEDULE_FLAG) is None
            or flag_value(args, "--train-iters") is None
            or any(flag_present(args, flag) for flag in SCHEDULER_CHOICE_FLAGS)):
        return list(args), None
    return ([*args, "--use-checkpoint-opt-param-scheduler"],
            "--use-checkpoint-opt-param-scheduler added: with --step-batch-size-schedule and "
            "--train-iters Megatron-LM counts the learning-rate schedule in micro-batch x DP "
            "samples, which the new layout changes; the checkpoint keeps the original's")


STARTING_WEIGHTS_ONLY = {"--no-load-optim": False, "--no-load-rng": False, "--finetune": False,
                         "--ckpt-step": True}
"""Flags that say what to take of the weights a run starts from (a fine-tune leaves the
pretraining's Adam moments behind), and whether each takes a value; its own checkpoints'
optimizer and RNG are its own. Megatron-LM's ``--finetune`` also starts the iteration at 0,
and ``--ckpt-step`` loads that one iteration: kept, every recovery started the fine-tune over
from iteration 0, or reloaded the pinned step."""


def resume_from_save(args: Sequence[str], save_has_checkpoint: bool, *,
                     load_is_save: bool = False, saved_there: bool = False) -> list[str]:
    """The arguments of a relaunch: ``--load`` is the ``--save`` folder once that holds a
    checkpoint, even where ``--load`` named another folder (the weights the run started
    from), which would otherwise be reloaded and everything trained since thrown away. The
    flags of :data:`STARTING_WEIGHTS_ONLY` then go: kept, every recovery restarted Adam from
    zero moments. With ``--load`` already the ``--save`` folder (``load_is_save``: however
    written) they stay as given until the run ``saved_there`` itself: a rollback's
    ``--ckpt-step 500`` then reloaded iteration 500 at every recovery."""
    save = flag_value(args, "--save")
    if save is None or not save_has_checkpoint:
        return list(args)
    load_is_save = load_is_save or flag_value(args, "--load") == save
    if load_is_save and not saved_there:
        return list(args)
    resumed = list(args) if load_is_save else set_flag(list(args), "--load", save)
    for flag, takes_value in STARTING_WEIGHTS_ONLY.items():
        resumed = remove_flag(resumed, flag, takes_value=takes_value)
    return resumed


def uses_trainer_parser(script: Path) -> bool:
    """Whether ``script`` parses its arguments with ftmaster's trainer parser
    (``megatron.training.arguments.parse_args``), as the bundled ``pretrain_gpt.py`` does; a
    script with a parser of its own (upstream Megatron-LM's) is left to check itself."""
    try:
        tree = ast.parse(Path(script).read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.ImportFrom) and node.module == "megatron.training.arguments"
               and any(alias.name == "parse_args" for alias in node.names)
               for node in ast.walk(tree))
