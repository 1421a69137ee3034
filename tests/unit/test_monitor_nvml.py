"""The NVML backend against a fake ``pynvml``, function by function.

The same backend behind the real pynvml and a fake ``libnvidia-ml`` is in
``test_monitor_nvml_lib.py``.
"""

import threading
import time
import types
from types import SimpleNamespace

import pytest

from ftmaster.faults import parse_injection
from ftmaster.monitor.backends import BackendError
from ftmaster.monitor.backends.bounded import ReadBounds
from ftmaster.monitor.backends.nvml import (GpuIdentity, NvmlBackend, NvmlUnavailable, index_for_uuid,
                                            probe_gpus)

NOT_SUPPORTED, TIMEOUT, FUNCTION_NOT_FOUND, LOST, RESET_REQUIRED, UNKNOWN = 3, 10, 13, 15, 16, 999
NO_PERMISSION = 4
QUICK = ReadBounds(read_timeout_s=0.2, setup_timeout_s=0.4, wedged_after=3)  # generous for busy CI
RETRY_S = 1.0  # a failed XID registration's cadence in tests: well past one busy sample


class FakeError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


def raises(code):
    def fn(*_):
        raise FakeError(code)
    return fn


def fake_nvml(count=2, **overrides):
    """A pynvml stand-in with two healthy GPUs; ``overrides`` replace single functions."""
    calls = {}
    events = [SimpleNamespace(device=1, eventData=79)]

    def counted(name, fn):
        def wrapper(*args):
            calls[name] = calls.get(name, 0) + 1
            calls[(name, args[0] if args else None)] = calls.get((name, args[0] if args else None), 0) + 1
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
        "nvmlDeviceGetUUID": lambda h: f"GPU-{h:08d}-aaaa",
        "nvmlDeviceGetMigMode": lambda h: [0, 0],
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
        "nvmlDeviceGetRetiredPagesPendingStatus": raises(NOT_SUPPORTED),
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
        if fn is not None:
            setattr(module, name, counted(name, fn))
    module.__dict__.update(
        NVMLError=FakeError, NVML_ERROR_GPU_IS_LOST=LOST, NVML_ERROR_NOT_SUPPORTED=NOT_SUPPORTED,
        NVML_ERROR_RESET_REQUIRED=RESET_REQUIRED, NVML_ERROR_FUNCTION_NOT_FOUND=FUNCTION_NOT_FOUND,
        NVML_ERROR_UNKNOWN=UNKNOWN, NVML_ERROR_TIMEOUT=TIMEOUT,
        NVML_SUCCESS=0, NVML_TEMPERATURE_GPU=0, NVML_MEMORY_ERROR_TYPE_CORRECTED=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0, NVML_AGGREGATE_ECC=1,
        NVML_CLOCK_SM=1, nvmlEventTypeXidCriticalError=8, NVML_FI_DEV_GET_GPU_RECOVERY_ACTION=230,
        NVML_DEVICE_MIG_ENABLE=1, calls=calls, events=events)
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


def sampled(backend):
    backend.sample()
    return backend


def test_xids_are_reported_only_when_some_gpu_registered_for_them():
    assert "xid" in sampled(NvmlBackend(nvml=fake_nvml())).reported_fields
    assert "xid" not in sampled(NvmlBackend(nvml=fake_nvml(nvmlEventSetCreate=raises(NOT_SUPPORTED)))).reported_fields
    # Review point 10: an event set on which every registration failed covers nothing.
    unregistered = NvmlBackend(nvml=fake_nvml(nvmlDeviceRegisterEvents=raises(NOT_SUPPORTED)))
    assert "xid" not in sampled(unregistered).reported_fields
    one_registered = NvmlBackend(nvml=fake_nvml(nvmlDeviceRegisterEvents=failing_registration(NO_PERMISSION)))
    assert "xid" in sampled(one_registered).reported_fields
    assert one_registered.unreported_fields == {1: {"xid"}}  # but not on the GPU that failed
    # Failed for now on every GPU (tried again later): each GPU's XIDs are named unknown.
    none_yet = sampled(NvmlBackend(nvml=fake_nvml(nvmlDeviceRegisterEvents=raises(NO_PERMISSION))))
    assert none_yet.unreported_fields == {0: {"xid"}, 1: {"xid"}}


def test_the_driver_version_is_read_without_an_xid_event_set():
    """It was read only with the XIDs: in a container without events, every row lacked it."""
    backend = NvmlBackend(nvml=fake_nvml(nvmlEventSetCreate=raises(NOT_SUPPORTED)))
    try:
        assert {s.driver_version for s in backend.sample()} == {"570.1"}
    finally:
        backend.close()


