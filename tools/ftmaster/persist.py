"""Copy memory-tier checkpoints to ``--save``, so that what survives only in node memory
becomes durable (ftmaster's supervisor, which imports no torch and outlives every rank).

A copy goes into ``SAVE/.iter_XXXXXXX.partial-<id>/``: every file the checkpoint's manifest
lists, each hashed as it is copied and compared with the manifest's digest (a memory copy
that was torn or corrupted is never persisted), then fsynced; the manifest those digests
came from is written last, into that folder only, the folder is fsynced and, under the
tracker lock, renamed into place as ``iter_XXXXXXX`` (only while the memory copy still holds
that manifest: a resume that discarded its timeline renames it first, and the new timeline
may save that iteration again), the save folder is fsynced, and the disk tracker moves to it
unless it names a later checkpoint already. A copy that is killed leaves at most a
``.partial`` folder, which no loader reads and the next persister removes. While a copy
reads a memory checkpoint it is pinned, so the trainer's pruning spares it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import stat
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from typing import Callable, Sequence

from ftmaster.recovery import memory_room
from ftmaster.recovery.argv_flags import flag_value, set_flag
from ftmaster.lock import run_dir_in_use
from ftmaster.runfiles import atomic_write_text, fsync_path
from ftmaster.recovery.checkpoints import (MEMORY_HEADROOM, NON_PERSISTENT_SUBDIR,
                                           advance_tracker_locked, held_iterations, is_complete,
                                           iteration_dir, list_iterations, newest_on_disk,
                                           pin, read_tracker, tracker_lock, unpin)
from ftmaster.peer_files import PeerError, PeerMissing
from ftmaster.recovery.manifest import (MANIFEST_NAME, DigestingWriter, FileDigest, is_whole,
                                        known_manifest_name, parse_manifest, read_manifest)

_CHUNK = 16 << 20
_PARTIAL = ".iter_{:07d}.partial-"
TYPE_FLAG, DIR_FLAG = "--non-persistent-ckpt-type", "--non-persistent-global-ckpt-dir"
SHM = Path("/dev/shm")
CHECKPOINT_BYTES_PER_PARAMETER = 16  # fp32 weights and Adam's two moments, plus fp32 masters
MEMORY_COPIES = 3  # the newest complete one, the one being written, the one being copied
Fetch = Callable[[str, Path, FileDigest], None]
"""Fetch one file of a checkpoint, verified, from a peer that holds it (:mod:`replication`)."""


@dataclass(frozen=True)
class Tiers:
    """The folders of a command with a memory tier."""

    memory: Path
    disk: Path


def tiers_of(args: Sequence[str]) -> Tiers | None:
    """The memory and disk folders of training arguments, as the trainer resolves them
    (Megatron-LM's default memory folder is ``SAVE/non_persistent``); None without a tier."""
    save = flag_value(args, "--save")
    if flag_value(args, TYPE_FLAG) != "global" or save is None:
        return None
    memory = flag_value(args, DIR_FLAG)
    return Tiers(Path(memory) if memory else Path(save) / NON_PERSISTENT_SUBDIR, Path(save))


def checkpoint_bytes_guess(args: Sequence[str]) -> int | None:
    """The size of one checkpoint: the newest one on disk, else from the model's shape."""
    save = flag_value(args, "--save")
    for folder in (save, flag_value(args, "--load")):
        try:  # one this user cannot list is refused later, in one line, by the --save claim
            newest = list_iterations(Path(folder))[:1] if folder else []
        except OSError:
            continue
        manifest = read_manifest(iteration_dir(Path(folder), newest[0])) if newest else None
        if manifest is not None and manifest.files:
            return manifest.total_bytes
    from ftmaster.recovery.cost_model import total_parameters
    from ftmaster.recovery.megatron_args import read_model_shape
    from ftmaster.recovery.memory_estimate import ASSUMED_VOCAB_SIZE

    try:
        shape = read_model_shape(args)
    except ValueError:
        return None
    vocab = shape.vocab_size or ASSUMED_VOCAB_SIZE  # a tokenizer file's size, as the planner
    return int(total_parameters(shape, vocab) * CHECKPOINT_BYTES_PER_PARAMETER)


def with_memory_dir(args: Sequence[str], run_dir: Path, shm: Path = SHM,
                    node_rank: int | None = None) -> tuple[list[str], str | None]:
    """``args`` with a per-run memory folder in ``/dev/shm`` when the memory tier is on, its
    folder not given, and ``/dev/shm`` has room for three checkpoints (the newest, the one
    being written and the one being copied to disk); and a line to log. Across nodes the
    folder is the node's own (``node_rank``), so that two nodes on one host never share one."""
    args = list(args)
    if flag_value(args, TYPE_FLAG) != "global" or flag_value(args, DIR_FLAG) is not None:
        return args, None
    run = Path(run_dir).resolve()  # one folder per run directory, the same on a restart
    node = "" if node_rank is None else f"-node{node_rank}"
    key = str(run) if node_rank is None else f"{run}#{node_rank}"
    folder = shm / f"ftmaster-{run.name}{node}-{uuid.uuid5(uuid.NAMESPACE_URL, key).hex[:8]}"
    if folder.is_dir() and not _ours_alone(folder):
        # Its name is known in advance: another user may have made it, to read or swap
        # the checkpoints that a load and a persist copy then take as this run's.
        return args, (f"warning: the memory tier stays in {NON_PERSISTENT_SUBDIR}/ under --save: "
                      f"{folder} exists and is not this user's alone (a symlink, another "
                      f"user's, or writable by others); remove it to keep the tier in {shm}")
    if folder.is_dir():
        # An earlier ftmaster's, whose newest checkpoints may be there alone: its room, counted
        # again, is taken, and moving the tier would resume from older ones or from none.
        return set_flag(args, DIR_FLAG, str(folder)), f"memory tier in {folder} (the run's own)"
    needed = checkpoint_bytes_guess(args)
    free, note = memory_room.room(shm) if shm.is_dir() else (0, "")  # a container's limit too
    if needed is None:
        return args, (f"the memory tier stays in {NON_PERSISTENT_SUBDIR}/ under --save: the size "
                      f"of a checkpoint is unknown, so {shm} cannot be checked for room")
    # The third folder is made only with the trainer's headroom free.
    room = (MEMORY_COPIES - 1 + MEMORY_HEADROOM) * needed
    if free < room:
        return args, (f"the memory tier stays in {NON_PERSISTENT_SUBDIR}/ under --save: {shm} has "
                      f"{free / 1e9:.2f} GB free{note}, {MEMORY_COPIES} checkpoints and "
                      f"{MEMORY_HEADROOM - 1:.0%} of one to spare need about {room / 1e9:.2f} GB")
    return set_flag(args, DIR_FLAG, str(folder)), f"memory tier in {folder}"


OWNER_FILE = ".ftmaster_owner.json"
"""In a memory folder ftmaster picked on one node: the ``--save`` and run directory it serves."""


def make_ours_alone(folder: Path) -> None:
    """The memory folder ftmaster picked, made here if need be and writable by this user
    alone, whatever the umask (002 makes it group-writable): a later launch trusts only such
    a folder (:func:`with_memory_dir`)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    os.chmod(folder, stat.S_IMODE(os.stat(folder).st_mode) & ~0o022)


def mark_owner(folder: Path, save_dir: Path, run_dir: Path) -> None:
    """Write :data:`OWNER_FILE` into the folder ftmaster picked (:func:`make_ours_alone`)."""
    make_ours_alone(folder)
    owner = {"save": str(Path(save_dir).resolve()), "run_dir": str(Path(run_dir).resolve())}
    atomic_write_text(Path(folder) / OWNER_FILE, json.dumps(owner), durable=False)


def persist_left_behind(own: Path | None, save_dir: Path, resumes: bool,
                        say: Callable[[str], None], shm: Path = SHM) -> int:
    """Memory folders an earlier run on the same ``--save`` left in ``shm`` (its ftmaster
    killed, and this launch under another run directory, as a relaunch without ``--run-dir``
    is). When this run ``resumes`` from ``save_dir`` (its ``--load``), each one's newest
    checkpoint is persisted there when disk lacks it, then the folder removed: the relaunch
    resumes from it and the node's memory is freed (the older ones are older than that on
    disk then). When that one cannot be persisted, the next newer than disk is, and the
    folder stays. A run that starts fresh leaves a newer one in place (its checkpoints would
    make the fresh start refuse ``--save``), said as a warning. Each step is told to ``say``
    (``warning: `` first for one left in place). Only folders of this user's, not writable
    by others, whose run directory exists and is held by no ftmaster, are taken
    (``/dev/shm`` is everyone's); one whose run directory this host does not see is named
    in a warning. Call with ``save_dir`` claimed (no other job writes it).
    Returns how many folders were removed."""
    save, removed = str(Path(save_dir).resolve()), 0
    for folder in sorted(Path(shm).glob("ftmaster-*")):
        owner = _owner(folder) if folder != own and _ours_alone(folder) else None
        if owner is None or owner.get("save") != save or not isinstance(owner.get("run_dir"), str):
            continue
        run_dir = Path(owner["run_dir"])
        if not run_dir.is_dir():
            _warn_unseen(folder, run_dir, Path(save_dir), say)
        elif not run_dir_in_use(run_dir):
            removed += _take_over(folder, Path(save_dir), resumes, say)
    return removed


def _warn_unseen(folder: Path, run_dir: Path, save_dir: Path, say: Callable[[str], None]) -> None:
    """Name a folder left alone because it may be a live run's this host cannot tell: it
    holds node memory, and maybe a checkpoint newer than any this launch can resume."""
    newest, disk = next(iter(held_iterations(folder)), None), newest_on_disk(save_dir)
    newer = (f"; it holds iteration {newest}, newer than disk's {disk}"
             if newest is not None and (disk is None or newest > disk) else "")
    say(f"warning: {folder}, a memory tier on this --save, is left alone: its run directory "
        f"{run_dir} is not seen here (remove the folder once no run uses it, to free its "
        f"memory){newer}")


def _ours_alone(path: Path) -> bool:
    """A real folder or file (no symlink) of this user's that no one else may write."""
    try:
        status = os.lstat(path)
    except OSError:
        return False
    kind = stat.S_ISDIR(status.st_mode) or stat.S_ISREG(status.st_mode)
    return kind and status.st_uid == os.geteuid() and not status.st_mode & 0o022


def _owner(folder: Path) -> dict | None:
    record = folder / OWNER_FILE
    try:
        owner = json.loads(record.read_text()) if _ours_alone(record) else None
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _take_over(folder: Path, save_dir: Path, resumes: bool, say: Callable[[str], None]) -> int:
    """1 when ``folder`` was removed, else 0. Its checkpoints newer than disk's are tried
    newest first, as a load falls back to the next: one that cannot be persisted (damaged in
    memory, say) leaves the resume the next one. The folder goes only once its newest is on
    disk: a failed copy may have been the disk's fault, not the checkpoint's."""
    disk = newest_on_disk(save_dir)
    newer = [it for it in held_iterations(folder) if disk is None or it > disk]
    if newer and not resumes:
        say(f"warning: {folder}, the memory tier a stopped run on this --save left, holds "
            f"iteration {newer[0]}, newer than disk's {disk}: give --load {save_dir} to resume "
            f"from it (it is persisted first), or remove it")
        return 0
    landed = next((it for it in newer if _persisted_left(folder, save_dir, it, disk, say)), None)
    if newer and landed != newer[0]:
        say(f"warning: {folder} is left in place: its iteration {newer[0]} could not be "
            f"persisted, and is newer than disk's {newest_on_disk(save_dir)}")
        return 0
    shutil.rmtree(folder, ignore_errors=True)
    say(f"removed {folder}: the memory tier a stopped run on this --save left")
    return 1


def _persisted_left(folder: Path, save_dir: Path, iteration: int, disk: int | None,
                    say: Callable[[str], None]) -> bool:
    say(f"persisting iteration {iteration} to {save_dir} before training starts: {folder}, "
        f"the memory tier a stopped run on this --save left, holds it (disk: {disk})")
    try:
        copied = persist(folder, save_dir, iteration)
    except (PersistError, OSError) as error:
        say(f"warning: iteration {iteration} could not be persisted ({error})")
        return False
    if copied is not None:
        say(f"persisted iteration {iteration}: {copied.bytes / 1e6:.1f} MB in "
            f"{copied.seconds:.2f} s")
    return True


class PersistError(Exception):
    """A copy that did not complete; the disk tier is unchanged (one line)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.finished_at = time.time()
        """Unix time the copy ended, as :attr:`Persisted.finished_at`."""


class PersistSuperseded(PersistError):
    """A copy from the peers given up because they pruned the checkpoint: they hold newer
    ones, which the next copy takes. Not a failure of the disk tier."""


@dataclass(frozen=True)
class Persisted:
    iteration: int
    path: Path
    seconds: float
    bytes: int
    fetched_bytes: int = 0
    """What came from the peers that hold the files this node's folder lacks."""
    finished_at: float = field(default_factory=time.time)
    """Unix time the copy was durable, when this is made: its result may be read much later
    (a launch waits for warm workers before the supervisor polls again)."""


def _copy_verified(source: Path, target: Path, expected: FileDigest) -> None:
    with open(source, "rb") as reader, DigestingWriter(target) as writer:
        while chunk := reader.read(_CHUNK):
            writer.write(chunk)
        writer.flush()
        os.fsync(writer.fileno())
        copied = writer.digest()
    if copied != expected:
        raise PersistError(f"{source.name} does not match its checksum (memory copy damaged)")


def persist(memory_dir: Path, save_dir: Path, iteration: int,
            fetch: Fetch | None = None) -> Persisted | None:
    """Copy memory checkpoint ``iteration`` into ``save_dir`` durably; None when the disk
    tier has it already. With ``fetch``, the files this node's folder lacks come from the
    peers that hold them (a node-local tier whose folder here is not whole: its manifest is
    the one kept beside them). Raises PersistError (the disk tier unchanged)."""
    source, target = iteration_dir(memory_dir, iteration), iteration_dir(save_dir, iteration)
    # A copy killed after its rename, or the trainer's own save (its lock taken only then)
    if is_complete(target) and _tracked_if_complete(save_dir, iteration):
        return None
    if target.exists():  # found only after the whole copy, at every try, it never landed
        raise PersistError(f"{target} exists and is not a complete checkpoint (a save under "
                           "way, one killed before its manifest, or another tool's folder): "
                           "the copy would not land there")
    manifest_name = known_manifest_name(source) if fetch is not None else MANIFEST_NAME
    text = _read_bytes(source / manifest_name) if manifest_name else None
    manifest = parse_manifest(text) if text is not None else None
    if manifest is None or not manifest.files:
        raise PersistError(f"{source} has no checksummed manifest: not a complete checkpoint")
    start = time.perf_counter()
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    partial = Path(save_dir) / f"{_PARTIAL.format(iteration)}{uuid.uuid4().hex[:8]}"
    remote = {} if fetch is None else {name: digest for name, digest in manifest.files.items()
                                       if not (source / name).is_file()}
    try:
        partial.mkdir()
        # The peers' files first, fsynced later: this node's pin spares only its own folder,
        # and a peer refills the slot that holds them a few iterations on
        for name, digest in sorted(remote.items()):
            fetch(name, partial / name, digest)  # verified against ``digest`` before it lands
        for name, digest in sorted(manifest.files.items()):
            if name not in remote:
                _copy_verified(source / name, partial / name, digest)
        for name in remote:
            fsync_path(partial / name)
        _write_manifest_last(partial, text)
        _dated_as_written(partial, source, manifest_name)
        _move_into_place(source, text, partial, target)
    except PeerMissing as error:
        raise PersistSuperseded(f"iteration {iteration} is no longer held by the peers (pruned "
                                f"after newer checkpoints): {error}") from None
    except PeerError as error:
        raise PersistError(f"copying {source} to {save_dir} from the peers: {error}") from None
    except OSError as error:
        raise PersistError(f"copying {source} to {save_dir}: {error}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return Persisted(iteration, target, time.perf_counter() - start, manifest.total_bytes,
                     sum(digest.bytes for digest in remote.values()))


def _tracked_if_complete(save_dir: Path, iteration: int) -> bool:
    """Whether ``save_dir`` still holds ``iteration`` complete, the disk tracker then moved
    to it. The look and the move in one hold of the lock, under which the trainer removes a
    failed save's folder: seen complete just before, it could be gone once tracked."""
    with tracker_lock(save_dir):
        if not is_complete(iteration_dir(save_dir, iteration)):
            return False
        _advance_disk_tracker_locked(save_dir, iteration)
        return True


def _write_manifest_last(partial: Path, text: bytes) -> None:
    """The very manifest the files were checked against, into the copy's own folder only:
    taken away under the copy (a peer node's ftmaster starting removes leftovers), the folder
    must not be made again around the manifest alone, which would then land as complete."""
    try:
        with open(partial / MANIFEST_NAME, "xb") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise PersistError(f"writing the manifest into {partial}: {error}") from None
    fsync_path(partial)


def _dated_as_written(partial: Path, source: Path, manifest_name: str) -> None:
    """The copy's files and folder dated when the trainer completed the checkpoint (its
    memory manifest's time), as ``cp -p`` keeps times: the supervisor's hang check reads a
    fresh checkpoint in --save as the trainer writing one, and a copy landed by ftmaster
    itself while the trainer hung put the hang off by a whole timeout."""
    written = os.stat(source / manifest_name).st_mtime_ns
    for entry in (*partial.iterdir(), partial):
        os.utime(entry, ns=(written, written))


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _move_into_place(source: Path, manifest: bytes, partial: Path, target: Path) -> None:
    """Rename and tracker in one hold of the disk tier's lock, which a resume holds while it
    sets both tiers' discarded timelines aside: a copy of a discarded checkpoint never lands,
    and a tracker never names a folder set aside in between. The source must still hold the
    ``manifest`` copied: the new timeline may have saved the same iteration there since.
    A tracker that cannot move (a full ``--save``) takes the folder back out of place: a
    failed copy leaves the disk tier as it was, and its room free."""
    with tracker_lock(target.parent):
        held = known_manifest_name(source)  # either kind: the same text
        if held is None or _read_bytes(source / held) != manifest:
            raise PersistError(f"{source} was set aside while it was copied (a resume discarded "
                               f"its timeline)")
        if target.exists():
            raise PersistError(f"{target} appeared while the copy was made")
        iteration = int(target.name.removeprefix("iter_"))
        os.rename(partial, target)
        try:
            fsync_path(target.parent)
            _advance_disk_tracker_locked(target.parent, iteration)
        except OSError:
            if read_tracker(target.parent) != iteration:  # else it landed, durably or not
                os.rename(target, partial)
            raise


def _advance_disk_tracker_locked(save_dir: Path, iteration: int) -> None:
    """The disk tracker moved to a copied ``iteration``. Without a usable tracker a load takes
    the newest complete folder, which a tracker naming an older copy would hide."""
    if (newest_on_disk(save_dir) or -1) <= iteration:
        advance_tracker_locked(save_dir, iteration)


def remove_partial_copies(save_dir: Path) -> None:
    """The leftovers of copies that were killed (never loaded: not named ``iter_*``).

    One may be a live copy's: across nodes every node's ftmaster removes them from the shared
    ``--save`` as it starts, while rank 0's node may be copying. Each is renamed away before
    it is emptied: of that rename and the copy's own into place only one succeeds, so the copy
    either fails or lands whole. Emptied where it is, the copy went on writing into it (its
    files are written one after the other), and landed short of the files removed."""
    if Path(save_dir).is_dir():
        for leftover in Path(save_dir).glob(".iter_*.partial-*"):
            doomed = leftover.with_name(f"{leftover.name}.removed-{uuid.uuid4().hex[:8]}")
            try:
                leftover.rename(doomed)
            except OSError:  # landed or removed meanwhile
                continue
            shutil.rmtree(doomed, ignore_errors=True)


RETRY_WAIT_S = (5.0, 300.0)
"""After a failed copy: the wait before the same checkpoint is tried again, doubling per
failure in a row up to the second figure. An attempt's failure and the run's end try it
again sooner, but not within the first figure: a copy that failed a moment before fails
again (three tries and three ``persist_failed`` of one damaged checkpoint in a second)."""


class Persister:
    """One background copy at a time; results are collected with :meth:`take_results`."""

    def __init__(self, memory_dir: Path, save_dir: Path) -> None:
        self.memory_dir, self.save_dir = Path(memory_dir), Path(save_dir)
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.last_requested: int | None = None
        self._whole: int | None = None  # the last checkpoint seen whole (checked once)
        self._failures = 0  # copies failed in a row
        # The failed iteration, and from when it is tried again: asked at once (retry_now),
        # and at a poll.
        self._retry: tuple[int, float, float] | None = None
        remove_partial_copies(self.save_dir)
        self._let_go_of_a_dead_copys_pin()

    def _let_go_of_a_dead_copys_pin(self) -> None:
        """This folder is pinned by this persister alone (the run directory's lock and the
        folder's claim keep other ftmasters out), and none of its copies runs yet: a pin is
        a killed ftmaster's, which would keep its checkpoint from pruning and slot refills
        in the tier until this one's first copy, and for good when none comes."""
        try:
            unpin(self.memory_dir)
        except OSError as error:
            logging.getLogger("ftmaster").warning(
                "letting go of a killed ftmaster's persist pin in %s: %s", self.memory_dir, error)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def newest_memory_checkpoint(self) -> int | None:
        """The memory tracker's iteration when its folder holds every file: in a node-local
        tier, rank 0's folder has the manifest before peer copies bring the other nodes'
        shards (:mod:`replication`)."""
        newest = read_tracker(self.memory_dir)
        if newest is None:
            return None
        folder = iteration_dir(self.memory_dir, newest)
        if newest == self._whole:
            return newest if is_complete(folder) else None
        if not is_whole(folder):
            return None
        self._whole = newest
        return newest

    def needs_copy(self, iteration: int | None, retry_now: bool = False) -> bool:
        """Whether ``iteration`` is newer than the disk tier's and not being copied; one whose
        copy just failed waits before it is tried again (a damaged checkpoint was re-read at
        every poll), for :data:`RETRY_WAIT_S`'s first figure alone when ``retry_now``."""
        return self.may_need_copy(iteration, retry_now) and self.newer_than_disk(iteration)

    def may_need_copy(self, iteration: int | None, retry_now: bool = False) -> bool:
        """:meth:`needs_copy` without its read of ``--save``: False in the common case, at
        every poll (already requested, or waiting to be tried again)."""
        if iteration is not None:  # the memory tier's newest older: a resume set newer aside
            self.resumed_from(iteration)
        if iteration is None or iteration == self.last_requested:
            return False
        if self._retry is None or iteration != self._retry[0]:
            return True
        _, now_from, poll_from = self._retry
        return time.monotonic() >= (now_from if retry_now else poll_from)

    def resumed_from(self, iteration: int) -> None:
        """Training went back to ``iteration``: a copy asked for a newer one was of another
        timeline, and its number may come again, another state, never copied. The memory
        tier's newest tells (:meth:`may_need_copy`) unless a resume from disk set every
        memory checkpoint aside; the attempt's ``checkpoint_loaded`` tells either way."""
        if iteration < (self.last_requested or 0):
            self.last_requested = None

    def newer_than_disk(self, iteration: int) -> bool:
        """Whether ``iteration`` is newer than what a load would take from ``--save``; True
        when ``--save`` cannot be read: the copy is tried, and fails saying why, or lands."""
        try:
            disk = newest_on_disk(self.save_dir)
        except OSError:
            return True
        return disk is None or iteration > disk

    def start(self, iteration: int, fetch: Fetch | None = None) -> bool:
        """Copy ``iteration`` in the background (what this node lacks through ``fetch``)
        unless a copy is running or it was pruned meanwhile; True if started. It is pinned
        before this returns, so pruning spares it; a pin the tier has no room for is a failed
        copy, reported and tried again as any other."""
        if self.busy:
            return False
        try:
            pinned = pin(self.memory_dir, iteration)
        except OSError as error:  # a full /dev/shm refuses the pin's few bytes
            self._failed(iteration, PersistError(f"pinning iteration {iteration} in "
                                                 f"{self.memory_dir}: {error}"))
            return False
        if not pinned:
            return False
        self.last_requested = iteration
        self._thread = threading.Thread(target=self._copy, args=(iteration, fetch),
                                        name="ftmaster-persist", daemon=True)
        self._thread.start()
        return True

    def _copy(self, iteration: int, fetch: Fetch | None) -> None:
        try:
            self._results.put(persist(self.memory_dir, self.save_dir, iteration, fetch))
            self._failures, self._retry = 0, None
        except Exception as error:  # a copier that dies must still say why
            self._failed(iteration, error if isinstance(error, PersistError) else PersistError(
                f"{type(error).__name__}: {error}"))
        finally:
            unpin(self.memory_dir)

    def _failed(self, iteration: int, failure: PersistError) -> None:
        """Report ``failure``; the copy is tried again after a wait, unless superseded."""
        if not isinstance(failure, PersistSuperseded):  # that one cannot come back
            self.last_requested = None  # try again (at the end of the run at the latest)
            self._failures += 1
            wait = min(RETRY_WAIT_S[1], RETRY_WAIT_S[0] * 2 ** (self._failures - 1))
            now = time.monotonic()
            self._retry = (iteration, now + RETRY_WAIT_S[0], now + wait)
        self._results.put(failure)

    def wait(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def take_results(self) -> list[Persisted | PersistError | None]:
        results = []
        while True:
            try:
                results.append(self._results.get_nowait())
            except queue.Empty:
                return results
