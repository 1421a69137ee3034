"""``ftmaster plan``: show the layout and command a relaunch on the GPUs left would use."""

from __future__ import annotations

import json
import math
import reprlib
import shlex
from itertools import groupby
from pathlib import Path

import click

from .planner import MODES, Plan, PlanError, plan_nodes, uniform_nodes
from .training_values import check_script_values

SEPARATOR_KEY = "ftmaster.after_separator"
MAX_NODES = 10**6
"""Far beyond any cluster. The planner keeps an entry per node: 10^7 nodes took 23 s and
1.2 GB, and --gpus 10^9 --gpus-per-node 1 ran until killed."""
MAX_NODE_GPUS = 1024
"""Far beyond any node's GPUs. One node's GPUs are listed one by one (the job's, the sim's):
--nproc-per-node 10^8 took 10 s and 4 GB before its first check, 10^20 overflowed ``range``."""


class SeparatedCommand(click.Command):
    """A command whose pass-through arguments must follow ``--``.

    With ``ignore_unknown_options`` click would quietly pass a mistyped option, or a missing
    ``--``, on to the script; remembering what followed ``--`` lets the callback refuse both.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        separator = args.index("--") if "--" in args else None
        ctx.meta[SEPARATOR_KEY] = None if separator is None else tuple(args[separator + 1:])
        if separator and args[separator - 1] in self._valued(ctx):
            # click takes the separator as the option's value (``--run-dir $RUN --`` with RUN
            # unset), and the script's arguments as its own
            raise click.UsageError(f"{args[separator - 1]} needs a value before --", ctx)
        return super().parse_args(ctx, args)  # its usage errors: one line (ftmaster.cli)

    def _valued(self, ctx: click.Context) -> set[str]:
        """This command's options that take a value."""
        return {name for param in self.get_params(ctx)
                if isinstance(param, click.Option) and not param.is_flag and not param.count
                for name in (*param.opts, *param.secondary_opts)}


class FiniteFloatRange(click.FloatRange):
    """click's ``FloatRange`` without ``nan``, which passes every bound (``--interval nan``
    reached a traceback), or an infinity (no duration or rate here is meant to be one), and
    at most 10^9 unless told (a thread's wait takes at most about 9.2e9 s, a timestamp less:
    ``--duration 1e10`` reached a traceback too)."""

    def __init__(self, min=None, max=1e9, min_open=False, max_open=False, clamp=False):
        super().__init__(min, max, min_open, max_open, clamp)

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{reprlib.repr(value)} is not a finite number.", param, ctx)
        return super().convert(number, param, ctx)


class FolderPath(click.Path):
    """click's ``Path`` for a folder ftmaster writes into, without the empty value: ``Path("")``
    is the working directory, where an unset variable (``--run-dir "$RUN"``) put a run's
    files unasked."""

    def __init__(self) -> None:
        super().__init__(file_okay=False, path_type=Path)

    def convert(self, value, param, ctx):
        if value == "":
            self.fail("needs a folder, got an empty value", param, ctx)
        if value == "--":  # ``--run-dir $RUN --`` with RUN unset, where no -- follows
            self.fail("needs a folder, got '--'", param, ctx)
        return super().convert(value, param, ctx)


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


def parse_node_gpus(text: str) -> tuple[int, ...]:
    """``8,8,7`` -> (8, 8, 7): schedulable GPUs per node, in node-rank order."""
    try:
        nodes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InputError(f"--node-gpus takes GPU counts separated by commas, got {text!r}") from None
    if not nodes or any(not 0 <= gpus <= MAX_NODE_GPUS for gpus in nodes):
        raise InputError(f"--node-gpus counts must be 0 or more and at most {MAX_NODE_GPUS} "
                         f"(a node's GPUs), got {reprlib.repr(text)}")
    if len(nodes) > MAX_NODES:
        raise InputError("--node-gpus lists more than 10^6 nodes")
    return nodes


def _ranks_per_node(ranks: tuple[int, ...]) -> str:
    """In node-rank order; runs of equal nodes compressed (``8 x 2046``)."""
    runs = [(value, len(list(group))) for value, group in groupby(ranks)]
    return ", ".join(str(value) if count == 1 else f"{value} x {count}" for value, count in runs)


def _throughput_line(plan: Plan, original_gpus: int | None) -> str:
    if plan.throughput_vs_original is None:
        ratio = ("unknown against the original layout (give --original-gpus)" if original_gpus is None
                 else f"unknown: the original layout and batch do not run on --original-gpus "
                      f"{original_gpus}")
    else:
        ratio = f"{plan.throughput_vs_original:.1%} of the original layout's"
    return (f"estimated throughput: {ratio}; step {plan.estimated_step_seconds:.4g} s, "
            f"peak memory {plan.estimated_memory_gib:g} GiB; why: {plan.reason}")


