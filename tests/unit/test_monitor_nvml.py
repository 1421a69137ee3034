"""The NVML backend against a fake ``pynvml``, function by function."""

import threading
import time
import types
from types import SimpleNamespace

import pytest

from ftmaster.monitor.backends import BackendError
from ftmaster.monitor.backends.nvml import NvmlBackend

LOST, NOT_SUPPORTED, UNKNOWN, TIMEOUT = 15, 3, 999, 10


class FakeError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_nvml(count=2, **overrides):
    """A pynvml stand-in with two healthy GPUs; ``overrides`` replace single functions."""
    calls = {}
    events = [SimpleNamespace(device=1, eventData=79)]
    release = threading.Event()

    def counted(name, fn):
        def wrapper(*args):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args)
        wrapper.__name__ = name
        return wrapper

    def event_wait(_set, timeout_ms):
        assert timeout_ms == 0, "XID polling must never block"
        if events:
            return events.pop()
        raise FakeError(TIMEOUT)

    field = SimpleNamespace(nvmlReturn=0, valueType=1, value=SimpleNamespace(uiVal=0))
    functions = {
        "nvmlInit": lambda: None,
        "nvmlDeviceGetCount": lambda: count,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetIndex": lambda h: h,
        "nvmlSystemGetDriverVersion": lambda: "570.1",
        "nvmlDeviceGetName": lambda h: "FakeGPU",
        "nvmlDeviceGetTemperature": lambda h, sensor: 60 + h,
        "nvmlDeviceGetPowerUsage": lambda h: 300_000,
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=97, memory=40),
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(used=1024 ** 3, total=80 * 1024 ** 3),
        "nvmlDeviceGetTotalEccErrors": lambda h, kind, counter: {(0, 0): 5, (1, 0): 0, (1, 1): 2}[(kind, counter)],
        "nvmlDeviceGetCurrentClocksEventReasons": lambda h: 0x4,
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: 700_000,
        "nvmlDeviceGetClockInfo": lambda h, clock: 1980,
        "nvmlDeviceGetPcieReplayCounter": lambda h: 3,
        "nvmlDeviceGetRetiredPagesPendingStatus": lambda h: (_ for _ in ()).throw(FakeError(NOT_SUPPORTED)),
        "nvmlDeviceGetRemappedRows": lambda h: (0, 0, 1 if h == 1 else 0, 0),
        "nvmlDeviceGetFieldValues": lambda h, ids: [field],
        "nvmlEventSetCreate": lambda: "set",
        "nvmlDeviceRegisterEvents": lambda h, types_, s: None,
        "nvmlEventSetWait": event_wait,
        "nvmlEventSetFree": lambda s: None,
    }
    functions.update(overrides)
    module = types.ModuleType("fake_pynvml")
    for name, fn in functions.items():
        setattr(module, name, counted(name, fn))
    module.__dict__.update(
        NVMLError=FakeError, NVML_ERROR_GPU_IS_LOST=LOST, NVML_ERROR_NOT_SUPPORTED=NOT_SUPPORTED,
        NVML_SUCCESS=0, NVML_TEMPERATURE_GPU=0, NVML_MEMORY_ERROR_TYPE_CORRECTED=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0, NVML_AGGREGATE_ECC=1,
        NVML_CLOCK_SM=1, nvmlEventTypeXidCriticalError=8, NVML_FI_DEV_GET_GPU_RECOVERY_ACTION=230,
        calls=calls, release=release)
    return module


def by_gpu(samples):
    return {s.gpu_id: s for s in samples}


def test_reads_every_field_with_units_converted():
    samples = by_gpu(NvmlBackend(nvml=fake_nvml()).sample())
    s = samples[0]
    assert (s.gpu_name, s.driver_version, s.temperature, s.power_draw) == ("FakeGPU", "570.1", 60, 300.0)
    assert (s.gpu_utilization, s.memory_utilization, s.memory_used, s.memory_total) == (97, 40, 1024, 81920)
    assert (s.errors, s.ecc_sbe, s.ecc_dbe) == (2, 5, 0)
    assert (s.throttle_reasons, s.power_limit, s.sm_clock, s.pcie_replay) == (0x4, 700.0, 1980, 3)
    assert (s.retired_pages_pending, s.recovery_action, s.xid) == (0, 0, None)
    assert samples[1].retired_pages_pending == 1  # remapped rows pending
    assert samples[1].xid == 79  # drained from the event set


def test_one_init_per_process():
    nvml = fake_nvml()
    NvmlBackend(nvml=nvml)
    NvmlBackend(nvml=nvml)
    assert nvml.calls["nvmlInit"] == 1


