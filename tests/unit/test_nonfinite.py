"""The NaN/Inf guard's split optimizer step, with a stand-in optimizer on one gloo rank."""

import math

import pytest

from megatron.training.nonfinite import NonFiniteGuard, NonFiniteLoss, prepare_update
from helpers.process_group import process_group_of_one


@pytest.fixture(scope="module")
def guard(tmp_path_factory):
    with process_group_of_one(tmp_path_factory.mktemp("pg")) as world:
        yield NonFiniteGuard(world, enabled=True)


class Optimizer:
    """``prepare_grads`` says whether the gradients overflowed (fp16); the norm is given."""

    def __init__(self, overflow: bool, norm: float = 1.0) -> None:
        self.overflow, self.norm = overflow, norm

    def prepare_grads(self) -> bool:
        return self.overflow

    def get_grad_norm(self) -> float:
        return self.norm

    def get_parameters(self) -> list:
        return []


def test_a_finite_step_is_applied_with_its_norm(guard):
    assert prepare_update(Optimizer(overflow=False, norm=2.0), 0.0, 1, 3.5, guard) == (True, 2.0)


@pytest.mark.parametrize("loss, norm, what", [(math.nan, 1.0, "loss"), (1.0, math.inf, "gradient norm")])
def test_a_non_finite_loss_or_norm_stops_before_the_update(guard, loss, norm, what):
    with pytest.raises(NonFiniteLoss) as raised:
        prepare_update(Optimizer(overflow=False, norm=norm), 1.0, 4, loss, guard)
    assert (raised.value.iteration, raised.value.what) == (4, what)


def test_an_fp16_overflow_skips_the_step(guard):
    assert prepare_update(Optimizer(overflow=True), 1.0, 5, 2.0, guard) == (False, None)


@pytest.mark.parametrize("loss", [math.nan, math.inf])
def test_a_non_finite_loss_is_one_even_when_the_gradients_overflowed(guard, loss):
    """The overflow skips the step; the loss is the forward's, which no loss scale mends."""
    with pytest.raises(NonFiniteLoss) as raised:
        prepare_update(Optimizer(overflow=True), 1.0, 6, loss, guard)
    assert (raised.value.iteration, raised.value.what) == (6, "loss")
