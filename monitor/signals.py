"""What the telemetry means: hard-signal tables and the pure hard-signal check.

Hard signals say the hardware is failing now; any one of them makes a GPU critical (score
1.0) at once. They are compared between a GPU's previous and current sample, so a counter
that was already non-zero when the monitor started does not alert forever.
"""

from __future__ import annotations

from typing import Iterable

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

# NVML clocks-event (throttle) bits that point at hardware trouble. Left out on purpose:
# GPU idle (0x1), application clocks (0x2), SW power cap (0x4: routine under heavy load),
# sync boost (0x10), display clocks (0x100).
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
BAD_THROTTLE_MASK = HW_SLOWDOWN | SW_THERMAL | HW_THERMAL | HW_POWER_BRAKE

RECOVERY_ACTION_NONE = 0


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


def hard_reasons(previous: GpuSample | None, current: GpuSample) -> list[str]:
    """The hard signals ``current`` shows; ``previous`` is the GPU's last sample, if any."""
    reasons = []
    if previous is not None and (_increased(previous.ecc_dbe, current.ecc_dbe)
                                 or _increased(previous.errors, current.errors)):
        reasons.append("ecc_dbe")
    if current.xid in _XID_RANK:
        reasons.append(f"xid_{current.xid}")
    if current.recovery_action is not None and current.recovery_action != RECOVERY_ACTION_NONE:
        reasons.append(f"recovery_action_{current.recovery_action}")
    if current.retired_pages_pending:
        reasons.append("retired_pages_pending")
    return reasons
