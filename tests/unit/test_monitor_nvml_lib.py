"""The NVML backend behind the real pynvml bindings and a fake ``libnvidia-ml`` (compiled
from ``tests/fakes/fake_libnvidia_ml.c``): real ctypes structures, real error classes, and a
driver call that truly blocks in C, as a wedged driver's does. Skipped without a C compiler."""

import time

import pytest

from fakes.nvml_lib import GPU_IS_LOST, NO_PERMISSION, RESET_REQUIRED, UNKNOWN, FakeNvml, build
from ftmaster.monitor.backends.bounded import ReadBounds
from ftmaster.monitor.backends.nvml import GpuIdentity, NvmlBackend, index_for_uuid, probe_gpus
from ftmaster.monitor.daemon import Monitor

QUICK = ReadBounds(read_timeout_s=0.2, setup_timeout_s=0.5, wedged_after=3)  # generous for busy CI
RETRY_S = 1.0  # a failed XID registration's cadence in tests: well past one busy sample


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("fake_nvml")
    current, old = build(out), build(out, old_driver=True)
    if current is None:
        pytest.skip("no C compiler to build the fake libnvidia-ml")
    return {"current": current, "old": old}


@pytest.fixture
def fake(built, tmp_path):
    """``fake(gpus, driver="current")``: a fresh copy of the library and its pynvml."""
    made = []

    def make(gpus=2, driver="current"):
        made.append(FakeNvml(built[driver], tmp_path, gpus))
        return made[-1]
    yield make
    for lib in made:
        lib.release_all()  # let reads stuck in the fake driver return


def by_gpu(samples):
    return {s.gpu_id: s for s in samples}


def test_every_field_through_the_real_bindings(fake):
    nvml = fake(2)
    nvml.remap(1, pending=1, failure=0)
    backend = NvmlBackend(nvml=nvml.pynvml)
    s0, s1 = backend.sample()
    assert (s0.gpu_name, s0.driver_version) == ("Fake H100 80GB HBM3", "570.124.06")
    assert (s0.temperature, s1.temperature) == (60, 61)  # nvmlDeviceGetTemperatureV
    assert (s0.power_draw, s0.gpu_utilization, s0.memory_used, s0.memory_total) == (300.0, 97.0, 1024.0, 81920.0)
    assert (s0.errors, s0.ecc_sbe, s0.ecc_dbe, s0.throttle_reasons) == (2, 5, 0, 0x4)
    assert (s0.power_limit, s0.sm_clock, s0.pcie_replay, s0.recovery_action) == (700.0, 1980, 3, 0)
    # Retired pages are not supported (as on H100): the remapped rows answer.
    assert (s0.retired_pages_pending, s1.retired_pages_pending) == (0, 1)
    assert "xid" in backend.reported_fields and backend.conditions == {}


def test_an_old_driver_gets_the_old_calls(fake):
    nvml = fake(1, driver="old")
    (sample,) = NvmlBackend(nvml=nvml.pynvml).sample()
    assert (sample.temperature, sample.throttle_reasons) == (50, 0x1)  # the deprecated calls answered


def test_a_gpu_that_does_not_support_the_newer_calls_gets_the_older_ones(fake):
    nvml = fake(2)
    nvml.new_calls_unsupported(1)
    backend = NvmlBackend(nvml=nvml.pynvml)
    backend.sample()
    s0, s1 = backend.sample()
    assert (s0.temperature, s0.throttle_reasons) == (60, 0x4)  # the newer calls
    assert (s1.temperature, s1.throttle_reasons) == (51, 0x1)  # the older ones, on that GPU only


def test_a_gpu_whose_xid_registration_failed_is_registered_again(fake):
    nvml = fake(2)
    nvml.register_error(1, NO_PERMISSION)
    backend = NvmlBackend(nvml=nvml.pynvml)
    backend.xid_retry_s = RETRY_S
    backend.sample()
    assert not nvml.registered(1) and backend.unreported_fields == {1: {"xid"}}
    nvml.register_error(1, 0)
    time.sleep(RETRY_S + 0.05)
    backend.sample()
    assert nvml.registered(1) and backend.unreported_fields == {}
    nvml.push_xid(1, 79)
    assert by_gpu(backend.sample())[1].xid == 79
    assert nvml.event_sets() == (1, 0)


def test_unknown_from_a_registration_frees_the_set_and_makes_another(fake):
    nvml = fake(2)
    nvml.register_error(1, UNKNOWN)
    backend = NvmlBackend(nvml=nvml.pynvml)
    backend.xid_retry_s = RETRY_S
    backend.sample()
    assert nvml.event_sets() == (2, 1) and backend.unreported_fields == {0: {"xid"}, 1: {"xid"}}
    nvml.register_error(1, 0)
    backend.sample()
    assert nvml.registered(0) and not nvml.registered(1)  # GPU 1 waits its turn
    time.sleep(RETRY_S + 0.05)
    backend.sample()
    assert nvml.registered(1) and backend.unreported_fields == {}
    nvml.push_xid(0, 48)
    nvml.push_xid(1, 79)
    samples = by_gpu(backend.sample())
    assert (samples[0].xid, samples[1].xid) == (48, 79)


