"""Find the newest checkpoint that can really be loaded, in Megatron's layout.

    SAVE/iter_0000010/{*.distcp, .metadata, common.pt, metadata.json}
    SAVE/latest_checkpointed_iteration.txt      written last, by atomic rename

A save that did not finish never moved the tracker, so only iterations at or below the
tracker's are candidates. A candidate is valid when its files are all there and every shard
byte range recorded in the torch_dist ``.metadata`` lies inside its file, so a truncated
shard is caught by a few ``stat`` calls instead of a failed load. When the tracker's
iteration is invalid, the newest valid older one is used, and the reason is reported.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

TRACKER_NAME = "latest_checkpointed_iteration.txt"
SAVE_KIND_FILE = "ftmaster_save.json"
SAVE_KINDS = ("periodic", "emergency", "exit", "final")
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
_REQUIRED_FILES = ("common.pt", "metadata.json", ".metadata")


def iteration_dir(save_dir: Path, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def tracker_path(save_dir: Path) -> Path:
    return Path(save_dir) / TRACKER_NAME


def read_tracker(save_dir: Path) -> int | None:
    """The tracker's iteration, or None when it is missing or unreadable."""
    try:
        return int(tracker_path(save_dir).read_text().strip())
    except (OSError, ValueError):
        return None


def list_iterations(save_dir: Path) -> list[int]:
    """Iterations with an ``iter_XXXXXXX`` folder, newest first."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = (_ITER_DIR.match(entry.name) for entry in save_dir.iterdir() if entry.is_dir())
    return sorted((int(match.group(1)) for match in found if match), reverse=True)


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint folder cannot be loaded, or None when it looks complete."""
    path = Path(path)
    if not path.is_dir():
        return "folder is missing"
    for name in _REQUIRED_FILES:
        if not (path / name).is_file():
            return f"{name} is missing"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as error:  # an unreadable .metadata is exactly what we are looking for
        return f".metadata is unreadable ({type(error).__name__})"
    return _shard_problem(path, storage.values())


def _shard_problem(path: Path, storage_infos) -> str | None:
    needed: dict[str, int] = {}
    for info in storage_infos:
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return f"shard {name} is missing"
        size = shard.stat().st_size
        if size < end:
            return f"shard {name} is truncated ({size} of {end} bytes)"
    return None


@dataclass(frozen=True)
class CheckpointChoice:
    """The outcome of a search: what to load, and what was passed over and why."""

    save_dir: Path
    iteration: int | None
    skipped: tuple[tuple[int, str], ...] = field(default_factory=tuple)
    tracker_iteration: int | None = None

    @property
    def path(self) -> Path | None:
        return None if self.iteration is None else iteration_dir(self.save_dir, self.iteration)

    def describe(self) -> str:
        """One line for the log saying what will be loaded and why."""
        skipped = "; ".join(f"iter_{it:07d} skipped: {why}" for it, why in self.skipped)
        prefix = f"{skipped}; " if skipped else ""
        if self.iteration is None:
            reason = ("no checkpoint tracker" if self.tracker_iteration is None
                      else "no valid checkpoint")
            return f"{prefix}{reason} in {self.save_dir}; starting from scratch"
        return f"{prefix}loading iteration {self.iteration} from {self.path}"


def find_loadable_checkpoint(save_dir: Path) -> CheckpointChoice:
    """The newest valid checkpoint at or below the tracker's iteration."""
    save_dir = Path(save_dir)
    tracked = read_tracker(save_dir)
    if tracked is None:
        return CheckpointChoice(save_dir, None)
    skipped = []
    if not iteration_dir(save_dir, tracked).is_dir():
        skipped.append((tracked, "folder is missing"))
    for iteration in (it for it in list_iterations(save_dir) if it <= tracked):
        problem = checkpoint_problem(iteration_dir(save_dir, iteration))
        if problem is None:
            return CheckpointChoice(save_dir, iteration, tuple(skipped), tracked)
        skipped.append((iteration, problem))
    return CheckpointChoice(save_dir, None, tuple(skipped), tracked)


def write_save_kind(path: Path, kind: str) -> None:
    """Record why a checkpoint was taken, so emergency ones can be pruned later."""
    if kind not in SAVE_KINDS:
        raise ValueError(f"unknown save kind {kind!r}; expected one of {SAVE_KINDS}")
    (Path(path) / SAVE_KIND_FILE).write_text(json.dumps({"kind": kind}) + "\n")


def read_save_kind(path: Path) -> str | None:
    """The recorded kind, or None for a checkpoint ftmaster did not write (never pruned)."""
    try:
        kind = json.loads((Path(path) / SAVE_KIND_FILE).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in SAVE_KINDS else None


def prunable_emergency_checkpoints(save_dir: Path, keep: int) -> list[int]:
    """Emergency checkpoints superseded by a newer regular one, beyond the newest ``keep``.

    Emergency checkpoints newer than the newest regular checkpoint are the freshest state and
    are never candidates, and neither is the one the tracker names.
    """
    save_dir = Path(save_dir)
    kinds = {it: read_save_kind(iteration_dir(save_dir, it)) for it in list_iterations(save_dir)}
    regular = [it for it, kind in kinds.items() if kind in ("periodic", "exit", "final")]
    if not regular:
        return []
    superseded = sorted((it for it, kind in kinds.items()
                         if kind == "emergency" and it < max(regular)), reverse=True)
    tracked = read_tracker(save_dir)
    return [it for it in superseded[keep:] if it != tracked]
