"""``ftmaster report RUN_DIR``: a run's timeline and, per failure, what it cost (RTO and RPO).

Reads ``RUN_DIR/events.jsonl`` (DESIGN's events table) and ``RUN_DIR/logs/attempt_<N>.log``.
A line that is not an event is an error, except a torn last line (no newline: the run is still
writing, or a writer was killed mid-write), which is left out with a warning.
Times are unix seconds; the timeline shows them relative to the first event. Per ``failure``
event (``fault_at`` is the moment the fault happened, where it is known):

* **detection latency**: failure event time minus the first of, in this order,
  1. a ``fault_injected`` event of kind ``fail`` or ``hang`` on a failed GPU since the previous
     failure (``fault_at`` is its time); for a ``nonfinite`` failure, training's ``nonfinite``
     event on its node since the previous failure;
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
  checkpoint is durable) before the failure, leaving out those a resume since set aside
  (newer than the ``checkpoint_loaded`` iteration); a ``checkpoint_loaded`` of an iteration
  with no save event (an earlier job's checkpoint the run started from) counts as one, of kind
  ``loaded``, and a ``resumed`` sets aside those from before its launch at or after its
  iteration (a relaunch that loaded nothing resumes at 1). **restarted from**: the iteration
  of the relaunch log's ``loaded checkpoint`` line.
* **lost iterations (RPO)**: the failure's last completed iteration minus the iteration
  training restarted from (else the one before the first resumed iteration, 0 for a relaunch
  that loaded nothing; else, not resumed, the checkpoint's, else 0); ``lost_seconds`` adds up
  the failed attempt's logged iteration times for them.
* **RTO** (``rto_seconds``): from detection, i.e. the first ``resumed`` event after the
  failure minus the failure event, in phases failure -> ``plan`` (this includes any
  ``waiting`` for GPUs), plan -> ``launch``, launch -> checkpoint loaded, loaded -> first
  resumed iteration. The trainer's log lines carry no clock time, so the loaded moment is
  estimated as the ``resumed`` time minus the relaunch log's per-iteration times for the
  iterations after the loaded one (the ``loaded checkpoint`` line's own load duration is
  given as ``load_seconds``). Without those times both of these phases are null. A failure
  whose relaunch failed in turn before resuming recovers at the resume that ended the later
  failures too (``later_failures`` counts them; its phases are those of its own relaunch). A
  node that gave up or was stopped first ends its failures unresumed: an ftmaster started
  again on the run directory later starts anew.
* **start-up** (``startup``): the relaunch's ``startup`` event (the first after its launch):
  the start-up phases from the launch to the end of the job's first iteration, each ending
  when its last rank ends it (``megatron.training.startup``), whether its ranks ran on warm
  workers, and the rank that finished its first iteration last. Null when the relaunch recorded none (it never completed an iteration,
  or a trainer that does not measure its start-up).
* **RTO from the fault** (``rto_from_fault_seconds``): where ``fault_at`` is known, the RTO
  plus the detection phase ``fault_to_failure_seconds`` (failure event minus ``fault_at``),
  the recovery time as FlashRecovery measures it. Null when the fault's time is unknown.
* **new layout**: the ``plan`` event's fields, with the relaunch's GPUs.

**Several nodes.** When RUN_DIR holds ``node_<R>`` folders (``ftmaster launch --nnodes``), each
with the single-node layout, the report merges them into one timeline and one recovery per
round; without node folders nothing below applies and the output is as above.

* **Which node.** Every event read from ``node_<R>/events.jsonl`` gets ``"node": R`` (the
  folder's rank, replacing any ``node`` field of the line); timeline rows carry it and the
  text prints it as a column. Events of all nodes are sorted by time, ties in node order;
  clocks are taken as synchronised (NTP), so a skew shows up as-is in cross-node intervals.
  GPU ids stay the node's local ones: a failure is matched only with its own node's
  ``fault_injected`` and ``risk_alert`` events.
* **Nodes without events.** A node folder whose ``events.jsonl`` is missing or empty (a node
  that died before writing) is listed under ``nodes`` with that, and is otherwise absent.
  Only when no node has an event is the input bad; a malformed line is bad on any node.
* **One recovery per round.** Each node's ftmaster records its own ``failure``. A failure
  joins the current round when its node has none in it yet and no ``launch`` (on any node)
  came after the round's first failure: a rendezvous relaunches only once every live node has
  stopped, so launches separate rounds. The **root** is the failure whose fault came first, by
  ``fault_at`` where known, else by its own time (so a hang that the faulty node detects late
  still beats its peers' earlier collective errors), among the failures whose cause is not
  ``peer`` (a node that stopped because a peer was waiting) and the ``peer`` ones whose own
  node shows a fault (an injected fault or a lost device on any of its GPUs: the faulty node
  may see its peers waiting before its own hang check fires). With no such candidate (the
  faulty node recorded nothing), the earliest failure is the root and the text says the cause
  is unknown. The others are the root's ``consequences``; ``silent_nodes`` launched the
  generation that failed but recorded no failure in the round (a spare, or a node that died
  without writing).
* **RTO and RPO** are computed as above from the root's event, attempt and GPUs, over the
  events of all nodes: the ``plan`` is the first after the root on any node (every node plans
  from the same rendezvous round); the relaunch is each node's first ``launch`` after it, and
  the **launch moment is the latest** of these, since no rank trains before every node's ranks
  have started; ``resumed`` is the **earliest after that, on any node**: iterations are
  collective, so the first node to record one proves the job trains again, and the root's node
  may have no ``resumed`` at all (it left the layout, or died).
* **Logs.** Rank 0 logs the ``loaded checkpoint`` line and the last rank the iteration lines,
  often on different nodes, so an attempt's log is the merge of its nodes' logs (earlier ones
  win on overlap): for the failed generation the root's attempt first, then per other node in
  rank order the attempt of its failure in the round, else of its latest launch before the
  root; for the relaunch, each relaunching node's attempt in rank order. A log without a
  ``loaded checkpoint`` line has its first iteration line stand for the iterations after the
  merged load, as the log interval means.
* **new layout** lists ``gpus_by_node`` (``{"node", "gpus"}`` per relaunching node) instead of
  ``gpus``.

A RUN_DIR with both its own ``events.jsonl`` and node folders is refused, since which one is
meant is unknown; give ``RUN_DIR/node_<R>`` to report one node alone.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import click

from ftmaster import runfiles
from ftmaster.console import END_EVENTS, describe_event, gpus_text
from ftmaster.lock import LOCK_NAME, run_dir_holder
from ftmaster.monitor.signals import WARNING_XIDS
from ftmaster.peer_files import PEERS_FILE

INCIDENT_PAGE = "report.html"
SAVES = ("emergency_save", "periodic_save")
FAULT_KINDS = ("fail", "hang", "xid", "wedge")  # injections that are the fault itself
PEER = "peer"  # the cause a node records when it stopped because a peer node was waiting
REPLICA_EVENTS = ("replica_dump", "replica_gathered", "replica_merge", "replica_fallback")
LAST_PROGRESS = "last progress (estimated)"
"""Where detection is measured from when no evidence of the fault was recorded."""
DECIMAL = r"(\d+(?:\.\d+)?)(?![\d.])"
"""A logged figure; one garbled by interleaved writes ("1.2.3") does not match."""
# 18 digits at most: Python refuses to convert more than 4300, and no run counts past 10**18.
_ITERATION = re.compile(r"iteration\s+(\d{1,18})/\s*\d+ \|.*?elapsed time per iteration \(ms\): "
                        + DECIMAL)
_LOADED = re.compile(r"loaded checkpoint from .+? at iteration (\d{1,18}) in " + DECIMAL
                     + r" s \((\d{1,18}) bytes\)")
_STARTED = re.compile(r"training from iteration (\d{1,18}) to ")
MAX_LOGGED_GAP = 100_000
"""Iterations between two logged ones that take the later one's time (``--log-interval``);
a longer jump is no interval, and spread over every iteration it took gigabytes."""


class ReportError(click.ClickException):
    """Bad input: one line on stderr and exit status 1."""


# ---- where the files are ---------------------------------------------------------------------

def node_folder(run_dir: Path, node: int | None) -> Path:
    """A node's folder; the run directory itself for a single-node run (node None)."""
    return run_dir if node is None else runfiles.node_dir(run_dir, node)


