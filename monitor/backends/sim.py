"""Simulated GPUs: a small seeded physical model shared with the trace generator.

Each virtual GPU draws power in proportion to its load, heats towards a temperature set by
that power (first-order lag, about 90 s) plus a slow random wander, reports integer
temperatures like NVML does, sometimes sits at the software power cap, and may collect
benign single-bit ECC errors. Anomalies (thermal runaway, ECC bursts, ...) are not part of
the healthy model: the monitor lays them over the samples (:mod:`ftmaster.monitor.anomalies`),
which is how ``--inject`` reaches this backend.

Each GPU is read through the same per-GPU bounded machinery as NVML
(:mod:`ftmaster.monitor.backends.bounded`): ``--inject wedge`` makes a simulated GPU's read
block until a ``recover``, and the monitor sees exactly what a wedged driver shows it (the
GPU unknown, then lost as ``wedged``, the others sampled throughout). The physics is stepped
for every GPU on the sampling thread, so a seed gives the same telemetry whatever is read.

To drop GPUs from the virtual set after a relaunch, build a new ``SimBackend`` with
``gpu_ids`` listing the ones left, or select the GPUs to read (``select_gpus``, which
:class:`ftmaster.monitor.daemon.Monitor` calls).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ftmaster.monitor.backends.bounded import PerGpuBackend, PerGpuReads, ReadBounds, Reading
from ftmaster.monitor.sample import GpuSample

AMBIENT_C = 28.0
THERMAL_TAU_S = 90.0
WANDER_TAU_S = 600.0
IDLE_POWER_W = 70.0
IDLE_THROTTLE = 0x1
SW_POWER_CAP = 0x4


@dataclass(frozen=True)
class GpuTraits:
    """How one virtual GPU differs from a textbook one."""

    temp_offset_c: float = 0.0  # a hot-but-steady GPU runs this much warmer, always
    temp_noise_c: float = 0.6  # per-sample sensor noise (before rounding to whole degrees)
    wander_c: float = 0.8  # standard deviation of the slow temperature wander
    power_noise_frac: float = 0.03  # per-sample power noise, as a fraction of the draw
    power_cap_prob: float = 0.05  # chance a loaded sample shows the (benign) SW power-cap bit
    benign_sbe_per_hour: float = 0.0  # sporadic corrected errors on a healthy GPU
    thermal_tau_s: float = THERMAL_TAU_S  # how fast it heats and cools (heatsink, airflow)


@dataclass
class _GpuState:
    temperature: float
    wander: float = 0.0
    ecc_sbe: int = 0
    memory_used: float = 450.0


class Fleet:
    """N virtual GPUs under loads the caller chooses each step."""

    def __init__(self, gpu_ids: Sequence[int], seed: int, traits: Mapping[int, GpuTraits] | None = None,
                 gpu_name: str = "NVIDIA H100 80GB HBM3", driver_version: str = "570.124.06",
                 power_limit_w: float = 700.0, memory_total_mib: float = 81559.0) -> None:
        self.rng = random.Random(seed)
        self.traits = {g: (traits or {}).get(g, GpuTraits()) for g in gpu_ids}
        self.gpu_name, self.driver_version = gpu_name, driver_version
        self.power_limit_w, self.memory_total_mib = power_limit_w, memory_total_mib
        self.states = {g: _GpuState(temperature=AMBIENT_C + 6.0 + self.traits[g].temp_offset_c / 3)
                       for g in gpu_ids}

    def step(self, now: float, dt: float, loads: Mapping[int, float]) -> list[GpuSample]:
        """Advance every GPU named in ``loads`` by ``dt`` seconds and read it at ``now``."""
        return [self._step_gpu(gpu, now, dt, load) for gpu, load in loads.items()]

    def _step_gpu(self, gpu: int, now: float, dt: float, load: float) -> GpuSample:
        rng, traits, state = self.rng, self.traits[gpu], self.states[gpu]
        power = IDLE_POWER_W + (0.85 * self.power_limit_w - IDLE_POWER_W) * load
        measured_power = min(self.power_limit_w * 1.02, power * (1.0 + rng.gauss(0.0, traits.power_noise_frac)))
        # Ornstein-Uhlenbeck wander: slow drifts of a degree or two, as real cooling shows.
        keep = math.exp(-dt / WANDER_TAU_S)
        state.wander = state.wander * keep + rng.gauss(0.0, traits.wander_c * math.sqrt(1 - keep * keep))
        target = AMBIENT_C + 0.075 * power + traits.temp_offset_c + state.wander
        state.temperature += (target - state.temperature) * (1.0 - math.exp(-dt / traits.thermal_tau_s))
        if load > 0.05:
            state.memory_used = 0.8 * self.memory_total_mib
        if traits.benign_sbe_per_hour and rng.random() < traits.benign_sbe_per_hour * dt / 3600.0:
            state.ecc_sbe += 1
        utilization = float(min(100, max(0, round(load * 100.0 + rng.gauss(0.0, 1.5)))))
        loaded = load > 0.05
        return GpuSample(
            timestamp=now, gpu_id=gpu, gpu_name=self.gpu_name, driver_version=self.driver_version,
            temperature=float(round(state.temperature + rng.gauss(0.0, traits.temp_noise_c))),
            power_draw=round(measured_power, 2),
            gpu_utilization=utilization,
            memory_utilization=float(round(utilization * 0.45)),
            memory_used=state.memory_used, memory_total=self.memory_total_mib,
            errors=0, ecc_sbe=state.ecc_sbe, ecc_dbe=0, xid=None,
            throttle_reasons=(SW_POWER_CAP if rng.random() < traits.power_cap_prob else 0) if loaded
            else IDLE_THROTTLE,
            power_limit=self.power_limit_w,
            sm_clock=float(round(1980 - abs(rng.gauss(0.0, 25.0)))) if loaded else 345.0,
            pcie_replay=0, retired_pages_pending=0, recovery_action=0,
        )


class SimBackend(PerGpuBackend):
    """Virtual GPUs that warm up over ``warmup_s`` and then train at a steady load."""

    name = "sim"

    def __init__(self, num_gpus: int = 8, seed: int = 0, gpu_ids: Sequence[int] | None = None,
                 clock: Callable[[], float] = time.time, warmup_s: float = 60.0,
                 traits: Mapping[int, GpuTraits] | None = None, bounds: ReadBounds | None = None) -> None:
        ids = list(range(num_gpus)) if gpu_ids is None else list(gpu_ids)
        if not ids:
            raise ValueError("the sim backend needs at least one GPU")
        self.fleet = Fleet(ids, seed, traits)
        self.clock = clock
        self.warmup_s = warmup_s
        self._reads = PerGpuReads(ids, bounds or ReadBounds(), "sim")
        self._start: float | None = None
        self._last: float | None = None

    def close(self) -> None:
        self._reads.close()

    def sample(self) -> list[GpuSample]:
        now = self.clock()
        if self._start is None:
            self._start = now
        dt = 1.0 if self._last is None else max(1e-3, now - self._last)
        self._last = now
        # Clamped at 0 too: a wall clock stepped back past the start (NTP) made the load, and
        # with it the power draw, negative.
        ramp = 1.0 if self.warmup_s <= 0 else min(1.0, max(0.0, (now - self._start) / self.warmup_s))
        load = 0.1 + 0.86 * ramp
        stepped = {s.gpu_id: s for s in self.fleet.step(now, dt, {gpu: load for gpu in self.fleet.states})}

        def read_one(gpu: int, reading: Reading) -> None:
            reading.calling = "the simulated driver"
            reading.sample = stepped[gpu]

        return self._reads.read(read_one, now)
