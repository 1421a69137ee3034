"""The Prometheus metrics: what the monitor's samples, the run's events and the heartbeat set,
read back from the registry and from a real scrape of the served endpoint."""

import socket
import urllib.request

import pytest
from click.testing import CliRunner

from ftmaster import runfiles
from ftmaster.cli import main
from ftmaster.metrics import Metrics, MetricsConfig, MetricsUnavailable, serve_metrics
from ftmaster.monitor.backends import make_backend
from ftmaster.monitor.daemon import Alert, Monitor
from ftmaster.monitor.sample import GpuSample
from ftmaster.states import State
from helpers.ipv6 import needs_ipv6

NODE = {"Hostname": "node-a", "node_rank": "1"}


def metrics():
    return Metrics(MetricsConfig(port=0, hostname="node-a", node_rank=1))


def value(m, name, **labels):
    return m.registry.get_sample_value(name, {**NODE, **labels})


def gpu(g, name="H100"):
    return {"gpu": str(g), "UUID": "", "modelName": name}


def test_samples_set_risk_and_dcgm_telemetry_and_an_unknown_reading_has_no_series():
    m = metrics()
    m.observe_samples([GpuSample(1.0, 0, "H100", temperature=71.5, power_draw=300.0,
                                 failure_risk=0.4)], [])
    assert value(m, "ftmaster_gpu_failure_risk", **gpu(0)) == 0.4
    assert value(m, "DCGM_FI_DEV_GPU_TEMP", **gpu(0)) == 71.5
    assert value(m, "DCGM_FI_DEV_SM_CLOCK", **gpu(0)) is None  # never read: absent
    m.observe_samples([GpuSample(2.0, 0, "H100", temperature=None, power_draw=310.0,
                                 failure_risk=0.9)], [Alert(0, 0.97, ("xid",), 2.0)] * 2)
    assert value(m, "DCGM_FI_DEV_GPU_TEMP", **gpu(0)) is None  # a failed read is unknown
    assert value(m, "ftmaster_gpu_alerts_total", **gpu(0)) == 2


def test_a_gpu_left_out_of_a_sample_and_a_pace_while_nothing_trains_have_no_series():
    m = metrics()
    m.observe_samples([GpuSample(1.0, g, "H100", temperature=40.0, failure_risk=0.9) for g in (0, 1)], [])
    m.observe_samples([GpuSample(2.0, 0, "H100", temperature=41.0, failure_risk=0.1)], [])  # 1 lost
    assert value(m, "ftmaster_gpu_failure_risk", **gpu(0)) == 0.1
    assert value(m, "ftmaster_gpu_failure_risk", **gpu(1)) is None  # not its last 0.9
    assert value(m, "DCGM_FI_DEV_GPU_TEMP", **gpu(1)) is None
    m.observe_heartbeat({"iteration": 10, "consumed_samples": 80, "time": 100.0})
    m.observe_heartbeat({"iteration": 12, "consumed_samples": 96, "time": 101.0})
    m.observe_state(State.PLANNING)  # a failure: training's pace is no longer current
    assert value(m, "ftmaster_step_seconds") is None and value(m, "ftmaster_samples_per_second") is None
    m.observe_state(State.RUNNING)
    m.observe_heartbeat({"iteration": 5, "consumed_samples": 40, "time": 200.0})
    assert value(m, "ftmaster_step_seconds") is None  # one beat of the new attempt: no pace yet
    m.observe_heartbeat({"iteration": 6, "consumed_samples": 48, "time": 200.5})
    assert value(m, "ftmaster_step_seconds") == 0.5


def test_a_gpu_whose_first_sample_was_unread_leaves_no_stale_series_nor_an_empty_name():
    """An unread first sample (no UUID, no name) started a series of 0.5 under empty labels,
    which stayed when the next sample's labels differed, after the GPU's retirement too; and
    the model's name stayed empty for good."""
    m = metrics()
    m.observe_samples([GpuSample(1.0, 0, None, failure_risk=0.5)], [])
    m._uuids[0] = "GPU-1"
    m.observe_samples([GpuSample(2.0, 0, "H100", temperature=40.0, failure_risk=0.1)], [])
    assert value(m, "ftmaster_gpu_failure_risk", gpu="0", UUID="", modelName="") is None
    assert value(m, "ftmaster_gpu_failure_risk", gpu="0", UUID="GPU-1", modelName="H100") == 0.1
    m.observe_samples([], [])  # retired: no series left at all
    assert not [sample for family in m.registry.collect() for sample in family.samples
                if sample.name == "ftmaster_gpu_failure_risk"]


