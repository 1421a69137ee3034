"""NVML backend (nvidia-ml-py's ``pynvml``): every call bounded, a failed read is unknown.

- ``nvmlInit`` runs once per process (NVML reference-counts inits, but one is all we need and
  it keeps a wedged driver from being hit again by every new backend).
- Every NVML call runs on one worker thread with a deadline (:class:`BoundedCaller`). A call
  that overruns gives "unknown" and, while it stays stuck, later calls in that sample give
  "unknown" at once instead of piling up threads behind it. A later sample that finds the
  call still stuck fails with a BackendError naming it: a wedged driver is an error the
  monitor reports, not GPUs that stay "unknown" in silence.
- A call that fails gives ``None`` (unknown), never a healthy default. ``NOT_SUPPORTED`` is
  remembered per GPU and field so unsupported reads are not retried every sample.
- ``NVML_ERROR_GPU_IS_LOST`` on any call leaves that GPU out of the sample: the monitor
  reports it lost.
- XIDs come from an event set polled with ``nvmlEventSetWait(set, 0)``, which never blocks.
- GPU ids are NVML indices (PCI bus order); ``ftmaster launch`` runs training with
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that ``CUDA_VISIBLE_DEVICES`` uses the same numbers.
"""

from __future__ import annotations

import importlib
import queue
import threading
import time
from types import ModuleType
from typing import Any, Callable, Sequence

from ftmaster.monitor.backends import BackendError
from ftmaster.monitor.sample import FIELD_NAMES, GpuSample
from ftmaster.monitor.signals import worst_xid

MIB = 1024 * 1024
# nvmlFieldValue_t.valueType -> the union member that holds the value
_FIELD_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}
# A storm of XID events must not stall one sample; the rest are read next time.
MAX_EVENTS_PER_SAMPLE = 64


class CallTimeout(Exception):
    """An NVML call did not return within its deadline (or an earlier one is still stuck)."""