def test_an_xid_whose_index_lookup_fails_is_kept():
    nvml = fake_nvml(nvmlDeviceGetIndex=raises(UNKNOWN))
    assert by_gpu(NvmlBackend(nvml=nvml).sample())[1].xid == 79  # placed by its handle
    assert "nvmlDeviceGetIndex" not in nvml.calls


def test_an_xid_from_an_unknown_handle_is_placed_by_uuid():
    nvml = fake_nvml(nvmlDeviceGetIndex=raises(UNKNOWN),
                     nvmlDeviceGetUUID=lambda h: "GPU-00000001-aaaa" if h in (1, "other") else f"GPU-{h:08d}-aaaa")
    nvml.events[:] = [SimpleNamespace(device="other", eventData=48)]
    assert by_gpu(NvmlBackend(nvml=nvml).sample())[1].xid == 48


def test_an_xid_of_a_gpu_not_sampled_now_comes_with_its_next_sample():
    """The event set gives every registered GPU's codes: one left out of the samples for now
    (a spare after a replan) had its XID 48 thrown away, and was planned on again."""
    nvml = fake_nvml()
    nvml.events[:] = []
    backend = NvmlBackend(nvml=nvml)
    backend.sample()
    backend.select_gpus([0], ())
    nvml.events[:] = [SimpleNamespace(device=1, eventData=48)]
    assert [s.gpu_id for s in backend.sample()] == [0]
    backend.select_gpus(None, ())
    assert by_gpu(backend.sample())[1].xid == 48


def test_bad_gpu_ids_are_refused():
    with pytest.raises(BackendError, match="no GPU with index"):
        NvmlBackend(gpu_ids=[5], nvml=fake_nvml())


def test_temperature_uses_the_current_call_and_falls_back_when_the_driver_lacks_it():
    current = NvmlBackend(nvml=fake_nvml(nvmlDeviceGetTemperatureV=lambda h, sensor: 70))
    assert {s.temperature for s in current.sample()} == {70}
    nvml = fake_nvml(nvmlDeviceGetTemperatureV=raises(FUNCTION_NOT_FOUND))  # binding newer than driver
    old = NvmlBackend(nvml=nvml)
    old.sample()
    assert [s.temperature for s in old.sample()] == [60, 61]
    assert nvml.calls["nvmlDeviceGetTemperatureV"] == 1  # remembered, not asked every read


def test_throttle_reasons_fall_back_when_the_driver_lacks_the_new_call():
    nvml = fake_nvml(nvmlDeviceGetCurrentClocksEventReasons=raises(FUNCTION_NOT_FOUND),
                     nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x8)
    assert [s.throttle_reasons for s in NvmlBackend(nvml=nvml).sample()] == [0x8, 0x8]
    binding_without_it = fake_nvml(nvmlDeviceGetCurrentClocksEventReasons=None,
                                   nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x20)
    assert [s.throttle_reasons for s in NvmlBackend(nvml=binding_without_it).sample()] == [0x20, 0x20]


def test_recovery_action_of_value_type_unsigned_short():
    field = SimpleNamespace(nvmlReturn=0, valueType=6, value=SimpleNamespace(usVal=4))
    samples = NvmlBackend(nvml=fake_nvml(nvmlDeviceGetFieldValues=lambda h, ids: [field])).sample()
    assert [s.recovery_action for s in samples] == [4, 4]


def test_reset_required_is_evidence_not_just_unknown():
    backend = NvmlBackend(nvml=fake_nvml(nvmlDeviceGetPowerUsage=lambda h: (_ for _ in ()).throw(
        FakeError(RESET_REQUIRED)) if h == 1 else 300_000))
    samples = by_gpu(backend.sample())
    assert samples[1].power_draw is None and samples[1].temperature == 61  # kept, that read unknown
    assert backend.conditions == {1: ("reset_required",)}


def test_lost_gpu_is_left_out_with_its_condition():
    backend = NvmlBackend(nvml=fake_nvml(nvmlDeviceGetPowerUsage=lambda h: (_ for _ in ()).throw(
        FakeError(LOST)) if h == 0 else 300_000))
    assert [s.gpu_id for s in backend.sample()] == [1]
    assert backend.conditions == {0: ("gpu_is_lost",)}