def test_events_count_attempts_and_failures_and_time_rto_and_rpo():
    m = metrics()
    m.observe_heartbeat({"iteration": 10, "consumed_samples": 80, "time": 100.0})
    m.observe_heartbeat({"iteration": 12, "consumed_samples": 96, "time": 101.0})
    assert value(m, "ftmaster_step_seconds") == 0.5
    assert value(m, "ftmaster_samples_per_second") == 16.0
    assert value(m, "ftmaster_iteration") == 12
    for event in ({"event": "launch", "attempt": 1, "time": 90.0},
                  {"event": "failure", "cause": "exit", "iteration": 12, "time": 102.0},
                  {"event": "launch", "attempt": 2, "time": 104.0},
                  {"event": "checkpoint_loaded", "iteration": 8, "time": 108.0},
                  {"event": "resumed", "attempt": 2, "iteration": 9, "time": 110.0}):
        m.observe_event(event)
    assert value(m, "ftmaster_attempts_total") == 2 and value(m, "ftmaster_attempt") == 2
    assert value(m, "ftmaster_failures_total", cause="exit") == 1
    assert value(m, "ftmaster_rto_seconds_sum") == 8.0
    assert value(m, "ftmaster_rto_seconds_count") == 1
    assert value(m, "ftmaster_rpo_iterations_sum") == 4
    assert value(m, "ftmaster_rpo_seconds_sum") == 2.0  # 4 iterations at 0.5 s
    m.observe_event({"event": "resumed", "attempt": 2, "iteration": 20, "time": 130.0})
    assert value(m, "ftmaster_rto_seconds_count") == 1  # no failure to answer


def test_stragglers_named_and_drained_are_counted_per_gpu():
    """A drain relaunched the job (attempts_total rose, no failure counted) and the endpoint
    said nothing of the straggler the console, the events and the report all named."""
    m = metrics()
    for event in ({"event": "straggler", "gpu": 1, "slowdown": 1.9, "time": 10.0},
                  {"event": "straggler", "gpu": 2, "slowdown": 1.5, "time": 10.0},
                  {"event": "straggler_drained", "gpu": 1, "time": 12.0},
                  {"event": "straggler", "gpu": "3", "time": 13.0}):  # not a GPU: not counted
        m.observe_event(event)
    assert value(m, "ftmaster_stragglers_total", **gpu(1, "")) == 1
    assert value(m, "ftmaster_stragglers_total", **gpu(2, "")) == 1
    assert value(m, "ftmaster_straggler_drains_total", **gpu(1, "")) == 1
    assert value(m, "ftmaster_straggler_drains_total", **gpu(2, "")) is None
    assert value(m, "ftmaster_stragglers_total", **gpu(3, "")) is None


def test_a_relaunch_from_scratch_loses_every_iteration_and_an_earlier_load_is_not_its_own():
    m = metrics()
    for event in ({"event": "failure", "cause": "exit", "iteration": 12, "time": 102.0},
                  {"event": "checkpoint_loaded", "iteration": 10, "time": 108.0},
                  {"event": "resumed", "attempt": 2, "iteration": 11, "time": 110.0},
                  {"event": "failure", "cause": "exit", "iteration": 30, "time": 130.0},
                  {"event": "resumed", "attempt": 3, "iteration": 1, "time": 140.0}):
        m.observe_event(event)
    assert value(m, "ftmaster_rpo_iterations_count") == 2
    assert value(m, "ftmaster_rpo_iterations_sum") == 2 + 30  # from scratch: all 30 lost


def test_a_spare_nodes_failure_is_not_timed_to_its_next_rounds_resume():
    """Node 1 stood by after its peer failure (no ranks in the plan): the job resumed on the
    other nodes. Its next resume, a later round's, answers no failure of its own."""
    m = metrics()
    for event in ({"event": "failure", "cause": "peer", "iteration": 16, "time": 70.0},
                  {"event": "plan", "nodes": [0, 1, 2], "ranks_per_node": [2, 0, 2], "time": 72.0},
                  {"event": "plan", "nodes": [0, 1], "ranks_per_node": [2, 2], "time": 5000.0},
                  {"event": "launch", "attempt": 2, "time": 5001.0},
                  {"event": "checkpoint_loaded", "iteration": 400, "time": 5010.0},
                  {"event": "resumed", "attempt": 2, "iteration": 401, "time": 5012.0}):
        m.observe_event(event)
    assert value(m, "ftmaster_rto_seconds_count") is None  # never observed
    assert value(m, "ftmaster_rpo_iterations_count") is None


