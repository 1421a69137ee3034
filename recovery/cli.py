"""``ftmaster plan``: show the layout and command a relaunch on N GPUs would use."""

from __future__ import annotations

import json

import click

from .planner import MODES, Plan, PlanError, plan_layout

SEPARATOR_KEY = "ftmaster.after_separator"


class SeparatedCommand(click.Command):
    """A command whose pass-through arguments must follow ``--``.

    With ``ignore_unknown_options`` click would quietly pass a mistyped option, or a missing
    ``--``, on to the script; remembering what followed ``--`` lets the callback refuse both.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[SEPARATOR_KEY] = tuple(args[args.index("--") + 1:]) if "--" in args else None
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as error:
            error.ctx = None  # without a context click prints only "Error: ...": one line
            raise


class InputError(click.ClickException):
    """Bad input, shown as one line; exit code 2 as for click's own usage errors."""

    exit_code = 2


def script_command(ctx: click.Context, command: tuple[str, ...]) -> list[str]:
    """``command`` checked to be ``SCRIPT ARGS...`` given after ``--``."""
    after_separator = ctx.meta.get(SEPARATOR_KEY)
    if after_separator is None:
        raise InputError("put -- before the training script: ... -- SCRIPT ARGS...")
    if command != after_separator:
        unexpected = command[:len(command) - len(after_separator)]
        raise InputError(f"unexpected {' '.join(unexpected)!r} before --")
    if not command:
        raise InputError("give the training script after --: ... -- SCRIPT ARGS...")
    return list(command)


def _summary(plan: Plan, gpus: int) -> str:
    return (f"TP {plan.tensor_model_parallel_size} x PP {plan.pipeline_model_parallel_size} "
            f"x DP {plan.data_parallel_size} on {plan.num_gpus_used} of {gpus} GPUs, "
            f"micro-batch {plan.micro_batch_size}, global batch {plan.global_batch_size}\n"
            f"command: {' '.join(plan.command)}")


@click.command(
    "plan", cls=SeparatedCommand,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--gpus", type=click.IntRange(min=1), required=True, help="GPUs available.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=None,
              help="GPUs per node, when the job spans nodes: TP stays within one node. "
                   "Default: a single node.")
@click.option("--mode", type=click.Choice(MODES), default="closest", show_default=True,
              help="closest: the layout nearest the original; paper: the paper's max-TP rule.")
@click.option("--gpu-memory-gb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Per-GPU memory in GiB: drop layouts whose rough estimate does not fit.")
@click.option("--original-gpus", type=click.IntRange(min=1), default=None,
              help="GPUs of the original launch; needed only without --global-batch-size, "
                   "which Megatron then derives from the layout.")
@click.option("--json", "as_json", is_flag=True,
              help="Print only the JSON object, without the summary on stderr.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- SCRIPT ARGS")
@click.pass_context
def plan_command(ctx: click.Context, gpus: int, gpus_per_node: int | None, mode: str,
                 gpu_memory_gb: float | None, original_gpus: int | None, as_json: bool,
                 command: tuple[str, ...]) -> None:
    """Plan TP/PP/DP and the micro-batch for the GPUs available; print the rewritten command.

    The plan goes to stdout as one JSON object (DESIGN's contract), a summary to stderr.
    """
    argv = script_command(ctx, command)
    try:
        plan = plan_layout(argv, gpus, gpus_per_node, mode=mode, gpu_memory_gb=gpu_memory_gb,
                           original_world_size=original_gpus)
    except PlanError as error:
        raise click.ClickException(str(error)) from None
    except ValueError as error:
        raise InputError(str(error)) from None
    if not as_json:
        click.echo(_summary(plan, gpus), err=True)
    click.echo(json.dumps(plan.as_json()))
