"""A synthetic run directory for ``ftmaster analyze`` tests and benchmarks.

Writes ``gpu_metrics.csv`` (every schema column, vectorised with numpy so a week of 1 s
samples is quick) and ``events.jsonl`` with one degrade-then-fail story: GPU ``failing_gpu``
heats up and its risk climbs over the last ten minutes before it is lost at ``fail_frac`` of
the trace; the monitor alerts, an emergency save runs, the job fails, is re-planned and
relaunched on the others, and the lost GPU has no samples after that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ftmaster.monitor.schema import CSV_COLUMNS

START = 1_767_225_600.0  # 2026-01-01T00:00:00Z


@dataclass(frozen=True)
class SynthRun:
    """What to generate."""

    gpus: int = 8
    """GPUs sampled."""
    hours: float = 3.0
    """Length of the trace."""
    interval_s: float = 1.0
    """Seconds between samples."""
    failing_gpu: int = 3
    """The GPU that degrades and is lost (ignored when it is not below ``gpus``)."""
    fail_frac: float = 0.6
    """Where in the trace it is lost, as a fraction of the length."""
    seed: int = 0
    """Random seed for the noise."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.hours <= 0 or self.interval_s <= 0:
            raise ValueError("gpus, hours and interval_s must be positive")
        if not 0 < self.fail_frac < 1:
            raise ValueError("fail_frac must be between 0 and 1")

    @property
    def fail_time(self) -> float:
        return START + self.fail_frac * self.hours * 3600


def _frame(run: SynthRun) -> pd.DataFrame:
    rng = np.random.default_rng(run.seed)
    times = START + np.arange(0, run.hours * 3600, run.interval_s)
    gpu = np.tile(np.arange(run.gpus), times.size)
    t = np.repeat(times, run.gpus)
    n = t.size
    ramp = np.where(gpu == run.failing_gpu,
                    np.clip(1 - (run.fail_time - t) / 600, 0, 1), 0.0)  # 10 minutes
    dip = ((t - START) % 1800 < 20)  # utilisation dips during the half-hourly saves
    frame = pd.DataFrame({
        "timestamp": pd.to_datetime(t, unit="s", utc=True).strftime("%Y-%m-%dT%H:%M:%S.%f")
        .str[:-3] + "+00:00",
        "gpu_id": gpu, "gpu_name": "NVIDIA H100 80GB HBM3", "driver_version": "570.86.15",
        "temperature": np.round(62 + gpu * 0.8 + rng.normal(0, 1.5, n) + 25 * ramp, 1),
        "power_draw": np.round(610 + rng.normal(0, 25, n) - 400 * dip + 60 * ramp, 1),
        "gpu_utilization": np.clip(np.round(97 + rng.normal(0, 2, n) - 80 * dip), 0, 100),
        "memory_utilization": np.clip(np.round(45 + rng.normal(0, 5, n)), 0, 100),
        "memory_used": np.round(70_000 + gpu * 500 + rng.normal(0, 300, n)),
        "memory_total": 81_559.0,
        "errors": np.where(ramp > 0.9, 1, 0),
        "ecc_sbe": np.floor(ramp * 40), "ecc_dbe": np.where(ramp > 0.95, 1, 0),
        "xid": np.where(ramp > 0.98, "79", ""), "throttle_reasons": 0, "power_limit": 700.0,
        "sm_clock": np.round(1980 - 300 * ramp + rng.normal(0, 10, n)), "pcie_replay": 0,
        "retired_pages_pending": 0, "recovery_action": 0,
        "failure_risk": np.round(np.clip(0.05 + rng.normal(0, 0.02, n) + 0.95 * ramp, 0, 1), 3),
    })
    lost = (gpu == run.failing_gpu) & (t > run.fail_time)
    return frame.loc[~lost, list(CSV_COLUMNS)]


def _events(run: SynthRun) -> list[dict]:
    fail, gpus = run.fail_time, list(range(run.gpus))
    left = [g for g in gpus if g != run.failing_gpu]
    layout = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    return [
        {"event": "launch", "time": START, "attempt": 0, "gpus": gpus,
         "data_parallel_size": len(gpus), "command": ["pretrain_gpt.py"], **layout},
        {"event": "risk_alert", "time": fail - 120, "gpu": run.failing_gpu, "score": 0.96,
         "reasons": ["temperature"], "timestamp": fail - 120},
        {"event": "emergency_save", "time": fail - 100, "iteration": 500, "seconds": 8.5,
         "bytes": 1 << 30},
        {"event": "failure", "time": fail + 5, "attempt": 0, "iteration": 520,
         "cause": "device_lost", "gpus": [run.failing_gpu], "exit_codes": [1]},
        {"event": "plan", "time": fail + 8, "gpus_available": len(left), "num_gpus_used": 4,
         "data_parallel_size": 4, "micro_batch_size": 1, "global_batch_size": 32, **layout},
        {"event": "launch", "time": fail + 10, "attempt": 1, "gpus": left,
         "data_parallel_size": 4, "command": ["pretrain_gpt.py"], **layout},
        {"event": "resumed", "time": fail + 70, "attempt": 1, "iteration": 501},
    ]


def write_run_dir(run_dir: Path, run: SynthRun = SynthRun()) -> Path:
    """Write the CSV and events into ``run_dir``; returns the CSV's path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    csv_path = run_dir / "gpu_metrics.csv"
    _frame(run).to_csv(csv_path, index=False)
    lines = [json.dumps(e) + "\n" for e in _events(run)]
    (run_dir / "events.jsonl").write_text("".join(lines))
    return csv_path
