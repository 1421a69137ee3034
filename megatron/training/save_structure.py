"""Keeping a save's plan while the state keeps its structure.

Megatron-LM's ``--ckpt-assume-constant-structure`` keeps one save strategy for the whole run
(``megatron/training/checkpointing.py``: ``checkpointing_context['save_strategy']``, and
``validate_sharding_integrity = not args.ckpt_assume_constant_structure`` once it exists).
megatron-core's ``TorchDistSaveShardedStrategy`` with ``use_cached_ckpt_structure`` then
reuses its local and central save plans once two saves in a row planned alike (skipping the
plans' exchange), and ``FullyParallelSaveStrategyWrapper(do_cache_distribution=True)`` keeps
who writes each replicated shard. The sharding validation (an all-gather of every shard's
metadata) runs only when a strategy is new.

With the flag, ftmaster does the same and trusts it. Without it, the strategy is kept only
while the structure stays the same on every rank: a fingerprint of each shard's key, dtype,
shapes, offsets and replica id is compared with the previous save's, and the ranks agree
through one all-reduce. Any change on any rank (a new layout, a new optimizer state) and every
rank plans afresh, so a reused plan never describes other tensors than those written.
"""

from __future__ import annotations

from typing import Callable

import torch
import xxhash
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor


def structure_fingerprint(sharded_part: dict) -> str:
    """What a save plan depends on, for every shard of ``sharded_part``, hashed; the bytes of
    objects and tensors are not in it."""
    hasher = xxhash.xxh3_64()
    for shard in nested_values(sharded_part):
        if isinstance(shard, ShardedTensor):
            described = (shard.key, str(shard.dtype), shard.local_shape, shard.global_shape,
                         shard.global_offset, shard.axis_fragmentations, shard.replica_id,
                         shard.flattened_range, shard.allow_shape_mismatch)
        elif isinstance(shard, ShardedObject):
            described = (shard.key, shard.global_shape, shard.global_offset, shard.replica_id)
        else:
            described = (type(shard).__name__, getattr(shard, "key", None))
        hasher.update(repr(described).encode())
    return hasher.hexdigest()


class SaveStructure:
    """The save strategy one rank keeps from save to save, and when it must start afresh.

    ``new_strategy`` builds megatron-core's strategy with its caches on; ``group`` is the
    group on which every rank of the job agrees (all ranks call :meth:`strategy_for` at the
    same save, as they call the save itself)."""

    def __init__(self, new_strategy: Callable[[], object], group, assume_constant: bool) -> None:
        self._new_strategy = new_strategy
        self._group = group
        self._assume_constant = assume_constant
        self._strategy = None
        self._fingerprint: str | None = None

    def strategy_for(self, sharded_part: dict) -> tuple[object, bool]:
        """The strategy for this save, and whether it is the previous save's (its plans and
        validation reusable) rather than a new one."""
        if self._assume_constant:
            kept = self._strategy is not None
        else:
            kept = self._same_everywhere(sharded_part)
        if not kept:
            self._strategy = self._new_strategy()
        return self._strategy, kept

    def _same_everywhere(self, sharded_part: dict) -> bool:
        """Whether every rank's structure is its previous save's (never at the first save)."""
        fingerprint = structure_fingerprint(sharded_part)
        changed = torch.tensor([int(fingerprint != self._fingerprint)], dtype=torch.int64)
        torch.distributed.all_reduce(changed, op=torch.distributed.ReduceOp.MAX, group=self._group)
        self._fingerprint = fingerprint
        return not changed.item()
