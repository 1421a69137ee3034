"""Reusing megatron-core's conversion of a save's shards to torch's ``ShardedTensor``.

Every torch_dist save converts each of megatron-core's ``ShardedTensor`` to a torch
``ShardedTensor`` (``mcore_to_pyt_state_dict``), and a shard stacked along a pipeline's layers
(``prepend_axis_num``) takes the slow path: torch's metadata checks, shard by shard. For a
77 MB checkpoint of some 300 tensors that is most of the save's planning, at every save,
although with a kept structure the result describes the same tensors each time: parameters and
optimizer states are updated in place, so each shard's data is the same memory.

:class:`ConversionCache` keeps, for one save strategy (so for one structure: a new structure
gets a new strategy, see :mod:`save_structure`), each key's converted tensor, and reuses it
when every shard's data is the very memory it was built from: same address, shape, strides
and dtype (and contiguous: a converted copy of other data would hold stale values). Holding the converted tensor holds that memory, so an address cannot be recycled
for other bytes in between. Memory is held only while its owner lives: once a save has handed
its tensors over, a key whose data was made for that save alone (the distributed optimizer's
gathered state, say) is let go (:meth:`ConversionCache.forget_copies`), and converted afresh
at every save.

A ``ShardedObject`` is serialized afresh at every save (its value may have changed), except
one that holds nothing: megatron-core's own layers keep an ``_extra_state`` of None (kept for
Transformer Engine's layers, which fill it), 4 per layer, and ``torch.save`` of each took 0.13
ms at every save. The bytes of nothing are made once.
"""

from __future__ import annotations

import contextlib
import functools
import io
import threading
import weakref

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

_original = mcore_torch.mcore_to_pyt_state_dict
_active = threading.local()


def _memory(shards: list) -> tuple | None:
    """Where each shard's bytes are and where they sit in the global tensor, or None when the
    key holds no plain shards. The placement is the strategy's structure already; it is
    compared too, so that a reuse never rests on ``--ckpt-assume-constant-structure`` alone.

    None too for a shard whose data is not contiguous: megatron-core's conversion of a stacked
    shard (``prepend_axis_num``) writes a contiguous copy of it, made at that save, and a reuse
    would hand every later save that first save's values."""
    if not all(isinstance(shard, ShardedTensor) and shard.data is not None
               and shard.data.is_contiguous() for shard in shards):
        return None
    return tuple((shard.data.data_ptr(), tuple(shard.data.shape), shard.data.stride(),
                  shard.data.dtype, shard.data.device, shard.global_shape, shard.global_offset,
                  shard.axis_fragmentations, shard.prepend_axis_num, shard.flattened_range)
                 for shard in shards)


@functools.cache
def _serialized_nothing(count: int) -> bytes:
    """What megatron-core's conversion makes of ``count`` shards of an object holding None."""
    buffer = io.BytesIO()
    torch.save([None] * count, buffer)
    return buffer.getvalue()


def _holds_nothing(shards: list) -> bool:
    return all(isinstance(shard, ShardedObject) and shard.data is None for shard in shards)


def serialized(objects: list[ShardedObject]) -> io.BytesIO:
    """What megatron-core's conversion makes of one key's ``ShardedObject`` shards (its
    ``_mcore_to_torch_sharded_object``), the bytes of nothing made once."""
    if _holds_nothing(objects):
        return io.BytesIO(_serialized_nothing(len(objects)))
    buffer = io.BytesIO()
    torch.save([shard.data for shard in objects], buffer)
    return buffer


class ConversionCache:
    """One strategy's converted tensors, by key (see the module docstring)."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[tuple, object]] = {}
        self._keys: set[str] = set()
        """Every key of the last conversion."""
        self._owners: dict[str, list[weakref.ref]] = {}
        self.reused = 0
        """How many keys the last save reused."""

    @contextlib.contextmanager
    def active(self):
        _active.cache = self
        try:
            yield
        finally:
            _active.cache = None

    def convert(self, state_dict: dict, *args, **kwargs) -> dict:
        """A save's conversion (megatron-core's arguments after ``is_loading``)."""
        memory = {key: _memory(shards) for key, shards in state_dict.items()}
        reused = {key: self._kept[key][1] for key in state_dict
                  if memory[key] is not None and self._kept.get(key, (None,))[0] == memory[key]}
        # Before megatron-core's conversion replaces each shard's data with a view of it.
        self._owners = {key: [weakref.ref(shard.data) for shard in state_dict[key]]
                        for key in state_dict if memory[key] is not None}
        reused.update({key: serialized(shards)
                       for key, shards in state_dict.items() if _holds_nothing(shards)})
        converted = {**_original({key: shards for key, shards in state_dict.items()
                                  if key not in reused}, False, *args, **kwargs), **reused}
        self._kept = {key: (memory[key], converted[key]) for key in self._owners}
        self._keys = set(state_dict)
        self.reused = len(reused)
        return {key: converted[key] for key in state_dict}

    def unchanged(self, state_dict: dict) -> bool:
        """Whether a save's shards (grouped by key, as converted) are those of the last
        conversion: the same keys, and each key of tensors the very memory it was converted
        from (objects may hold other values: they are serialized afresh)."""
        return state_dict.keys() == self._keys and all(
            isinstance(shards[0], ShardedObject)
            or key in self._kept and self._kept[key][0] == _memory(shards)
            for key, shards in state_dict.items())

    def writes_kept_memory(self, write_buckets: list) -> bool:
        """Whether every tensor in torch_dist's write buckets is the memory of a kept
        conversion of its key, not a copy made for that save (torch_dist's writer copies a
        view into a larger storage, megatron-core a strided shard)."""
        addresses = {key: {shard[0] for shard in memory} for key, (memory, _) in self._kept.items()}
        return all(tensor.data_ptr() in addresses.get(item.index.fqn, ())
                   for _, _, (_, tensor_data) in write_buckets for item, tensor in tensor_data)

    def forget_copies(self) -> None:
        """Let go of the tensors whose owner is gone (made for the save just handed over)."""
        for key, owners in self._owners.items():
            if any(owner() is None for owner in owners):
                self._kept.pop(key, None)


def _convert(state_dict: dict, is_loading: bool = False, *args, **kwargs) -> dict:
    cache = getattr(_active, "cache", None)
    if cache is None or is_loading:
        return _original(state_dict, is_loading, *args, **kwargs)
    return cache.convert(state_dict, *args, **kwargs)


def install() -> None:
    """Route megatron-core's conversion through the active cache (idempotent)."""
    mcore_torch.mcore_to_pyt_state_dict = _convert
