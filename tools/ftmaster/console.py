"""What ftmaster prints while training runs: the trainer's events as they happen, and a
progress line every so often.

Everything comes from files the run already writes, read incrementally (no rescans): the
trainer's events from ``events.jsonl``, the iteration from the heartbeat, the loss from the
attempt log's Megatron iteration lines (DESIGN's log-line contract). Nothing here decides
anything; the supervisor reads the same events for its bookkeeping.
"""

from __future__ import annotations

import itertools
import logging
import re
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ftmaster import runfiles
from ftmaster.recovery.checkpoints import iteration_dir

log = logging.getLogger("ftmaster")

# Megatron formats the loss with {:.6E}, which writes a NaN as NAN and an infinity as -INF.
_ITERATION_LINE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|"
    r".*?lm loss: ([0-9.eE+-]+|-?(?i:nan|inf)) \|")
SAVE_EVENTS = ("emergency_save", "periodic_save")
END_EVENTS = ("complete", "gave_up", "stopped", "store_lost")
"""The events an ftmaster that ran to its end wrote last."""


class FileTail:
    """Complete lines appended to a file since the last call; a file that shrank (replaced or
    truncated) is read again from its start."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def skip_to_end(self) -> None:
        """Ignore what the file holds now: only what is appended from here on is new."""
        try:
            self._offset = self.path.stat().st_size
        except OSError:
            self._offset = 0
        self._partial = b""

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as handle:
                size = handle.seek(0, 2)
                if size < self._offset:
                    self._offset, self._partial = 0, b""
                handle.seek(self._offset)
                data = self._partial + handle.read()
                self._offset = handle.tell()
        except OSError:
            return []
        *lines, self._partial = data.split(b"\n")
        return [line.decode(errors="replace") for line in lines]


def new_events(tail: FileTail) -> list[dict[str, Any]]:
    """Events appended since the last call; a torn or foreign line is skipped."""
    return [record for record in runfiles.parse_events(tail.new_lines())
            if isinstance(record["event"], str)]


def duration(seconds: float) -> str:
    """``12 s``, ``4 min 10 s``, ``3 h 02 min``: as a person reads an ETA."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def gpus_text(gpus) -> str:
    """``GPU 3``, ``GPUs 0, 1``, ``no GPU``: GPU ids as an operator writes them, not as a
    Python list; anything not a list (a hand-edited event's field) as it is."""
    ids = list(gpus) if isinstance(gpus, Sequence) and not isinstance(gpus, str) else [gpus]
    if not ids:
        return "no GPU"
    return f"GPU {ids[0]}" if len(ids) == 1 else f"GPUs {', '.join(map(str, ids))}"