def test_field_values_of_type_unsigned_short(fake):
    nvml = fake(1)
    nvml.field_type(6)
    (sample,) = NvmlBackend(nvml=nvml.pynvml).sample()
    assert sample.recovery_action == 2


def test_xids_are_placed_by_handle_even_when_the_index_lookup_fails(fake):
    nvml = fake(3)
    backend = NvmlBackend(nvml=nvml.pynvml)
    backend.sample()
    nvml.index_error(999)
    nvml.push_xid(2, 79)
    nvml.push_xid(0, 13)
    samples = by_gpu(backend.sample())
    assert [samples[g].xid for g in (0, 1, 2)] == [13, None, 79]


def test_driver_errors_become_conditions(fake):
    nvml = fake(4)
    nvml.remap(3, pending=0, failure=1)
    backend = NvmlBackend(nvml=nvml.pynvml)
    backend.sample()
    nvml.fail(1, GPU_IS_LOST)
    nvml.fail(2, RESET_REQUIRED)
    samples = by_gpu(backend.sample())
    assert sorted(samples) == [0, 2, 3]
    assert samples[2].temperature is None and samples[3].retired_pages_pending == 1
    assert backend.conditions == {1: ("gpu_is_lost",), 2: ("reset_required",), 3: ("row_remap_failure",)}


def test_a_gpu_wedged_in_the_driver_is_reported_lost_while_the_others_are_sampled(fake, tmp_path):
    nvml = fake(4)
    monitor = Monitor(NvmlBackend(nvml=nvml.pynvml, bounds=QUICK), tmp_path)
    monitor.step()
    nvml.wedge(2)
    calls_when_wedged = nvml.calls(2)
    samples_before_lost = 0
    while 2 not in monitor.lost_gpus():
        samples_before_lost += 1
        assert samples_before_lost < 500, "the wedged GPU was never reported lost"
        monitor.step()
        time.sleep(0.01)
    assert samples_before_lost >= QUICK.wedged_after  # unknown for a few deadlines, then lost
    assert monitor.lost_reasons() == {2: "wedged"}
    assert [(a.gpu, a.reasons) for a in monitor.alerts] == [(2, ("device_lost", "wedged"))]
    assert monitor.unschedulable_gpus() == {2: "wedged"}
    assert nvml.calls(2) == calls_when_wedged + 1  # one stuck call, nothing queued behind it
    rows = (tmp_path / "gpu_metrics.csv").read_text().splitlines()[1:]
    per_gpu = {g: sum(1 for r in rows if r.split(",")[1] == str(g)) for g in range(4)}
    assert per_gpu[0] == per_gpu[1] == per_gpu[3] == samples_before_lost + 1  # never missed a sample
    nvml.wedge(2, on=False)
    while 2 in monitor.lost_gpus():  # the driver came back: so does the GPU (evidence stays)
        monitor.step()
        time.sleep(0.01)
    assert monitor.unschedulable_gpus() == {2: "wedged"}


def test_excluded_and_unwatched_gpus_get_no_call(fake, tmp_path):
    nvml = fake(4)
    monitor = Monitor(NvmlBackend(nvml=nvml.pynvml), tmp_path)
    monitor.exclude_gpus([1])
    monitor.watch([0, 1, 2])
    for _ in range(3):
        monitor.step()
    assert nvml.calls(1) == 0 and nvml.calls(3) == 0
    assert nvml.calls(0) > 0 and nvml.calls(2) > 0
    assert monitor.lost_gpus() == frozenset()


def test_a_handle_lookup_slower_than_a_read_deadline_is_fine(fake):
    nvml = fake(2)
    nvml.delays(open_ms=300)  # no persistence mode: opening initialises the GPU
    backend = NvmlBackend(nvml=nvml.pynvml, bounds=ReadBounds(read_timeout_s=0.05, setup_timeout_s=5))
    assert [s.temperature for s in backend.sample()] == [60, 61]


def test_probe_through_the_real_bindings(fake):
    nvml = fake(3)
    nvml.mig(1, 1)
    nvml.mig(2, -1)
    probed = probe_gpus(timeout_s=5, nvml=nvml.pynvml)
    assert [(g.index, g.mig_enabled, g.problem) for g in probed] == [(0, False, None), (1, True, None),
                                                                    (2, False, None)]
    assert probed[2].uuid == "GPU-feed0002-0000-4000-8000-000000000002"
    assert index_for_uuid("GPU-feed0002", probed) == 2


def test_probe_of_a_wedged_gpu_is_bounded(fake):
    nvml = fake(2)
    nvml.wedge(0)
    assert probe_gpus(timeout_s=0.2, nvml=nvml.pynvml) == [
        GpuIdentity(0, None, None, "wedged"),
        GpuIdentity(1, "GPU-feed0001-0000-4000-8000-000000000001", False)]