def test_a_failed_row_remap_is_a_condition():
    backend = NvmlBackend(nvml=fake_nvml(nvmlDeviceGetRemappedRows=lambda h: (0, 1, 0, h)))
    samples = by_gpu(backend.sample())
    assert (samples[0].retired_pages_pending, samples[1].retired_pages_pending) == (0, 1)
    assert backend.conditions == {1: ("row_remap_failure",)}


def stuck_on(gpu, release, value):
    """A read that blocks on ``gpu`` (as a wedged driver) until ``release`` is set."""
    def read(h, *_):
        if h == gpu:
            release.wait(60)
        return value
    return read


def test_a_call_stuck_on_one_gpu_blinds_only_that_gpu():
    release = threading.Event()
    nvml = fake_nvml(count=3, nvmlDeviceGetPowerUsage=stuck_on(1, release, 300_000))
    backend = NvmlBackend(nvml=nvml, bounds=QUICK)
    try:
        first = by_gpu(backend.sample())
        assert [first[g].power_draw for g in (0, 1, 2)] == [300.0, None, 300.0]
        assert first[1].temperature == 61  # read before the stuck call: kept
        assert first[1].pcie_replay is None  # after it: unknown
        second = by_gpu(backend.sample())
        assert second[1].temperature is None  # no new call queued behind the stuck one
        assert second[0].temperature == 60 and second[2].temperature == 62
    finally:
        release.set()


def test_a_wedged_gpu_is_left_out_as_wedged_while_the_others_are_sampled():
    release = threading.Event()
    nvml = fake_nvml(count=3, nvmlDeviceGetPowerUsage=stuck_on(2, release, 300_000))
    backend = NvmlBackend(nvml=nvml, bounds=QUICK)
    try:
        history = wedge_history(backend)
    finally:
        release.set()
    assert all(ids[:2] == [0, 1] for ids, _ in history)  # the others, every sample
    assert len(history) >= QUICK.wedged_after  # unknown for a few deadlines first
    assert all(ids == [0, 1, 2] for ids, _ in history[:-1])
    assert history[-1] == ([0, 1], {2: ("wedged",)})
    nvml.nvmlDeviceGetPowerUsage = lambda h: 300_000
    assert wait_for_gpu(backend, 2).power_draw == 300.0  # the driver came back


def wedge_history(backend, most=500):
    """(GPU ids, conditions) of each sample until one reports a GPU wedged."""
    history = []
    for _ in range(most):
        ids = [s.gpu_id for s in backend.sample()]
        history.append((ids, dict(backend.conditions)))
        if any("wedged" in c for c in backend.conditions.values()):
            return history
        time.sleep(0.01)
    raise AssertionError("no GPU was reported wedged")


def wait_for_gpu(backend, gpu, most=500):
    for _ in range(most):
        try:
            samples = by_gpu(backend.sample())
        except BackendError:  # the stuck calls have not returned yet
            samples = {}
        if gpu in samples and samples[gpu].temperature is not None:
            return samples[gpu]
        time.sleep(0.01)
    raise AssertionError(f"GPU {gpu} never answered again")


def test_an_injected_wedge_takes_the_same_path_until_recover():
    backend = NvmlBackend(nvml=fake_nvml(count=2), bounds=QUICK)
    backend.inject(parse_injection("wedge:gpu=0,at=0s"))
    history = wedge_history(backend)
    assert history[-1] == ([1], {0: ("wedged",)})
    backend.inject(parse_injection("recover:gpu=0,at=0s"))
    assert wait_for_gpu(backend, 0).temperature == 60


def test_unselected_gpus_get_no_call():
    nvml = fake_nvml(count=3)
    nvml.events.clear()  # GPU 1 never registers for events, so none can come from it
    backend = NvmlBackend(nvml=nvml)
    backend.select_gpus(None, excluded={1})
    backend.sample()
    backend.select_gpus({0, 1}, excluded={1})
    assert [s.gpu_id for s in backend.sample()] == [0]
    assert ("nvmlDeviceGetHandleByIndex", 1) not in nvml.calls
    assert not any(key[1] == 1 for key in nvml.calls if isinstance(key, tuple))
    assert nvml.calls[("nvmlDeviceGetHandleByIndex", 2)] == 1


def test_a_hanging_init_fails_within_the_set_up_bound():
    release = threading.Event()
    try:
        with pytest.raises(NvmlUnavailable, match="nvmlInit did not return within 0.2 s"):
            NvmlBackend(nvml=fake_nvml(nvmlInit=lambda: release.wait(60)),
                        bounds=ReadBounds(setup_timeout_s=0.2))
    finally:
        release.set()