class BoundedCaller:
    """Runs calls one at a time on a daemon worker thread, each with a deadline.

    A daemon thread (not a ThreadPoolExecutor, whose workers are joined at exit) so that a
    call stuck in the driver can never keep the process from exiting.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._stuck: tuple[str, float, threading.Event] | None = None  # name, since, done
        threading.Thread(target=self._serve, name="nvml-calls", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, args, box, done = self._requests.get()
            try:
                box.append((True, fn(*args)))
            except BaseException as exc:  # handed back to the caller, who decides
                box.append((False, exc))
            done.set()

    def stuck_call(self) -> tuple[str, float] | None:
        """The call that overran and has still not returned, and for how many seconds."""
        if self._stuck is None:
            return None
        name, since, done = self._stuck
        if done.is_set():
            self._stuck = None
            return None
        return name, time.monotonic() - since

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        stuck = self.stuck_call()
        if stuck is not None:
            raise CallTimeout(f"{stuck[0]} is still stuck; skipping")
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        since = time.monotonic()
        self._requests.put((fn, args, box, done))
        if not done.wait(self.timeout_s):
            name = getattr(fn, "__name__", repr(fn))
            self._stuck = (name, since, done)
            raise CallTimeout(f"{name} did not return within {self.timeout_s:g} s")
        ok, value = box[0]
        if ok:
            return value
        raise value


_INIT_LOCK = threading.Lock()
_INITIALISED: set[ModuleType] = set()


def _init_once(nvml: ModuleType, calls: BoundedCaller) -> None:
    with _INIT_LOCK:
        if nvml in _INITIALISED:
            return
        try:
            calls.call(nvml.nvmlInit)
        except Exception as exc:
            raise BackendError(f"NVML could not start: {exc}") from None
        _INITIALISED.add(nvml)


class _GpuLost(Exception):
    pass


class NvmlBackend:
    """Samples every (or the chosen) GPU through NVML."""

    name = "nvml"

    def __init__(self, gpu_ids: Sequence[int] | None = None, call_timeout_s: float = 1.0,
                 nvml: ModuleType | None = None) -> None:
        try:
            self._nvml = nvml or importlib.import_module("pynvml")
        except ImportError:
            raise BackendError("the nvml backend needs nvidia-ml-py (pip install nvidia-ml-py)") from None
        self._calls = BoundedCaller(call_timeout_s)
        _init_once(self._nvml, self._calls)
        self._handles = self._open_handles(gpu_ids)
        self._unsupported: set[tuple[int, str]] = set()
        self._names: dict[int, str] = {}
        self._driver: str | None = None
        self._events = self._open_event_set()

    # -- set-up ---------------------------------------------------------------------------
    def _open_handles(self, gpu_ids: Sequence[int] | None) -> dict[int, Any]:
        n = self._nvml
        try:
            count = self._calls.call(n.nvmlDeviceGetCount)
        except Exception as exc:
            raise BackendError(f"NVML could not count GPUs: {exc}") from None
        wanted = range(count) if gpu_ids is None else gpu_ids
        missing = [g for g in wanted if not 0 <= g < count]
        if missing:
            raise BackendError(f"NVML sees {count} GPU(s); no GPU with index {missing}")
        handles = {}
        for gpu in wanted:
            try:
                handles[gpu] = self._calls.call(n.nvmlDeviceGetHandleByIndex, gpu)
            except Exception as exc:
                raise BackendError(f"NVML could not open GPU {gpu}: {exc}") from None
        return handles

    def _open_event_set(self) -> Any:
        """An XID event set; a GPU that cannot register simply reports no XIDs."""
        n = self._nvml
        try:
            events = self._calls.call(n.nvmlEventSetCreate)
        except Exception:
            return None
        for handle in self._handles.values():
            try:
                self._calls.call(n.nvmlDeviceRegisterEvents, handle, n.nvmlEventTypeXidCriticalError,
                                 events)
            except Exception:
                continue
        return events

    def close(self) -> None:
        # NVML stays initialised: the init is per process and other backends may share it.
        if self._events is not None:
            try:
                self._calls.call(self._nvml.nvmlEventSetFree, self._events)
            except Exception:
                pass
            self._events = None

    @property
    def reported_fields(self) -> frozenset[str]:
        """The sample fields this backend can fill at all; XIDs need the event set."""
        every = frozenset(FIELD_NAMES)
        return every if self._events is not None else every - {"xid"}

    # -- reads ----------------------------------------------------------------------------
    def _read(self, gpu: int, field: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One bounded call; None when it fails or overruns; _GpuLost when the GPU is gone."""
        if (gpu, field) in self._unsupported:
            return None
        n = self._nvml
        try:
            return self._calls.call(fn, *args)
        except CallTimeout:
            return None
        except n.NVMLError as exc:
            if exc.value == n.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost() from None
            if exc.value == n.NVML_ERROR_NOT_SUPPORTED:
                self._unsupported.add((gpu, field))
            return None
        except Exception:
            return None

    def sample(self) -> list[GpuSample]:
        stuck = self._calls.stuck_call()
        if stuck is not None:
            name, seconds = stuck
            raise BackendError(f"NVML call {name} has not returned for {seconds:.1f} s; "
                               f"the driver may be wedged")
        xids = self._drain_xids()
        if self._driver is None:
            self._driver = self._read(-1, "driver", self._nvml.nvmlSystemGetDriverVersion)
        samples = []
        for gpu, handle in self._handles.items():
            try:
                samples.append(self._sample_gpu(gpu, handle, xids))
            except _GpuLost:
                continue
        return samples

    def _sample_gpu(self, gpu: int, handle: Any, xids: dict[int, list[int]]) -> GpuSample:
        n = self._nvml
        now = time.time()
        if gpu not in self._names:
            name = self._read(gpu, "name", n.nvmlDeviceGetName, handle)
            if name is not None:
                self._names[gpu] = name
        util = self._read(gpu, "utilization", n.nvmlDeviceGetUtilizationRates, handle)
        memory = self._read(gpu, "memory", n.nvmlDeviceGetMemoryInfo, handle)
        return GpuSample(
            timestamp=now,
            gpu_id=gpu,
            gpu_name=self._names.get(gpu),
            driver_version=self._driver,
            temperature=self._read(gpu, "temperature", n.nvmlDeviceGetTemperature, handle,
                                   n.NVML_TEMPERATURE_GPU),
            power_draw=_scaled(self._read(gpu, "power", n.nvmlDeviceGetPowerUsage, handle), 1e-3),
            gpu_utilization=None if util is None else float(util.gpu),
            memory_utilization=None if util is None else float(util.memory),
            memory_used=None if memory is None else memory.used / MIB,
            memory_total=None if memory is None else memory.total / MIB,
            errors=self._read(gpu, "ecc_aggregate", n.nvmlDeviceGetTotalEccErrors, handle,
                              n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_AGGREGATE_ECC),
            ecc_sbe=self._read(gpu, "ecc_sbe", n.nvmlDeviceGetTotalEccErrors, handle,
                               n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC),
            ecc_dbe=self._read(gpu, "ecc_dbe", n.nvmlDeviceGetTotalEccErrors, handle,
                               n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC),
            xid=worst_xid(xids.get(gpu, ())),
            throttle_reasons=self._read(gpu, "throttle", self._throttle_fn(), handle),
            power_limit=_scaled(self._read(gpu, "power_limit", n.nvmlDeviceGetEnforcedPowerLimit,
                                           handle), 1e-3),
            sm_clock=self._read(gpu, "sm_clock", n.nvmlDeviceGetClockInfo, handle, n.NVML_CLOCK_SM),
            pcie_replay=self._read(gpu, "pcie_replay", n.nvmlDeviceGetPcieReplayCounter, handle),
            retired_pages_pending=self._pending(gpu, handle),
            recovery_action=self._recovery_action(gpu, handle),
        )

    def _throttle_fn(self) -> Callable[..., Any]:
        # Renamed "clocks event reasons" in newer drivers; older pynvml has only the old name.
        n = self._nvml
        return getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            n.nvmlDeviceGetCurrentClocksThrottleReasons

    def _pending(self, gpu: int, handle: Any) -> int | None:
        """1 when retired pages or remapped rows are pending (or a remap failed), else 0.

        Pre-Ampere GPUs retire pages, Ampere and later remap rows: whichever the GPU supports
        answers. None only when neither could be read.
        """
        n = self._nvml
        retired = self._read(gpu, "retired_pending", n.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        remapped = self._read(gpu, "remapped_rows", n.nvmlDeviceGetRemappedRows, handle)
        answers = []
        if retired is not None:
            answers.append(bool(retired))
        if remapped is not None:
            _corrected, _uncorrected, pending, failure = remapped
            answers.append(bool(pending) or bool(failure))
        return None if not answers else int(any(answers))

    def _recovery_action(self, gpu: int, handle: Any) -> int | None:
        """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (driver >= 570); None where it is missing."""
        n = self._nvml
        field_id = getattr(n, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field_id is None:
            return None
        values = self._read(gpu, "recovery_action", n.nvmlDeviceGetFieldValues, handle, [field_id])
        if not values or values[0].nvmlReturn != n.NVML_SUCCESS:
            return None
        member = _FIELD_MEMBERS.get(values[0].valueType)
        return None if member is None else int(getattr(values[0].value, member))

    def _drain_xids(self) -> dict[int, list[int]]:
        """XID codes per GPU since the last sample, without waiting (timeout 0)."""
        n = self._nvml
        seen: dict[int, list[int]] = {}
        if self._events is None:
            return seen
        for _ in range(MAX_EVENTS_PER_SAMPLE):
            try:
                event = self._calls.call(n.nvmlEventSetWait, self._events, 0)
            except Exception:
                break  # NVML_ERROR_TIMEOUT: nothing pending; anything else: try next sample
            try:
                gpu = self._calls.call(n.nvmlDeviceGetIndex, event.device)
            except Exception:
                continue
            seen.setdefault(gpu, []).append(int(event.eventData))
        return seen


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor
