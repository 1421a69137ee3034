"""``replay:PATH``: plays back a recorded ``gpu_metrics.csv`` (or a generated trace).

- Rows are put in time order (a stable sort, so a file sorted by ``gpu_id`` plays like one
  the monitor wrote), then grouped into samples: one row per GPU, a new sample begins when
  a GPU id repeats.
- A GPU absent from every sample after some point was lost there: it is left out from then
  on, and the monitor reports it lost. A GPU missing from one sample but back later is
  "unknown" in that sample (all metrics None), not lost and not healthy. When the file ends
  in rows that had to be skipped (a torn last line), its last sample is incomplete: a GPU
  missing only from it is unknown there too, not lost.
- Unknown columns are ignored; a missing optional column, an empty cell or a malformed
  number is unknown.
- A row without a usable ``timestamp`` or ``gpu_id`` cannot be placed; it is skipped and
  counted (``skipped``, with the first few reasons in ``problems``), and so is a row that
  repeats the GPU of a row just before it at the same time (the first one plays). A file
  without those columns, or with no usable row at all, is an error (:class:`ReplayError`).
- ``reported_fields`` names the sample fields the file has columns for, so the monitor can
  say which signals it cannot see.
- The file is read as UTF-8; a leading byte-order mark is dropped.
- Given a job's ``gpu_ids``, only their rows play, as the other backends read only the job's
  GPUs: another GPU's alert would ask the job for a save, before the supervisor says which
  GPUs to watch. A trace with none of them is an error; ``recorded_gpus`` names every GPU
  the file has rows for, so the caller can say which of the job's it lacks.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Iterable, Iterator

from ftmaster import runfiles
from ftmaster.console import gpus_text
from ftmaster.monitor.backends import TraceEnded
from ftmaster.monitor.sample import FIELD_NAMES, GpuSample, RowError, from_row

REQUIRED = ("timestamp", "gpu_id")
MAX_PROBLEMS_KEPT = 5


class ReplayError(ValueError):
    """The file cannot be replayed at all (missing, wrong columns, nothing usable)."""


class ReplayBackend:
    name = "replay"

    def __init__(self, path: Path, gpu_ids: Iterable[int] | None = None) -> None:
        self.path = Path(path)
        self._job_gpus = None if gpu_ids is None else frozenset(gpu_ids)
        self.recorded_gpus: set[int] = set()
        self.skipped = 0
        self.problems: list[str] = []
        self.reported_fields: frozenset[str] = frozenset()
        self._ends_in_skipped_rows = False
        self._batches = self._load()
        self._next = 0
        self.rows = sum(len(batch) for batch in self._batches)

    def close(self) -> None:
        pass

    def gpu_spans(self) -> dict[int, tuple[float, float]]:
        """Each GPU's first and last recorded time (how long it was watched)."""
        spans: dict[int, tuple[float, float]] = {}
        for batch in self._batches:
            for sample in batch:
                first = spans.get(sample.gpu_id, (sample.timestamp,))[0]
                spans[sample.gpu_id] = (first, sample.timestamp)
        return spans

    def sample(self) -> list[GpuSample]:
        if self._next >= len(self._batches):
            raise TraceEnded(str(self.path))
        batch = self._batches[self._next]
        self._next += 1
        return batch

    def _load(self) -> list[list[GpuSample]]:
        try:
            handle, torn = runfiles.open_whole_lines(self.path, newline="", encoding="utf-8-sig",
                                                     errors="replace")
        except OSError as exc:
            raise ReplayError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        with handle:
            samples = sorted(self._job_rows(self._rows(handle, torn)), key=lambda s: s.timestamp)
        if not samples and self.recorded_gpus:
            recorded = sorted(self.recorded_gpus)
            raise ReplayError(f"{self.path} records {gpus_text(recorded)}, none of the job's "
                              f"{gpus_text(sorted(self._job_gpus))}: replay a trace of the "
                              "job's GPUs, or run the job on the trace's with "
                              f"CUDA_VISIBLE_DEVICES={','.join(map(str, recorded))}")
        if not samples:
            raise ReplayError(f"{self.path} has no usable rows"
                              + (f" ({self.problems[0]})" if self.problems else ""))
        return _fill_gaps(_group(samples), last_is_complete=not self._ends_in_skipped_rows)

    def _job_rows(self, samples: Iterable[GpuSample]) -> Iterator[GpuSample]:
        for sample in samples:
            self.recorded_gpus.add(sample.gpu_id)
            if self._job_gpus is None or sample.gpu_id in self._job_gpus:
                yield sample

    def _rows(self, handle, torn: int):
        reader = csv.reader(handle)
        try:
            header = next(row for row in reader if row)  # past blank lines before it
        except (StopIteration, csv.Error):
            raise ReplayError(f"{self.path} is empty or not CSV") from None
        header = [h.strip() for h in header]
        missing = [c for c in REQUIRED if c not in header]
        if missing:
            raise ReplayError(f"{self.path} lacks the column(s) {', '.join(missing)}; "
                              f"is it a gpu_metrics.csv?")
        self.reported_fields = frozenset(header) & frozenset(FIELD_NAMES)
        # GPU -> the line that gave it, at the time of the newest row: a repeat is written
        # beside its original, and a map of every row would grow with the file (10^8 rows).
        placed: dict[int, int] = {}
        placed_at: float | None = None
        while True:
            try:
                cells = next(reader)
            except StopIteration:
                if torn:  # a cell cut short may still make a row of the header's length
                    self._skip(reader.line_num + 1, "incomplete last line (no newline)")
                return
            except csv.Error as exc:
                self._skip(reader.line_num, str(exc))
                continue
            if not cells:
                continue
            if len(cells) != len(header):  # torn by a full disk, or two rows run together
                self._skip(reader.line_num, f"{len(cells)} cells where the header has {len(header)}")
                continue
            try:
                sample = from_row(dict(zip(header, cells)))
            except RowError as exc:
                self._skip(reader.line_num, str(exc))
                continue
            if sample.timestamp != placed_at:
                placed, placed_at = {}, sample.timestamp
            first = placed.setdefault(sample.gpu_id, reader.line_num)
            if first != reader.line_num:
                # A second row of one GPU at one time would begin a sample of its own, and
                # every other GPU would be missing from it (lost, at the end of the file).
                self._count_skipped(reader.line_num, f"repeats line {first}: GPU "
                                                     f"{sample.gpu_id} at the same time")
                continue
            self._ends_in_skipped_rows = False
            yield sample

    def _skip(self, line: int, reason: str) -> None:
        self._ends_in_skipped_rows = True
        self._count_skipped(line, reason)

    def _count_skipped(self, line: int, reason: str) -> None:
        self.skipped += 1
        if len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems.append(f"{self.path}:{line}: {reason}")


