"""Digests of torch_dist shards, taken by the writer processes while the bytes go out.

megatron-core's ``FileSystemWriterAsync.write_preloaded_data`` opens each shard with the
name ``open`` of its module. :func:`install` points that name (in that module only) at
:func:`_digesting_open`, which hands back a :class:`DigestingWriter` for ``.distcp`` files:
every byte is hashed on its way to the file, with no second read. The writers run in forked
processes (or a spawned persistent worker), so the digest comes back the way the bytes went:
a small sidecar file ``<shard>.digest`` written when the shard is closed, which the rank reads
(and removes) at finalize time and sends to rank 0 for the manifest. A rank that writes its
shards itself (:mod:`records`: synchronous and memory saves) is handed each digest directly.

The sidecar also holds each item's digest: :func:`_write_item_with_digest`, installed as the
module's ``_write_item``, brackets every item the writer writes, so a load can check each
item as it reads it instead of reading every shard twice (:mod:`ftmaster.recovery.manifest`).

The save request's write function is wrapped by :func:`write_with_digests`, a module-level
function, so the hook is installed wherever the request runs: in the rank, in a fork of it,
or in a spawned worker that unpickles it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import multiprocessing
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from ftmaster.guard import die_with_parent, forked_children_die_with_this_process
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.filesystem import _write_item as write_item

from ftmaster.peer_files import PeerFile
from ftmaster.recovery.checkpoints import DCP_METADATA_FILE, metadata_digest, unpickled_metadata
from ftmaster.recovery.manifest import (ChecksumMismatch, DigestingWriter, FileDigest, Manifest,
                                        item_problem)

from . import rehearsal

SIDECAR_SUFFIX = ".digest"


DigestReport = Callable[[Path, "ShardDigest"], None]
"""Where a shard's digest goes when its writer closes it."""


class _ShardWriter(DigestingWriter):
    """A digesting writer that reports its digest when it closes: in a sidecar file (from a
    writer process), or straight to the rank's writer (in the rank, :mod:`records`)."""

    def __init__(self, path, mode: str = "wb", report: DigestReport | None = None) -> None:
        super().__init__(path, mode)
        self._report = report or write_sidecar

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._report(self.path, ShardDigest(self.digest(), self.hash_seconds, self.open_seconds,
                                            dict(self.items), self.io_seconds, self.item_seconds))


def write_sidecar(shard: Path, digest: "ShardDigest") -> None:
    """What a writer leaves beside ``shard`` for its rank (see :func:`take_shard_digest`)."""
    body = {**digest.digest.as_json(), "hash_seconds": digest.hash_seconds,
            "write_seconds": digest.write_seconds, "io_seconds": digest.io_seconds,
            "item_seconds": digest.item_seconds,
            "items": [[offset, item.bytes, item.digest] for offset, item in digest.items.items()]}
    sidecar_path(shard).write_text(json.dumps(body))


def shard_writer(path: Path, report: DigestReport) -> DigestingWriter:
    """A new file whose digests (the file's, and each item's between ``begin_item`` and
    ``end_item``) go to ``report`` when it closes."""
    return _ShardWriter(path, "wb", report)


def write_items(path: Path, items: Iterable, storage_key: str, transforms, fsync: bool,
                report: DigestReport) -> list:
    """Write ``(write_item, data)`` pairs into a new file as torch_dist's writer does, the
    file's and every item's digest reported; torch's write results."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    with shard_writer(path, report) as stream:
        results = [_write_item_with_digest(transforms, stream, data, item, storage_key,
                                           serialization_format=SerializationFormat.TORCH_SAVE)
                   for item, data in items]
        if fsync:
            stream.flush()
            os.fsync(stream.fileno())
        return results


def sidecar_path(shard: Path) -> Path:
    return Path(str(shard) + SIDECAR_SUFFIX)


def _digesting_open(path, mode="r", *args, **kwargs):
    if "w" in mode and str(path).endswith(".distcp"):
        return _ShardWriter(path, mode)
    return open(path, mode, *args, **kwargs)


def _os_error_behind(error: Exception) -> Exception:
    """The OS error that ``error`` arose from, if any, else ``error``: a full disk under
    ``torch.save`` can surface as its zip writer's complaint at closing ("unexpected pos"),
    the ENOSPC only in the chain, and the save's reason should name the full disk."""
    seen, cause = set(), error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return error


