"""A small sharded state of real megatron-core shards, whose structure a test can change."""

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor


def sharded_state(shape=(4, 6), dtype=torch.float32, key="decoder.weight", replica=0,
                  extra=False, fill=1.0):
    tensor = torch.full(shape, fill, dtype=dtype)
    part = {"w": ShardedTensor.from_rank_offsets(key, tensor, replica_id=replica),
            "rng": ShardedObject("rng_state", {"seed": int(fill)}, (1,), (0,), replica_id=replica)}
    if extra:  # an optimizer state that was not there before
        part["exp_avg"] = ShardedTensor.from_rank_offsets(f"optimizer.{key}.exp_avg",
                                                          torch.zeros(shape, dtype=dtype))
    return part
