"""``replay:PATH``: plays back a recorded ``gpu_metrics.csv`` (or a generated trace).

- Rows are grouped into samples the way the monitor writes them: one row per GPU, a new
  sample begins when a GPU id repeats.
- A GPU absent from every sample after some point was lost there: it is left out from then
  on, and the monitor reports it lost. A GPU missing from one sample but back later is
  "unknown" in that sample (all metrics None), not lost and not healthy.
- Unknown columns are ignored; a missing optional column, an empty cell or a malformed
  number is unknown.
- A row without a usable ``timestamp`` or ``gpu_id`` cannot be placed; it is skipped and
  counted (``skipped``, with the first few reasons in ``problems``). A file without those
  columns, or with no usable row at all, is an error (:class:`ReplayError`).
"""

from __future__ import annotations

import csv
from pathlib import Path

from ftmaster.monitor.backends import TraceEnded
from ftmaster.monitor.sample import GpuSample, RowError, from_row

REQUIRED = ("timestamp", "gpu_id")
MAX_PROBLEMS_KEPT = 5


class ReplayError(ValueError):
    """The file cannot be replayed at all (missing, wrong columns, nothing usable)."""


class ReplayBackend:
    name = "replay"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.skipped = 0
        self.problems: list[str] = []
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
            handle = self.path.open(newline="", errors="replace")
        except OSError as exc:
            raise ReplayError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        with handle:
            batches = self._group(self._rows(handle))
        if not batches:
            raise ReplayError(f"{self.path} has no usable rows"
                              + (f" ({self.problems[0]})" if self.problems else ""))
        return _fill_gaps(batches)

    def _rows(self, handle):
        reader = csv.reader(handle)
        try:
            header = next(reader)
        except (StopIteration, csv.Error):
            raise ReplayError(f"{self.path} is empty or not CSV") from None
        header = [h.strip() for h in header]
        missing = [c for c in REQUIRED if c not in header]
        if missing:
            raise ReplayError(f"{self.path} lacks the column(s) {', '.join(missing)}; "
                              f"is it a gpu_metrics.csv?")
        while True:
            try:
                cells = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                self._skip(reader.line_num, str(exc))
                continue
            if not cells:
                continue
            try:
                yield from_row(dict(zip(header, cells)))
            except RowError as exc:
                self._skip(reader.line_num, str(exc))

    def _skip(self, line: int, reason: str) -> None:
        self.skipped += 1
        if len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems.append(f"{self.path}:{line}: {reason}")

    @staticmethod
    def _group(samples) -> list[list[GpuSample]]:
        batches: list[list[GpuSample]] = []
        seen: set[int] = set()
        for sample in samples:
            if not batches or sample.gpu_id in seen:
                batches.append([])
                seen = set()
            batches[-1].append(sample)
            seen.add(sample.gpu_id)
        return batches


def _fill_gaps(batches: list[list[GpuSample]]) -> list[list[GpuSample]]:
    """Give a GPU missing from a sample, but present later, an all-unknown row there."""
    last_seen: dict[int, int] = {}
    first_seen: dict[int, int] = {}
    for index, batch in enumerate(batches):
        for sample in batch:
            last_seen[sample.gpu_id] = index
            first_seen.setdefault(sample.gpu_id, index)
    for index, batch in enumerate(batches):
        present = {s.gpu_id for s in batch}
        for gpu, last in last_seen.items():
            if first_seen[gpu] < index < last and gpu not in present:
                batch.append(GpuSample(timestamp=batch[0].timestamp, gpu_id=gpu))
    return batches
