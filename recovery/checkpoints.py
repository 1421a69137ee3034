"""Find the newest checkpoint that can really be loaded, in Megatron's layout.

    SAVE/iter_0000010/{*.distcp, .metadata, common.pt, metadata.json, ftmaster_save.json}
    SAVE/latest_checkpointed_iteration.txt      written last, by atomic rename

A save that did not finish never moved the tracker, so while the tracker is readable only
iterations at or below it are candidates. An unreadable tracker (garbage, a torn write of an
older tool) is never a fresh start: every folder is a candidate, newest first, and the reason
is reported. Without a tracker, a folder is a candidate only if it is complete (it has its
manifest, written just before the tracker would have been): the others are unfinished saves,
and a run that finds nothing else starts fresh.

**Two tiers.** With Megatron-LM's ``--non-persistent-ckpt-type global`` a second folder (the
memory tier, ``--non-persistent-global-ckpt-dir``, by default ``SAVE/non_persistent`` as in
Megatron-LM, under ``ftmaster launch`` a folder in ``/dev/shm``) holds checkpoints in the same
layout with its own tracker. Loading tries both tiers' candidates, highest iteration first,
memory first on a tie (:func:`tier_candidates`). The disk tracker has two writers, the
trainer's rank 0 and ftmaster's persist copy, so it moves under a lock and never backwards
(:func:`advance_tracker`), except when a resume discards a timeline.

A candidate is valid when its files are all there, every shard byte range recorded in the
torch_dist ``.metadata`` lies inside its file and is listed in its manifest
(:mod:`ftmaster.recovery.manifest`), and every file has the size the manifest records: a few
``stat`` calls, and the checksum of ``.metadata``, whose bytes are read to be unpickled anyway.
Comparing the other checksums reads every byte, so the trainer does that itself, spread over
its ranks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pickle
import re
import reprlib
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

from ftmaster.runfiles import atomic_write_text, remove_abandoned_temp_files

from .argv_flags import flag_value
from .manifest import (MANIFEST_NAME, ChecksumMismatch, FileDigest, Manifest, bytes_problem,
                       is_plain_file_name, known_manifest_name, read_manifest, size_problem)

TRACKER_NAME = "latest_checkpointed_iteration.txt"
NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron-LM's memory-tier folder under --save
MEMORY_HEADROOM = 1.1
"""Free space a memory save wants before it makes a folder, in units of the last checkpoint."""
TIERS = ("memory", "disk")
_LOCK_NAME = ".ftmaster_tracker.lock"
_PIN_NAME = ".ftmaster_persisting"
_WHOLE_NAME = ".ftmaster_whole"
_REPLICATED_NAME = ".ftmaster_replicated"
# The names iteration_dir gives: {:07d} is a minimum width, so iteration 10,000,000 is
# iter_10000000; a longer name with a leading zero is no save's (nor are non-ASCII digits).
_ITER_DIR = re.compile(r"^iter_([0-9]{7}|[1-9][0-9]{7,})\Z")  # \Z: "$" takes a trailing newline
COMMON_FILE = "common.pt"  # the non-sharded state, torch.save'd by rank 0
CONFIG_FILE = "metadata.json"  # megatron-core's CheckpointingConfig
DCP_METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's global plan
_REQUIRED_FILES = (COMMON_FILE, CONFIG_FILE, DCP_METADATA_FILE)


def same_folder(folder: Path, other: Path | str | None) -> bool:
    """Whether both name one folder (however written: a symlink, a relative path); False
    when either is missing or cannot be looked at."""
    try:
        return other is not None and os.path.samefile(folder, other)
    except OSError:
        return False


def iteration_dir(save_dir: Path, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def tracker_path(save_dir: Path) -> Path:
    return Path(save_dir) / TRACKER_NAME


@dataclass(frozen=True)
class TrackerReading:
    """What the tracker file says: an iteration, nothing (absent), or why it is unusable."""

    iteration: int | None
    problem: str | None = None


def read_tracker_state(save_dir: Path) -> TrackerReading:
    path = tracker_path(save_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return TrackerReading(None)
    except (OSError, UnicodeDecodeError) as error:
        return TrackerReading(None, f"{path} cannot be read ({error})")
    text = text.strip()
    # ASCII digits alone, as Megatron-LM writes it: int() also took "1_0", "+30" and "٣٠"
    if not re.fullmatch(r"[0-9]{1,18}", text):
        return TrackerReading(None, f"{path} holds {text[:40]!r}, not an iteration")
    return TrackerReading(int(text))


def read_tracker(save_dir: Path) -> int | None:
    """The tracker's iteration, or None when it is missing or unreadable."""
    return read_tracker_state(save_dir).iteration


