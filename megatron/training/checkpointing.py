"""Distributed checkpoints in Megatron's torch_dist layout, reloadable under any TP/PP/DP.

A checkpoint holds the model and optimizer as sharded tensors (resharded on load by
``dist_checkpointing``), and in ``common.pt`` what Megatron-LM's ``load_checkpoint`` reads:
``args`` as an ``argparse.Namespace`` with Megatron-LM's attribute names (the consumed samples
in ``args.consumed_train_samples``), ``iteration``, ``checkpoint_version`` 3.0,
``opt_param_scheduler``, ``num_floating_point_operations_so_far``, and ``content_metadata``
(how the optimizer state is sharded). The model is ``model``, or ``model0``, ``model1``... with
virtual pipeline stages, as Megatron-LM names them. RNG states are a list per (PP, TP) rank;
they are restored only when the layout is unchanged, because a new layout has different ranks
and a stale stream would be wrong. Checkpoints written before (``args`` a dict, consumed
samples at the top level, RNG state a dict) still load.

**Saving never kills training.** A save follows ``dist_checkpointing.save`` step by step
(preprocess, ``common.pt`` on rank 0, the sharded async request, ``metadata.json``) so that
no step raises on one rank while the others wait in a collective: each rank records its own
problem, every rank goes through the same collectives, and one agreement at the end decides.
When every rank succeeded, rank 0 writes the manifest (``ftmaster_save.json``: a checksum
per file, each taken as its bytes were written, see :mod:`checksums`) and then moves the
tracker ``latest_checkpointed_iteration.txt``; otherwise the partial folder is removed and
the failure is reported (``save_failed``) while training goes on. For an async save the same
happens in the finalize step, which megatron-core runs once every rank's writer is done.

**Loading falls back.** Candidates come newest first (an unreadable tracker means every
``iter_*`` folder is one). Each is checked for structure (rank 0, a few ``stat`` calls), then
for checksums (the files spread over the ranks), then loaded; a candidate that fails any of
these on any rank is skipped by all ranks, with one line and a ``checkpoint_skipped`` event,
and the next older one is tried. When none can be loaded, the run stops and nothing on disk
is touched. Checkpoints above the one loaded are a discarded timeline: they are moved aside
before any new save could mix with them.

The agreements run on a gloo group of their own (CPU tensors, never a GPU stream).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import multiprocessing
import os
import queue
import random
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Callable

import numpy
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.core import CheckpointingConfig
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import (
    _CONTENT_METADATA_KEY,
    get_default_load_sharded_strategy,
)
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
from megatron.core.dist_checkpointing.validation import (
    determine_global_metadata,
    validate_sharding_integrity,
)
from torch.distributed.checkpoint.api import CheckpointException

from ftmaster import runfiles
from ftmaster.guard import exit_with_parent
from ftmaster.peer_files import PeerError, PeerMissing, peer_clients
from ftmaster.persist import CHECKPOINT_BYTES_PER_PARAMETER
from ftmaster.recovery import memory_room
from ftmaster.recovery.checkpoints import (
    MEMORY_HEADROOM,
    COMMON_FILE,
    CONFIG_FILE,
    DCP_METADATA_FILE,
    advance_tracker,
    advance_tracker_locked,
    checkpoint_problem,
    folder_written_at,
    holds_checkpoints,
    iteration_dir,
    list_iterations,
    left_by_a_killed_save,
    prunable_emergency_checkpoints,
    prunable_memory_checkpoints,
    read_tracker,
    remove_checkpoint_folder,
    same_folder,
    tier_candidates,
    tracker_lock,
    tracker_path,
    unfinished_saves,
)
from ftmaster.recovery.manifest import (
    FileDigest,
    Manifest,
    digest_bytes,
    digest_problem,
    read_manifest,
    write_manifest,
)
from ftmaster.runfiles import atomic_write_bytes, atomic_write_text

from . import checksums, conversions, optimizer_from_distributed, startup
from .async_saves import AsyncSaves
from .console import error_line, local_rank, log_rank0
from .conversions import ConversionCache
from .dcp_metadata import MetadataBytes
from .kept_writes import KeptWritesStrategy
from .memory_slots import IN_PLACE_FILE_SYSTEMS, MemorySlots
from .records import DiskRecords
from .model import optimizer_metadata
from .save_structure import SaveStructure
from .timers import seconds_into

CHECKPOINT_VERSION = 3.0
_LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
# An OSError's str(): its file names as repr() quotes them, the second one a rename's target.
_QUOTED = r"""('[^'\n]*'|"[^"\n]*")"""
_OS_ERROR = re.compile(
    rf"\[Errno (\d+)\] ([^\n'\"]+?)(?:: {_QUOTED}(?: -> {_QUOTED})?)?(?:$|\n|['\"])")
# torch's load_state_dict catches what its reader's read_metadata raised and fails with an
# AssertionError holding only the text of it (state_dict_loader.py, local_step).
_READ_METADATA_FAILED = re.compile(
    r"metadata is None; global metadata read failed: (.*?)(?:; rank local metadata read failed: .*)?",
    re.DOTALL)

# torch's CheckpointException (a write or read failure gathered from any rank) derives from
# BaseException, not Exception.
CHECKPOINT_ERRORS = (Exception, CheckpointException)

EventSink = Callable[..., None]
"""``event(name, **fields)``: appends to the run's events (rank 0 only; may be a no-op)."""


def layout_of(args: argparse.Namespace) -> dict[str, int]:
    return {key: getattr(args, key) for key in _LAYOUT_KEYS}


def _failure_behind(error: BaseException) -> BaseException:
    """The error a rank's read or write failed with, inside torch's CheckpointException (the
    lowest failed rank's: every rank is handed them all)."""
    while isinstance(error, CheckpointException) and error.failures:
        error = error.failures[min(error.failures)][0]
    return error


def describe_error(error: BaseException) -> str:
    """One line for a failed read or write; an OS error by its errno name, e.g.
    ``ENOSPC (No space left on device)``, wherever in the exception it is buried (writer
    failures reach rank 0 as text inside a CheckpointException)."""
    error = _failure_behind(error)
    if isinstance(error, (checksums.ChecksumMismatch, PeerError)):  # each names its file
        return str(error)
    if isinstance(error, OSError) and error.errno is not None:
        return _os_error_line(error.errno, error.strerror or os.strerror(error.errno),
                              error.filename, error.filename2)
    wrapped = _READ_METADATA_FAILED.fullmatch(str(error))
    text = wrapped.group(1) if wrapped else f"{type(error).__name__}: {error}"
    found = _OS_ERROR.search(text)
    if found:
        names = (quoted and quoted[1:-1] for quoted in found.group(3, 4))
        return _os_error_line(int(found.group(1)), found.group(2).strip(), *names)
    return text.strip().splitlines()[0][:300]


def _os_error_line(number: int, message: str, filename=None, filename2=None) -> str:
    """``ENOENT (No such file or directory) on a -> b``: the file, or both of a rename's."""
    name = errno.errorcode.get(number, f"errno {number}")
    files = " -> ".join(str(each) for each in (filename, filename2) if each is not None)
    return f"{name} ({message})" + (f" on {files}" if files else "")


def _bytes_read_by_this_process() -> int:
    """``rchar`` of /proc/self/io: every byte read(2) returned, from the medium or the cache."""
    try:
        with open("/proc/self/io") as counters:
            return next(int(line.split()[1]) for line in counters if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return 0


def clean_content_metadata(common: dict) -> None:
    """What megatron-core's validated save_preprocess does to common.pt's content metadata;
    a save that skips the validation must do it too."""
    if _CONTENT_METADATA_KEY in common:
        common[_CONTENT_METADATA_KEY] = _clean_metadata_for_serialization(common[_CONTENT_METADATA_KEY])


# ---- agreement on the control group ---------------------------------------------------------
def _rank() -> int:
    return torch.distributed.get_rank()


def memory_folder_owner(memory_dir: Path | None, group) -> tuple[int | None, set[int] | None]:
    """The rank that makes, renames, prunes and sets aside this rank's memory folders, and,
    when the tier is node-local, the ranks that write into this rank's folder (else None).
    When every rank names one folder (one every node sees), rank 0 does it all. When nodes
    name folders of their own (each node's ``/dev/shm``), the lowest rank naming this rank's
    folder does it there; rank 0 still writes the manifest and the tracker, in its folder
    only: another node's folder is made whole by ftmaster's peer copies
    (:mod:`ftmaster.peer_files`)."""
    if memory_dir is None:
        return None, None
    folders = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(folders, str(memory_dir), group=group)
    writers = {rank for rank, folder in enumerate(folders) if folder == str(memory_dir)}
    return folders.index(str(memory_dir)), writers if len(set(folders)) > 1 else None


def broadcast_from_rank0(value, group):
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0, group=group)
    return box[0]


def first_problem(problem: str | None, group) -> str | None:
    """Every rank's problem (None: fine) in; the lowest rank's problem out, on every rank."""
    every = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(every, problem, group=group)
    return next((p for p in every if p is not None), None)


