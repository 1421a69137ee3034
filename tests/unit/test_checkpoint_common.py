"""common.pt as Megatron-LM writes it (args a Namespace holding consumed_train_samples) and as
ftmaster wrote it before (args a dict, the count at the top level): both load."""

import argparse

import pytest

from megatron.training.checkpointing import consumed_samples, saved_args

MEGATRON_LM = {"args": argparse.Namespace(num_layers=4, consumed_train_samples=96), "iteration": 8}
BEFORE = {"args": {"num_layers": 4}, "consumed_train_samples": 96, "iteration": 8}


@pytest.mark.parametrize("common", [MEGATRON_LM, BEFORE], ids=["megatron-lm", "before"])
def test_both_forms_give_the_args_and_the_samples(common):
    assert saved_args(common)["num_layers"] == 4
    assert consumed_samples(common) == 96


def test_the_namespace_wins_over_a_stale_top_level_count():
    common = {**MEGATRON_LM, "consumed_train_samples": 12}
    assert consumed_samples(common) == 96


def test_a_checkpoint_without_args_has_none():
    assert saved_args({"iteration": 8}) == {}
