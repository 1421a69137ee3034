"""On CUDA: a short bf16 run with one save and one load (skipped without a GPU)."""

import pytest
import torch

from helpers.trainer import SMALL_GPT, iterations, run_trainer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_training_saves_and_resumes_on_cuda(tmp_path):
    save = tmp_path / "save"
    common = SMALL_GPT + ["--micro-batch-size", "2", "--lr", "1e-3", "--bf16"]
    first = run_trainer(1, common + ["--train-iters", "10", "--save", str(save),
                                     "--save-interval", "5", "--exit-interval", "5"])
    assert first.returncode == 0, first.stdout[-3000:]
    assert "saved periodic checkpoint at iteration 5" in first.stdout
    second = run_trainer(1, common + ["--train-iters", "10", "--load", str(save)])
    assert second.returncode == 0, second.stdout[-3000:]
    assert "loaded checkpoint from" in second.stdout
    assert min(iterations(second.stdout)) == 6
