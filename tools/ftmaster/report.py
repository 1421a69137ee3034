"""``ftmaster report RUN_DIR``: a run's timeline and, per failure, what it cost (RTO and RPO).

Reads ``RUN_DIR/events.jsonl`` (DESIGN's events table) and ``RUN_DIR/logs/attempt_<N>.log``.
Times are unix seconds; the timeline shows them relative to the first event. Per ``failure``
event (``fault_at`` is the moment the fault happened, where it is known):

* **detection latency**: failure event time minus the first of, in this order,
  1. a ``fault_injected`` event of kind ``fail`` or ``hang`` on a failed GPU since the previous
     failure (``fault_at`` is its time);
  2. a ``risk_alert`` with reason ``device_lost`` on a failed GPU, by the sample's own
     ``timestamp``, since the previous failure and not after this one (``fault_at`` is that);
  3. the last progress of the failed attempt, estimated (nothing records when an iteration
     ends): the newest event of the attempt that names an iteration (``resumed``,
     ``save_deferred``, ``fault_injected`` at its time; a save at its ``started_at``), plus the
     log's per-iteration times for the iterations from there to the failure's. Before any
     iteration, the attempt's launch. Unknown (null) when the log lacks an iteration needed.
* **lead time**: ``fault_at`` (else the failure event's time) minus the first ``risk_alert``
  (not ``device_lost``) on a failed GPU since the previous failure and before that moment.
  Null when no alert came first.
* **checkpoint**: the newest ``emergency_save``/``periodic_save`` event (written once the
  checkpoint is durable) before the failure. **restarted from**: the iteration of the
  relaunch log's ``loaded checkpoint`` line.
* **lost iterations (RPO)**: the failure's last completed iteration minus the iteration
  training restarted from (else the checkpoint's, else 0); ``lost_seconds`` adds up the failed
  attempt's logged iteration times for them.
* **RTO** (``rto_seconds``): from detection, i.e. the first ``resumed`` event after the
  failure minus the failure event, in phases failure -> ``plan`` (this includes any
  ``waiting`` for GPUs), plan -> ``launch``, launch -> checkpoint loaded, loaded -> first
  resumed iteration. The trainer's log lines carry no clock time, so the loaded moment is
  estimated as the ``resumed`` time minus the relaunch log's per-iteration times for the
  iterations after the loaded one (the ``loaded checkpoint`` line's own load duration is
  given as ``load_seconds``). Without those times both of these phases are null.
* **RTO from the fault** (``rto_from_fault_seconds``): where ``fault_at`` is known, the RTO
  plus the detection phase ``fault_to_failure_seconds`` (failure event minus ``fault_at``),
  the recovery time as FlashRecovery measures it. Null when the fault's time is unknown.
* **new layout**: the ``plan`` event's fields, with the relaunch's GPUs.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import click

from ftmaster import runfiles

SAVES = ("emergency_save", "periodic_save")
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
_LOADED = re.compile(r"loaded checkpoint from .+? at iteration (\d+) in ([0-9.]+) s \((\d+) bytes\)")


class ReportError(click.ClickException):
    """Bad input: one line on stderr and exit status 1."""


# ---- inputs ----------------------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


class FieldType(NamedTuple):
    """What an event field must hold: as the error message says it, and as a test."""

    wording: str
    test: Callable[[Any], bool]


INT_OR_NULL = FieldType("an integer or null", lambda v: v is None or _is_int(v))
NUMBER = FieldType("a finite number", _is_number)
INT_LIST = FieldType("a list of integers", lambda v: isinstance(v, list) and all(map(_is_int, v)))
STR_LIST = FieldType("a list of strings",
                     lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v))
SAVE_FIELDS = {"iteration": INT_OR_NULL, "started_at": NUMBER}
# The fields the report computes with, per event: a wrong type would crash it or, worse,
# silently mislead (a string of GPU digits iterates as characters). Absent is fine.
FIELD_TYPES = {
    "launch": {"attempt": INT_OR_NULL},
    "failure": {"attempt": INT_OR_NULL, "iteration": INT_OR_NULL, "gpus": INT_LIST},
    "resumed": {"attempt": INT_OR_NULL, "iteration": INT_OR_NULL},
    "fault_injected": {"gpu": INT_OR_NULL, "iteration": INT_OR_NULL},
    "risk_alert": {"gpu": INT_OR_NULL, "reasons": STR_LIST},
    "save_deferred": {"iteration": INT_OR_NULL},
    "emergency_save": SAVE_FIELDS, "periodic_save": SAVE_FIELDS,
}


def load_events(run_dir: Path) -> list[dict]:
    """Every event, strictly: a report built on a skipped line would silently mislead."""
    path = runfiles.events_path(run_dir)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ReportError(f"{path} does not exist: give a run directory written by ftmaster "
                          "launch") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"cannot read {path}: {exc}") from None
    events = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            events.append(_parse_event(path, number, line))
    if not events:
        raise ReportError(f"{path} has no events: nothing to report")
    return sorted(events, key=lambda e: e["time"])


def _parse_event(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not (isinstance(record, dict) and isinstance(record.get("event"), str)
            and _is_number(record.get("time"))):
        raise ReportError(f"{path} line {number} is not a JSON object with a string \"event\" "
                          "and a numeric \"time\"; fix or remove that line")
    for name, expected in FIELD_TYPES.get(record["event"], {}).items():
        if name in record and not expected.test(record[name]):
            raise ReportError(f"{path} line {number}: \"{name}\" of a {record['event']} event "
                              f"must be {expected.wording}, not {json.dumps(record[name])}; fix "
                              "or remove that line")
    return record


@dataclass
class AttemptLog:
    """What one attempt's training log says about loading and iteration times."""

    loaded_iteration: int | None = None
    load_seconds: float | None = None
    load_bytes: int | None = None
    iteration_s: dict[int, float] = field(default_factory=dict)
    """Seconds per iteration; a line logged every k iterations stands for all k of them."""

    def seconds_between(self, after: int, upto: int) -> float | None:
        """Time of iterations ``after+1 .. upto``; None when one of them is not logged."""
        wanted = range(after + 1, upto + 1)
        if any(i not in self.iteration_s for i in wanted):
            return None
        return sum(self.iteration_s[i] for i in wanted)