def test_a_hanging_gpu_count_fails_within_the_set_up_bound():
    release = threading.Event()
    try:
        with pytest.raises(BackendError, match="could not count GPUs: nvmlDeviceGetCount did not return"):
            NvmlBackend(nvml=fake_nvml(nvmlDeviceGetCount=lambda: release.wait(60)),
                        bounds=ReadBounds(setup_timeout_s=0.2))
    finally:
        release.set()


def test_opening_a_handle_gets_the_set_up_bound_not_the_read_deadline():
    def slow_open(i):
        time.sleep(0.3)  # a GPU initialising without persistence mode
        return i
    backend = NvmlBackend(nvml=fake_nvml(nvmlDeviceGetHandleByIndex=slow_open),
                          bounds=ReadBounds(read_timeout_s=0.05, setup_timeout_s=5.0))
    assert [s.temperature for s in backend.sample()] == [60, 61]


def test_an_opening_that_hangs_blinds_only_its_gpu():
    release = threading.Event()

    def open_handle(i):
        if i == 0:
            release.wait(60)
        return i
    backend = NvmlBackend(nvml=fake_nvml(count=2, nvmlDeviceGetHandleByIndex=open_handle),
                          bounds=ReadBounds(read_timeout_s=0.1, setup_timeout_s=0.3))
    try:
        history = wedge_history(backend)
    finally:
        release.set()
    assert history[-1] == ([1], {0: ("wedged",)})


# -- the launcher's probe --------------------------------------------------------------------
def test_probe_gives_uuids_and_mig_mode():
    nvml = fake_nvml(count=3, nvmlDeviceGetMigMode=lambda h: [1, 1] if h == 2 else [0, 0])
    assert probe_gpus(nvml=nvml) == [GpuIdentity(0, "GPU-00000000-aaaa", False),
                                      GpuIdentity(1, "GPU-00000001-aaaa", False),
                                      GpuIdentity(2, "GPU-00000002-aaaa", True)]


def test_probe_marks_gpus_that_cannot_be_used():
    release = threading.Event()

    def uuid(h):
        if h == 0:
            release.wait(60)
        if h == 1:
            raise FakeError(LOST)
        if h == 2:
            raise FakeError(RESET_REQUIRED)
        return "GPU-3"
    try:
        probed = probe_gpus(timeout_s=0.2, nvml=fake_nvml(count=5, nvmlDeviceGetUUID=uuid,
                                                          nvmlDeviceGetMigMode=raises(NOT_SUPPORTED)))
    finally:
        release.set()
    assert [(g.index, g.problem) for g in probed] == \
        [(0, "wedged"), (1, "gpu_is_lost"), (2, "reset_required"), (3, None), (4, None)]
    assert (probed[3].uuid, probed[3].mig_enabled) == ("GPU-3", False)  # MIG not supported: off


@pytest.mark.parametrize("code, problem", [(RESET_REQUIRED, "reset_required"), (LOST, "gpu_is_lost")])
def test_probe_marks_a_gpu_whose_first_read_past_its_cached_uuid_fails(code, problem):
    """The UUID comes from cached device info; the MIG mode read is the first to reach the
    GPU. Its RESET_REQUIRED read as 'MIG unknown', and the first attempt was planned on it."""
    probed = probe_gpus(nvml=fake_nvml(count=2, nvmlDeviceGetMigMode=lambda h: (
        (_ for _ in ()).throw(FakeError(code)) if h == 1 else [0, 0])))
    assert [(g.index, g.uuid, g.problem) for g in probed] == [
        (0, "GPU-00000000-aaaa", None), (1, "GPU-00000001-aaaa", problem)]


def test_probe_without_nvml_is_one_clear_error():
    with pytest.raises(NvmlUnavailable, match="NVML could not start: NVML error 999"):
        probe_gpus(nvml=fake_nvml(nvmlInit=raises(UNKNOWN)))


IDENTITIES = [GpuIdentity(0, "GPU-8932f937-aaaa", False), GpuIdentity(1, "GPU-8932f999-bbbb", False),
              GpuIdentity(2, None, None, "wedged")]


@pytest.mark.parametrize("entry, index", [
    ("GPU-8932f937-aaaa", 0), (" gpu-8932F999-BBBB ", 1), ("GPU-8932f93", 0),
])
def test_index_for_uuid(entry, index):
    assert index_for_uuid(entry, IDENTITIES) == index


