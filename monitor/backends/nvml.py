"""NVML backend (nvidia-ml-py's ``pynvml``): bounded per GPU, a failed read is unknown.

- Set-up calls get the longer set-up deadline: ``nvmlInit`` (once per process: NVML counts
  inits, but one is all we need, and it keeps a wedged driver from being hit again by every
  new backend), the GPU count and the XID event set. Each GPU's handle is opened by its own
  first read, on its own worker, so one GPU that hangs there blinds only itself.
- Each GPU is read on its own worker (:mod:`ftmaster.monitor.backends.bounded`): a GPU stuck
  in the driver reads as unknown, then is left out as ``wedged`` (the monitor reports it
  lost), while the others are sampled as usual; every GPU stuck at once is a wedged driver,
  a BackendError. A GPU that is not selected gets no call.
- A call that fails gives ``None`` (unknown), never a healthy default. ``NOT_SUPPORTED`` (and
  ``FUNCTION_NOT_FOUND``) is remembered per GPU and field, so unsupported reads are not
  retried every sample.
- Readings with a newer and an older NVML call (temperature: ``nvmlDeviceGetTemperatureV``
  then ``nvmlDeviceGetTemperature``; throttle reasons: ``...ClocksEventReasons`` then
  ``...ClocksThrottleReasons``) try the newest the binding has first. One the driver lacks
  (``FUNCTION_NOT_FOUND``: the binding may be newer than the driver) is skipped on every GPU;
  one the GPU does not support (``NOT_SUPPORTED``) is skipped on that GPU; either way the
  older call is tried at once. The call that answered is remembered per GPU.
- Driver states the CSV cannot hold reach the monitor as ``conditions``:
  ``NVML_ERROR_GPU_IS_LOST`` on any call leaves the GPU out (``gpu_is_lost``);
  ``NVML_ERROR_RESET_REQUIRED`` keeps it in with unknown fields (``reset_required``); a failed
  row remap is ``row_remap_failure``.
- XIDs come from an event set polled with ``nvmlEventSetWait(set, 0)``, which never blocks,
  on a worker of its own. An event is placed by its device handle, else by
  ``nvmlDeviceGetIndex``, else by UUID; one that none of them places is logged, not dropped.
  Each GPU registers for XID events on its own worker (``nvmlDeviceRegisterEvents``), after
  its reads; every operation on the set holds one lock (NVML's header up to API 12: "operations
  on set are not thread safe"). A GPU whose registration failed reports no XIDs
  (:attr:`NvmlBackend.unreported_fields` names it), and it registers again every
  ``xid_retry_s`` (60 s) until it succeeds; ``NOT_SUPPORTED`` is for good ("None of the
  requested eventTypes are registered", the set stays usable). After ``NVML_ERROR_UNKNOWN``
  the set "is in undefined state and should be freed" (nvml.h): it is freed and a new one made
  at the next sample, every GPU registers again, and until then no GPU's XIDs are known.
- GPU ids are NVML indices (PCI bus order); ``ftmaster launch`` runs training with
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that ``CUDA_VISIBLE_DEVICES`` uses the same numbers.
  :func:`probe_gpus` gives the launcher each GPU's UUID and MIG mode, bounded;
  :func:`index_for_uuid` maps a UUID back to its index.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Sequence

from ftmaster.monitor.backends import BackendError
from ftmaster.monitor.backends.bounded import (CallTimeout, GpuGone, PerGpuBackend, PerGpuReads, ReadBounds,
                                               Reading, Worker, call_once_bounded)
from ftmaster.monitor.sample import FIELD_NAMES, GpuSample
from ftmaster.monitor.signals import worst_xid

log = logging.getLogger("ftmaster.monitor")

MIB = 1024 * 1024
# nvmlFieldValue_t.valueType -> the union member that holds the value
_FIELD_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
# A storm of XID events must not stall one sample; the rest are read next time.
MAX_EVENTS_PER_SAMPLE = 64
GPU_IS_LOST, RESET_REQUIRED, ROW_REMAP_FAILURE = "gpu_is_lost", "reset_required", "row_remap_failure"
# Newest first: the binding may have a function the installed driver lacks.
TEMPERATURE_FUNCTIONS = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature")
THROTTLE_FUNCTIONS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
# A GPU whose XID event registration failed tries again this often (seconds).
XID_RETRY_S = 60.0
# How long a GPU's registration waits for another's (or the XID drain) to let go of the event
# set before it leaves its turn to the next sample.
EVENT_SET_WAIT_S = 0.1


class NvmlUnavailable(BackendError):
    """NVML cannot be used here: no binding, no library, no driver, or a driver that does not answer."""


def _load(nvml: ModuleType | None) -> ModuleType:
    if nvml is not None:
        return nvml
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        raise NvmlUnavailable("the nvml backend needs nvidia-ml-py (pip install nvidia-ml-py)") from None


_INIT_LOCK = threading.Lock()
_INITIALISED: set[ModuleType] = set()


def _init_once(nvml: ModuleType, timeout_s: float) -> None:
    with _INIT_LOCK:
        if nvml in _INITIALISED:
            return
        try:
            call_once_bounded("nvml-init", timeout_s, nvml.nvmlInit)
        except CallTimeout:
            raise NvmlUnavailable(f"NVML could not start: nvmlInit did not return within {timeout_s:g} s "
                                  f"(the driver may be wedged)") from None
        except Exception as exc:
            raise NvmlUnavailable(f"NVML could not start: {exc}") from None
        _INITIALISED.add(nvml)


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> Any:
    """A device handle as a dict key: its address (pynvml handles are ctypes pointers, which
    compare by object, not by address); a fake binding's own value otherwise."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return handle


