"""The memory tier's refill from device memory: each tensor copied from the GPU straight into
the slot's mapping, registered with the driver as pinned memory (no staging copy), and hashed
once it has landed; then the trainer's own refilled memory checkpoint, resumed on the GPU."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import xxhash

from ftmaster.recovery.checkpoints import iteration_dir
from ftmaster.recovery.manifest import digest_file
from helpers.gpu import needs_gpus
from helpers.slots import SHARD, read_back, save
from helpers.trainer import SMALL_GPT, iterations, run_trainer
from megatron.training.memory_slots import MemorySlots

pytestmark = pytest.mark.gpu


def device_state(seed: int) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return {"weight": torch.randn(4096, 4096, device="cuda", generator=generator),  # 64 MB
            "half": torch.randn(1024, 1000, device="cuda", generator=generator).to(torch.bfloat16),
            "strided": torch.randn(512, 256, device="cuda", generator=generator).t()}


@needs_gpus(1)
def test_a_refill_copies_device_tensors_into_the_pinned_slot(tmp_path):
    slots = MemorySlots(tmp_path)
    try:
        for iteration in (1, 2, 3):
            refilled, written = save(slots, tmp_path, iteration, device_state(iteration))
        assert refilled
        folder = iteration_dir(tmp_path, 3)
        assert_read_back(folder, written, device_state(3))
        assert slots.digests[SHARD].digest == digest_file(folder / SHARD)
    finally:
        slots.close()


@needs_gpus(1)
def test_the_trainers_refilled_memory_checkpoint_resumes_on_the_gpu(tmp_path):
    memory = tmp_path / "memory"
    common = SMALL_GPT + ["--micro-batch-size", "2", "--lr", "1e-3", "--bf16", "--train-iters", "8",
                          "--save", str(tmp_path / "save"), "--save-interval", "100"]
    tier = ["--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir", str(memory),
            "--non-persistent-save-interval", "1"]
    first = run_trainer(1, common + tier)
    assert first.returncode == 0, first.stdout[-3000:]
    shutil.rmtree(tmp_path / "save")  # the final save: the memory tier is all there is now
    second = run_trainer(1, common + tier + ["--load", str(tmp_path / "save")])
    assert second.returncode == 0, second.stdout[-3000:]
    assert f"loaded checkpoint from {iteration_dir(memory, 7)}" in second.stdout  # a refill
    assert min(iterations(second.stdout)) == 8


def odd_device_state(seed: int) -> dict:
    """Odd-sized tensors of six dtypes, so every record after the first sits at a byte offset
    its dtype does not divide; one stays on the host, as a state may hold."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return {"a_half": torch.randn(3, device="cuda", generator=generator).to(torch.bfloat16),
            "b_weight": torch.randn(517, 7, device="cuda", generator=generator),
            "c_bytes": torch.randint(-100, 100, (3,), device="cuda", generator=generator,
                                     dtype=torch.int8),
            "d_double": torch.randn(17, device="cuda", generator=generator).double(),
            "e_strided": torch.randn(40, 6, device="cuda", generator=generator).t(),
            "f_flags": torch.rand(5, device="cuda", generator=generator) > 0.5,
            "g_host": torch.randn(9, generator=torch.Generator().manual_seed(seed))}


@needs_gpus(1)
@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_a_refill_from_the_device_lays_odd_sized_tensors_at_unaligned_records(tmp_path, where):
    """The CUDA refill copies each tensor's bytes into its record as bytes: torch_dist's
    records sit end to end, at any offset (the mapping viewed as a float32 at an odd offset
    raised). In the folder the tier usually has (/dev/shm) the slot's mapping is registered
    as pinned memory; a disk-backed one may be, or be refilled through the host."""
    if where == "shm":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        memory = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ftmaster-gpu-"))
    else:
        memory = tmp_path
    slots = MemorySlots(memory)
    try:
        for iteration in (1, 2, 3):
            refilled, written = save(slots, memory, iteration, odd_device_state(iteration))
        assert refilled
        slot_file = next(iter(slots._files[0].values()))
        if where == "shm":  # a disk-backed mapping the driver refuses is refilled unpinned
            assert slot_file._bytes.is_pinned()
        offsets = sorted(r.data_offset for r in slot_file.records.values())
        assert any(offset % 2 for offset in offsets[1:]), offsets  # the case is the one meant
        folder = iteration_dir(memory, 3)
        assert_read_back(folder, written, odd_device_state(3))
        reported = slots.digests[SHARD]
        assert reported.digest == digest_file(folder / SHARD)
        data = (folder / SHARD).read_bytes()
        for offset, item in reported.items.items():
            assert xxhash.xxh3_64(data[offset:offset + item.bytes]).hexdigest() == item.digest
    finally:
        slots.close()
        if where == "shm":
            shutil.rmtree(memory, ignore_errors=True)


@needs_gpus(1)
def test_a_slot_the_driver_refuses_to_pin_is_refilled_and_cuda_goes_on(tmp_path, monkeypatch):
    """A real refusal (a flag the driver rejects): torch's ``cudaHostRegister`` binding leaves
    the error pending on the thread, and the next kernel launch's check raised it from an
    unrelated op. The slot is refilled through the host, and the kernels after it run."""
    from torch.cuda import _pin_memory_utils

    def refused(ptr: int, size: int) -> None:
        code = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0x80000000))  # no such flag
        assert code != 0, "the driver registered the mapping with an undefined flag"
        raise RuntimeError(f"Registering memory failed with cudaError: {code}.")

    monkeypatch.setattr(_pin_memory_utils, "pin_memory", refused)
    slots = MemorySlots(tmp_path)
    try:
        for iteration in (1, 2, 3):
            refilled, written = save(slots, tmp_path, iteration, odd_device_state(iteration))
            assert torch.ones(8, device="cuda").sum().item() == 8  # a launch after the refusal
        assert refilled and not next(iter(slots._files[0].values()))._bytes.is_pinned()
        folder = iteration_dir(tmp_path, 3)
        assert_read_back(folder, written, odd_device_state(3))
        assert slots.digests[SHARD].digest == digest_file(folder / SHARD)
    finally:
        slots.close()


def assert_read_back(folder, written, expected: dict) -> None:
    """Every tensor the save wrote (the RNG state aside) reads back from its file as given."""
    for result in written:
        if result.index.fqn != "rng":
            assert torch.equal(read_back(folder, result), expected[result.index.fqn].cpu()), \
                result.index.fqn