@pytest.mark.parametrize("entry, words", [
    ("GPU-8932f9", "matches 2 GPUs"), ("GPU-0000", "no GPU has UUID"), ("3", "not a GPU UUID"),
    ("MIG-4a1b2c", "MIG instance"),
])
def test_index_for_uuid_refuses_with_one_line(entry, words):
    with pytest.raises(ValueError, match=words):
        index_for_uuid(entry, IDENTITIES)


def test_a_stuck_xid_read_delays_only_the_xids_and_loses_none():
    release, waits = threading.Event(), []

    def event_wait(_set, timeout_ms):
        waits.append(timeout_ms)
        if len(waits) == 1:
            release.wait(60)  # the driver sits on the first event
            return SimpleNamespace(device=1, eventData=95)
        raise FakeError(TIMEOUT)
    backend = NvmlBackend(nvml=fake_nvml(nvmlEventSetWait=event_wait), bounds=QUICK)
    try:
        first = by_gpu(backend.sample())
    finally:
        release.set()
    assert first[1].xid is None and first[1].temperature == 61  # sampled all the same
    seen = []
    for _ in range(100):
        seen += [s.xid for s in backend.sample() if s.xid is not None]
        time.sleep(0.01)
    assert seen == [95]  # handed over once it returned, once


def test_an_xid_a_late_drain_read_is_delivered_while_the_event_set_cannot_be_remade():
    """The drain that overran returned an XID, then the set broke and could not be made
    again: the code, already out of the driver's queue, waited unseen until a set could be."""
    release, state = threading.Event(), {"waits": 0, "creates": 0}

    def event_wait(_set, timeout_ms):
        state["waits"] += 1
        if state["waits"] == 1:
            raise FakeError(TIMEOUT)  # the first sample: nothing pending
        if state["waits"] == 2:
            release.wait(60)  # the driver sits on it past the read deadline
            return SimpleNamespace(device=0, eventData=79)
        raise FakeError(UNKNOWN)  # then the set breaks

    def event_set_create():
        state["creates"] += 1
        if state["creates"] > 1:
            raise FakeError(UNKNOWN)
        return "set"

    backend = NvmlBackend(nvml=fake_nvml(nvmlEventSetWait=event_wait,
                                         nvmlEventSetCreate=event_set_create), bounds=QUICK)
    backend.xid_retry_s = 0.0
    try:
        backend.sample()
        backend.sample()  # the drain overruns its deadline
    finally:
        release.set()
    seen = []
    for _ in range(50):
        seen += [s.xid for s in backend.sample() if s.xid is not None]
        time.sleep(0.01)
    assert seen == [79]


def test_every_gpu_stuck_is_a_wedged_driver_not_every_gpu_lost():
    release = threading.Event()

    def power(h):
        release.wait(60)
        return 300_000
    backend = NvmlBackend(nvml=fake_nvml(count=2, nvmlDeviceGetPowerUsage=power), bounds=QUICK)
    try:
        for _ in range(500):
            try:
                backend.sample()
            except BackendError as error:
                assert "all 2 GPUs have been stuck in the driver" in str(error)
                break
            assert backend.conditions == {}  # never one GPU named wedged on the way
            time.sleep(0.01)
        else:
            raise AssertionError("a wedged driver was never reported")
    finally:
        release.set()
    backend._nvml.nvmlDeviceGetPowerUsage = lambda h: 300_000
    assert wait_for_gpu(backend, 1).power_draw == 300.0


def test_a_read_that_returns_during_a_later_sample_is_not_dated_back():
    """A stuck read that returned while the sampler waited for the other GPUs gave its
    sample dated when it began, samples ago: a row (and any alert) out of time order."""
    release, opened = threading.Event(), []

    def temperature(h, sensor):
        if h == 0:
            opened.append(h)
            if len(opened) == 2:  # in the second sample, GPU 1's stuck read returns
                release.set()
                time.sleep(0.1)
        return 60 + h
    nvml = fake_nvml(count=2, nvmlDeviceGetTemperature=temperature,
                     nvmlDeviceGetPowerUsage=stuck_on(1, release, 300_000))
    backend = NvmlBackend(nvml=nvml, bounds=QUICK)
    try:
        first = by_gpu(backend.sample())
        time.sleep(0.05)
        second = by_gpu(backend.sample())
    finally:
        release.set()
    assert first[1].power_draw is None  # stuck
    assert second[1].timestamp == second[0].timestamp > first[1].timestamp
    assert second[1].power_draw is None  # read for a past sample: unknown in this one
    assert by_gpu(backend.sample())[1].power_draw == 300.0  # and read afresh in the next


