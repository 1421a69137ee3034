"""The monitor loop with the sim backend: injections, alerts, lost GPUs, backend errors."""

import json
import os
import threading
import time

import pytest

from ftmaster import runfiles
from ftmaster.faults import parse_injection
from ftmaster.monitor.anomalies import PagesPending, ThermalRunaway
from ftmaster.monitor.backends import BackendError
from ftmaster.monitor.backends.bounded import ReadBounds
from ftmaster.monitor.backends.sim import SimBackend
from ftmaster.monitor.daemon import Monitor, MonitorConfig, backoff_delay
from ftmaster.monitor.sample import GpuSample


class Clock:
    """Virtual time: each sample advances it by ``step`` seconds, so nothing sleeps."""

    def __init__(self, step):
        self.now, self.step = 1_750_000_000.0, step

    def __call__(self):
        self.now += self.step
        return self.now


def sim_monitor(tmp_path, step, injections=(), seed=0, num_gpus=4):
    backend = SimBackend(num_gpus=num_gpus, seed=seed, clock=Clock(step))
    return Monitor(backend, tmp_path, injections=[parse_injection(i) for i in injections], seed=seed)


def run(monitor, steps):
    for _ in range(steps):
        monitor.step()


def test_degrade_alerts_within_a_few_samples_at_half_a_second(tmp_path):
    for seed in range(5):  # every degrade plan, not just one
        monitor = sim_monitor(tmp_path / str(seed), 0.5, ["degrade:gpu=2,at=1s"], seed=seed)
        run(monitor, 2)  # before the trigger
        assert monitor.alerts == []
        run(monitor, 6)
        assert {a.gpu for a in monitor.alerts} == {2}, seed
    events = runfiles.read_events(tmp_path / "4")
    assert [e["gpu"] for e in events if e["event"] == "risk_alert"] == [2]
    flag = runfiles.read_flag(runfiles.trigger_flag_path(tmp_path / "4"))
    assert flag["gpu"] == 2 and flag["score"] == 1.0 and flag["reasons"]


def test_fail_loses_the_gpu_and_recover_brings_it_back(tmp_path):
    monitor = sim_monitor(tmp_path, 1.0, ["fail:gpu=1,at=3s", "recover:gpu=1,at=6s"])
    run(monitor, 5)
    assert monitor.lost_gpus() == {1}
    lost = [e for e in runfiles.read_events(tmp_path) if e["event"] == "risk_alert"]
    assert [(e["gpu"], e["reasons"]) for e in lost] == [(1, ["device_lost"])]
    # its rank is gone, so no save can be agreed: the alert asks for none
    assert not runfiles.trigger_flag_path(tmp_path).exists()
    run(monitor, 3)
    assert monitor.lost_gpus() == set()


def test_iteration_trigger_reads_the_heartbeat(tmp_path):
    monitor = sim_monitor(tmp_path, 1.0, ["fail:gpu=0,at=iter:10"])
    run(monitor, 2)
    (tmp_path / "heartbeat.json").write_text("{garbled")
    run(monitor, 2)
    runfiles.write_heartbeat(tmp_path, iteration=9, consumed_samples=0)
    run(monitor, 2)
    assert monitor.lost_gpus() == set()
    runfiles.write_heartbeat(tmp_path, iteration=10, consumed_samples=0)
    run(monitor, 2)
    assert monitor.lost_gpus() == {0}


def test_soft_thermal_runaway_and_hang_alert_on_the_right_gpu(tmp_path):
    monitor = sim_monitor(tmp_path, 5.0, ["hang:gpu=3,at=900s"])
    run(monitor, 120)  # 10 minutes: warm-up done, baselines learnt, nothing alerted
    assert monitor.alerts == []
    monitor.overlay.inject(1, ThermalRunaway(rate_c_per_min=3.0))
    run(monitor, 96)  # 8 more minutes
    reasons = {a.gpu: a.reasons for a in monitor.alerts}
    assert set(reasons) == {1, 3}
    assert "temperature_trend" in reasons[1] and "utilization_collapse" in reasons[3]