def summary(plan: Plan, original_gpus: int | None = None) -> str:
    """The human summary ``ftmaster plan`` prints on stderr."""
    gpus = plan.num_gpus_used + plan.idle_gpus
    layout = (f"TP {plan.tensor_model_parallel_size} x PP {plan.pipeline_model_parallel_size}"
              + (f" x CP {plan.context_parallel_size}" if plan.context_parallel_size > 1 else "")
              + f" x DP {plan.data_parallel_size}"
              + (f" (EP {plan.expert_model_parallel_size})" if plan.expert_model_parallel_size > 1 else "")
              + (f", VPP {plan.virtual_pipeline_model_parallel_size}"
                 if plan.virtual_pipeline_model_parallel_size else ""))
    batch = f"global batch {plan.global_batch_size}"
    original_batch = plan.original_global_batch_size
    if original_batch and original_batch != plan.global_batch_size:
        batch += f" (was {original_batch}, {plan.global_batch_size / original_batch - 1:+.2%})"
    lines = [f"{layout} on {plan.num_gpus_used} of {gpus} GPUs ({plan.idle_gpus} idle), "
             f"micro-batch {plan.micro_batch_size}, {batch}",
             f"ranks per node: {_ranks_per_node(plan.ranks_per_node)}",
             _throughput_line(plan, original_gpus),
             *(f"warning: {warning}" for warning in plan.warnings),
             f"command: {shlex.join(plan.command)}"]  # to paste into a shell as it is
    return "\n".join(lines)


def _nodes(gpus: int | None, gpus_per_node: int | None, node_gpus: str | None) -> tuple[int, ...]:
    if node_gpus is not None:
        if gpus is not None or gpus_per_node is not None:
            raise InputError("give either --node-gpus or --gpus [--gpus-per-node], not both")
        return parse_node_gpus(node_gpus)
    if gpus is None:
        raise InputError("give --gpus N (with --gpus-per-node M across nodes) or --node-gpus")
    if gpus_per_node is None and gpus > MAX_NODE_GPUS:
        raise InputError(f"--gpus {gpus} on one node is more than {MAX_NODE_GPUS} GPUs: give "
                         f"--gpus-per-node M across nodes")
    if gpus_per_node is not None and -(-gpus // gpus_per_node) > MAX_NODES:
        raise InputError(f"--gpus {gpus} with --gpus-per-node {gpus_per_node} is more than "
                         f"10^6 nodes")
    return uniform_nodes(gpus, gpus_per_node)


@click.command(
    "plan", cls=SeparatedCommand,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--gpus", type=click.IntRange(min=1), default=None, help="GPUs available.")
@click.option("--gpus-per-node", type=click.IntRange(min=1, max=MAX_NODE_GPUS), default=None,
              help="GPUs per node, when the job spans nodes: TP stays within one node. "
                   "Default: a single node.")
@click.option("--node-gpus", default=None, metavar="N,N,...",
              help="Schedulable GPUs of each node, in node-rank order (instead of --gpus).")
@click.option("--mode", type=click.Choice(MODES), default="closest", show_default=True,
              help="closest: the fastest estimate, ties to the layout nearest the original; "
                   "paper: the paper's max-TP rule.")
@click.option("--gpu-memory-gb", type=FiniteFloatRange(min=0, min_open=True), default=None,
              help="Per-GPU memory in GiB: drop layouts whose memory estimate does not fit.")
@click.option("--original-gpus", type=click.IntRange(min=1), default=None,
              help="GPUs of the original launch: keeps the original layout when it still fits, "
                   "compares throughput with it, and derives an absent --global-batch-size.")
@click.option("--global-batch-tolerance", "tolerance_pct", type=FiniteFloatRange(min=0, max=50),
              default=0.0, show_default=True, metavar="PCT",
              help="Allow a global batch within PCT percent of the original when that buys a "
                   "better layout (the run still ends at the same sample count).")
@click.option("--consumed-samples", type=click.IntRange(min=0), default=None,
              help="Samples consumed at the resume point (places a --step-batch-size-schedule).")
@click.option("--measured-step-s", type=FiniteFloatRange(min=0, min_open=True), default=None,
              help="Measured step time of the original layout: calibrates the cost model "
                   "(needs --original-gpus).")
@click.option("--json", "as_json", is_flag=True,
              help="Print only the JSON object, without the summary on stderr.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- SCRIPT ARGS")
@click.pass_context
def plan_command(ctx: click.Context, gpus: int | None, gpus_per_node: int | None,
                 node_gpus: str | None, mode: str, gpu_memory_gb: float | None,
                 original_gpus: int | None, tolerance_pct: float, consumed_samples: int | None,
                 measured_step_s: float | None, as_json: bool, command: tuple[str, ...]) -> None:
    """Plan TP/PP/CP/DP, the micro-batch and the ranks per node for the GPUs available;
    print the rewritten command.

    The plan goes to stdout as one JSON object (DESIGN's contract), a summary to stderr.
    """
    argv = script_command(ctx, command)
    nodes = _nodes(gpus, gpus_per_node, node_gpus)
    try:
        check_script_values(argv[1:])
        plan = plan_nodes(argv, nodes, mode=mode, gpu_memory_gb=gpu_memory_gb,
                          original_world_size=original_gpus,
                          global_batch_tolerance_pct=tolerance_pct,
                          consumed_samples=consumed_samples, measured_step_s=measured_step_s)
    except PlanError as error:
        raise click.ClickException(str(error)) from None
    except ValueError as error:
        raise InputError(str(error)) from None
    if not as_json:
        click.echo(summary(plan, original_gpus), err=True)
    click.echo(json.dumps(plan.as_json()))