def test_checkpoint_age_per_tier_and_the_persist_lag(monkeypatch):
    m = metrics()
    monkeypatch.setattr("ftmaster.metrics.time.time", lambda: 1000.0)
    m.observe_event({"event": "periodic_save", "tier": "memory", "iteration": 10, "time": 900.0})
    m.observe_event({"event": "emergency_save", "tier": "memory", "iteration": 14, "time": 950.0})
    assert value(m, "ftmaster_checkpoint_age_seconds", tier="memory") == 50.0
    assert value(m, "ftmaster_persist_lag_iterations") == 14
    assert value(m, "ftmaster_persist_lag_seconds") == 100.0  # iteration 10, not on disk yet
    m.observe_event({"event": "persisted", "iteration": 10, "time": 990.0})
    assert value(m, "ftmaster_checkpoint_age_seconds", tier="disk") == 100.0  # taken at 900
    assert value(m, "ftmaster_persist_lag_iterations") == 4
    assert value(m, "ftmaster_persist_lag_seconds") == 50.0
    m.observe_event({"event": "persisted", "iteration": 14, "time": 995.0})
    assert value(m, "ftmaster_persist_lag_seconds") == 0.0
    assert value(m, "ftmaster_persist_lag_iterations") == 0


def test_a_node_that_does_not_persist_shows_no_persist_lag(monkeypatch):
    """Across nodes one node copies the memory tier to disk: the others never saw a copy
    land, and their lag grew for the whole run (an alert on it fired there all along)."""
    m = metrics()
    monkeypatch.setattr("ftmaster.metrics.time.time", lambda: 1000.0)
    m.observe_persisting(False)
    m.observe_event({"event": "periodic_save", "tier": "memory", "iteration": 10, "time": 900.0})
    assert value(m, "ftmaster_persist_lag_iterations") is None
    assert value(m, "ftmaster_persist_lag_seconds") is None
    assert value(m, "ftmaster_checkpoint_age_seconds", tier="memory") == 100.0
    m.observe_persisting(True)  # a new round put the trainer's rank 0 here
    assert value(m, "ftmaster_persist_lag_iterations") == 10
    assert value(m, "ftmaster_persist_lag_seconds") == 100.0


def test_a_checkpoints_age_counts_from_when_its_save_began(monkeypatch):
    """The trainer writes a save's event once it is durable: an async disk save that wrote for
    minutes read minutes younger than the state it holds."""
    m = metrics()
    monkeypatch.setattr("ftmaster.metrics.time.time", lambda: 1000.0)
    m.observe_event({"event": "periodic_save", "tier": "disk", "iteration": 10, "time": 990.0,
                     "started_at": 700.0})
    assert value(m, "ftmaster_checkpoint_age_seconds", tier="disk") == 300.0


def test_without_a_memory_checkpoint_the_persist_lag_is_absent_not_zero():
    """0 reads as persisted with no lag: a run without a memory tier has no lag to show."""
    m = metrics()
    assert value(m, "ftmaster_persist_lag_seconds") is None
    m.observe_event({"event": "periodic_save", "tier": "disk", "iteration": 10, "time": 900.0})
    m.observe_event({"event": "persisted", "iteration": 10, "time": 950.0})
    assert value(m, "ftmaster_persist_lag_seconds") is None
    assert value(m, "ftmaster_persist_lag_iterations") is None
    assert value(m, "ftmaster_checkpoint_age_seconds", tier="disk") is not None


def test_a_checkpoint_merged_from_replicas_is_the_memory_tiers_newest(monkeypatch):
    m = metrics()
    monkeypatch.setattr("ftmaster.metrics.time.time", lambda: 1000.0)
    m.observe_event({"event": "periodic_save", "tier": "disk", "iteration": 10, "time": 900.0})
    m.observe_event({"event": "replica_merge", "iteration": 16, "time": 990.0, "seconds": 2.0})
    assert value(m, "ftmaster_checkpoint_age_seconds", tier="memory") == 10.0


def test_the_state_is_an_enum():
    m = metrics()
    m.observe_state(State.RUNNING)
    assert value(m, "ftmaster_supervisor_state", ftmaster_supervisor_state="running") == 1
    assert value(m, "ftmaster_supervisor_state", ftmaster_supervisor_state="failed") == 0