def test_excluded_gpus_are_neither_scored_nor_lost(tmp_path):
    monitor = sim_monitor(tmp_path, 1.0, ["fail:gpu=2,at=2s"])
    run(monitor, 4)
    monitor.exclude_gpus([2])
    run(monitor, 2)
    assert monitor.lost_gpus() == set()
    rows = (tmp_path / "gpu_metrics.csv").read_text().splitlines()
    assert sum(1 for r in rows[1:] if r.split(",")[1] == "2") == 2  # only before it was lost


def test_csv_has_the_header_once_and_a_risk_per_row(tmp_path):
    import pandas as pd
    monitor = sim_monitor(tmp_path, 0.1)
    run(monitor, 3)
    monitor.close()
    again = sim_monitor(tmp_path, 0.1)  # a relaunch appends to the same file
    run(again, 2)
    frame = pd.read_csv(tmp_path / "gpu_metrics.csv")
    assert len(frame) == 20 and frame["failure_risk"].notna().all()


class FlakyBackend:
    name = "flaky"

    def __init__(self, failures):
        self.failures, self.calls = failures, 0
        self.done = threading.Event()

    def sample(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise BackendError("driver busy")
        if self.calls >= self.failures + 3:
            self.done.set()
        return [GpuSample(timestamp=1_750_000_000.0 + self.calls, gpu_id=0, temperature=60.0)]

    def close(self):
        pass


def test_the_thread_survives_backend_errors_with_backoff(tmp_path):
    backend = FlakyBackend(failures=3)
    monitor = Monitor(backend, tmp_path, config=MonitorConfig(interval_s=0.01, max_backoff_s=0.05))
    monitor.start()
    assert backend.done.wait(30)
    monitor.stop()
    errors = [e for e in runfiles.read_events(tmp_path) if e["event"] == "monitor_error"]
    assert len(errors) == 1 and "driver busy" in errors[0]["error"]  # one per run of failures
    assert monitor.samples_seen >= 3
    assert json.loads((tmp_path / "events.jsonl").read_text().splitlines()[0])["event"] == "monitor_error"


def test_backoff_is_capped_however_long_the_outage():
    assert backoff_delay(1, 10.0, 60.0) == 20.0
    assert backoff_delay(5000, 10.0, 60.0) == 60.0  # 2 ** 5000 would overflow a float


class SoftOnlyBackend:
    """Temperature, power and utilisation only: no hard signal can show."""

    name = "soft"
    reported_fields = frozenset({"timestamp", "gpu_id", "temperature", "power_draw", "gpu_utilization"})

    def __init__(self):
        self.now = 1_750_000_000.0

    def sample(self):
        self.now += 1
        return [GpuSample(timestamp=self.now, gpu_id=g, temperature=60.0, power_draw=300.0,
                          gpu_utilization=95.0) for g in range(2)]

    def close(self):
        pass


def test_missing_hard_signals_are_reported_once(tmp_path, caplog):
    monitor = Monitor(SoftOnlyBackend(), tmp_path)
    run(monitor, 3)
    coverage = [e for e in runfiles.read_events(tmp_path) if e["event"] == "monitor_coverage"]
    assert [e["unavailable"] for e in coverage] == \
        [["ecc_dbe/errors", "xid", "retired_pages_pending", "recovery_action"]]
    warnings = [r.getMessage() for r in caplog.records if "hard signals unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "xid" in warnings[0]


def test_full_telemetry_reports_no_coverage_gap(tmp_path):
    run(sim_monitor(tmp_path, 1.0), 3)
    assert not any(e["event"] == "monitor_coverage" for e in runfiles.read_events(tmp_path))


# -- issue 10: xid and wedge injections, watched GPUs, lost reasons, health evidence ---------
QUICK = ReadBounds(read_timeout_s=0.1, setup_timeout_s=0.5, wedged_after=3)  # generous for busy CI


def quick_sim_monitor(tmp_path, injections=(), num_gpus=4):
    backend = SimBackend(num_gpus=num_gpus, clock=Clock(1.0), bounds=QUICK)
    return Monitor(backend, tmp_path, injections=[parse_injection(i) for i in injections])


def rows_per_gpu(tmp_path):
    rows = (tmp_path / "gpu_metrics.csv").read_text().splitlines()[1:]
    counts = {}
    for row in rows:
        gpu = int(row.split(",")[1])
        counts[gpu] = counts.get(gpu, 0) + 1
    return counts


def test_an_injected_xid_alerts_with_a_hard_reason_and_makes_the_gpu_unschedulable(tmp_path):
    monitor = quick_sim_monitor(tmp_path, ["xid:gpu=1,code=95,at=3s", "recover:gpu=1,at=8s"])
    run(monitor, 5)
    assert [(a.gpu, a.reasons) for a in monitor.alerts] == [(1, ("xid_95",))]
    assert monitor.unschedulable_gpus() == {1: "xid_95"}
    xids = [r.split(",")[13] for r in (tmp_path / "gpu_metrics.csv").read_text().splitlines()[1:]]
    assert xids.count("95") == 1  # an XID is an event: one sample shows it
    run(monitor, 4)
    assert monitor.unschedulable_gpus() == {}  # recover: the rehearsal's reset


def test_a_wedged_sim_gpu_is_reported_lost_while_the_others_are_sampled(tmp_path):
    monitor = quick_sim_monitor(tmp_path, ["wedge:gpu=2,at=2s"])
    steps = 0
    while 2 not in monitor.lost_gpus():
        steps += 1
        assert steps < 500, "the wedged GPU was never reported lost"
        monitor.step()
        time.sleep(0.01)
    assert monitor.lost_reasons() == {2: "wedged"}
    assert monitor.unschedulable_gpus() == {2: "wedged"}
    assert [(a.gpu, a.reasons) for a in monitor.alerts] == [(2, ("device_lost", "wedged"))]
    counts = rows_per_gpu(tmp_path)
    assert counts[0] == counts[1] == counts[3] == steps
    assert steps - counts[2] >= 1 and counts[2] >= 2  # unknown rows while stuck, then left out
    events = runfiles.read_events(tmp_path)
    assert [e["reasons"] for e in events if e["event"] == "risk_alert"] == [["device_lost", "wedged"]]


def test_recover_releases_a_wedged_sim_gpu(tmp_path):
    monitor = quick_sim_monitor(tmp_path, ["wedge:gpu=0,at=1s"])
    while 0 not in monitor.lost_gpus():
        monitor.step()
        time.sleep(0.01)
    monitor.pending_injections.append(parse_injection("recover:gpu=0,at=0s"))
    for _ in range(500):
        monitor.step()
        if 0 not in monitor.lost_gpus():
            break
        time.sleep(0.01)
    assert monitor.lost_gpus() == set() and monitor.unschedulable_gpus() == {}


def test_a_wedge_on_an_excluded_gpu_is_never_seen(tmp_path):
    monitor = quick_sim_monitor(tmp_path, ["wedge:gpu=3,at=1s"])
    monitor.exclude_gpus([3])
    for _ in range(20):
        monitor.step()
    assert monitor.lost_gpus() == set() and 3 not in rows_per_gpu(tmp_path)


def test_unwatched_spares_are_not_sampled_and_raise_no_alert(tmp_path):
    monitor = sim_monitor(tmp_path, 5.0, ["hang:gpu=3,at=900s"])
    monitor.watch([0, 1, 2])  # GPU 3 is a spare the replanned attempt does not use
    run(monitor, 216)  # 18 minutes: long enough for an idle watched GPU to alert
    assert monitor.alerts == [] and monitor.lost_gpus() == set()
    assert set(rows_per_gpu(tmp_path)) == {0, 1, 2}
    monitor.watch(None)  # every GPU again
    run(monitor, 2)
    assert set(rows_per_gpu(tmp_path)) == {0, 1, 2, 3}


def test_a_pending_flag_set_before_the_monitor_started_never_alerts(tmp_path):
    # Review point 9: the flag stays set until a reset. At start it is old news; it must
    # neither alert at every start nor keep the GPU critical forever.
    monitor = sim_monitor(tmp_path, 1.0)
    monitor.overlay.inject(0, PagesPending())
    run(monitor, 3)
    assert monitor.alerts == []
    monitor.overlay.inject(1, PagesPending())  # set while watched: news
    run(monitor, 120)
    assert [(a.gpu, a.reasons) for a in monitor.alerts] == [(1, ("retired_pages_pending",))]
    assert not monitor.still_critical(1)  # re-armed although the flag is still set


class ScriptedBackend:
    """Samples and driver conditions given step by step."""

    name = "scripted"

    def __init__(self, script):
        self.script, self.conditions, self.now = list(script), {}, 1_750_000_000.0

    def sample(self):
        present, self.conditions = self.script.pop(0)
        self.now += 1
        return [GpuSample(timestamp=self.now, gpu_id=g, temperature=60.0, power_draw=300.0,
                          gpu_utilization=95.0) for g in present]

    def close(self):
        pass


def test_driver_conditions_become_lost_reasons_and_evidence(tmp_path):
    monitor = Monitor(ScriptedBackend([
        ([0, 1, 2], {}),
        ([0, 2], {1: ("gpu_is_lost",), 2: ("reset_required",), 3: ("wedged",)}),
        ([0, 2], {}),
    ]), tmp_path)
    run(monitor, 3)
    assert monitor.lost_reasons() == {1: "gpu_is_lost", 3: "wedged"}  # 3 was never sampled: still lost
    assert monitor.unschedulable_gpus() == {1: "gpu_is_lost", 2: "reset_required", 3: "wedged"}
    # reset_required is evidence for the supervisor, not an alert: it would alert at every start.
    assert sorted((a.gpu, a.reasons) for a in monitor.alerts) == [
        (1, ("device_lost", "gpu_is_lost")), (3, ("device_lost", "wedged"))]


def test_a_gpu_that_only_goes_missing_is_lost_but_schedulable(tmp_path):
    monitor = Monitor(ScriptedBackend([([0, 1], {}), ([0], {})]), tmp_path)
    run(monitor, 2)
    assert monitor.lost_reasons() == {1: "device_lost"}
    assert monitor.unschedulable_gpus() == {}  # the wait policy may still wait for it


def test_a_wedge_of_every_gpu_is_a_monitor_error_not_a_lost_node(tmp_path):
    monitor = quick_sim_monitor(tmp_path, ["wedge:gpu=0,at=1s", "wedge:gpu=1,at=1s"], num_gpus=2)
    monitor.config = MonitorConfig(interval_s=0.01, max_backoff_s=0.02)
    monitor.start()
    try:
        for _ in range(500):
            if any(e["event"] == "monitor_error" for e in runfiles.read_events(tmp_path)):
                break
            time.sleep(0.01)
    finally:
        monitor.stop()
    (error,) = [e for e in runfiles.read_events(tmp_path) if e["event"] == "monitor_error"]
    assert "the driver looks wedged" in error["error"]
    assert monitor.lost_gpus() == set() and monitor.unschedulable_gpus() == {}


def test_refresh_takes_a_sample_now_instead_of_after_the_interval(tmp_path):
    from ftmaster.monitor.backends.sim import SimBackend
    from ftmaster.monitor.daemon import Monitor, MonitorConfig

    monitor = Monitor(SimBackend(num_gpus=2, seed=1), None, config=MonitorConfig(interval_s=3600))
    assert monitor.refresh(0.1) is False  # no thread yet
    monitor.start()
    try:
        assert monitor.refresh(10)  # the first sample, then an hour's wait...
        before = monitor.samples_seen
        assert monitor.refresh(10)  # ...cut short: one more sample of both GPUs
        assert monitor.samples_seen == before + 2
    finally:
        monitor.stop()


def test_an_alert_asks_for_its_checkpoint_even_when_the_csv_and_events_cannot_be_written(
        tmp_path, monkeypatch, caplog):
    """The policy disarms a GPU as it alerts: a full disk failing the sample's row (or the
    event) before the flag was written lost the alert's checkpoint for good."""
    import errno
    import logging
    import os

    caplog.set_level(logging.INFO)
    monitor = sim_monitor(tmp_path, 0.5, ["xid:gpu=1,code=79,at=1s"])
    run(monitor, 1)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(monitor._writer, "write", disk_full)
    monkeypatch.setattr(runfiles, "append_event", disk_full)
    run(monitor, 4)
    assert [a.gpu for a in monitor.alerts] == [1]
    assert runfiles.read_flag(runfiles.trigger_flag_path(tmp_path))["gpu"] == 1
    assert caplog.text.count("gpu_metrics.csv (ENOSPC: No space left on device)") == 1
    monkeypatch.undo()
    run(monitor, 1)
    assert "gpu_metrics.csv is written again" in caplog.text
    assert os.path.getsize(runfiles.metrics_csv_path(tmp_path)) > 0


def test_a_save_request_whose_flag_could_not_be_written_is_written_at_a_later_sample(
        tmp_path, monkeypatch):
    """The flag's write failing once (ENOSPC, an NFS EIO) lost the request for good: the
    policy had disarmed the GPU, which never asked again."""
    import errno

    monitor = sim_monitor(tmp_path, 0.5, ["xid:gpu=1,code=79,at=1s"])
    run(monitor, 1)
    write_flag, failed = runfiles.write_flag, []

    def fails_once(path, **body):
        if not failed:
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error")
        return write_flag(path, **body)

    monkeypatch.setattr(runfiles, "write_flag", fails_once)
    run(monitor, 4)
    assert failed and [a.gpu for a in monitor.alerts] == [1]
    assert runfiles.read_flag(runfiles.trigger_flag_path(tmp_path))["gpu"] == 1


def test_the_csv_is_whole_rows_after_a_write_cut_short_or_a_writer_killed_mid_row(tmp_path, monkeypatch):
    import csv
    import errno
    import os

    from ftmaster.monitor import daemon
    from ftmaster.monitor.schema import CSV_COLUMNS

    monitor = sim_monitor(tmp_path, 0.5)
    run(monitor, 2)
    path = runfiles.metrics_csv_path(tmp_path)
    whole = path.read_bytes()
    real_write, calls = os.write, []

    def short_then_full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:40]))  # a part, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(daemon.os, "write", short_then_full)
    run(monitor, 1)
    monkeypatch.undo()
    assert path.read_bytes() == whole  # the part taken back
    monitor.close()
    with path.open("ab") as handle:  # a writer killed mid-row
        handle.write(b"1750000000.0,3,63.0,")
    run(sim_monitor(tmp_path, 0.5), 1)
    rows = list(csv.reader(path.open()))
    assert all(len(row) == len(CSV_COLUMNS) for row in rows) and len(rows) == 1 + 4 * 3


