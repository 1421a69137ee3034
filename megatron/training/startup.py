"""A rank's start-up in phases, from ftmaster's launch to the end of its first iteration.

Each phase ends at a mark the trainer sets once (:func:`mark`); a phase whose mark never came
(no checkpoint to verify, say) lasts 0 s and the next one starts where the last mark was. The
phases tile the time from the launch to the first iteration, so they add up to it. Names are
Megatron-LM's timers where it has one (``model-and-optimizer-setup``,
``train/valid/test-data-iterators-setup``); the three ``checkpoint-*`` phases together are its
``load-checkpoint``.

After the first iteration every rank hands its marks to :func:`agree` (one collective); in the
``startup`` event a phase ends when its last rank ends it, so the event's phases add up to the
time from the launch to the job's first iteration.

This module is imported by the script's first line, so it imports nothing heavy.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ftmaster.runfiles import ASSIGNED_AT_ENV, LAUNCHED_AT_ENV

PHASES = (
    "launch",            # ftmaster's launch -> this process runs (torchrun and its guard; or a
                         # warm worker receiving its rank)
    "interpreter",       # -> the script's first line (Python's own start; 0 when warm)
    "imports",           # -> torch, megatron-core and the trainer imported
    "process-group",     # -> the process group and the model-parallel groups
    "model-and-optimizer-setup",
    "train/valid/test-data-iterators-setup",
    "checkpoint-search",  # -> the checkpoint to load is chosen
    "checkpoint-verify",  # -> its structure and checksums are checked
    "checkpoint-read",    # -> it is loaded into the model and optimizer
    "first-iteration",
)
_marks: dict[str, float] = {}


def mark(phase: str) -> None:
    """The end of ``phase`` (the first call counts)."""
    if phase not in PHASES:
        raise ValueError(f"unknown start-up phase {phase!r}")
    _marks.setdefault(phase, time.time())


def _process_started_at() -> float:
    """When this rank's process started (a warm worker: when it got its rank), unix time.

    Not ``psutil``'s ``create_time``: it adds the age to the kernel's boot time, which is
    whole seconds and drifts from the wall clock (0.9 s off on these VMs). The age alone,
    on the boot-time clock the kernel counts it on, is exact to a clock tick.
    """
    assigned = os.environ.get(ASSIGNED_AT_ENV)
    if assigned:
        return float(assigned)
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def ends() -> dict[str, float]:
    """This rank's start (``start``: ftmaster's launch, else the process's own) and the unix
    time each phase ended; a phase never marked ends where the one before it did."""
    started = _process_started_at()
    launched = os.environ.get(LAUNCHED_AT_ENV)
    marked = {"launch": started, **_marks}
    times = {"start": float(launched) if launched else started}
    last = times["start"]
    for phase in PHASES:
        last = max(last, marked.get(phase, last))
        times[phase] = last
    return times


def summary(per_rank: list[dict[str, float]]) -> dict:
    """The ``startup`` event's fields from every rank's :func:`ends`. A phase ends when the
    last rank ends it (the view Megatron-LM's timers take with ``barrier=True``), so the phases
    tile the time from the launch to the job's first iteration; ``seconds`` is that time,
    ``slowest_rank`` the rank that finished its first iteration last."""
    start = min(ends["start"] for ends in per_rank)
    phases, last = {}, start
    for phase in PHASES:
        end = max(ends[phase] for ends in per_rank)
        phases[phase], last = round(end - last, 4), end
    slowest = max(range(len(per_rank)), key=lambda r: per_rank[r]["first-iteration"])
    return {"phases": phases, "seconds": round(last - start, 4), "slowest_rank": slowest,
            "warm": bool(os.environ.get(ASSIGNED_AT_ENV)), "ranks": len(per_rank)}


def agree(group) -> dict:
    """Every rank's phase ends, gathered over ``group`` (one collective): the event's fields."""
    import torch
    every: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(every, ends(), group=group)
    return summary(every)