def _group(samples: list[GpuSample]) -> list[list[GpuSample]]:
    """Time-ordered rows into samples: a new one begins when a GPU id repeats, or when a row
    comes more than half the usual spacing after the row before it (a GPU back after a gap,
    or first watched later, otherwise joined the sample before it, and every sample after).
    Not after the sample's first row: a tool that reads GPUs one after the other dates each
    row on its own, and 4 GPUs read 0.2 s apart at 1 s were cut into samples that lacked
    GPUs, the last of them lost."""
    gap = _spacing(samples) / 2
    batches: list[list[GpuSample]] = []
    seen: set[int] = set()
    for sample in samples:
        if (not batches or sample.gpu_id in seen
                or (gap and sample.timestamp - batches[-1][-1].timestamp > gap)):
            batches.append([])
            seen = set()
        batches[-1].append(sample)
        seen.add(sample.gpu_id)
    return batches


def _spacing(samples: list[GpuSample]) -> float:
    """The usual time between samples: the median between the first rows of samples cut
    where a GPU id repeats (a few cut wrongly do not move it)."""
    starts: list[float] = []
    seen: set[int] = set()
    for sample in samples:
        if not starts or sample.gpu_id in seen:
            starts.append(sample.timestamp)
            seen = set()
        seen.add(sample.gpu_id)
    return statistics.median(b - a for a, b in zip(starts, starts[1:])) if len(starts) > 2 else 0.0


def _fill_gaps(batches: list[list[GpuSample]], last_is_complete: bool) -> list[list[GpuSample]]:
    """Give a GPU missing from a sample, but present later, an all-unknown row there.

    When the last sample is incomplete, a GPU in the sample before it counts as present
    later, so it is unknown in the last sample rather than lost.
    """
    last_seen: dict[int, int] = {}
    first_seen: dict[int, int] = {}
    for index, batch in enumerate(batches):
        for sample in batch:
            last_seen[sample.gpu_id] = index
            first_seen.setdefault(sample.gpu_id, index)
    final = len(batches) - 1
    if not last_is_complete:
        for gpu, last in last_seen.items():
            if last == final - 1:
                last_seen[gpu] = final + 1
    for index, batch in enumerate(batches):
        present = {s.gpu_id for s in batch}
        for gpu, last in last_seen.items():
            if first_seen[gpu] < index < last and gpu not in present:
                batch.append(GpuSample(timestamp=batch[0].timestamp, gpu_id=gpu))
    return batches