def test_a_header_whose_line_was_cut_is_kept_and_ended(tmp_path):
    """Taken for a torn row, the whole file was cut: the rows went on without a header."""
    import csv

    from ftmaster.monitor.daemon import MetricsWriter
    from ftmaster.monitor.schema import CSV_COLUMNS

    path = runfiles.metrics_csv_path(tmp_path)
    path.write_text(",".join(CSV_COLUMNS))
    MetricsWriter(path).write([GpuSample(timestamp=1750000000.0, gpu_id=0, temperature=60.0)])
    rows = list(csv.reader(path.open()))
    assert tuple(rows[0]) == CSV_COLUMNS and len(rows) == 2 and rows[1][1] == "0"


@pytest.mark.parametrize("rotation", ["moved away", "emptied in place", "replaced by another"])
def test_the_csv_follows_its_path_through_a_rotation(tmp_path, rotation):
    """logrotate's create (or mv) left the rows going into the moved file and none at the path;
    its copytruncate left them headerless at offset 0, which a restarted monitor refused."""
    import csv

    from ftmaster.monitor.daemon import MetricsWriter
    from ftmaster.monitor.schema import CSV_COLUMNS

    path = runfiles.metrics_csv_path(tmp_path)
    writer = MetricsWriter(path)
    writer.write([GpuSample(timestamp=1750000000.0, gpu_id=0, temperature=60.0)])
    if rotation == "moved away":
        path.rename(tmp_path / "gpu_metrics.csv.1")
    elif rotation == "emptied in place":
        os.truncate(path, 0)
    else:
        path.rename(tmp_path / "gpu_metrics.csv.1")
        path.write_text("a,b\n1,2\n")
    sample = [GpuSample(timestamp=1750000010.0, gpu_id=1, temperature=61.0)]
    if rotation == "replaced by another":  # not ours to write into: the outage says so once
        with pytest.raises(OSError, match="other columns"):
            writer.write(sample)
        assert path.read_text() == "a,b\n1,2\n"
        return
    writer.write(sample)
    writer.close()
    rows = list(csv.reader(path.open()))
    assert tuple(rows[0]) == CSV_COLUMNS and [row[1] for row in rows[1:]] == ["1"]
    MetricsWriter(path).close()  # a restarted monitor takes the file


