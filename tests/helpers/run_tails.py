"""What a failed end-to-end test leaves to read: the tail of every node's output, attempt log
and events under its ``tmp_path``, for the failure report.

A run directory under pytest's base temp lives only until three later sessions have run, so
a rare stall (a wait that timed out on a busy machine) is gone before anyone reads it; its
tails in the report outlive it, in CI's log too."""

from __future__ import annotations

import json
from pathlib import Path

LINES = 25
EVENTS = 12
EVENT_FIELDS = ("iteration", "round", "nodes", "tier", "kind", "reason", "gpu", "rank", "code")


def _tail(path: Path, count: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-count:]
    except OSError as error:
        return [f"(unreadable: {error})"]


def _event_line(line: str, start: float) -> str:
    try:
        event = json.loads(line)
        fields = {k: event[k] for k in EVENT_FIELDS if k in event}
        return f"{event['time'] - start:8.2f} s {event['event']} {fields}"
    except (ValueError, KeyError, TypeError):
        return f"(torn) {line[:200]}"


def _events_tail(path: Path) -> list[str]:
    lines = _tail(path, 100_000)
    try:
        start = json.loads(lines[0])["time"]
    except (ValueError, KeyError, TypeError, IndexError):
        start = 0.0
    return [f"({len(lines)} events; times from the first)"] + [
        _event_line(line, start) for line in lines[-EVENTS:]]


def _found(root: Path) -> list[Path]:
    """Outputs, attempt logs and events files, checkpoints' folders left out."""
    wanted = []
    for path in sorted(root.rglob("*")):
        if any(part.startswith("iter_") for part in path.relative_to(root).parts):
            continue
        if path.is_file() and (path.suffix in (".out", ".log") or path.name == "events.jsonl"):
            wanted.append(path)
    return wanted


def run_tails(root: Path, limit: int = 40_000) -> str:
    """The tails under ``root``, each headed by its path from ``root``; at most ``limit``
    characters, the last files' cut first."""
    parts = []
    for path in _found(root):
        body = _events_tail(path) if path.name == "events.jsonl" else _tail(path, LINES)
        parts.append("\n".join([f"--- {path.relative_to(root)}", *body]))
    text = "\n".join(parts)
    return text if len(text) <= limit else text[:limit] + "\n(cut)"