# ---- RNG ------------------------------------------------------------------------------------
def _rng_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def rng_state() -> dict:
    """Every RNG stream training draws from, as Megatron-LM's ``get_rng_state`` keeps them."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": numpy.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
        # On CPU the tracker's streams are CPU generator states (cpu_compat); a CUDA
        # generator cannot take them, so they are restored on the same kind of device only.
        "rng_device": _rng_device(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def _rng_sharded_object(state: dict | None = None) -> ShardedObject:
    """Megatron-LM's ``get_rng_state``: a list with this rank's state (one per DP rank only
    with ``--data-parallel-random-init``), sharded over (PP, TP); the streams as they are now
    unless ``state`` gives them."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return ShardedObject(
        "rng_state", [state or rng_state()],
        (parallel_state.get_pipeline_model_parallel_world_size(),
         parallel_state.get_tensor_model_parallel_world_size()),
        (pp_rank, tp_rank), replica_id=parallel_state.get_data_parallel_rank())


def _restore_rng(saved: list | dict) -> None:
    """The saved streams; the device's own ones only when saved on the same kind of device
    (checkpoints from before the field was written were all made on CPU). Older checkpoints
    hold the state itself rather than a list of one."""
    state = saved[0] if isinstance(saved, list) else saved
    random.setstate(state["random_rng_state"])
    numpy.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("rng_device", "cpu") != _rng_device():
        log_rank0(f"device RNG streams not restored: saved on {state.get('rng_device', 'cpu')}, "
                  f"resumed on {_rng_device()}")
        return
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


_writers_manager: SyncManager | None = None
"""The server of the writer processes' result queues (:func:`start_writer_results_queue`)."""


def start_writer_results_queue() -> None:
    """Start torch_dist's writer result queue now, in a server that dies with this rank.

    megatron-core creates the queue lazily through a spawn-context Manager: a fresh interpreter
    that imports torch's checkpoint classes only when it first unpickles a write result. Both
    would otherwise land in the first, possibly emergency, save (seconds to tens of seconds on
    a busy host), so a round trip of a real ``WriteResult`` pays them at start-up instead.

    Its Manager server also outlives a rank killed by a signal (about 270 MB each, and a lost
    rank is exactly what ftmaster recovers from), so ours asks to exit when its rank dies.
    It holds nothing of a rank, so a warm worker starts it before it is given one
    (``ftmaster.warm.WARM_UP``).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    global _writers_manager
    if filesystem_async._results_queue is not None:
        return
    _writers_manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    _writers_manager.start(initializer=exit_with_parent, initargs=(os.getpid(),))
    queue = _writers_manager.Queue()
    queue.put({0: [WriteResult(MetadataIndex("warm-up"), 0, _StorageInfo("warm-up", 0, 0))]})
    queue.get()
    filesystem_async._results_queue = queue


def results_queue_of_one_save(in_rank: bool):
    """A save's own queue for its write results.

    megatron-core hands every save its one module-wide queue, and a save's finalize takes the
    first result in it. With ``--async-save`` an asynchronous disk save's writers put their
    results there whenever they end, which may be during a memory save or before an earlier
    save is finalized: that save would take the other's results, and both checkpoints'
    ``.metadata`` would describe the other's files. A save written in the rank needs no
    process to share its queue with. A Manager server that died (the OOM killer: it is a
    process of its own) is started again, once: else every later async save failed."""
    if in_rank or _writers_manager is None:
        return queue.SimpleQueue()
    try:
        return _writers_manager.Queue()
    except (OSError, EOFError) as error:
        rank = os.environ.get("RANK", "0")
        error_line(f"warning: rank {rank}: the async writers' result server is gone "
                   f"({describe_error(error)}); starting it again")
        _restart_writer_results_queue()
        return _writers_manager.Queue()


def _restart_writer_results_queue() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _writers_manager
    try:
        _writers_manager.shutdown()
    except (OSError, EOFError, AttributeError):
        pass  # gone already
    _writers_manager = filesystem_async._results_queue = None
    start_writer_results_queue()


def use_in_rank_results_queue() -> None:
    """Without ``--async-save`` every save writes in the rank (:mod:`records`,
    :mod:`memory_slots`), so its write results need no queue shared with other processes:
    no Manager server to spawn (measured: 3.3 s of a 4-rank start on 2 cores, the data setup
    phase 3.8 s against 0.4 s) and no round trip through one at every save. A warm worker's
    queue, started before it knew the flags, is kept."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.SimpleQueue()


class Janitor:
    """A background thread, in order, for file work that must not block training: removing
    a failed save's folder, pruning superseded emergency checkpoints (a deletion or a scan
    of the save folder can take seconds on a parallel file system)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._removals: dict[Path, threading.Event] = {}
        """Failed saves' folders queued for removal (training thread only)."""

    def submit(self, job: Callable, *args) -> threading.Event:
        """Queue ``job(*args)``; the event is set once it has run."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="checkpoint-janitor",
                                            daemon=True)
            self._thread.start()
        done = threading.Event()
        self._jobs.put((job, args, done))
        return done

    def remove_failed_save(self, folder: Path, iteration: int) -> None:
        self._removals = {path: done for path, done in self._removals.items() if not done.is_set()}
        self._removals[folder] = self.submit(_remove_unless_tracked, folder, iteration)

    def wait_for_removal(self, folder: Path) -> None:
        """Before a save makes ``folder`` again (one at the same iteration, as the
        --exit-interval save after a failed periodic one): the removal would otherwise take
        the new checkpoint's files, after its tracker moved or while it writes them."""
        removal = self._removals.pop(folder, None)
        if removal is not None:
            removal.wait()

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, args, done = item
            try:
                job(*args)
            except Exception as error:  # a failed clean-up must not end training
                log_rank0(f"warning: {getattr(job, '__name__', job)} failed: {describe_error(error)}")
            finally:
                done.set()

    def finish(self, timeout_s: float = 300.0) -> None:
        """Let the queued work finish (at the end of training)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout_s)
            self._thread = None


def prune_memory_checkpoints(memory_dir: Path, newest: int, slots: set[int],
                             superseded_below: int | None = None) -> None:
    """Keep the newest complete memory checkpoint, the tracked one, the one a persist copy
    reads and the other slot's (the tier holds at most two, and one being written: a pinned
    slot is not refilled); remove the rest, and what a resume set aside (node memory is scarce:
    the disk tier keeps its discarded timelines). With ``superseded_below`` (the run's newest
    disk checkpoint) the tracked one goes too when older, and the tracker with it: a full
    tier's saves went to disk, and the tier kept its last checkpoint, which no load would
    take first, while every later memory save failed for want of its room."""
    with tracker_lock(memory_dir):  # as pin() marks: never between its check and its mark
        doomed = [iteration_dir(memory_dir, it) for it in prunable_memory_checkpoints(
            memory_dir, newest, slots, superseded_below)]
        for folder in doomed:
            remove_checkpoint_folder(folder)
        for folder in Path(memory_dir).glob("iter_*.discarded-*"):
            shutil.rmtree(folder, ignore_errors=True)
        tracked = read_tracker(memory_dir)
        if tracked is not None and iteration_dir(memory_dir, tracked) in doomed:
            tracker_path(memory_dir).unlink(missing_ok=True)


def prune_emergency_checkpoints(save_dir: Path, keep: int) -> None:
    """Remove emergency checkpoints a newer regular one supersedes, beyond the newest ``keep``."""
    for iteration in prunable_emergency_checkpoints(save_dir, keep):
        if _remove_unless_tracked(iteration_dir(save_dir, iteration), iteration):
            log_rank0(f"pruned emergency checkpoint iter_{iteration:07d}: a newer regular "
                      f"checkpoint supersedes it (--keep-emergency {keep})")


class CheckpointMismatch(Exception):
    """The checkpoint cannot continue under these arguments; the message says what to pass."""


MODEL_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size",
               "num_attention_heads": "--num-attention-heads", "ffn_hidden_size": "--ffn-hidden-size",
               "swiglu": "--swiglu", "normalization": "--normalization",
               "position_embedding_type": "--position-embedding-type",
               "add_bias_linear": "--disable-bias-linear",
               "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights"}
"""The arguments that shape the model, by the flag that sets each. A checkpoint of another
shape whose tensors happen to fit (4 heads read as 2, the same QKV weight cut otherwise;
learned positions and biases dropped under RoPE and --disable-bias-linear) loaded silently;
one that does not fit failed as a damaged checkpoint. Megatron-LM's check_checkpoint_args
refuses such resumes too."""


def _check_model(saved: dict, args) -> None:
    """CheckpointMismatch naming the first argument that shapes the model otherwise than
    the checkpoint's (those it saved: an older or foreign checkpoint may lack some)."""
    for name, flag in MODEL_FLAGS.items():
        if name in saved and saved[name] is not None and getattr(args, name, None) is not None \
                and saved[name] != getattr(args, name):
            raise CheckpointMismatch(
                f"the checkpoint's model has {name} {saved[name]!r} where the arguments give "
                f"{getattr(args, name)!r} ({flag}): resume with the checkpoint's model, or "
                f"start a new run from its weights")
    saved_groups, groups = _query_groups(saved), _query_groups(vars(args))
    if None not in (saved_groups, groups) and saved_groups != groups:
        raise CheckpointMismatch(
            f"the checkpoint's model has {saved_groups} query groups where the arguments give "
            f"{groups} (--group-query-attention, --num-query-groups): resume with the "
            f"checkpoint's model, or start a new run from its weights")


def _query_groups(values: dict) -> int | None:
    """The attention's key-value groups: --num-query-groups under --group-query-attention,
    else one per head."""
    if values.get("group_query_attention"):
        return values.get("num_query_groups")
    return values.get("num_attention_heads")


class NoLoadableCheckpoint(Exception):
    """The load folder holds checkpoints and none of them can be loaded; nothing was touched."""


class PeerReadFailed(Exception):
    """A peer failed or stalled while the shards a node lacks of a node-local memory
    checkpoint were read from it: nothing is known against the checkpoint, so the attempt
    ends rather than resume an older one, which would set this one aside on every node."""


class PeerReadProblem(str):
    """A load's problem that is the peers', not its checkpoint's (see :class:`PeerReadFailed`).
    A str, so that :func:`first_problem` hands it to every rank as it is."""


def load_problem(error: BaseException) -> str:
    """:func:`describe_error`'s line for a failed load; a PeerReadProblem when a peer failed
    to give bytes, unless every peer asked answered it lacks the file (PeerMissing: the
    checkpoint is not whole on the live nodes). A checksum mismatch is the checkpoint's."""
    behind = _failure_behind(error)
    peers_failed = isinstance(behind, PeerError) and not isinstance(behind, PeerMissing)
    return (PeerReadProblem if peers_failed else str)(describe_error(behind))


def schedule_differences(saved: dict, current: dict) -> list[str]:
    """The LR/WD schedule settings in which a checkpoint and the arguments differ (the step
    count is progress, not a setting)."""
    return [f"{key} {saved[key]} in the checkpoint, {value} now" for key, value in current.items()
            if key != "num_steps" and key in saved and saved[key] != value]


@dataclass
class TrainingState:
    """What the loop needs to continue where a checkpoint left off."""

    iteration: int = 0
    consumed_train_samples: int = 0


class OwnStates:
    """The checkpoints that hold this run's state at its current iteration: the one it loaded
    and those it saved since, by folder and checksummed files. A complete checkpoint found
    where a disk save of that iteration goes is this state only when it is one of them, or
    has the same files (the supervisor's persisted copy of a memory one); else it is another
    run's (``--save`` other than ``--load``), whose weights a later resume would load."""

    def __init__(self) -> None:
        self.iteration: int | None = None
        self._folders: set[Path] = set()
        self._files: list[dict[str, FileDigest]] = []

    def add(self, iteration: int, folder: Path, files: dict[str, FileDigest]) -> None:
        if iteration != self.iteration:
            self.iteration, self._folders, self._files = iteration, set(), []
        self._folders.add(Path(folder).resolve())
        if files:  # a checkpoint written before checksums is told by its folder alone
            self._files.append(dict(files))

    def holds(self, iteration: int, folder: Path, manifest: Manifest) -> bool:
        return iteration == self.iteration and (
            Path(folder).resolve() in self._folders
            or bool(manifest.files) and dict(manifest.files) in self._files)


@dataclass(frozen=True)
class DurableSave:
    """A checkpoint whose files are all on disk and which the tracker now names."""

    iteration: int
    path: Path
    kind: str  # periodic, emergency, exit or final: see manifest.SAVE_KINDS
    tier: str  # memory or disk
    started_at: float  # unix time the save began
    seconds_to_durable: float
    bytes: int
    hash_seconds: float  # summed over the ranks' writers
    write_seconds: float  # the same writers' time from open to close, summed
    phases: dict[str, float]
    """Rank 0's wall time in each step of the save (see :class:`_Save`)."""
    writer_phases: dict[str, float]
    """The writers' time by kind (:meth:`checksums.ShardDigest.phases`), summed over writers."""
    structure_kept: bool
    """Whether the save kept the previous save's strategy (see :mod:`save_structure`)."""
    slot: str | None = None
    """A memory save's: ``refilled`` (a slot's files written in place) or ``new`` (set up)."""
    waited_for_ranks: float = 0.0
    """How much sooner rank 0 entered the save than the last rank (a slower pipeline stage
    still finishing its step): part of rank 0's blocked time, but not the save's own cost,
    since without the save rank 0 would wait for that stage in the next step anyway."""
    already_on_disk: bool = False
    """Nothing written: the folder already held a complete checkpoint of this iteration
    (:meth:`_Save._made_unless_complete`)."""


@dataclass(frozen=True)
class SaveFailure:
    """A save that did not complete: the previous checkpoint stays the newest."""

    iteration: int
    path: Path
    kind: str
    tier: str
    reason: str


@dataclass(frozen=True)
class _RankReport:
    """What one rank sends to rank 0 when a save ends."""

    problem: str | None
    shards: dict[str, checksums.ShardDigest]
    elapsed: float
    """The rank's seconds in the save so far. Every rank reports right after the same
    collective, so the ranks' differences are their differences in entering the save."""
    write_results: list | str | None = None
    """torch's results of this rank's writes, from which rank 0 writes ``.metadata``, or
    :data:`_UNCHANGED`."""


_UNCHANGED = "the same write results as at the last save"


class _WriteResultsRelay:
    """Each rank's write results on their way to rank 0, sent only when they changed.

    With a kept structure they are the same at every save (the same files, items, offsets
    and sizes), and pickling some 170 of them per rank for the agreement's gather, then
    unpickling every rank's on rank 0, was most of that gather: 8-9 ms of a 77 MB memory save
    before, 4-5 ms after (``benchmarks/save_profile.py``, with the waits). Every rank sends
    at every agreement and rank 0 receives at every one, so what a rank last sent is what
    rank 0 last received from it."""

    def __init__(self) -> None:
        self._sent: list | None = None
        self._received: dict[int, list] = {}

    def outgoing(self, results: list | None) -> list | str | None:
        if results is None:
            return None
        if results == self._sent:
            return _UNCHANGED
        self._sent = results
        return results

    def incoming(self, reports: list[_RankReport]) -> list[_RankReport]:
        """Rank 0: the reports with every rank's results in full."""
        for rank, report in enumerate(reports):
            if report.write_results == _UNCHANGED:
                reports[rank] = replace(report, write_results=self._received[rank])
            elif report.write_results is not None:
                self._received[rank] = report.write_results
        return reports


@contextlib.contextmanager
def _finalize_deferred_to(save: "_Save"):
    """Within it, megatron-core's torch_dist finalize only hands its writer, plan and results
    to ``save``: the gather of every rank's results to rank 0, which then writes
    ``.metadata``, travels with the agreement (:meth:`_Save.commit`), which gathers to rank 0
    anyway. That saves megatron-core's gather and its broadcast of failures (2-3 ms of a
    45 ms memory save at 77 MB, measured), and a ``.metadata`` that cannot be written is one
    more problem the agreement reports: in megatron-core's finalize it raised on rank 0 alone,
    before the broadcast the other ranks waited in, and the ranks' collectives parted ways.
    The finalize closure looks the function up in its module, so that name is the one seam."""
    original = torch_strategy.save_state_dict_async_finalize
    torch_strategy.save_state_dict_async_finalize = save.keep_write_results
    try:
        yield
    finally:
        torch_strategy.save_state_dict_async_finalize = original


def _write_durably(path: Path, data: bytes | memoryview) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _run_in_rank(request) -> None:
    """megatron-core's ``AsyncRequest.execute_sync`` without its barrier between the writes
    and the finalize steps: the first of those gathers every rank's write results, so it
    waits for every rank's writes anyway (the barrier was one more round trip per save)."""
    if request.async_fn is not None:
        request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
    for finalize in request.finalize_fns:
        finalize()


class _TimedParallelSave(FullyParallelSaveStrategyWrapper):
    """megatron-core's fully parallel save, timing its exchange of shard metadata, with the
    shards' conversions to torch's kept for as long as the strategy (:mod:`conversions`).

    With a data-parallel group of one there is nothing to distribute, and megatron-core's
    cached distribution stays None, so it would validate the sharding again at every save
    (an all-gather of every shard's metadata: 5-13 ms of a 40 ms memory save, measured);
    ``_Save`` validates it whenever the structure is new, so here it is skipped."""

    distribution_seconds = 0.0
    """The last save's."""

    def __init__(self, *args, conversion_cache: ConversionCache | None = None, **kwargs) -> None:
        """``conversion_cache``: the one the base strategy reads too, if it does."""
        super().__init__(*args, **kwargs)
        self.conversions = conversion_cache or ConversionCache()

    def async_save(self, sharded_state_dict, checkpoint_dir, in_rank: bool = False):
        """``in_rank``: the request is written in the rank, so the last full plan's buckets
        may be written again (:mod:`kept_writes`)."""
        self.base_strategy.writes_in_rank = in_rank
        with self.conversions.active():
            return super().async_save(sharded_state_dict, checkpoint_dir)

    def apply_saving_parallelization(self, sharded_state_dict) -> None:
        start = time.perf_counter()
        try:
            if torch.distributed.get_world_size(self.parallelization_group) > 1:
                super().apply_saving_parallelization(sharded_state_dict)
        finally:
            self.distribution_seconds = time.perf_counter() - start


class _Save:
    """One checkpoint being written; see the module docstring for the protocol.

    ``phases`` times each step on this rank: ``state-dict`` (the sharded state dict),
    ``preprocess`` (megatron-core's save_preprocess, and common.pt on rank 0),
    ``metadata-exchange`` (the fully parallel wrapper's exchange of shard metadata, which
    decides who writes each replicated shard), ``planning`` (megatron-core's conversion of the
    shards to torch's, reused while the structure is kept: :mod:`conversions`; torch DCP's
    local and global plans, their exchange included, and the write buckets), ``write`` (a
    synchronous save's writing, in the rank: :mod:`records` and :mod:`memory_slots`), ``finalize``
    (megatron-core's, on every rank: the write results collected; on rank 0 also
    ``.metadata``, written from every rank's results), ``agreement`` (every rank's outcome
    and write results to rank 0) and ``manifest-and-tracker``.

    Synchronous saves (every memory save, and disk saves without ``--async-save``) write in
    the rank from the tensors' own memory; asynchronous disk saves go through torch_dist's
    writer processes, forked from the rank, whose snapshot lets training go on."""

    def __init__(self, checkpointer: "Checkpointer", iteration: int, kind: str, tier: str,
                 on_durable: Callable[[DurableSave], None] | None,
                 on_failed: Callable[[SaveFailure], None] | None = None) -> None:
        self.checkpointer = checkpointer
        self.group = checkpointer.group
        self.iteration, self.kind, self.tier = iteration, kind, tier
        self.on_durable, self.on_failed = on_durable, on_failed
        """This save's own callbacks: an async save failing as the next one starts (which
        finalizes it first) must not end the next one."""
        self.path = iteration_dir(checkpointer.folder_of(tier), iteration)
        self.started_at, self.start = time.time(), time.perf_counter()
        self.problem: str | None = None
        self.own_shards: list[str] = []
        self.small_files: dict[str, FileDigest] = {}  # written by rank 0 from memory
        self.phases: dict[str, float] = {}
        self.planned_at = self.start
        self.structure_kept = False
        self.strategy: _TimedParallelSave | None = None
        self.slot: str | None = None
        self.write_results: list | None = None
        self.results_queue = None
        """Where this save's writers put their results (:func:`results_queue_of_one_save`)."""
        self.global_metadata = None
        """megatron-core's global metadata, from which rank 0 writes ``.metadata``."""
        self.found_bytes: int | None = None
        """The size of the complete checkpoint of this iteration found on disk, left as it is."""
        self.folder_made = tier == "memory"
        """Rank 0, a disk save: whether this save made its folder (or took what a killed save
        of ours left), and so may remove it on failure: not another tool's, never set aside."""
        self.slots = checkpointer.slots if tier == "memory" else None
        self.synchronous = checkpointer.async_saves is None or self.slots is not None
        self.records = self.slots if self.slots is not None else (
            checkpointer.disk_records if self.synchronous else None)
        """Writes the shards in the rank (None: torch_dist's writer processes do)."""

    def timed(self, phase: str):
        return seconds_into(self.phases, phase)

    def note(self, what: str, error: BaseException) -> None:
        if self.problem is None:
            self.problem = f"{what}: {describe_error(error)}"

    # -- preparation (all ranks, in the training thread) --
    def request(self, sharded_state_dict: dict):
        """The async request that writes the shards, with our finalize steps; None if even
        the folder could not be made (already reported)."""
        with self.timed("preprocess"):
            sharded_part, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
            clean_content_metadata(common)
            strategy, self.structure_kept = self.checkpointer.structure.strategy_for(sharded_part)
            self.strategy = strategy
            if not self.structure_kept:
                validate_sharding_integrity(determine_global_metadata(sharded_part)[1],
                                            common_state_dict=common)
            if not self._folder_made():
                self.commit()
                return None
            if _rank() == 0:
                self._write_common(common)
        with self.timed("planning"):
            request = strategy.async_save(sharded_part, self.path, in_rank=self.records is not None)
        self.phases["metadata-exchange"] = strategy.distribution_seconds
        self.phases["planning"] -= strategy.distribution_seconds
        self.planned_at = time.perf_counter()
        return self._with_digests(request)._replace(
            finalize_fns=[*(partial(self._guarded, fn) for fn in request.finalize_fns),
                          partial(self._write_config, strategy), self.commit])

    def _with_digests(self, request):
        """The request writing through torch_dist's writer processes with our digests, or in
        the rank from the tensors' own memory (:mod:`records`)."""
        if request.async_fn is None:  # nothing for this rank to write
            return request
        rank, buckets, _ = request.async_fn_args
        try:
            self.results_queue = results_queue_of_one_save(in_rank=self.records is not None)
        except (OSError, EOFError) as error:  # the writers' result server is gone
            self.note("making the save's results queue", error)  # the agreement fails it
            self.results_queue = queue.SimpleQueue()
        args = [rank, buckets, self.results_queue]
        if self.records is None:
            self.own_shards = [name for _, name, _ in buckets]
            write = partial(checksums.write_with_digests, request.async_fn, self.iteration)
            return request._replace(async_fn=write, async_fn_args=args)
        self.own_shards = self.records.files(rank, buckets)
        # The writer reads each tensor where it is (device memory included): no staging.
        return request._replace(async_fn=partial(self.records.write, self.path, self.iteration),
                                async_fn_args=args, preload_fn=None)

    def _folder_made(self) -> bool:
        """The save's folder, made (or a slot's renamed to it) by rank 0, on every rank; in a
        node-local memory tier by each node's owner, every owner's problem told to all. False
        too when a complete checkpoint of this iteration is on disk already: nothing to write."""
        previous = self.records.begin(self.structure_kept) if self.records is not None else None
        owner = self.checkpointer.memory_owner if self.tier == "memory" else 0
        made = self._make_folder(previous) if _rank() == owner else None
        if self.tier == "memory" and self.checkpointer.node_local_memory:
            every = [None] * torch.distributed.get_world_size(self.group)
            torch.distributed.all_gather_object(every, made, group=self.group)
            self.problem = next((m[0] for m in every if m is not None and m[0]), None)
            refilled = every[owner][1]
        else:
            self.problem, refilled, self.found_bytes = broadcast_from_rank0(made, self.group)
        if self.slots is not None:
            self.slots.use(refilled)
            self.slot = "refilled" if refilled else "new"
        return self.problem is None and self.found_bytes is None

    def _make_folder(self, previous: int | None) -> tuple[str | None, bool, int | None]:
        """Rank 0: the problem, if any, whether a slot's files are refilled, and the size of
        a complete checkpoint of this iteration already on disk. Never raises an OSError: the
        other ranks wait for this answer in a collective."""
        try:
            self.checkpointer.janitor.wait_for_removal(self.path)
            if self.tier == "disk":
                return None, False, self._made_unless_complete()
            if self.slots.claim(previous, self.path):
                return None, True, None
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            return f"creating {self.path}: {describe_error(error)}", False, None
        try:
            return self._room_problem(), False, None
        except OSError as error:  # a tmpfs gone or unreadable under the pruning
            return f"making room in {self.path.parent}: {describe_error(error)}", False, None

    def _made_unless_complete(self) -> int | None:
        """Rank 0, a disk save: None once its folder is made; or, when the folder already
        holds a complete checkpoint of this iteration (a memory checkpoint the supervisor
        persisted, or the one resumed from), its size, with the tracker moved to it as the
        save would have. Written over in place, a save that failed partway (killed, a full
        disk) tore the only good copy while the tracker named it. Under the tracker lock,
        which a persist copy lands under: it cannot land between the look and the mkdir."""
        with tracker_lock(self.path.parent):
            found = read_manifest(self.path) if checkpoint_problem(self.path) is None else None
            if found is not None and self.checkpointer.own_states.holds(
                    self.iteration, self.path, found):
                advance_tracker_locked(self.path.parent, self.iteration)
                return found.total_bytes
            if found is not None:
                self._set_aside(f"it holds another state of iteration {self.iteration} than this "
                                f"run's (not the checkpoint it loaded or saved there), set aside "
                                f"for this run's save")
            elif self.path.exists() and left_by_a_killed_save(self.path) is None:
                # Written into, another tool's files (Megatron-LM's legacy folders, a torch_dist
                # checkpoint without our manifest) were overwritten, and a failed save's
                # clean-up removed them all
                self._set_aside("it holds no complete checkpoint of ftmaster's (another tool's "
                                "files, or a damaged checkpoint), set aside for this run's save")
            self.path.mkdir(parents=True, exist_ok=True)
            self.folder_made = True
            return None

    def _set_aside(self, why: str) -> None:
        """What this save's folder holds, kept under another name, as a resume keeps a
        discarded timeline's, and this run's state written in its place."""
        moved_to = _removed_or_set_aside(self.path, why)
        self.checkpointer.event("checkpoint_set_aside", iteration=self.iteration,
                                path=str(self.path), moved_to=str(moved_to), reason=why)

    def _room_problem(self) -> str | None:
        """A memory save that would not fit is not even started (a full tmpfs also squeezes
        everything else in the node's memory); the size of the last checkpoint is the guess.
        Short of room, what the janitor would have pruned after the newest save goes first:
        a slot passed over while a persist copy read it is pruned only after a memory save
        succeeds, so without this every later save would fail for want of the room that
        checkpoint holds; so does a memory checkpoint older than the run's newest on disk,
        tracked or not (the saves that did not fit went there). The newest complete
        checkpoint (saved or loaded) always stays."""
        needed, newest = self.checkpointer.last_bytes, self.checkpointer.last_durable_iteration
        if not needed:
            return None
        free, note = memory_room.room(self.path)  # on tmpfs, the memory cgroup's room too
        if newest is not None and free < needed * MEMORY_HEADROOM:
            prune_memory_checkpoints(self.path.parent, newest, self.slots.kept_iterations(),
                                     self.checkpointer.newest_disk_iteration)
            free, note = memory_room.room(self.path)
        if free < needed * MEMORY_HEADROOM:
            return (f"the memory tier {self.path.parent} has {free} bytes free{note}, a "
                    f"checkpoint needs about {needed} and {MEMORY_HEADROOM - 1:.0%} more to spare")
        return None

    @staticmethod
    def _serialized(common: dict) -> memoryview:
        buffer = io.BytesIO()
        torch.save(common, buffer)
        return buffer.getbuffer()

    def _write_common(self, common: dict) -> None:
        """Rank 0: ``common.pt``. A state that does not pickle (or no memory to) fails the
        save at the agreement, on every rank: raised here, on rank 0 alone, it left the others
        waiting in the planning's collectives until the process-group timeout."""
        try:
            data = self._serialized(common)
        except CHECKPOINT_ERRORS as error:
            self.note(f"serialising {COMMON_FILE}", error)
            return
        self._write_small_file(COMMON_FILE, data)

    def _write_small_file(self, name: str, data: bytes | memoryview) -> None:
        try:
            _write_durably(self.path / name, data)
            self.small_files[name] = digest_bytes(data)
        except OSError as error:
            self.note(f"writing {name}", error)

    # -- finalization (all ranks, once every writer is done) --
    def _guarded(self, finalize: Callable[[], None]) -> None:
        if "write" not in self.phases and self.synchronous:
            # A synchronous save's writers ran between its planning and its first finalize.
            self.phases["write"] = time.perf_counter() - self.planned_at
        try:
            with self.timed("finalize"), _finalize_deferred_to(self):
                finalize()
        except CHECKPOINT_ERRORS as error:  # recorded; the agreement in commit() decides for all
            self.note("writing the shards", error)

    def keep_write_results(self, storage_writer, global_metadata, _dist_wrapper) -> None:
        """megatron-core's ``save_state_dict_async_finalize`` up to its gather: this rank's
        results, or its writers' error (which megatron-core wraps with its traceback). Its
        group wrapper is not needed: the agreement gathers on the save's own group."""
        if self.results_queue is not None:
            storage_writer.results_queue = self.results_queue
        results = storage_writer.retrieve_write_results()
        if isinstance(results, tuple):
            self.note("writing the shards", results[0])
        else:
            self.write_results = results
        self.global_metadata = global_metadata

    def _write_metadata(self, reports: list[_RankReport]) -> None:
        """Rank 0: ``.metadata`` from every rank's write results (:mod:`dcp_metadata`)."""
        if self.global_metadata is None:
            raise RuntimeError("megatron-core's finalize never ran on rank 0")
        with self.timed("finalize"):
            data = self.checkpointer.metadata_bytes.of(self.global_metadata,
                                                       [r.write_results for r in reports])
            atomic_write_bytes(self.path / DCP_METADATA_FILE, data)
        self.small_files[DCP_METADATA_FILE] = digest_bytes(data)

    def _write_config(self, strategy) -> None:
        if _rank() == 0:
            config = CheckpointingConfig(strategy.backend, strategy.version)
            self._write_small_file(CONFIG_FILE, json.dumps(asdict(config)).encode())

    def _own_report(self) -> _RankReport:
        shards = {}
        for name in self.own_shards:
            try:
                shards[name] = (self.records.digests[name] if self.records is not None
                                else checksums.take_shard_digest(self.path / name))
            except (OSError, ValueError, KeyError) as error:
                self.note(f"reading the digest of {name}", error)
        return _RankReport(self.problem, shards, time.perf_counter() - self.start,
                           self.checkpointer.write_results_relay.outgoing(self.write_results))

    def commit(self) -> None:
        """The agreement: rank 0 gathers every rank's outcome, commits or cleans up, and tells
        every rank, so that all of them count the same checkpoints."""
        report = self._own_report()
        reports = [None] * torch.distributed.get_world_size() if _rank() == 0 else None
        with self.timed("agreement"):
            torch.distributed.gather_object(report, reports, dst=0, group=self.group)
        outcome = (self._decide(self.checkpointer.write_results_relay.incoming(reports))
                   if _rank() == 0 else None)
        outcome = broadcast_from_rank0(outcome, self.group)
        self.checkpointer.saved(self, outcome)

    def _decide(self, reports: list[_RankReport]):
        """Rank 0: the durable save, or the failure's reason."""
        if self.found_bytes is not None:
            return self._left_as_found()
        problem = next((r.problem for r in reports if r.problem), None)
        if problem is None:
            try:
                self._write_metadata(reports)
            except CHECKPOINT_ERRORS as error:
                problem = f"writing {DCP_METADATA_FILE}: {describe_error(error)}"
        if problem is None:
            try:
                return self._write_manifest_and_tracker(reports)
            except OSError as error:
                problem = f"writing the manifest or the tracker: {describe_error(error)}"
        self.remove_partial_folder()
        return SaveFailure(self.iteration, self.path, self.kind, self.tier, problem)

    def _write_manifest_and_tracker(self, reports: list[_RankReport]) -> DurableSave:
        shards = {name: shard for r in reports for name, shard in r.shards.items()}
        with self.timed("manifest-and-tracker"):
            files = {**self.small_files, **{name: s.digest for name, s in shards.items()}}
            items = {name: shard.items for name, shard in shards.items() if shard.items}
            write_manifest(self.path, self.kind, self.iteration, files, items)
            self.checkpointer.own_states.add(self.iteration, self.path, files)
            # Never backwards: a persisted memory checkpoint may be newer than this one.
            advance_tracker(self.path.parent, self.iteration)
        writer_phases = {}
        for shard in shards.values():
            for phase, seconds in shard.phases().items():
                writer_phases[phase] = writer_phases.get(phase, 0.0) + seconds
        return DurableSave(self.iteration, self.path, self.kind, self.tier, self.started_at,
                           time.perf_counter() - self.start,
                           sum(d.bytes for d in files.values()),
                           sum(s.hash_seconds for s in shards.values()),
                           sum(s.write_seconds for s in shards.values()),
                           dict(self.phases), {**writer_phases, "writers": len(shards)},
                           self.structure_kept, self.slot,
                           max(0.0, reports[0].elapsed - min(r.elapsed for r in reports)))

    def _left_as_found(self) -> DurableSave:
        return DurableSave(self.iteration, self.path, self.kind, self.tier, self.started_at,
                           time.perf_counter() - self.start, self.found_bytes, 0.0, 0.0,
                           dict(self.phases), {}, self.structure_kept, already_on_disk=True)

    def remove_partial_folder(self) -> None:
        if not self.folder_made:  # another's folder that could not be set aside: kept whole
            return
        # In the janitor, the tracker read too: a failed save's file system may hang.
        self.checkpointer.janitor.remove_failed_save(self.path, self.iteration)


def _folder_written_at(save: _Save) -> float | None:
    """When a file of the save's folder (or the folder) last changed; None when unreadable
    (no write seen: a stuck save's file system must not keep it waiting)."""
    try:
        return folder_written_at(save.path)
    except OSError:
        return None


def _remove_unless_tracked(folder: Path, iteration: int) -> bool:
    """``folder``, of ``iteration``, removed unless the tracker names it; whether it was. The
    read and the removal in one hold of the tracker lock: a persist copy moves the tracker to
    a complete folder under it, and between the two could make this one current."""
    with tracker_lock(folder.parent):
        if read_tracker(folder.parent) == iteration:
            return False
        remove_checkpoint_folder(folder)
        return True


class Checkpointer:
    """Saves and loads checkpoints for one model chunk, its optimizer and its scheduler.

    ``group`` is the gloo group the agreements run on; ``event`` records run events (rank 0).
    """

    def __init__(self, args, model, optimizer, scheduler, group, event: EventSink) -> None:
        self.args = args
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.group = group
        self.event = event
        # On CUDA a persistent writer process: forking a rank with a CUDA context for every
        # save costs a device sync and a fork of its whole address space. On CPU a fork is
        # cheap, and a spawned worker would pay a fresh torch import at the first save.
        self.async_saves = (AsyncSaves(AsyncCallsQueue(persistent=torch.cuda.is_available()),
                                       group, args.async_save_timeout, self._abandoned,
                                       CHECKPOINT_BYTES_PER_PARAMETER * sum(
                                           p.numel() for module in model.modules
                                           for p in module.parameters()),
                                       runfiles.hang_timeout_from_env(),
                                       _folder_written_at if local_rank() == 0 else None)
                            if args.async_save else None)
        self.janitor = Janitor()
        self.memory_dir = (Path(args.non_persistent_global_ckpt_dir)
                           if args.non_persistent_ckpt_type == "global" else None)
        self.memory_owner, node_writers = memory_folder_owner(self.memory_dir, group)
        self.node_local_memory = node_writers is not None
        self.slots = (MemorySlots(self.memory_dir, node_writers)
                      if self.memory_dir is not None else None)
        if self.slots is not None and not self.slots.in_place:
            where = self.slots.file_system or "a file system of unknown type"
            log_rank0(f"memory tier {self.memory_dir}: on {where}, each save writes its files "
                      f"anew (refilled in place only on {', '.join(sorted(IN_PLACE_FILE_SYSTEMS))})")
        self.disk_records = DiskRecords()
        self.own_states = OwnStates()
        self.write_results_relay = _WriteResultsRelay()
        self.metadata_bytes = MetadataBytes()
        self.last_bytes: int | None = None
        """The size of the last complete checkpoint (a memory save's room check)."""
        self.last_saved_iteration: int | None = None
        self._last_saved_tier: str | None = None
        """The newest checkpoint, counting a save in flight (what the gap filter counts from)."""
        self.last_durable_iteration: int | None = None
        self.newest_disk_iteration: int | None = None
        """The newest complete checkpoint of this run's state in ``--save`` (saved or loaded)."""
        self.structure = SaveStructure(self._new_save_strategy, self.group,
                                       args.ckpt_assume_constant_structure,
                                       lambda: len(self.optimizer.state) > 0)
        if args.save:
            if args.async_save:
                start_writer_results_queue()
            else:
                use_in_rank_results_queue()
            checksums.install()
            conversions.install()

    # ---- saving -------------------------------------------------------------------------
    def _state_dict(self, state: TrainingState, is_loading: bool, with_rng: bool,
                    with_optimizer: bool = True, rng: dict | None = None,
                    from_distributed: bool = False) -> dict:
        metadata = optimizer_metadata(self.args)
        sharded = {**self.model.sharded_state_dict(metadata), "checkpoint_version": CHECKPOINT_VERSION}
        if with_optimizer and from_distributed:
            sharded.update(optimizer_from_distributed.template(self.optimizer, sharded))
        elif with_optimizer:
            # Not even built when not loaded: for loading it initialises the optimizer's
            # state, which a fresh Adam must not find half made (no "step").
            sharded["optimizer"] = self.optimizer.sharded_state_dict(
                sharded, is_loading=is_loading, metadata=metadata)
        if with_rng:
            sharded["rng_state"] = _rng_sharded_object(rng)
        if not is_loading:
            sharded.update(
                iteration=state.iteration, opt_param_scheduler=self.scheduler.state_dict(),
                args=megatron_args(self.args, state), layout=layout_of(self.args),
                num_floating_point_operations_so_far=0,
                **{_CONTENT_METADATA_KEY: metadata})
        return sharded

    def state_dict_at(self, iteration: int, consumed_samples: int, rng: dict | None) -> dict:
        """What a save at this point would write, the RNG streams as given (a replica dump
        runs on a side thread while the training thread may already draw from them). The
        distributed optimizer's tensors are left out, only its common part kept: a regular
        save gathers them over DP (the dump writes its slices: ``optimizer_shards``)."""
        distributed = bool(self.args.use_distributed_optimizer)
        sharded = self._state_dict(TrainingState(iteration, consumed_samples), is_loading=False,
                                   with_rng=True, rng=rng, with_optimizer=not distributed)
        if distributed:  # what megatron-core's sharded_state_dict leaves in common.pt
            sharded["optimizer"] = {**self.optimizer.state_dict(),
                                    "param_state_sharding_type": "fully_reshardable"}
        return sharded

    def on_disk_at(self, iteration: int) -> bool:
        """Whether the newest save (durable or in flight) is of ``iteration`` on disk."""
        return self.last_saved_iteration == iteration and self._last_saved_tier == "disk"

    def folder_of(self, tier: str) -> Path:
        return self.memory_dir if tier == "memory" else Path(self.args.save)

    def save(self, state: TrainingState, kind: str, tier: str = "disk",
             on_durable: Callable[[DurableSave], None] | None = None,
             on_failed: Callable[[SaveFailure], None] | None = None) -> float:
        """Save at ``state.iteration`` into ``tier``; returns the seconds training was blocked.

        ``on_durable`` runs on every rank once every file is written and the tracker moved;
        ``on_failed`` on every rank when the save did not complete. Either runs before this
        returns for a synchronous save, in a later ``finalize_async`` otherwise.
        """
        start = time.perf_counter()
        save = _Save(self, state.iteration, kind, tier, on_durable, on_failed)
        self.last_saved_iteration, self._last_saved_tier = state.iteration, tier
        with save.timed("state-dict"):
            sharded_state_dict = self._state_dict(state, is_loading=False, with_rng=True)
        request = save.request(sharded_state_dict)
        del sharded_state_dict  # what was made for this save alone is no one's once handed over
        if save.strategy is not None:
            save.strategy.conversions.forget_copies()
        if request is not None:
            if save.synchronous:
                _run_in_rank(request)
            else:
                self.async_saves.start(save, request)
        return time.perf_counter() - start

    def _new_save_strategy(self) -> "_TimedParallelSave":
        """megatron-core's torch_dist strategy with its plan caches on, kept by
        :class:`SaveStructure` for as long as the state's structure stays the same."""
        cache = conversions.ConversionCache()
        return _TimedParallelSave(
            KeptWritesStrategy(cache), parallel_state.get_data_parallel_group(with_context_parallel=True),
            do_cache_distribution=True, conversion_cache=cache)

    def saved(self, save: _Save, outcome: DurableSave | SaveFailure) -> None:
        """Every rank, when a save ends: count it, or forget it and say why."""
        if save.slots is not None:
            save.slots.ended(save.iteration, isinstance(outcome, DurableSave))
        if self.async_saves is not None and not save.synchronous:
            self.async_saves.ended(save, complete=isinstance(outcome, DurableSave))
        if isinstance(outcome, DurableSave):
            self.last_durable_iteration = max(self.last_durable_iteration or 0, outcome.iteration)
            self.last_bytes = outcome.bytes
            if outcome.tier == "disk":
                self.newest_disk_iteration = max(self.newest_disk_iteration or 0, outcome.iteration)
            log_rank0(f"{outcome.kind} checkpoint at iteration {outcome.iteration} not written: "
                      f"{outcome.path} already holds a complete one ({outcome.bytes} bytes)"
                      if outcome.already_on_disk else
                      f"saved {outcome.kind} checkpoint at iteration {outcome.iteration} to "
                      f"{outcome.path} in {outcome.seconds_to_durable:.3f} s ({outcome.bytes} bytes)")
            if outcome.tier == "memory" and _rank() == self.memory_owner:
                self.janitor.submit(prune_memory_checkpoints, self.memory_dir, outcome.iteration,
                                    self.slots.kept_iterations())
            if save.on_durable is not None:
                save.on_durable(outcome)
            return
        if outcome.tier == "memory" and _rank() == self.memory_owner != 0:
            save.remove_partial_folder()  # rank 0 removed its own as it decided
        if self.last_saved_iteration == outcome.iteration:
            self.last_saved_iteration, self._last_saved_tier = self.last_durable_iteration, None
        log_rank0(f"error: {outcome.kind} checkpoint at iteration {outcome.iteration} not saved "
                  f"to {outcome.path}: {outcome.reason}; the newest checkpoint is still "
                  + (f"iteration {self.last_durable_iteration}" if self.last_durable_iteration
                     else "none"))
        self.event("save_failed", iteration=outcome.iteration, kind=outcome.kind, tier=outcome.tier,
                   path=str(outcome.path), reason=outcome.reason)
        if save.on_failed is not None:
            save.on_failed(outcome)

    def finalize_async(self, blocking: bool = False) -> None:
        """Finish async saves whose writers are done on every rank, and give up one past its
        deadline (all ranks call this; :mod:`async_saves`)."""
        if self.async_saves is not None:
            self.async_saves.finalize(blocking)

    def _abandoned(self, save: _Save, reason: str) -> None:
        if _rank() == 0:
            save.remove_partial_folder()
        self.saved(save, SaveFailure(save.iteration, save.path, save.kind, save.tier, reason))

    def close(self) -> None:
        if self.async_saves is not None:
            self.async_saves.close()
        self.janitor.finish()
        if self.slots is not None:
            self.slots.close()

    # ---- loading ------------------------------------------------------------------------
    def load(self, state: TrainingState) -> bool:
        """Load the newest checkpoint under ``--load`` that loads on every rank; False when
        there is none at all (a fresh start). NoLoadableCheckpoint when some exist and every
        one fails; CheckpointMismatch when the resume is refused (its checkpoint cannot
        continue under these arguments, or a discarded timeline cannot be set aside). Each
        refusal is one ``load_failed`` event, with the reason the ranks exit with: every
        refusal, as ftmaster's report and incident page say why the attempt failed from it.
        PeerReadFailed, a refusal too, when a peer failed while a node-local memory
        checkpoint was read from it: the next round agrees anew on what the nodes hold."""
        try:
            return self._load_newest(state)
        except (CheckpointMismatch, NoLoadableCheckpoint, PeerReadFailed) as refusal:
            self.event("load_failed", path=str(self.args.load), reason=str(refusal))
            raise

    def _load_newest(self, state: TrainingState) -> bool:
        found = broadcast_from_rank0(
            tier_candidates(Path(self.args.load), self.memory_dir) if _rank() == 0 else None,
            self.group)
        startup.mark("checkpoint-search")
        for note in found.notes:
            log_rank0(f"warning: {note}")
            self.event("tracker_problem", reason=note)
        skipped = []
        for candidate in found.candidates:
            problem = self._load_from(candidate.path, state, candidate.tier)
            if problem is None:
                self._set_aside_newer(state.iteration, candidate.tier, self._in_own_folder(
                    candidate.path, candidate.tier))
                return True
            if isinstance(problem, PeerReadProblem):
                raise PeerReadFailed(
                    f"memory checkpoint {candidate.path} could not be read from the peers "
                    f"({problem}): not resuming from an older one, which would set it aside on "
                    f"every node; ftmaster's next round reads it again")
            where = "" if candidate.tier == "disk" else f"{candidate.tier} "
            skipped.append(f"{where}{candidate.path.name}: {problem}")
            log_rank0(f"warning: skipping checkpoint {candidate.path}: {problem}"
                      + ("; trying the next one (the disk tier has the persisted copies)"
                         if candidate.tier == "memory" else ""))
            self.event("checkpoint_skipped", iteration=candidate.iteration, tier=candidate.tier,
                       path=str(candidate.path), reason=problem)
        folders = " or ".join(str(folder) for folder in found.folders)
        if not skipped and found.notes:  # a tracker with nothing it names: never a fresh start
            raise NoLoadableCheckpoint(
                f"no checkpoint in {folders} can be loaded ({'; '.join(found.notes)}); nothing "
                f"was changed: repair or move the tracker, or give another --load")
        if not skipped:
            log_rank0(f"no checkpoint in {folders}; starting from scratch")
            self.event("fresh_start", folders=[str(folder) for folder in found.folders])
            return False
        raise NoLoadableCheckpoint(
            f"no checkpoint in {folders} can be loaded ({'; '.join(skipped)}); nothing was "
            f"changed: repair or move them, or give another --load")

    def _load_from(self, path: Path, state: TrainingState, tier: str) -> str | None:
        """Load ``path`` on every rank, or the reason it cannot be (the same on every rank). A
        node-local memory tier is read from each node's own copy, and what that copy lacks
        from the peers ftmaster lists (a PeerReadProblem when they failed to give it)."""
        node_local = tier == "memory" and self.node_local_memory
        if tier == "memory":
            path = self.memory_dir / path.name
        # The shards of a node-local memory checkpoint this node lacks are read from the peers
        # ftmaster lists for the round (none on one node)
        peers = peer_clients(runfiles.run_dir_from_env()) if tier == "memory" else []
        checked = broadcast_from_rank0(
            (checkpoint_problem(path, bool(peers)), read_manifest(path)) if _rank() == 0 else None,
            self.group)
        problem, manifest = checked
        if node_local and problem is None:
            problem = first_problem(checkpoint_problem(path, bool(peers))
                                    if _rank() == self.memory_owner else None, self.group)
        start, read_before = time.perf_counter(), _bytes_read_by_this_process()
        if problem is None and manifest is not None and manifest.files:
            problem = self._checksum_problem(path, manifest, node_local)
        elif problem is None:  # written before manifests, by another tool, or lost its own
            log_rank0(f"warning: {path} has no checksummed manifest: its structure is checked, "
                      "its bytes cannot be")
        verify_seconds = time.perf_counter() - start
        if problem is not None:
            return problem
        startup.mark("checkpoint-verify")
        common = None
        try:
            common = dist_checkpointing.load_common_state_dict(str(path))
        except CHECKPOINT_ERRORS as error:
            problem = f"{COMMON_FILE}: {describe_error(error)}"
        problem = first_problem(problem, self.group)
        if problem is not None:
            return problem
        _check_model(saved_args(common), self.args)
        from_distributed = False
        if not self.args.no_load_optim:
            self._check_schedule(common.get("opt_param_scheduler", {}))
            from_distributed = self._check_optimizer(saved_args(common))
        same_layout = common.get("layout") == layout_of(self.args)
        with_rng = same_layout and not self.args.no_load_rng
        try:
            template = self._state_dict(state, is_loading=True, with_rng=with_rng,
                                        with_optimizer=not self.args.no_load_optim,
                                        from_distributed=from_distributed)
            with checksums.reads_for_load(manifest, peers) as read_on_the_way:
                loaded = dist_checkpointing.load(template, str(path),
                                                 sharded_strategy=self._load_strategy(path))
            self._apply(loaded, state, with_rng, from_distributed)
        except CHECKPOINT_ERRORS as error:
            problem = load_problem(error)
        problem = first_problem(problem, self.group)
        if problem is None:
            startup.mark("checkpoint-read")
            read = _bytes_read_by_this_process() - read_before
            self._loaded(path, state, common, with_rng, manifest, time.perf_counter() - start,
                         verify_seconds, self._sum_over_ranks([*read_on_the_way, read]), tier)
        return problem

    def _checksum_problem(self, path: Path, manifest: Manifest, node_local: bool) -> str | None:
        """The checksum of every file the load will not check item by item as it reads it,
        the files spread over the ranks so each reads a share (each node's owner reads them
        all in its own copy of a node-local memory checkpoint). ``.metadata`` is checked
        wherever it is unpickled (:func:`checkpoint_problem`, the load's reader), not here."""
        names = [name for name in sorted(manifest.files)
                 if not manifest.items_cover(name) and name != DCP_METADATA_FILE]
        if node_local:
            mine = names if _rank() == self.memory_owner else []
        else:
            mine = names[_rank()::torch.distributed.get_world_size()]
        return first_problem(digest_problem(path, manifest, mine), self.group)

    def _sum_over_ranks(self, values: list[int]) -> list[int]:
        total = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(total, group=self.group)
        return total.tolist()

    def _loaded(self, path: Path, state: TrainingState, common: dict, with_rng: bool,
                manifest: Manifest | None, seconds: float, verify_seconds: float,
                read_counts: list[int], tier: str) -> None:
        """``read_counts``: the bytes checked item by item as they were read, those read from
        peers (a node-local memory checkpoint), and the bytes the ranks read in all from the
        start of verification to the end of the load, as the kernel counts them (``rchar``,
        sockets included); each summed over ranks."""
        size = manifest.total_bytes if manifest and manifest.files else None
        log_rank0(f"loaded checkpoint from {path} at iteration {state.iteration} in "
                  f"{seconds:.3f} s ({size if size is not None else 'unknown'} bytes); layout "
                  f"{common.get('layout')} -> {layout_of(self.args)}"
                  + ("" if with_rng else "; RNG state not restored"))
        self.event("checkpoint_loaded", iteration=state.iteration, path=str(path), tier=tier,
                   seconds=round(seconds, 4), bytes=size, verify_seconds=round(verify_seconds, 4),
                   verified_on_read=read_counts[0], peer_bytes=read_counts[1],
                   read_bytes=read_counts[2])
        self.last_saved_iteration = self.last_durable_iteration = state.iteration
        # A disk checkpoint of --load elsewhere is not --save's: the final save must write it
        # there (--train-iters at the loaded iteration: resharding into --save)
        in_own_folder = self._in_own_folder(path, tier)
        self._last_saved_tier = tier if in_own_folder else None
        self.last_bytes = size
        if tier == "disk" and in_own_folder:
            self.newest_disk_iteration = state.iteration
        self.own_states.add(state.iteration, path, manifest.files if manifest else {})

    def prepare_fresh_start(self) -> None:
        """Every rank, when nothing was loaded: rank 0 checks and cleans the save folder (see
        :func:`prepare_fresh_start`), and every rank refuses alike."""
        folders = [self.args.save] if _rank() == 0 else []
        if _rank() == self.memory_owner:
            folders.append(self.memory_dir)
        refusal = None
        try:
            for folder in folders:
                prepare_fresh_start(folder)
        except CheckpointMismatch as problem:
            refusal = str(problem)
        except OSError as error:  # rank 0's alone: the other ranks wait in first_problem
            refusal = (f"{folder} cannot be checked before a fresh start "
                       f"({describe_error(error)}): fix its permissions or give another folder")
        refusal = first_problem(refusal, self.group)
        if refusal is not None:
            raise CheckpointMismatch(refusal)

    def _in_own_folder(self, path: Path, tier: str) -> bool:
        """Whether a checkpoint resumed from is in its tier's own folder: the memory tier's,
        or --save, not a --load elsewhere."""
        return tier != "disk" or same_folder(path.parent, self.args.save)

    def _set_aside_newer(self, iteration: int, tier: str, in_own_folder: bool) -> None:
        """Rank 0 (and each node's owner of a node-local memory tier): checkpoints above the
        one resumed from belong to a discarded timeline; a new save at the same iteration
        must not mix with their files, nor a later load pick them. They are renamed, not
        deleted (but for what a save killed mid-write left: :func:`set_aside_newer`), and the
        tracker comes back to ``iteration``, loaded from ``tier``. When that fails, every
        rank refuses the resume with the reason (the others would wait for rank 0 until the
        collective's timeout): left under its name, such a folder stays a load candidate. The
        folders moved before a failure are events all the same (the operator looks for them
        there), and so is the refusal (:meth:`load`'s ``load_failed``)."""
        problem, moved = None, []
        try:
            self._set_aside_newer_here(iteration, tier, moved, in_own_folder)
        except OSError as error:
            problem = (
                f"resuming from iteration {iteration}: the checkpoints newer than it cannot be "
                f"set aside ({describe_error(error)}), and left in place a later relaunch would "
                f"load them: make the folder writable, or move them out of it")
        for old, new in moved:
            self.event("checkpoint_set_aside", iteration=iteration, path=str(old),
                       moved_to=None if new is None else str(new))
        problem = first_problem(problem, self.group)
        if problem is not None:
            raise CheckpointMismatch(problem)

    def _set_aside_newer_here(self, iteration: int, tier: str,
                              moved: list[tuple[Path, Path | None]], in_own_folder: bool) -> None:
        if _rank() == 0:
            # The disk tier's lock across both: a persist copy checks that its memory
            # checkpoint still stands and moves it into place under that lock.
            with tracker_lock(Path(self.args.save)) if self.args.save else contextlib.nullcontext():
                if self.memory_dir is not None:
                    with tracker_lock(self.memory_dir):
                        set_aside_newer(self.memory_dir, iteration, tier == "memory", moved)
                if self.args.save:
                    set_aside_newer(Path(self.args.save), iteration,
                                    tier == "disk" and in_own_folder, moved)
        elif _rank() == self.memory_owner:  # another node's own memory folder
            with tracker_lock(self.memory_dir):
                set_aside_newer(self.memory_dir, iteration, tier == "memory", moved)

    def _check_optimizer(self, saved: dict) -> bool:
        """Whether the distributed optimizer's state goes to the plain optimizer (see
        :mod:`optimizer_from_distributed`). The other way is refused: the plain optimizer's
        state is not stored in the fully reshardable format the distributed one reads."""
        was = bool(saved.get("use_distributed_optimizer"))
        if not was and self.args.use_distributed_optimizer:
            raise CheckpointMismatch(
                "the checkpoint's optimizer state was saved without the distributed optimizer: "
                "resume without --use-distributed-optimizer, or pass --no-load-optim to start "
                "its state afresh")
        return was and not self.args.use_distributed_optimizer

    def _check_schedule(self, saved: dict) -> None:
        """Megatron-LM's rule: a resume keeps the schedule unless told which one to follow,
        so that a changed --train-iters or --lr never silently keeps the old decay."""
        if self.args.override_opt_param_scheduler or self.args.use_checkpoint_opt_param_scheduler:
            return
        differences = schedule_differences(saved, self.scheduler.state_dict())
        if differences:
            raise CheckpointMismatch(
                f"the learning-rate schedule differs from the checkpoint's ({'; '.join(differences)}): "
                f"pass --override-opt-param-scheduler to follow the arguments, or "
                f"--use-checkpoint-opt-param-scheduler to keep the checkpoint's")

    def _load_strategy(self, path: Path):
        strategy = get_default_load_sharded_strategy(str(path))
        return FullyParallelLoadStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))

    def _apply(self, loaded: dict, state: TrainingState, with_rng: bool,
               from_distributed: bool = False) -> None:
        self.model.load_state_dict(loaded)
        if with_rng:
            _restore_rng(loaded["rng_state"])
        state.iteration = int(loaded["iteration"])
        state.consumed_train_samples = consumed_samples(loaded)
        if self.args.no_load_optim:
            # A fresh optimizer, but the schedule (counted in samples) goes on where it was.
            # (dist_checkpointing hands back the common part of "optimizer" even when the
            # template left it out, so the flag, not the key, decides.)
            self.scheduler.num_steps = 0
            self.scheduler.step(increment=state.consumed_train_samples)
            log_rank0(f"--no-load-optim: a fresh optimizer; the learning-rate schedule goes on "
                      f"at sample {state.consumed_train_samples} (Megatron-LM starts it over, "
                      "warm-up included)")
            # Megatron's mixed-precision optimizer copied the fp32 master weights when it was
            # built; without this its first step would write those random weights back over
            # the loaded ones (optimizer.py: reload_model_params).
            self.optimizer.reload_model_params()
        else:
            if from_distributed:
                optimizer_from_distributed.apply(self.optimizer, loaded,
                                                 optimizer_from_distributed.saved_step(loaded["optimizer"]))
            else:
                self.optimizer.load_state_dict(loaded["optimizer"])
            self.scheduler.load_state_dict(loaded["opt_param_scheduler"])


