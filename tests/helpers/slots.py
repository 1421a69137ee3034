"""The memory tier's slots driven in one process, as the checkpointer drives them."""

from __future__ import annotations

import io
import queue

import torch
from torch.distributed.checkpoint.planner_helpers import _create_write_items

from ftmaster.recovery.checkpoints import iteration_dir
from ftmaster.recovery.manifest import MANIFEST_NAME
from megatron.training.memory_slots import MemorySlots
from megatron.training.records import DiskRecords

SHARD = "__0_0.distcp"


def buckets(tensors: dict, blob: bytes) -> list:
    tensor_data = [(_create_write_items(name, tensor)[0], tensor) for name, tensor in tensors.items()]
    byte_data = [(_create_write_items("rng", io.BytesIO(blob))[0], io.BytesIO(blob))]
    return [("", SHARD, (byte_data, tensor_data))]


def save(slots: MemorySlots, memory, iteration: int, tensors: dict, blob: bytes = b"rng",
         kept: bool = True):
    """One save as the checkpointer drives it; whether the slot was refilled, and the results."""
    target = iteration_dir(memory, iteration)
    refilled = slots.claim(slots.begin(kept), target)
    slots.use(refilled)
    results = queue.Queue()
    slots.write(target, iteration, 0, buckets(tensors, blob), results)
    written = results.get_nowait()
    assert not isinstance(written, Exception), written
    (target / MANIFEST_NAME).write_text("{}")  # complete, as rank 0 would make it
    slots.ended(iteration, True)
    return refilled, [result for results in written.values() for result in results]


def read_back(folder, result):
    info = result.storage_data
    with open(folder / info.relative_path, "rb") as handle:
        handle.seek(info.offset)
        data = handle.read(info.length)
    if result.index.fqn == "rng":
        return data
    return torch.load(io.BytesIO(data), weights_only=True)


def disk_save(records: DiskRecords, folder, tensors: dict, kept: bool = True) -> list:
    """One disk save of ``tensors`` (and an object) through ``records``; its write results."""
    folder.mkdir(parents=True)
    records.begin(kept)
    results = queue.Queue()
    records.write(folder, 1, 0, buckets(tensors, b"rng state"), results)
    written = results.get_nowait()
    assert not isinstance(written, Exception), written
    return [result for results in written.values() for result in results]
