"""Run megatron-core 0.16.1 on CPU with gloo: the complete list of adaptations.

megatron-core assumes CUDA in a handful of places. On a machine without CUDA, ``apply()``
adapts exactly these, and nothing else; with CUDA present it does nothing at all.

Patch points (module: what it assumes -> what we do):

1. ``torch.cuda.current_device()`` places tensors in the pipeline schedules and
   ``p2p_communication`` (shape exchange, receive buffers), ``utils.GlobalMemoryBuffer``,
   Megatron DDP's ``param_and_grad_buffer``, the attention and tensor-parallel layers, the
   optimizers (loss scale) and ``dist_checkpointing`` (the all-reduce that agrees an async
   save finished) -> inside the modules in ``_DEVICE_MODULES`` it returns the CPU device.
2. ``device="cuda"`` is hard-coded in ``pipeline_parallel.schedules`` (``total_num_tokens``),
   ``optimizer.clip_grads`` (norm and scale buffers), ``utils.local_multi_tensor_l2_norm``,
   ``transformer.utils`` (causal masks), DDP's buffer warm-up and
   ``dist_checkpointing.exchange_utils`` -> tensor factories called from those modules place
   "cuda" tensors on the CPU.
3. ``torch.cuda.synchronize()`` after batched p2p in ``p2p_communication`` -> a no-op (gloo's
   send/recv are already complete when ``wait()`` returns). Likewise the CUDA stream Megatron
   DDP makes for the all-reduce between distributed-optimizer instances
   (``--num-distributed-optimizer-instances`` above 1: ``torch.cuda.Stream``, ``stream``,
   ``default_stream``, ``wait_stream``) -> stand-ins with nothing to order.
4. The CUDA RNG tracker in ``tensor_parallel.random`` (``get_cuda_rng_tracker``,
   ``model_parallel_cuda_manual_seed``) reads and seeds the CUDA generator -> it reads and
   seeds the CPU default generator instead, so ``fork()`` still gives each TP rank its own
   stream for dropout and initialisation.
5. ``optimizer.clip_grads.clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor``
   grads -> replaced by the same scaling without the assertion, so ``--clip-grad`` works.
6. ``DistributedOptimizer.__init__`` and ``Float16OptimizerWithFloat16Params.__init__``
   accept only parameters whose ``Tensor.type()`` is ``torch.cuda.*Tensor`` -> while they run,
   ``Tensor.type()`` (without arguments) reports a CPU float tensor under its CUDA name. The
   buffers they wrap are Megatron DDP's, already on the CPU through patch 1; with this the
   distributed optimizer and bf16 train on CPU (fp16 is not tried and stays refused).
7. ``Tensor.cuda()`` is called by ``LanguageModule.setup_embeddings_and_output_layer`` (tied
   embeddings across pipeline stages), ``dist_checkpointing.exchange_utils`` (fully parallel
   load) and the optimizer's offload path -> it returns the tensor itself. This one is
   process-wide, because it is a method; without CUDA every such call would raise anyway.
8. ``CudaRNGStatesTracker.fork`` warns "CPU RNG state changed within GPU RNG context" when
   the CPU generator moves inside a fork; on CPU the forked stream *is* the CPU generator, so
   the warning is expected on every dropout -> that one message is filtered from its logger.

CPU choices made elsewhere, as settings rather than patches: ``model.transformer_config``
turns off the fused bias/dropout/activation/RoPE kernels and batched p2p without CUDA, and
``arguments`` refuses ``--fp16`` without CUDA. Bugs of megatron-core that hit GPUs as well
are fixed in :mod:`mcore_fixes`, not here (the local spec's torch norm under
``--sequence-parallel`` among them).

Patches 1-4 are scoped: each patched module gets its own view of ``torch`` whose ``cuda``
namespace and tensor factories are redirected, so code elsewhere (and torch itself) is
untouched.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types

import torch

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "empty_like", "zeros_like",
              "ones_like")

# Every module on the trainer's path that calls ``torch.cuda.current_device()`` or hard-codes
# ``device="cuda"`` (found with grep over megatron-core 0.16.1).
_DEVICE_MODULES = tuple(f"megatron.core.{name}" for name in (
    "distributed.distributed_data_parallel",
    "distributed.param_and_grad_buffer",
    "transformer.attention",
    "transformer.dot_product_attention",
    "transformer.module",
    "transformer.transformer_layer",
    "transformer.utils",
    "models.gpt.gpt_model",
    "models.common.embeddings.rotary_pos_embedding",
    "optimizer.distrib_optimizer",
    "tensor_parallel.data",
    "tensor_parallel.layers",
    "tensor_parallel.mappings",
    "tensor_parallel.random",
    "tensor_parallel.utils",
    "pipeline_parallel.p2p_communication",
    "pipeline_parallel.schedules",
    "optimizer.clip_grads",
    "optimizer.grad_scaler",
    "optimizer.optimizer",
    "dist_checkpointing.exchange_utils",
    "dist_checkpointing.strategies.fully_parallel",
    "dist_checkpointing.tensor_aware_state_dict",
    "dist_checkpointing.strategies.async_utils",
    "dist_checkpointing.strategies.filesystem_async",
    "dist_checkpointing.strategies.state_dict_saver",
    "parallel_state",
    "utils",
))

_applied = False
_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
                    "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


def _cpu_factory(factory):
    def make(*args, device=None, **kwargs):
        return factory(*args, device=_cpu_device(device), **kwargs)

    return make


class _CpuCudaNamespace(types.SimpleNamespace):
    """What the patched modules see as ``torch.cuda``: the CPU stands in for the device."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuStream:
    """A CUDA stream's stand-in: gloo's collectives are done when they return, so there is
    nothing to order."""

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _cpu_cuda_namespace():
    return _CpuCudaNamespace(
        Stream=lambda *args, **kwargs: _CpuStream(),
        stream=lambda stream: contextlib.nullcontext(),
        default_stream=lambda *args, **kwargs: _CpuStream(),
        current_stream=lambda *args, **kwargs: _CpuStream(),
        current_device=lambda: torch.device("cpu"),
        synchronize=lambda *args, **kwargs: None,
        is_available=lambda: False,
        get_rng_state=lambda *args, **kwargs: torch.get_rng_state(),
        set_rng_state=lambda state, *args, **kwargs: torch.set_rng_state(state),
        manual_seed=torch.manual_seed,
    )