def test_a_stop_during_a_long_first_sample_closes_the_readers_without_a_traceback(tmp_path):
    """The stop closes the backend while the sampler still starts GPU readers (20000 GPUs
    at the monitor's 5 s join: "dictionary changed size during iteration")."""
    from ftmaster.monitor.backends.bounded import PerGpuReads

    reads = PerGpuReads(range(4), QUICK, "test")
    started, closing = threading.Event(), threading.Event()

    def slow_read(gpu, reading):
        started.set()
        closing.wait(2)

    sampler = threading.Thread(target=lambda: reads.read(slow_read, 0.0), daemon=True)
    sampler.start()
    assert started.wait(5)
    reads.close()  # while the sample is under way
    closing.set()
    sampler.join(5)
    try:
        reads.read(slow_read, 1.0)
    except BackendError as error:
        assert "closed" in str(error)
    else:
        raise AssertionError("a closed reader started new reads")


def test_the_sampling_period_does_not_drift(tmp_path, monkeypatch):
    """Each wait was the interval less the step, from when the step began: every wake-up's
    lateness added up, so samples fell further behind their period each time (found in review)."""
    import types

    from ftmaster.monitor import daemon

    class LateClock:
        """Steps take 0.2 s and every wait wakes 0.05 s late; nothing sleeps."""

        def __init__(self):
            self.now = 100.0

        def wait(self, seconds):
            self.now += seconds + 0.05

        def set(self):
            pass

        def clear(self):
            pass

    clock, starts = LateClock(), []

    class TimedBackend:
        name = "timed"

        def sample(self):
            starts.append(clock.now)
            clock.now += 0.2
            if len(starts) == 200:
                monitor._stop.set()
            return [GpuSample(timestamp=1_750_000_000.0 + clock.now, gpu_id=0, temperature=60.0)]

        def close(self):
            pass

    monkeypatch.setattr(daemon, "time", types.SimpleNamespace(monotonic=lambda: clock.now, time=time.time))
    monitor = Monitor(TimedBackend(), None, config=MonitorConfig(interval_s=10.0))
    monitor._wake = clock
    monitor._loop()
    assert starts[-1] - starts[0] == pytest.approx(199 * 10.0, abs=0.1)