def newest_on_disk(save_dir: Path) -> int | None:
    """The newest checkpoint a load would take from ``save_dir`` (:func:`loading_candidates`):
    the tracker's; when its folder is gone (removed by hand, or set aside by a resume killed
    before the tracker moved back), the newest complete folder below it; without a usable
    tracker, the newest complete folder."""
    tracked = read_tracker(save_dir)
    if tracked is not None and iteration_dir(save_dir, tracked).is_dir():
        return tracked
    return next((it for it in list_iterations(save_dir)
                 if (tracked is None or it < tracked) and is_complete(iteration_dir(save_dir, it))),
                None)


def schedule_on_disk(args: Sequence[str]) -> int | None:
    """``--train-iters`` when the checkpoint a load would take from training ``args``'
    ``--save`` is that iteration's: the schedule ended, and a launch would only load it and
    end. None when not (a torn one there is passed over by a load, which trains on from an
    older one), and when ``--save`` cannot be read (unknown)."""
    train_iters, save = flag_value(args, "--train-iters"), flag_value(args, "--save")
    if train_iters is None or save is None:
        return None
    try:
        loaded = find_loadable_checkpoint(Path(save)).iteration
    except OSError:
        return None
    return loaded if str(loaded) == train_iters else None


def list_iterations(save_dir: Path) -> list[int]:
    """Iterations with an ``iter_XXXXXXX`` folder, newest first."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = (_ITER_DIR.match(entry.name) for entry in save_dir.iterdir() if entry.is_dir())
    return sorted((int(match.group(1)) for match in found if match), reverse=True)


REMOVING = ".removing-"
"""What a checkpoint folder being removed is renamed to first (``iter_*.removing-<id>``)."""


def remove_checkpoint_folder(folder: Path) -> None:
    """``folder`` out of every load's candidates at once (renamed), then emptied: a removal
    cut short (a kill, a file an NFS server keeps busy) leaves a folder no load looks at, not
    a checkpoint with its manifest and short of a shard, which a load without a tracker took
    as complete, failed, and then refused every relaunch on (exit 66). Folders an earlier
    removal left this way go too. Where the rename fails, emptied in place, manifest first."""
    folder = Path(folder)
    try:
        folder.rename(folder.with_name(f"{folder.name}{REMOVING}{uuid.uuid4().hex[:8]}"))
    except FileNotFoundError:
        pass
    except OSError:
        (folder / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
    for leftover in folder.parent.glob(f"iter_*{REMOVING}*"):  # this one's, and any left
        shutil.rmtree(leftover, ignore_errors=True)


def remove_abandoned_writes(save_dir: Path, older_than: float) -> None:
    """What writers killed mid-write left in a tier (see
    :func:`ftmaster.runfiles.remove_abandoned_temp_files`): in the folder (a tracker, a mark)
    and in its ``iter_*`` folders, where a peer copy's temp file is a whole shard, kept in a
    memory tier for as long as its checkpoint is."""
    for folder in (save_dir, *(iteration_dir(save_dir, it) for it in list_iterations(save_dir))):
        remove_abandoned_temp_files(folder, older_than)


def folder_written_at(folder: Path) -> float:
    """When ``folder`` or one of its entries last changed (unix time); raises OSError when it
    cannot be read, or changes while it is read (a save renaming its files): the caller
    decides what an unknown time means."""
    folder = Path(folder)
    return max(entry.stat().st_mtime for entry in (folder, *folder.iterdir()))


def is_complete(folder: Path) -> bool:
    """Whether the save that wrote ``folder`` finished (its manifest is written last); not
    one this user cannot look into (``is_file`` raises EACCES)."""
    try:
        return (Path(folder) / MANIFEST_NAME).is_file()
    except OSError:
        return False


_SAVE_LEFTOVER = re.compile(r"(__\d+_(\d+|objects)\.distcp(\.digest)?|common\.pt|metadata\.json"
                            r"|\.(\.metadata|common\.pt|metadata\.json)\..+)")
"""What a save of ours writes before its ``.metadata`` and manifest: shards and their digest
sidecars, ``common.pt``, ``metadata.json``, and the temp files of atomic writes."""


def never_finished(folder: Path) -> bool:
    """Whether ``folder`` is what a save of ours left when it was killed mid-write: neither
    ``.metadata`` nor a manifest, no subfolder, and nothing but the files such a save writes
    first, so it can never be loaded. A folder of another tool or format (Megatron-LM's
    legacy ``mp_rank_*``, a user's own ``iter_N``) is not."""
    folder = Path(folder)
    if is_complete(folder) or (folder / DCP_METADATA_FILE).exists():
        return False
    try:
        entries = list(folder.iterdir())
    except OSError:
        return False
    return bool(entries) and all(entry.is_file() and _SAVE_LEFTOVER.fullmatch(entry.name)
                                 for entry in entries)


def left_by_a_killed_save(folder: Path) -> str | None:
    """Why ``folder`` is nothing any load could ever take, left by a save of ours that was
    killed (at its ``mkdir``, or mid-write: :func:`never_finished`); None for any other, which
    may be a checkpoint of another tool or format, and is never removed."""
    if not any(path.is_file() for path in Path(folder).rglob("*")):
        return "an empty folder left by a save that wrote nothing"
    if never_finished(folder):
        return "a save that never finished (no manifest, no .metadata)"
    return None


def holds_checkpoints(save_dir: Path) -> bool:
    """Whether the folder has a tracker (readable or not) or a complete ``iter_*`` folder:
    then it is never to be written over by a run that starts fresh."""
    return tracker_path(save_dir).exists() or any(
        is_complete(iteration_dir(save_dir, it)) for it in list_iterations(save_dir))


def unfinished_saves(save_dir: Path) -> list[int]:
    """``iter_*`` folders a killed save of ours left (:func:`left_by_a_killed_save`), in a
    folder without a tracker."""
    if tracker_path(save_dir).exists():
        return []
    return [it for it in list_iterations(save_dir)
            if left_by_a_killed_save(iteration_dir(save_dir, it))]


@dataclass(frozen=True)
class Candidates:
    """The iterations to try loading, newest first, and what was noticed finding them."""

    save_dir: Path
    iterations: tuple[int, ...]
    notes: tuple[str, ...] = ()
    tracker_iteration: int | None = None


def loading_candidates(save_dir: Path) -> Candidates:
    """Iterations at or below a readable tracker; every folder when the tracker is unusable.
    A folder that cannot be listed (EACCES, EIO, ESTALE) has none, and a note that says so,
    which makes the load refuse on every rank rather than start fresh: raised, it was rank
    0's traceback, with the other ranks waiting in their broadcast."""
    save_dir = Path(save_dir)
    try:
        return _loading_candidates(save_dir)
    except OSError as error:
        return Candidates(save_dir, (), (f"{save_dir} cannot be read ({error.strerror or error})",))


def _loading_candidates(save_dir: Path) -> Candidates:
    tracker = read_tracker_state(save_dir)
    folders = list_iterations(save_dir)
    if tracker.problem is not None:
        if not folders:
            return Candidates(save_dir, (), (f"{tracker.problem}; no iter_* folder to fall back on",))
        return Candidates(save_dir, tuple(folders),
                          (f"{tracker.problem}: trying every iter_* folder, newest first",))
    if tracker.iteration is None:
        complete = tuple(it for it in folders if is_complete(iteration_dir(save_dir, it)))
        if not complete:
            return Candidates(save_dir, ())
        return Candidates(save_dir, complete, (
            f"{tracker_path(save_dir)} is missing: trying the complete iter_* folders, newest first",))
    notes = ()
    if tracker.iteration not in folders:
        notes = (f"the tracker names iteration {tracker.iteration}, whose folder is missing",)
    return Candidates(save_dir, tuple(it for it in folders if it <= tracker.iteration), notes,
                      tracker.iteration)


def checkpoint_problem(path: Path, elsewhere: bool = False) -> str | None:
    """Why the checkpoint folder cannot be loaded, or None when it looks complete; with
    ``elsewhere`` the shards it lacks are for peers to give (a node-local memory tier), and
    only those it holds are checked. A folder this user cannot look into (another user's,
    written under umask 077) is one the load skips: its EACCES was rank 0's traceback, with
    every other rank waiting in its broadcast."""
    try:
        return _checkpoint_problem(Path(path), elsewhere)
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"


def _checkpoint_problem(path: Path, elsewhere: bool) -> str | None:
    if not path.is_dir():
        return "folder is missing"
    for name in _REQUIRED_FILES:
        if not (path / name).is_file():
            return f"{name} is missing"
    manifest = read_manifest(path)
    if (manifest is None and (path / MANIFEST_NAME).exists()) or \
            (manifest is not None and manifest.lost_its_files):
        # Loaded as a checkpoint without one, its damaged shards would go unchecked.
        return f"{MANIFEST_NAME} is unreadable, so the checksums cannot be checked"
    if manifest is not None and manifest.files:
        problem = size_problem(path, manifest, missing_ok=elsewhere)
        if problem is not None:
            return problem
    try:
        storage = unpickled_metadata((path / DCP_METADATA_FILE).read_bytes(),
                                     metadata_digest(manifest)).storage_data
    except ChecksumMismatch as mismatch:
        return str(mismatch)
    except Exception as error:  # an unreadable .metadata is exactly what we are looking for
        return f"{DCP_METADATA_FILE} is unreadable ({type(error).__name__})"
    try:
        ends = _shard_ends(storage)
    except _DamagedMetadata as damage:
        return f"{DCP_METADATA_FILE} is damaged: it {damage}"
    return _unlisted_shard_problem(ends, manifest) or _shard_problem(path, ends, elsewhere)


def metadata_digest(manifest: Manifest | None) -> FileDigest | None:
    """The manifest's digest of ``.metadata``; None without one (another tool's checkpoint, a
    manifest from before checksums), when there is nothing to check it against."""
    return None if manifest is None else manifest.files.get(DCP_METADATA_FILE)


def unpickled_metadata(data: bytes, expected: FileDigest | None = None):
    """torch's ``Metadata`` from the bytes of a ``.metadata``: the object the previous call
    gave when the bytes are the same, else a new unpickle. Bytes unlike ``expected``, the
    manifest's digest, raise ChecksumMismatch before anything is unpickled: what is unpickled
    is what was checked, not another read of a file that may have changed in between (3 us
    for the 72 KB of an 8-layer GPT's, whose unpickle takes 1.3 ms).

    A relaunch's rank 0 checks the structure of the checkpoint it resumes when it reads the
    saved arguments, again just before the load, and then loads it (every rank waits for it);
    an unpickle takes 1 ms for an 8-layer GPT and grows with the tensor count, to 150 ms for
    4000. Comparing the bytes, not a file's name or times, makes a changed file always read
    afresh. Holders must not change the object (torch's reader sets only its load id)."""
    global _last_unpickled
    problem = None if expected is None else bytes_problem(DCP_METADATA_FILE, data, expected)
    if problem is not None:
        raise ChecksumMismatch(problem)
    if _last_unpickled is None or _last_unpickled[0] != data:
        _last_unpickled = (data, pickle.loads(data))
    return _last_unpickled[1]


_last_unpickled: tuple[bytes, object] | None = None


class _DamagedMetadata(ValueError):
    """A ``.metadata`` that unpickles (damaged, or made by hand or by another tool) but whose
    storage entries no load could follow."""


def _shard_ends(storage_data) -> dict[str, int]:
    """Each shard ``.metadata`` reads from -> the end of the last byte range it reads there."""
    if not isinstance(storage_data, Mapping):
        raise _DamagedMetadata(f"has storage data {reprlib.repr(storage_data)}, not a table of shards")
    ends: dict[str, int] = {}
    for info in storage_data.values():
        name, offset, length = (getattr(info, field, None)
                                for field in ("relative_path", "offset", "length"))
        if not (isinstance(name, str) and is_plain_file_name(name)):
            # A path outside the folder would have the load read another checkpoint's bytes.
            raise _DamagedMetadata(f"names shard {reprlib.repr(name)}, not a file of its folder")
        if not (_is_byte_count(offset) and _is_byte_count(length)):
            raise _DamagedMetadata(f"has a byte range {reprlib.repr(offset)} + "
                                   f"{reprlib.repr(length)} in shard {name}")
        ends[name] = max(ends.get(name, 0), offset + length)
    return ends


def _is_byte_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _unlisted_shard_problem(shards: Iterable[str], manifest: Manifest | None) -> str | None:
    """The first shard ``.metadata`` points at that a checksummed manifest does not list: the
    load checks the files the manifest lists, so this one's bytes would go unchecked (a
    manifest written incomplete, a folder changed by hand or by a tool)."""
    if manifest is None or not manifest.files:
        return None
    unlisted = sorted(set(shards) - manifest.files.keys())
    if not unlisted:
        return None
    return f"shard {unlisted[0]} is not in {MANIFEST_NAME}, so its checksum cannot be checked"


def _shard_problem(path: Path, ends: dict[str, int], elsewhere: bool = False) -> str | None:
    for name, end in sorted(ends.items()):
        shard = path / name
        if not shard.is_file():
            if elsewhere:
                continue
            return f"shard {name} is missing"
        size = shard.stat().st_size
        if size < end:
            return f"shard {name} is truncated ({size} of {end} bytes)"
    return None


def read_save_kind(path: Path) -> str | None:
    """The recorded kind, or None for a checkpoint ftmaster did not write (never pruned)."""
    manifest = read_manifest(path)
    return None if manifest is None else manifest.kind


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


# -- two tiers --------------------------------------------------------------------------------

_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


@contextlib.contextmanager
def tracker_lock(save_dir: Path) -> Iterator[None]:
    """Exclusive, across processes, while a tracker is read and moved (an advisory lock file
    in the folder; released when its holder dies). Not re-entrant. On a filesystem without
    locks (Lustre's noflock, NFS without lockd) it locks nothing rather than fail every save:
    there the memory tier's copies must not share a --save with a running trainer."""
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(save_dir) / _LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as error:
            if error.errno not in _NO_LOCKS:
                raise
        yield
    finally:
        os.close(fd)


def advance_tracker(save_dir: Path, iteration: int) -> bool:
    """Name ``iteration`` in the tracker unless it names a later one already; True if moved."""
    with tracker_lock(save_dir):
        return advance_tracker_locked(save_dir, iteration)


def advance_tracker_locked(save_dir: Path, iteration: int) -> bool:
    """:func:`advance_tracker` for a caller that holds ``tracker_lock(save_dir)``."""
    current = read_tracker(save_dir)
    if current is not None and current >= iteration:
        return False
    atomic_write_text(tracker_path(save_dir), f"{iteration}\n")
    return True


def set_tracker(save_dir: Path, iteration: int) -> None:
    """Name ``iteration`` in the tracker, even below the one it names (the checkpoints agreed
    on across nodes: newer ones here are not complete anywhere)."""
    with tracker_lock(save_dir):
        atomic_write_text(tracker_path(save_dir), f"{iteration}\n")


def pin(memory_dir: Path, iteration: int) -> bool:
    """Mark memory checkpoint ``iteration`` as read by a persist copy, so that pruning spares
    it; False (nothing pinned) when it is no longer complete (here, or held in part for a
    copy from the peers)."""
    return _mark(memory_dir, _PIN_NAME, iteration)


def unpin(memory_dir: Path) -> None:
    (Path(memory_dir) / _PIN_NAME).unlink(missing_ok=True)


def pinned(memory_dir: Path) -> int | None:
    return _marked(memory_dir, _PIN_NAME)


def mark_whole(memory_dir: Path, iteration: int) -> bool:
    """Across nodes: mark memory checkpoint ``iteration`` as the newest of which this node's
    folder holds every file (its peers' shards copied in), so that neither a slot refill nor
    pruning takes it while a newer one is still being copied: a node lost then leaves this
    copy to resume from. False (nothing marked) when it is gone."""
    return _mark(memory_dir, _WHOLE_NAME, iteration)


def whole_here(memory_dir: Path) -> int | None:
    return _marked(memory_dir, _WHOLE_NAME)


def unmark_whole(memory_dir: Path) -> None:
    (Path(memory_dir) / _WHOLE_NAME).unlink(missing_ok=True)


def mark_replicated(memory_dir: Path, iteration: int) -> bool:
    """Across nodes: mark memory checkpoint ``iteration`` as the newest that outlives the
    loss of any ``--memory-replicas`` nodes (every file on that many nodes and one more), of
    which this node holds a part: kept from slot refills and pruning until a newer one is,
    since with fewer replicas than peers no node's folder is whole and nothing else keeps
    it. False (nothing marked) when it is gone here."""
    return _mark(memory_dir, _REPLICATED_NAME, iteration)


def replicated_here(memory_dir: Path) -> int | None:
    return _marked(memory_dir, _REPLICATED_NAME)


def unmark_replicated(memory_dir: Path) -> None:
    (Path(memory_dir) / _REPLICATED_NAME).unlink(missing_ok=True)


def newest_held(memory_dir: Path) -> int | None:
    """The newest memory checkpoint a tier holds whole or in part: its tracker's, or a later
    folder with a manifest of either kind (across nodes a folder that is never whole has no
    tracker, but its part may still be fetched from it)."""
    return next(iter(held_iterations(memory_dir)), None)


def held_iterations(memory_dir: Path) -> list[int]:
    """Every memory checkpoint :func:`newest_held` counts, newest first."""
    held = {it for it in list_iterations(memory_dir)
            if known_manifest_name(iteration_dir(memory_dir, it)) is not None}
    return sorted(held | {read_tracker(memory_dir) or 0} - {0}, reverse=True)


def unmark_peer_copies(memory_dir: Path) -> None:
    """Let go of the marks only peer copies across nodes set and move (a run without them
    finds an earlier run's, which would keep their checkpoints for good)."""
    unmark_whole(memory_dir)
    unmark_replicated(memory_dir)


def _mark(memory_dir: Path, name: str, iteration: int) -> bool:
    # Under the tier's lock, as pruning and slot refills are, so that the checkpoint cannot
    # be removed or refilled between the check and the mark.
    with tracker_lock(memory_dir):
        if known_manifest_name(iteration_dir(memory_dir, iteration)) is None:
            return False
        atomic_write_text(Path(memory_dir) / name, f"{iteration}\n", durable=False)
        return True


def _marked(memory_dir: Path, name: str) -> int | None:
    try:
        return int((Path(memory_dir) / name).read_text().strip())
    except (OSError, ValueError):
        return None


def kept_memory_checkpoints(memory_dir: Path, superseded_below: int | None = None) -> set[int]:
    """What neither pruning nor a slot refill may take: the one a persist copy reads, a
    node-local tier's newest whole copy and newest replicated checkpoint, and the one the
    tracker names unless it is below ``superseded_below`` (see
    :func:`prunable_memory_checkpoints`)."""
    tracked = read_tracker(memory_dir)
    if tracked is not None and superseded_below is not None and tracked < superseded_below:
        tracked = None
    return {it for it in (pinned(memory_dir), whole_here(memory_dir),
                          replicated_here(memory_dir), tracked)
            if it is not None}


def prunable_memory_checkpoints(memory_dir: Path, newest: int, kept: Iterable[int] = (),
                                superseded_below: int | None = None) -> list[int]:
    """Memory checkpoints older than ``newest`` (just completed), except those
    :func:`kept_memory_checkpoints` names and those ``kept`` (the trainer's other slot).
    ``superseded_below``: a complete disk checkpoint of the run, which a load takes before
    any older memory one; the tracked one below it may go too."""
    keep = {newest, *kept_memory_checkpoints(memory_dir, superseded_below), *kept}
    return [it for it in list_iterations(memory_dir) if it < newest and it not in keep]


@dataclass(frozen=True)
class TierCandidate:
    iteration: int
    path: Path
    tier: str


@dataclass(frozen=True)
class TierCandidates:
    """Both tiers' candidates, in the order to try them, and what was noticed."""

    candidates: tuple[TierCandidate, ...]
    notes: tuple[str, ...]
    folders: tuple[Path, ...]
    """The folders searched (for messages)."""


def tier_candidates(save_dir: Path, memory_dir: Path | None) -> TierCandidates:
    """Candidates of the disk tier and, when on, the memory tier: highest iteration first,
    memory first on a tie (the same checkpoint, read at memory speed)."""
    found, notes, folders = [], [], []
    for tier, folder in (("memory", memory_dir), ("disk", save_dir)):
        if folder is None:
            continue
        candidates = loading_candidates(Path(folder))
        folders.append(Path(folder))
        notes += candidates.notes
        found += [TierCandidate(it, iteration_dir(folder, it), tier) for it in candidates.iterations]
    found.sort(key=lambda c: (-c.iteration, TIERS.index(c.tier)))
    return TierCandidates(tuple(found), tuple(notes), tuple(folders))


@dataclass(frozen=True)
class CheckpointChoice:
    """The outcome of a search: what to load, and what was passed over and why."""

    folders: tuple[Path, ...]
    chosen: TierCandidate | None
    skipped: tuple[tuple[int, str], ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def iteration(self) -> int | None:
        return None if self.chosen is None else self.chosen.iteration

    @property
    def path(self) -> Path | None:
        return None if self.chosen is None else self.chosen.path

    def describe(self) -> str:
        """One line for the log saying what will be loaded and why."""
        said = [*self.notes, *(f"iter_{it:07d} skipped: {why}" for it, why in self.skipped)]
        prefix = "; ".join(said) + "; " if said else ""
        if self.chosen is None:
            return f"{prefix}no loadable checkpoint in {' or '.join(map(str, self.folders))}"
        return f"{prefix}loading iteration {self.iteration} from {self.path}"


def find_loadable_checkpoint(save_dir: Path, memory_dir: Path | None = None) -> CheckpointChoice:
    """The first candidate of either tier whose structure is valid (of the checksums, only
    ``.metadata``'s is compared here)."""
    found = tier_candidates(Path(save_dir), memory_dir)
    skipped = []
    for candidate in found.candidates:
        problem = checkpoint_problem(candidate.path)
        if problem is None:
            return CheckpointChoice(found.folders, candidate, tuple(skipped), found.notes)
        skipped.append((candidate.iteration, problem))
    return CheckpointChoice(found.folders, None, tuple(skipped), found.notes)
