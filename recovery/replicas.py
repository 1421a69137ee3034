"""Which surviving replicas make a checkpoint: the pure part of replica recovery.

The survivors of a failed attempt dump their state (``megatron.training.replicas``), each
with a report. :func:`choose_cut` picks, from the reports alone, the largest iteration at
which every shard of the old layout has a survivor, all of them with the same consumed
samples, and one survivor per shard (the lowest rank). A shard is a (TP, PP) coordinate, and
with the distributed optimizer also the rank's optimizer shard within its instance
(``--num-distributed-optimizer-instances N`` replicates the shards across N instances). Replicas of one shard at that
iteration must hold equal bytes, item by item; if they do not, one of them is corrupted and
there is no cut at all (a merge must never guess which one is right).

No torch here: the supervisor imports it. The merge (``megatron.training.replica_merge``)
then checks what the reports cannot: that the chosen plans cover every tensor exactly once.
"""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

REQUEST_FLAG = "replica_dump.json"
"""In the run directory's ``flags/``: ``{"folder": DUMP}`` asks every rank for a dump."""
DUMPS_SUBDIR = "replicas"
"""In the memory tier: ``replicas/attempt_<N>/`` holds one attempt's dumps."""
SHARD_FILE = "optimizer_shard.pt"
"""In a rank's dump, with the distributed optimizer: its slices of the optimizer state."""
STAGING_PREFIX = ".replica-"
"""A merge builds ``iter_<N>`` in ``.iter_<N>.replica-<id>`` beside it (never loaded); a merge
killed or crashed mid-write leaves that folder, which holds links to the chosen shards."""


def dump_folder(memory_dir: Path, attempt: int) -> Path:
    return Path(memory_dir) / DUMPS_SUBDIR / f"attempt_{attempt}"


def round_dump_folder(memory_dir: Path, round_number: int) -> Path:
    """Across nodes: one failed round's dumps, each node's in its own memory tier."""
    return Path(memory_dir) / DUMPS_SUBDIR / f"round_{round_number}"


