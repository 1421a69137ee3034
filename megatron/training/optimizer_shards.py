"""The distributed optimizer's state as one rank holds it, for a replica dump.

A regular save writes the distributed optimizer's state fully reshardable: one tensor per
parameter and state key (``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, shaped
as the parameter), which megatron-core builds by gathering every rank's shard over DP
(``DistributedOptimizer.sharded_param_state_fully_reshardable``): a collective, which a dump
taken after a peer's death cannot make. So a dump writes what this rank holds instead: for
each chunk of those tensors that its shard touches, the flat range ``[start, end)`` of the
chunk it holds and the values there (:func:`shard_slices`). The merge
(``megatron.training.replica_merge``) puts the chunks back together from one survivor per
shard, and the checkpoint it writes holds the very tensors a regular save writes.

With ``--num-distributed-optimizer-instances N`` the state is sharded within each instance and
replicated across them (megatron-core's ``initialize_model_parallel``): shard ``s`` of
instance 0 is held again by shard ``s`` of every other instance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.dist_checkpointing.dict_utils import nested_values

from ftmaster.recovery.replicas import slice_key

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
"""The world tensors' keys in ``get_parameter_state_dp_zero``, so the fully reshardable
tensors' names (megatron-core 0.16.1; ``step`` lives in the param groups)."""


@dataclass(frozen=True)
class Position:
    """Where this rank's optimizer shard sits: its instance, and its shard of ``shards``."""

    instance: int
    shard: int
    shards: int


def distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers inside megatron-core's optimizer (chained or not)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def position(optimizer) -> Position:
    """The shard from the optimizer's own group (local queries: no collective)."""
    inner = distributed_optimizers(optimizer)[0]
    group = inner.data_parallel_group
    return Position(int(inner.distributed_optimizer_instance_id), group.rank(), group.size())


@dataclass(frozen=True)
class _Piece:
    """One stored chunk of a fully reshardable tensor, and the parameter's flat elements
    ``[first, first + numel)`` it holds (in order)."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_size: tuple[int, ...]
    first: int
    numel: int


def _pieces_per_state(sharded_metadata, shape: torch.Size) -> dict[str, list[_Piece]]:
    """:func:`_pieces` for each of :data:`STATE_KEYS`, learnt once: they differ only in
    their keys' prefix (each learning walked the parameter's elements, about 80 ns each: a
    rank of a few hundred million parameters missed the supervisor's wait for its dump)."""
    first, *others = STATE_KEYS
    pieces = _pieces(sharded_metadata, first, shape)
    prefix = f"optimizer.state.{first}."
    if not all(piece.fqn.startswith(prefix) for piece in pieces):
        return {key: _pieces(sharded_metadata, key, shape) for key in STATE_KEYS}
    return {first: pieces, **{key: [replace(piece, fqn=f"optimizer.state.{key}."
                                            + piece.fqn[len(prefix):]) for piece in pieces]
                              for key in others}}


def _pieces(sharded_metadata, state_key: str, shape: torch.Size) -> list[_Piece]:
    """The chunks a regular save stores for one parameter's ``state_key``: the model
    tensor's sharding with megatron-core's key, its factories built (SwiGLU's fc1 is stored
    as two halves) over the parameter's flat indices to learn which elements each holds. A
    plain sharding holds the whole parameter, in order, in one chunk."""
    key = f"optimizer.state.{state_key}.{sharded_metadata.key}"
    if not isinstance(sharded_metadata, ShardedTensorFactory) and \
            sharded_metadata.flattened_range is None and \
            math.prod(sharded_metadata.local_shape) == math.prod(shape):
        return [_Piece(key, tuple(sharded_metadata.global_offset),
                       (1,) * sharded_metadata.prepend_axis_num + tuple(sharded_metadata.local_shape),
                       tuple(sharded_metadata.global_shape), 0, math.prod(shape))]
    index = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    changes = dict(key=key, data=index)
    if isinstance(sharded_metadata, ShardedTensorFactory):
        built = replace(sharded_metadata, **changes).build()
    else:
        built = replace(sharded_metadata, dtype=index.dtype, **changes)
    pieces = []
    for tensor in nested_values(built) if isinstance(built, (dict, list)) else [built]:
        flat = tensor.data.reshape(-1)
        first = int(flat[0]) if flat.numel() else 0
        if not torch.equal(flat, torch.arange(first, first + flat.numel(), dtype=flat.dtype)):
            raise ValueError(f"{tensor.key}: a stored chunk is not a flat range of the parameter")
        pieces.append(_Piece(tensor.key, tuple(tensor.global_offset),
                             (1,) * tensor.prepend_axis_num + tuple(tensor.local_shape),
                             tuple(tensor.global_shape), first, flat.numel()))
    return pieces


def sharding_by_param(model_sharded_state_dict: dict) -> dict:
    """Each model parameter's ShardedTensor (or factory), keyed by the parameter itself, as
    megatron-core's fully reshardable format finds it."""
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    return {item.data: item for item in nested_values(sharded)}


def shard_slices(optimizer, model_sharded_state_dict: dict) -> dict[str, dict]:
    """This rank's part of every fully reshardable optimizer tensor, by slice key: the
    chunk (fqn, offsets, sizes, global size), the range ``[start, end)`` of its flat elements
    held here, and the values (a copy: training may go on)."""
    metadata_of = sharding_by_param(model_sharded_state_dict)
    slices = {}
    for inner in distributed_optimizers(optimizer):
        for buffer_ranges in inner.gbuf_ranges:
            for bucket_ranges in buffer_ranges.values():
                for bucket in bucket_ranges:
                    for model_param, ranges in bucket["param_map"].items():
                        if _a_copy_of_another_stages(metadata_of[model_param]):
                            continue
                        slices.update(_param_slices(inner, model_param, ranges["param"],
                                                    metadata_of[model_param]))
    return slices


def _a_copy_of_another_stages(sharded_metadata) -> bool:
    """The last pipeline stage's output weight tied to the first stage's embedding: megatron-
    core saves it under the embedding's key with ``replica_id`` (1, 0, DP rank), a copy of
    the first stage's (its optimizer state too, kept equal by the embedding's gradient
    all-reduce), and a regular save stores the first stage's alone. Dumped, its slices lay
    over the first stage's at other shard boundaries (the two stages' buffers differ), and
    every merge was refused."""
    replica = getattr(sharded_metadata, "replica_id", 0)
    return isinstance(replica, tuple) and bool(replica) and replica[0] != 0


def _param_slices(inner, model_param, held, sharded_metadata) -> dict[str, dict]:
    states = inner._get_main_param_and_optimizer_states(model_param)
    slices = {}
    for state_key, pieces in _pieces_per_state(sharded_metadata, model_param.shape).items():
        values = states[state_key].detach().reshape(-1)
        for piece in pieces:
            start = max(held.start, piece.first)
            end = min(held.end, piece.first + piece.numel)
            if start >= end:
                continue
            part = values[start - held.start:end - held.start].to("cpu", copy=True)
            key = slice_key(piece.fqn, piece.offsets, start - piece.first, end - piece.first)
            slices[key] = {"fqn": piece.fqn, "offsets": piece.offsets, "sizes": piece.sizes,
                           "global_size": piece.global_size, "start": start - piece.first,
                           "end": end - piece.first, "values": part}
    return slices

