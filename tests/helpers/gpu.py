"""Markers for the tests a GPU owner runs (``scripts/gpu_check.sh``): each skips, with the
reason, where this machine lacks what it needs."""

from __future__ import annotations

import shutil

import pytest
import torch


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(count: int = 1):
    return pytest.mark.skipif(gpu_count() < count,
                              reason=f"needs {count} CUDA GPU(s), this machine has {gpu_count()}")


def needs_driver():
    return pytest.mark.skipif(shutil.which("nvidia-smi") is None or gpu_count() == 0,
                              reason="needs an NVIDIA driver (nvidia-smi) and a CUDA GPU")


def job_gpu(local_rank: int, nproc: int) -> int:
    """The NVML index ``ftmaster launch`` gives local rank ``local_rank`` of ``nproc``: what
    ``--inject`` names and events report (with ``CUDA_VISIBLE_DEVICES=4,5,6,7`` GPU 1 is
    none of the job's)."""
    from ftmaster.launch import job_gpus

    return job_gpus(nproc, "nvml").ids[local_rank]