def node_folders(run_dir: Path, own_file: str) -> dict[int | None, Path]:
    """Each node's folder by node rank: ``{None: run_dir}`` without ``node_<R>`` folders.
    ``own_file`` (the file the caller reads) in RUN_DIR itself beside node folders is refused:
    which of them is meant is unknown. A ``node_<R>`` entry beside them that is no folder is
    left out, said on stderr."""
    try:
        nodes, strays = runfiles.node_ranks(run_dir), runfiles.stray_node_entries(run_dir)
    except OSError as exc:
        raise ReportError(f"cannot read {run_dir}: {exc.strerror}") from None
    if not nodes:
        return {None: run_dir}
    if (run_dir / own_file).exists():
        raise ReportError(f"{run_dir} holds both {own_file} and node folders ({_folder_names(nodes)}): "
                          f"give one node's folder, e.g. {node_folder(run_dir, nodes[0])}")
    for entry in strays:
        _warn_once(f"warning: {entry} left out: not a node folder (a file, or a link to no folder)")
    return {node: node_folder(run_dir, node) for node in nodes}


def _warn_once(line: str) -> None:
    """``line`` on stderr, once in this command: it may read a run's folders more than once
    (the report its events, then its samples for the page)."""
    context = click.get_current_context(silent=True)
    warned = context.meta.setdefault("ftmaster.warned", set()) if context else set()
    if line not in warned:
        warned.add(line)
        click.echo(line, err=True)


def _folder_names(nodes: list) -> str:
    return ", ".join(f"node_{node}" for node in nodes)


def write_for_people(path: Path, text: str) -> None:
    """A page or summary in UTF-8. The paths in it keep the bytes the file system holds: a
    name that is not UTF-8 (a folder named under another locale) is no reason to fail."""
    with runfiles.open_output(path, errors="surrogateescape") as handle:
        handle.write(text)


# ---- inputs ----------------------------------------------------------------------------------

def is_int(value: Any) -> bool:
    """An integer as ftmaster writes one: 64 bits at most (a larger one overflowed the
    report's arithmetic in floats)."""
    return isinstance(value, int) and not isinstance(value, bool) and -2 ** 63 <= value < 2 ** 63


class FieldType(NamedTuple):
    """What an event field must hold: as the error message says it, and as a test."""

    wording: str
    test: Callable[[Any], bool]


INT_OR_NULL = FieldType("an integer or null", lambda v: v is None or is_int(v))
NUMBER = FieldType("a finite number", runfiles.is_finite_number)
INT_LIST = FieldType("a list of integers", lambda v: isinstance(v, list) and all(map(is_int, v)))
GPU_LIST = FieldType("a list of integers or nulls",
                     lambda v: isinstance(v, list) and all(g is None or is_int(g) for g in v))
STR_LIST = FieldType("a list of strings",
                     lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v))
UNFIT_LIST = FieldType('a list of {"gpu": integer, "reason": string} objects',
                       lambda v: isinstance(v, list) and all(
                           isinstance(u, dict) and is_int(u.get("gpu"))
                           and isinstance(u.get("reason"), str) for u in v))
INT = FieldType("an integer", is_int)
SAVE_FIELDS = {"iteration": INT_OR_NULL, "started_at": NUMBER}
EVERY_EVENT = {"node": INT}
"""ftmaster writes no node in an event; the report adds each node folder's own."""
# The fields the report computes with, per event: a wrong type would crash it or, worse,
# silently mislead (a string of GPU digits iterates as characters). Absent is fine.
FIELD_TYPES = {
    "launch": {"attempt": INT_OR_NULL, "gpus": INT_LIST, "tensor_model_parallel_size": INT_OR_NULL,
               "pipeline_model_parallel_size": INT_OR_NULL, "data_parallel_size": INT_OR_NULL},
    "failure": {"attempt": INT_OR_NULL, "iteration": INT_OR_NULL, "gpus": INT_LIST,
                "unfit_gpus": UNFIT_LIST},
    "resumed": {"attempt": INT_OR_NULL, "iteration": INT_OR_NULL},
    "fault_injected": {"gpu": INT_OR_NULL, "iteration": INT_OR_NULL},
    "risk_alert": {"gpu": INT_OR_NULL, "reasons": STR_LIST},
    "save_deferred": {"iteration": INT_OR_NULL},
    "startup": {"seconds": NUMBER},
    "straggler": {"gpu": INT_OR_NULL, "slow_mates": INT_LIST, "slow_mate_gpus": GPU_LIST},
    "emergency_save": SAVE_FIELDS, "periodic_save": SAVE_FIELDS,
    "replica_merge": {"iteration": INT_OR_NULL, "seconds": NUMBER, "merge_seconds": NUMBER},
    "replica_dump": {"ranks": INT_LIST, "seconds": NUMBER, "bytes": NUMBER},
    "replica_gathered": {"bytes": NUMBER},
    "complete": {"iteration": INT_OR_NULL},
    "fresh_start": {"folders": STR_LIST},
}


def load_events(run_dir: Path) -> list[dict]:
    """Every event of every node, strictly: a report built on a skipped line would silently
    mislead."""
    return _load_run(run_dir)[0]


def _load_run(run_dir: Path) -> tuple[list[dict], list[dict] | None]:
    """(all events in time order, per node what it recorded; None for a single-node run)."""
    folders = node_folders(run_dir, runfiles.events_path(run_dir).name)
    if None in folders:
        path = runfiles.events_path(run_dir)
        events = _read_events_file(path)
        if events is None and runfiles.metrics_csv_path(run_dir).is_file():
            raise ReportError(f"{path} does not exist: ftmaster monitor alone ran here and raised "
                              f"no alert (ftmaster analyze {runfiles.metrics_csv_path(run_dir)} reads "
                              "its samples)")
        if events is None:
            raise ReportError(f"{path} does not exist: give a run directory written by ftmaster "
                              "launch")
        if not events:
            raise ReportError(f"{path} has no events: nothing to report")
        return sorted(events, key=lambda e: e["time"]), None
    merged, nodes = [], []
    for node, folder in folders.items():
        events = _read_events_file(runfiles.events_path(folder))
        nodes.append({"node": node, "events": len(events or ()), "outcome": _node_outcome(events, folder)})
        merged += [_at_its_moment({**e, "node": node}) for e in events or ()]
    if not merged:
        raise ReportError(f"{run_dir} has node folders ({_folder_names(list(folders))}) but none "
                          "holds an event: nothing to report")
    return sorted(merged, key=lambda e: e["time"]), nodes


def _at_its_moment(event: dict) -> dict:
    """Across nodes, a node's lost supervisor is put where it was last alive, not where its
    successor recorded it: there its node went silent and the others recovered without it,
    while at the record it stood for a second failure, on the node's rejoin."""
    lost_at = event.get("lost_at")
    if event.get("cause") != "supervisor_lost" or not runfiles.is_finite_number(lost_at):
        return event
    return {**event, "time": lost_at, "recorded_at": event["time"]}


def _read_events_file(path: Path) -> list[dict] | None:
    """One events.jsonl's events, in file order; None when the file does not exist. A torn
    last line (a live run's, or a killed writer's) and lines a failed write cut short are
    left out, and said on stderr; any other bad line is an error."""
    try:
        handle, torn = runfiles.open_whole_lines(path)
        with handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ReportError(f"cannot read {path}: {exc}") from None
    if torn:
        click.echo(f"warning: {runfiles.torn_line_note(path)}", err=True)
    events = {number: _parse_event(path, number, line)
              for number, line in enumerate(lines, 1) if line.strip()}
    if cut := [str(number) for number, event in events.items() if event is None]:
        click.echo(f"warning: {path} line{'s' * (len(cut) > 1)} {', '.join(cut)}: cut short (a "
                   "write that failed, e.g. on a full disk), skipped", err=True)
    return [event for event in events.values() if event is not None]


