"""Disk saves written in the rank from the tensors' own memory, with the records learnt at the
structure's first save: the same records torch_dist would write, their digests, and a new
structure learnt again."""

import errno
import io
import os
import pickle
import queue

import pytest

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import SerializationFormat, _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ftmaster.recovery.manifest import digest_file
from ftmaster.recovery.writeback import STEP
from helpers.slots import SHARD, buckets, disk_save, read_back
from megatron.training import checksums
from megatron.training.records import DiskRecords, objects_file, write_byte_items


def state(seed: int, rows: int = 4) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(rows, 6, generator=generator),
            "big": torch.randn(3 * STEP // 4 + 5, generator=generator),  # paced, over 3 steps
            "strided": torch.randn(6, 4, generator=generator).t()}


def test_later_saves_write_the_learnt_records_from_the_tensors_memory(tmp_path):
    records = DiskRecords()
    first = disk_save(records, tmp_path / "1", state(1))
    second = disk_save(records, tmp_path / "2", state(2))
    assert [r.storage_data for r in second] == [r.storage_data for r in first]
    assert (tmp_path / "2" / SHARD).stat().st_size == (tmp_path / "1" / SHARD).stat().st_size
    for result in second:
        got = read_back(tmp_path / "2", result)
        if result.index.fqn == "rng":
            assert got == b"rng state"
        else:
            assert torch.equal(got, state(2)[result.index.fqn])


def test_the_digests_handed_over_are_those_of_the_files_written_and_no_sidecar_is_left(tmp_path):
    records = DiskRecords()
    disk_save(records, tmp_path / "1", state(1))
    disk_save(records, tmp_path / "2", state(2))
    shard = tmp_path / "2" / SHARD
    assert sorted(records.digests) == sorted(path.name for path in (tmp_path / "2").iterdir())
    assert records.digests[objects_file(0)].digest == digest_file(tmp_path / "2" / objects_file(0))
    reported = records.digests[SHARD]
    assert reported.digest == digest_file(shard)
    data = shard.read_bytes()
    assert sum(item.bytes for item in reported.items.values()) == len(data)
    for offset, item in reported.items.items():
        assert xxhash.xxh3_64(data[offset:offset + item.bytes]).hexdigest() == item.digest


def test_a_new_structure_or_shape_is_learnt_again(tmp_path):
    records = DiskRecords()
    disk_save(records, tmp_path / "1", state(1))
    reshaped = disk_save(records, tmp_path / "2", state(2, rows=9))
    weight = next(r for r in reshaped if r.index.fqn == "weight")
    assert torch.equal(read_back(tmp_path / "2", weight), state(2, rows=9)["weight"])
    relearnt = disk_save(records, tmp_path / "3", state(3), kept=False)
    weight = next(r for r in relearnt if r.index.fqn == "weight")
    assert torch.equal(read_back(tmp_path / "3", weight), state(3)["weight"])


def test_a_write_that_fails_reports_the_os_error_behind_it(tmp_path, monkeypatch):
    """A full disk inside torch.save can surface as its zip writer's RuntimeError at closing,
    the ENOSPC only as its context: the OS error is what the save reports (the item writer,
    shared with torch_dist's writer processes, raises it)."""
    def full_disk(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checksums, "write_item", full_disk)
    (tmp_path / "1").mkdir()
    results = queue.Queue()
    DiskRecords().write(tmp_path / "1", 1, 0, buckets(state(1), b"rng state"), results)
    reported = results.get_nowait()
    assert isinstance(reported, OSError) and reported.errno == errno.ENOSPC


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_torch_dist_writer_processes_report_a_full_disk_as_the_os_error():
    """torch_dist's writer processes queue their exception pickled, which drops its chain: the
    item writer raises the ENOSPC itself, not the zip writer's "unexpected pos" it causes."""
    item = WriteItem(index=MetadataIndex("weight"), type=WriteItemType.TENSOR)
    with pytest.raises(OSError) as raised:
        checksums._write_item_with_digest(
            _StorageWriterTransforms(), checksums.shard_writer("/dev/full", lambda *_: None),
            torch.ones(1 << 20), item, "__0_0.distcp", serialization_format=SerializationFormat.TORCH_SAVE)
    assert pickle.loads(pickle.dumps(raised.value)).errno == errno.ENOSPC


def test_byte_items_are_laid_out_and_reported_as_torchs_writer_does(tmp_path):
    """The objects file is written without torch's ``_write_item``: the same bytes, offsets,
    lengths and write results as through it, and the same digests."""
    items = [(WriteItem(MetadataIndex(f"object{index}"), WriteItemType.BYTE_IO), blob)
             for index, blob in enumerate([b"rng state" * 7, b"", b"\x80\x02N.", bytes(range(256))])]
    copies = [(item, io.BytesIO(blob)) for item, blob in items]
    torch_digests, our_digests = {}, {}
    expected = checksums.write_items(tmp_path / "torch", copies, "objects", _StorageWriterTransforms(),
                                     False, lambda path, digest: torch_digests.update({0: digest}))
    copies = [(item, io.BytesIO(blob)) for item, blob in items]
    written = write_byte_items(tmp_path / "ours", copies, "objects", True,
                               lambda path, digest: our_digests.update({0: digest}))
    assert written == expected
    assert (tmp_path / "ours").read_bytes() == (tmp_path / "torch").read_bytes()
    assert our_digests[0].digest == torch_digests[0].digest
    assert our_digests[0].items == torch_digests[0].items