def test_a_gpu_reported_wedged_stays_lost_while_another_is_slow(tmp_path):
    """Once GPU 0 was reported wedged, one slow read on GPU 1 made every GPU "stuck": GPU 0
    came back as unknown ("reports again") and was lost anew at the next sample, a second
    device_lost alert and emergency save for the same wedged GPU."""
    from ftmaster.monitor.daemon import Monitor
    wedged, slow = threading.Event(), threading.Event()

    def power(h):
        if h == 0:
            wedged.wait(60)
        elif slow.is_set():
            time.sleep(QUICK.read_timeout_s * 2)
        return 300_000
    nvml = fake_nvml(count=2, nvmlDeviceGetPowerUsage=power)
    nvml.events.clear()
    monitor = Monitor(NvmlBackend(nvml=nvml, bounds=QUICK), tmp_path)
    try:
        for _ in range(500):
            monitor.step()
            if 0 in monitor.lost_gpus():
                break
            time.sleep(0.01)
        slow.set()  # GPU 1 overruns one deadline
        monitor.step()
        assert monitor.lost_reasons() == {0: "wedged"}
        slow.clear()
        time.sleep(QUICK.read_timeout_s * 2)
        monitor.step()
        monitor.step()
    finally:
        wedged.set()
    assert [(a.gpu, a.reasons) for a in monitor.alerts] == [(0, ("device_lost", "wedged"))]


# -- XID registration: a failure is unknown coverage, and is tried again ---------------------
def failing_registration(code, gpu=1, times=1):
    """nvmlDeviceRegisterEvents that fails with ``code`` on ``gpu`` its first ``times`` calls."""
    left = {gpu: times}

    def register(h, _types, _set):
        if left.get(h, 0) > 0:
            left[h] -= 1
            raise FakeError(code)
    return register


def test_a_failed_xid_registration_is_that_gpus_unknown_and_is_tried_again():
    """A GPU whose registration failed once read "no XID" for the whole run: it was never
    registered again, and the backend still claimed XIDs for every GPU."""
    nvml = fake_nvml(nvmlDeviceRegisterEvents=failing_registration(NO_PERMISSION))
    nvml.events.clear()
    backend = NvmlBackend(nvml=nvml)
    backend.xid_retry_s = RETRY_S
    backend.sample()
    assert backend.unreported_fields == {1: {"xid"}} and "xid" in backend.reported_fields
    backend.sample()
    assert nvml.calls[("nvmlDeviceRegisterEvents", 1)] == 1  # not every sample: at its cadence
    time.sleep(RETRY_S + 0.05)
    backend.sample()
    assert nvml.calls[("nvmlDeviceRegisterEvents", 1)] == 2
    assert backend.unreported_fields == {}
    nvml.events[:] = [SimpleNamespace(device=1, eventData=48)]
    assert by_gpu(backend.sample())[1].xid == 48
    assert nvml.calls[("nvmlDeviceRegisterEvents", 0)] == 1  # a registered GPU is left alone
    assert "nvmlEventSetFree" not in nvml.calls  # the set stays usable after such a failure


def test_an_unsupported_xid_registration_is_not_tried_again():
    """NOT_SUPPORTED: "None of the requested eventTypes are registered", for good."""
    nvml = fake_nvml(nvmlDeviceRegisterEvents=failing_registration(NOT_SUPPORTED, times=99))
    backend = NvmlBackend(nvml=nvml)
    backend.xid_retry_s = 0.0
    for _ in range(3):
        backend.sample()
    assert nvml.calls[("nvmlDeviceRegisterEvents", 1)] == 1
    assert backend.unreported_fields == {1: {"xid"}}