def _parse_event(path: Path, number: int, line: str) -> dict | None:
    """The event on ``line``; None when the line is one cut short."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        if _cut_short(line, exc):
            return None
        record = None
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        record = None
    if not (isinstance(record, dict) and isinstance(record.get("event"), str)
            and runfiles.is_finite_number(record.get("time"))):
        raise ReportError(f"{path} line {number} is not a JSON object with a string \"event\" "
                          "and a numeric \"time\"; fix or remove that line")
    if not _printable(line, record):
        raise ReportError(f"{path} line {number} holds a lone surrogate escape (\\ud800-\\udfff), "
                          "text that cannot be written out; fix or remove that line")
    for name, expected in {**EVERY_EVENT, **FIELD_TYPES.get(record["event"], {})}.items():
        if name in record and not expected.test(record[name]):
            article = "an" if record["event"][:1] in tuple("aeiou") else "a"
            raise ReportError(f"{path} line {number}: \"{name}\" of {article} {record['event']} event "
                              f"must be {expected.wording}, not {runfiles.json_excerpt(record[name])}; fix "
                              "or remove that line")
    return record


def _printable(line: str, record: dict) -> bool:
    """Whether the event's text can be written out: a lone surrogate escaped in JSON
    (``"\\ud800"``) is text no encoding takes, and was a traceback at the first print. Bytes
    that are not UTF-8 are read as escapes that write back as they came."""
    if "\\ud" not in line.lower():
        return True
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def _cut_short(line: str, error: json.JSONDecodeError) -> bool:
    """Whether ``line``, an object, failed to parse only for want of its end: what
    :func:`runfiles.append_event` leaves of an event a full disk took part of (it ends such a
    line before the next event, which the report then reads)."""
    return line.startswith("{") and (error.pos >= len(line.rstrip())
                                     or error.msg.startswith("Unterminated string"))


@dataclass
class AttemptLog:
    """What one attempt's training log says about loading and iteration times."""

    loaded_iteration: int | None = None
    load_seconds: float | None = None
    load_bytes: int | None = None
    iteration_s: dict[int, float] = field(default_factory=dict)
    """Seconds per iteration; a line logged every k iterations stands for all k of them."""
    unanchored_first: tuple[int, float] | None = None
    """The first iteration line (iteration, seconds) when no ``loaded checkpoint`` or
    ``training from`` line came before it: after a start that another node's log holds, it
    stands for the iterations since."""
    started_from: int | None = None
    """The iteration training started from (rank 0's ``training from`` line): 0 on a fresh
    start. The trainer times its first logged window from there, as from a load."""

    def seconds_between(self, after: int, upto: int) -> float | None:
        """Time of iterations ``after+1 .. upto``; None when one of them is not logged."""
        wanted = range(after + 1, upto + 1)
        if any(i not in self.iteration_s for i in wanted):
            return None
        return sum(self.iteration_s[i] for i in wanted)


def open_log(path: Path) -> TextIO:
    """A training log's whole lines: its last line may be cut short (a full disk, a rank
    killed mid-write, or still writing), and a figure in it too ("2" of "200.0")."""
    handle, _ = runfiles.open_whole_lines(path, errors="replace")
    return handle


def read_attempt_log(folder: Path, attempt: Any) -> AttemptLog:
    """``folder/logs/attempt_<attempt>.log``; ``folder`` is the run directory or a node's."""
    log = AttemptLog()
    path = runfiles.logs_dir(folder) / f"attempt_{attempt}.log"
    try:
        with open_log(path) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return log  # no log: the phases that need it are reported as unknown
    previous = None
    for line in lines:
        if loaded := _LOADED.search(line):
            log.loaded_iteration = previous = int(loaded.group(1))
            log.load_seconds, log.load_bytes = float(loaded.group(2)), int(loaded.group(3))
        elif started := _STARTED.search(line):
            log.started_from = previous = int(started.group(1))
        elif logged := _ITERATION.search(line):
            iteration, seconds = int(logged.group(1)), float(logged.group(2)) / 1000
            if previous is None:
                log.unanchored_first = (iteration, seconds)
            first = iteration if previous is None else previous + 1
            if iteration - first < MAX_LOGGED_GAP:
                log.iteration_s.update(dict.fromkeys(range(first, iteration + 1), seconds))
            previous = iteration
    return log


def merge_logs(logs: list[AttemptLog]) -> AttemptLog:
    """One attempt's logs from several nodes as one; earlier logs win where they overlap."""
    loaded = next((log for log in logs if log.loaded_iteration is not None), AttemptLog())
    merged = AttemptLog(loaded.loaded_iteration, loaded.load_seconds, loaded.load_bytes)
    merged.started_from = next((log.started_from for log in logs if log.started_from is not None),
                               None)
    for log in logs:
        for iteration, seconds in log.iteration_s.items():
            merged.iteration_s.setdefault(iteration, seconds)
    start = merged.loaded_iteration if merged.loaded_iteration is not None else merged.started_from
    if start is not None:
        for log in logs:
            if log.unanchored_first is not None:
                iteration, seconds = log.unanchored_first
                if iteration - start - 1 >= MAX_LOGGED_GAP:
                    continue  # a garbled line: filled, it took all the memory there was
                for since_start in range(start + 1, iteration):
                    merged.iteration_s.setdefault(since_start, seconds)
    return merged


def _read_logs(run_dir: Path, attempts: list[tuple[int | None, Any]]) -> AttemptLog:
    """The merged log of ``(node, attempt)`` pairs."""
    return merge_logs([read_attempt_log(node_folder(run_dir, node), attempt)
                       for node, attempt in attempts])


# ---- per failure -----------------------------------------------------------------------------

def _gpu_name(event: dict, gpu: Any) -> str:
    """``GPU g``, with its node where the run has several: GPU ids are per node."""
    return f"GPU {gpu}" if event.get("node") is None else f"node {event['node']} GPU {gpu}"


def _node_of(event: dict) -> dict:
    """``{"node": R}`` for an event of a multi-node run, else nothing: JSON stays as before."""
    return {"node": event["node"]} if "node" in event else {}


def _on_failed_gpu(event: dict, failure: dict, gpu: Any) -> bool:
    """Whether ``gpu`` of ``event`` is one of the failure's; a node that stopped for its
    peers names no GPU of its own, so any of its node's counts. An event that names none (a
    fault or an alert written without its ``gpu``) is on none."""
    return gpu is not None and event.get("node") == failure.get("node") and (
        failure.get("cause") == PEER or gpu in set(failure.get("gpus") or ()))


def _sample_time(alert: dict, earliest: float) -> float:
    """A risk_alert's sample time (its ISO ``timestamp``) when it lies between ``earliest``
    and the event's own time, else the event's time: a replayed trace's samples carry the
    recording's times."""
    try:
        sampled = datetime.fromisoformat(str(alert["timestamp"])).timestamp()
    except (KeyError, ValueError):
        return alert["time"]
    return sampled if earliest <= sampled <= alert["time"] else alert["time"]


_WARNING_XID_NAMES = frozenset(map(str, WARNING_XIDS))


def _is_fault_evidence(alert: dict) -> bool:
    """An alert that shows the fault itself (the GPU gone, wedged, or an XID that ends its
    applications), not a prediction of it: an XID 92 before a GPU's loss is the monitor's
    lead, and taken for the fault it ran the detection latency and the RTO from fault over
    the whole lead."""
    return any(reason in ("device_lost", "wedged")
               or reason.startswith("xid_") and reason[4:] not in _WARNING_XID_NAMES
               for reason in alert.get("reasons") or ())


def _fault_moment(window: list[dict], failure: dict) -> tuple[float, str] | None:
    """Where the fault's own time is known: injected, training found a non-finite loss, or
    the monitor saw it (the GPU gone or wedged, an XID)."""
    for event in window:  # the window runs on to the next failure: a later fault is its
        if event["event"] == "fault_injected" and event.get("kind") in FAULT_KINDS \
                and event["time"] <= failure["time"] and _on_failed_gpu(event, failure, event.get("gpu")):
            return event["time"], f"fault_injected {event['kind']} on {_gpu_name(event, event['gpu'])}"
        if event["event"] == "nonfinite" and failure.get("cause") == "nonfinite" \
                and event["time"] <= failure["time"] and event.get("node") == failure.get("node"):
            return event["time"], f"nonfinite {event.get('what')} at iteration {event.get('iteration')}"
    seen = [(_sample_time(e, window[0]["time"]), e["gpu"], e) for e in window if e["event"] == "risk_alert"
            and _is_fault_evidence(e) and _on_failed_gpu(e, failure, e.get("gpu"))]
    seen = [(t, gpu, e) for t, gpu, e in seen if t <= failure["time"]]
    if seen:
        when, gpu, alert = min(seen, key=lambda found: found[0])  # the first of a tie
        return when, f"monitor: {_gpu_name(alert, gpu)} {', '.join(alert['reasons'])}"
    return None


