"""A checkpoint's manifest, ``ftmaster_save.json``: why it was taken, and each file's checksum.

::

    {"kind": "periodic", "iteration": 20, "checksum": "xxh3_64",
     "files": {"common.pt": {"bytes": 5120, "digest": "9f0c..."},
               "__0_0.distcp": {"bytes": 3145728, "digest": "41aa..."}, ...},
     "items": {"__0_0.distcp": [[0, 1512, "77e1..."], [1512, 3144216, "c3d0..."]], ...}}

The manifest is written after every other file of the checkpoint and before the tracker
moves, so a checkpoint that has one is complete. Each digest is computed where the bytes
already are in memory, as they are written (:class:`DigestingWriter`), never by reading the
file back. Validation re-reads the files and compares: a checkpoint whose bytes changed since
(a flipped bit, 4 KB of garbage in the middle of a shard) fails it, whatever its size.
Checkpoints written before manifests existed, or by other tools, have none and are validated
by their structure alone.

``items`` gives, for each torch_dist shard, the checksum of every item in it (``[offset,
bytes, digest]``, the byte ranges torch's ``.metadata`` points at). A load then checks each
item as it reads it (:func:`item_problem`), so every byte of a shard is read once, and bytes
the load does not need are not read at all. Manifests without ``items`` are checked file by
file before the load, as before.

xxh3_64 hashes at about 20 GB/s on one core, so hashing costs a few per cent of a save that
writes at disk or memory speed; crc32 would cost ten times more.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import xxhash

from ftmaster.recovery.writeback import Writeback
from ftmaster.runfiles import atomic_write_text

MANIFEST_NAME = "ftmaster_save.json"
HELD_MANIFEST_NAME = ".ftmaster_save.held.json"
"""A node-local memory tier's copy of a manifest whose folder here is not whole (it holds some
nodes' shards): what its peers read to copy or persist the checkpoint from the nodes that
hold each file. Never loaded: a folder without ``MANIFEST_NAME`` is no checkpoint."""
CHECKSUM = "xxh3_64"
SAVE_KINDS = ("periodic", "emergency", "exit", "final", "replica")
_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileDigest:
    """A file's size and checksum as its writer saw it."""

    bytes: int
    digest: str

    def as_json(self) -> dict:
        return {"bytes": self.bytes, "digest": self.digest}


MALFORMED_JSON = (ValueError, TypeError, KeyError, AttributeError, OverflowError,
                  RecursionError)
"""What reading a damaged or foreign JSON record raises: OverflowError for a size of 1e999
(inf), RecursionError for JSON nested past the parser's depth (either, raised, ended a load
or the supervisor in a traceback)."""


def file_digests(files: Mapping) -> dict[str, FileDigest]:
    """A JSON record's ``files`` (name -> {"bytes", "digest"}); one of :data:`MALFORMED_JSON`
    when it is not one."""
    return {name: FileDigest(int(entry["bytes"]), str(entry["digest"]))
            for name, entry in files.items()}


def digest_bytes(data: bytes | memoryview) -> FileDigest:
    return FileDigest(len(data), xxhash.xxh3_64(data).hexdigest())


