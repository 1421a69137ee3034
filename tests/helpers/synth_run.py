"""A run directory for ``ftmaster analyze`` tests, its benchmark and the README plot, made with
the monitor's trace generator (:mod:`ftmaster.monitor.tracegen`).

tracegen writes the telemetry of GPUs that fail; this adds what the rest of ftmaster would
have written beside it:

* ``failure_risk`` and ``risk_alert`` events: the trace is replayed through the monitor, as
  ``ftmaster monitor --backend replay:`` does. Each alert event is dated at its sample's time,
  as live (a replay writes events at the time it runs);
* around each labelled failure, the trainer's and launcher's events: an emergency save after
  the first alert, the failure, a plan, the relaunch and its first iteration;
* :func:`repeat_csv`: a long trace as copies of a short one, because tracegen draws samples
  one by one (thousands per second), too slow for a week of them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pandas as pd

from ftmaster import runfiles
from ftmaster.monitor import tracegen
from ftmaster.monitor.anomalies import DoubleBitError, EccBurst, Xid
from ftmaster.monitor.backends.replay import ReplayBackend
from ftmaster.monitor.backends.sim import GpuTraits
from ftmaster.monitor.daemon import Monitor, MonitorConfig
from ftmaster.monitor.scorers import make_scorer

PRECURSOR_S = 900.0  # ECC errors grow for 15 minutes before the GPU is lost
ITERATION_S = 2.0  # the pretend training's seconds per iteration, for event iterations


def failing_spec(gpus: int = 8, hours: float = 3.0, interval_s: float = 1.0, failing_gpu: int = 3,
                 fail_frac: float = 0.6, seed: int = 0) -> tracegen.TraceSpec:
    """tracegen's trace for ``seed``, resized, with one GPU lost after an ECC burst."""
    duration = hours * 3600
    fail_at = round(fail_frac * duration / interval_s) * interval_s
    failure = tracegen.FailurePlan(failing_gpu, fail_at, "ecc_degradation", PRECURSOR_S,
                                   (EccBurst(doubling_s=PRECURSOR_S / 8),),
                                   (DoubleBitError(), Xid(code=48)))
    return replace(tracegen.random_spec(seed), num_gpus=gpus, interval_s=interval_s,
                   duration_s=duration, traits=(GpuTraits(),) * gpus, failures=(failure,))


def write_run_dir(run_dir: Path, spec: tracegen.TraceSpec) -> Path:
    """``gpu_metrics.csv`` and ``events.jsonl`` for ``spec`` in ``run_dir``; returns the CSV."""
    run_dir = Path(run_dir)
    trace, labels_path = tracegen.write_trace(spec, run_dir / "trace")
    monitor = Monitor(ReplayBackend(trace), run_dir, scorer=make_scorer("adaptive"),
                      config=MonitorConfig(interval_s=0.0))
    monitor.run_to_end()
    monitor.close()
    alerts = [{**e, "time": datetime.fromisoformat(e["timestamp"]).timestamp()}
              for e in runfiles.read_events(run_dir) if e["event"] == "risk_alert"]
    events = alerts + launcher_events(json.loads(labels_path.read_text()), alerts)
    runfiles.events_path(run_dir).write_text(
        "".join(json.dumps(e) + "\n" for e in sorted(events, key=lambda e: e["time"])))
    return runfiles.metrics_csv_path(run_dir)


def _launch(time: float, attempt: int, gpus: list[int]) -> dict:
    return {"event": "launch", "time": time, "attempt": attempt, "gpus": gpus,
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "data_parallel_size": len(gpus), "command": ["pretrain_gpt.py"]}


def launcher_events(labels: dict, alerts: list[dict]) -> list[dict]:
    """DESIGN's events for a job on every GPU that relaunches after each labelled failure."""
    start, gpus = labels["start_time"], list(range(labels["num_gpus"]))
    events = [_launch(start, 1, gpus)]
    for attempt, failure in enumerate(sorted(labels["failures"], key=lambda f: f["failure_time"]), 2):
        gpu, lost_at = failure["gpu"], failure["failure_time"]
        iteration = int((lost_at - start) / ITERATION_S)
        saved = iteration
        warned = [a["time"] for a in alerts if a["gpu"] == gpu and a["time"] < lost_at
                  and "device_lost" not in a["reasons"]]
        if warned:
            saved = int((min(warned) - start) / ITERATION_S) + 1
            events.append({"event": "emergency_save", "time": start + (saved + 4) * ITERATION_S,
                           "iteration": saved, "seconds": 8.5, "bytes": 1 << 30, "kind": "emergency"})
        gpus = [g for g in gpus if g != gpu]
        events += [
            {"event": "failure", "time": lost_at + 5, "attempt": attempt - 1, "iteration": iteration,
             "cause": "device_lost", "gpus": [gpu], "exit_codes": {}},
            {"event": "plan", "time": lost_at + 8, "gpus_available": gpus, "num_gpus_used": len(gpus),
             "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
             "data_parallel_size": len(gpus), "micro_batch_size": 1, "global_batch_size": 96},
            _launch(lost_at + 10, attempt, gpus),
            {"event": "resumed", "time": lost_at + 70, "attempt": attempt, "iteration": saved + 1},
        ]
    return events


def repeat_csv(csv_path: Path, copies: int) -> None:
    """Replace ``csv_path`` with ``copies`` back-to-back copies of its samples."""
    frame = pd.read_csv(csv_path, dtype={"timestamp": str}, keep_default_na=False)
    stamps = pd.to_datetime(frame["timestamp"], format="ISO8601", utc=True)
    span = stamps.max() - stamps.min() + (stamps.diff()[stamps.diff() > pd.Timedelta(0)].min())
    with csv_path.open("w") as handle:
        for copy in range(copies):
            shifted = (stamps + copy * span).dt.strftime("%Y-%m-%dT%H:%M:%S.%f").str[:-3] + "+00:00"
            frame.assign(timestamp=shifted).to_csv(handle, index=False, header=copy == 0)
