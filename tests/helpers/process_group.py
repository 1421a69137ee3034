"""A gloo process group of one, for unit tests of code that asks for its rank or runs a
collective (megatron-core's strategies, the trainer's agreement)."""

import contextlib
from pathlib import Path

import torch


@contextlib.contextmanager
def process_group_of_one(folder: Path):
    """The default group, of this process alone, its store in ``folder``; destroyed on exit."""
    store = torch.distributed.FileStore(str(folder / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield torch.distributed.group.WORLD
    finally:
        torch.distributed.destroy_process_group()
