"""A kept plan's write buckets written again while every shard is the memory they hold (one
rank, real megatron-core shards and its real torch_dist planning)."""

import io

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from helpers.process_group import process_group_of_one
from megatron.training import conversions
from megatron.training.checkpointing import _TimedParallelSave
from megatron.training.kept_writes import KeptWritesStrategy
from megatron.training.save_structure import SaveStructure


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with process_group_of_one(tmp_path_factory.mktemp("pg")) as world:
        conversions.install()
        yield world


def new_strategy(group) -> _TimedParallelSave:
    cache = conversions.ConversionCache()
    return _TimedParallelSave(KeptWritesStrategy(cache), group, do_cache_distribution=True,
                              conversion_cache=cache)


def sharded(parameter: torch.Tensor, state: torch.Tensor, rng: int) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("layer.weight", parameter, (0, 0, 1), prepend_axis_num=1),
            "state": ShardedTensor.from_rank_offsets("optimizer.state", state),
            "rng": ShardedObject("rng_state", {"draw": rng}, (1,), (0,))}


def handed(request) -> dict:
    """What the writer is handed, by key: tensors, and the byte items' values."""
    _, buckets, _ = request.async_fn_args
    found = {item.index.fqn: tensor for _, _, (_, tensors) in buckets for item, tensor in tensors}
    for _, _, (byte_items, _) in buckets:
        for item, data in byte_items:
            found[item.index.fqn] = torch.load(io.BytesIO(data.getvalue()), weights_only=False)
    return found


def save(strategy, tmp_path, iteration: int, state_dict: dict, in_rank: bool = True):
    (tmp_path / str(iteration)).mkdir()
    request = strategy.async_save(state_dict, tmp_path / str(iteration), in_rank=in_rank)
    return request, strategy.base_strategy.written_again


def test_a_save_in_the_same_memory_writes_the_kept_buckets_with_its_own_values(group, tmp_path):
    """From the third save on: megatron-core validates its cached plan at the second."""
    strategy, parameter, state = new_strategy(group), torch.zeros(4, 6), torch.zeros(3)
    for iteration in (1, 2, 3, 4):
        parameter.fill_(float(iteration))
        state.fill_(-float(iteration))
        request, again = save(strategy, tmp_path, iteration, sharded(parameter, state, iteration))
        assert again == (iteration > 2)
        found = handed(request)
        assert torch.equal(found["layer.weight"].reshape(-1), torch.full((24,), float(iteration)))
        assert torch.equal(found["optimizer.state"], torch.full((3,), -float(iteration)))
        assert [value for key, value in found.items() if key.startswith("rng_state")] == [
            [{"draw": iteration}]]


def test_other_memory_or_writer_processes_plan_in_full(group, tmp_path):
    strategy, parameter, state = new_strategy(group), torch.zeros(4, 6), torch.zeros(3)
    for iteration in (1, 2):
        save(strategy, tmp_path, iteration, sharded(parameter, state, iteration))
    moved = torch.ones(4, 6)  # a parameter whose data was replaced
    request, again = save(strategy, tmp_path, 3, sharded(moved, state, 3))
    assert not again and torch.equal(handed(request)["layer.weight"].reshape(-1), torch.ones(24))
    _, again = save(strategy, tmp_path, 4, sharded(moved, state, 4), in_rank=False)
    assert not again  # torch_dist's writer processes
    _, again = save(strategy, tmp_path, 5, sharded(moved, state, 5))
    assert again


def test_a_new_structure_plans_in_full(group, tmp_path):
    """A state the optimizer did not hold before: the structure's agreement makes a new
    strategy, which writes nothing again."""
    structure = SaveStructure(lambda: new_strategy(group), group, assume_constant=False)
    parameter, state = torch.zeros(4, 6), torch.zeros(3)
    for iteration in (1, 2, 3):
        strategy, kept = structure.strategy_for(sharded(parameter, state, iteration))
        _, again = save(strategy, tmp_path, iteration, sharded(parameter, state, iteration))
    assert kept and again
    grown = {**sharded(parameter, state, 4), "new": ShardedTensor.from_rank_offsets("optimizer.new", torch.ones(2))}
    strategy, kept = structure.strategy_for(grown)
    request, again = save(strategy, tmp_path, 4, grown)
    assert not kept and not again and torch.equal(handed(request)["optimizer.new"], torch.ones(2))


def test_a_plan_whose_buckets_hold_a_copy_is_never_kept(group, tmp_path):
    """torch_dist's writer copies a tensor that views a larger storage (parameters in a
    contiguous buffer): written again, that copy would hand every later save its first values."""
    strategy, buffer = new_strategy(group), torch.zeros(40)
    parameter, state = buffer[:24].view(4, 6), buffer[24:27]
    for iteration in (1, 2, 3):
        buffer.fill_(float(iteration))
        request, again = save(strategy, tmp_path, iteration, sharded(parameter, state, iteration))
        assert not again
        assert torch.equal(handed(request)["optimizer.state"], torch.full((3,), float(iteration)))
