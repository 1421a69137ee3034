"""``ftmaster goodput``: the goodput model's command line and its run-directory measurements.

Precedence of an input: a value given on the command line, else one measured in
``--run-dir``, else the model's default. The output names the measured ones.

Beside today's single tier (periodic-only and proactive) it shows the two tiers of
:mod:`ftmaster.goodput` at ``--memory-interval``, or at the optimal one when that is unset.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import re
import statistics
import textwrap
from dataclasses import asdict, fields
from pathlib import Path

import click
import numpy as np

from ftmaster import goodput, report, runfiles
from ftmaster.goodput import GoodputInputs
from ftmaster.recovery.cli import FiniteFloatRange, InputError

_ELAPSED = re.compile(r"elapsed time per iteration \(ms\): " + report.DECIMAL)
MAX_RUNS = 1_000_000
"""The most Monte Carlo runs. The simulation holds about 30 numbers per run: 10^9 runs were
killed for their memory, 10^12 raised numpy's MemoryError. 10^6 take 0.4 GB and, with the
default inputs, about half an hour for the three simulations (10^5: 2.5 minutes)."""


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _iteration_s(run_dir: Path) -> float | None:
    """Median ``elapsed time per iteration`` over every launch attempt's log (every node's)."""
    folders = [runfiles.node_dir(run_dir, r) for r in runfiles.node_ranks(run_dir)] or [run_dir]
    logs = [log for folder in folders for log in sorted(runfiles.logs_dir(folder).glob("*.log"))
            if log.is_file()]
    return _median([seconds for log in logs for seconds in _logged_step_s(log)])


def _logged_step_s(log: Path) -> list[float]:
    """A log's iteration times; none from a log that cannot be read (another user's), said in
    one line: its times are unknown, and the other logs still measure the step."""
    try:
        with report.open_log(log) as handle:
            return [float(m.group(1)) / 1000 for m in map(_ELAPSED.search, handle) if m]
    except OSError as exc:
        click.echo(f"warning: cannot read {log}: {exc.strerror}; its iteration times are left "
                   "out of the measured ones", err=True)
        return []


def _restart_s(failures: list[dict], iteration_s: float | None) -> float | None:
    """Median time from a fault to its first resumed iteration, less that iteration: the
    report's RTO plus its detection latency where that is known or estimated, since the
    model's restart cost runs from the fault. An RTO through later failures of its relaunch
    is left out: it spans their restarts too, each of which the model charges on its own. So
    is ftmaster's own loss (``supervisor_lost``): it spans the time no ftmaster ran, until
    someone started one again, which is no recovery from a GPU's fault; and a node's join
    (a scale-up), a regroup planned with no fault."""
    gaps = [f["rto_seconds"] + (f["detection_latency"]["seconds"] or 0.0) - (iteration_s or 0.0)
            for f in failures if f["rto_seconds"] is not None and not f.get("later_failures")
            and f.get("cause") != "supervisor_lost"  # no GPU fault: ftmaster itself was down
            and not f.get("scale_up")]
    return _median([max(gap, 0.0) for gap in gaps])


SAVES = ("emergency_save", "periodic_save")


def _event_field(events: list[dict], kinds: tuple[str, ...], key: str,
                 tier: str | None = None) -> float | None:
    """Median ``key`` in seconds of the events of ``kinds``; with ``tier``, of the saves that
    went there (a save without a ``tier`` field predates the memory tier: it went to disk). A
    value that is no time is left out, said in one warning line: taken as it came, true was
    1 s and a negative time shifted the median. A save that found its checkpoint already on
    disk (``already_on_disk``) wrote nothing: its time is no save's cost."""
    given = [e[key] for e in events if e["event"] in kinds and e.get(key) is not None
             and (tier is None or e.get("tier", "disk") == tier)
             and e.get("already_on_disk") is not True]
    times = [_seconds(value) for value in given]
    bad = [value for value, seconds in zip(given, times) if seconds is None]
    if bad:
        click.echo(f"warning: {len(bad)} {'/'.join(sorted(kinds))} event(s) left out of the "
                   f"measured times: their {key} is no time in seconds (such as "
                   f"{runfiles.json_excerpt(bad[0])})", err=True)
    return _median([seconds for seconds in times if seconds is not None])


def _seconds(value) -> float | None:
    """A JSON value as a time in seconds; None for one that is no finite number (true, a
    string, NaN, an integer past float range) or is negative."""
    return float(value) if runfiles.is_finite_number(value) and value >= 0 else None


