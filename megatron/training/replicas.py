"""Recovery from surviving data-parallel replicas, the trainer's side (``--replica-recovery``).

When a rank dies, its data-parallel replicas still hold the same model and optimizer state.
Three things let the supervisor build a checkpoint from them (see
:mod:`megatron.training.replica_merge` for the merge):

- **A consistent cut.** The local update, the scheduler step and the iteration and sample
  counters change only under :class:`Cut`'s lock, which a dump takes: a dump sees the state
  before an update or after it, never half of one. The RNG streams are copied at the same
  moment (the next forward draws from them). Every update follows the NaN guard's agreement
  on every rank, so survivors hold the same iteration: either nobody passed the agreement
  (the victim died before it) or everybody did, and the update needs no collective, but
  for the distributed optimizer's all-gather of the parameters within its instance: a rank
  that dies in its optimizer step leaves its instance mates' updates unfinished (blocked or
  failed under the lock), and their dumps refused. A rank that has passed the agreement but
  not yet applied the update (the clipping runs between) would still show the iteration
  before, so a dump waits for that update; and, briefly, for an agreement under way, which
  either ends at once or never (a peer died before it).
- **Parking.** A rank whose collective fails (a peer died) does not exit: it waits, its state
  in memory, until its dump is written or :data:`PARK_TIMEOUT_S` has passed, then raises the
  error as before. A rank blocked in a collective needs nothing: its dump thread runs anyway.
- **The dump.** A thread per rank polls ``flags/replica_dump.json`` in the run directory. On
  a request it takes the lock and writes, with no collective, its own shards as a one-rank
  ``torch_dist`` checkpoint (``DUMP/rank_<R>/``: the shards, ``.metadata``, its local save
  plan, and ``common.pt``), then a report ``DUMP/rank_<R>.json``: its layout coordinates, the
  iteration and consumed samples its state holds, and an xxh3 checksum per file and per item.
  With the distributed optimizer, the optimizer state is not in that checkpoint (a regular
  save gathers it over DP): the rank's own slices of it are in ``optimizer_shard.pt`` (see
  :mod:`megatron.training.optimizer_shards`), and the report says which shard it holds.

torchrun SIGTERMs the survivors as soon as one rank fails and SIGKILLs them 30 s later; the
supervisor asks for the dump and waits well within that window.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import xxhash
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed import checkpoint as dcp

from ftmaster import runfiles
from ftmaster.recovery.checkpoints import COMMON_FILE
from ftmaster.recovery.manifest import digest_bytes
from ftmaster.recovery.replicas import (
    REQUEST_FLAG,
    SHARD_FILE,
    item_key,
    rank_dump_dir,
    report_path,
)

from .checkpointing import CHECKPOINT_ERRORS, clean_content_metadata, describe_error, rng_state
from .console import log_rank0

POLL_INTERVAL_S = 0.05
PARK_TIMEOUT_S = 25.0  # below torchrun's 30 s from SIGTERM to SIGKILL
LOCK_TIMEOUT_S = 10.0  # an update is local work: seconds at most, even on a large model
AGREEMENT_WAIT_S = 0.5  # a tiny all-reduce every rank has joined ends in milliseconds
# What gloo and NCCL say when a peer is gone (torch raises DistError subclasses for some).
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "NCCL", "gloo", "ProcessGroup")


class Cut:
    """The training state a dump may see; ``commit`` is the only place it changes."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)
        self.rng: dict | None = None  # the streams as of the last commit
        self.torn: str | None = None  # why the state in memory is not a whole iteration
        self._agreement: str | None = None  # "under way", then "passed" until the commit

    def begin(self) -> None:
        """Training starts from the state it loaded (or its fresh one), whole: its RNG
        streams are kept now, before training draws from them (a dump before the first
        commit read them live, from its own thread, in the middle of an iteration)."""
        if self.enabled:
            with self.lock:
                self.rng = rng_state()

    @contextlib.contextmanager
    def agreement(self):
        """Around the collective whose outcome the next ``commit`` applies."""
        if not self.enabled:
            yield
            return
        self._set_agreement("under way")
        try:
            yield
        except BaseException:
            self._set_agreement(None)  # no update follows
            raise
        self._set_agreement("passed")

    @contextlib.contextmanager
    def commit(self):
        """Apply an update and advance the counters inside; an error there tears the state."""
        if not self.enabled:
            yield
            return
        with self.lock:
            try:
                yield
            except BaseException as error:
                self.torn = f"an error during the update left it half applied: {error}"
                raise
            finally:
                self._agreement = None
                self._changed.notify_all()
            self.rng = rng_state()

    def acquire_whole(self) -> bool:
        """Take the lock once no agreed update is pending (see the module's docstring);
        False when the update did not end within :data:`LOCK_TIMEOUT_S`."""
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        if not self.lock.acquire(timeout=LOCK_TIMEOUT_S):
            return False
        self._changed.wait_for(lambda: self._agreement != "under way", AGREEMENT_WAIT_S)
        if self._changed.wait_for(lambda: self._agreement != "passed",
                                  max(0.0, deadline - time.monotonic())):
            return True
        self.lock.release()
        return False

    def _set_agreement(self, phase: str | None) -> None:
        with self.lock:
            self._agreement = phase
            self._changed.notify_all()


