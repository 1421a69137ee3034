"""The NaN/Inf guard (Megatron-LM's ``--check-for-nan-in-loss-and-grad``, on by default).

An optimizer step is split where Megatron's own ``step()`` would run it: gradients prepared
(an fp16 overflow still skips the step, as the loss scaler wants, but a non-finite loss is
still one), the gradient norm taken,
then **every rank agrees**, in one MAX all-reduce of two flags on the control group, whether
any rank saw a non-finite loss or gradient norm. Only then are gradients clipped and the
update applied. A non-finite iteration raises :class:`NonFiniteLoss` on every rank at the same
point, before anything was updated, so no NaN ever reaches the weights or a checkpoint;
``pretrain_gpt.py`` exits with its own status, which ftmaster answers by relaunching from the
newest valid checkpoint.

For rehearsals (:mod:`rehearsal`), a rank can poison its own gradients at a given iteration,
right where corrupted values from a failing GPU would show up.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager

import torch
from megatron.core.optimizer import clip_grads

from .rehearsal import kill_point, poison_gradients


class NonFiniteLoss(Exception):
    """A NaN or Inf loss or gradient norm at ``iteration``; nothing was updated."""

    def __init__(self, iteration: int, what: str) -> None:
        super().__init__(f"non-finite {what} at iteration {iteration}: the iteration was "
                         f"stopped before the optimizer step; nothing was updated or saved")
        self.iteration = iteration
        self.what = what


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


class NonFiniteGuard:
    """Agrees, on every rank, whether an iteration's loss and gradients are finite."""

    def __init__(self, group, enabled: bool) -> None:
        self.group = group
        self.enabled = enabled
        self._flags = torch.zeros(2, dtype=torch.int32)

    def check(self, iteration: int, loss: float | None, grad_norm: float | None) -> None:
        if not self.enabled:
            return
        self._flags[0] = int(loss is not None and not math.isfinite(loss))
        self._flags[1] = int(grad_norm is not None and not math.isfinite(grad_norm))
        torch.distributed.all_reduce(self._flags, op=torch.distributed.ReduceOp.MAX,
                                     group=self.group)
        loss_bad, norm_bad = self._flags.tolist()
        if loss_bad or norm_bad:
            raise NonFiniteLoss(iteration, "loss" if loss_bad else "gradient norm")


class HeldLossScale:
    """The fp16 loss scalers' fields from before ``prepare_grads`` moved them, and the moved
    ones: put back as soon as they moved (:meth:`hold`), and moved again only at the cut's
    commit (:meth:`move`)."""

    def __init__(self, scalers: list) -> None:
        self.scalers = scalers
        self.before = [dict(vars(scaler)) for scaler in scalers]
        self.moved: list[dict] | None = None

    def hold(self) -> None:
        """Called right after ``prepare_grads``, before the update's agreement, during which
        a replica dump may be taken (a dead peer hangs it): the scalers are put back. Once."""
        if self.moved is None:
            self.moved = [dict(vars(scaler)) for scaler in self.scalers]
            _set_fields(self.scalers, self.before)

    def move(self) -> None:
        _set_fields(self.scalers, self.moved or [])


@contextlib.contextmanager
def loss_scale_held_back(optimizer):
    """Around :func:`prepare_update`: megatron-core moves the fp16 loss scalers inside
    ``prepare_grads``, before the update is agreed. A replica dump taken while a dead peer
    hung that agreement saw iteration N's weights with the scale already moved for N+1, and
    the resume from it moved the scale a second time. Held back (``prepare_update`` calls
    :meth:`HeldLossScale.hold` as soon as they moved, and at the latest this does on its
    way out), they keep their state until ``train_step`` calls :meth:`HeldLossScale.move`
    inside the cut's commit; after an error it never does, and they keep it."""
    held = HeldLossScale([scaler for sub in _sub_optimizers(optimizer)
                          if (scaler := getattr(sub, "grad_scaler", None)) is not None])
    try:
        yield held
    finally:  # megatron's update rebinds the fields it changes: a shallow copy keeps them
        held.hold()


def _set_fields(objects: list, fields: list[dict]) -> None:
    for target, values in zip(objects, fields):
        vars(target).update(values)


def prepare_update(optimizer, clip_grad: float, iteration: int, loss: float | None,
                   guard: NonFiniteGuard, poison: bool = False,
                   agreement: Callable[[], ContextManager] = contextlib.nullcontext,
                   hold_loss_scale: Callable[[], None] = lambda: None,
                   ) -> tuple[bool, float | None]:
    """Megatron's optimizer step up to the update, with the guard between the gradient norm
    and the clipping; the caller applies the update (``step_with_ready_grads``), so that it
    can do so under the lock a replica dump takes (see :mod:`replicas`), and the guard's
    check runs inside ``agreement`` (the dump's ``Cut.agreement``).

    Returns whether the update is to be applied (an fp16 overflow skips it, as in Megatron),
    and the gradient norm where it was computed. ``hold_loss_scale`` puts the loss scalers
    that ``prepare_grads`` moved back before the agreement (:class:`HeldLossScale`).
    """
    overflow = optimizer.prepare_grads()
    hold_loss_scale()
    if overflow:
        # An fp16 overflow: the loss scale made the gradients infinite and the step is
        # skipped. A non-finite loss is the forward's own, which no loss scale mends (Megatron
        # checks the loss in its loss function, whatever the gradients): checked here too, on
        # every rank alike, as the overflow is agreed across ranks.
        with agreement():
            guard.check(iteration, loss, None)
        return False, None
    if poison:
        poison_gradients(p for sub in _sub_optimizers(optimizer) for p in sub.get_parameters())
        loss = float("nan") if loss is not None else None
    grad_norm = optimizer.get_grad_norm() if (guard.enabled or clip_grad > 0) else None
    kill_point("grad-norm", iteration)
    with agreement():
        guard.check(iteration, loss, grad_norm)
    if clip_grad > 0:
        for sub in _sub_optimizers(optimizer):
            params = sub.get_parameters()
            if params:
                # Through the module, so that cpu_compat's CPU version is the one called.
                clip_grads.clip_grad_by_total_norm_fp32(params, clip_grad, grad_norm)
    return True, grad_norm