def _last_progress(attempt_events: list[dict], failure: dict, log: AttemptLog) -> float | None:
    """Estimated end of the failure's last completed iteration (see the module docstring)."""
    target = failure.get("iteration")
    # before its first iteration the supervisor names the one the attempt resumes from
    if not isinstance(target, int) or failure.get("before_first_iteration") is True:
        launches = [e["time"] for e in attempt_events if e["event"] == "launch"]
        return launches[0] if launches else None
    # An armed injection's event is written at the launch, its iteration still to come
    anchors = [(e["iteration"], e.get("started_at", e["time"]) if e["event"] in SAVES else e["time"])
               for e in attempt_events
               if e["event"] in (*SAVES, "resumed", "save_deferred", "fault_injected")
               and not e.get("armed") and isinstance(e.get("iteration"), int)
               and e["iteration"] <= target]
    if not anchors:
        return None
    iteration, when = max(anchors, key=lambda a: (a[0], -a[1]))
    rest = log.seconds_between(iteration, target)
    return None if rest is None else min(when + rest, failure["time"])


def _detection(window: list[dict], attempt_events: list[dict], failure: dict,
               log: AttemptLog) -> tuple[float | None, dict]:
    """(fault_at or None, the detection record): from the earliest evidence of the fault,
    else from the last progress (a fault can have come no earlier)."""
    known = _fault_moment(window, failure)
    if known is not None:
        return known[0], {"seconds": failure["time"] - known[0], "since": known[1]}
    progress = _last_progress(attempt_events, failure, log)
    seconds = None if progress is None else failure["time"] - progress
    return progress, {"seconds": seconds, "since": LAST_PROGRESS}


def _lead_time(window: list[dict], failure: dict, fault_at: float) -> dict | None:
    alerts = [e for e in window
              if e["event"] == "risk_alert" and _on_failed_gpu(e, failure, e.get("gpu"))
              and "device_lost" not in (e.get("reasons") or ()) and e["time"] < fault_at]
    if not alerts:
        return None
    first = alerts[0]
    return {"seconds": fault_at - first["time"], **_node_of(first), "gpu": first["gpu"],
            "score": first.get("score"), "reasons": first.get("reasons"), "time": first["time"]}


def _checkpoint(events: list[dict], failure: dict) -> dict | None:
    saves, launched_at = [], -math.inf
    for event in (e for e in events if e["time"] <= failure["time"]):
        if event["event"] == "launch":
            launched_at = event["time"]
        elif event["event"] in SAVES and is_int(event.get("iteration")):
            saves.append(event)
        elif event["event"] == "checkpoint_loaded" and is_int(event.get("iteration")):
            # a resume sets every newer checkpoint aside (it failed its checks, or its
            # timeline was discarded): none of them is there for a later failure
            saves = [e for e in saves if e["iteration"] <= event["iteration"]]
            if all(e["iteration"] != event["iteration"] for e in saves):
                saves.append(event)  # one this run never saved: an earlier job's
        elif event["event"] == "resumed" and is_int(event.get("iteration")):
            # it went on from the iteration before: after a relaunch that loaded nothing, no
            # checkpoint from before its launch was left (its own may precede this event)
            saves = [e for e in saves if e["iteration"] < event["iteration"]
                     or e["time"] >= launched_at]
    if not saves:
        return None
    newest = max(saves, key=lambda e: (e["iteration"], e["time"]))
    loaded = newest["event"] == "checkpoint_loaded"
    return {"iteration": newest["iteration"], "event": newest["event"],
            "kind": "loaded" if loaded else newest.get("kind"), "tier": newest.get("tier", "disk"),
            "durable_at": newest["time"]}


def _first(events: list[dict], name: str, after: float) -> dict | None:
    return next((e for e in events if e["event"] == name and e["time"] >= after), None)


def _relaunches(after: list[dict], since: float) -> list[dict]:
    """Each node's first launch after ``since`` (the plan) and before the first resumed, in
    node order."""
    resumed = _first(after, "resumed", since)
    until = resumed["time"] if resumed else math.inf
    firsts: dict[Any, dict] = {}
    for event in after:
        if event["event"] == "launch" and since <= event["time"] <= until:
            firsts.setdefault(event.get("node"), event)
    return sorted(firsts.values(), key=lambda e: e.get("node", -1))


def _recovery(after: list[dict], failure: dict, plan: dict | None, launch: dict | None,
              relaunch_log: AttemptLog) -> dict:
    """RTO and its phases, from the events between this failure and the next one."""
    resumed = _first(after, "resumed", launch["time"]) if launch else None
    loaded = None
    if resumed and relaunch_log.loaded_iteration is not None and isinstance(resumed.get("iteration"), int):
        first_iterations = relaunch_log.seconds_between(relaunch_log.loaded_iteration,
                                                        resumed["iteration"])
        loaded = None if first_iterations is None else {"time": resumed["time"] - first_iterations}
    # Without a plan (a supervisor started again on the run directory relaunches at once)
    # the time to the launch is all failure_to_plan.
    marks = [failure, plan or launch, launch, loaded, resumed]
    names = ("failure_to_plan", "plan_to_launch", "launch_to_loaded", "loaded_to_first_iteration")
    phases = {name: (b["time"] - a["time"] if a and b else None)
              for name, a, b in zip(names, marks, marks[1:])}
    return {"rto_seconds": resumed["time"] - failure["time"] if resumed else None,
            "phases": phases, "resumed": resumed}


def _replica_recovery(after: list[dict], failure: dict, plan: dict | None) -> dict | None:
    """The survivors' dump and merge between the failure and its plan (part of
    ``failure_to_plan``), or the reason it fell back; None without replica recovery."""
    until = plan["time"] if plan else math.inf
    found = [e for e in after if e["time"] <= until and e["event"] in REPLICA_EVENTS]
    if not found:
        return None
    of = {name: [e for e in found if e["event"] == name] for name in REPLICA_EVENTS}
    dumps, gathered = of["replica_dump"], of["replica_gathered"]  # across nodes, each node's
    merge = of["replica_merge"][-1] if of["replica_merge"] else {}
    fallback = of["replica_fallback"][-1] if of["replica_fallback"] else {}
    return {"dump_seconds": _most(e.get("seconds") for e in dumps),
            "ranks": sorted(r for e in dumps for r in e.get("ranks") or [] if is_int(r)),
            "bytes": _total_bytes(dumps), "gathered_bytes": _total_bytes(gathered),
            "gathered_seconds": _most(e.get("seconds") for e in gathered),
            "merge_seconds": merge.get("merge_seconds"),
            "merge_wait_seconds": merge.get("seconds"),
            "iteration": merge.get("iteration"), "fallback": fallback.get("reason")}


def _total_bytes(events: list[dict]) -> int:
    return sum(e["bytes"] for e in events if is_int(e.get("bytes")))


def _most(values) -> float | None:
    """The largest of the numbers among ``values`` (steps that ran in parallel), or None."""
    return max((v for v in values if runfiles.is_finite_number(v)), default=None)


def _startup(after: list[dict], relaunch: dict | None) -> dict | None:
    found = _first(after, "startup", relaunch["time"]) if relaunch else None
    if found is None:
        return None
    return {k: found.get(k) for k in ("phases", "seconds", "warm", "ranks", "slowest_rank")}


def _startup_text(startup: dict | None) -> list[str]:
    if not startup or not isinstance(startup.get("phases"), dict):
        return []
    how = "warm workers" if startup.get("warm") else "cold start"
    ranks = startup.get("ranks")
    ends = "its rank" if ranks == 1 else f"the last of {ranks} ranks"
    lines = [f"  start-up           {_s(startup.get('seconds'))} launch to first iteration "
             f"({how}; a phase ends when {ends} ends it)"]
    return lines + [f"    {name:<40}{_s(value if runfiles.is_finite_number(value) else None)}"
                    for name, value in startup["phases"].items()]


def _layout(plan: dict | None, relaunches: list[dict]) -> dict | None:
    if plan is None:
        return None
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
            "micro_batch_size", "global_batch_size", "num_gpus_used")
    layout = {key: plan.get(key) for key in keys}
    if "node" in plan:
        layout["gpus_by_node"] = [{"node": e["node"], "gpus": e.get("gpus")} for e in relaunches]
    else:
        layout["gpus"] = relaunches[0].get("gpus") if relaunches else plan.get("gpus_available")
    return layout


def _root_cause_after(after: list[dict], failure: dict) -> str | None:
    """What training said of the failure that made its node's ftmaster give up (its
    ``gave_up`` event)."""
    gave_up = next((e for e in after if e["event"] == "gave_up"
                    and e.get("node") == failure.get("node")), None)
    cause = None if gave_up is None else gave_up.get("root_cause")
    return cause if isinstance(cause, str) and cause.strip() else None


