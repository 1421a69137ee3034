"""The trainer's other CUDA paths, each in one process: a disk save's records written from
device tensors (their bytes brought to the host as each one's turn comes), the device's RNG
streams saved and restored (and left alone for a checkpoint saved on CPU; a replica dump's,
on its own thread, from the rank's GPU), and the batch prefetcher pinning the host batches
the iteration copies to the GPU without blocking."""

import copy

import pytest
import torch
import xxhash
from megatron.core import parallel_state, tensor_parallel

from ftmaster.recovery.manifest import digest_file
from helpers.gpu import needs_gpus
from helpers.replicas import dump_once
from helpers.slots import SHARD, disk_save, read_back
from megatron.training import replicas, training
from megatron.training.checkpointing import _restore_rng, rng_state
from megatron.training.data import BatchPrefetcher
from megatron.training.records import DiskRecords

pytestmark = pytest.mark.gpu


def device_state(seed: int) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return {"a_half": torch.randn(3, device="cuda", generator=generator).to(torch.bfloat16),
            "b_weight": torch.randn(517, 7, device="cuda", generator=generator),
            "c_strided": torch.randn(40, 6, device="cuda", generator=generator).t(),
            "d_double": torch.randn(17, device="cuda", generator=generator).double()}


@needs_gpus(1)
def test_a_disk_save_writes_device_tensors_records_and_their_digests(tmp_path):
    """The first save learns the records (each tensor brought to the host whole), the
    second writes them from ``host_bytes`` of the device tensors: same layout, the second
    state's bytes, and digests of the file written."""
    records = DiskRecords()
    first = disk_save(records, tmp_path / "1", device_state(1))
    second = disk_save(records, tmp_path / "2", device_state(2))
    assert [r.storage_data for r in second] == [r.storage_data for r in first]
    expected = device_state(2)
    for result in second:
        if result.index.fqn != "rng":
            assert torch.equal(read_back(tmp_path / "2", result),
                               expected[result.index.fqn].cpu()), result.index.fqn
    shard = tmp_path / "2" / SHARD
    reported = records.digests[SHARD]
    assert reported.digest == digest_file(shard)
    data = shard.read_bytes()
    for offset, item in reported.items.items():
        assert xxhash.xxh3_64(data[offset:offset + item.bytes]).hexdigest() == item.digest


def draws(tracker) -> tuple[torch.Tensor, torch.Tensor]:
    plain = torch.rand(8, device="cuda")
    with tracker.fork():  # the tensor-parallel stream (dropout inside TP regions)
        forked = torch.rand(8, device="cuda")
    return plain, forked


@needs_gpus(1)
def test_the_device_rng_streams_are_saved_and_restored(capsys):
    torch.cuda.init()
    tensor_parallel.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = rng_state()
    assert saved["rng_device"] == "cuda" and "cuda_rng_state" in saved
    first = draws(tracker)
    assert not torch.equal(first[0], first[1])  # two streams
    _restore_rng([copy.deepcopy(saved)])
    again = draws(tracker)
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    # A checkpoint saved on CPU: its streams cannot go to a CUDA generator; left as they are.
    on_cpu = {key: value for key, value in copy.deepcopy(saved).items() if key != "cuda_rng_state"}
    on_cpu["rng_device"] = "cpu"
    _restore_rng([on_cpu])
    assert not torch.equal(draws(tracker)[0], first[0])
    assert "device RNG streams not restored: saved on cpu, resumed on cuda" in capsys.readouterr().out


class TokenDataset:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict:
        return {"tokens": torch.full((16,), index, dtype=torch.int64)}


@needs_gpus(1)
def test_prefetched_batches_are_pinned_and_reach_the_device_intact(monkeypatch):
    monkeypatch.setattr(parallel_state, "get_data_parallel_rank", lambda *a, **k: 0)
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda *a, **k: 1)
    prefetcher = BatchPrefetcher(TokenDataset(), micro_batch_size=2, num_micro_batches=2,
                                 global_batch_size=4, pin_memory=True)
    try:
        batches = list(prefetcher.iteration(0))
        ahead = list(prefetcher.iteration(4))  # the one built in the background thread
    finally:
        prefetcher.close()
    for batch in batches + ahead:
        assert batch["tokens"].is_pinned()
    on_device = [training._to_device(batch) for batch in ahead]
    torch.cuda.synchronize()
    for host, device in zip(ahead, on_device):
        assert device["tokens"].is_cuda and torch.equal(device["tokens"].cpu(), host["tokens"])
    assert [row[0].item() for b in ahead for row in b["tokens"]] == [4, 5, 6, 7]


@needs_gpus(2)
def test_the_replica_dump_saves_the_cuda_rng_stream_of_its_ranks_gpu(tmp_path, monkeypatch):
    """The dump runs on a thread of its own, and a new thread's current device is GPU 0: a
    dump before any update had committed the streams saved GPU 0's CUDA RNG stream on every
    rank. Here the rank's GPU is 1, its stream seeded apart from GPU 0's."""
    monkeypatch.setattr(replicas, "layout_coordinates", lambda: {"rank": 1})
    seen = []

    def state_dict(iteration: int, consumed: int, rng: dict | None) -> dict:
        seen.append(rng_state()["cuda_rng_state"])  # what the dump saves when rng is None
        raise OSError("the dump stops here")

    torch.cuda.set_device(1)
    try:
        torch.cuda.manual_seed(1234)  # GPU 1's stream only
        dump_once(tmp_path, state_dict)
        assert torch.equal(seen[0], torch.cuda.get_rng_state(1))
        assert not torch.equal(seen[0], torch.cuda.get_rng_state(0))
    finally:
        torch.cuda.set_device(0)
