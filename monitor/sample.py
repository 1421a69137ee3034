"""One GPU reading (:class:`GpuSample`) and its ``gpu_metrics.csv`` row form.

Every metric is optional: ``None`` means "unknown" (the read failed, the backend or driver
does not have it, or the recorded cell was empty or malformed). Nothing downstream may read
``None`` as healthy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from datetime import datetime, timezone

from ftmaster.monitor.schema import CSV_COLUMNS


@dataclass(slots=True)
class GpuSample:
    """A GPU's telemetry at one instant; field names and order are the CSV columns."""

    timestamp: float  # unix seconds; ISO 8601 UTC in the CSV
    gpu_id: int
    gpu_name: str | None = None
    driver_version: str | None = None
    temperature: float | None = None  # degrees C
    power_draw: float | None = None  # W
    gpu_utilization: float | None = None  # %
    memory_utilization: float | None = None  # %
    memory_used: float | None = None  # MiB
    memory_total: float | None = None  # MiB
    errors: int | None = None  # cumulative uncorrectable ECC errors
    ecc_sbe: int | None = None  # cumulative volatile single-bit (corrected)
    ecc_dbe: int | None = None  # cumulative volatile double-bit (uncorrected)
    xid: int | None = None  # most severe XID seen in this interval
    throttle_reasons: int | None = None  # NVML clocks-event bitmask
    power_limit: float | None = None  # W
    sm_clock: float | None = None  # MHz
    pcie_replay: int | None = None
    retired_pages_pending: int | None = None  # 1 when pages/rows await retirement or remap
    recovery_action: int | None = None  # NVML gpuRecoveryAction, 0 = none
    failure_risk: float | None = None


FIELD_NAMES = tuple(f.name for f in fields(GpuSample))
assert FIELD_NAMES == CSV_COLUMNS, "GpuSample fields must follow schema.CSV_COLUMNS"

_TEXT = {"gpu_name", "driver_version"}
_INTEGER = {"errors", "ecc_sbe", "ecc_dbe", "xid", "throttle_reasons", "pcie_replay",
            "retired_pages_pending", "recovery_action"}
_FLOAT = set(FIELD_NAMES) - _TEXT - _INTEGER - {"timestamp", "gpu_id"}


class RowError(ValueError):
    """A CSV row that cannot be attributed to a GPU and an instant."""


def iso_time(unix_seconds: float) -> str:
    """The CSV's timestamp form: ISO 8601 in UTC with milliseconds."""
    return datetime.fromtimestamp(unix_seconds, timezone.utc).isoformat(timespec="milliseconds")


def parse_time(text: str) -> float:
    """ISO 8601 (a naive time is taken as UTC) or plain unix seconds; RowError if neither,
    or if the time is one the CSV's ISO 8601 form cannot hold (a millisecond epoch, say)."""
    text = text.strip()
    value = _unix_seconds(text)
    try:
        datetime.fromtimestamp(value, timezone.utc)
    except (OverflowError, ValueError, OSError):
        raise RowError(f"timestamp {text!r} is out of range (unix seconds, not milliseconds?)") from None
    return value


def _unix_seconds(text: str) -> float:
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise RowError(f"timestamp {text!r} is neither ISO 8601 nor unix seconds") from None
        if not math.isfinite(value):
            raise RowError(f"timestamp {text!r} is not finite") from None
        return value
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


def _format(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(round(value, 3))
    return str(value)


def to_row(sample: GpuSample) -> list[str]:
    """The sample as CSV cells in column order; unknown values are empty cells."""
    cells = [iso_time(sample.timestamp)]
    cells.extend(_format(getattr(sample, name)) for name in FIELD_NAMES[1:])
    return cells


MAX_READING = 1e9
"""No GPU reading (C, W, %, MiB, MHz) comes near it: a corrupt cell of 1e308 is finite, and a
window's sum, or two peers' mean, overflowed to infinity, and the scores went NaN for good."""


def unknown_if_not_finite(sample: GpuSample) -> GpuSample:
    """``sample`` with each NaN, infinite or impossibly large reading made None (unknown):
    taken as read, a NaN kept as a counter's level hid every later rise, and in a window it
    kept the score NaN."""
    for name in _INTEGER | _FLOAT:
        value = getattr(sample, name)
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= MAX_READING):
            setattr(sample, name, None)
    return sample


def _number(text: str | None, integer: bool) -> float | int | None:
    """A numeric cell, or None for empty, N/A-like or malformed text (unknown, not zero)."""
    if text is None:
        return None
    text = text.strip()
    if not text:
        return None
    try:
        value = int(text, 0) if integer and text.lower().startswith("0x") else float(text)
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    if integer and abs(value) >= 2 ** 64:  # no NVML counter or bitmask is wider: garbage
        return None
    return int(value) if integer else value


def from_row(row: dict[str, str | None]) -> GpuSample:
    """Build a sample from a CSV row keyed by column; unknown columns are ignored.

    Raises RowError when the row has no usable ``timestamp`` or ``gpu_id``; every other
    missing or malformed cell becomes None (unknown).
    """
    stamp, gpu = row.get("timestamp"), row.get("gpu_id")
    if not stamp:
        raise RowError("missing timestamp")
    gpu_id = _number(gpu, integer=False)  # not truncated: 1.5 would join GPU 1's series
    if gpu_id is None or gpu_id < 0 or gpu_id % 1:
        raise RowError(f"gpu_id {gpu!r} is not a GPU index")
    values: dict[str, object] = {"timestamp": parse_time(stamp), "gpu_id": int(gpu_id)}
    for name in _TEXT:
        text = (row.get(name) or "").strip()
        values[name] = text or None
    for name in _INTEGER:
        values[name] = _number(row.get(name), integer=True)
    for name in _FLOAT:
        values[name] = _number(row.get(name), integer=False)
    return GpuSample(**values)
