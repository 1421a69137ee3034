"""torch_dist's tensor records, laid out once and then written from the tensors' own memory.

torch_dist stores each tensor as one ``torch.save`` record (a small zip: a pickle naming the
dtype, shape and storage, then the tensor's bytes, then the zip's directory) at an offset
that ``.metadata`` records. While the state keeps its structure (:mod:`save_structure`), a
record differs from one save to the next only in the tensor's bytes and the zip's CRC-32,
which ``torch.load`` does not check. So the first save of a structure writes each file as
torch_dist does and learns, with torch's own zip reader (``get_record_offset``), where each
tensor's bytes sit; later saves write the record's header and trailer as learnt and the
tensor's bytes straight from its memory: no pickling, no CRC pass, no writer processes, one
large write per tensor. Files and items are hashed on the way, as :mod:`checksums` does.

Byte items (megatron-core's ShardedObjects, e.g. the RNG states) change length from save to
save, so they go to a small file of their own (``__<rank>_objects.distcp``), written afresh,
end to end, as torch's ``_write_item`` lays them out (:func:`write_byte_items`).

:class:`RecordWriter` is the save's write function, in the rank (what
``write_preloaded_data_multiproc`` is to torch_dist's writer processes, with the same
arguments and the results left where torch_dist's finalize looks for them).
:class:`DiskRecords` writes each disk save's files afresh; :mod:`memory_slots` refills the
memory tier's files in place.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from . import checksums

CHUNK = 512 << 10  # hashed while still in L2, then written or copied
_TRANSFORMS = _StorageWriterTransforms()  # no stream extensions, as torch_dist's writer


def objects_file(rank: int) -> str:
    return f"__{rank}_objects.distcp"


@dataclass(frozen=True)
class Record:
    """Where one tensor item sits in its file, and the bytes around the tensor's."""

    result: WriteResult
    """What the first write reported (the record's offset and length in the file)."""
    data_offset: int
    """Of the tensor's bytes, from the start of the file."""
    dtype: torch.dtype
    shape: torch.Size
    header: bytes
    trailer: bytes

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    @property
    def offset(self) -> int:
        return self.result.storage_data.offset

    @property
    def end(self) -> int:
        """Of the whole record (its trailer included), from the start of the file."""
        return self.offset + self.result.storage_data.length


class _Window(io.RawIOBase):
    """One record of a file, as a file of its own (what torch's zip reader takes)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._position = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer) -> int:
        wanted = max(0, min(len(buffer), self._length - self._position))
        data = os.pread(self._fd, wanted, self._start + self._position)
        buffer[:len(data)] = data
        self._position += len(data)
        return len(data)


def _learnt(fd: int, result: WriteResult, tensor: torch.Tensor) -> Record:
    """A written record's layout: torch's zip reader finds the tensor's bytes in it."""
    info = result.storage_data
    reader = torch._C.PyTorchFileReader(_Window(fd, info.offset, info.length))
    data_offset = info.offset + reader.get_record_offset("data/0")
    data_end = data_offset + tensor.numel() * tensor.element_size()
    return Record(result, data_offset, tensor.dtype, tensor.shape,
                  os.pread(fd, data_offset - info.offset, info.offset),
                  os.pread(fd, info.offset + info.length - data_end, data_end))


def _writable_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """What torch.save should see: on CPU, contiguous, owning exactly its bytes (a record's
    layout is then the tensor's shape alone, as every later write lays it out)."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def set_up_file(path: Path, storage_key: str, tensor_data: list, fsync: bool,
                report: checksums.DigestReport) -> dict[MetadataIndex, Record]:
    """Write the items as torch_dist does, each tensor brought to the host only as its turn
    comes, and learn where everything went."""
    written = checksums.write_items(
        path, ((item, _writable_cpu(tensor)) for item, tensor in tensor_data), storage_key,
        _TRANSFORMS, fsync, report)
    with open(path, "rb") as handle:
        return {item.index: _learnt(handle.fileno(), result, tensor)
                for (item, tensor), result in zip(tensor_data, written)}


def write_byte_items(path: Path, items: list, storage_key: str, fsync: bool,
                     report: checksums.DigestReport) -> list[WriteResult]:
    """Write ``(write_item, BytesIO)`` pairs into a new file, each item's bytes as they are
    where the last one ended, with the file's and each item's digest reported; torch's write
    results. What torch's ``_write_item`` makes of a byte item with no stream extensions, less
    its per-item cost (a class made for the item's stream wrapper, and a flush to the file):
    80 us an item, and a 77 MB checkpoint's rank writes 17 at every save."""
    results = []
    with checksums.shard_writer(path, report) as stream:
        for item, data in items:
            offset = stream.bytes
            stream.begin_item()
            stream.write(data.getbuffer())
            stream.end_item()
            length = stream.bytes - offset
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(storage_key, offset, length)))
        if fsync:
            stream.flush()
            os.fsync(stream.fileno())
    return results


