"""Fixes for megatron-core 0.16.1's distributed optimizer, on CPU and GPU alike.

Each is a wrapper around one method, applied once by :func:`apply` (idempotent). They are
bugs of the pinned release, not CPU adaptations (those are in :mod:`cpu_compat`):

1. ``DistributedOptimizer.sharded_param_state_fully_reshardable`` slices the world tensors of
   ``get_parameter_state_dp_zero``, packed without the padding between buckets, at
   ``param_index_map`` offsets that include it: with more than one bucket (any overlapped
   gradient reduce, or a first pipeline stage's separate embedding bucket), every parameter
   after the first padded bucket end is saved with another parameter's optimizer state and
   fp32 master weights. Silent; the checkpoint is wrong on disk. Here the world tensors are
   laid out at the buckets' own offsets first. Upstream fixed it in NVIDIA/Megatron-LM
   32a03b77c5 ("Fix bugs in re-sharding DistributedOptimizer state in torch_dist checkpoint",
   2026-08-21), in no release yet.

Without Apex or Transformer Engine (``distrib_optimizer.HAVE_APEX_OR_TE`` False: the CPU, or
a CUDA install without either), the distributed optimizer runs ``torch.optim.Adam``, whose
per-parameter ``step`` the code does not expect:

2. ``state_dict`` asserts one ``step`` over a fresh optimizer that has none (the template of a
   load): a fresh state is created first, as Adam's first step would;
3. ``_set_main_param_and_optimizer_states`` copies every key of a loaded state, and the fully
   reshardable format drops ``step``: the current one is kept;
4. ``load_state_dict`` gives every parameter the same ``step`` tensor, which Adam then
   advances once per parameter per iteration: each gets its own copy.
"""

from __future__ import annotations

import torch

_applied = False


def _at_buffer_offsets(optimizer, state):
    """``get_parameter_state_dp_zero``'s world tensors, moved to their buckets' offsets."""
    for index, buffer in enumerate(optimizer.buffers):
        for world in state[index].values():
            if not world:
                continue
            for key in ("param", "exp_avg", "exp_avg_sq"):
                packed, padded, start = world[key], torch.zeros(buffer.numel), 0
                for bucket in buffer.buckets:
                    padded[bucket.offset:bucket.offset + bucket.numel_unpadded] = (
                        packed[start:start + bucket.numel_unpadded])
                    start += bucket.numel_unpadded
                world[key] = padded
    return state


def _with_world_tensors_at_buffer_offsets(fully_reshardable):
    def wrapped(self, model_sharded_state_dict, is_loading=False, metadata=None):
        packed = type(self).get_parameter_state_dp_zero

        def padded(*args, **kwargs):
            state = packed(self, *args, **kwargs)
            return None if state is None else _at_buffer_offsets(self, state)

        self.get_parameter_state_dp_zero = padded
        try:
            return fully_reshardable(self, model_sharded_state_dict, is_loading, metadata)
        finally:
            del self.get_parameter_state_dp_zero
    return wrapped


def _with_fresh_adam_state(state_dict):
    def wrapped(self):
        if len(self.optimizer.state) == 0:
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    self.optimizer.state[param].update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                        exp_avg_sq=torch.zeros_like(param))
        return state_dict(self)
    return wrapped


def _keeping_step(set_states):
    def wrapped(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state.get(main_param, {})
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        return set_states(self, model_param, tensors)
    return wrapped


def _unsharing_steps(load_state_dict):
    def wrapped(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
    return wrapped


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.optimizer import distrib_optimizer

    optimizer = distrib_optimizer.DistributedOptimizer
    optimizer.sharded_param_state_fully_reshardable = _with_world_tensors_at_buffer_offsets(
        optimizer.sharded_param_state_fully_reshardable)
    if not distrib_optimizer.HAVE_APEX_OR_TE:
        optimizer.state_dict = _with_fresh_adam_state(optimizer.state_dict)
        optimizer._set_main_param_and_optimizer_states = _keeping_step(
            optimizer._set_main_param_and_optimizer_states)
        optimizer.load_state_dict = _unsharing_steps(optimizer.load_state_dict)
    _applied = True