@functools.wraps(write_item)  # megatron-core inspects its signature for serialization_format
def _write_item_with_digest(transforms, stream, *args, **kwargs):
    """torch's ``_write_item(transforms, stream, data, write_item, storage_key, ...)``, whose
    item is the bytes it adds to ``stream`` (it records ``stream.tell()`` before and after)."""
    if not isinstance(stream, DigestingWriter):
        return write_item(transforms, stream, *args, **kwargs)
    stream.begin_item()
    try:
        result = write_item(transforms, stream, *args, **kwargs)
    except Exception as error:  # a writer process queues it pickled, without its chain
        behind = _os_error_behind(error)
        if behind is error:
            raise
        raise behind from None
    stream.end_item()
    return result


def install() -> None:
    """Make torch_dist's shard writer hash what it writes, file by file and item by item
    (idempotent, module-scoped)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.open = _digesting_open
    filesystem_async._write_item = _write_item_with_digest


def write_with_digests(write: Callable, iteration: int, *args, **kwargs):
    """Run the write function of the save at ``iteration`` with the hook installed in this
    process.

    In megatron-core's persistent writer (spawned, so no fork hook reaches it) this is also
    where it learns to die with its rank, and the writers it forks with it: a writer
    outliving a killed rank, or a worker given up as stuck (:mod:`async_saves`), would hold
    its memory, and its files open, for good."""
    global _dies_with_parent
    install()
    if not _dies_with_parent:
        die_with_parent(os.getppid())
        forked_children_die_with_this_process()
        _ignore_step_wide_sigterm()
        _dies_with_parent = True
    rehearsal.stall_writer(iteration)
    return write(*args, **kwargs)


def _ignore_step_wide_sigterm() -> None:
    """In a writer process (multiprocessing's child of the rank, never the rank itself, whose
    SIGTERM is its exit save's signal): a SIGTERM sent to every process of a job step (SLURM's
    warning before its time limit) killed the persistent writer mid-save, the save in flight
    failed as "its writer process died", and the exit save paid for a new one. It dies with
    its rank, and a save given up kills it with SIGKILL. Only a main thread sets handlers."""
    if multiprocessing.parent_process() is not None and \
            threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


_dies_with_parent = False
"""In this writer process, :func:`write_with_digests` has asked for its own and its forks'
death with their parents (once: the fork hooks would pile up in a persistent worker)."""


@dataclass(frozen=True)
class ShardDigest:
    """What a writer reported for one shard file."""

    digest: FileDigest
    hash_seconds: float
    write_seconds: float
    """From open to close."""
    items: dict[int, FileDigest]
    io_seconds: float = 0.0
    item_seconds: float = 0.0

    def phases(self) -> dict[str, float]:
        """Where the writer's time went: ``serialisation`` (torch.save of each item),
        ``writing`` (the file's write calls), ``hashing``, and ``fsync`` (after the last item
        until closed: megatron-core's fsync, then close)."""
        return {"serialisation": self.item_seconds - self.io_seconds - self.hash_seconds,
                "writing": self.io_seconds, "hashing": self.hash_seconds,
                "fsync": self.write_seconds - self.item_seconds}


def take_shard_digest(shard: Path) -> ShardDigest:
    """The digest a writer left beside ``shard``, its sidecar then removed (the digest goes
    into the manifest, and a torch_dist folder holds only its own files); OSError or
    ValueError when it left none."""
    sidecar = sidecar_path(shard)
    body = json.loads(sidecar.read_text())
    items = {int(offset): FileDigest(int(size), str(digest))
             for offset, size, digest in body.get("items", ())}
    digest = ShardDigest(FileDigest(int(body["bytes"]), str(body["digest"])),
                         float(body["hash_seconds"]), float(body["write_seconds"]), items,
                         float(body.get("io_seconds", 0.0)), float(body.get("item_seconds", 0.0)))
    sidecar.unlink(missing_ok=True)
    return digest


class PeerFallbackFileSystem(FileSystem):
    """torch's local files, and a file this node lacks under ``root`` read from the peers
    that hold it (:class:`ftmaster.peer_files.PeerFile`: one range request per item)."""

    def __init__(self, root: Path, peers: list, counter: list[int]) -> None:
        super().__init__()
        self.root, self.peers, self.counter = Path(root), peers, counter

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        path = Path(path)
        if path.exists() or "r" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with PeerFile(self.peers, str(path.relative_to(self.root)), self._count) as stream:
            yield stream

    def _count(self, size: int) -> None:
        self.counter[1] += size


class SharedMetadataReader(CachedMetadataFileSystemReader):
    """megatron-core's caching reader, whose ``.metadata`` is unpickled once for the structure
    checks before the load and the load itself, while its bytes stay the same
    (:func:`ftmaster.recovery.checkpoints.unpickled_metadata`), and only once they match
    ``expected_metadata``, the manifest's digest of the file (None: nothing to check)."""

    def __init__(self, path, expected_metadata: FileDigest | None = None) -> None:
        super().__init__(path)
        self.expected_metadata = expected_metadata

    def read_metadata(self) -> Metadata:
        """torch's ``FileSystemReader.read_metadata``, the unpickle shared and checked."""
        if self._cached_metadata is None:
            path = self.fs.concat_path(self.path, DCP_METADATA_FILE)
            with self.fs.create_stream(path, "rb") as stream:
                metadata = unpickled_metadata(stream.read(), self.expected_metadata)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._cached_metadata = metadata
        return self._cached_metadata


class VerifyingReader(SharedMetadataReader):
    """The reader of a load, checking each item against the manifest as it reads it.

    torch's ``FileSystemReader.read_data`` asks ``_slice_file`` for each item's bytes. Reading
    them into memory here costs one memory copy before ``torch.load``; it lets the digest be
    checked before anything is unpickled, and the bytes come off the medium once."""

    def __init__(self, path, manifest: Manifest, counter: list[int], peers: list = ()) -> None:
        """``counter``: the bytes checked as read, and (with ``peers``) those read from them."""
        super().__init__(path, metadata_digest(manifest))
        self.manifest = manifest
        self.counter = counter
        if peers:  # a node-local memory checkpoint: what this node lacks, its peers give
            self.fs = PeerFallbackFileSystem(Path(path).parent, list(peers), counter)

    def _slice_file(self, file, sinfo):
        if sinfo.relative_path not in self.manifest.items:  # checked in full before the load
            return super()._slice_file(file, sinfo)
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        problem = item_problem(self.manifest, sinfo.relative_path, sinfo.offset, data)
        if problem is not None:
            raise ChecksumMismatch(problem)
        self.counter[0] += len(data)
        return io.BytesIO(data)


@contextlib.contextmanager
def reads_for_load(manifest: Manifest | None, peers: list = ()):
    """Within it, megatron-core's torch_dist loads read each folder through one reader: a
    :class:`VerifyingReader` when the manifest has item checksums (what this node lacks read
    from ``peers``), else a :class:`SharedMetadataReader` (the files checked in full
    beforehand). Either checks the ``.metadata`` it unpickles against the manifest. Yields a
    list counting the bytes checked as read and the bytes read from peers.

    megatron-core builds its reader inside ``TorchDistLoadShardedStrategy.load`` with the
    module function ``_get_filesystem_reader``, so that name is the one seam (module-scoped,
    undone on exit). Its fully parallel load (more than one data-parallel rank) calls that
    load twice, for the sharded objects and then the tensors: a reader each unpickled
    ``.metadata`` twice, where one reader keeps what it read (it resets the rest per load)."""
    counter = [0, 0]
    original = torch_strategy._get_filesystem_reader
    readers: dict[str, FileSystemReader] = {}

    def new_reader(path) -> FileSystemReader:
        if manifest is not None and manifest.items:
            return VerifyingReader(path, manifest, counter, peers)
        return SharedMetadataReader(path, metadata_digest(manifest))

    def reader_of(path, cache_metadata: bool = False) -> FileSystemReader:
        if str(path) not in readers:
            readers[str(path)] = new_reader(path)
        return readers[str(path)]

    torch_strategy._get_filesystem_reader = reader_of
    logging.getLogger().addFilter(_no_traceback_of_a_mismatch)
    try:
        yield counter
    finally:
        logging.getLogger().removeFilter(_no_traceback_of_a_mismatch)
        torch_strategy._get_filesystem_reader = original


def _no_traceback_of_a_mismatch(record: logging.LogRecord) -> bool:
    """Drops torch's warning, with a traceback, that the global metadata "is not found" when
    the reader refused a ``.metadata`` unlike its manifest: the load fails with that mismatch
    as its reason anyway (torch logs it on the root logger, in ``load_state_dict``)."""
    return not (record.exc_info and isinstance(record.exc_info[1], ChecksumMismatch))