def test_a_nan_reading_is_unknown_not_a_level_or_a_score(tmp_path):
    """A backend's NaN was taken as read: kept as the error counter's level it hid every later
    rise (no ecc_dbe alert, nor evidence), and in the scorer's windows it kept the score NaN,
    which never alerts (found in review)."""
    nan = float("nan")

    class NanBackend:
        name = "nan"

        def __init__(self):
            self.readings = [dict(errors=0), dict(errors=nan, temperature=nan), dict(errors=1)]

        def sample(self):
            values = self.readings.pop(0)
            t = 1_750_000_000.0 + 10 * (3 - len(self.readings))
            return [GpuSample(timestamp=t, gpu_id=g, **{"temperature": 60.0, "power_draw": 300.0,
                                                        "gpu_utilization": 95.0, **(values if g == 0 else {})})
                    for g in range(4)]

        def close(self):
            pass

    monitor = Monitor(NanBackend(), tmp_path)
    run(monitor, 2)
    (alert,) = monitor.step()
    assert alert.gpu == 0 and alert.reasons == ("ecc_dbe",)
    assert monitor.unschedulable_gpus() == {0: "ecc_dbe"}
    assert "nan" not in runfiles.metrics_csv_path(tmp_path).read_text()


def test_an_injection_for_a_gpu_that_is_not_sampled_is_said_once(tmp_path, caplog):
    """A real backend's GPUs are known only from its first sample: an injection for one it
    does not have ran to the end with no word, and never fired."""
    monitor = sim_monitor(tmp_path, 1.0, ["fail:gpu=9,at=2s", "degrade:gpu=1,at=1s"])
    run(monitor, 4)
    said = [r.getMessage() for r in caplog.records if "is not among the sampled" in r.getMessage()]
    assert said == ["--inject fail:gpu=9,at=2s: GPU 9 is not among the sampled GPUs "
                    "0, 1, 2, 3; it changes nothing"]
    (event,) = [e for e in runfiles.read_events(tmp_path) if e["event"] == "injection_unsampled"]
    assert (event["gpu"], event["sampled"]) == (9, [0, 1, 2, 3])


