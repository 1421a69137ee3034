"""``RUN_DIR/report.html``: the incident page ``ftmaster report`` writes beside its text.

One self-contained file (figures inlined as PNG), built from the report
(:func:`ftmaster.report.build_report`), the run's events and the monitor's CSV:

* the run's timeline: one bar per attempt with its layout and GPUs, and markers for alerts,
  saves by tier, persists to disk, failures and plans; the same as a table below it;
* each failure: its RTO phases as one stacked bar, its RPO, and the risk of every GPU from
  shortly before its fault until it resumed;
* goodput: what the run achieved (iterations at its median step time over its wall time)
  and what ``ftmaster goodput`` models for its measured save, iteration and restart times.

Every number on the page is rounded for people (:func:`human`).
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ftmaster import goodput, goodput_cli  # noqa: E402
from ftmaster.console import gpu_count_text, gpus_text  # noqa: E402
from ftmaster.monitor.alerts import AlertConfig  # noqa: E402
from ftmaster.report import (INCIDENT_PAGE, event_label, restarted_from_text,  # noqa: E402
                             round_text, straggler_text, write_for_people)

RISK_WINDOW_BEFORE_S = 60.0
"""How long before a failure's fault its risk plot starts."""
PHASES = ("failure_to_plan", "plan_to_launch", "launch_to_loaded", "loaded_to_first_iteration")
PHASE_COLOURS = ("#d62728", "#ff7f0e", "#1f77b4", "#2ca02c")
MARKERS = {  # event -> (label, marker, colour)
    "risk_alert": ("alert", "v", "#d62728"),
    "memory_save": ("save to memory", "o", "#1f77b4"),
    "disk_save": ("save to disk", "s", "#2ca02c"),
    "persisted": ("persisted to disk", "D", "#9467bd"),
    "failure": ("failure", "X", "black"),
    "plan": ("plan", "|", "#ff7f0e"),
}


def human(value, unit: str = "") -> str:
    """A number as people read it: at most 2 decimals (1 from 10, none from 100), thousands
    grouped, never float noise; below 0.01 it reads "< 0.01"."""
    if value is None:
        return "unknown"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return html.escape(str(value))
    if isinstance(value, int) or float(value).is_integer():
        text = f"{int(value):,}"
    elif abs(value) >= 100:
        text = f"{value:,.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    elif abs(value) >= 0.01:
        text = f"{value:.2f}"
    else:
        text = "< 0.01"
    return f"{text} {unit}".strip()


def share(value: float | None) -> str:
    """A fraction such as goodput in per cent, to two decimals: 0.9975 and 0.9994 differ,
    where two decimals of the fraction read both as 1.00, no loss at all."""
    return "unknown" if value is None else f"{value:.2%}"