def read_attempt_log(run_dir: Path, attempt: Any) -> AttemptLog:
    log = AttemptLog()
    path = runfiles.logs_dir(run_dir) / f"attempt_{attempt}.log"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return log  # no log: the phases that need it are reported as unknown
    previous = None
    for line in lines:
        if loaded := _LOADED.search(line):
            log.loaded_iteration = previous = int(loaded.group(1))
            log.load_seconds, log.load_bytes = float(loaded.group(2)), int(loaded.group(3))
        elif logged := _ITERATION.search(line):
            iteration, seconds = int(logged.group(1)), float(logged.group(2)) / 1000
            first = iteration if previous is None else previous + 1
            log.iteration_s.update(dict.fromkeys(range(first, iteration + 1), seconds))
            previous = iteration
    return log


# ---- per failure -----------------------------------------------------------------------------

def _sample_time(alert: dict) -> float:
    """A risk_alert's sample time (its ISO ``timestamp``), else the event's own time."""
    try:
        return datetime.fromisoformat(str(alert["timestamp"])).timestamp()
    except (KeyError, ValueError):
        return alert["time"]


def _fault_moment(window: list[dict], failure: dict) -> tuple[float, str] | None:
    """Where the fault's own time is known: injected, or the monitor saw the GPU vanish."""
    gpus = set(failure.get("gpus") or ())
    for event in window:
        if event["event"] == "fault_injected" and event.get("kind") in ("fail", "hang") \
                and event.get("gpu") in gpus:
            return event["time"], f"fault_injected {event['kind']} on GPU {event['gpu']}"
    lost = [(_sample_time(e), e["gpu"]) for e in window if e["event"] == "risk_alert"
            and "device_lost" in (e.get("reasons") or ()) and e.get("gpu") in gpus]
    lost = [(t, gpu) for t, gpu in lost if t <= failure["time"]]
    if lost:
        when, gpu = min(lost)
        return when, f"monitor: GPU {gpu} device_lost"
    return None


def _last_progress(attempt_events: list[dict], failure: dict, log: AttemptLog) -> float | None:
    """Estimated end of the failure's last completed iteration (see the module docstring)."""
    target = failure.get("iteration")
    if not isinstance(target, int):
        launches = [e["time"] for e in attempt_events if e["event"] == "launch"]
        return launches[0] if launches else None
    anchors = [(e["iteration"], e.get("started_at", e["time"]) if e["event"] in SAVES else e["time"])
               for e in attempt_events
               if e["event"] in (*SAVES, "resumed", "save_deferred", "fault_injected")
               and isinstance(e.get("iteration"), int) and e["iteration"] <= target]
    if not anchors:
        return None
    iteration, when = max(anchors, key=lambda a: (a[0], -a[1]))
    rest = log.seconds_between(iteration, target)
    return None if rest is None else min(when + rest, failure["time"])