def test_failing_init_is_a_backend_error():
    def broken():
        raise FakeError(UNKNOWN)
    with pytest.raises(BackendError, match="NVML could not start"):
        NvmlBackend(nvml=fake_nvml(nvmlInit=broken))


def test_a_raising_call_is_unknown_not_healthy():
    def broken(*_):
        raise FakeError(UNKNOWN)
    samples = NvmlBackend(nvml=fake_nvml(nvmlDeviceGetTemperature=broken,
                                         nvmlDeviceGetTotalEccErrors=broken)).sample()
    assert all(s.temperature is None and s.ecc_dbe is None and s.errors is None for s in samples)
    assert all(s.power_draw == 300.0 for s in samples)


def test_unsupported_is_unknown_and_not_asked_again():
    def unsupported(*_):
        raise FakeError(NOT_SUPPORTED)
    nvml = fake_nvml(nvmlDeviceGetPcieReplayCounter=unsupported, nvmlDeviceGetRemappedRows=unsupported)
    backend = NvmlBackend(nvml=nvml)
    first = backend.sample()
    backend.sample()
    assert all(s.pcie_replay is None and s.retired_pages_pending is None for s in first)
    assert nvml.calls["nvmlDeviceGetPcieReplayCounter"] == 2  # once per GPU, then remembered


def test_failed_field_value_is_unknown():
    bad = SimpleNamespace(nvmlReturn=UNKNOWN, valueType=1, value=SimpleNamespace(uiVal=0))
    samples = NvmlBackend(nvml=fake_nvml(nvmlDeviceGetFieldValues=lambda h, ids: [bad])).sample()
    assert all(s.recovery_action is None for s in samples)


def test_recovery_action_is_read_from_field_values():
    field = SimpleNamespace(nvmlReturn=0, valueType=3, value=SimpleNamespace(ullVal=2))
    samples = NvmlBackend(nvml=fake_nvml(nvmlDeviceGetFieldValues=lambda h, ids: [field])).sample()
    assert [s.recovery_action for s in samples] == [2, 2]


def test_lost_gpu_is_left_out():
    def temperature(h, sensor):
        if h == 1:
            raise FakeError(LOST)
        return 50
    samples = NvmlBackend(nvml=fake_nvml(nvmlDeviceGetTemperature=temperature)).sample()
    assert [s.gpu_id for s in samples] == [0]


def test_a_hanging_call_is_bounded_and_unknown():
    nvml = fake_nvml()

    def hangs(h):
        nvml.release.wait(30)  # stuck in the "driver" until the test lets it go
        return 123_000
    nvml.nvmlDeviceGetPowerUsage = hangs
    backend = NvmlBackend(nvml=nvml, call_timeout_s=0.2)
    try:
        first = backend.sample()
    finally:
        nvml.release.set()
    assert [s.power_draw for s in first] == [None, None]
    assert first[0].temperature == 60  # reads before the hang went through
    # While the call stayed stuck, later reads answered "unknown" at once instead of queueing.
    assert first[1].temperature is None


def test_a_call_still_stuck_at_the_next_sample_is_a_backend_error():
    release = threading.Event()

    def hangs(h, sensor):
        release.wait(30)
        return 60
    nvml = fake_nvml(nvmlDeviceGetTemperature=hangs)
    backend = NvmlBackend(nvml=nvml, call_timeout_s=0.2)
    try:
        backend.sample()
        with pytest.raises(BackendError, match="nvmlDeviceGetTemperature has not returned for .* wedged"):
            backend.sample()
    finally:
        release.set()
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: 60
    assert wait_until_sampled(backend)[0].temperature == 60  # the driver came back


def wait_until_sampled(backend, attempts=50):
    """The first sample once the stuck call has returned (its worker needs a moment)."""
    for _ in range(attempts):
        try:
            return backend.sample()
        except BackendError:
            time.sleep(0.05)
    raise AssertionError("the backend never recovered")


def test_xids_are_reported_only_with_an_event_set():
    assert "xid" in NvmlBackend(nvml=fake_nvml()).reported_fields

    def no_event_set():
        raise FakeError(NOT_SUPPORTED)
    assert "xid" not in NvmlBackend(nvml=fake_nvml(nvmlEventSetCreate=no_event_set)).reported_fields


def test_bad_gpu_ids_are_refused():
    with pytest.raises(BackendError, match="no GPU with index"):
        NvmlBackend(gpu_ids=[5], nvml=fake_nvml())