def is_collective_failure(error: BaseException) -> bool:
    """A collective that failed because a peer went away (its data may be fine)."""
    dist_error = getattr(torch.distributed, "DistError", ())
    return isinstance(error, dist_error) or (
        isinstance(error, RuntimeError) and any(text in str(error) for text in _PEER_GONE))


def layout_coordinates() -> dict[str, int]:
    """Where this rank's state sits in the layout: a report's rank, tp, pp, dp and sizes
    (see ``ftmaster.recovery.replicas.Report``; the merge groups replicas by tp, pp)."""
    return {"rank": torch.distributed.get_rank(),
            "tp": parallel_state.get_tensor_model_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(),
            "dp": parallel_state.get_data_parallel_rank(),
            "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pp_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp_size": parallel_state.get_data_parallel_world_size()}


class ReplicaDumper:
    """The side thread that dumps this rank's state when the supervisor asks.

    ``state_dict(iteration, consumed, rng)`` builds the sharded state dict of a save at the
    cut, and ``optimizer_slices(sharded_state_dict)``, with the distributed optimizer, this
    rank's slices of its state (``coordinates`` then name the shard); ``refusal`` is set when
    this rank's state can never make a replica, and is reported instead of a dump.
    """

    def __init__(self, run_dir: Path, cut: Cut, state, state_dict: Callable[..., dict],
                 refusal: str | None = None,
                 optimizer_slices: Callable[[dict], dict] | None = None,
                 coordinates: dict[str, int] | None = None) -> None:
        self.flag = runfiles.flags_dir(run_dir) / REQUEST_FLAG
        self.cut, self.state, self.state_dict, self.refusal = cut, state, state_dict, refusal
        self.optimizer_slices = optimizer_slices
        self.coordinates = {**layout_coordinates(), **(coordinates or {})}
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else None
        """The training thread's GPU: CUDA's current device is per thread, GPU 0 in a new one."""
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="replica-dump", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        if self.device is not None:  # the dump reads the current device's RNG stream, and
            torch.cuda.set_device(self.device)  # megatron-core allocates on it
        while True:
            request = runfiles.read_flag(self.flag)
            if request is not None and "folder" in request:
                break
            time.sleep(POLL_INTERVAL_S)
        folder = Path(request["folder"])
        report = self._dump(folder)
        try:
            runfiles.atomic_write_text(report_path(folder, self.coordinates["rank"]),
                                       json.dumps(report) + "\n", durable=False)
        except OSError as error:  # no report is no dump to the merge: it falls back
            print(f"replica recovery: rank {self.coordinates['rank']}'s dump report could not be "
                  f"written: {describe_error(error)}", flush=True)
        finally:
            # A parked rank ends now, so the supervisor does not wait out its dump timeout.
            self.done.set()

    def _dump(self, folder: Path) -> dict:
        start = time.perf_counter()
        report = dict(self.coordinates)
        if self.refusal is not None:
            return {**report, "refused": self.refusal}
        if not self.cut.acquire_whole():
            return {**report, "refused": f"the update did not end within {LOCK_TIMEOUT_S:g} s"}
        try:
            if self.cut.torn is not None:
                return {**report, "refused": self.cut.torn}
            iteration, consumed = self.state.iteration, self.state.consumed_train_samples
            sharded = self.state_dict(iteration, consumed, self.cut.rng)
            slices = None if self.optimizer_slices is None else self.optimizer_slices(sharded)
            written = write_dump(rank_dump_dir(folder, self.coordinates["rank"]), sharded, slices)
        except CHECKPOINT_ERRORS as error:  # reported: the merge then falls back
            # What was written is never merged, and may hold the room the report needs.
            shutil.rmtree(rank_dump_dir(folder, self.coordinates["rank"]), ignore_errors=True)
            return {**report, "refused": f"the dump failed: {describe_error(error)}"}
        finally:
            self.cut.lock.release()
        return {**report, "iteration": iteration, "consumed_samples": consumed, **written,
                "seconds": round(time.perf_counter() - start, 4)}

    def park(self, error: BaseException) -> None:
        """Called with the error that ends training: after a peer's death, stay alive until
        this rank's dump is written (or the park timeout), so that its state is not lost."""
        if not is_collective_failure(error) or self.done.is_set():
            return
        log_rank0(f"replica recovery: a collective failed ({str(error).splitlines()[0][:200]}); "
                  f"waiting up to {PARK_TIMEOUT_S:g} s for the supervisor to ask for a dump")
        self.done.wait(PARK_TIMEOUT_S)