def test_a_sim_clock_stepped_back_past_the_start_reads_no_negative_power():
    times = iter([1000.0, 1010.0, 950.0, 960.0])  # NTP steps the wall clock back a minute
    backend = SimBackend(num_gpus=2, seed=0, clock=lambda: next(times))
    try:
        samples = [s for _ in range(4) for s in backend.sample()]
    finally:
        backend.close()
    assert all(s.power_draw > 0 and s.gpu_utilization >= 0 for s in samples)


def test_a_gpu_still_critical_asks_again_once_its_request_is_gone(tmp_path, caplog):
    """Alerts come once until the GPU re-arms: when its request went unanswered (a failed
    save consumes it, a relaunch clears it), a GPU that stayed critical never asked again."""
    from ftmaster.monitor.alerts import AlertConfig

    backend = SimBackend(num_gpus=4, seed=0, clock=Clock(1.0))
    monitor = Monitor(backend, tmp_path, injections=[parse_injection("degrade:gpu=2,at=1s")],
                      seed=0, alert_config=AlertConfig(cooldown_s=20.0))
    flag = runfiles.trigger_flag_path(tmp_path)
    run(monitor, 8)
    assert [a.gpu for a in monitor.alerts] == [2] and flag.exists()
    flag.unlink()  # consumed by a save that failed
    run(monitor, 5)
    assert not flag.exists()  # within the cooldown
    run(monitor, 20)
    assert runfiles.read_flag(flag)["gpu"] == 2
    assert [a.gpu for a in monitor.alerts] == [2]  # a request, not a new alert
    assert "GPU 2 is still critical" in caplog.text
    runfiles.save_now_flag_path(tmp_path).parent.mkdir(parents=True, exist_ok=True)
    flag.rename(runfiles.save_now_flag_path(tmp_path))  # moved to training, not yet answered
    run(monitor, 40)
    assert not flag.exists()


