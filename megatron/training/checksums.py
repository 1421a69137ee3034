"""Digests of torch_dist shards, taken by the writer processes while the bytes go out.

megatron-core's ``FileSystemWriterAsync.write_preloaded_data`` opens each shard with the
name ``open`` of its module. :func:`install` points that name (in that module only) at
:func:`_digesting_open`, which hands back a :class:`DigestingWriter` for ``.distcp`` files:
every byte is hashed on its way to the file, with no second read. The writers run in forked
processes (or a spawned persistent worker), so the digest comes back the way the bytes went:
a small sidecar file ``<shard>.digest`` written when the shard is closed, which the rank reads
at finalize time and sends to rank 0 for the manifest.

The save request's write function is wrapped by :func:`write_with_digests`, a module-level
function, so the hook is installed wherever the request runs: in the rank, in a fork of it,
or in a spawned worker that unpickles it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ftmaster.guard import die_with_parent
from ftmaster.recovery.manifest import DigestingWriter, FileDigest

SIDECAR_SUFFIX = ".digest"


class _SidecarWriter(DigestingWriter):
    """A digesting writer that leaves its digest beside the file when it closes."""

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        body = {**self.digest().as_json(), "hash_seconds": self.hash_seconds,
                "write_seconds": self.open_seconds}
        sidecar_path(self.path).write_text(json.dumps(body))


def sidecar_path(shard: Path) -> Path:
    return Path(str(shard) + SIDECAR_SUFFIX)


def _digesting_open(path, mode="r", *args, **kwargs):
    if "w" in mode and str(path).endswith(".distcp"):
        return _SidecarWriter(path, mode)
    return open(path, mode, *args, **kwargs)


def install() -> None:
    """Make torch_dist's shard writer hash what it writes (idempotent, module-scoped)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.open = _digesting_open


def write_with_digests(write: Callable, *args, **kwargs):
    """Run a save request's write function with the hook installed in this process.

    In megatron-core's persistent writer (spawned, so no fork hook reaches it) this is also
    where it learns to die with its rank: a writer outliving a killed rank would hold its
    memory, and its files open, for good."""
    install()
    die_with_parent(os.getppid())
    return write(*args, **kwargs)


@dataclass(frozen=True)
class ShardDigest:
    """What a writer reported for one shard file."""

    digest: FileDigest
    hash_seconds: float
    write_seconds: float


def read_shard_digest(shard: Path) -> ShardDigest:
    """The digest a writer left beside ``shard``; OSError or ValueError when it left none."""
    body = json.loads(sidecar_path(shard).read_text())
    return ShardDigest(FileDigest(int(body["bytes"]), str(body["digest"])),
                       float(body["hash_seconds"]), float(body["write_seconds"]))
