"""The memory tier's two slots: each rank's files set up once, then refilled in place.

DLRover's flash checkpoint sizes every tensor at the first save and copies the tensors into
one shared-memory segment at every later save, with no pickling and no new pages. This does
the same inside a regular ``torch_dist`` checkpoint, which still loads under any layout:

- The first save into a slot writes the rank's files as torch_dist does and learns where each
  tensor's bytes sit (:mod:`records`). The pages are then in memory, so the files are
  preallocated and prefaulted from here on; the rank keeps them mapped (``MAP_POPULATE``).
- Every later save into the slot copies each tensor's bytes to its place: on CPU a copy with
  streaming stores, each chunk hashed just before it is copied, the whole loop in C
  (``stream_copy.c``), and on
  CUDA a device-to-host copy straight into the mapping, registered with the driver as pinned
  memory (as torch's own ``_state_dict_stager`` pins its shared memory), hashed once landed;
  a mapping the driver refuses to pin is refilled as on CPU, each tensor brought to the host.
  The file's and each item's digest are taken while the bytes are in the cache.

Slots are used in turn, so the newest complete checkpoint is never written over. Before a
slot is refilled, rank 0 removes its manifest and ``.metadata`` and renames it to the new
iteration's folder, under the tier's lock, and only when no persist copy has pinned it, the
tracker does not name it and, across nodes, it is not the node's newest whole copy, nor its
part of the newest replicated checkpoint, while a newer one is still being copied from the
peers (``kept_memory_checkpoints``): a rank killed mid-copy leaves a folder no loader
accepts. The tier then holds two checkpoints plus the one being written, and those a
persist or peer copy holds back (a kept slot is left to the pruning, and a fresh folder is
written instead).

A structure change (a new layout, a new optimizer state) drops both slots, and so does a
failed save: their checkpoints stay until pruned, and the next two saves set up new ones.

A tier on a file system that may not rewrite a page where it is (:data:`IN_PLACE_FILE_SYSTEMS`)
is never refilled: each save writes its files anew, with write(2), whose failure fails the
save, where a store into the mapping that fails is SIGBUS and kills the rank.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import mmap
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch
import xxhash
import xxhash._xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from ftmaster.recovery.checkpoints import (DCP_METADATA_FILE, iteration_dir,
                                           kept_memory_checkpoints, tracker_lock)
from ftmaster.recovery.manifest import MANIFEST_NAME, FileDigest
from ftmaster.replication import writer_rank

from . import checksums, records, rehearsal
from .console import error_line
from .records import Record, RecordWriter

COPY_CHUNK = 512 << 10  # hashed twice, then copied while still in L2 (1.25x faster than 2 MB)
IN_PLACE_FILE_SYSTEMS = frozenset({"tmpfs", "ext2", "ext3", "ext4", "xfs"})
"""File systems where rewriting a page already written needs no new room and no network: a
refill through the mapping cannot fail there. Elsewhere it can (btrfs and zfs copy on write
and may find no room, NFS and Lustre write back over the network, FUSE to anything), and
the kernel reports that failure as SIGBUS."""
MOUNTS = Path("/proc/self/mounts")


def file_system_type(path: Path, mounts: Path = MOUNTS) -> str | None:
    """The type of the file system that holds ``path`` (the deepest mount above it), None
    when the mount table cannot be read."""
    target = Path(os.path.realpath(path))
    try:
        table = mounts.read_text(errors="replace").splitlines()
    except OSError:
        return None
    found, depth = None, -1
    for fields in map(str.split, table):
        if len(fields) < 3:
            continue
        point = Path(re.sub(r"\\([0-7]{3})", lambda code: chr(int(code[1], 8)), fields[1]))
        if (point == target or point in target.parents) and len(point.parts) >= depth:
            found, depth = fields[2], len(point.parts)  # a later mount over it hides it
    return found


def _stream_copy_library() -> ctypes.CDLL | None:
    """``stream_copy.c``, built (None without a C compiler at set-up)."""
    spec = importlib.util.find_spec(f"{__package__}._stream_copy")
    try:
        return ctypes.CDLL(spec.origin)
    except (AttributeError, OSError, TypeError):  # no spec, no library
        return None


def _stream_copy(library: ctypes.CDLL | None):
    """``stream_copy.c``'s copy (streaming stores), or libc's ``memmove`` where that was not
    built; both take (target, source, length)."""
    function = getattr(library, "ftmaster_stream_copy", None)
    if function is None:
        return ctypes.memmove
    function.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    function.restype = None
    return function


@dataclass(frozen=True)
class _Xxh3:
    """XXH3's streaming calls, from one library (its states are its own)."""

    create_state: ctypes._CFuncPtr
    free_state: ctypes._CFuncPtr
    reset: ctypes._CFuncPtr
    update: ctypes._CFuncPtr
    digest: ctypes._CFuncPtr


