"""The NaN/Inf guard's split optimizer step, with a stand-in optimizer on one gloo rank."""

import contextlib
import math

import pytest

from megatron.training.nonfinite import (NonFiniteGuard, NonFiniteLoss, loss_scale_held_back,
                                         prepare_update)
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


class ScaledOptimizer(Optimizer):
    """With megatron-core's fp16 loss scaler, moved where megatron-core moves it."""

    def __init__(self, overflow: bool, norm: float = 1.0) -> None:
        from megatron.core.optimizer.grad_scaler import DynamicGradScaler
        from megatron.training import cpu_compat

        super().__init__(overflow, norm)
        cpu_compat.apply()
        self.grad_scaler = DynamicGradScaler(1024.0, 1.0, 2.0, 0.5, growth_interval=1,
                                             hysteresis=1)

    def prepare_grads(self) -> bool:
        self.grad_scaler.update(self.overflow)
        return self.overflow


@pytest.mark.parametrize("overflow, moved_to", [(False, 2048.0), (True, 512.0)])
def test_the_loss_scale_moves_only_when_the_update_is_committed(guard, overflow, moved_to):
    """A replica dump taken while a dead peer hung the agreement saw iteration N's weights
    with the scale already moved for N+1; the resume from it moved it a second time."""
    optimizer = ScaledOptimizer(overflow)
    seen_in_the_agreement = []

    @contextlib.contextmanager
    def agreement():  # where a dead peer hangs it, and a dump is taken meanwhile
        seen_in_the_agreement.append(optimizer.grad_scaler.scale.item())
        yield

    with loss_scale_held_back(optimizer) as loss_scale:
        prepare_update(optimizer, 1.0, 7, 2.0, guard, agreement=agreement,
                       hold_loss_scale=loss_scale.hold)
    assert seen_in_the_agreement == [1024.0]
    assert optimizer.grad_scaler.scale.item() == 1024.0  # what a dump sees before the commit
    loss_scale.move()
    assert optimizer.grad_scaler.scale.item() == moved_to


def test_an_iteration_stopped_before_its_commit_leaves_the_loss_scale(guard):
    optimizer = ScaledOptimizer(overflow=False, norm=math.inf)
    with pytest.raises(NonFiniteLoss), loss_scale_held_back(optimizer):
        prepare_update(optimizer, 1.0, 8, 2.0, guard)
    assert (optimizer.grad_scaler.scale.item(), optimizer.grad_scaler._growth_tracker) == (1024.0, 0)