def test_a_failed_row_remap_on_a_gpu_still_sampled_alerts_once_and_asks_for_a_save(tmp_path):
    """The driver's conditions went into the evidence only, and alerts come from the samples'
    fields: a GPU the driver says needs replacing trained on with no alert and no save."""
    monitor = Monitor(ScriptedBackend([([0, 1], {})] + [([0, 1], {1: ("row_remap_failure",)})] * 3),
                      tmp_path)
    run(monitor, 4)
    assert [(a.gpu, a.reasons) for a in monitor.alerts] == [(1, ("row_remap_failure",))]
    assert runfiles.read_flag(runfiles.trigger_flag_path(tmp_path))["gpu"] == 1
    assert monitor.unschedulable_gpus() == {1: "row_remap_failure"}


def test_an_impossibly_large_reading_is_unknown_and_keeps_every_score_a_number(tmp_path):
    """Two peers' power of 1e308 (a corrupt, finite cell) overflowed their median's mean to
    infinity: the healthy GPU's baseline went NaN, and its score stayed NaN for the rest of
    the run, never alerting nor re-arming."""
    import math

    class HugeBackend:
        name = "huge"

        def __init__(self):
            self.count = 0

        def sample(self):
            self.count += 1
            t = 1_750_000_000.0 + 10 * self.count
            huge = self.count == 5
            return [GpuSample(timestamp=t, gpu_id=g, temperature=60.0, gpu_utilization=95.0,
                              power_draw=1e308 if huge and g < 2 else 300.0) for g in range(3)]

        def close(self):
            pass

    monitor = Monitor(HugeBackend(), tmp_path)
    for _ in range(20):
        monitor.step()
    rows = runfiles.metrics_csv_path(tmp_path).read_text()
    assert "nan" not in rows and "e+308" not in rows
    last = list(monitor.scorer.update([GpuSample(timestamp=1_750_000_300.0, gpu_id=2,
                                                 temperature=60.0, gpu_utilization=95.0,
                                                 power_draw=300.0)]).values())[0]
    assert math.isfinite(last.score)