def test_unknown_from_a_registration_renews_the_event_set():
    """nvml.h: after NVML_ERROR_UNKNOWN "event set is in undefined state and should be freed":
    it is, a new one is made, and every GPU registers on it (the one that failed, at its cadence)."""
    made, waits, registered = iter(["set-1", "set-2", "set-3"]), [], []
    fail_once = failing_registration(UNKNOWN)

    def register(handle, types, event_set):
        registered.append((handle, event_set))
        fail_once(handle, types, event_set)

    def event_wait(event_set, _timeout_ms):
        waits.append(event_set)
        raise FakeError(TIMEOUT)
    nvml = fake_nvml(nvmlDeviceRegisterEvents=register, nvmlEventSetWait=event_wait,
                     nvmlEventSetCreate=lambda: next(made))
    backend = NvmlBackend(nvml=nvml)
    backend.xid_retry_s = RETRY_S
    backend.sample()
    assert nvml.calls[("nvmlEventSetFree", "set-1")] == 1 and nvml.calls["nvmlEventSetCreate"] == 2
    assert "set-1" not in waits  # the undefined set is never read
    assert backend.unreported_fields == {0: {"xid"}, 1: {"xid"}}  # until they register on the new one
    backend.sample()
    # GPU 0 registers on the new set (on the old one too if its worker came before GPU 1's)
    assert registered.count((0, "set-2")) == 1
    assert backend.unreported_fields == {1: {"xid"}} and "xid" in backend.reported_fields
    time.sleep(RETRY_S + 0.05)
    backend.sample()
    assert backend.unreported_fields == {} and registered.count((1, "set-2")) == 1
    assert nvml.calls["nvmlEventSetCreate"] == 2 and waits[-1] == "set-2"


def test_an_event_set_that_could_not_be_made_at_the_start_is_made_again(monkeypatch):
    """One failed nvmlEventSetCreate (other than NOT_SUPPORTED) turned XIDs off for the job:
    the renewal was only for a broken set, not a missing one."""
    from ftmaster.monitor.backends import nvml as nvml_module

    monkeypatch.setattr(nvml_module, "XID_RETRY_S", RETRY_S)
    made = iter([FakeError(UNKNOWN), "set-1"])

    def create():
        result = next(made)
        if isinstance(result, Exception):
            raise result
        return result
    nvml = fake_nvml(nvmlEventSetCreate=create)
    backend = NvmlBackend(nvml=nvml)
    backend.sample()
    assert "xid" in backend.reported_fields and backend.unreported_fields == {0: {"xid"}, 1: {"xid"}}
    time.sleep(RETRY_S + 0.05)
    backend.sample()
    backend.sample()
    assert nvml.calls["nvmlEventSetCreate"] == 2 and backend.unreported_fields == {}


def test_the_monitor_says_when_a_gpu_cannot_show_xids_and_when_it_can_again(tmp_path):
    from ftmaster import runfiles
    from ftmaster.monitor.daemon import Monitor
    nvml = fake_nvml(nvmlDeviceRegisterEvents=failing_registration(NO_PERMISSION))
    nvml.events.clear()
    backend = NvmlBackend(nvml=nvml)
    backend.xid_retry_s = RETRY_S
    monitor = Monitor(backend, tmp_path)
    monitor.step()
    monitor.step()
    time.sleep(RETRY_S + 0.05)
    monitor.step()
    coverage = [e for e in runfiles.read_events(tmp_path) if e["event"] == "monitor_coverage"]
    assert [(e.get("gpu"), e["unavailable"]) for e in coverage] == [(1, ["xid"]), (1, [])]


# -- newer NVML calls with an older equivalent -----------------------------------------------
def test_a_newer_call_the_gpu_does_not_support_falls_back_to_the_older_one():
    """NOT_SUPPORTED from nvmlDeviceGetTemperatureV left the temperature unknown for good,
    though nvmlDeviceGetTemperature answered on that GPU; likewise the throttle reasons."""
    def unsupported_on_1(value):
        def call(h, *_):
            if h == 1:
                raise FakeError(NOT_SUPPORTED)
            return value
        return call
    nvml = fake_nvml(nvmlDeviceGetTemperatureV=unsupported_on_1(70),
                     nvmlDeviceGetCurrentClocksEventReasons=unsupported_on_1(0x4),
                     nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x8)
    backend = NvmlBackend(nvml=nvml)
    for _ in range(3):
        samples = backend.sample()
    assert [(s.temperature, s.throttle_reasons) for s in samples] == [(70, 0x4), (61, 0x8)]
    assert nvml.calls[("nvmlDeviceGetTemperatureV", 1)] == 1  # the choice is remembered per GPU
    assert nvml.calls[("nvmlDeviceGetTemperatureV", 0)] == 3
    assert ("nvmlDeviceGetTemperature", 0) not in nvml.calls
    assert nvml.calls[("nvmlDeviceGetCurrentClocksThrottleReasons", 1)] == 3
    assert ("nvmlDeviceGetCurrentClocksThrottleReasons", 0) not in nvml.calls