def measure(run_dir: Path, events: list[dict]) -> dict[str, float]:
    """Inputs found in a run directory: save, persist and restart times from its ``events``
    (:func:`ftmaster.report.load_events`: read as strictly as ``ftmaster report`` does), log
    iteration times. Only what was found is returned."""
    iteration_s = _iteration_s(run_dir)
    found = {"iteration_s": iteration_s,
             "save_block_s": _event_field(events, SAVES, "seconds", "disk"),
             "save_persist_s": _event_field(events, SAVES, "persist_seconds", "disk"),
             "memory_save_s": _event_field(events, SAVES, "seconds", "memory"),
             "persist_s": _event_field(events, ("persisted",), "seconds"),
             "restart_s": _restart_s(report.failure_reports(run_dir, events), iteration_s)}
    return {name: value for name, value in found.items() if value is not None}


def model_inputs(explicit: dict, measured: dict) -> GoodputInputs:
    """The model's inputs: given, else measured, else the defaults. The memory tier's
    defaults follow the disk's figures as the defaults do each other (a quarter of the block,
    the disk save's time until durable), so that a run that saved to disk alone is not
    modelled with a memory tier slower than its disk."""
    chosen = {**measured, **explicit}
    block = chosen.get("save_block_s", GoodputInputs.save_block_s)
    if "save_persist_s" not in chosen:  # the default persist may be below a measured block
        chosen["save_persist_s"] = max(block, GoodputInputs.save_persist_s)
    chosen.setdefault("memory_save_s", block * GoodputInputs.memory_save_s / GoodputInputs.save_block_s)
    chosen.setdefault("persist_s", chosen["save_persist_s"])
    return GoodputInputs(**chosen)


def _report(x: GoodputInputs, runs: int, seed: int) -> dict:
    """Analytic and simulated outcome and the optimum: periodic-only and proactive on one
    tier, and the two tiers."""
    result = {}
    single = x.single_tier()
    for name, case, tune_gap in (("periodic_only", single.periodic_only(), False),
                                 ("proactive", single, True)):
        breakdown = goodput.first_order_breakdown(case) if tune_gap else None
        result[name] = ({"analytic": None, "optimum": None, "no_estimate": breakdown}
                        if breakdown else
                        {"analytic": goodput.analytic(case),
                         "optimum": goodput.optimal_interval(case, tune_gap=tune_gap)})
        if runs:
            result[name]["monte_carlo"] = goodput.simulate(case, runs=runs, seed=seed)
    result["two_tier"] = _two_tier_report(x, runs, seed)
    young_s, daly_s = goodput.young_daly_interval_s(x), goodput.daly_exact_interval_s(x)
    result["young_daly"] = {"interval_s": young_s, "save_interval": young_s / x.iteration_s,
                            "daly_exact_interval_s": daly_s,
                            "daly_exact_save_interval": daly_s / x.iteration_s}
    iters = round(x.run_hours * goodput.HOUR / x.iteration_s)
    worst = goodput.table_iii_overhead_s(x.save_block_s, x.gap_frac, iters, x.save_interval)
    result["worst_case_save_hours"] = worst / goodput.HOUR
    return result


def _two_tier_report(x: GoodputInputs, runs: int, seed: int) -> dict:
    """The two tiers at the given memory interval, else at the optimal one. Its Monte Carlo
    is left out, with the reason, when the chosen interval makes it too long: the user may
    not have chosen it."""
    best = goodput.optimal_memory_interval(x.periodic_only())
    case = x.two_tier(x.memory_interval or best["memory_interval"])
    result = {"memory_interval": case.memory_interval, "given": x.tiered,
              "analytic": goodput.analytic(case), "optimum": best}
    events = goodput.expected_events_per_run(case)
    if runs and events > goodput.MAX_EVENTS_PER_RUN:
        result["monte_carlo_skipped"] = (f"about {events:.2g} events per run, over the limit "
                                         f"of {goodput.MAX_EVENTS_PER_RUN:.0e}")
    elif runs:
        result["monte_carlo"] = goodput.simulate(case, runs=runs, seed=seed)
    young_s = goodput.memory_young_daly_interval_s(x)
    finite = math.isfinite(young_s)
    result["young_daly"] = {"interval_s": young_s if finite else None,
                            "memory_interval": young_s / x.iteration_s if finite else None}
    return result


def in_option_names(message: str, measured: dict, run_dir: Path | None) -> str:
    """The model's message about its inputs in the command's words: each input by its option,
    and those of them measured in the run directory (not given) said to be."""
    named = [field.name for field in fields(GoodputInputs)
             if re.search(rf"\b{field.name}\b", message)]
    for name in named:
        message = re.sub(rf"\b{name}\b", _option(name), message)
    found = [f"{_option(name)} {measured[name]:g}" for name in named if name in measured]
    return message + (f" ({', '.join(found)}: measured in {run_dir})" if found else "")


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _row(label: str, values: list[str]) -> str:
    return f"{label:<34}" + "".join(f"{v:>18}" if len(v) < 18 else f" {v}" for v in values)