def set_aside_newer(save_dir: Path, iteration: int, resumed_here: bool = True,
                    moved: list[tuple[Path, Path | None]] | None = None
                    ) -> list[tuple[Path, Path | None]]:
    """Rename every ``iter_*`` folder above ``iteration`` to ``iter_*.discarded-<time>`` (kept,
    since any of them may be complete) and bring the tracker back to ``iteration`` (or remove
    it when this tier has no such folder: the resume came from the other tier). A folder
    without a single file (a save killed at its ``mkdir``) holds nothing to keep and is
    removed, as is one a save of ours killed mid-write left (:func:`left_by_a_killed_save`: it can
    never be loaded, and a failure during an async or emergency save left one per failure);
    so is such a folder of ``iteration`` itself unless the resume came from this tier
    (``resumed_here``): the tracker would name it, and a persist copy could not land there.
    Returns (folder, new name or None when removed), appended to ``moved`` as each is done
    when given: an OSError partway leaves the caller knowing where the earlier ones went.
    The caller holds ``tracker_lock(save_dir)``."""
    moved = [] if moved is None else moved
    if not Path(save_dir).is_dir():
        return moved
    same = iteration_dir(save_dir, iteration)
    if not resumed_here and same.is_dir() and left_by_a_killed_save(same) is not None:
        moved.append((same, _removed_or_set_aside(same)))
    for newer in (it for it in list_iterations(save_dir) if it > iteration):
        old = iteration_dir(save_dir, newer)
        moved.append((old, _removed_or_set_aside(
            old, f"it is newer than the resumed iteration {iteration}, from a discarded timeline")))
    tracked = read_tracker(save_dir)
    if tracked is not None and tracked > iteration:
        if iteration_dir(save_dir, iteration).is_dir():
            atomic_write_text(tracker_path(save_dir), f"{iteration}\n")
        else:  # resumed from the other tier: this one's complete folders are its candidates
            tracker_path(save_dir).unlink()
    return moved


