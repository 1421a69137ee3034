"""A distributed optimizer's checkpoint resumed by the plain optimizer.

megatron-core 0.16.1 does not load one into the other: their param groups differ (the plain
optimizer's ``load_state_dict`` raises KeyError 'pre_wd_mult'), and so do their tensors'
names (``optimizer.state.param.<key>`` for the distributed optimizer's fp32 master weights,
``optimizer.state.fp32_param.<key>`` for the mixed-precision one's). But the fully
reshardable format (``DistributedOptimizer.sharded_param_state_fully_reshardable``) stores the
state in model space: per parameter, ``param``, ``exp_avg`` and ``exp_avg_sq`` shaped as the
parameter, and ``step`` in the param groups. So the load asks for those tensors under the
model's own sharding (:func:`template`), and :func:`apply` hands them to the plain
optimizer's Adam, parameter by parameter; its hyperparameters stay the ones it was built
with (the schedule sets the learning rate and weight decay at each step).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

from .optimizer_shards import STATE_KEYS, distributed_optimizers, sharding_by_param

KEY = "optimizer_from_distributed"
"""Where the template puts the tensors (the load's result has them at the same place)."""

STEP_PER_PARAMETER = (torch.optim.Adam, torch.optim.AdamW)
"""torch's Adams count their step per parameter. Transformer Engine's and apex's FusedAdam
(megatron-core's Adam wherever either is installed) count it per param group, as the saved
param groups hold it, and their ``state_dict`` reads every per-parameter entry as a moment
(KeyError 'step' for any other)."""


def _main_params(optimizer) -> list[tuple[torch.nn.Parameter, torch.Tensor, torch.optim.Optimizer]]:
    """(model parameter, the parameter Adam updates, that Adam) for every parameter."""
    pairs = []
    for inner in distributed_optimizers(optimizer):
        if hasattr(inner, "float16_groups"):  # mixed precision: fp32 copies of the bf16/fp16 ones
            groups = zip(inner.float16_groups + inner.fp32_from_fp32_groups,
                         inner.fp32_from_float16_groups + inner.fp32_from_fp32_groups)
        else:
            groups = ((group["params"], group["params"]) for group in inner.optimizer.param_groups)
        pairs += [(model, main, inner.optimizer) for models, mains in groups
                  for model, main in zip(models, mains)]
    return pairs


def template(optimizer, model_sharded_state_dict: dict) -> dict:
    """The fully reshardable tensors of every parameter, under the model's sharding."""
    metadata_of = sharding_by_param(model_sharded_state_dict)
    tensors = {}
    for index, (model, _, _) in enumerate(_main_params(optimizer)):
        sharded_metadata = metadata_of[model]
        tensors[index] = {}
        for state_key in STATE_KEYS:
            empty = torch.empty(model.shape, dtype=torch.float32, device=model.device)
            changes = dict(key=f"optimizer.state.{state_key}.{sharded_metadata.key}", data=empty)
            if not isinstance(sharded_metadata, ShardedTensorFactory):
                changes["dtype"] = empty.dtype
            tensors[index][state_key] = replace(sharded_metadata, **changes)
    return {KEY: tensors}


def saved_step(common_optimizer: dict) -> float:
    """Adam's step as the distributed optimizer saved it (in its param groups); 0 when no
    group holds one: a fused Adam (Transformer Engine's, apex's) that never stepped (fp16,
    every step so far skipped by the loss scale) saves none, and such a checkpoint was
    skipped as unloadable, then every older one too."""
    groups = common_optimizer.get("optimizer", {}).get("param_groups", [])
    steps = {float(group["step"]) for group in groups if group.get("step") is not None}
    if groups and not steps:
        return 0.0
    if len(steps) != 1:
        raise ValueError(f"the checkpoint's optimizer holds no single step ({sorted(steps)})")
    return steps.pop()


def apply(optimizer, loaded: dict, step: float) -> None:
    """Give each parameter's Adam its loaded state, the master weights their values, and an
    fp16 loss scaler the scale saved beside them (as ``DistributedOptimizer.load_state_dict``
    does: a fresh scaler starts at 2^32 again, and skips tens of steps finding its level)."""
    saved_scaler = (loaded.get("optimizer") or {}).get("grad_scaler")
    # each inner optimizer's: megatron-core's ChainedOptimizer, what it builds, has none itself
    for inner in distributed_optimizers(optimizer):
        if saved_scaler is not None and getattr(inner, "grad_scaler", None) is not None:
            inner.grad_scaler.load_state_dict(saved_scaler)
    tensors = loaded[KEY]
    for index, (_, main, adam) in enumerate(_main_params(optimizer)):
        state = tensors[index]
        with torch.no_grad():
            main.copy_(state["param"].view_as(main))
        adam.state[main] = {"exp_avg": state["exp_avg"].view_as(main).to(main.dtype).clone(),
                            "exp_avg_sq": state["exp_avg_sq"].view_as(main).to(main.dtype).clone()}
        if isinstance(adam, STEP_PER_PARAMETER):
            adam.state[main]["step"] = torch.tensor(step)
        else:
            for group in adam.param_groups:
                group["step"] = int(step)
