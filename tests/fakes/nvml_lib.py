"""The fake ``libnvidia-ml`` (``fake_libnvidia_ml.c``) behind a fresh copy of the real pynvml.

:func:`build` compiles the library (None without a C compiler); :class:`FakeNvml` loads one
copy of it, binds a private copy of ``pynvml`` to it (so tests never share pynvml's global
library handle or function cache), and wraps the library's ``fake_*`` controls.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).with_name("fake_libnvidia_ml.c")
GPU_IS_LOST, RESET_REQUIRED, TIMEOUT = 15, 16, 10
NOT_SUPPORTED, NO_PERMISSION, UNKNOWN = 3, 4, 999
_copies = itertools.count()


def build(out_dir: Path, old_driver: bool = False) -> Path | None:
    """Compile the fake library into ``out_dir``; None when there is no C compiler."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    path = Path(out_dir) / ("libnvidia-ml-old.so.1" if old_driver else "libnvidia-ml.so.1")
    flags = ["-DOLD_DRIVER"] if old_driver else []
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", *flags, "-o", str(path), str(SOURCE)],
                   check=True, capture_output=True)
    return path


def fresh_pynvml(library: ctypes.CDLL) -> ModuleType:
    """A private copy of the installed pynvml whose NVML library is ``library``."""
    origin = importlib.util.find_spec("pynvml").origin
    name = f"pynvml_fake_{next(_copies)}"
    spec = importlib.util.spec_from_file_location(name, origin)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pynvml looks itself up there while it loads
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    module.nvmlLib = library
    return module


class FakeNvml:
    """One loaded copy of the fake library with ``gpus`` GPUs, and its pynvml."""

    def __init__(self, built: Path, copy_dir: Path, gpus: int) -> None:
        # dlopen shares one instance per path: a copy of our own keeps the fake's state ours.
        path = Path(copy_dir) / f"{next(_copies)}-{built.name}"
        shutil.copyfile(built, path)
        self.lib = ctypes.CDLL(str(path))
        self.lib.fake_calls.restype = ctypes.c_long
        self.lib.fake_push_xid.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
        self.lib.fake_configure(gpus)
        self.gpus = gpus
        self.pynvml = fresh_pynvml(self.lib)

    def wedge(self, gpu: int, on: bool = True) -> None:
        self.lib.fake_wedge(gpu, int(on))

    def release_all(self) -> None:
        for gpu in range(self.gpus):
            self.lib.fake_wedge(gpu, 0)

    def fail(self, gpu: int, nvml_error: int) -> None:
        self.lib.fake_fail(gpu, nvml_error)

    def calls(self, gpu: int) -> int:
        return self.lib.fake_calls(gpu)

    def delays(self, init_ms: int = 0, open_ms: int = 0) -> None:
        self.lib.fake_delays(init_ms, open_ms)

    def index_error(self, nvml_error: int) -> None:
        self.lib.fake_index_error(nvml_error)

    def remap(self, gpu: int, pending: int, failure: int) -> None:
        self.lib.fake_remap(gpu, pending, failure)

    def mig(self, gpu: int, mode: int) -> None:
        """1 on, 0 off, -1 not supported."""
        self.lib.fake_mig(gpu, mode)

    def field_type(self, value_type: int) -> None:
        self.lib.fake_field_type(value_type)

    def push_xid(self, gpu: int, code: int) -> None:
        """Queue an XID on ``gpu``; dropped unless it is registered for events, as in the driver."""
        self.lib.fake_push_xid(gpu, code)

    def register_error(self, gpu: int, nvml_error: int) -> None:
        """Make ``nvmlDeviceRegisterEvents`` on ``gpu`` fail with ``nvml_error`` (0: succeed)."""
        self.lib.fake_register_error(gpu, nvml_error)

    def registered(self, gpu: int) -> bool:
        return bool(self.lib.fake_registered(gpu))

    def new_calls_unsupported(self, gpu: int, on: bool = True) -> None:
        """``nvmlDeviceGetTemperatureV`` and ``...ClocksEventReasons`` say NOT_SUPPORTED on ``gpu``."""
        self.lib.fake_new_calls_unsupported(gpu, int(on))

    def event_sets(self) -> tuple[int, int]:
        """(made, freed) event sets."""
        return self.lib.fake_sets_made(), self.lib.fake_sets_freed()
