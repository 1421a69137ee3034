"""The memory tier's refill from device memory: each tensor copied from the GPU straight into
the slot's mapping, registered with the driver as pinned memory (no staging copy), and hashed
once it has landed; then the trainer's own refilled memory checkpoint, resumed on the GPU."""

import shutil

import pytest
import torch

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
        expected = device_state(3)
        for result in written:
            if result.index.fqn != "rng":
                assert torch.equal(read_back(folder, result), expected[result.index.fqn].cpu())
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
