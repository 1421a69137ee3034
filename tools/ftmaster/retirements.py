"""GPUs an earlier supervisor retired, carried over to one started again on its run directory.

A supervisor that was killed (an operator, the OOM killer, a lost login session) leaves its
retirements in its ``plan`` events (``gpus_retired``), and those no plan listed yet in its
``failure`` events (``unfit_gpus``) and ``retired`` events (a drained GPU, or one a rank
outlived its kill on: ``gpus_retired``). Some would not come back by themselves: the monitor
sees a GPU that fell off the bus again, but not a straggler drained for its speed, a GPU
drained on a risk alert, or one whose rank hung. So the supervisor started again retires
them anew, and plans before its first launch.

Only within the same boot of the same machine, which each ``plan`` and ``launch`` event
records (``boot``, the kernel's boot id): a GPU index names the same GPU only there
(``launch`` orders GPUs by PCI bus), and a reboot resets the GPUs that a retirement was
about. A plan or launch event from another boot, or a plan with no boot (an older ftmaster),
carries nothing from before it over: the GPUs are tried again, and the monitor and the
supervisor retire them anew if they fail again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
RECORDED_BEFORE_A_PLAN = {"failure": "unfit_gpus", "retired": "gpus_retired"}
"""The events, and their field, that list GPUs to retire before the next plan lists them."""


def boot_id(path: Path = BOOT_ID_PATH) -> str | None:
    """This boot's id (a fresh UUID at each boot), or None where the kernel gives none."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def carried_over(events: Sequence[dict], boot: str | None, gpus: Sequence[int],
                 uuids: Mapping[int, str] | None = None) -> dict[int, str]:
    """The retirements of the last ``plan`` event of this ``boot`` among ``events`` and
    those recorded after it (:data:`RECORDED_BEFORE_A_PLAN`, left by a supervisor that ended
    before its next plan: a store lost mid-round, a give-up, a kill), GPU -> why; only those
    of ``gpus`` (the GPUs this supervisor was given). With no plan in this boot yet (a first
    attempt launched without one), those recorded since its first launch. Such a failure is
    that plan's supervisor's: a failure with unfit GPUs follows a launch, and a launch its
    supervisor's plan. An entry with a UUID is matched by it among ``uuids`` (this
    supervisor's GPU -> UUID) when NVML gave them: a container given other GPUs numbers them
    from 0 again."""
    if boot is None:
        return {}
    stretch = _this_boot(events, boot)
    plans = [at for at, e in enumerate(stretch) if e.get("event") == "plan"]
    if not plans and not any(e.get("event") == "launch" for e in stretch):
        return {}
    since = plans[-1] if plans else 0
    listed = [stretch[since].get("gpus_retired")] if plans else []
    listed += [e.get(RECORDED_BEFORE_A_PLAN[e.get("event")]) for e in stretch[since:]
               if e.get("event") in RECORDED_BEFORE_A_PLAN]
    found: dict[int, str] = {}
    for entries in listed:
        found.update(_listed_gpus(entries, gpus, uuids or {}))
    return found


def _this_boot(events: Sequence[dict], boot: str) -> Sequence[dict]:
    """The events after the last plan or launch recorded in another boot, or a plan recorded
    in none (an older ftmaster, whose launches record none either)."""
    start = 0
    for at, event in enumerate(events):
        kind, recorded = event.get("event"), event.get("boot")
        if (kind == "plan" and recorded != boot) or \
                (kind == "launch" and recorded is not None and recorded != boot):
            start = at + 1
    return events[start:]


def _listed_gpus(listed: object, gpus: Sequence[int], uuids: Mapping[int, str]) -> dict[int, str]:
    """A ``[{gpu, reason, uuid}]`` list's GPUs among ``gpus``; nothing from a list that is
    none."""
    if not isinstance(listed, list):
        return {}
    by_uuid = {uuid: gpu for gpu, uuid in uuids.items()}
    found = {}
    for entry in listed:
        if not isinstance(entry, dict):
            continue
        gpu = by_uuid.get(entry["uuid"]) if uuids and isinstance(entry.get("uuid"), str) \
            else entry.get("gpu")
        if gpu in gpus:
            found[gpu] = str(entry.get("reason", "retired"))
    return found
