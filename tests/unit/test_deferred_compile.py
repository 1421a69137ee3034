"""megatron-core's compile decorators deferred to the first call, and a rank's end without
the interpreter's teardown."""

import subprocess
import sys
import textwrap

import torch

from helpers.trainer import REPO
from megatron.training.deferred_compile import compile_at_first_call, deferred


class Compiler:
    """A stand-in for ``torch.compile`` that records what it was asked to compile."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, **options):
        self.calls.append((model, options))
        return lambda *args, **kwargs: ("compiled", model(*args, **kwargs))


def double(x):
    """Twice x."""
    return 2 * x


def test_a_function_is_compiled_at_its_first_call_once_with_its_options():
    compiler = Compiler()
    wrapped = deferred(compiler)(double, mode="max-autotune")
    assert compiler.calls == []
    assert (wrapped.__name__, wrapped.__doc__) == ("double", "Twice x.")
    assert wrapped(3) == ("compiled", 6) and wrapped(x=4) == ("compiled", 8)
    assert compiler.calls == [(double, {"mode": "max-autotune"})]


def test_as_a_decorator_with_options_and_on_a_method():
    compiler = Compiler()

    class Norm:
        @deferred(compiler)(dynamic=False)
        def scale(self, x):
            return x + 1

    assert compiler.calls == []
    assert Norm().scale(1) == ("compiled", 2)
    assert [options for _, options in compiler.calls] == [{"dynamic": False}]


def test_a_module_is_compiled_at_once():
    compiler = Compiler()
    module = torch.nn.Identity()
    deferred(compiler)(module)
    assert compiler.calls == [(module, {})]


def test_torch_compile_is_given_back_even_when_the_import_fails():
    real = torch.compile
    try:
        with compile_at_first_call():
            assert torch.compile is not real
            raise ImportError("a module that does not import")
    except ImportError:
        pass
    assert torch.compile is real


def test_megatron_core_imports_without_torchinductor_and_its_decorators_deferred():
    """In a fresh interpreter (megatron-core's decorators run once per process)."""
    code = textwrap.dedent("""
        import sys
        import torch
        from megatron.training.deferred_compile import compile_at_first_call
        with compile_at_first_call():
            import megatron.core
            from megatron.core import jit
        print("inductor" if "torch._inductor.compile_fx" in sys.modules else "no inductor")
        print("restored" if torch.compile.__module__ == "torch" else "still patched")
        print("deferred" if jit.jit_fuser is not torch.compile else "eager")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["no", "inductor", "restored", "deferred"]


def test_a_rank_ends_with_its_status_after_its_threads_and_exit_handlers():
    code = textwrap.dedent("""
        import atexit, threading, time
        from pretrain_gpt import end_without_teardown
        atexit.register(lambda: print("exit handler", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread", flush=True))).start()
        print("main returned")
        end_without_teardown(3)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stdout.split("\n") == ["main returned", "thread", "exit handler", ""]