def _xxh3_of(library: str | None, update_name: str) -> _Xxh3 | None:
    """``library``'s XXH3 calls, if it has them and they give python-xxhash's own digests
    (those the manifest's readers take)."""
    try:
        hashes = ctypes.CDLL(library)
        calls = _Xxh3(hashes.XXH3_createState, hashes.XXH3_freeState, hashes.XXH3_64bits_reset,
                      getattr(hashes, update_name), hashes.XXH3_64bits_digest)
    except (AttributeError, OSError, TypeError):  # no library, or a symbol missing
        return None
    calls.create_state.restype = ctypes.c_void_p
    for function in (calls.free_state, calls.reset, calls.digest):
        function.argtypes = (ctypes.c_void_p,)
    calls.update.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)
    calls.digest.restype = ctypes.c_uint64
    sample = bytes(range(256)) * 20  # several of XXH3's 1 KB blocks, in two updates
    state = calls.create_state()
    try:
        calls.reset(state)
        calls.update(state, sample[:1000], 1000)
        calls.update(state, sample[1000:], len(sample) - 1000)
        agrees = calls.digest(state) == xxhash.xxh3_64_intdigest(sample)
    finally:
        calls.free_state(state)
    return calls if agrees else None


def _xxh3() -> _Xxh3 | None:
    """python-xxhash's own XXH3 calls, its update dispatched at run time to the CPU's widest
    vectors where its build exports that (AVX2 here: 32 GB/s in cache, against 21 for the
    plain update, its SSE2 path)."""
    return (_xxh3_of(xxhash._xxhash.__file__, "XXH3_64bits_update_dispatch")
            or _xxh3_of(xxhash._xxhash.__file__, "XXH3_64bits_update"))


@dataclass(frozen=True)
class _NativeRefill:
    """``stream_copy.c``'s refill loop and the XXH3 calls it hashes with: the digests are
    those the manifest's readers take through python-xxhash."""

    refill: ctypes._CFuncPtr
    hashes: _Xxh3

    @functools.cached_property
    def hash_functions(self) -> tuple[int, int, int]:
        """The addresses of XXH3's reset, update and digest, for the loop."""
        return tuple(ctypes.cast(function, ctypes.c_void_p).value
                     for function in (self.hashes.reset, self.hashes.update, self.hashes.digest))


def _native_refill(library: ctypes.CDLL | None) -> _NativeRefill | None:
    """The refill loop in C, or None where ``stream_copy.c`` was not built or no library at
    hand exports XXH3's streaming calls: the refill then loops in Python."""
    refill, hashes = getattr(library, "ftmaster_refill", None), _xxh3()
    if refill is None or hashes is None:
        return None
    refill.argtypes = (ctypes.c_void_p,) * 2 + (ctypes.c_size_t,) * 2 + (ctypes.c_void_p,) * 7
    refill.restype = None
    return _NativeRefill(refill, hashes)


_library = _stream_copy_library()
copy_bytes = _stream_copy(_library)
native_refill = _native_refill(_library)


def _pinned(region: torch.Tensor) -> bool:
    """Whether a slot's mapping is now registered with the driver as pinned memory, for the
    device-to-host copies to land in directly. Never on CPU; not where the driver refuses it:
    the refill then brings each tensor to the host first (correct, only slower)."""
    if not torch.cuda.is_available():
        return False
    from torch.cuda import _pin_memory_utils

    try:
        _pin_memory_utils.pin_memory(region.data_ptr(), region.numel())
    except RuntimeError as refusal:
        _clear_pending_cuda_error()
        _say_unpinned(str(refusal).split(".")[0])
        return False
    return True


