"""What the telemetry means: hard-signal tables and the pure hard-signal check.

Hard signals say the hardware is failing now; any one of them makes a GPU critical (score
1.0) at once. Cumulative error counters are compared with their last known value for the
GPU, so a counter that was already non-zero when the monitor started does not alert
forever, and a rise across a failed read (0, unknown, 1) is still a rise.

The pending page-retirement / row-remap flag is treated the same way: it stays set until the
GPU is reset, so only its change from clear to set is news. A flag already set when the
monitor starts alerts neither at every start nor forever (which kept the GPU from ever
re-arming); a failed remap, the part of it that needs the GPU replaced, is a persistent state
the supervisor sees through :mod:`ftmaster.monitor.health` instead.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from ftmaster.monitor.sample import GpuSample

# XIDs that mean lost or failing hardware (NVIDIA's XID catalogue), most severe first.
HARD_XIDS = (
    79,   # GPU has fallen off the bus
    95,   # uncontained ECC error
    48,   # double-bit ECC error
    64,   # row-remapper failure
    63,   # ECC page retirement / row remapping event
    94,   # contained ECC error
    92,   # high single-bit ECC error rate
    74,   # NVLink error
    140,  # unrecovered ECC error
    119,  # GSP RPC timeout
    120,  # GSP error
    62,   # internal micro-controller halt
    61,   # internal micro-controller breakpoint/warning
    154,  # GPU recovery action changed
)
_XID_RANK = {code: rank for rank, code in enumerate(HARD_XIDS)}
WARNING_XIDS = frozenset({64, 63, 92, 61, 154})
"""Hard XIDs after which the GPU's applications run on: a warning of a fault (a high
single-bit rate, a page retired, a micro-controller warning, a recovery action asked), not
the fault itself, whose XIDs (79, 48, 95, ...) end them."""

# NVML clocks-event (throttle) bits that point at hardware trouble. Left out on purpose:
# GPU idle (0x1), application clocks (0x2), SW power cap (0x4: routine under heavy load),
# sync boost (0x10), display clocks (0x100).
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
BAD_THROTTLE_MASK = HW_SLOWDOWN | SW_THERMAL | HW_THERMAL | HW_POWER_BRAKE

RECOVERY_ACTION_NONE = 0

# Counters whose rise means an uncorrectable (double-bit) ECC error.
CUMULATIVE_ERROR_COUNTERS = ("ecc_dbe", "errors")
# Levels remembered per GPU, whose rise is the signal (the pending flag is sticky until reset).
RISING_LEVELS = CUMULATIVE_ERROR_COUNTERS + ("retired_pages_pending",)

# Each hard signal and the sample fields that can show it.
HARD_SIGNAL_FIELDS = {
    "ecc_dbe/errors": CUMULATIVE_ERROR_COUNTERS,
    "xid": ("xid",),
    "retired_pages_pending": ("retired_pages_pending",),
    "recovery_action": ("recovery_action",),
}
# Empty whenever nothing happened, so an empty value cannot tell that it is unavailable.
EVENT_FIELDS = frozenset({"xid"})


def worst_xid(codes: Iterable[int]) -> int | None:
    """The code to record for an interval: the most severe hard XID, else the first seen."""
    codes = list(codes)
    if not codes:
        return None
    hard = [c for c in codes if c in _XID_RANK]
    return min(hard, key=_XID_RANK.__getitem__) if hard else codes[0]


def _increased(before: int | None, after: int | None) -> bool:
    # Unknown on either side is no evidence; a counter reset (after < before) is not an error.
    return before is not None and after is not None and after > before


def remember_counters(known: dict[str, int], current: GpuSample) -> None:
    """Keep ``current``'s known :data:`RISING_LEVELS` in ``known``; an unknown read keeps the old value."""
    for name in RISING_LEVELS:
        value = getattr(current, name)
        if value is not None:
            known[name] = value


def double_bit_error(known: Mapping[str, int], current: GpuSample) -> bool:
    """Whether an uncorrectable-error counter rose since its last known value in ``known``."""
    return any(_increased(known.get(name), getattr(current, name)) for name in CUMULATIVE_ERROR_COUNTERS)


def hard_reasons(known: Mapping[str, int], current: GpuSample) -> list[str]:
    """The hard signals ``current`` shows; ``known`` holds the GPU's :data:`RISING_LEVELS` at
    their last known values before it (see :func:`remember_counters`), empty at first."""
    reasons = []
    if double_bit_error(known, current):
        reasons.append("ecc_dbe")
    if current.xid in _XID_RANK:
        reasons.append(f"xid_{current.xid}")
    if current.recovery_action is not None and current.recovery_action != RECOVERY_ACTION_NONE:
        reasons.append(f"recovery_action_{current.recovery_action}")
    if _increased(known.get("retired_pages_pending"), current.retired_pages_pending):
        reasons.append("retired_pages_pending")
    return reasons


def xid_severity(code: int) -> int:
    """Sort key: most severe hard XID first, then any other code."""
    return _XID_RANK.get(code, len(_XID_RANK))


def unavailable_hard_signals(samples: list[GpuSample],
                             reported_fields: frozenset[str] | None = None) -> list[str]:
    """The hard signals (keys of HARD_SIGNAL_FIELDS) that no GPU in ``samples`` can show.

    ``reported_fields`` are the fields the backend can fill at all (None: it does not say). An
    event field counts as available when the backend has it; any other field when some GPU
    reported it.
    """
    def available(name: str) -> bool:
        if reported_fields is not None and name not in reported_fields:
            return False
        return name in EVENT_FIELDS or any(getattr(s, name) is not None for s in samples)

    return [signal for signal, names in HARD_SIGNAL_FIELDS.items()
            if not any(available(name) for name in names)]
