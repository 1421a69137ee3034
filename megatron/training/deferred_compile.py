"""megatron-core's ``torch.compile`` decorators, compiled at their function's first call
instead of importing TorchInductor while megatron-core is imported.

megatron-core 0.16.1 sets ``megatron.core.jit.jit_fuser = torch.compile`` and decorates about
twenty fusion functions with it at import time. ``torch.compile`` compiles lazily, at the first
call, but the decoration itself imports TorchInductor: 1.3-1.7 s of CPU a rank here, a third
of the trainer's imports (``python -X importtime``: ``torch._inductor.compile_fx`` under
``megatron.core.fusions.fused_bias_geglu``). Without CUDA the fused kernels are switched off
(``model.transformer_config``) and none of those functions is ever called, so that import
bought nothing; with CUDA it now happens at the first fused call, which compiled there
anyway. Only while megatron-core is imported: ``torch.compile`` is given back afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Iterator


def deferred(compile_fn: Callable) -> Callable:
    """A stand-in for ``compile_fn`` (``torch.compile``) that compiles a plain function at
    its first call, with the same options. A module, or anything but a function, is compiled
    at once: ``torch.compile`` returns an ``OptimizedModule`` for those, not a function."""

    def compile_later(model=None, **options):
        if model is None:  # used as @torch.compile(mode=...)
            return lambda function: compile_later(function, **options)
        if not inspect.isfunction(model):
            return compile_fn(model, **options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    return compile_later


@contextlib.contextmanager
def compile_at_first_call() -> Iterator[None]:
    """Inside, ``torch.compile`` defers as :func:`deferred` does."""
    import torch

    real = torch.compile
    torch.compile = deferred(real)
    try:
        yield
    finally:
        torch.compile = real
