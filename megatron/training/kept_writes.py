"""Writing the last fully planned save's buckets again, without megatron-core's planning.

With a kept structure (:mod:`save_structure`) megatron-core's torch_dist strategy reuses its
save plans, yet every save still flattens the state dict, converts each shard to torch's
(:mod:`conversions`), sets torch's planner up, resolves every write item in the state dict
and sorts the items into write buckets (``prepare_write_data``): about a tenth of a 77 MB
memory save (``benchmarks/save_profile.py``'s ``plan``), for buckets that hold the very same
tensors as the save before. So a save written in the rank (:mod:`records`,
:mod:`memory_slots`) whose shards are the keys of the last fully planned save, each of
tensors the very memory it wrote from, writes that save's buckets again: its tensors as they
are (their bytes are this save's), and the byte items (megatron-core's ShardedObjects, the
RNG states) serialized afresh from this save's state dict, as megatron-core serializes them.
The write results, the global metadata and so ``.metadata`` are the same as that save's.

A plan is kept only when every tensor its buckets hold is the memory of its shard, never a
copy made for that save (:meth:`conversions.ConversionCache.writes_kept_memory`); a new
structure brings a new strategy, and with it a full plan. Each rank decides alone, so the
buckets are written again only once megatron-core has validated its cached plan (two saves
planned alike): a rank that plans in full from then on plans locally, while before, its
planning gathered every rank's plan, and a rank writing its buckets again would never have
joined that gather. torch_dist's writer processes (asynchronous disk saves) are always
planned in full: they are handed their buckets in megatron-core's own way.
"""

from __future__ import annotations

from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
)

from .conversions import ConversionCache, serialized


class KeptWritesStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's torch_dist save strategy, its plan caches on, that writes its last
    fully planned save's buckets again when it can (see the module docstring)."""

    def __init__(self, conversions: ConversionCache) -> None:
        super().__init__("torch_dist", 1)
        self.use_cached_ckpt_structure = True
        self.conversions = conversions
        self.writes_in_rank = False
        """Whether the next request is written in the rank; set by the caller at each save."""
        self.written_again = False
        """Whether the last request writes the kept buckets again."""
        self._planned: tuple | None = None
        """The last fully planned save's writer, global metadata and group wrapper, when its
        buckets hold only the shards' own memory."""

    def async_save(self, sharded_state_dict, checkpoint_dir):
        again = (self._written_again(sharded_state_dict)
                 if self.writes_in_rank and self.validated_cache_reuse and self._planned is not None
                 else None)
        self.written_again = again is not None
        return again if again is not None else super().async_save(sharded_state_dict, checkpoint_dir)

    def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
        """megatron-core's last step of a full plan: the plan is kept for later saves."""
        kept = self.conversions.writes_kept_memory(writer.write_buckets or [])
        self._planned = save_state_dict_ret if kept else None
        return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)

    def _written_again(self, sharded_state_dict):
        """The request writing the kept buckets with this save's byte items; None when a key
        or a tensor's memory is not the last full plan's."""
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                self.keep_only_main_replica)
        if not self.conversions.unchanged(flat):
            return None
        writer = self._planned[0]
        writer.write_buckets = [
            (path, name, ([(item, serialized(flat[item.index.fqn])) for item, _ in byte_data],
                          tensor_data))
            for path, name, (byte_data, tensor_data) in writer.write_buckets]
        return super()._get_save_and_finalize_callbacks(writer, self._planned)