class _CpuTorchView(types.ModuleType):
    """A module-local stand-in for ``torch`` with CPU factories and a CPU ``cuda``."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _cpu_cuda_namespace()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is not None:
            grad.detach().mul_(clip_coeff)


def _patch_rng_functions(random_module):
    random_module._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random_module._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def _reporting_cuda_type_names(init):
    """``init`` run with ``Tensor.type()`` naming CPU float tensors as CUDA ones (patch 6)."""
    def wrapped(self, *args, **kwargs):
        original = torch.Tensor.type

        def type_(tensor, dtype=None, non_blocking=False, **more):
            if dtype is None and not more:
                name = original(tensor)
                return _CUDA_TYPE_NAMES.get(name, name)
            return original(tensor, dtype, non_blocking, **more)

        torch.Tensor.type = type_
        try:
            init(self, *args, **kwargs)
        finally:
            torch.Tensor.type = original
    return wrapped


def _patch_classes() -> None:
    from megatron.core.optimizer import distrib_optimizer, optimizer

    for cls in (distrib_optimizer.DistributedOptimizer, optimizer.Float16OptimizerWithFloat16Params):
        cls.__init__ = _reporting_cuda_type_names(cls.__init__)


class _DropExpectedRngWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def apply() -> bool:
    """Adapt megatron-core for CPU when CUDA is absent. Returns True when patches applied."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    view = _CpuTorchView()
    for name in _DEVICE_MODULES:
        importlib.import_module(name).torch = view
    _patch_rng_functions(importlib.import_module("megatron.core.tensor_parallel.random"))
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropExpectedRngWarning())
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        module = importlib.import_module(name)
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            module.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    _patch_classes()
    _applied = True
    return True