def _removed_or_set_aside(folder: Path, why: str = "") -> Path | None:
    """None once ``folder`` is removed, which it is when a save of ours killed mid-write left
    it (:func:`left_by_a_killed_save`); else, or when it cannot be removed (a permission, a
    busy NFS file), its new name ``<name>.discarded-<time>``: left under its own, it would be
    a candidate of a load, or take a later save's files of its iteration among its own. An
    OSError when the rename fails too. ``why`` it is set aside, for one that may be loadable."""
    left = left_by_a_killed_save(folder)
    if left is not None:
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            log_rank0(f"removed {folder}: {left}")
            return None
        why = f"{left}, and it could not be removed"
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    new = folder.with_name(f"{folder.name}.discarded-{stamp}")
    folder.rename(new)
    log_rank0(f"moved {folder} to {new}: {why}")
    return new


def prepare_fresh_start(save_dir: str | None) -> None:
    """Rank 0, for a run that starts from scratch: refuse to write over a folder holding
    checkpoints; remove the folders of saves of ours that never finished (no tracker was ever
    written), whose stale shards would otherwise mix with new ones of the same iteration (set
    aside when they cannot be removed; refused when that fails too). A folder of another tool
    or format (a Megatron-LM checkpoint copied in without its tracker) is kept: it is no
    candidate, but may be the only copy of someone's weights."""
    if not save_dir:
        return
    save_dir = Path(save_dir)
    if holds_checkpoints(save_dir):
        newest = list_iterations(save_dir)[:3]
        held = ", ".join(f"iter_{it:07d}" for it in newest) or "a tracker"
        raise CheckpointMismatch(
            f"--save {save_dir} already holds checkpoints ({held}) and none was loaded: pass "
            f"--load {save_dir} to resume from them, or give an empty --save folder")
    for iteration in unfinished_saves(save_dir):
        folder = iteration_dir(save_dir, iteration)
        try:
            _removed_or_set_aside(folder)
        except OSError as error:
            raise CheckpointMismatch(
                f"{folder}, a save that never finished, can be neither removed nor renamed "
                f"({describe_error(error)}): remove it, or give an empty --save folder") from None