def _outcome_after(after: list[dict], failure: dict) -> str:
    """What became of a failure that was not resumed, on its node."""
    for event in (e for e in after if e.get("node") == failure.get("node")):
        if event["event"] == "gave_up":
            return f"gave up: {event.get('reason')}"
        if event["event"] == "stopped":
            return "stopped by a signal before resuming"
        if event["event"] == "complete":
            return "completed before resuming: nothing was left to train"
        if event["event"] == "store_lost":
            return "the job's rendezvous store was lost before resuming: a requeue resumes it"
        if event["event"] == "failure" and event.get("cause") == "supervisor_lost":
            return "the ftmaster recovering it was lost before resuming"
    return "not resumed (the run ended or is still recovering)"


def recovery_rounds(events: list[dict]) -> list[list[dict]]:
    """The failures grouped by recovery round, each in time order (see the module docstring).
    In a single-node run every failure is its own round."""
    launches = [e["time"] for e in events if e["event"] == "launch"]
    rounds: list[list[dict]] = []
    for failure in (e for e in events if e["event"] == "failure"):
        current = rounds[-1] if rounds else []
        if current and failure.get("node") not in {f.get("node") for f in current} \
                and not any(current[0]["time"] < t <= failure["time"] for t in launches):
            current.append(failure)
        else:
            rounds.append([failure])
    return rounds


def _root(failures: list[dict], window: list[dict]) -> dict:
    """The round's failure that started it (see the module docstring)."""
    found = [(failure, _fault_moment(window, failure)) for failure in failures]
    candidates = [(f, known) for f, known in found if f.get("cause") != PEER or known] or found
    return min(candidates, key=lambda c: (c[0]["time"] if c[1] is None else c[1][0], c[0]["time"]))[0]


def _failed_attempts(failures: list[dict], root: dict, before: list[dict]) -> list[tuple]:
    """(node, attempt) of the failed generation's logs: the root's first, then by node."""
    attempts = {f.get("node"): f.get("attempt") for f in failures}
    for event in before:  # in time order: a node's latest launch wins
        if event["event"] == "launch" and event.get("node") not in {f.get("node") for f in failures}:
            attempts[event.get("node")] = event.get("attempt")
    others = sorted(((node, attempt) for node, attempt in attempts.items()
                     if node != root.get("node")), key=lambda pair: pair[0])
    return [(root.get("node"), root.get("attempt")), *others]


def _round_nodes(failures: list[dict], root: dict, before: list[dict]) -> dict:
    """For a multi-node run: the root's node, the other failures, the silent nodes."""
    if "node" not in root:
        return {}
    failed = {f["node"] for f in failures}
    launched = {e["node"] for e in before if e["event"] == "launch"}
    return {"node": root["node"],
            "consequences": [{"node": f["node"], "attempt": f.get("attempt"), "cause": f.get("cause"),
                              "gpus": f.get("gpus"), "iteration": f.get("iteration"),
                              "time": f["time"], "after_root_seconds": f["time"] - root["time"]}
                             for f in failures if f is not root],
            "silent_nodes": sorted(launched - failed)}


def failure_report(run_dir: Path, events: list[dict], index: int, rounds: list[list[dict]]) -> dict:
    """Everything the report says about ``rounds[index]`` (see :func:`recovery_rounds`)."""
    since = rounds[index - 1][-1]["time"] if index else -math.inf
    until = rounds[index + 1][0]["time"] if index + 1 < len(rounds) else math.inf
    window = [e for e in events if since < e["time"] <= until]
    failure = _root(rounds[index], window)
    before = [e for e in window if e["time"] <= failure["time"]]
    after = _until_it_ended([e for e in window if e["time"] >= failure["time"] and e is not failure],
                            failure)
    attempt = failure.get("attempt")
    launched = [e for e in events if e["event"] == "launch" and e.get("attempt") == attempt
                and e.get("node") == failure.get("node")]
    attempt_events = [e for e in before if not launched or e["time"] >= launched[0]["time"]]
    failed_log = _read_logs(run_dir, _failed_attempts(rounds[index], failure, before))
    fault_at, detection = _detection(window, attempt_events, failure, failed_log)

    plan = _first(after, "plan", failure["time"])
    relaunches = _relaunches(after, plan["time"] if plan else failure["time"])
    relaunch = max(relaunches, key=lambda e: e["time"]) if relaunches else None
    relaunch_log = _with_load_event(
        _read_logs(run_dir, [(e.get("node"), e.get("attempt")) for e in relaunches]), after, relaunch)
    recovery = _recovery(after, failure, plan, relaunch, relaunch_log)
    if recovery["resumed"] is None:
        _resumed_through_later_failures(recovery, after, events, failure, until)

    checkpoint = _checkpoint(events, failure)
    restart_from = relaunch_log.loaded_iteration
    resumed = recovery["resumed"]
    base = _went_on_from(restart_from, resumed, checkpoint)
    last = failure.get("iteration")
    # Null: the heartbeat was unreadable, or an older supervisor's failure before the first
    # iteration. The log's last iteration, at least; with none, the one it loaded.
    if not isinstance(last, int):
        last = max(failed_log.iteration_s, default=failed_log.loaded_iteration)
    # Survivors may have completed one more iteration than the last heartbeat said.
    lost = max(0, last - base) if isinstance(last, int) else None
    fault_to_failure = None if fault_at is None else failure["time"] - fault_at
    rto = recovery["rto_seconds"]
    return {
        "attempt": attempt, "time": failure["time"], "cause": failure.get("cause"),
        "scale_up": failure.get("reason") == "rejoin",
        "gpus": failure.get("gpus"), "unfit_gpus": failure.get("unfit_gpus") or [],
        "iteration": last, "fault_at": fault_at,
        **_round_nodes(rounds[index], failure, before),
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
        "replica": _replica_recovery(after, failure, plan),
        "startup": _startup(after, relaunch),
        "resumed": ({**_node_of(resumed), **{k: resumed.get(k) for k in ("attempt", "iteration")}}
                    if resumed else None),
        "outcome": "resumed" if resumed else _outcome_after(after, failure),
        "root_cause": None if resumed else _root_cause_after(after, failure),
        "later_failures": recovery.get("later_failures", 0),
        "new_layout": _layout(plan, relaunches),
    }


def _went_on_from(loaded: int | None, resumed: dict | None, checkpoint: dict | None) -> int:
    """The iteration training went on from after a failure: the relaunch's load, else the one
    before its first resumed iteration (0: it loaded nothing), else, not resumed, the newest
    checkpoint (0: none)."""
    if loaded is not None:
        return loaded
    if resumed is not None and is_int(resumed.get("iteration")) and resumed["iteration"] >= 1:
        return resumed["iteration"] - 1
    return (checkpoint or {}).get("iteration", 0)


def _ends_its_recovery(event: dict, failure: dict) -> bool:
    """Whether ``event`` ended the recovery of ``failure`` on its node: it gave up, was stopped,
    lost its rendezvous (a requeue), or the ftmaster recovering it died (its successor's
    ``supervisor_lost``)."""
    return event.get("node") == failure.get("node") and (
        event["event"] in ("gave_up", "stopped", "store_lost")
        or event["event"] == "failure" and event.get("cause") == "supervisor_lost")


def _with_load_event(log: AttemptLog, after: list[dict], relaunch: dict | None) -> AttemptLog:
    """The relaunch's load from its ``checkpoint_loaded`` event where no log read says it: a
    node's log has the line only where the trainer's rank 0 ran (one node looked at alone)."""
    loaded = _first(after, "checkpoint_loaded", relaunch["time"]) if relaunch else None
    if log.loaded_iteration is not None or loaded is None or not is_int(loaded.get("iteration")):
        return log
    seconds, size = loaded.get("seconds"), loaded.get("bytes")
    return replace(log, loaded_iteration=loaded["iteration"],
                   load_seconds=seconds if runfiles.is_finite_number(seconds) else None,
                   load_bytes=size if is_int(size) else None)


def _until_it_ended(after: list[dict], failure: dict) -> list[dict]:
    """A failure's events up to the end of its recovery (:func:`_ends_its_recovery`), that
    one included: an ftmaster started again later on the run directory starts anew, and the
    time until then is no part of the failure's RTO."""
    end = next((i for i, e in enumerate(after) if _ends_its_recovery(e, failure)), None)
    return after if end is None else after[:end + 1]