def _table(x: GoodputInputs, measured: dict, result: dict) -> str:
    tiers = result["two_tier"]
    cases = [result["periodic_only"], result["proactive"], tiers]
    lines = ["inputs: " + ", ".join(f"{k}={v:g}" for k, v in asdict(x).items()),
             "measured in the run directory: " + (", ".join(sorted(measured)) or "none"), "",
             _row("", ["periodic-only", "proactive", "two-tier"])]
    rows = (("goodput (analytic)", "goodput", "{:.4f}"), ("failures (expected)", "failures",
            "{:.1f}"), ("lost work (h)", "lost_hours", "{:.2f}"),
            ("lost work per failure (s)", "lost_per_failure_s", "{:.0f}"),
            ("restart time (h)", "restart_hours", "{:.2f}"),
            ("save overhead (h)", "save_hours", "{:.2f}"), ("wall time (h)", "wall_hours",
            "{:.1f}"))
    for label, key, fmt in rows:
        lines.append(_row(label, [_figure(fmt, (c["analytic"] or {}).get(key)) for c in cases]))
    if "monte_carlo" in cases[0]:
        simulated = [c.get("monte_carlo") for c in cases]
        lines.append(_row("goodput (Monte Carlo)", [
            f"{m['goodput']:.4f} ± {m['goodput_stderr']:.4f}" if m else "-" for m in simulated]))
        lines.append(_row("lost work (h, Monte Carlo)",
                          [_figure("{:.2f}", m["lost_hours"]) if m else "-" for m in simulated]))
    best = [c["optimum"] or {} for c in cases]
    lines.append(_row("optimal save interval (iterations)",
                      [str(best[0]["save_interval"]),
                       f"{best[1]['save_interval']} (gap {best[1]['gap_frac']:.2f})"
                       if best[1] else "-", f"memory {best[2]['memory_interval']}"]))
    lines.append(_row("goodput at the optimum",
                      [_figure("{:.4f}", b.get("goodput")) for b in best]))
    young = result["young_daly"]
    if cases[1]["analytic"] is None:
        lines.append(f"proactive: {cases[1]['no_estimate']}")
    lines += ["", *_two_tier_lines(x, tiers), "",
              f"Young/Daly sqrt(2 C MTBF_job), the periodic-only reference: "
              f"{_figure('{:.0f}', young['save_interval'])} iterations "
              f"({_figure('{:.0f}', young['interval_s'])} s of compute between saves)",
              f"Daly's exact optimum (periodic-only is solved exactly): "
              f"{_figure('{:.0f}', young['daly_exact_save_interval'])} iterations "
              f"({_figure('{:.0f}', young['daly_exact_interval_s'])} s)",
              f"paper-style worst case (an alert every gap, no failure): "
              f"{_figure('{:.2f}', result['worst_case_save_hours'])} h of saves"]
    return "\n".join(lines)


def _two_tier_lines(x: GoodputInputs, tiers: dict) -> list[str]:
    model, young = tiers["analytic"], tiers["young_daly"]
    chosen = "--memory-interval" if tiers["given"] else "the optimum"
    if tiers["memory_interval"] == x.save_interval:
        chosen += "; none between disk copies"
    lines = [f"two-tier, no predictor: a memory save every {tiers['memory_interval']} iterations "
             f"({chosen}), {x.memory_save_s:g} s blocked;",
             f"  the one every {model['disk_copy_interval']} iterations is copied to disk in the "
             f"background ({x.persist_s:g} s)",
             "  (not counted: the trainer's own --save-interval save, which goes to disk and "
             "blocks as a periodic one does)",
             f"  lost work per failure: {_figure('{:.0f}', model['lost_per_rank_failure_s'])} s "
             "when host RAM survives (GPU or process failure),",
             f"  {_figure('{:.0f}', model['lost_per_node_crash_s'])} s after a node crash "
             f"({x.node_failure_share:.0%} of failures: --node-failure-share)",
             "Young/Daly for the memory tier, sqrt(2 C_mem MTBF_job / (1 - node share)) with the",
             "  node-crash correction: " + (
                 f"{_figure('{:.0f}', young['memory_interval'])} iterations "
                 f"({_figure('{:.0f}', young['interval_s'])} s of compute between memory saves)"
                 if young["interval_s"] is not None
                 else "none, every failure loses host RAM")]
    if "monte_carlo_skipped" in tiers:
        lines.append(f"  two-tier Monte Carlo left out: {tiers['monte_carlo_skipped']}")
    return lines


LONGEST_FIGURE = 1e12
"""From here on a figure is shown in three significant digits: '{:.2f}' of 4e33 hours was
a 37-digit number, not the model's precision."""


