"""The trainer's replica dump thread, with the state it dumps stood in for."""

import json
import threading
from types import SimpleNamespace

import torch

from ftmaster import runfiles
from ftmaster.recovery.replicas import REQUEST_FLAG
from megatron.training import replicas
from megatron.training.replicas import Cut, ReplicaDumper


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

    dumper = ReplicaDumper(tmp_path, Cut(enabled=True),
                           SimpleNamespace(iteration=5, consumed_train_samples=40), state_dict)
    flag = runfiles.flags_dir(tmp_path) / REQUEST_FLAG
    flag.parent.mkdir(parents=True)
    flag.write_text(json.dumps({"folder": str(tmp_path / "dumps")}))
    assert dumper.done.wait(10)
    assert seen == [3]
