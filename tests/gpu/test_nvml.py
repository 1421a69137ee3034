"""The monitor against a real driver: a healthy GPU reads as healthy (every field the backend
claims is read, no XID, no hard reason), NVML and nvidia-smi agree on the GPUs and their
UUIDs, and the launcher's probe names the GPUs CUDA uses. Timings are the benchmark's
(``benchmarks/nvml_vs_smi.py``, which ``scripts/gpu_check.sh`` runs), never assertions."""

import socket
import subprocess
import time

import pytest

from ftmaster.metrics import Metrics
from ftmaster.monitor.backends.nvml import NvmlBackend, probe_gpus
from ftmaster.monitor.backends.smi import SmiBackend
from ftmaster.monitor.daemon import Monitor
from helpers.gpu import needs_driver

pytestmark = [pytest.mark.gpu, needs_driver()]

# Fields a data-centre GPU answers; consumer boards may not report ECC or row remapping.
ALWAYS_READ = ("gpu_name", "driver_version", "temperature", "power_draw", "gpu_utilization",
               "memory_used", "memory_total", "sm_clock")


def smi(*query: str) -> list[list[str]]:
    output = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(query)}",
                             "--format=csv,noheader,nounits"], capture_output=True, text=True,
                            check=True, timeout=60).stdout
    return [[cell.strip() for cell in line.split(",")] for line in output.strip().splitlines()]


def test_a_healthy_gpu_reads_healthy_with_xid_events_registered():
    backend = NvmlBackend()
    monitor = Monitor(backend, None)
    try:
        for _ in range(3):
            monitor.step()
            time.sleep(0.5)
        samples = backend.sample()
        assert "xid" in backend.reported_fields, "XID events could not be registered on any GPU"
        assert backend.unreported_fields == {}, \
            f"XID events could not be registered on GPUs {sorted(backend.unreported_fields)}"
    finally:
        monitor.close()
    assert len(samples) == len(smi("index"))
    for sample in samples:
        unread = [f for f in ALWAYS_READ if getattr(sample, f) is None]
        assert not unread, f"GPU {sample.gpu_id}: {unread} unknown"
        assert sample.xid is None, f"GPU {sample.gpu_id}: XID {sample.xid}"
        assert sample.recovery_action in (None, 0), sample
    assert monitor.unschedulable_gpus() == {}
    assert monitor.lost_gpus() == frozenset()
    assert backend.conditions == {} or not any(backend.conditions.values())


def test_the_probe_names_every_gpu_by_the_uuid_nvidia_smi_shows():
    identities = probe_gpus()
    expected = {int(index): uuid for index, uuid in smi("index", "uuid")}
    assert {g.index: g.uuid for g in identities} == expected
    assert all(g.problem is None for g in identities), identities


def test_nvml_and_smi_agree_on_memory_total():
    nvml, smi_backend = NvmlBackend(), SmiBackend()
    try:
        by_nvml = {s.gpu_id: s.memory_total for s in nvml.sample()}
        by_smi = {s.gpu_id: s.memory_total for s in smi_backend.sample()}
    finally:
        nvml.close()
        smi_backend.close()
    assert by_nvml.keys() == by_smi.keys()
    for gpu, total in by_nvml.items():
        assert abs(total - by_smi[gpu]) <= 1, gpu  # MiB, rounding


def test_the_metrics_carry_each_gpus_uuid_as_nvidia_smi_shows_it():
    """DCGM exporter's UUID label, from the NVML backend, on a real scrape."""
    metrics = Metrics()
    backend = NvmlBackend()
    monitor = Monitor(backend, None)
    metrics.watch(monitor)
    try:
        monitor.step()
    finally:
        monitor.close()
    expected = {index: uuid for index, uuid in smi("index", "uuid")}
    for index, uuid in expected.items():
        temperature = metrics.registry.get_sample_value(
            "DCGM_FI_DEV_GPU_TEMP", {"gpu": index, "UUID": uuid, "modelName": smi("name")[int(index)][0],
                                     "Hostname": socket.gethostname(), "node_rank": ""})
        assert temperature is not None and temperature > 0, (index, uuid)