def test_served_on_loopback_by_default_and_scraped():
    served, url = serve_metrics(0, "127.0.0.1", node_rank=1)
    served.observe_state(State.PLANNING)
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert 'ftmaster_supervisor_state{Hostname="' in text and 'node_rank="1"' in text


def test_ftmaster_monitor_names_a_free_port_in_a_metrics_event_as_launch_does(tmp_path):
    """With --metrics-port 0 a scraper set up from events.jsonl found the URL of a launch's
    metrics, but none of a standalone monitor's: it wrote the URL on the console alone."""
    out = CliRunner().invoke(main, ["monitor", "--backend", "sim", "--num-gpus", "1",
                                    "--run-dir", str(tmp_path), "--metrics-port", "0",
                                    "--duration", "0"])
    assert out.exit_code == 0, out.output
    said = [e for e in runfiles.read_events(tmp_path) if e["event"] == "metrics"]
    assert len(said) == 1 and f"metrics: serving {said[0]['url']}" in out.output


def test_an_ipv6_address_is_served_at_a_url_one_can_open():
    try:
        _, url = serve_metrics(0, "::1")
    except MetricsUnavailable:
        pytest.skip("no IPv6 loopback here")
    assert url.startswith("http://[::1]:")
    assert urllib.request.urlopen(url, timeout=5).status == 200


def test_a_port_in_use_is_one_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsUnavailable, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            serve_metrics(port, "127.0.0.1")
        out = CliRunner().invoke(main, ["monitor", "--backend", "sim", "--run-dir", str(tmp_path),
                                        "--metrics-port", str(port), "--duration", "0"])
        assert out.exit_code != 0 and "cannot serve metrics" in out.output
        assert len(out.output.strip().splitlines()) == 1


@needs_ipv6
def test_a_port_in_use_at_an_ipv6_address_is_named_with_brackets():
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsUnavailable, match=rf"cannot serve metrics on \[::1\]:{port} "):
            serve_metrics(port, "::1")


def test_watching_a_monitor_labels_each_gpu_with_the_uuid_its_backend_knows():
    backend = make_backend("sim", num_gpus=2, seed=0)
    backend.uuids = lambda: {0: "GPU-aaaa", 1: "GPU-bbbb"}  # as the NVML backend's
    monitor = Monitor(backend, None)
    m = metrics()
    m.watch(monitor)
    monitor.step()
    monitor.close()
    names = {sample.labels["gpu"]: sample.labels["UUID"] for family in m.registry.collect()
             for sample in family.samples if sample.name == "ftmaster_gpu_failure_risk"}
    assert names == {"0": "GPU-aaaa", "1": "GPU-bbbb"}


def test_a_resume_from_an_older_checkpoint_forgets_the_discarded_ones(monkeypatch):
    """A node took the memory tier's 20-40 with it and the job resumed from disk's 10: those
    are set aside, so they neither wait for a persist nor stay the tier's newest save."""
    m = metrics()
    monkeypatch.setattr("ftmaster.metrics.time.time", lambda: 100.0)
    for event in ({"event": "periodic_save", "tier": "memory", "iteration": 10, "time": 10.0},
                  {"event": "periodic_save", "tier": "memory", "iteration": 20, "time": 20.0},
                  {"event": "persisted", "iteration": 10, "time": 25.0},
                  {"event": "periodic_save", "tier": "memory", "iteration": 30, "time": 30.0},
                  {"event": "periodic_save", "tier": "memory", "iteration": 40, "time": 40.0},
                  {"event": "failure", "cause": "peer", "iteration": 42, "time": 45.0},
                  {"event": "checkpoint_loaded", "tier": "disk", "iteration": 10, "time": 50.0},
                  {"event": "periodic_save", "tier": "memory", "iteration": 20, "time": 90.0}):
        m.observe_event(event)
    assert value(m, "ftmaster_checkpoint_age_seconds", tier="memory") == 10.0
    assert value(m, "ftmaster_persist_lag_seconds") == 10.0
    assert value(m, "ftmaster_persist_lag_iterations") == 10