def test_a_hang_rehearsals_idle_gpu_works_again_once_the_attempt_is_relaunched(tmp_path):
    """The stopped rank's idleness stayed on its GPU for the rest of the run: relaunched on
    it, the healthy GPU read 0% busy, and the monitor asked for a save every cooldown."""
    from ftmaster.faults import parse_injection

    monitor = sim_monitor(tmp_path, 10.0)
    run(monitor, 30)
    monitor.pending_injections.append(parse_injection("hang:gpu=1,at=iter:5").at_once())
    run(monitor, 30)
    monitor.watch([0, 1, 2, 3])  # the relaunch after the hang, on the same GPUs
    alerts = len(monitor.alerts)
    run(monitor, 200)  # over half an hour: several cooldowns
    assert len(monitor.alerts) == alerts
    assert not monitor.still_critical(1)
    assert all(s.gpu_utilization > 50 for s in monitor.overlay.apply(monitor.backend.sample())
               if s.gpu_id == 1)


def test_a_fail_due_at_the_first_sample_is_a_gpu_lost_not_one_never_sampled(tmp_path):
    """The injection was laid over the first sample before the GPUs were counted: GPU 1
    never counted as seen, so it was never lost, and the run said the injection changed
    nothing (GPU 1 "is not among the sampled GPU 0")."""
    monitor = sim_monitor(tmp_path, 1.0, ["fail:gpu=1,at=0s"], num_gpus=2)
    run(monitor, 3)
    assert monitor.lost_gpus() == {1}
    events = [e["event"] for e in runfiles.read_events(tmp_path)]
    assert "injection_unsampled" not in events


def test_an_earlier_runs_heartbeat_fires_no_injection_at_an_iteration(tmp_path):
    """`ftmaster monitor` on a run directory kept from a run three days ago (iteration 30,
    finished): at=iter:8 fired at the first sample, with no trainer running."""
    import time

    runfiles.write_heartbeat(tmp_path, iteration=30, consumed_samples=240, finished=True)
    stale = json.loads(runfiles.heartbeat_path(tmp_path).read_text())
    runfiles.heartbeat_path(tmp_path).write_text(json.dumps({**stale, "time": time.time() - 3 * 86400}))
    monitor = sim_monitor(tmp_path, 1.0, ["fail:gpu=1,at=iter:8"], num_gpus=2)
    run(monitor, 3)
    assert monitor.lost_gpus() == set()
    runfiles.write_heartbeat(tmp_path, iteration=8, consumed_samples=64)  # a trainer at work now
    run(monitor, 3)
    assert monitor.lost_gpus() == {1}
