"""``.metadata`` pickled once while the global metadata and the write results stay the same,
and read back by torch's own reader."""

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata,
                                                   MetadataIndex)
from torch.distributed.checkpoint.storage import WriteResult

from ftmaster.runfiles import atomic_write_bytes
from megatron.training.dcp_metadata import MetadataBytes


def global_metadata() -> Metadata:
    metadata = Metadata({"rng_state": BytesStorageMetadata()})
    metadata.all_local_plans = ["every rank's plan"]  # as megatron-core attaches them
    return metadata


def results(length: int) -> list[list[WriteResult]]:
    return [[WriteResult(MetadataIndex("rng_state"), length, _StorageInfo("__0_objects.distcp", 0, length))]]


def test_the_bytes_are_made_again_only_when_the_metadata_or_a_result_changes():
    made, metadata = MetadataBytes(), global_metadata()
    first = made.of(metadata, results(8))
    assert made.of(metadata, results(8)) is first
    assert made.of(metadata, results(9)) != first
    assert made.of(global_metadata(), results(9)) is not made.of(metadata, results(9))
    assert metadata.all_local_plans and metadata.storage_data is None  # megatron-core's is left alone


def test_torch_reads_what_is_written_with_its_own_storage_meta(tmp_path):
    atomic_write_bytes(tmp_path / ".metadata", MetadataBytes().of(global_metadata(), results(8)))
    assert [path.name for path in tmp_path.iterdir()] == [".metadata"]
    reader = FileSystemReader(tmp_path)
    read = reader.read_metadata()
    assert read.state_dict_metadata == {"rng_state": BytesStorageMetadata()}
    assert read.storage_data == {MetadataIndex("rng_state"): _StorageInfo("__0_objects.distcp", 0, 8)}
    assert read.storage_meta.load_id == reader.load_id
    assert not hasattr(read, "all_local_plans")
    assert read.version == CURRENT_DCP_VERSION