def fits(records: dict[MetadataIndex, Record], tensor_data: list) -> bool:
    """Whether these are the items the records were learnt for, with the same dtypes and shapes."""
    if len(tensor_data) != len(records):
        return False
    return all(record is not None and record.dtype == tensor.dtype and record.shape == tensor.shape
               for record, tensor in ((records.get(item.index), tensor) for item, tensor in tensor_data))


def in_file_order(records: dict[MetadataIndex, Record], tensor_data: list) -> list[tuple[Record, torch.Tensor]]:
    return sorted(((records[item.index], tensor) for item, tensor in tensor_data),
                  key=lambda pair: pair[0].offset)


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in row-major order, as a flat uint8 tensor where it is (a strided
    one copied contiguous there first: a strided view's ``reshape`` is a view still)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in row-major order, as a flat uint8 tensor on the host."""
    return flat_bytes(tensor.detach().to("cpu"))


class RecordWriter:
    """The save's write function for one rank; subclasses say how a bucket's tensors go out."""

    durable = False
    """Whether every file is fsynced before the write reports."""

    def __init__(self) -> None:
        self.digests: dict[str, checksums.ShardDigest] = {}
        """Each file's digest from the last write, by name: handed over in the rank, where
        a writer process leaves a sidecar file (0.5 ms each to write, and again to read)."""

    def keep_digest(self, path: Path, digest: checksums.ShardDigest) -> None:
        self.digests[path.name] = digest

    @staticmethod
    def files(rank: int, write_buckets: list) -> list[str]:
        """The files this rank writes for these buckets."""
        names = [name for _, name, (_, tensors) in write_buckets if tensors]
        if any(objects for _, _, (objects, _) in write_buckets):
            names.append(objects_file(rank))
        return names

    def write(self, folder: Path, iteration: int, rank: int, write_buckets: list,
              results_queue) -> None:
        """``write_preloaded_data_multiproc``'s arguments (after the save's folder and
        iteration): each bucket's tensors into its file, the byte items into their own
        file, the results (or the error) where torch_dist's finalize looks for them."""
        try:
            results_queue.put(self._write_buckets(folder, iteration, rank, write_buckets))
        except Exception as error:  # as torch_dist's writers report theirs: finalize raises it
            results_queue.put(error)

    def _write_buckets(self, folder: Path, iteration: int, rank: int,
                       write_buckets: list) -> dict[int, list[WriteResult]]:
        self.digests = {}
        results = {index: self.write_tensors(folder / name, name, tensor_data, iteration)
                   if tensor_data else []
                   for index, (_, name, (_, tensor_data)) in enumerate(write_buckets)}
        objects = [pair for _, _, (byte_data, _) in write_buckets for pair in byte_data]
        if objects:
            name = objects_file(rank)
            results[0] = results[0] + write_byte_items(folder / name, objects, name,
                                                       self.durable, self.keep_digest)
        return results

    def write_tensors(self, path: Path, name: str, tensor_data: list, iteration: int) -> list[WriteResult]:
        raise NotImplementedError


class DiskRecords(RecordWriter):
    """A rank's synchronous disk saves: each file written afresh, in the rank, from the
    records learnt at the structure's first save, then fsynced."""

    durable = True

    def __init__(self) -> None:
        super().__init__()
        self._learnt: dict[str, dict[MetadataIndex, Record]] = {}

    def begin(self, structure_kept: bool) -> None:
        """Called at every save; a new structure is learnt again."""
        if not structure_kept:
            self._learnt.clear()

    def write_tensors(self, path: Path, name: str, tensor_data: list, iteration: int) -> list[WriteResult]:
        records = self._learnt.get(name)
        if records is None or not fits(records, tensor_data):
            self._learnt[name] = set_up_file(path, name, tensor_data, fsync=True,
                                             report=self.keep_digest)
            return [record.result for record in self._learnt[name].values()]
        with checksums.shard_writer(path, self.keep_digest) as stream:
            for record, tensor in in_file_order(records, tensor_data):
                stream.begin_item()
                stream.write(record.header)
                source = host_bytes(tensor)
                for start in range(0, record.nbytes, CHUNK):
                    stream.write(source[start:start + CHUNK].numpy())
                stream.write(record.trailer)
                stream.end_item()
            stream.flush()
            os.fsync(stream.fileno())
        return [records[item.index].result for item, _ in tensor_data]