def remove_merge_leftovers(memory_dir: Path) -> None:
    """What merges that never finished left in the memory tier (run when none is running)."""
    for leftover in Path(memory_dir).glob(f".iter_*{STAGING_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)


def remove_recovery_leftovers(memory_dir: Path) -> None:
    """What a killed ftmaster's recovery left in its memory tier: dumps never merged and a
    merge's half-built folder (whose links keep the dumps' bytes in memory). Run as an
    ftmaster starts, when none of its dumps or merges runs yet."""
    shutil.rmtree(Path(memory_dir) / DUMPS_SUBDIR, ignore_errors=True)
    remove_merge_leftovers(memory_dir)


def rank_dump_dir(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank_{rank}"


def report_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank_{rank}.json"


def item_key(fqn: str, offset: Iterable[int] | None) -> str:
    """One stored item: a tensor chunk by its global offset, or a whole object."""
    return fqn if offset is None else f"{fqn}@{','.join(str(int(o)) for o in offset)}"


def slice_key(fqn: str, offsets: Iterable[int], start: int, end: int) -> str:
    """A distributed optimizer's slice: the flat elements ``[start, end)`` of one chunk."""
    return f"{item_key(fqn, offsets)}[{start}:{end}]"


class NoCut(Exception):
    """No complete, consistent set of replicas; the message says why, in one line."""


def unavailable_reason(replica_recovery: bool, distributed_optimizer: bool,
                       instances: int) -> str | None:
    """Why ``--replica-recovery`` cannot work with these settings, in one line with the way
    out; None when it can. The trainer's dumps refuse with it, and ``ftmaster launch`` says it
    at once (else it came only in a failure's fallback, after the rehearsal it spoilt)."""
    if replica_recovery and distributed_optimizer and instances < 2:
        return ("replica recovery is unavailable: the distributed optimizer with one instance "
                "shards its state over DP, so no rank holds a replica of another's; pass "
                "--num-distributed-optimizer-instances 2 or more (DP x CP must divide by it), "
                "or --no-use-distributed-optimizer")
    return None


@dataclass(frozen=True)
class Report:
    """One rank's dump report; ``refused`` instead of a state when it could not dump."""

    rank: int
    tp: int
    pp: int
    dp: int
    tp_size: int
    pp_size: int
    dp_size: int
    iteration: int | None = None
    consumed_samples: int | None = None
    items: Mapping[str, str] | None = None
    files: Mapping[str, dict] | None = None
    bytes: int = 0
    seconds: float = 0.0
    refused: str | None = None
    instance: int = 0
    """The distributed optimizer's instance (0 without it)."""
    optimizer_shard: int = 0
    """This rank's shard of the distributed optimizer's state within its instance."""
    optimizer_shards: int = 1
    """The shards of an instance: DP x CP / instances (1 without the distributed optimizer)."""

    @property
    def shard(self) -> tuple[int, int, int]:
        return self.tp, self.pp, self.optimizer_shard

    @classmethod
    def from_json(cls, body: dict) -> "Report":
        known = {name: body[name] for name in cls.__dataclass_fields__ if name in body}
        return cls(**known)


@dataclass(frozen=True)
class ReplicaCut:
    """The survivors whose dumps make the checkpoint of ``iteration``: one per shard."""

    iteration: int
    consumed_samples: int
    ranks: tuple[int, ...]
    """In (PP, TP, optimizer shard) order."""


def read_reports(folder: Path) -> list[Report]:
    """Every complete report in a dump folder (a torn or foreign file is skipped)."""
    reports = []
    for path in sorted(Path(folder).glob("rank_*.json")):
        try:
            reports.append(Report.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return reports


def choose_cut(reports: list[Report]) -> ReplicaCut:
    """The newest complete cut; NoCut with the reason when there is none."""
    dumped = [r for r in reports if r.refused is None and r.iteration is not None]
    layout = _old_layout(reports)
    if not dumped:
        refused = "; ".join(f"rank {r.rank}: {r.refused}" for r in reports if r.refused)
        raise NoCut("no survivor dumped its state" + (f" ({refused})" if refused else ""))
    newest_gap = None
    for iteration in sorted({r.iteration for r in dumped}, reverse=True):
        at = [r for r in dumped if r.iteration == iteration]
        if len({r.consumed_samples for r in at}) > 1:
            newest_gap = newest_gap or f"the survivors at iteration {iteration} disagree on the samples consumed"
            continue  # a mixed cut: the data position would be wrong
        chosen, missing = _one_per_shard(at, layout)
        if missing is None:
            _check_replicas_agree(at, iteration)
            return ReplicaCut(iteration, at[0].consumed_samples, tuple(r.rank for r in chosen))
        newest_gap = newest_gap or f"{_describe(missing, layout[3])} has no survivor at iteration {iteration}"
    why = " (DP 1: no shard has a replica)" if layout[2] == 1 else ""
    raise NoCut(f"{newest_gap}, nor a complete cut at an earlier one{why}")


def _describe(shard: tuple[int, int, int], optimizer_shards: int) -> str:
    tp, pp, optimizer_shard = shard
    sharded = f", optimizer shard {optimizer_shard}" if optimizer_shards > 1 else ""
    return f"shard (TP {tp}, PP {pp}{sharded})"


def _old_layout(reports: list[Report]) -> tuple[int, int, int, int]:
    layouts = {(r.tp_size, r.pp_size, r.dp_size, r.optimizer_shards) for r in reports}
    if len(layouts) != 1:
        raise NoCut(f"the reports disagree on the layout: {sorted(layouts)}" if layouts
                    else "no survivor reported")
    return layouts.pop()


def _one_per_shard(at: list[Report], layout: tuple[int, int, int, int]):
    tp_size, pp_size, _, optimizer_shards = layout
    chosen = []
    for pp, tp, optimizer_shard in itertools.product(range(pp_size), range(tp_size),
                                                     range(optimizer_shards)):
        shard = (tp, pp, optimizer_shard)
        holders = sorted((r for r in at if r.shard == shard), key=lambda r: r.rank)
        if not holders:
            return [], shard
        chosen.append(holders[0])
    return chosen, None


def _check_replicas_agree(at: list[Report], iteration: int) -> None:
    by_shard: dict[tuple[int, int, int], list[Report]] = {}
    for report in at:
        by_shard.setdefault(report.shard, []).append(report)
    for shard, holders in by_shard.items():
        first = holders[0]
        for other in holders[1:]:
            for key in sorted(set(first.items or {}) & set(other.items or {})):
                if first.items[key] != other.items[key]:
                    raise NoCut(f"the replicas of {_describe(shard, first.optimizer_shards)} at iteration "
                                f"{iteration} differ (ranks {first.rank} and {other.rank}, "
                                f"{key}): one of them is corrupted")