def digest_file(path: Path) -> FileDigest:
    """Read ``path`` once, in chunks; raises OSError when it cannot be read."""
    hasher, size = xxhash.xxh3_64(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_READ_CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    return FileDigest(size, hasher.hexdigest())


class DigestingWriter:
    """A binary file opened for writing that hashes every byte on its way to the file.

    It offers what torch_dist's writer uses (``write``, ``tell``, ``flush``, ``fileno``,
    ``close``, a context manager) and nothing that would move the position: a ``seek`` would
    make the digest describe other bytes than the file's. ``hash_seconds`` and
    ``open_seconds`` tell what hashing cost against the whole write; ``io_seconds`` is the
    time in the file's own ``write`` (its writeback pacing included, :mod:`writeback`), and
    ``item_seconds`` the time between the :meth:`begin_item` and :meth:`end_item` of each
    item (its serialisation included).
    """

    def __init__(self, path: str | os.PathLike, mode: str = "wb") -> None:
        self.path = Path(path)
        self._file = open(path, mode)
        self._hasher = xxhash.xxh3_64()
        self._item: tuple[int, xxhash.xxh3_64, float] | None = None
        self.items: dict[int, FileDigest] = {}
        """Offset -> digest of each item written between :meth:`begin_item` and :meth:`end_item`."""
        self.bytes = 0
        self.hash_seconds = self.io_seconds = self.item_seconds = 0.0
        self._opened = time.perf_counter()
        self.open_seconds = 0.0
        self._writeback = Writeback(self._file.fileno())

    def write(self, data) -> int:
        start = time.perf_counter()
        self._hasher.update(data)
        if self._item is not None:
            self._item[1].update(data)
        hashed = time.perf_counter()
        self.hash_seconds += hashed - start
        written = self._file.write(data)
        self.bytes += written
        if self._writeback.due(self.bytes):
            self._file.flush()
            self._writeback.written(self.bytes)
        self.io_seconds += time.perf_counter() - hashed
        return written

    def begin_item(self) -> None:
        self._item = (self.bytes, xxhash.xxh3_64(), time.perf_counter())

    def end_item(self) -> None:
        offset, hasher, started = self._item
        self.items[offset] = FileDigest(self.bytes - offset, hasher.hexdigest())
        self.item_seconds += time.perf_counter() - started
        self._item = None

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
            self.open_seconds = time.perf_counter() - self._opened

    @property
    def closed(self) -> bool:
        return self._file.closed

    def digest(self) -> FileDigest:
        return FileDigest(self.bytes, self._hasher.hexdigest())

    def __enter__(self) -> "DigestingWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class Manifest:
    """The parsed ``ftmaster_save.json`` of one checkpoint."""

    kind: str | None
    iteration: int | None
    files: Mapping[str, FileDigest]
    """Empty for a manifest written before checksums existed (``{"kind": ...}`` only)."""
    items: Mapping[str, Mapping[int, FileDigest]] = field(default_factory=dict)
    """Shard name -> item offset -> digest; empty when the writer recorded none."""
    checksummed: bool = False
    """Whether it names its checksum: written with checksums, so it must list its files."""

    @property
    def lost_its_files(self) -> bool:
        """Written with checksums, and its file list gone ("files" one flipped bit from
        "filgs"): taken as a manifest of before checksums, it left every file unchecked."""
        return self.checksummed and not self.files

    @property
    def total_bytes(self) -> int:
        return sum(entry.bytes for entry in self.files.values())

    def items_cover(self, name: str) -> bool:
        """Whether ``name``'s items tile the whole file, so checking them checks every byte."""
        end = 0
        for offset, entry in sorted(self.items.get(name, {}).items()):
            if offset != end:
                return False
            end += entry.bytes
        return name in self.files and end == self.files[name].bytes


def write_manifest(folder: Path, kind: str, iteration: int, files: Mapping[str, FileDigest],
                   items: Mapping[str, Mapping[int, FileDigest]] | None = None) -> None:
    """Write the manifest durably (temp file, fsync, rename, fsync of the folder)."""
    if kind not in SAVE_KINDS:
        raise ValueError(f"unknown save kind {kind!r}; expected one of {SAVE_KINDS}")
    body = {"kind": kind, "iteration": iteration, "checksum": CHECKSUM,
            "files": {name: files[name].as_json() for name in sorted(files)}}
    if items:
        body["items"] = {name: [[offset, entry.bytes, entry.digest]
                                for offset, entry in sorted(items[name].items())]
                         for name in sorted(items)}
    # Unindented: json's C encoder (indented, it falls back to Python: 1.9 ms against 0.24 ms
    # for a 77 MB checkpoint's items, on the save's path).
    atomic_write_text(Path(folder) / MANIFEST_NAME, json.dumps(body) + "\n")


def read_manifest(folder: Path, name: str = MANIFEST_NAME) -> Manifest | None:
    """The manifest (or the one under ``name``), or None when there is none or it cannot be
    parsed."""
    try:
        text = (Path(folder) / name).read_text()
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    return parse_manifest(text)


def parse_manifest(text: str | bytes) -> Manifest | None:
    """:func:`read_manifest` of a manifest's text, for a caller that keeps that text."""
    try:
        body = json.loads(text)
        files = file_digests(body.get("files") or {})
        items = {name: {int(offset): FileDigest(int(size), str(digest))
                        for offset, size, digest in entries}
                 for name, entries in (body.get("items") or {}).items()}
    except MALFORMED_JSON:
        return None
    if body.get("checksum", CHECKSUM) != CHECKSUM or \
            not all(map(is_plain_file_name, files.keys() | items.keys())):
        return None
    kind = body.get("kind")
    iteration = body.get("iteration")
    return Manifest(kind if kind in SAVE_KINDS else None,
                    iteration if isinstance(iteration, int) else None, files, items,
                    "checksum" in body)


def is_plain_file_name(name: str) -> bool:
    """Whether a manifest's file name names a file in its checkpoint's folder: a damaged or
    hand-edited one could lead a check, a persist copy or a peer copy outside it."""
    return name not in ("", ".", "..") and "\0" not in name and Path(name).name == name


def known_manifest_name(folder: Path) -> str | None:
    """``MANIFEST_NAME`` for a complete folder, else ``HELD_MANIFEST_NAME`` for one holding
    part of a node-local checkpoint, else None."""
    for name in (MANIFEST_NAME, HELD_MANIFEST_NAME):
        if (Path(folder) / name).is_file():
            return name
    return None


def is_whole(folder: Path) -> bool:
    """A manifest, and every file it lists there at its size (a few stats: a node-local memory
    checkpoint has its manifest before peer copies bring the other nodes' shards)."""
    manifest = read_manifest(folder)
    return manifest is not None and size_problem(folder, manifest) is None


def size_problem(folder: Path, manifest: Manifest, missing_ok: bool = False) -> str | None:
    """The first file the manifest lists that is missing (unless ``missing_ok``: a peer holds
    it) or of another size (a few stats)."""
    for name, entry in sorted(manifest.files.items()):
        try:
            size = (Path(folder) / name).stat().st_size
        except OSError:
            if missing_ok:
                continue
            return f"{name} is missing"
        if size != entry.bytes:
            return f"{name} has {size} bytes, the manifest says {entry.bytes}"
    return None


def digest_problem(folder: Path, manifest: Manifest, names: Iterable[str]) -> str | None:
    """The first of ``names`` whose bytes no longer match the manifest, read in full."""
    for name in names:
        expected = manifest.files[name]
        try:
            found = digest_file(Path(folder) / name)
        except OSError as error:
            return f"{name} cannot be read ({error.strerror or error})"
        if found != expected:
            return _mismatch(name, found, expected)
    return None


class ChecksumMismatch(ValueError):
    """Bytes read are not what their writer wrote: its message says which."""


def item_problem(manifest: Manifest, name: str, offset: int, data: bytes) -> str | None:
    """Whether the ``data`` read at ``offset`` of shard ``name`` is the item the writer wrote."""
    expected = manifest.items.get(name, {}).get(offset)
    if expected is None:
        return f"{name} has no item at byte {offset} in the manifest"
    return bytes_problem(name, data, expected, f" in the item at byte {offset}")


def bytes_problem(name: str, data: bytes, expected: FileDigest, where: str = "") -> str | None:
    """Whether ``data``, read from ``name``, is what its writer wrote."""
    found = digest_bytes(data)
    return None if found == expected else _mismatch(name, found, expected, where)


def _mismatch(name: str, found: FileDigest, expected: FileDigest, where: str = "") -> str:
    if found.bytes != expected.bytes:
        return (f"{name} checksum mismatch{where} ({found.bytes} bytes, the manifest says "
                f"{expected.bytes})")
    return (f"{name} checksum mismatch{where} ({CHECKSUM} {found.digest}, the manifest says "
            f"{expected.digest})")