@functools.cache
def _say_unpinned(reason: str) -> None:
    """Once per rank and reason: every slot's set-up would say it again."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    error_line(f"warning: rank {rank}: the memory tier's files could not be pinned for device "
               f"copies ({reason}): their saves bring each tensor to the host first")


def _clear_pending_cuda_error() -> None:
    """torch's ``cudaHostRegister`` binding returns a refusal unchecked
    (``C10_CUDA_ERROR_HANDLED``), which leaves it pending on the thread, and the next kernel
    launch's check (``C10_CUDA_KERNEL_LAUNCH_CHECK``, a ``cudaGetLastError``) would raise it
    from whatever op came next. torch binds no ``cudaGetLastError``: a launch's check takes
    it off here."""
    try:
        torch.empty(1, device="cuda").fill_(0)
    except RuntimeError:  # the refusal, reported once more and now cleared
        pass


class _SlotFile:
    """One rank's tensor file in one slot, mapped for refills."""

    def __init__(self, path: Path, learnt: dict[MetadataIndex, Record]) -> None:
        self.records = learnt
        self._fd = os.open(path, os.O_RDWR)
        self._map, self._bytes, self._pinned, self._hash_states = None, None, False, None
        try:  # a mapping refused (ENOMEM, vm.max_map_count) left the file open at every save
            size = os.fstat(self._fd).st_size
            self._map = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
            self._address = self._bytes.data_ptr()
            self._pinned = _pinned(self._bytes)
            self._hash_states = (tuple(native_refill.hashes.create_state() for _ in range(2))
                                 if native_refill is not None and not self._pinned else None)
            """The file's and the current item's XXH3 states, for the refill loop in C."""
        except BaseException:
            self.close()
            raise

    @classmethod
    def set_up(cls, path: Path, storage_key: str, tensor_data: list,
               report: checksums.DigestReport) -> "_SlotFile":
        """The first save into this slot: written as torch_dist writes, then mapped."""
        return cls(path, records.set_up_file(path, storage_key, tensor_data, fsync=False,
                                             report=report))

    def refill(self, tensor_data: list, iteration: int) -> tuple[list[WriteResult], checksums.ShardDigest]:
        """Copy each tensor's bytes to its record, hashing the file and each item (a record:
        the zip's header, the tensor's bytes, its trailer) from the copied bytes."""
        started = time.perf_counter()
        ordered = records.in_file_order(self.records, tensor_data)
        self._seconds = {"copy": 0.0, "hash": 0.0}
        # The C loop reads every source at once: device tensors would each need a host copy,
        # all alive together (a whole file's worth of RAM), where the Python loop takes one.
        if self._hash_states is not None and all(tensor.is_cpu for _, tensor in ordered):
            file_digest, items = self._copy_natively(ordered, iteration)
        else:
            file_digest, items = self._copy_in_python(ordered, iteration)
        copied = time.perf_counter() - started
        # Written through the mapping: on a folder shared over the network, other nodes
        # (and the persist copy) see the bytes only once they are synced (on tmpfs, free).
        self._map.flush()
        digest = checksums.ShardDigest(FileDigest(len(self._map), file_digest),
                                       self._seconds["hash"], time.perf_counter() - started,
                                       items, self._seconds["copy"], copied)
        return [self.records[item.index].result for item, _ in tensor_data], digest

    def _copy_natively(self, ordered: list, iteration: int) -> tuple[str, dict[int, FileDigest]]:
        """The refill loop in C (``stream_copy.c``), in two calls around the rehearsal's kill
        point; the file's digest and each item's."""
        sources = [self._source(record, tensor) for record, tensor in ordered]  # kept alive
        plan = numpy.array([(record.offset, record.data_offset, record.nbytes, record.end,
                             source.data_ptr()) for (record, _), source in zip(ordered, sources)],
                           dtype=numpy.uint64).reshape(-1, 5)
        item_digests = numpy.zeros(len(ordered), dtype=numpy.uint64)
        elapsed_ns = numpy.zeros(2, dtype=numpy.uint64)
        file_state, item_state = self._hash_states
        native_refill.hashes.reset(file_state)
        half = len(ordered) // 2
        for first, last in ((0, half), (half, len(ordered))):
            if first == half:
                rehearsal.kill_point("slot-copy", iteration)
            native_refill.refill(self._address, plan[first:].ctypes.data, last - first, COPY_CHUNK,
                                 *native_refill.hash_functions, file_state, item_state,
                                 item_digests[first:].ctypes.data, elapsed_ns.ctypes.data)
        self._seconds = {"copy": int(elapsed_ns[0]) / 1e9, "hash": int(elapsed_ns[1]) / 1e9}
        return f"{native_refill.hashes.digest(file_state):016x}", {
            record.offset: FileDigest(record.end - record.offset, f"{int(value):016x}")
            for (record, _), value in zip(ordered, item_digests)}

    def _copy_in_python(self, ordered: list, iteration: int) -> tuple[str, dict[int, FileDigest]]:
        """The refill loop where C's is not at hand, and from a pinned mapping on CUDA."""
        landed = self._start_device_copies(ordered) if self._pinned else None
        file_hash, items = xxhash.xxh3_64(), {}
        with memoryview(self._map) as view:
            for position, (record, tensor) in enumerate(ordered):
                if position == len(ordered) // 2:
                    rehearsal.kill_point("slot-copy", iteration)
                hashers = (file_hash, xxhash.xxh3_64())
                if landed is None:
                    self._copy_and_hash(record, tensor, view, hashers)
                else:
                    clock = time.perf_counter()
                    landed[position].synchronize()
                    self._seconds["copy"] += time.perf_counter() - clock
                    self._hash(view, record.offset, record.end, hashers)
                items[record.offset] = FileDigest(record.end - record.offset, hashers[1].hexdigest())
        return file_hash.hexdigest(), items

    def _start_device_copies(self, ordered: list) -> list[torch.cuda.Event]:
        """Every tensor's device-to-host copy into the pinned mapping, queued at once; one
        event per tensor, so each is hashed as soon as it has landed."""
        done = []
        for record, tensor in ordered:
            self._target(record, tensor).copy_(records.flat_bytes(tensor), non_blocking=True)
            done.append(torch.cuda.Event())
            done[-1].record()
        return done

    def _target(self, record: Record, tensor: torch.Tensor) -> torch.Tensor:
        """The record's bytes in the mapping, as bytes: torch_dist lays records end to end,
        so a record's data sits at any offset, and viewing it as the tensor's dtype raised
        for every one not aligned to its element size."""
        self._check_fits(record, tensor)
        return self._bytes[record.data_offset:record.data_offset + record.nbytes]

    def _check_fits(self, record: Record, tensor: torch.Tensor) -> None:
        """Raw bytes are copied, so both ends are checked first (``Tensor.copy_`` would have
        raised)."""
        if tensor.numel() * tensor.element_size() != record.nbytes \
                or record.data_offset + record.nbytes > len(self._map):
            raise ValueError(f"{tensor.dtype} {tuple(tensor.shape)} does not fit its record "
                             f"({record.nbytes} bytes at {record.data_offset})")

    def _source(self, record: Record, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor's bytes to copy, checked against the record: a contiguous host tensor
        is read where it is (making it a byte view took four dispatcher calls per tensor, a
        tenth of a small model's refill)."""
        self._check_fits(record, tensor)
        return tensor if tensor.is_cpu and tensor.is_contiguous() else records.host_bytes(tensor)

    def _copy_and_hash(self, record: Record, tensor: torch.Tensor, view: memoryview,
                       hashers: tuple) -> None:
        """Chunk by chunk: hashed from the tensor, then copied while in L2; the zip's header
        before the first chunk, its trailer after the last.

        The copy is :data:`copy_bytes`: its streaming stores do not read each target line
        from memory first, as ``memmove``'s do, and the chunk it reads is in the cache, just
        hashed (``benchmarks/refill_floor.py``: the copy with both digests a fifth faster
        than ``memmove`` and hashing the copied bytes, which was itself a quarter faster than
        ``Tensor.copy_`` and its per-call dispatch). The digests are of the bytes meant for
        the file: a copy gone wrong would fail the load's check, not be blessed by it.
        It copies raw bytes, so both ends are checked against the record first
        (``Tensor.copy_`` would have raised)."""
        source = self._source(record, tensor)
        nbytes, data_offset = record.nbytes, record.data_offset
        source_address, target_address = source.data_ptr(), self._address + data_offset
        seconds = self._seconds
        source_view = memoryview((ctypes.c_char * nbytes).from_address(source_address)).cast("B")
        self._hash(view, record.offset, data_offset, hashers)
        for start in range(0, nbytes, COPY_CHUNK):
            length = min(COPY_CHUNK, nbytes - start)
            self._hash(source_view, start, start + length, hashers)
            clock = time.perf_counter()
            copy_bytes(target_address + start, source_address + start, length)
            seconds["copy"] += time.perf_counter() - clock
        self._hash(view, data_offset + nbytes, record.end, hashers)

    def _hash(self, view: memoryview, start: int, end: int, hashers: tuple) -> None:
        clock = time.perf_counter()
        with view[start:end] as piece:
            for hasher in hashers:
                hasher.update(piece)
        self._seconds["hash"] += time.perf_counter() - clock

    def close(self) -> None:
        for state in self._hash_states or ():
            native_refill.hashes.free_state(state)
        if self._pinned:
            from torch.cuda import _pin_memory_utils

            _pin_memory_utils.unpin_memory(self._bytes.data_ptr())
        self._bytes = None  # the map closes only once no tensor views it
        if self._map is not None:
            self._map.close()
        os.close(self._fd)


class MemorySlots(RecordWriter):
    """One rank's view of the tier's two slots, used in turn.

    Every rank calls :meth:`begin` and :meth:`use` at every memory save (rank 0 between
    them :meth:`claim`, whose answer every rank receives), :meth:`write` as the save's
    write function, and :meth:`ended` with the save's agreed outcome."""

    def __init__(self, memory_dir: Path, node_writers: set[int] | None = None) -> None:
        super().__init__()
        self.memory_dir = Path(memory_dir)
        self.node_writers = node_writers
        """In a node-local tier, the ranks writing into this node's folder: the folder also
        holds peer copies of other ranks' files, which a refill does not rewrite."""
        self.file_system = file_system_type(self.memory_dir)
        self.in_place = self.file_system in IN_PLACE_FILE_SYSTEMS
        """Whether slots are refilled; else each save writes its files anew."""
        self._iterations: list[int | None] = [None, None]
        self._files: list[dict[str, _SlotFile]] = [{}, {}]
        self._turn = 0

    def begin(self, structure_kept: bool) -> int | None:
        """The iteration whose slot this save refills, if any; a new structure drops both."""
        if not structure_kept:
            for slot in (0, 1):
                self._drop(slot)
        return self._iterations[self._turn] if self.in_place else None

    def claim(self, iteration: int | None, target: Path) -> bool:
        """Rank 0: make the slot of ``iteration`` the folder ``target`` (True), or make
        ``target`` afresh when that checkpoint is pinned by a persist copy, is a node-local
        tier's newest whole copy or newest replicated checkpoint, is named by the tracker, or
        is gone."""
        if iteration is not None and not target.exists():
            previous = iteration_dir(self.memory_dir, iteration)
            with tracker_lock(self.memory_dir):
                if previous.is_dir() and iteration not in kept_memory_checkpoints(self.memory_dir):
                    # .metadata first: a folder killed with it and no manifest would load,
                    # unverified, as a checkpoint of another tool's
                    for name in (DCP_METADATA_FILE, MANIFEST_NAME):
                        (previous / name).unlink(missing_ok=True)
                    previous.rename(target)
                    self._drop_foreign_files(target)
                    return True
        target.mkdir(parents=True, exist_ok=True)
        return False

    def _drop_foreign_files(self, folder: Path) -> None:
        """A node-local slot keeps only its own ranks' tensor files: a peer copy (another
        node's shards, rank 0's files, a kept manifest) would sit there at its size but with
        the old iteration's bytes, until ftmaster copies the new ones."""
        if self.node_writers is None:
            return
        for path in folder.iterdir():
            if path.is_file() and writer_rank(path.name) not in self.node_writers:
                path.unlink(missing_ok=True)

    def use(self, refilled: bool) -> None:
        """Every rank: whether the slot's files are the ones rank 0's claim kept."""
        if not refilled:
            self._drop(self._turn)

    def ended(self, iteration: int, complete: bool) -> None:
        """The save's agreed outcome: the slot now holds ``iteration``; or, after a failure
        (a full tier, say), neither slot holds anything: the other's checkpoint is left to the
        pruning, which may take it once a disk save supersedes it. Kept mapped, its pages
        stayed held by every rank, and a short tier stayed short for good."""
        if complete:
            self._iterations[self._turn] = iteration
            self._turn ^= 1
        else:
            for slot in (0, 1):
                self._drop(slot)

    def kept_iterations(self) -> set[int]:
        return {iteration for iteration in self._iterations if iteration is not None}

    def write_tensors(self, path: Path, name: str, tensor_data: list, iteration: int) -> list[WriteResult]:
        if not self.in_place:  # never mapped
            return [record.result for record in records.set_up_file(
                path, name, tensor_data, fsync=False, report=self.keep_digest).values()]
        slot_files = self._files[self._turn]
        slot_file = slot_files.get(name)
        if slot_file is not None and records.fits(slot_file.records, tensor_data):
            written, digest = slot_file.refill(tensor_data, iteration)
            self.keep_digest(path, digest)
            return written
        if slot_files.pop(name, None) is not None:
            slot_file.close()
        slot_files[name] = _SlotFile.set_up(path, name, tensor_data, self.keep_digest)
        return [record.result for record in slot_files[name].records.values()]

    def _drop(self, slot: int) -> None:
        for slot_file in self._files[slot].values():
            slot_file.close()
        self._files[slot] = {}
        self._iterations[slot] = None

    def close(self) -> None:
        for slot in (0, 1):
            self._drop(slot)