def megatron_args(args: argparse.Namespace, state: TrainingState) -> argparse.Namespace:
    """The ``args`` Megatron-LM's ``load_checkpoint`` reads, by attribute: these arguments
    (Megatron-LM's names) and the progress it keeps in them."""
    saved = argparse.Namespace(**vars(args))
    saved.consumed_train_samples = state.consumed_train_samples
    saved.consumed_valid_samples = 0
    saved.skipped_train_samples = 0
    saved.no_save_optim = saved.no_save_rng = False
    saved.ckpt_fully_parallel_save = True
    saved.add_position_embedding = args.position_embedding_type == "learned_absolute"
    saved.use_rotary_position_embeddings = args.position_embedding_type == "rope"
    return saved


def saved_args(common: dict) -> dict:
    """A checkpoint's args as a dict, whether saved as a Namespace or (before) as a dict."""
    found = common.get("args") or {}
    return vars(found) if isinstance(found, argparse.Namespace) else dict(found)


def consumed_samples(loaded: dict) -> int:
    """Where Megatron-LM keeps them (``args.consumed_train_samples``), else where ftmaster
    kept them before."""
    found = saved_args(loaded).get("consumed_train_samples")
    return int(found if found is not None else loaded["consumed_train_samples"])


def checkpoint_args(load_dir: str | None, memory_dir: Path | None = None) -> dict | None:
    """The args saved with the checkpoint a load would pick first (either tier), without
    loading it: the first candidate that passes the load's own first checks. A node-local
    memory checkpoint whose shards the peers hold counts, as the load reads them there; one
    whose ``common.pt`` cannot be read, or differs from its manifest, does not, as the load
    falls back past it. Any other choice built the model (its optimizer, padded vocabulary,
    layers) for a checkpoint the load then did not take."""
    if not load_dir:
        return None
    from_peers = bool(peer_clients(runfiles.run_dir_from_env()))
    for candidate in tier_candidates(Path(load_dir), memory_dir).candidates:
        if checkpoint_problem(candidate.path, candidate.tier == "memory" and from_peers) is None:
            found = _common_args(candidate.path)
            if found is not None:
                return found
    return None


def _common_args(path: Path) -> dict | None:
    """The args in ``path``'s ``common.pt``; None when it cannot be read or is not the
    manifest's (the load's to report, with its fallback)."""
    manifest = read_manifest(path)
    if manifest is not None and COMMON_FILE in manifest.files and digest_problem(
            path, manifest, [COMMON_FILE]) is not None:
        return None
    try:
        return saved_args(dist_checkpointing.load_common_state_dict(str(path)))
    except Exception:  # any damage: the load says which, at this checkpoint
        return None
