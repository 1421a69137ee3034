"""A save strategy's conversions to torch's ShardedTensor, reused while each shard's data is
the same memory (one rank, real megatron-core shards and the real torch_dist strategy)."""

import io

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

from megatron.training import conversions
from megatron.training.checkpointing import _TimedParallelSave
from helpers.process_group import process_group_of_one

LAYERS_KEY = "decoder.layers.mlp.weight"


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with process_group_of_one(tmp_path_factory.mktemp("pg")) as world:
        conversions.install()
        yield world


def stacked(data: torch.Tensor) -> ShardedTensor:
    """A shard of a layer stacked along the pipeline's layers (megatron-core's slow path)."""
    return ShardedTensor.from_rank_offsets(LAYERS_KEY, data, (0, 0, 1), prepend_axis_num=1)


def converted(cache: conversions.ConversionCache, data: torch.Tensor):
    with cache.active():
        return conversions.mcore_torch.mcore_to_pyt_state_dict({LAYERS_KEY: [stacked(data)]})[LAYERS_KEY]


def local_values(torch_sharded) -> torch.Tensor:
    return torch_sharded.local_shards()[0].tensor.reshape(-1)


def test_a_shard_in_the_same_memory_is_converted_once_and_reads_its_current_bytes(group):
    cache, parameter = conversions.ConversionCache(), torch.zeros(4, 6)
    first = converted(cache, parameter)
    assert cache.reused == 0
    parameter.add_(5.0)  # an optimizer step, in place
    assert converted(cache, parameter) is first and cache.reused == 1
    assert torch.equal(local_values(first), parameter.reshape(-1))


def test_a_shard_whose_data_is_not_contiguous_is_converted_afresh_with_its_current_values(group):
    """megatron-core writes a contiguous copy of such a shard at its conversion: kept, that copy
    would hand every later save the first save's values."""
    cache, storage = conversions.ConversionCache(), torch.zeros(6, 4)
    parameter = storage.t()  # lives on, in the same memory, not contiguous
    converted(cache, parameter)
    storage.add_(7.0)  # an optimizer step, in place
    second = converted(cache, parameter)
    assert cache.reused == 0
    assert torch.equal(local_values(second), parameter.reshape(-1))


def test_a_shard_copied_for_each_save_is_let_go_once_handed_over_and_converted_afresh(group):
    cache, parameter = conversions.ConversionCache(), torch.zeros(4, 6)
    converted(cache, parameter.clone())
    assert LAYERS_KEY in cache._kept
    cache.forget_copies()  # the save's copy has no owner left: nothing held till the next save
    assert cache._kept == {}
    parameter.add_(1.0)
    second = converted(cache, parameter.clone())
    assert cache.reused == 0 and torch.equal(local_values(second), parameter.reshape(-1))
    cache.forget_copies()
    assert cache._kept == {}
    kept = converted(cache, parameter)
    cache.forget_copies()  # the parameter itself lives on: kept
    assert converted(cache, parameter) is kept


def test_a_shard_of_another_shape_or_place_or_outside_a_save_is_converted_afresh(group):
    cache, parameter = conversions.ConversionCache(), torch.zeros(4, 6)
    first = converted(cache, parameter)
    assert converted(cache, parameter[:2]) is not first
    first = converted(cache, parameter)
    with cache.active():  # the same memory, no longer stacked along the layers
        moved = ShardedTensor.from_rank_offsets(LAYERS_KEY, parameter)
        assert conversions.mcore_torch.mcore_to_pyt_state_dict({LAYERS_KEY: [moved]})[LAYERS_KEY] is not first
    kept = converted(cache, parameter)
    assert conversions.mcore_torch.mcore_to_pyt_state_dict({LAYERS_KEY: [stacked(parameter)]})[
        LAYERS_KEY] is not kept  # no cache active: megatron-core's own conversion


def test_saves_that_reuse_the_conversions_write_each_save_s_values(group, tmp_path):
    """Planned by the real torch_dist strategy: from the second save on every tensor's
    conversion is reused, and what each save's writer is handed holds that save's values."""
    base = get_default_save_sharded_strategy("torch_dist")
    base.use_cached_ckpt_structure = True
    strategy = _TimedParallelSave(base, group, do_cache_distribution=True)
    parameter, state = torch.zeros(4, 6), torch.zeros(3)
    for iteration in (1, 2, 3):
        parameter.fill_(float(iteration))
        state.fill_(-float(iteration))
        sharded = {"w": stacked(parameter),
                   "state": ShardedTensor.from_rank_offsets("optimizer.state", state),
                   "rng": ShardedObject("rng_state", {"iteration": iteration}, (1,), (0,))}
        (tmp_path / str(iteration)).mkdir()
        request = strategy.async_save(sharded, tmp_path / str(iteration))
        assert strategy.conversions.reused == (0 if iteration == 1 else 2)
        _, buckets, _ = request.async_fn_args
        handed = {item.index.fqn: tensor for _, _, (_, tensors) in buckets for item, tensor in tensors}
        assert torch.equal(handed[LAYERS_KEY].reshape(-1), torch.full((24,), float(iteration)))
        assert torch.equal(handed["optimizer.state"], torch.full((3,), -float(iteration)))


def test_an_object_holding_nothing_is_serialized_once_and_others_at_every_save(group, monkeypatch):
    """megatron-core's layers keep an ``_extra_state`` of None: its bytes are the ones
    megatron-core's conversion makes, made once; an object with a value is serialized afresh."""
    cache, extra, rng = conversions.ConversionCache(), "layer._extra_state", "rng_state"
    expected = conversions._original({extra: [ShardedObject(extra, None, (2,), (0,))]})[extra]
    with conversions.ConversionCache().active():  # the bytes of nothing made, once per process
        conversions.mcore_torch.mcore_to_pyt_state_dict({extra: [ShardedObject(extra, None, (2,), (0,))]})
    saved, save = [], torch.save
    monkeypatch.setattr(torch, "save", lambda obj, *args, **kwargs: (saved.append(obj), save(obj, *args, **kwargs)))
    for iteration in (1, 2):
        with cache.active():
            pyt = conversions.mcore_torch.mcore_to_pyt_state_dict({
                extra: [ShardedObject(extra, None, (2,), (0,))],
                rng: [ShardedObject(rng, {"iteration": iteration}, (1,), (0,))]})
        assert pyt[extra].getvalue() == expected.getvalue()
        assert torch.load(io.BytesIO(pyt[rng].getvalue())) == [{"iteration": iteration}]
    assert saved == [[{"iteration": 1}], [{"iteration": 2}]]