def _resumed_through_later_failures(recovery: dict, after: list[dict], events: list[dict],
                                    failure: dict, until: float) -> None:
    """A failure whose relaunch failed in turn before resuming (the next failure of its node
    came at ``until``): its recovery ends at the resume that ended the later ones too, unless
    its node gave up or was stopped first."""
    if any(_ends_its_recovery(e, failure) for e in after):
        return
    later = _until_it_ended([e for e in events if e["time"] >= until], failure)
    mine = [e for e in later if e.get("node") == failure.get("node")]
    resumed = next((e for e in mine if e["event"] == "resumed"), None)
    if resumed is None:
        return
    recovery.update(resumed=resumed, rto_seconds=resumed["time"] - failure["time"],
                    later_failures=sum(e["event"] == "failure" and e["time"] < resumed["time"]
                                       for e in mine))


# ---- the whole run ---------------------------------------------------------------------------

TEMPLATES = {
    "launch": "attempt {attempt} on {gpus}: TP {tensor_model_parallel_size} x "
              "PP {pipeline_model_parallel_size} x DP {data_parallel_size}",
    "fault_injected": "{kind} on GPU {gpu} at iteration {iteration}",
    "risk_alert": "GPU {gpu} score {score} ({reasons})",
    "checkpoint_request": "from {source}, GPU {gpu}",
    "emergency_save": "{kind} checkpoint of iteration {iteration} {state} ({tier}): training "
                      "blocked {seconds} s, {persist_seconds} s to complete, {bytes} bytes",
    "persisted": "memory checkpoint of iteration {iteration} copied to {path} in {seconds} s "
                 "({bytes} bytes)",
    "persist_failed": "a memory checkpoint was not copied to disk: {reason}",
    "persist_superseded": "a memory checkpoint was skipped by the disk copy: {reason}",
    "replica_dump": "rank(s) {ranks} dumped their state in {seconds} s ({bytes} bytes)",
    "replica_merge": "checkpoint of iteration {iteration} merged from {shards} shard(s) in "
                     "{seconds} s",
    "replica_fallback": "no replica cut ({reason}): the newest checkpoint is used",
    "save_deferred": "iteration {iteration}: emergency save deferred to iteration {until_iteration}",
    "failure": "attempt {attempt} {cause}{on_gpus}, last iteration {iteration}",
    "stopped": "signal {signal} at iteration {iteration}: {training}",
    "plan": "TP {tensor_model_parallel_size} x PP {pipeline_model_parallel_size} x DP "
            "{data_parallel_size}, micro-batch {micro_batch_size}, global batch "
            "{global_batch_size} on {num_gpus_used} of {gpus_available}",
    "resumed": "attempt {attempt} completed iteration {iteration}",
    "complete": "iteration {iteration}{where}",
    "gave_up": "{reason}",
    "store_lost": "the job's rendezvous store is gone ({reason}): requeue the job (exit status 75)",
    "checkpoint_loaded": "iteration {iteration} from {path} in {seconds} s ({bytes} bytes, "
                         "checksums verified in {verify_seconds} s)",
    "checkpoint_skipped": "iteration {iteration} ({path}): {reason}",
    "save_failed": "{kind} checkpoint of iteration {iteration} not saved ({tier}): {reason}",
    "load_failed": "{reason}",
    "nonfinite": "non-finite {what} at iteration {iteration}, nothing updated or saved",
    "startup": "{seconds} s from the launch to the first iteration (warm: {warm})",
    "straggler": "GPU {gpu} (rank {rank}) computes {slowdown}x slower than its peers ({compute_ms} "
                 "ms against {peers_ms} ms) since iteration {since}; the job ran {ran}, "
                 "{before}",
    "straggler_kept": "{kept}",
    "straggler_drain_result": "attempt {attempt} runs {step_s} s/iteration, against "
                              "{slowed_step_s} with the straggler",
}
TEMPLATES["periodic_save"] = TEMPLATES["emergency_save"]


TEMPLATES["armed"] = "{kind} armed on GPU {gpu} for iteration {iteration} (at the launch)"


def _save_state(save: dict) -> str:
    """A memory checkpoint is complete, not durable: it outlives no node."""
    return "complete" if save.get("tier") == "memory" else "durable"


class _Fields(dict):
    def __missing__(self, key: str) -> str:
        return "disk" if key == "tier" else "?"  # saves before the memory tier went to disk


def _ran(step_s) -> str:
    """The job's step since a straggler slowed it: none is measured when it was named within
    two heartbeats of the slowdown."""
    return "at a step not yet measured" if step_s is None else f"{step_s} s/iteration"


def _before(healthy_step_s) -> str:
    """The job's step before a straggler slowed it: none is measured when the slowdown began
    within an attempt's first iterations."""
    return "not measured before" if healthy_step_s is None else f"{healthy_step_s} before"


def _derived(event: dict) -> dict:
    """Words that depend on several fields: a memory save is complete, not durable; a failure
    on no GPU (storage, a NaN) names none; a stop says how training ended."""
    if event["event"] in SAVES:  # a time or size that is none ('blocked True s') reads '?'
        return {"state": _save_state(event), **{
            name: event[name] if runfiles.is_finite_number(event.get(name)) and event[name] >= 0
            else "?" for name in ("seconds", "persist_seconds", "bytes")}}
    if event["event"] == "complete":  # a standby node's iteration is where it last trained
        return {"where": " here, then on the other nodes" if event.get("on_other_nodes") else ""}
    if event["event"] == "failure":
        gpus = event.get("gpus")
        return {"on_gpus": f" on {gpus_text(gpus)}" if gpus else ""}
    if event["event"] == "launch":
        return {"gpus": gpus_text(event.get("gpus", "?"))}
    if event["event"] == "plan":
        return {"gpus_available": gpus_text(event.get("gpus_available", "?"))}
    if event["event"] == "straggler":
        return {"ran": _ran(event.get("step_s")), "before": _before(event.get("healthy_step_s"))}
    if event["event"] == "straggler_kept":  # the cost model's line names the GPU, the rest not
        reason = str(event.get("reason"))
        return {"kept": reason if reason.startswith("keeping GPU")
                else f"keeping GPU {event.get('gpu')}: {reason}"}
    if event["event"] == "stopped":  # training's exit status, not ftmaster's (128 + signal)
        code = event.get("exit_code")
        return {"training": f"training exited with status {code}" if code is not None
                else f"nothing was training ({event['state']})" if "state" in event
                else "training was killed at the stop timeout"}
    return {}


def event_label(event: dict) -> str:
    """The timeline's name of an event: a save by its kind (an exit or final save is no
    periodic one), a fault armed at a launch as such."""
    if event["event"] in SAVES and isinstance(event.get("kind"), str):
        return f"{event['kind']}_save"
    if event["event"] == "fault_injected" and event.get("armed"):
        return "fault_armed"
    return event["event"]


def describe(event: dict) -> str:
    """One event as text: its template, else the console's line for it (a removed folder read
    as 'iteration=10 path=.../iter_0000015 moved_to=None'), else its fields as key=value (the
    node has a column)."""
    fields = _Fields({k: f"{v:g}" if isinstance(v, float) else
                      ", ".join(map(str, v)) if isinstance(v, list) and k == "reasons" else v
                      for k, v in event.items()})
    fields.update(_derived(event))
    template = TEMPLATES.get("armed" if event.get("armed") else event["event"])
    if template is not None:
        return template.format_map(fields)
    console_line = describe_event(event)
    if console_line is not None:
        return console_line[1]
    return " ".join(f"{k}={fields[k]}" for k in event if k not in ("event", "time", "command", "node"))


def _run_outcome(events: list[dict], folders: Iterable[Path]) -> str:
    """The last end event; across nodes one where the job ended, over a spare's that saw it.
    Only a node's end since its newest launch counts: an earlier one (a preemption's stop, a
    give-up advising a requeue) was an ftmaster before the one that carried on. Without one,
    whether the ftmaster of any of ``folders`` still lives (:func:`_without_end`)."""
    newest_launch: dict = {}
    for event in events:
        if event["event"] == "launch":
            node = event.get("node")
            newest_launch[node] = max(newest_launch.get(node, event["time"]), event["time"])
    ends = [event for event in events if event["event"] in END_EVENTS
            and event["time"] >= newest_launch.get(event.get("node"), -math.inf)]
    if not ends:
        return _without_end(folders, launched=any(e["event"] == "launch" for e in events))
    event = next((e for e in reversed(ends) if not e.get("on_other_nodes")), ends[-1])
    where = f" (node {event['node']})" if "node" in event else ""
    return f"{event['event']}: {describe(event)}{where}"


