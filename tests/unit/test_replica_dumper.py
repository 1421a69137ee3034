"""The trainer's replica dump thread, with the state it dumps stood in for."""

import threading

import torch

from helpers.replicas import dump_once
from megatron.training import replicas


def test_the_dump_thread_works_on_the_gpu_of_the_thread_that_made_it(tmp_path, monkeypatch):
    """CUDA's current device is per thread, and a new thread's is GPU 0: on every rank the
    dump read "the current device" as GPU 0 (the CUDA RNG stream it saves before any update
    has committed one, megatron-core's allocations on the current device). Stood in for on
    CPU: a per-thread current device."""
    current = threading.local()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "index", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: setattr(current, "index", index))
    monkeypatch.setattr(replicas, "layout_coordinates", lambda: {"rank": 3})
    torch.cuda.set_device(3)  # the training thread's GPU: local rank 3
    seen = []

    def state_dict(iteration: int, consumed: int, rng: dict | None) -> dict:
        seen.append(torch.cuda.current_device())
        raise OSError("the dump stops here")

    dump_once(tmp_path, state_dict)
    assert seen == [3]