def test_an_xid_stays_on_its_gpu_until_another_comes_as_dcgm_exporter_keeps_it():
    """A sample carries an XID only in the interval it came; a scrape after the next sample
    (Prometheus every 15 s, the monitor every 10 s) missed it altogether."""
    m = metrics()
    m.observe_samples([GpuSample(1.0, 0, "H100", failure_risk=0.0)], [])
    assert value(m, "DCGM_FI_DEV_XID_ERRORS", **gpu(0)) is None  # none seen yet
    m.observe_samples([GpuSample(2.0, 0, "H100", xid=48, failure_risk=1.0)], [])
    m.observe_samples([GpuSample(3.0, 0, "H100", failure_risk=0.99)], [])
    assert value(m, "DCGM_FI_DEV_XID_ERRORS", **gpu(0)) == 48
    m.observe_samples([GpuSample(4.0, 0, "H100", xid=13, failure_risk=0.5)], [])
    m.observe_samples([GpuSample(5.0, 1, "H100", failure_risk=0.0)], [])  # GPU 0 lost
    assert value(m, "DCGM_FI_DEV_XID_ERRORS", **gpu(0)) is None


def test_after_a_resume_from_an_older_checkpoint_its_age_is_that_checkpoints(monkeypatch):
    """Iteration 20 failed its checksums and the relaunch loaded 10: until the next save the
    disk tier's newest is 10, taken at 100, not the set-aside 20's time (a younger age)."""
    m = metrics()
    monkeypatch.setattr("ftmaster.metrics.time.time", lambda: 1000.0)
    for event in ({"event": "periodic_save", "tier": "disk", "iteration": 10, "time": 100.0},
                  {"event": "periodic_save", "tier": "disk", "iteration": 20, "time": 900.0},
                  {"event": "failure", "cause": "device_lost", "iteration": 25, "time": 950.0},
                  {"event": "checkpoint_loaded", "iteration": 10, "time": 990.0}):
        m.observe_event(event)
    assert value(m, "ftmaster_checkpoint_age_seconds", tier="disk") == 900.0


def test_the_save_times_kept_for_a_resume_stay_few_in_a_long_run(monkeypatch):
    """Every save's time was kept for the life of the run (a save every few minutes for
    weeks); the newest few date a resume, an older one the newest save's time."""
    from ftmaster.metrics import KEPT_SAVE_TIMES

    m = metrics()
    monkeypatch.setattr("ftmaster.metrics.time.time", lambda: 1e6)
    for n in range(1, 3 * KEPT_SAVE_TIMES):
        m.observe_event({"event": "periodic_save", "tier": "disk", "iteration": 10 * n,
                         "time": float(n)})
    assert len(m._taken["disk"]) == KEPT_SAVE_TIMES
    kept = 10 * (3 * KEPT_SAVE_TIMES - 5)
    m.observe_event({"event": "checkpoint_loaded", "iteration": kept, "time": 1e6})
    assert value(m, "ftmaster_checkpoint_age_seconds", tier="disk") == 1e6 - kept / 10


def test_a_metrics_address_whose_lookup_hangs_is_one_line(monkeypatch):
    """A --metrics-addr name went to prometheus_client's getaddrinfo with no time limit: an
    unreachable DNS server stalled the launch with no word."""
    import threading
    import time

    import ftmaster.addresses

    answer, real = threading.Event(), socket.getaddrinfo

    def hangs(*args, **kwargs):
        answer.wait(3)
        return real(*args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hangs)
    monkeypatch.setattr(ftmaster.addresses, "RESOLVE_TIMEOUT_S", 0.2)
    started = time.monotonic()
    with pytest.raises(MetricsUnavailable, match="looking up localhost did not finish within 0.2 s"):
        serve_metrics(0, "localhost")
    assert time.monotonic() - started < 2
    answer.set()


def test_a_silent_connection_is_closed_and_scrapes_go_on(monkeypatch):
    """prometheus_client's server kept a thread and a descriptor for every connection that
    sent nothing (a port scan), for good: with the descriptors gone, the heartbeat's reads
    failed and a healthy attempt looked hung."""
    import threading
    import time

    from ftmaster import metrics as metrics_module

    monkeypatch.setattr(metrics_module._Handler, "timeout", 0.2)
    served, url = serve_metrics(0, "127.0.0.1", node_rank=1)
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    before = threading.active_count()
    idle = [socket.create_connection((host, int(port))) for _ in range(5)]
    time.sleep(1.0)
    assert threading.active_count() <= before + 1  # their handlers ended
    assert all(s.recv(1) == b"" for s in idle)  # closed by the server
    with urllib.request.urlopen(url, timeout=5) as response:
        assert b"ftmaster_" in response.read()