def _without_end(folders: Iterable[Path], launched: bool) -> str:
    """A run with no end event: still running while a live ftmaster holds a run directory
    lock, killed when none does. The locks are probed, never taken from a holder; one that
    cannot be probed leaves it unknown. Without a launch nothing trained: ``ftmaster monitor``
    alone ends with no end event, and was not killed."""
    holders, unknown = [], False
    for folder in folders:
        try:
            holder = run_dir_holder(folder)
        except OSError:
            unknown = True
            continue
        if holder is not None:
            holders.append(holder)
    if holders:
        return f"no end event: still running ({'; '.join(holders)})"
    if not launched:
        return ("no launch event: no training ran here (a run directory of ftmaster monitor "
                "alone, or an ftmaster launch killed before its first attempt)")
    if unknown:
        return "no end event (still running, or ftmaster itself was killed)"
    return "no end event: ftmaster was killed (no live holder of the run directory lock)"


def _node_outcome(events: list[dict] | None, folder: Path) -> str:
    if events is None:
        return "no events.jsonl: this node recorded nothing"
    if not events:
        return "events.jsonl is empty: this node recorded nothing"
    return _run_outcome(sorted(events, key=lambda e: e["time"]), [folder])


def failure_reports(run_dir: Path, events: list[dict]) -> list[dict]:
    """:func:`failure_report` for every recovery round of ``events`` (from
    :func:`load_events`): one per failure on a single node."""
    rounds = recovery_rounds(events)
    return [failure_report(run_dir, events, i, rounds) for i in range(len(rounds))]


def build_report(run_dir: Path, events: list[dict], nodes: list[dict] | None) -> dict:
    """The report of what :func:`_load_run` read from ``run_dir``."""
    start = events[0]["time"]
    return {
        "run_dir": str(run_dir), "start_time": start,
        **({} if nodes is None else {"nodes": nodes}),
        "timeline": [{"t": e["time"] - start, **_node_of(e), "event": e["event"],
                      "label": event_label(e), "text": describe(e)} for e in events],
        "failures": failure_reports(run_dir, events),
        "stragglers": stragglers(events),
        "outcome": _run_outcome(
            events, node_folders(run_dir, runfiles.events_path(run_dir).name).values()),
    }


def stragglers(events: list[dict]) -> list[dict]:
    """Each straggler found, what was done about it, and the step times around it."""
    found = []
    named = [e for e in events if e["event"] == "straggler"]
    for event in named:
        # Until the GPU is named again (slow again after it was fast): what follows is that
        # naming's, not this one's.
        again = next((e["time"] for e in named if e["time"] > event["time"]
                      and _same_gpu(e, event)), math.inf)
        later = [e for e in events if event["time"] <= e["time"] < again]
        mine = [e for e in later if _same_gpu(e, event)]
        drain = next((e for e in mine if e["event"] == "drain" and e.get("reason") == "straggler"),
                     None)
        drained = next((e for e in mine if e["event"] == "straggler_drained"), None)
        # The last: one kept for the window or a slow mate is weighed again once that is over.
        kept = next((e for e in reversed(mine) if e["event"] == "straggler_kept"), None)
        # The next attempt's, after this GPU left: none once another drain came first (its
        # own did, or this drain's next attempt failed before its step was measured).
        following = None if drained is None else next(
            (e for e in later if e["event"] in ("straggler_drain_result", "straggler_drained")
             and e["time"] >= drained["time"] and e is not drained), None)
        result = following if following and following["event"] == "straggler_drain_result" else None
        found.append({
            "gpu": event.get("gpu"), "rank": event.get("rank"), "iteration": event.get("iteration"),
            "since": event.get("since"), "slowdown": event.get("slowdown"),
            "step_s": event.get("step_s"), "healthy_step_s": event.get("healthy_step_s"),
            "action": ("drained" if drained else "drain decided, not done (the attempt ended "
                       "first)" if drain else "kept" if kept else "reported"),
            "decided_by": (drain or {}).get("decided_by") or (kept or {}).get("reason"),
            "step_s_after_drain": (result or {}).get("step_s"),
            "slow_mates": event.get("slow_mates") or [],
            "slow_mate_gpus": event.get("slow_mate_gpus")})
    return found


def _same_gpu(event: dict, other: dict) -> bool:
    return event.get("gpu") == other.get("gpu") and event.get("node") == other.get("node")


# ---- text --------------------------------------------------------------------------------------

def _s(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds:.3f} s"


def _training_time(seconds: float | None) -> str:
    return "training time unknown" if seconds is None else f"{seconds:.3f} s of training"


def round_text(f: dict, start: float) -> list[str]:
    """The lines a multi-node round adds: its other failures and its silent nodes."""
    lines = [f"  also failed        node {c['node']}: {c['cause']} (attempt {c['attempt']}, "
             f"{gpus_text(c['gpus'])}) at +{c['time'] - start:.2f} s, {_s(abs(c['after_root_seconds']))} "
             + ("after" if c["after_root_seconds"] >= 0 else "before") for c in f["consequences"]]
    if f.get("scale_up"):
        lines.append("  cause              a node joined: the attempt stopped for a larger round "
                     "(a scale-up), no fault")
    elif f["cause"] == PEER and f["detection_latency"]["since"] == LAST_PROGRESS:  # no fault seen
        lines.append("  root cause         unknown: every node that recorded this failure says "
                     f"{PEER}")
    if f["silent_nodes"]:
        lines.append(f"  silent nodes       {', '.join(map(str, f['silent_nodes']))} (launched, "
                     "recorded no failure: a spare, or a node that died without writing)")
    return lines


def _gpus_text(layout: dict) -> str:
    if "gpus" in layout:
        return gpus_text(layout["gpus"])
    return ("; ".join(f"node {n['node']} {gpus_text(n['gpus'])}" for n in layout["gpus_by_node"])
            or "no GPU launched")


def _replica_text(replica: dict | None) -> list[str]:
    if replica is None:
        return []
    dump = (f"dump {_s(replica['dump_seconds'])} ({len(replica['ranks'] or [])} rank(s), "
            f"{(replica['bytes'] or 0) / 1e6:.1f} MB)")
    if replica["iteration"] is None:
        if replica["fallback"] is not None:
            return [f"  replica recovery   fell back: {replica['fallback']}"]
        # Not a fallback: one node's folder, whose dumps rank 0's node merged, or a stop
        return [f"  replica recovery   {dump}; no merge or fallback recorded here: stopped "
                f"first, or merged on rank 0's node (across nodes; report the whole run "
                f"directory)"]
    gathered = (f", gathered {replica['gathered_bytes'] / 1e6:.1f} MB from the other nodes in "
                f"{_s(replica['gathered_seconds'])}" if replica.get("gathered_bytes") else "")
    return [f"  replica recovery   iteration {replica['iteration']} from the survivors: "
            f"{dump}{gathered}, merge {_s(replica['merge_seconds'])} "
            f"({_s(replica.get('merge_wait_seconds'))} with starting its process)"]


def restarted_from_text(failure: dict) -> str:
    """What the relaunch after ``failure`` loaded, for the text and the incident page. One
    that loaded nothing and never resumed did not start afresh: it was still starting, or the
    run gave up, was stopped or killed first (the failure's outcome says which)."""
    iteration = failure["restarted_from_iteration"]
    if iteration is not None:
        return f"iteration {iteration}"
    return "no checkpoint loaded" if failure["resumed"] else "nothing: no relaunch resumed"


def _lead_text(f: dict, start: float) -> str:
    """The lead time counts alerts before the fault where its moment is known: one the fault
    itself raised (an XID's) comes before the failure but predicted nothing."""
    lead = f["lead_time"]
    if lead is not None:
        return (f"{_s(lead['seconds'])} (first risk_alert: {_gpu_name(lead, lead['gpu'])} "
                f"score {lead['score']} at +{lead['time'] - start:.2f} s)")
    if f["fault_at"] is None:
        return "no alert before the failure"
    return f"no alert before the fault at +{f['fault_at'] - start:.2f} s"


