"""A rank's start-up in phases, from ftmaster's launch to the end of its first iteration.

Each phase ends at a mark the trainer sets once (:func:`mark`); a phase whose mark never came
(no checkpoint to verify, say) lasts 0 s and the next one starts where the last mark was. The
phases tile the time from the launch to the first iteration, so they add up to it. Names are
Megatron-LM's timers where it has one (``model-and-optimizer-setup``,
``train/valid/test-data-iterators-setup``); the three ``checkpoint-*`` phases together are its
``load-checkpoint``.

After the first iteration every rank hands its phases to :func:`agree` (one collective); the
``startup`` event then gives each phase's maximum over ranks.

This module is imported by the script's first line, so it imports nothing heavy.
"""

from __future__ import annotations

import os
import time

LAUNCHED_AT_ENV = "FTMASTER_LAUNCHED_AT"  # ftmaster.attempt sets it
ASSIGNED_AT_ENV = "FTMASTER_ASSIGNED_AT"  # ftmaster.warm sets it in a warm worker

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
    assigned = os.environ.get(ASSIGNED_AT_ENV)
    if assigned:
        return float(assigned)
    import psutil
    return psutil.Process().create_time()


def phases() -> dict[str, float]:
    """Seconds per phase so far, in order; without ftmaster's launch time, from this
    process's start (and no ``launch`` phase)."""
    launched = os.environ.get(LAUNCHED_AT_ENV)
    started = _process_started_at()
    ends = {"launch": started, **_marks}
    last = float(launched) if launched else started
    seconds = {}
    for phase in PHASES:
        end = ends.get(phase)
        seconds[phase] = round(max(0.0, end - last), 4) if end is not None else 0.0
        last = end if end is not None else last
    return seconds


def summary(per_rank: list[dict[str, float]]) -> dict:
    """The ``startup`` event's fields from every rank's phases: each phase's maximum, the
    slowest rank's total, and which rank that was."""
    totals = [sum(p.values()) for p in per_rank]
    slowest = max(range(len(per_rank)), key=totals.__getitem__)
    return {"phases": {name: max(p[name] for p in per_rank) for name in PHASES},
            "seconds": round(totals[slowest], 4), "slowest_rank": slowest,
            "warm": bool(os.environ.get(ASSIGNED_AT_ENV)), "ranks": len(per_rank)}


def agree(group) -> dict:
    """Every rank's phases, gathered over ``group`` (one collective): the event's fields."""
    import torch
    mine = phases()
    every: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(every, mine, group=group)
    return summary(every)