def write_incident_page(run_dir: Path, report: dict, events: list[dict], frame) -> Path:
    """Write ``run_dir/report.html``; ``frame`` is the monitor's samples (None: no CSV)."""
    start = report["start_time"]
    sections = [_header(report), _timeline(events, start), _stragglers(report),
                _failures(report, frame, start), _goodput(run_dir, events)]
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>ftmaster incident report: {html.escape(Path(report['run_dir']).name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}td.n{{text-align:right}}
img{{max-width:100%}}h2{{border-bottom:1px solid #ddd}}.failure{{margin-bottom:2em}}</style>
</head><body>
{''.join(sections)}
</body></html>
"""
    path = run_dir / INCIDENT_PAGE
    write_for_people(path, page)
    return path


def _header(report: dict) -> str:
    timeline = report["timeline"]
    took = timeline[-1]["t"] if timeline else 0.0
    return (f"<h1>Incident report: {html.escape(report['run_dir'])}</h1>\n"
            f"<p>outcome: <b>{html.escape(report['outcome'])}</b>; "
            f"{len(report['failures'])} failure(s); {human(took, 's')} from the first event to "
            f"the last</p>\n")


# ---- the timeline ------------------------------------------------------------------------------

def _attempts(events: list[dict]) -> list[dict]:
    """Each launch with the time its attempt ended (its failure, completion or stop), at the
    latest its node's next launch: a drained attempt records no end of its own."""
    launches = [e for e in events if e["event"] == "launch"]
    ends = [e for e in events if e["event"] in ("failure", "complete", "stopped", "gave_up")]
    attempts = []
    for launch in launches:
        mine = launch.get("node")
        relaunch = next((e["time"] for e in launches if e["time"] > launch["time"]
                         and e.get("node") == mine), events[-1]["time"])
        end = next((e["time"] for e in ends if e["time"] >= launch["time"]
                    and e.get("node") == mine
                    and e.get("attempt", launch.get("attempt")) == launch.get("attempt")),
                   relaunch)
        attempts.append({**launch, "end": min(end, relaunch)})
    return attempts


def _marker_kind(event: dict) -> str | None:
    kind = event["event"]
    if kind in ("emergency_save", "periodic_save"):
        return "memory_save" if event.get("tier") == "memory" else "disk_save"
    return kind if kind in MARKERS else None


def _layout_label(launch: dict) -> str:
    tp, pp, dp = ("?" if launch.get(key) is None else launch[key] for key in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size"))
    return f"attempt {launch.get('attempt')}: TP{tp} x PP{pp} x DP{dp}, {gpus_text(launch.get('gpus'))}"


def _items(value) -> str:
    """A list as a person reads it, its items joined (``xid_92``, not ``['xid_92']``)."""
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def _timeline(events: list[dict], start: float) -> str:
    attempts = _attempts(events)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * max(1, len(attempts))), dpi=100)
    for row, attempt in enumerate(attempts):
        ax.barh(row, attempt["end"] - attempt["time"], left=attempt["time"] - start, height=0.5,
                color="#c7dcef", edgecolor="#1f77b4")
        ax.text(attempt["time"] - start, row - 0.3, _layout_label(attempt), fontsize=8,
                va="bottom", parse_math=False)  # above the bar: the axis is inverted
    # One scatter per kind (a call took 4.5 ms: a long run's saves took minutes), in the
    # order each kind first came, which the legend keeps.
    shown: dict[str, list[tuple[float, int]]] = {}
    for event in events:
        kind = _marker_kind(event)
        if kind is not None:
            shown.setdefault(kind, []).append((event["time"] - start, _row_at(attempts, event)))
    for kind, points in shown.items():
        label, marker, colour = MARKERS[kind]
        ax.scatter(*zip(*points), marker=marker, color=colour, s=60, zorder=3, label=label)
    ax.set_yticks(range(len(attempts)), [_node_prefix(a) + f"attempt {a.get('attempt')}"
                                         for a in attempts])
    ax.set_ylim(-0.9, max(1, len(attempts)) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first event")
    ax.grid(axis="x", alpha=0.3)
    if shown:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    nodes = any("node" in e for e in events)  # several nodes: each row says whose it is
    rows = "".join(
        f"<tr><td class='n'>{human(e['time'] - start)}</td>"
        + (f"<td class='n'>{html.escape(str(e.get('node', '')))}</td>" if nodes else "")
        + f"<td>{html.escape(event_label(e))}</td><td>{_event_text(e)}</td></tr>\n"
        for e in events if _marker_kind(e) or e["event"] in (
            "launch", "complete", "stopped", "gave_up", "resumed", "store_lost", "straggler",
            "drain", "straggler_drained", "straggler_kept", "straggler_drain_result"))
    return (f"<h2>Timeline</h2>\n{_png(fig)}\n<table><tr><th>t (s)</th>"
            + ("<th>node</th>" if nodes else "")
            + f"<th>event</th><th>details</th></tr>\n{rows}</table>\n")


def _node_prefix(event: dict) -> str:
    return f"node {event['node']} " if "node" in event else ""


def _row_at(attempts: list[dict], event: dict) -> float:
    """The attempt row an event belongs on: its node's newest launched before it (-0.5 before
    any)."""
    rows = [row for row, a in enumerate(attempts)
            if a["time"] <= event["time"] and a.get("node") == event.get("node")]
    return rows[-1] if rows else -0.5


def _event_text(event: dict) -> str:
    kind = event["event"]
    if kind == "launch":
        return html.escape(_layout_label(event))
    keys = {"risk_alert": ("gpu", "score", "reasons"), "failure": ("cause", "gpus", "iteration"),
            "plan": ("gpus_available", "tensor_model_parallel_size",
                     "pipeline_model_parallel_size", "data_parallel_size"),
            "persisted": ("iteration", "seconds"), "resumed": ("attempt", "iteration"),
            "emergency_save": ("iteration", "tier", "seconds"),
            "periodic_save": ("iteration", "tier", "seconds"),
            "complete": ("iteration",), "stopped": ("signal",), "gave_up": ("reason",),
            "store_lost": ("reason",), "straggler": ("gpu", "slowdown", "since"),
            "drain": ("gpu", "reason", "decided_by"), "straggler_drained": ("gpu",),
            "straggler_kept": ("gpu", "reason"),
            "straggler_drain_result": ("step_s", "slowed_step_s")}
    return ", ".join(f"{key} {human(event[key]) if not isinstance(event[key], (list, str)) else html.escape(_items(event[key]))}"
                     for key in keys.get(kind, ()) if key in event)


# ---- stragglers --------------------------------------------------------------------------------

def _stragglers(report: dict) -> str:
    found = report.get("stragglers") or []
    if not found:
        return ""
    return "<h2>Stragglers</h2>\n" + "".join(f"<p>{html.escape(straggler_text(s))}</p>\n"
                                              for s in found)


# ---- failures ----------------------------------------------------------------------------------

def _failures(report: dict, frame, start: float) -> str:
    if not report["failures"]:
        return "<h2>Failures</h2>\n<p>none</p>\n"
    parts = ["<h2>Failures</h2>\n"]
    for number, failure in enumerate(report["failures"], 1):
        where = f" on {html.escape(gpus_text(failure['gpus']))}" if failure["gpus"] else ""
        parts.append(f"<div class='failure'><h3>Failure {number}: {_node_prefix(failure)}"
                     f"{html.escape(str(failure['cause']))}{where} at "
                     f"{human(failure['time'] - start, 's')}</h3>\n")
        if "node" in failure:
            parts.append("".join(f"<p>{html.escape(' '.join(line.split()))}</p>\n"
                                 for line in round_text(failure, start)))  # the text's padding
        lost_s = failure.get("lost_seconds")
        parts.append(
            f"<p>RTO <b>{human(failure['rto_seconds'], 's')}</b> (failure to first resumed "
            f"iteration; from the fault {human(failure['rto_from_fault_seconds'], 's')}); RPO "
            f"<b>{human(failure['lost_iterations'])} iteration(s)</b>"
            f"{'' if lost_s is None else ' (' + human(lost_s, 's') + ' of training)'}, restarted "
            f"from: {html.escape(restarted_from_text(failure))}; outcome "
            f"{html.escape(failure['outcome'])}</p>\n")
        parts.append(_phases_bar(failure))
        parts.append(_risk_around(failure, frame))
        parts.append("</div>\n")
    return "".join(parts)


def _phases_bar(failure: dict) -> str:
    phases = failure.get("phases") or {}
    known = [(name, phases.get(name)) for name in PHASES if phases.get(name) is not None]
    if not known:
        return "<p>RTO phases: unknown (no resume, or no relaunch log times)</p>\n"
    fig, ax = plt.subplots(figsize=(12, 1.6), dpi=100)
    left = 0.0
    for (name, seconds), colour in zip(known, PHASE_COLOURS):
        ax.barh(0, seconds, left=left, color=colour, label=f"{name.replace('_', ' ')} "
                                                         f"{human(seconds, 's')}")
        left += seconds
    ax.set_yticks([])
    ax.set_xlabel("seconds from the failure")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.1), fontsize=8, frameon=False)
    fig.tight_layout()
    return f"<p>RTO phases:</p>\n{_png(fig)}\n"


def _risk_around(failure: dict, frame) -> str:
    if frame is None or "failure_risk" not in frame:
        return "<p>risk: no monitor samples</p>\n"
    fault = failure.get("fault_at") or failure["time"]
    until = failure["time"] + (failure.get("rto_seconds") or 0.0) + 5.0
    window = frame[(frame["time"] >= fault - RISK_WINDOW_BEFORE_S) & (frame["time"] <= until)]
    if "node" in window and failure.get("node") is not None:
        window = window[window["node"] == failure["node"]]
    if window.empty:
        return "<p>risk: no monitor samples around it</p>\n"
    fig, ax = plt.subplots(figsize=(12, 3), dpi=100)
    for gpu, rows in window.groupby("gpu_id"):
        ax.plot(rows["time"] - failure["time"], rows["failure_risk"], linewidth=1.2,
                label=f"GPU {gpu}")
    ax.axhline(AlertConfig().threshold, color="crimson", linestyle="--", linewidth=1,
               label="alert threshold")
    ax.axvline(0.0, color="black", linewidth=1, label="failure")
    if failure.get("fault_at") is not None:
        ax.axvline(failure["fault_at"] - failure["time"], color="grey", linestyle=":",
                   label="fault")
    ax.set_xlabel("seconds from the failure")
    ax.set_ylabel("failure risk")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return f"<p>risk of each GPU around it:</p>\n{_png(fig)}\n"


# ---- goodput -----------------------------------------------------------------------------------

PROGRESS_EVENTS = ("complete", "checkpoint_loaded", "resumed", "emergency_save", "periodic_save")
"""Events that name an iteration the run held when they were written. A failure's own is not
one: what it kept is its newest checkpoint, which a save or a relaunch's load names; counted,
a run that gave up (or was still recovering) read the iterations it lost as useful work. Nor
is a stop's: it names the last iteration trained (the failed attempt's, stopped while waiting
for GPUs), and a stop that saved wrote its own save event."""


def observed_goodput(measured: dict, events: list[dict]) -> dict | None:
    """The iterations the run completed, from where its first attempt started to where it
    ended (a live run: to its newest save or resume), at its median step time, over its wall
    time."""
    # The last one: an attempt that got further before failing had its iterations past the
    # relaunch's load redone or lost; a standby node's completion says where it last trained.
    done = [e["iteration"] for e in events if e["event"] in PROGRESS_EVENTS
            and isinstance(e.get("iteration"), int) and not e.get("on_other_nodes")]
    launches = [e["time"] for e in events if e["event"] == "launch"]
    if not done or not launches or "iteration_s" not in measured:
        return None
    wall = events[-1]["time"] - launches[0]
    iterations = max(0, done[-1] - _started_from(events))
    useful = iterations * measured["iteration_s"]
    return {"goodput": min(1.0, useful / wall) if wall > 0 else None, "wall_s": wall,
            "useful_s": useful, "iterations": iterations, "iteration_s": measured["iteration_s"]}


def _started_from(events: list[dict]) -> int:
    """The iteration the first attempt loaded (0: from scratch). A run may start from an
    earlier job's checkpoint, whose iterations took none of its wall time; a load after an
    attempt ended is a relaunch's, whose redone iterations are lost work; not after one that
    failed before its first iteration (a bad GPU at NCCL's start), which trained nothing."""
    for event in events:
        if event["event"] == "failure" and event.get("before_first_iteration") is True:
            continue
        if event["event"] in ("failure", "complete", "stopped", "gave_up", "store_lost"):
            return 0
        if event["event"] == "checkpoint_loaded" and isinstance(event.get("iteration"), int):
            return event["iteration"]
    return 0


def job_gpus(events: list[dict]) -> int:
    """The job's GPUs, for the model: across nodes the most that any round's plan ran (a
    standby node that replaced a failed one is not counted on top of it); otherwise each
    node's largest launch, added up."""
    planned = [e["num_gpus_used"] for e in events if e["event"] == "plan" and "round" in e
               and isinstance(e.get("num_gpus_used"), int)]
    if planned:
        return max(planned)
    per_node: dict = {}
    for launch in (e for e in events if e["event"] == "launch"):
        node = launch.get("node")
        per_node[node] = max(per_node.get(node, 0), len(launch.get("gpus") or []))
    return sum(per_node.values()) or 1


def _goodput(run_dir: Path, events: list[dict]) -> str:
    measured = goodput_cli.measure(run_dir, events)
    seen = observed_goodput(measured, events)
    lines = ["<h2>Goodput</h2>\n"]
    if seen is None:
        lines.append("<p>this run: unknown (no iteration times in its logs)</p>\n")
    else:
        lines.append(f"<p>this run: <b>{share(seen['goodput'])}</b>: {human(seen['iterations'])} "
                     f"iterations at {human(seen['iteration_s'], 's')} each, "
                     f"{human(seen['useful_s'], 's')} of {human(seen['wall_s'], 's')} from the "
                     f"first launch (start-up included)</p>\n")
    gpus = job_gpus(events)
    try:
        x = goodput_cli.model_inputs({"gpus": max(1, gpus)}, measured)
    except ValueError as error:
        return "".join(lines) + f"<p>model: {html.escape(str(error))}</p>\n"
    rows = []
    for name, case in (("periodic-only", x.single_tier().periodic_only()),
                       ("proactive", x.single_tier()),
                       ("two tiers", x.two_tier(goodput.optimal_memory_interval(
                           x.periodic_only())["memory_interval"]))):
        why = goodput.first_order_breakdown(case) if name == "proactive" else None
        value = None if why else goodput.analytic(case)["goodput"]
        rows.append(f"<tr><td>{name}</td><td class='n'>{share(value) if why is None else 'no estimate'}"
                    f"</td></tr>\n")
    lines.append(f"<p>modelled (<code>ftmaster goodput</code>, {gpu_count_text(gpus)}, measured here: "
                 f"{html.escape(', '.join(sorted(measured)) or 'nothing')}; defaults otherwise):</p>\n"
                 f"<table><tr><th>checkpointing</th><th>goodput</th></tr>\n{''.join(rows)}</table>\n")
    return "".join(lines)


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    encoded = base64.b64encode(buffer.getvalue()).decode()
    return f'<img alt="figure" src="data:image/png;base64,{encoded}">'