def _figure(fmt: str, value) -> str:
    """A number for the table: '-' for no estimate, 'unbounded' where the model has no finite
    value, and a huge one in scientific notation."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "unbounded"
    return fmt.format(value) if abs(value) < LONGEST_FIGURE else f"{value:.3g}"


def _jsonable(value, path: str, unbounded: list[str]):
    """``value`` with numpy numbers as floats, and a float that is not finite as null, its
    path noted in ``unbounded``: NaN and Infinity are not JSON."""
    if isinstance(value, dict):
        return {k: _jsonable(v, f"{path}.{k}" if path else k, unbounded)
                for k, v in value.items()}
    if isinstance(value, int) or not hasattr(value, "__float__"):
        return value
    if math.isfinite(float(value)):
        return float(value)
    unbounded.append(path)
    return None


def _json_body(x: GoodputInputs, measured: dict, result: dict) -> dict:
    unbounded: list[str] = []
    body = _jsonable({"inputs": asdict(x), "measured": sorted(measured), **result}, "",
                     unbounded)
    if unbounded:
        body["unbounded"] = {"fields": unbounded, "message": (
            "these are null: the model has no finite value for them (failures outpace "
            "progress, so the run never ends)")}
    return body


def _field_docs() -> dict[str, str]:
    """Each GoodputInputs field's docstring (the string after it), for the option help."""
    body = ast.parse(textwrap.dedent(inspect.getsource(GoodputInputs))).body[0].body
    return {node.target.id: follower.value.value.split("\n")[0]
            for node, follower in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(follower, ast.Expr)}


FOLLOWING_DEFAULTS = {
    "memory_save_s": "a quarter of --save-block-s",
    "persist_s": "--save-persist-s",
}
"""Inputs whose default follows another input's value (:func:`model_inputs`)."""


def _input_options(command):
    """One option per model input, default None so that an unset one can be measured."""
    docs = _field_docs()
    for field in reversed(fields(GoodputInputs)):
        kind = int if field.type == "int" else float
        default = FOLLOWING_DEFAULTS.get(field.name, f"{field.default:g}")
        option = click.option(_option(field.name), field.name, type=kind,
                              default=None, help=f"{docs[field.name]} [default: {default}]")
        command = option(command)
    return command


@click.command("goodput")
@click.option("--run-dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Read measured save, iteration and restart times from this run directory.")
@click.option("--gpu-failure-rate", type=FiniteFloatRange(min=1 / goodput.MAX_INPUT,
                                                          max=goodput.MAX_INPUT), default=None,
              help="Failures per GPU-hour; the same as --gpu-mtbf-hours 1/RATE.")
@click.option("--runs", type=int, default=200, show_default=True,
              help=f"Monte Carlo runs: 0 for the analytic model only, else 2 to {MAX_RUNS}.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@_input_options
def goodput_command(run_dir, gpu_failure_rate, runs, seed, as_json, **given):
    """Expected goodput, lost work and the best save interval: periodic-only against
    proactive checkpointing, analytic model and Monte Carlo, under Poisson GPU failures."""
    if runs < 0 or runs == 1:
        raise InputError(f"--runs must be 0 (analytic model only) or at least 2 (the "
                         f"Monte Carlo's standard error needs two runs), not {runs}")
    if runs > MAX_RUNS:
        raise InputError(f"--runs must be at most {MAX_RUNS} (each run's state is held "
                         f"in memory), not {runs}")
    explicit = {k: v for k, v in given.items() if v is not None}
    if gpu_failure_rate is not None:
        if "gpu_mtbf_hours" in explicit:
            raise InputError("give --gpu-mtbf-hours or --gpu-failure-rate, not both")
        explicit["gpu_mtbf_hours"] = 1 / gpu_failure_rate
    measured = measure(run_dir, report.load_events(run_dir)) if run_dir else {}
    measured = {k: v for k, v in measured.items() if k not in explicit}
    try:
        x = model_inputs(explicit, measured)
        with np.errstate(all="ignore"):  # absurd inputs overflow: shown as "unbounded"
            result = _report(x, runs, seed)
    except (ValueError, RuntimeError) as exc:
        raise InputError(in_option_names(str(exc), measured, run_dir)) from None
    except ArithmeticError as exc:  # inputs the model's own checks let through
        inputs = [f"{_option(name)} {value:g}" for name, value in explicit.items()]
        inputs += [f"{_option(name)} {value:g} (measured in {run_dir})"
                   for name, value in measured.items()]
        raise InputError(
            f"the goodput model cannot evaluate these inputs ({type(exc).__name__}: {exc}): "
            + (", ".join(inputs) if inputs else "the defaults")) from None
    if as_json:
        click.echo(json.dumps(_json_body(x, measured, result), indent=2, allow_nan=False))
    else:
        click.echo(_table(x, measured, result))