def test_a_reading_neither_call_supports_is_unknown_and_not_asked_again():
    nvml = fake_nvml(nvmlDeviceGetTemperatureV=raises(FUNCTION_NOT_FOUND),
                     nvmlDeviceGetTemperature=raises(NOT_SUPPORTED))
    backend = NvmlBackend(nvml=nvml)
    for _ in range(3):
        assert [s.temperature for s in backend.sample()] == [None, None]
    assert nvml.calls["nvmlDeviceGetTemperatureV"] == 1  # the driver lacks it: on no GPU again
    assert nvml.calls["nvmlDeviceGetTemperature"] == 2  # once per GPU


def test_a_newer_call_that_fails_otherwise_is_unknown_this_time_not_abandoned():
    fails = {"left": 1}

    def temperature_v(h, sensor):
        if fails["left"]:
            fails["left"] -= 1
            raise FakeError(UNKNOWN)
        return 70
    nvml = fake_nvml(count=1, nvmlDeviceGetTemperatureV=temperature_v)
    backend = NvmlBackend(nvml=nvml)
    assert [s.temperature for s in backend.sample()] == [None]
    assert [s.temperature for s in backend.sample()] == [70]
    assert "nvmlDeviceGetTemperature" not in nvml.calls


@pytest.mark.parametrize("failure", [LOST, UNKNOWN])
def test_an_xid_wait_that_fails_makes_every_gpus_xids_unknown_not_none(failure):
    """Only NVML_ERROR_TIMEOUT says no event is pending. A GPU lost on the set fails every
    wait (GPU_IS_LOST): read as "no XID", every other GPU's XIDs went unseen for the rest of
    the job, and nothing said they were not read."""
    failing = {"on": False}

    def event_wait(_set, timeout_ms):
        if failing["on"]:
            raise FakeError(failure)
        raise FakeError(TIMEOUT)
    nvml = fake_nvml(nvmlEventSetWait=event_wait)
    backend = NvmlBackend(nvml=nvml, bounds=QUICK)
    try:
        backend.sample()
        assert backend.unreported_fields == {}  # both registered
        failing["on"] = True
        backend.sample()
        unknown = backend.unreported_fields
        failing["on"] = False
        backend.sample()  # the set is made anew, and each GPU registers again
        backend.sample()
        again = backend.unreported_fields
    finally:
        backend.close()
    assert unknown == {0: frozenset({"xid"}), 1: frozenset({"xid"})}
    assert again == {} and nvml.calls["nvmlEventSetCreate"] == 2


def test_a_registration_stuck_in_the_driver_leaves_every_gpus_xids_unknown():
    """GPU 1's retried XID registration hangs, holding the event set: every later sample read
    no XID on GPUs 0 and 2 while coverage still claimed them, and a DBE on GPU 0 went unseen."""
    release, calls = threading.Event(), []

    def register(handle, _types, _set):
        if handle == 1:
            calls.append(handle)
            if len(calls) == 1:
                raise FakeError(NO_PERMISSION)  # tried again after xid_retry_s
            release.wait(60)  # the retry hangs in the driver

    nvml = fake_nvml(count=3, nvmlDeviceRegisterEvents=register)
    nvml.events.clear()
    backend = NvmlBackend(nvml=nvml, bounds=QUICK)
    backend.xid_retry_s = 0.0
    try:
        backend.sample()
        assert backend.unreported_fields == {1: frozenset({"xid"})}
        backend.sample()  # the retry, which hangs
        nvml.events[:] = [SimpleNamespace(device=0, eventData=48)]
        backend.sample()
        assert set(backend.unreported_fields) == {0, 1, 2}
    finally:
        release.set()
    time.sleep(QUICK.read_timeout_s)
    assert [(s.gpu_id, s.xid) for s in backend.sample() if s.gpu_id == 0] == [(0, 48)]


def test_a_uuid_that_failed_to_read_at_the_open_is_read_again():
    """One transient failure at the handle's open left the GPU without its UUID for the run:
    an empty UUID label on its metrics, and events placed by UUID missed it."""
    failed = []

    def uuid(handle):
        if handle == 1 and not failed:
            failed.append(handle)
            raise FakeError(UNKNOWN)
        return f"GPU-{handle}"

    backend = NvmlBackend(nvml=fake_nvml(count=2, nvmlDeviceGetUUID=uuid), bounds=QUICK)
    backend.sample()
    assert backend.uuids() == {0: "GPU-0"}
    backend.sample()
    assert backend.uuids() == {0: "GPU-0", 1: "GPU-1"}