def _failure_text(number: int, f: dict, start: float) -> list[str]:
    detection, ckpt = f["detection_latency"], f["checkpoint"]
    node = f"node {f['node']}, " if "node" in f else ""
    where = f" on {gpus_text(f['gpus'])}" if f["gpus"] else ""
    # the evidence that retires GPUs, as the console gave it, where it says more than the cause
    evidence = [f"{_gpu_name(f, u['gpu'])} {u['reason']}" for u in f["unfit_gpus"]
                if u["reason"] != f["cause"]]
    if evidence:
        where += f" (hardware: {', '.join(evidence)})"
    lines = [f"failure {number}: {node}attempt {f['attempt']}, {f['cause']}{where} at "
             f"+{f['time'] - start:.2f} s, last completed iteration {f['iteration']}",
             *(round_text(f, start) if node else ()),
             f"  detection latency  {_s(detection['seconds'])} (since {detection['since']})",
             "  lead time          " + _lead_text(f, start),
             "  last checkpoint    " + ("none" if ckpt is None else
                                        f"iteration {ckpt['iteration']} ({ckpt['kind'] or ckpt['event']}, "
                                        f"{ckpt['tier']}, {_save_state(ckpt)} at +{ckpt['durable_at'] - start:.2f} s)"),
             "  restarted from     " + restarted_from_text(f) + (
                 "" if f["load_seconds"] is None else
                 f" (load {f['load_seconds']:.3f} s, {f['load_bytes']} bytes)"),
             f"  lost iterations    {f['lost_iterations']} (RPO; {_training_time(f['lost_seconds'])})",
             *_replica_text(f["replica"])]
    if f["outcome"] != "resumed":
        said = (f.get("root_cause") or "").splitlines()
        # The console's reason points "(above)" at what training said: here it follows.
        outcome = f["outcome"].replace(" (above)", "") if said else f["outcome"]
        return [*lines, f"  RTO                unknown: {outcome}",
                *(["  root cause, from training's output:", *(f"    {line}" for line in said)]
                  if said else [])]
    resumed = f["resumed"]
    where = f"node {resumed['node']} " if "node" in resumed else ""
    through = (f", through {f['later_failures']} more failure(s) of its relaunch"
               if f.get("later_failures") else "")
    lines.append(f"  RTO                {_s(f['rto_seconds'])} to iteration "
                 f"{resumed['iteration']} ({where}attempt {resumed['attempt']}){through}")
    lines += [f"    {name.replace('_', ' '):<28}{_s(value)}" for name, value in f["phases"].items()]
    lines += _startup_text(f.get("startup"))
    lines.append(f"  RTO from fault     {_s(f['rto_from_fault_seconds'])} (detection: fault to "
                 f"failure {_s(f['fault_to_failure_seconds'])}, since "
                 f"{f['detection_latency']['since']}; then the RTO above)")
    layout = f["new_layout"]
    if layout is not None:
        lines.append(f"  new layout         TP {layout['tensor_model_parallel_size']} x PP "
                     f"{layout['pipeline_model_parallel_size']} x DP {layout['data_parallel_size']}, "
                     f"micro-batch {layout['micro_batch_size']}, global batch "
                     f"{layout['global_batch_size']}, {_gpus_text(layout)}")
    return lines


def _timeline_line(row: dict) -> str:
    node = f"node {row['node']:<3} " if "node" in row else ""
    return f"  {'+' + format(row['t'], '.2f'):>10} s  {node}{row['label']:<18} {row['text']}"


def _mates_text(ranks: list[int], gpus: list | None) -> str:
    """By GPU, as the console names them (a rank of a later attempt is not the GPU of that
    number); by rank where the event has no GPUs (older) or a rank is another node's."""
    if gpus is None or len(gpus) != len(ranks):
        return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
    return ", ".join(f"GPU {gpu}" if gpu is not None else f"rank {rank} (another node's)"
                     for rank, gpu in zip(ranks, gpus))


def straggler_text(s: dict) -> str:
    mates = _mates_text(s.get("slow_mates") or [], s.get("slow_mate_gpus"))
    with_mates = (f"; {mates} of its model replica slow too, either may hold the other up"
                  if mates else "")
    line = (f"straggler: GPU {s['gpu']} computed {s['slowdown']}x slower than its peers from "
            f"iteration {s['since']} (found at {s['iteration']}{with_mates}); the job ran "
            f"{_ran(s['step_s'])} with it, {_before(s['healthy_step_s'])}; {s['action']}")
    if s["decided_by"]:
        line += f" ({s['decided_by']})"
    if s["step_s_after_drain"] is not None:
        line += f"; {s['step_s_after_drain']} s/iteration after the drain"
    return line


def format_report(report: dict) -> str:
    lines = [f"run {report['run_dir']}: {len(report['timeline'])} events, "
             f"{len(report['failures'])} failure(s); outcome {report['outcome']}"]
    if "nodes" in report:
        lines += ["", "nodes:"] + [f"  node {n['node']:<3} {n['events']:>6} events; {n['outcome']}"
                                   for n in report["nodes"]]
    lines += ["", "timeline:", *map(_timeline_line, report["timeline"]), ""]
    for straggler in report.get("stragglers", []):
        lines.append(straggler_text(straggler))
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
    iterations (RPO) and time to resume (RTO) in phases; write the same as JSON, and an
    incident page with the plots (RUN_DIR/report.html). A RUN_DIR with node_<R> folders
    (ftmaster launch --nnodes) is merged into one report."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory: give an ftmaster run directory")
    # here, not at the top: the page's modules (analysis, goodput) import this one
    from ftmaster.incident import write_incident_page

    # a run directory that takes no files (a read-only mount) can still be read: say how
    elsewhere = "" if json_out else " (--json-out FILE writes it elsewhere)"
    json_out = json_out or run_dir / "report.json"
    if (problem := run_path_problem(json_out, run_dir)) is not None:
        raise ReportError(f"--json-out {json_out} {problem}: give another path")
    events, nodes = _load_run(run_dir)
    report = build_report(run_dir, events, nodes)
    try:
        with runfiles.open_output(json_out) as handle:
            handle.write(json.dumps(report, indent=1) + "\n")
            text_to_stderr = runfiles.is_stdout(handle)
    except OSError as exc:
        raise ReportError(f"cannot write {json_out}: {exc.strerror}{elsewhere}") from None
    click.echo(format_report(report), err=text_to_stderr)  # before the page, which may fail
    try:
        page = write_incident_page(run_dir, report, events, _samples(run_dir))
    except OSError as exc:
        failed = runfiles.failed_path(exc, run_dir / INCIDENT_PAGE)
        raise ReportError(f"cannot make the incident page: {failed}: {exc.strerror}") from None
    click.echo(f"\nwrote {json_out} and {page}", err=text_to_stderr)


def run_path_problem(path: Path, run_dir: Path) -> str | None:
    """Why ``path`` must not be written (a file, or a folder to write files into), when it is
    a file of the run's own or one of its folders, or in one: the report's inputs (events,
    samples, logs), what a live run reads (heartbeat, lock, peer list, flags: any
    ``save_now`` flag is a save request) and the incident page written beside the JSON. A
    node's folder holds the same. None for any other path, in a folder of the run's or not
    (``RUN_DIR/analysis/``), and for ``run_dir`` itself (a folder to write into: the caller
    says why not)."""
    path, run_dir = path.resolve(), run_dir.resolve()
    if path.parent == run_dir:
        own = (runfiles.events_path(run_dir), runfiles.metrics_csv_path(run_dir),
               runfiles.heartbeat_path(run_dir), run_dir / LOCK_NAME, run_dir / PEERS_FILE,
               run_dir / INCIDENT_PAGE)
        if path in own:
            return "is one of the run's own files"
    if run_dir not in path.parents:
        return None
    folder = run_dir / path.relative_to(run_dir).parts[0]
    if folder in (runfiles.node_dir(run_dir, node) for node in runfiles.node_ranks(run_dir)):
        return run_path_problem(path, folder)
    if folder in (runfiles.flags_dir(run_dir), runfiles.logs_dir(run_dir),
                  runfiles.ranks_dir(run_dir)):
        return f"is {'' if path == folder else 'in '}{folder}, a folder the run writes or reads"
    return None


def _samples(run_dir: Path):
    """The monitor's samples for the page's risk plots; None when the run has none, or when
    they cannot be read: that is said on stderr, as the page cannot tell it from none, and so
    is each node left out of a multi-node run's."""
    from ftmaster.analyze import NoSamples, load_trace

    try:
        trace = load_trace(run_dir, with_events=False)
    except NoSamples:  # no CSV, or none with a sample: the page says so
        return None
    except click.ClickException as exc:
        click.echo(f"warning: {exc.message}; the incident page has no risk plots", err=True)
        return None
    for note in trace.notes:
        click.echo(f"warning: {note}; the incident page's risk plots lack this node", err=True)
    return trace.frame
