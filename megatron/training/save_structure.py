"""Keeping a save's plan while the state keeps its structure.

Megatron-LM's ``--ckpt-assume-constant-structure`` keeps one save strategy for the whole run
(``megatron/training/checkpointing.py``: ``checkpointing_context['save_strategy']``, and
``validate_sharding_integrity = not args.ckpt_assume_constant_structure`` once it exists).
megatron-core's ``TorchDistSaveShardedStrategy`` with ``use_cached_ckpt_structure`` then
reuses its local and central save plans once two saves in a row planned alike (skipping the
plans' exchange), and ``FullyParallelSaveStrategyWrapper(do_cache_distribution=True)`` keeps
who writes each replicated shard. The sharding validation (an all-gather of every shard's
metadata) runs only when a strategy is new.

With the flag, ftmaster does the same and trusts it, as Megatron-LM does: the first save's
plan is every later save's. A first save made while the optimizer holds no state (an fp16 run
whose first steps the loss scaler skipped, so Adam has no moments yet) plans no moments, and
no later save writes them; planning again would take the ranks' agreement that the structure
changed, which is what the flag waives. That plan is told on rank 0, once, as a warning.

Without the flag, the strategy is kept only while the structure stays the same on every rank:
a fingerprint of each shard's key, dtype, shapes, offsets and replica id is compared with the
previous save's, and the ranks agree through one all-reduce. The fingerprint is those fields
themselves, compared whole: hashing their ``repr`` took ten times as long (1.2 ms of each
rank's 77 MB save, some 170 shards), and each rank compares only with its own previous one.
Any change on any rank (a new layout, a new optimizer state) and every rank plans afresh, so
a reused plan never describes other tensors than those written.
"""

from __future__ import annotations

from typing import Callable

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from .console import log_rank0

STATELESS_OPTIMIZER_WARNING = (
    "warning: --ckpt-assume-constant-structure: this save's plan is made while the optimizer "
    "holds no state (no step taken yet, e.g. fp16 steps skipped by the loss scaler); later "
    "saves reuse this plan and may omit the optimizer's moments; train without "
    "--ckpt-assume-constant-structure to avoid it")


def structure_fingerprint(sharded_part: dict) -> tuple:
    """What a save plan depends on, for every shard of ``sharded_part``, to compare with
    ``==``; the bytes of objects and tensors are not in it."""
    return tuple(_described(shard) for shard in nested_values(sharded_part))


def _described(shard) -> tuple:
    if isinstance(shard, ShardedTensor):
        return (shard.key, shard.dtype, shard.local_shape, shard.global_shape,
                shard.global_offset, shard.axis_fragmentations, shard.replica_id,
                shard.flattened_range, shard.allow_shape_mismatch)
    if isinstance(shard, ShardedObject):
        return shard.key, shard.global_shape, shard.global_offset, shard.replica_id
    return type(shard).__name__, getattr(shard, "key", None)


class SaveStructure:
    """The save strategy one rank keeps from save to save, and when it must start afresh.

    ``new_strategy`` builds megatron-core's strategy with its caches on; ``group`` is the
    group on which every rank of the job agrees (all ranks call :meth:`strategy_for` at the
    same save, as they call the save itself). ``optimizer_holds_state`` tells whether the
    optimizer has any state yet (asked when a plan is made under the flag)."""

    def __init__(self, new_strategy: Callable[[], object], group, assume_constant: bool,
                 optimizer_holds_state: Callable[[], bool] = lambda: True) -> None:
        self._new_strategy = new_strategy
        self._group = group
        self._assume_constant = assume_constant
        self._optimizer_holds_state = optimizer_holds_state
        self._strategy = None
        self._fingerprint: tuple | None = None

    def strategy_for(self, sharded_part: dict) -> tuple[object, bool]:
        """The strategy for this save, and whether it is the previous save's (its plans and
        validation reusable) rather than a new one."""
        if self._assume_constant:
            kept = self._strategy is not None
            if not kept and not self._optimizer_holds_state():  # once: the flag plans once
                log_rank0(STATELESS_OPTIMIZER_WARNING)
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
