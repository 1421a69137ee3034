"""A checkpoint's ``.metadata``, pickled once for as long as nothing in it changes.

torch's ``FileSystemWriter.finish`` pickles the global metadata with every rank's write
results at every save. With a kept structure (:mod:`save_structure`) both are the same from
one save to the next: megatron-core hands back its cached global metadata, and the write
results name the same files, items, offsets and sizes. Pickling some 400 dataclasses took
4.5 ms of rank 0's time in each 77 MB save, and rank 0 does it while every other rank waits
for the agreement's outcome. So the bytes are kept and written again while both are equal.

What is written differs from torch's own ``finish`` in two fields, so that the bytes can
stay the same:

- megatron-core's ``all_local_plans`` (every rank's save plan, attached to the global
  metadata) is left out. Only a later save's planner reads it, after a load, to skip one
  gather; without it that save plans (``strategies/torch.py``), and no loader reads it.
- ``storage_meta`` (the folder the save was written to and a save id) is None, as in the
  checkpoints torch wrote before 2.4; its reader fills in its own (``read_metadata``). The
  folder is a memory slot's previous name after a refill, and a persisted checkpoint's
  memory folder after a persist copy, so it was never a place to read from.

Rank 0 writes the bytes through a temporary file, fsynced and renamed, as torch does
(``ftmaster.runfiles.atomic_write_bytes``).
"""

from __future__ import annotations

import copy
import pickle

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata


class MetadataBytes:
    """``.metadata``'s bytes, made afresh only when the global metadata or a write result
    changed."""

    def __init__(self) -> None:
        self._made_from: tuple[Metadata, list] | None = None
        self._bytes = b""

    def of(self, global_metadata: Metadata, results: list[list]) -> bytes:
        """The bytes for megatron-core's global metadata and every rank's write results."""
        if (self._made_from is None or self._made_from[0] is not global_metadata
                or self._made_from[1] != results):
            self._bytes = pickle.dumps(_as_written(global_metadata, results))
            self._made_from = (global_metadata, results)
        return self._bytes


def _as_written(global_metadata: Metadata, results: list[list]) -> Metadata:
    """A copy of the global metadata as torch's ``finish`` completes it, less the two fields
    (see the module docstring); megatron-core's cached one is left as it was."""
    metadata = copy.copy(global_metadata)
    vars(metadata).pop("all_local_plans", None)
    metadata.version = CURRENT_DCP_VERSION
    metadata.storage_data = {result.index: result.storage_data
                             for rank_results in results for result in rank_results}
    metadata.storage_meta = None
    return metadata

