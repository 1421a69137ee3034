"""GPUs an earlier supervisor retired, carried over to one started again on its run directory.

A supervisor that was killed (an operator, the OOM killer, a lost login session) leaves its
retirements only in its ``plan`` events (``gpus_retired``). Some would not come back by
themselves: the monitor sees a GPU that fell off the bus again, but not a straggler drained
for its speed, a GPU drained on a risk alert, or one whose rank hung. So the supervisor
started again retires them anew, and plans before its first launch.

Only within the same boot of the same machine, which each ``plan`` event records (``boot``,
the kernel's boot id): a GPU index names the same GPU only there (``launch`` orders GPUs by
PCI bus), and a reboot resets the GPUs that a retirement was about. A plan event from
another boot, or with no boot (an older ftmaster), carries nothing over: the GPUs are tried
again, and the monitor and the supervisor retire them anew if they fail again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def boot_id(path: Path = BOOT_ID_PATH) -> str | None:
    """This boot's id (a fresh UUID at each boot), or None where the kernel gives none."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def carried_over(events: Sequence[dict], boot: str | None, gpus: Sequence[int]) -> dict[int, str]:
    """The retirements of the last ``plan`` event among ``events``, GPU -> why, when it was
    recorded in ``boot``; only those of ``gpus`` (the GPUs this supervisor was given)."""
    plans = [e for e in events if e.get("event") == "plan"]
    if boot is None or not plans or plans[-1].get("boot") != boot:
        return {}
    retired = plans[-1].get("gpus_retired")
    if not isinstance(retired, list):
        return {}
    return {entry["gpu"]: str(entry.get("reason", "retired"))
            for entry in retired if isinstance(entry, dict) and entry.get("gpu") in gpus}
