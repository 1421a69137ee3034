"""When a save may keep the previous save's plan: the structure fingerprint, and the
strategy kept or made anew (one rank; the agreement between ranks is in
tests/integration/test_save_structure_ranks.py)."""

import pytest
import torch

from helpers.process_group import process_group_of_one
from helpers.structure import sharded_state
from megatron.training.save_structure import (
    STATELESS_OPTIMIZER_WARNING,
    SaveStructure,
    structure_fingerprint,
)


@pytest.mark.parametrize("changed", [
    {"shape": (4, 7)}, {"dtype": torch.bfloat16}, {"key": "decoder.bias"}, {"replica": 1},
    {"extra": True},
])
def test_the_fingerprint_changes_with_the_structure(changed):
    assert structure_fingerprint(sharded_state(**changed)) != structure_fingerprint(sharded_state())


def test_the_fingerprint_ignores_the_values():
    assert structure_fingerprint(sharded_state(fill=2.0)) == structure_fingerprint(sharded_state(fill=1.0))


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with process_group_of_one(tmp_path_factory.mktemp("pg")) as world:
        yield world


def test_a_strategy_is_kept_while_the_structure_is(group):
    structure = SaveStructure(object, group, assume_constant=False)
    first, kept = structure.strategy_for(sharded_state())
    assert not kept
    assert structure.strategy_for(sharded_state(fill=3.0)) == (first, True)
    changed, kept = structure.strategy_for(sharded_state(extra=True))
    assert not kept and changed is not first
    assert structure.strategy_for(sharded_state(extra=True)) == (changed, True)


def test_assume_constant_structure_keeps_it_without_looking(group):
    structure = SaveStructure(object, group, assume_constant=True)
    first, kept = structure.strategy_for(sharded_state())
    assert not kept
    assert structure.strategy_for(sharded_state(shape=(9, 9))) == (first, True)  # trusted: the flag's contract


def test_assume_constant_structure_warns_once_when_it_plans_without_optimizer_state(group, capsys):
    """An fp16 run whose first steps the loss scaler skipped saves before Adam has moments:
    the plan the flag keeps for every later save holds none, and the first save says so."""
    structure = SaveStructure(object, group, assume_constant=True,
                              optimizer_holds_state=lambda: False)
    structure.strategy_for(sharded_state())
    assert capsys.readouterr().out.splitlines() == [STATELESS_OPTIMIZER_WARNING]
    structure.strategy_for(sharded_state(extra=True))  # the moments now: the plan is kept
    assert capsys.readouterr().out == ""
    assert "optimizer's moments" in STATELESS_OPTIMIZER_WARNING
    assert "without --ckpt-assume-constant-structure" in STATELESS_OPTIMIZER_WARNING


@pytest.mark.parametrize("assume_constant, holds_state", [(True, True), (False, False)])
def test_no_warning_with_optimizer_state_or_without_the_flag(group, capsys, assume_constant,
                                                              holds_state):
    structure = SaveStructure(object, group, assume_constant=assume_constant,
                              optimizer_holds_state=lambda: holds_state)
    structure.strategy_for(sharded_state())
    structure.strategy_for(sharded_state(extra=True))  # without the flag: planned afresh
    assert capsys.readouterr().out == ""
