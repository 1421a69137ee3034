"""Fixes for megatron-core 0.16.1, on CPU and GPU alike.

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
   2026-08-21), in no release yet, the other way round: the world tensors stay packed and the
   slices skip the padding. On top of that fix this re-layout would again hand parameters
   other parameters' state, so it is applied only where the installed method is seen to get
   it wrong: :func:`_reshards_correctly` runs it on two padded buckets of a small stand-in
   optimizer (no communication), before and with the fix.

Without Apex or Transformer Engine (``distrib_optimizer.HAVE_APEX_OR_TE`` False: the CPU, or
a CUDA install without either), the distributed optimizer runs ``torch.optim.Adam``, whose
per-parameter ``step`` the code does not expect:

2. ``state_dict`` asserts one ``step`` over a fresh optimizer that has none (the template of a
   load): a fresh state is created first, as Adam's first step would;
3. ``_set_main_param_and_optimizer_states`` copies every key of a loaded state, and the fully
   reshardable format drops ``step``: the current one is kept;
4. ``load_state_dict`` gives every parameter the same ``step`` tensor, which Adam then
   advances once per parameter per iteration: each gets its own copy.

And outside the optimizer:

5. ``transformer.torch_norm.WrappedTorchNorm`` (the local spec's norm without Apex: the CPU,
   ``--transformer-impl local``, or CUDA without Transformer Engine) refuses
   ``sequence_parallel``, an assertion at the model's build -> it is built per token from a
   copy of the config without it (a norm is correct on a sequence shard), and its weights
   are marked ``sequence_parallel`` as Apex's ``FusedLayerNorm`` marks its own, so
   ``finalize_model_grads`` all-reduces their gradients over TP. (Without the marking the TP
   ranks' norms drift apart.)
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import torch

from .console import local_rank

_applied = False


def _at_buffer_offsets(optimizer, state):
    """``get_parameter_state_dp_zero``'s world tensors, moved to their buckets' offsets."""
    for index, buffer in enumerate(optimizer.buffers):
        for world in state[index].values():
            if not world:
                continue
            for key in ("param", "exp_avg", "exp_avg_sq"):
                packed, start = world[key], 0
                padded = packed.new_zeros(buffer.numel)
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


class _TwoBuckets:
    """A distributed optimizer's layout as ``sharded_param_state_fully_reshardable`` reads it:
    one buffer, two buckets of one parameter each, each bucket padded at its end (3 + 5 of 8
    and 5 + 3 of 8), and ``get_parameter_state_dp_zero``'s world tensors as megatron-core 0.16.1
    packs them, without that padding. Each state value is unique: ``param`` is 1-8, the
    moments 101-108 and 201-208, in parameter order."""

    KEYS = ("param", "exp_avg", "exp_avg_sq")

    def __init__(self) -> None:
        from megatron.core.optimizer.distrib_optimizer import Range

        self.params = [torch.zeros(3), torch.zeros(5)]
        spans, buckets, param_maps = [(0, 3), (8, 13)], [], []
        for index, (param, (start, end)) in enumerate(zip(self.params, spans)):
            offset, numel = index * 8, end - start
            buckets.append(SimpleNamespace(offset=offset, numel_unpadded=numel, bucket_id=index,
                                           grad_data=torch.zeros(8), params=[param]))
            local = Range(start - offset, end - offset)
            param_maps.append({"param_map": {param: {
                "gbuf_world": Range(start, end), "gbuf_world_in_bucket": local,
                "gbuf_local": local, "param": Range(0, numel)}}})
        self.buffers = [SimpleNamespace(
            numel=16, numel_unpadded=8, buckets=buckets, bucket_indices=[(0, 8), (8, 16)],
            param_index_map={param: (*span, index)
                             for index, (param, span) in enumerate(zip(self.params, spans))})]
        self.gbuf_ranges = [{torch.float32: param_maps}]
        self.per_bucket_numel, self.per_bucket_numel_unpadded = [{torch.float32: [8, 8]}], [
            {torch.float32: [3, 5]}]

    def get_parameter_state_dp_zero(self, use_gloo_comm=True, empty_data=False,
                                    return_on_all_ranks=False):
        world = {key: torch.arange(1.0, 9.0) + 100 * index for index, key in enumerate(self.KEYS)}
        return {"buckets_coalesced": True, 0: {torch.float32: {**world, "numel_unpadded": 8}}}

    def expected(self) -> list[dict[str, torch.Tensor]]:
        packed = self.get_parameter_state_dp_zero()[0][torch.float32]
        return [{key: packed[key][start:end] for key in self.KEYS}
                for start, end in [(0, 3), (3, 8)]]


def _reshards_correctly(fully_reshardable) -> bool:
    """Whether ``fully_reshardable`` gives each parameter of :class:`_TwoBuckets` its own
    state. megatron-core's warning of a range past the world tensor (its own symptom of the
    bug) is kept out of the log meanwhile."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.optimizer import distrib_optimizer

    probe = _TwoBuckets()
    model = {name: ShardedTensor.from_rank_offsets(name, param)
             for name, param in zip(("first", "second"), probe.params)}
    log = logging.getLogger(distrib_optimizer.__name__)
    was_disabled, log.disabled = log.disabled, True
    try:
        state = fully_reshardable(probe, model, False, {})
    finally:
        log.disabled = was_disabled
    return len(state) == 2 and all(
        torch.equal(state[index][key].data.reshape(-1), values)
        for index, expected in enumerate(probe.expected()) for key, values in expected.items())


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


def _sequence_parallel_norm(original_new):
    """Fix 5: a per-token norm on a sequence shard, its weights synchronised over TP."""
    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
            zero_centered_gamma=False, normalization="LayerNorm"):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, persist_layer_norm,
                                zero_centered_gamma, normalization)
        per_token = copy.copy(config)
        per_token.sequence_parallel = False
        norm = original_new(cls, per_token, hidden_size, eps, persist_layer_norm,
                            zero_centered_gamma, normalization)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm
    return staticmethod(new)


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.transformer import torch_norm

    torch_norm.WrappedTorchNorm.__new__ = _sequence_parallel_norm(torch_norm.WrappedTorchNorm.__new__)
    optimizer = distrib_optimizer.DistributedOptimizer
    installed = optimizer.sharded_param_state_fully_reshardable
    fixed = _with_world_tensors_at_buffer_offsets(installed)
    try:
        needed = not _reshards_correctly(installed)
        works = needed and _reshards_correctly(fixed)
    except Exception as error:  # another megatron-core than the one this fix was made for
        needed, works = True, False
        problem = f"its check failed ({type(error).__name__}: {error})"
    else:
        problem = "it does not help this megatron-core"
    if needed and works:
        optimizer.sharded_param_state_fully_reshardable = fixed
    elif needed and local_rank() == 0:
        print("warning: megatron-core's fully reshardable distributed optimizer state is not "
              f"fixed here: {problem}; with more than one gradient bucket its checkpoints may "
              "hold parameters' state at the wrong offsets", flush=True)
    if not distrib_optimizer.HAVE_APEX_OR_TE:
        optimizer.state_dict = _with_fresh_adam_state(optimizer.state_dict)
        optimizer._set_main_param_and_optimizer_states = _keeping_step(
            optimizer._set_main_param_and_optimizer_states)
        optimizer.load_state_dict = _unsharing_steps(optimizer.load_state_dict)
    _applied = True