class NvmlBackend(PerGpuBackend):
    """Samples every (or the chosen) GPU through NVML."""

    name = "nvml"

    def __init__(self, gpu_ids: Sequence[int] | None = None, bounds: ReadBounds | None = None,
                 nvml: ModuleType | None = None) -> None:
        self._nvml = _load(nvml)
        self.bounds = bounds or ReadBounds()
        _init_once(self._nvml, self.bounds.setup_timeout_s)
        self._system = Worker("nvml-system")
        self._reads = PerGpuReads(self._wanted_gpus(gpu_ids), self.bounds, "nvml")
        self._handles: dict[int, Any] = {}
        self._gpu_by_handle: dict[Any, int] = {}
        self._gpu_by_uuid: dict[str, int] = {}
        self._uuid_by_gpu: dict[int, str] = {}
        self._xid_gpus: set[int] = set()  # GPUs registered for XID events on the current set
        self._xid_retry_at: dict[int, float] = {}  # GPU -> when its failed registration is retried
        self.xid_retry_s = XID_RETRY_S
        self._events_lock = threading.Lock()  # held by every operation on the event set
        self._events_broken = False  # a registration said NVML_ERROR_UNKNOWN: the set is undefined
        self._renew_at = 0.0  # when a broken set is next freed and made anew
        self._unsupported: set[tuple[int, str]] = set()  # (GPU, field or NVML function)
        self._missing_functions: set[str] = set()  # NVML functions the driver lacks
        self._chosen: dict[tuple[int, str], str] = {}  # (GPU, field) -> the call that answered
        self._names: dict[int, str] = {}
        self._driver = self._driver_version()
        self._drain = None  # an XID read that overran its deadline, until its codes are taken
        self._xids_unread = False  # this sample's XIDs could not be read (a stuck call)
        self._said_registration_stuck = False
        self._xids_unsampled: dict[int, list[int]] = {}
        """XID codes of GPUs that were not sampled when the set gave them (each once)."""
        self._events = self._open_event_set()

    # -- set-up ---------------------------------------------------------------------------
    def _setup_call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return self._system.call(self.bounds.setup_timeout_s, fn, *args)
        except Exception as exc:
            raise BackendError(f"NVML could not {what}: {exc}") from None

    def _wanted_gpus(self, gpu_ids: Sequence[int] | None) -> list[int]:
        count = self._setup_call("count GPUs", self._nvml.nvmlDeviceGetCount)
        wanted = list(range(count)) if gpu_ids is None else list(gpu_ids)
        missing = [g for g in wanted if not 0 <= g < count]
        if missing:
            raise BackendError(f"NVML sees {count} GPU(s); no GPU with index {missing}")
        return wanted

    def _driver_version(self) -> str | None:
        """The driver's version (a Table I column); None when it cannot be read now (read
        again with the XIDs: it was read only there, so never without an event set)."""
        try:
            return _text(self._system.call(self.bounds.setup_timeout_s,
                                           self._nvml.nvmlSystemGetDriverVersion))
        except Exception:
            return None

    def _open_event_set(self) -> Any:
        """An XID event set, or None: then no GPU reports XIDs (and the monitor says so).
        Only NOT_SUPPORTED is for good: any other failure (one that passes, a driver call
        past its bound) is made anew as a broken set is, every ``xid_retry_s``, its XIDs
        unknown meanwhile; it turned XIDs off for the whole job."""
        try:
            return self._system.call(self.bounds.setup_timeout_s, self._nvml.nvmlEventSetCreate)
        except Exception as exc:
            if getattr(exc, "value", None) == self._nvml.NVML_ERROR_NOT_SUPPORTED:
                log.warning("nvml: no XID event set (%s): XIDs are not monitored", exc)
                return None
            self._events_broken, self._renew_at = True, time.monotonic() + self.xid_retry_s
            log.warning("nvml: no XID event set (%s); XIDs are unknown, tried again in %g s",
                        exc, self.xid_retry_s)
            return None

    def _open(self, gpu: int, reading: Reading) -> Any:
        """The GPU's handle, opened on its own worker with its UUID (its XID registration
        follows its first reads)."""
        n = self._nvml
        handle = self._read(reading, gpu, "handle", n.nvmlDeviceGetHandleByIndex, gpu)
        if handle is None:
            return None
        self._gpu_by_handle[_handle_key(handle)] = gpu
        self._learn_uuid(gpu, handle, reading)
        self._handles[gpu] = handle
        return handle

    def _learn_uuid(self, gpu: int, handle: Any, reading: Reading) -> None:
        """The GPU's UUID, once it reads (the metrics' label, events placed by UUID)."""
        uuid = self._read(reading, gpu, "uuid", self._nvml.nvmlDeviceGetUUID, handle)
        if uuid is not None:
            text = _text(uuid)
            self._uuid_by_gpu[gpu] = text
            self._gpu_by_uuid[text] = gpu

    def _register_xids(self, gpu: int, handle: Any, reading: Reading) -> None:
        """Register the GPU for XID events when it is not and its turn has come: at its first
        read, then every ``xid_retry_s`` after a failure. On the GPU's own worker."""
        if self._events is None or self._events_broken or gpu in self._xid_gpus:
            return
        if (gpu, "xid_events") in self._unsupported or time.monotonic() < self._xid_retry_at.get(gpu, 0.0):
            return
        if not self._events_lock.acquire(timeout=EVENT_SET_WAIT_S):
            return  # another registration or the drain has the set: this GPU's turn is next sample
        n = self._nvml
        try:
            if self._events is None or self._events_broken:
                return
            registered, _, code = self._try(reading, n.nvmlDeviceRegisterEvents, handle,
                                            n.nvmlEventTypeXidCriticalError, self._events)
            if registered:
                self._xid_gpus.add(gpu)
            elif code == n.NVML_ERROR_UNKNOWN:
                # nvml.h: "If function reports NVML_ERROR_UNKNOWN, event set is in undefined
                # state and should be freed": no GPU's XIDs can be read from it any more.
                self._events_broken = True
                self._xid_gpus.clear()
        finally:
            self._events_lock.release()
        if registered:
            if self._xid_retry_at.pop(gpu, None) is not None:
                log.info("nvml: GPU %d reports XIDs again (event registration succeeded)", gpu)
        elif code in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_FUNCTION_NOT_FOUND):
            self._unsupported.add((gpu, "xid_events"))
            log.warning("nvml: GPU %d cannot report XIDs (event registration not supported)", gpu)
        else:
            first = gpu not in self._xid_retry_at
            self._xid_retry_at[gpu] = time.monotonic() + self.xid_retry_s
            if first:
                why = f"NVML error {code}" if code is not None else "not an NVML error"
                log.warning("nvml: GPU %d cannot report XIDs for now (event registration failed: %s); "
                            "its XIDs are unknown, and it tries again every %g s", gpu, why, self.xid_retry_s)
            if self._events_broken:
                log.warning("nvml: the XID event set is in an undefined state (NVML_ERROR_UNKNOWN); "
                            "no GPU's XIDs are known until it is made anew")

    def close(self) -> None:
        # NVML stays initialised: the init is per process and other backends may share it.
        # A registration stuck in the driver keeps the set (it is not freed under a call on it).
        if self._events is not None and self._events_lock.acquire(timeout=EVENT_SET_WAIT_S):
            try:
                self._system.call(self.bounds.read_timeout_s, self._nvml.nvmlEventSetFree, self._events)
            except Exception:
                pass
            finally:
                self._events = None
                self._events_lock.release()
        self._reads.close()
        self._system.stop()

    def uuids(self) -> dict[int, str]:
        """Each opened GPU's UUID (the metrics' ``UUID`` label)."""
        # A copy: a GPU worker still opening its GPU adds to it (the metrics ask from another thread)
        return dict(self._uuid_by_gpu)

    @property
    def reported_fields(self) -> frozenset[str]:
        """The sample fields this backend can fill at all: XIDs need an event set and a GPU
        that did not refuse to register for them (which GPUs have them now:
        :attr:`unreported_fields`)."""
        every = frozenset(FIELD_NAMES)
        return every if self._xids_possible() else every - {"xid"}

    @property
    def unreported_fields(self) -> dict[int, frozenset[str]]:
        """Per GPU, the :attr:`reported_fields` it cannot fill now: ``xid`` while it is not
        registered for XID events (its registration failed, is still to come, or waits for a
        new event set), since its empty ``xid`` would read as "no XID" where none can be seen."""
        if not self._xids_possible():
            return {}  # no GPU has them: reported_fields says so
        registered = set() if self._xids_unread else set(self._xid_gpus)
        return {gpu: frozenset({"xid"}) for gpu in sorted(self._reads.gpus) if gpu not in registered}

    def _xids_possible(self) -> bool:
        """An event set exists (or is being made anew) and some GPU has not said NOT_SUPPORTED
        to registering for XIDs on it."""
        if self._events is None and not self._events_broken:
            return False
        return any((gpu, "xid_events") not in self._unsupported for gpu in self._reads.gpus)

    # -- reads ----------------------------------------------------------------------------
    def _try(self, reading: Reading, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any, int | None]:
        """One call on the GPU's worker: (True, value, None), or (False, None, NVML error code,
        None when it raised something else).

        GpuGone when the GPU is lost; RESET_REQUIRED is noted on the reading."""
        n = self._nvml
        reading.calling = getattr(fn, "__name__", repr(fn))
        try:
            return True, fn(*args), None
        except n.NVMLError as exc:
            if exc.value == n.NVML_ERROR_GPU_IS_LOST:
                raise GpuGone(GPU_IS_LOST) from None
            if exc.value == n.NVML_ERROR_RESET_REQUIRED:
                reading.note(RESET_REQUIRED)
            return False, None, exc.value
        except Exception:
            return False, None, None

    def _unavailable(self, code: int | None) -> bool:
        """The call can never answer here: the GPU does not support it, or the driver lacks it."""
        return code in (self._nvml.NVML_ERROR_NOT_SUPPORTED, self._nvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def _read(self, reading: Reading, gpu: int, field: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None when it failed; one that cannot answer is not asked again."""
        if (gpu, field) in self._unsupported:
            return None
        ok, value, code = self._try(reading, fn, *args)
        if not ok and self._unavailable(code):
            self._unsupported.add((gpu, field))
        return value

    def _read_newest(self, reading: Reading, gpu: int, field: str, names: Sequence[str], *args: Any) -> Any:
        """The reading from the first of ``names`` (newest first) that the binding, the driver
        and this GPU have: one the driver lacks is skipped on every GPU, one the GPU does not
        support on that GPU, and the next is asked at once. The call that answered is the
        GPU's from then on; a call that fails otherwise is unknown this time, asked again next."""
        chosen = self._chosen.get((gpu, field))
        for name in (chosen,) if chosen is not None else names:
            fn = getattr(self._nvml, name, None)
            if fn is None or name in self._missing_functions or (gpu, name) in self._unsupported:
                continue
            ok, value, code = self._try(reading, fn, *args)
            if ok:
                self._chosen[(gpu, field)] = name
                return value
            if not self._unavailable(code):
                return None
            if code == self._nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                self._missing_functions.add(name)
            else:
                self._unsupported.add((gpu, name))
            if chosen is not None:  # it answered before: ask the others from the next sample
                del self._chosen[(gpu, field)]
        return None

    def sample(self) -> list[GpuSample]:
        now = time.time()
        samples = self._reads.read(self._read_gpu, now, set_up=self._handles)
        # After the reads: a GPU's first read registers it for events and names its handle.
        xids = self._read_xids()
        # The set holds every registered GPU's codes: one not sampled now (a spare, a GPU left
        # out for now) gets its own at its next sample, as evidence; they were thrown away
        for gpu, codes in self._xids_unsampled.items():
            xids[gpu] = codes + xids.get(gpu, [])
        sampled = {sample.gpu_id for sample in samples}
        self._xids_unsampled = {gpu: list(dict.fromkeys(codes)) for gpu, codes in xids.items()
                                if gpu not in sampled}
        for sample in samples:
            sample.driver_version = self._driver
            sample.xid = worst_xid(xids.get(sample.gpu_id, ()))
        return samples

    def _read_gpu(self, gpu: int, reading: Reading) -> None:
        n = self._nvml
        handle = self._handles.get(gpu)
        if handle is None:
            handle = self._open(gpu, reading)
            if handle is None:
                return  # unknown this time; opened again next sample
        elif gpu not in self._uuid_by_gpu:  # a read that failed at the open: again
            self._learn_uuid(gpu, handle, reading)
        s = reading.sample
        if gpu not in self._names:
            name = self._read(reading, gpu, "name", n.nvmlDeviceGetName, handle)
            if name is not None:
                self._names[gpu] = _text(name)
        s.gpu_name = self._names.get(gpu)
        s.temperature = self._read_newest(reading, gpu, "temperature", TEMPERATURE_FUNCTIONS, handle,
                                          n.NVML_TEMPERATURE_GPU)
        s.power_draw = _scaled(self._read(reading, gpu, "power", n.nvmlDeviceGetPowerUsage, handle), 1e-3)
        util = self._read(reading, gpu, "utilization", n.nvmlDeviceGetUtilizationRates, handle)
        if util is not None:
            s.gpu_utilization, s.memory_utilization = float(util.gpu), float(util.memory)
        memory = self._read(reading, gpu, "memory", n.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            s.memory_used, s.memory_total = memory.used / MIB, memory.total / MIB
        s.errors = self._read(reading, gpu, "ecc_aggregate", n.nvmlDeviceGetTotalEccErrors, handle,
                              n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_AGGREGATE_ECC)
        s.ecc_sbe = self._read(reading, gpu, "ecc_sbe", n.nvmlDeviceGetTotalEccErrors, handle,
                               n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC)
        s.ecc_dbe = self._read(reading, gpu, "ecc_dbe", n.nvmlDeviceGetTotalEccErrors, handle,
                               n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC)
        s.throttle_reasons = self._read_newest(reading, gpu, "throttle", THROTTLE_FUNCTIONS, handle)
        s.power_limit = _scaled(self._read(reading, gpu, "power_limit", n.nvmlDeviceGetEnforcedPowerLimit,
                                           handle), 1e-3)
        s.sm_clock = self._read(reading, gpu, "sm_clock", n.nvmlDeviceGetClockInfo, handle, n.NVML_CLOCK_SM)
        s.pcie_replay = self._read(reading, gpu, "pcie_replay", n.nvmlDeviceGetPcieReplayCounter, handle)
        s.retired_pages_pending = self._pending(reading, gpu, handle)
        s.recovery_action = self._recovery_action(reading, gpu, handle)
        self._register_xids(gpu, handle, reading)

    def _pending(self, reading: Reading, gpu: int, handle: Any) -> int | None:
        """1 when retired pages or remapped rows are pending (or a remap failed), else 0.

        Pre-Ampere GPUs retire pages, Ampere and later remap rows: whichever the GPU supports
        answers. None only when neither could be read. A failed remap is also noted as the
        condition ``row_remap_failure``: the GPU needs replacing.
        """
        n = self._nvml
        retired = self._read(reading, gpu, "retired_pending", n.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        remapped = self._read(reading, gpu, "remapped_rows", n.nvmlDeviceGetRemappedRows, handle)
        answers = []
        if retired is not None:
            answers.append(bool(retired))
        if remapped is not None:
            _corrected, _uncorrected, pending, failure = remapped
            if failure:
                reading.note(ROW_REMAP_FAILURE)
            answers.append(bool(pending) or bool(failure))
        return None if not answers else int(any(answers))

    def _recovery_action(self, reading: Reading, gpu: int, handle: Any) -> int | None:
        """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (driver >= 570); None where it is missing."""
        n = self._nvml
        field_id = getattr(n, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field_id is None:
            return None
        values = self._read(reading, gpu, "recovery_action", n.nvmlDeviceGetFieldValues, handle, [field_id])
        if not values or values[0].nvmlReturn != n.NVML_SUCCESS:
            return None
        member = _FIELD_MEMBERS.get(values[0].valueType)
        return None if member is None else int(getattr(values[0].value, member))

    # -- XIDs -----------------------------------------------------------------------------
    def _read_xids(self) -> dict[int, list[int]]:
        """XID codes per GPU since the last sample, read on the system worker within the read
        deadline; a read that overran hands its codes over once it returns."""
        seen: dict[int, list[int]] = {}
        if self._drain is not None and self._drain.done.is_set():
            # taken from the driver's queue: delivered even while the set cannot be remade
            seen, self._drain = self._drain.value or {}, None
        if self._events_broken:
            self._renew_event_set()
        if self._events is None or self._events_broken:
            return seen
        # Unread (a stuck call), every GPU's XIDs are unknown: an empty xid would read as none
        self._xids_unread = True
        if self._drain is not None:
            return seen  # still stuck: no XIDs until it returns
        drain = self._system.submit(self._drain_xids)
        if not drain.done.wait(self.bounds.read_timeout_s):
            log.warning("nvml: reading XID events is stuck; XIDs are unknown until it returns")
            self._drain = drain
            return seen
        if drain.value is None:
            return seen  # the set is held by a registration stuck in the driver
        self._xids_unread = False
        for gpu, codes in drain.value.items():
            seen.setdefault(gpu, []).extend(codes)
        return seen

    def _renew_event_set(self) -> None:
        """Free the broken event set and make a new one (every GPU then registers again at its
        next read); tried again every ``xid_retry_s`` while it fails."""
        if time.monotonic() < self._renew_at or not self._events_lock.acquire(timeout=EVENT_SET_WAIT_S):
            return
        try:
            old, self._events = self._events, None
            self._xid_gpus.clear()
            if old is not None:
                try:
                    self._system.call(self.bounds.read_timeout_s, self._nvml.nvmlEventSetFree, old)
                except Exception:
                    pass  # undefined already; a new set is what matters
            try:
                self._events = self._system.call(self.bounds.read_timeout_s, self._nvml.nvmlEventSetCreate)
            except Exception as exc:
                self._renew_at = time.monotonic() + self.xid_retry_s
                log.warning("nvml: no new XID event set (%s); XIDs are unknown, tried again in %g s",
                            exc, self.xid_retry_s)
                return
            self._events_broken = False  # the GPU whose registration broke it keeps its retry time
            log.info("nvml: a new XID event set is made; each GPU registers for XIDs at its next read")
        finally:
            self._events_lock.release()

    def _drain_xids(self) -> dict[int, list[int]] | None:
        """XID codes per GPU since the last sample, without waiting (timeout 0); on the system
        worker. None when the event set is held by a registration stuck in the driver."""
        n = self._nvml
        if self._driver is None:
            try:
                self._driver = _text(n.nvmlSystemGetDriverVersion())
            except Exception:
                pass
        seen: dict[int, list[int]] = {}
        # A registration stuck in the driver holds the set: its events stay queued in it
        # (this GPU is reported wedged meanwhile); they are read once it lets go, and every
        # GPU's XIDs are unknown until then (it may never let go before the GPU's reset).
        if not self._events_lock.acquire(timeout=self.bounds.read_timeout_s / 2):
            if not self._said_registration_stuck:
                self._said_registration_stuck = True
                log.warning("nvml: an XID registration is stuck in the driver; no GPU's XIDs "
                            "are known until it returns")
            return None
        self._said_registration_stuck = False
        try:
            for _ in range(MAX_EVENTS_PER_SAMPLE):
                if self._events is None or self._events_broken:
                    break
                try:
                    event = n.nvmlEventSetWait(self._events, 0)
                except Exception as exc:
                    if getattr(exc, "value", None) != n.NVML_ERROR_TIMEOUT:  # not "none pending"
                        self._wait_failed(exc)
                    break
                code = int(event.eventData)
                gpu = self._gpu_of(event.device)
                if gpu is None:
                    log.warning("nvml: XID %d on a GPU that NVML could not name", code)
                    continue
                seen.setdefault(gpu, []).append(code)
        finally:
            self._events_lock.release()
        return seen

    def _wait_failed(self, error: Exception) -> None:
        """The set's wait failed for a reason other than no event pending (a GPU lost on it
        fails every wait, GPU_IS_LOST): read as "no XID", it hid every GPU's XIDs for the
        rest of the job. No GPU's XIDs are known (:attr:`unreported_fields`) until the set
        is made anew, at the next sample. Under the events lock."""
        self._events_broken = True
        self._xid_gpus.clear()
        log.warning("nvml: reading XID events failed (%s); no GPU's XIDs are known until the "
                    "event set is made anew", error)

    def _gpu_of(self, device: Any) -> int | None:
        """The index of an event's device: by handle (no call), else index, else UUID."""
        gpu = self._gpu_by_handle.get(_handle_key(device))
        if gpu is not None:
            return gpu
        n = self._nvml
        try:
            return int(n.nvmlDeviceGetIndex(device))
        except Exception:
            pass
        try:
            return self._gpu_by_uuid.get(_text(n.nvmlDeviceGetUUID(device)))
        except Exception:
            return None


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


# -- the launcher's probe -----------------------------------------------------------------
@dataclass(frozen=True)
class GpuIdentity:
    """One GPU as NVML names it, for ``CUDA_VISIBLE_DEVICES`` by UUID."""

    index: int
    """NVML index: PCI bus order, the order CUDA uses with CUDA_DEVICE_ORDER=PCI_BUS_ID."""
    uuid: str | None
    """``GPU-...``; None when the GPU did not answer."""
    mig_enabled: bool | None
    """MIG mode is on (CUDA then sees MIG instances, not the GPU); False where MIG is not
    supported; None when unknown."""
    problem: str | None = None
    """Why the GPU cannot be used: ``wedged`` (no answer in time), ``gpu_is_lost``,
    ``reset_required``, or NVML's error text; None when it answered."""


def probe_gpus(timeout_s: float = 30.0, nvml: ModuleType | None = None) -> list[GpuIdentity]:
    """Every GPU NVML sees, with UUID and MIG mode, each GPU probed on its own thread.

    Bounded: the whole probe takes at most about ``timeout_s`` per step (start, count, GPUs),
    however the driver behaves; a GPU that does not answer in time has ``problem="wedged"``.
    Raises :class:`NvmlUnavailable` (one line) when NVML cannot be used at all.
    """
    n = _load(nvml)
    _init_once(n, timeout_s)
    try:
        count = call_once_bounded("nvml-probe", timeout_s, n.nvmlDeviceGetCount)
    except CallTimeout:
        raise NvmlUnavailable(f"NVML could not count GPUs within {timeout_s:g} s "
                              f"(the driver may be wedged)") from None
    except Exception as exc:
        raise NvmlUnavailable(f"NVML could not count GPUs: {exc}") from None
    workers = [Worker(f"nvml-probe-gpu{gpu}") for gpu in range(count)]
    jobs = [worker.submit(_identify, n, gpu) for gpu, worker in enumerate(workers)]
    began = time.monotonic()
    identities = []
    for gpu, (worker, job) in enumerate(zip(workers, jobs)):
        job.done.wait(max(0.0, began + timeout_s - time.monotonic()))
        worker.stop()
        identities.append(_identity(n, gpu, job))
    return identities


def _identify(n: ModuleType, gpu: int) -> GpuIdentity:
    handle = n.nvmlDeviceGetHandleByIndex(gpu)
    uuid = _text(n.nvmlDeviceGetUUID(handle))  # cached device info: read where nothing else is
    try:
        mig = n.nvmlDeviceGetMigMode(handle)[0] == n.NVML_DEVICE_MIG_ENABLE
    except n.NVMLError as exc:
        unusable = _unusable(n, exc)
        if unusable is not None:  # planned on, the first attempt failed on it
            return GpuIdentity(gpu, uuid, None, unusable)
        mig = False if exc.value == n.NVML_ERROR_NOT_SUPPORTED else None
    return GpuIdentity(gpu, uuid, mig)


def _unusable(n: ModuleType, exc: Exception) -> str | None:
    """The problem an NVML error names that leaves the GPU out of a job, or None."""
    return {n.NVML_ERROR_GPU_IS_LOST: GPU_IS_LOST,
            n.NVML_ERROR_RESET_REQUIRED: RESET_REQUIRED}.get(getattr(exc, "value", None))


def _identity(n: ModuleType, gpu: int, job: Any) -> GpuIdentity:
    if not job.done.is_set():
        return GpuIdentity(gpu, None, None, "wedged")
    if job.error is None:
        return job.value
    problem = str(job.error)
    if isinstance(job.error, n.NVMLError):
        problem = _unusable(n, job.error) or problem
    return GpuIdentity(gpu, None, None, problem)


def index_for_uuid(entry: str, identities: Sequence[GpuIdentity]) -> int:
    """The NVML index of the GPU a ``CUDA_VISIBLE_DEVICES`` entry names: a full ``GPU-`` UUID
    or, as CUDA accepts, a unique prefix of one. ValueError (one line) otherwise."""
    text = entry.strip()
    if text.upper().startswith("MIG-"):
        raise ValueError(f"{text} is a MIG instance: ftmaster needs whole GPUs (turn MIG mode off)")
    if not text.upper().startswith("GPU-"):
        raise ValueError(f"{text!r} is not a GPU UUID (GPU-...)")
    matches = [g for g in identities if g.uuid is not None and g.uuid.lower().startswith(text.lower())]
    if not matches:
        raise ValueError(f"no GPU has UUID {text}")
    if len(matches) > 1:
        raise ValueError(f"{text} matches {len(matches)} GPUs "
                         f"({', '.join(str(g.index) for g in matches)}); give more of the UUID")
    return matches[0].index