def _detection(window: list[dict], attempt_events: list[dict], failure: dict,
               log: AttemptLog) -> tuple[float | None, dict]:
    """(fault_at or None, the detection record)."""
    known = _fault_moment(window, failure)
    if known is not None:
        return known[0], {"seconds": failure["time"] - known[0], "since": known[1]}
    progress = _last_progress(attempt_events, failure, log)
    seconds = None if progress is None else failure["time"] - progress
    return None, {"seconds": seconds, "since": "last progress (estimated)"}


def _lead_time(window: list[dict], failure: dict, fault_at: float) -> dict | None:
    gpus = set(failure.get("gpus") or ())
    alerts = [e for e in window if e["event"] == "risk_alert" and e.get("gpu") in gpus
              and "device_lost" not in (e.get("reasons") or ()) and e["time"] < fault_at]
    if not alerts:
        return None
    first = alerts[0]
    return {"seconds": fault_at - first["time"], "gpu": first["gpu"], "score": first.get("score"),
            "reasons": first.get("reasons"), "time": first["time"]}


def _checkpoint(events: list[dict], failure: dict) -> dict | None:
    saves = [e for e in events if e["event"] in SAVES and e["time"] <= failure["time"]
             and isinstance(e.get("iteration"), int)]
    if not saves:
        return None
    newest = max(saves, key=lambda e: (e["iteration"], e["time"]))
    return {"iteration": newest["iteration"], "event": newest["event"],
            "kind": newest.get("kind"), "durable_at": newest["time"]}


def _first(events: list[dict], name: str, after: float) -> dict | None:
    return next((e for e in events if e["event"] == name and e["time"] >= after), None)


def _recovery(after: list[dict], failure: dict, plan: dict | None, launch: dict | None,
              relaunch_log: AttemptLog) -> dict:
    """RTO and its phases, from the events between this failure and the next one."""
    resumed = _first(after, "resumed", launch["time"]) if launch else None
    loaded = None
    if resumed and relaunch_log.loaded_iteration is not None and isinstance(resumed.get("iteration"), int):
        first_iterations = relaunch_log.seconds_between(relaunch_log.loaded_iteration,
                                                        resumed["iteration"])
        loaded = None if first_iterations is None else {"time": resumed["time"] - first_iterations}
    marks = [failure, plan, launch, loaded, resumed]
    names = ("failure_to_plan", "plan_to_launch", "launch_to_loaded", "loaded_to_first_iteration")
    phases = {name: (b["time"] - a["time"] if a and b else None)
              for name, a, b in zip(names, marks, marks[1:])}
    return {"rto_seconds": resumed["time"] - failure["time"] if resumed else None,
            "phases": phases, "resumed": resumed}


def _layout(plan: dict | None, launch: dict | None) -> dict | None:
    if plan is None:
        return None
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
            "micro_batch_size", "global_batch_size", "num_gpus_used")
    layout = {key: plan.get(key) for key in keys}
    layout["gpus"] = launch.get("gpus") if launch else plan.get("gpus_available")
    return layout


def _outcome_after(after: list[dict]) -> str:
    """What became of a failure that was not resumed."""
    for event in after:
        if event["event"] == "gave_up":
            return f"gave up: {event.get('reason')}"
        if event["event"] == "stopped":
            return "stopped by a signal before resuming"
    return "not resumed (the run ended or is still recovering)"


def failure_report(run_dir: Path, events: list[dict], index: int, failures: list[dict]) -> dict:
    """Everything the report says about ``failures[index]``."""
    failure = failures[index]
    since = failures[index - 1]["time"] if index else -math.inf
    until = failures[index + 1]["time"] if index + 1 < len(failures) else math.inf
    window = [e for e in events if since < e["time"] <= until]
    before = [e for e in window if e["time"] <= failure["time"]]
    after = [e for e in window if e["time"] >= failure["time"] and e is not failure]
    attempt = failure.get("attempt")
    launched = [e for e in events if e["event"] == "launch" and e.get("attempt") == attempt]
    attempt_events = [e for e in before if not launched or e["time"] >= launched[0]["time"]]
    failed_log = read_attempt_log(run_dir, attempt)
    fault_at, detection = _detection(window, attempt_events, failure, failed_log)

    plan = _first(after, "plan", failure["time"])
    relaunch = _first(after, "launch", plan["time"]) if plan else None
    relaunch_log = read_attempt_log(run_dir, relaunch.get("attempt")) if relaunch else AttemptLog()
    recovery = _recovery(after, failure, plan, relaunch, relaunch_log)

    checkpoint = _checkpoint(events, failure)
    restart_from = relaunch_log.loaded_iteration
    base = restart_from if restart_from is not None else (checkpoint or {}).get("iteration", 0)
    last = failure.get("iteration")
    lost = last - base if isinstance(last, int) else None
    fault_to_failure = None if fault_at is None else failure["time"] - fault_at
    rto = recovery["rto_seconds"]
    return {
        "attempt": attempt, "time": failure["time"], "cause": failure.get("cause"),
        "gpus": failure.get("gpus"), "iteration": last, "fault_at": fault_at,
        "detection_latency": detection,
        "lead_time": _lead_time(window, failure, fault_at if fault_at is not None else failure["time"]),
        "checkpoint": checkpoint, "restarted_from_iteration": restart_from,
        "lost_iterations": lost,
        "lost_seconds": failed_log.seconds_between(base, last) if lost is not None else None,
        "rto_seconds": rto, "phases": recovery["phases"],
        "fault_to_failure_seconds": fault_to_failure,
        "rto_from_fault_seconds": (rto + fault_to_failure
                                   if rto is not None and fault_to_failure is not None else None),
        "load_seconds": relaunch_log.load_seconds, "load_bytes": relaunch_log.load_bytes,
        "resumed": ({k: recovery["resumed"].get(k) for k in ("attempt", "iteration")}
                    if recovery["resumed"] else None),
        "outcome": "resumed" if recovery["resumed"] else _outcome_after(after),
        "new_layout": _layout(plan, relaunch),
    }


# ---- the whole run ---------------------------------------------------------------------------

TEMPLATES = {
    "launch": "attempt {attempt} on GPU(s) {gpus}: TP {tensor_model_parallel_size} x "
              "PP {pipeline_model_parallel_size} x DP {data_parallel_size}",
    "fault_injected": "{kind} on GPU {gpu} at iteration {iteration}",
    "risk_alert": "GPU {gpu} score {score} ({reasons})",
    "checkpoint_request": "from {source}, GPU {gpu}",
    "emergency_save": "{kind} checkpoint of iteration {iteration} durable: training blocked "
                      "{seconds} s, {persist_seconds} s to disk, {bytes} bytes",
    "save_deferred": "iteration {iteration}: emergency save deferred to iteration {until_iteration}",
    "failure": "attempt {attempt} {cause} on GPU(s) {gpus}, last iteration {iteration}",
    "stopped": "signal {signal}, exit status {exit_code}, at iteration {iteration}",
    "plan": "TP {tensor_model_parallel_size} x PP {pipeline_model_parallel_size} x DP "
            "{data_parallel_size}, micro-batch {micro_batch_size}, global batch "
            "{global_batch_size} on {num_gpus_used} of GPU(s) {gpus_available}",
    "resumed": "attempt {attempt} completed iteration {iteration}",
    "complete": "iteration {iteration}",
    "gave_up": "{reason}",
    "checkpoint_loaded": "iteration {iteration} from {path} in {seconds} s ({bytes} bytes, "
                         "checksums verified in {verify_seconds} s)",
    "checkpoint_skipped": "iteration {iteration} ({path}): {reason}",
    "save_failed": "{kind} checkpoint of iteration {iteration} not saved ({tier}): {reason}",
    "load_failed": "{reason}",
    "nonfinite": "non-finite {what} at iteration {iteration}, nothing updated or saved",
}
TEMPLATES["periodic_save"] = TEMPLATES["emergency_save"]


class _Fields(dict):
    def __missing__(self, key: str) -> str:
        return "?"


def describe(event: dict) -> str:
    """One event as text: its template, or its fields as key=value."""
    fields = _Fields({k: f"{v:g}" if isinstance(v, float) else
                      ", ".join(map(str, v)) if isinstance(v, list) and k == "reasons" else v
                      for k, v in event.items()})
    template = TEMPLATES.get(event["event"])
    if template is not None:
        return template.format_map(fields)
    return " ".join(f"{k}={fields[k]}" for k in event if k not in ("event", "time", "command"))


def _run_outcome(events: list[dict]) -> str:
    for event in reversed(events):
        if event["event"] in ("complete", "gave_up", "stopped"):
            return f"{event['event']}: {describe(event)}"
    return "no end event (still running, or ftmaster itself was killed)"


def failure_reports(run_dir: Path, events: list[dict]) -> list[dict]:
    """:func:`failure_report` for every failure of ``events`` (from :func:`load_events`)."""
    failures = [e for e in events if e["event"] == "failure"]
    return [failure_report(run_dir, events, i, failures) for i in range(len(failures))]


def build_report(run_dir: Path) -> dict:
    events = load_events(run_dir)
    start = events[0]["time"]
    return {
        "run_dir": str(run_dir), "start_time": start,
        "timeline": [{"t": e["time"] - start, "event": e["event"], "text": describe(e)}
                     for e in events],
        "failures": failure_reports(run_dir, events),
        "outcome": _run_outcome(events),
    }


# ---- text --------------------------------------------------------------------------------------

def _s(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds:.3f} s"


def _failure_text(number: int, f: dict, start: float) -> list[str]:
    detection, lead, ckpt = f["detection_latency"], f["lead_time"], f["checkpoint"]
    lines = [f"failure {number}: attempt {f['attempt']}, {f['cause']} on GPU(s) {f['gpus']} at "
             f"+{f['time'] - start:.2f} s, last completed iteration {f['iteration']}",
             f"  detection latency  {_s(detection['seconds'])} (since {detection['since']})",
             "  lead time          " + ("no alert before the failure" if lead is None else
                                        f"{_s(lead['seconds'])} (first risk_alert: GPU {lead['gpu']} "
                                        f"score {lead['score']} at +{lead['time'] - start:.2f} s)"),
             "  last checkpoint    " + ("none" if ckpt is None else
                                        f"iteration {ckpt['iteration']} ({ckpt['kind'] or ckpt['event']}, "
                                        f"durable at +{ckpt['durable_at'] - start:.2f} s)"),
             "  restarted from     " + ("no checkpoint loaded" if f["load_seconds"] is None else
                                        f"iteration {f['restarted_from_iteration']} (load "
                                        f"{f['load_seconds']:.3f} s, {f['load_bytes']} bytes)"),
             f"  lost iterations    {f['lost_iterations']} (RPO; {_s(f['lost_seconds'])} of training)"]
    if f["outcome"] != "resumed":
        return [*lines, f"  RTO                unknown: {f['outcome']}"]
    lines.append(f"  RTO                {_s(f['rto_seconds'])} to iteration "
                 f"{f['resumed']['iteration']} (attempt {f['resumed']['attempt']})")
    lines += [f"    {name.replace('_', ' '):<28}{_s(value)}" for name, value in f["phases"].items()]
    if f["rto_from_fault_seconds"] is not None:
        lines.append(f"  RTO from fault     {_s(f['rto_from_fault_seconds'])} (detection: fault to "
                     f"failure {_s(f['fault_to_failure_seconds'])}, then the RTO above)")
    layout = f["new_layout"]
    if layout is not None:
        lines.append(f"  new layout         TP {layout['tensor_model_parallel_size']} x PP "
                     f"{layout['pipeline_model_parallel_size']} x DP {layout['data_parallel_size']}, "
                     f"micro-batch {layout['micro_batch_size']}, global batch "
                     f"{layout['global_batch_size']}, GPU(s) {layout['gpus']}")
    return lines


def format_report(report: dict) -> str:
    lines = [f"run {report['run_dir']}: {len(report['timeline'])} events, "
             f"{len(report['failures'])} failure(s); outcome {report['outcome']}", "", "timeline:"]
    lines += [f"  {'+' + format(row['t'], '.2f'):>10} s  {row['event']:<18} {row['text']}"
              for row in report["timeline"]]
    lines.append("")
    if not report["failures"]:
        lines.append("no failures in this run")
    for number, failure in enumerate(report["failures"], 1):
        lines += _failure_text(number, failure, report["start_time"])
    return "\n".join(lines)


@click.command("report")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the report as JSON [default: RUN_DIR/report.json].")
def report_command(run_dir: Path, json_out: Path | None) -> None:
    """Print RUN_DIR's timeline and, per failure, detection latency, alert lead time, lost
    iterations (RPO) and time to resume (RTO) in phases; write the same as JSON."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory: give an ftmaster run directory")
    report = build_report(run_dir)
    json_out = json_out or run_dir / "report.json"
    try:
        json_out.write_text(json.dumps(report, indent=1) + "\n")
    except OSError as exc:
        raise ReportError(f"cannot write {json_out}: {exc.strerror}") from None
    click.echo(format_report(report))
    click.echo(f"\nwrote {json_out}")