def gpu_count_text(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def describe_event(event: dict[str, Any]) -> tuple[int, str] | None:
    """The console line (log level, text) for a trainer event, or None for others."""
    name, it = event["event"], event.get("iteration")
    if name == "checkpoint_loaded":
        return logging.INFO, (f"loaded checkpoint iteration {it} from {event.get('path')} "
                              f"in {event.get('seconds', 0):.2f} s")
    if name in SAVE_EVENTS:
        size = event.get("bytes") or 0
        memory = event.get("tier") == "memory"
        return logging.INFO, (f"checkpoint at iteration {it} ({event.get('kind', 'periodic')}, "
                              f"{'in memory, ' if memory else ''}{size / 1e6:.1f} MB): training "
                              f"blocked {event.get('seconds', 0):.2f} s, "
                              f"{'complete' if memory else 'durable'} after "
                              f"{event.get('persist_seconds', event.get('seconds', 0)):.2f} s")
    if name == "save_failed":
        then = ("saving on disk instead" if event.get("tier") == "memory"
                else "the checkpoints before it are untouched")
        return logging.ERROR, (f"{event.get('kind', 'a')} checkpoint at iteration {it} failed: "
                               f"{event.get('reason')} ({event.get('path')}); {then}")
    if name == "checkpoint_skipped":
        return logging.WARNING, f"skipped checkpoint {event.get('path')}: {event.get('reason')}"
    if name == "load_failed":
        return logging.ERROR, str(event.get("reason"))
    if name == "nonfinite":
        return logging.ERROR, (f"non-finite {event.get('what', 'loss')} at iteration {it}: "
                               f"stopped before the update, nothing saved")
    if name == "fresh_start":
        return logging.INFO, (f"no checkpoint in {' or '.join(event.get('folders') or ['--load'])}; "
                              f"starting from scratch")
    if name == "tracker_problem":
        return logging.WARNING, f"checkpoint tracker: {event.get('reason')}"
    if name == "checkpoint_set_aside" and event.get("reason"):  # not a resume's: a save's
        return logging.WARNING, (f"{event.get('path')} set aside as {event.get('moved_to')}: "
                                 f"{event['reason']}")
    if name == "checkpoint_set_aside":
        return logging.WARNING, _set_aside_text(str(event.get("path")), event.get("moved_to"), it)
    if name == "save_deferred":
        return logging.INFO, (f"emergency checkpoint deferred to iteration "
                              f"{event.get('until_iteration')} (gap filter)")
    return None


def _set_aside_text(path: str, moved_to: str | None, resumed: Any) -> str:
    """A resume sets aside the folders newer than the iteration it resumed; of that iteration
    itself, only the other tier's folder a killed save left (its tracker would name it)."""
    killed = "left by a save that never finished"
    removed = f"removed ({killed}: nothing in it could be loaded)"
    if isinstance(resumed, int) and Path(path) == iteration_dir(Path(path).parent, resumed):
        done = (f"set aside as {moved_to} ({killed}, and it could not be removed)" if moved_to
                else removed)
        return f"{path} {done}: iteration {resumed} was resumed from the other tier"
    done = f"set aside as {moved_to}" if moved_to else removed
    return f"{path} {done}: newer than the resumed iteration {resumed}"


@dataclass
class _Point:
    iteration: int
    time: float


STEPS_KEPT = 10_000
"""Logged step times an attempt keeps: a long run logs millions, and only a median is used."""
WARM_UP_STEPS = 2
"""Logged iterations at an attempt's start that are no measure of its step time."""


class Progress:
    """One attempt's progress line: iteration, loss, speed, last checkpoint, ETA."""

    def __init__(self, log_path: Path, interval_s: float, started_at: float) -> None:
        self.log_tail = FileTail(log_path)
        self.train_iters: int | None = None
        """The attempt's last iteration, as the trainer counts it (a planned change of global
        batch changes it)."""
        self.step_ms: deque[float] = deque(maxlen=STEPS_KEPT)
        """The logged iterations' times, as the trainer measured them (the newest ones)."""
        self.steps_logged = 0
        self.interval_s = interval_s
        self._last_print = started_at
        self._previous: _Point | None = None
        self._loss: tuple[int, str] | None = None
        self.last_checkpoint: dict[str, Any] | None = None
        """The newest save event seen, else the ``checkpoint_loaded`` the attempt resumed from."""
        self._heartbeat_pace: float | None = None

    @property
    def seconds_per_iteration(self) -> float | None:
        """The trainer's own step time (the median of the last 20 logged), else the pace of
        the heartbeat between two progress lines: across nodes the last rank, which logs the
        iterations, may run on another node."""
        if self.step_ms:
            return statistics.median(itertools.islice(reversed(self.step_ms), 20)) / 1000
        return self._heartbeat_pace

    def took(self, step_ms: float) -> None:
        """A logged iteration's time."""
        self.step_ms.append(step_ms)
        self.steps_logged += 1

    def steady_step_s(self) -> float | None:
        """The median step time of the attempt's logged iterations after its first two
        (compiles, allocations, the data loader's start), over the newest kept."""
        warm_up_kept = max(0, WARM_UP_STEPS - (self.steps_logged - len(self.step_ms)))
        steady = list(self.step_ms)[warm_up_kept:]
        return statistics.median(steady) / 1000 if steady else None

    def line(self, heartbeat: dict[str, Any] | None, now: float) -> str | None:
        """The progress line when one is due, else None."""
        for text in self.log_tail.new_lines():
            found = _ITERATION_LINE.search(text)
            if found:
                self.train_iters = int(found.group(2))
                self.took(float(found.group(3)))
                self._loss = (int(found.group(1)), found.group(4))
        if now - self._last_print < self.interval_s or not heartbeat:
            return None
        point = _Point(heartbeat["iteration"], heartbeat.get("time", now))
        previous, self._previous = self._previous, point
        self._last_print = now
        if previous is not None and point.iteration > previous.iteration:
            per_iteration = (point.time - previous.time) / (point.iteration - previous.iteration)
            self._heartbeat_pace = per_iteration
        elif previous is None and self.step_ms:
            # The first line of an attempt takes the trainer's own timing: a short attempt
            # (a resume that ends within one interval) still shows where it stands.
            per_iteration = self.step_ms[-1] / 1000
        else:
            return None  # stalled since the last line, or no timing yet
        return self._format(point.iteration, per_iteration, now)

    def _format(self, iteration: int, per_iteration: float, now: float) -> str:
        parts = [f"iteration {iteration}" + (f"/{self.train_iters}" if self.train_iters else "")]
        if self._loss is not None:
            parts.append(f"lm loss {float(self._loss[1]):.4g} (iteration {self._loss[0]})")
        parts.append(f"{per_iteration:.3g} s/iteration")
        if self.last_checkpoint is not None and self.last_checkpoint.get("event") == "checkpoint_loaded":
            parts.append(f"resumed from checkpoint {self.last_checkpoint['iteration']}")
        elif self.last_checkpoint is not None:
            age = duration(now - self.last_checkpoint["time"])
            parts.append(f"last checkpoint {self.last_checkpoint['iteration']} ({age} ago)")
        else:
            parts.append("no checkpoint yet")
        if self.train_iters:
            parts.append(f"ETA {duration((self.train_iters - iteration) * per_iteration)}")
        return "progress: " + " | ".join(parts)