def _mapped(path: Path, mapped: contextlib.ExitStack) -> memoryview | bytes:
    """The file's bytes where they are: a dump lies in host memory (``/dev/shm``), and read
    back whole, every rank of a node doubled its footprint at once, in a recovery."""
    with path.open("rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return b""
        view = memoryview(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
    mapped.callback(view.obj.close)
    mapped.callback(view.release)
    return view


def write_dump(folder: Path, sharded_state_dict: dict, optimizer_slices: dict | None = None) -> dict:
    """Write one rank's shards as a one-rank torch_dist checkpoint, with no collective: every
    shard this rank holds (replicas included: the merge picks one per shard), its save plan
    (``.metadata``), ``common.pt``, and the distributed optimizer's slices when given.
    Returns the report's files and items (a slice's checksum covers its values)."""
    folder.mkdir(parents=True, exist_ok=True)
    sharded_part, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
    clean_content_metadata(common)
    renamed, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_part, keep_only_main_replica=False)
    metadata = dcp.save(mcore_to_pyt_state_dict(renamed, False),
                        storage_writer=dcp.FileSystemWriter(folder, thread_count=1, sync_files=False),
                        planner=MCoreSavePlanner(flatten_state_dict=False), no_dist=True)
    torch.save(common, folder / COMMON_FILE)
    if optimizer_slices is not None:
        torch.save(optimizer_slices, folder / SHARD_FILE)
    with contextlib.ExitStack() as mapped:
        data = {path.name: _mapped(path, mapped) for path in folder.iterdir() if path.is_file()}
        files = {name: digest_bytes(content).as_json() for name, content in sorted(data.items())}
        items = {item_key(index.fqn, index.offset): xxhash.xxh3_64_hexdigest(
                     data[info.relative_path][info.offset:info.offset + info.length])
                 for index, info in metadata.storage_data.items()}
        del data
    for key, piece in (optimizer_slices or {}).items():
        items[key] = xxhash.xxh3_64_hexdigest(piece["values"].numpy().tobytes())
    return {"files": files, "items": items, "bytes": sum(f["bytes"] for f in files.values())}
