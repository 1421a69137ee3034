"""Run directories for tests of ``ftmaster analyze`` and ``ftmaster report``, the analyze
benchmark and the README plot.

Generated, with the monitor's trace generator (:mod:`ftmaster.monitor.tracegen`):

tracegen writes the telemetry of GPUs that fail; this adds what the rest of ftmaster would
have written beside it:

* ``failure_risk`` and ``risk_alert`` events: the trace is replayed through the monitor, as
  ``ftmaster monitor --backend replay:`` does. Each alert event is dated at its sample's time,
  as live (a replay writes events at the time it runs);
* around each labelled failure, the trainer's and launcher's events: an emergency save after
  the first alert, the failure, a plan, the relaunch and its first iteration;
* :func:`repeat_csv`: a long trace as copies of a short one, because tracegen draws samples
  one by one (thousands per second), too slow for a week of them;
* :func:`write_nodes_run_dir`: a multi-node run, one ``node_<R>`` folder per trace, where every
  node records the other nodes' GPU losses as ``peer`` failures and relaunches with them.

Written by hand, for the report: :func:`write_run` with events from :func:`event` and its
shorthands, and logs from :func:`iteration_line` and :func:`loaded_line`, all as DESIGN's
events and log contract has them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timezone
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


def failing_spec(gpus: int = 8, hours: float = 3.0, interval_s: float = 1.0,
                 failing_gpu: int | None = 3, fail_frac: float = 0.6,
                 seed: int = 0) -> tracegen.TraceSpec:
    """tracegen's trace for ``seed``, resized, with one GPU lost after an ECC burst (none when
    ``failing_gpu`` is None)."""
    duration = hours * 3600
    fail_at = round(fail_frac * duration / interval_s) * interval_s
    failures = () if failing_gpu is None else (
        tracegen.FailurePlan(failing_gpu, fail_at, "ecc_degradation", PRECURSOR_S,
                             (EccBurst(doubling_s=PRECURSOR_S / 8),),
                             (DoubleBitError(), Xid(code=48))),)
    return replace(tracegen.random_spec(seed), num_gpus=gpus, interval_s=interval_s,
                   duration_s=duration, traits=(GpuTraits(),) * gpus, failures=failures)


def write_run_dir(run_dir: Path, spec: tracegen.TraceSpec,
                  peer_failures: tuple[float, ...] = ()) -> Path:
    """``gpu_metrics.csv`` and ``events.jsonl`` for ``spec`` in ``run_dir``; returns the CSV.
    ``peer_failures``: see :func:`launcher_events`."""
    run_dir = Path(run_dir)
    trace, labels_path = tracegen.write_trace(spec, run_dir / "trace")
    monitor = Monitor(ReplayBackend(trace), run_dir, scorer=make_scorer("adaptive"),
                      config=MonitorConfig(interval_s=0.0))
    monitor.run_to_end()
    monitor.close()
    alerts = [{**e, "time": datetime.fromisoformat(e["timestamp"]).timestamp()}
              for e in runfiles.read_events(run_dir) if e["event"] == "risk_alert"]
    events = alerts + launcher_events(json.loads(labels_path.read_text()), alerts, peer_failures)
    runfiles.events_path(run_dir).write_text(
        "".join(json.dumps(e) + "\n" for e in sorted(events, key=lambda e: e["time"])))
    return runfiles.metrics_csv_path(run_dir)


def _launch(time: float, attempt: int, gpus: list[int]) -> dict:
    return {"event": "launch", "time": time, "attempt": attempt, "gpus": gpus,
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "data_parallel_size": len(gpus), "command": ["pretrain_gpt.py"]}


def launcher_events(labels: dict, alerts: list[dict],
                    peer_failures: tuple[float, ...] = ()) -> list[dict]:
    """DESIGN's events for a job on every GPU that relaunches after each labelled failure, and
    after each of ``peer_failures`` (when another node lost a GPU), which this node records
    as a ``peer`` failure a second after that node's own."""
    start, gpus = labels["start_time"], list(range(labels["num_gpus"]))
    events = [_launch(start, 1, gpus)]
    own = [(f["failure_time"], f["gpu"]) for f in labels["failures"]]
    peers = [(lost_at, None) for lost_at in peer_failures]
    for attempt, (lost_at, gpu) in enumerate(sorted(own + peers, key=lambda f: f[0]), 2):
        iteration = int((lost_at - start) / ITERATION_S)
        saved = iteration
        warned = [a["time"] for a in alerts if a["gpu"] == gpu and a["time"] < lost_at
                  and "device_lost" not in a["reasons"]]
        if warned:
            saved = int((min(warned) - start) / ITERATION_S) + 1
            events.append({"event": "emergency_save", "time": start + (saved + 4) * ITERATION_S,
                           "iteration": saved, "seconds": 8.5, "bytes": 1 << 30, "kind": "emergency"})
        delay, cause, failed = (6, "peer", gpus) if gpu is None else (5, "device_lost", [gpu])
        gpus = [g for g in gpus if g != gpu]
        events += [
            {"event": "failure", "time": lost_at + delay, "attempt": attempt - 1,
             "iteration": iteration, "cause": cause, "gpus": failed, "exit_codes": {}},
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


def write_nodes_run_dir(run_dir: Path, specs: list[tracegen.TraceSpec]) -> list[Path]:
    """A multi-node run: ``run_dir/node_<R>`` holds ``specs[R]`` as :func:`write_run_dir`
    writes it, and records every other node's GPU losses as ``peer`` failures (all traces
    start at tracegen's same start time). Returns the node folders."""
    losses = [[tracegen.START_TIME + f.time_s for f in spec.failures] for spec in specs]
    folders = [Path(run_dir) / f"node_{node}" for node in range(len(specs))]
    for node, (folder, spec) in enumerate(zip(folders, specs)):
        peers = tuple(t for other, times in enumerate(losses) if other != node for t in times)
        write_run_dir(folder, spec, peers)
    return folders


# ---- hand-written runs, for the report ---------------------------------------------------------

T0 = 1_780_000_000.0
LAYOUT = {"micro_batch_size": 2, "global_batch_size": 12}


def iteration_line(n: int, total: int, ms: float) -> str:
    return (f"iteration {n}/{total} | consumed samples: {12 * n} | elapsed time per iteration "
            f"(ms): {ms:.1f} | learning rate: 1.000000E-03 | global batch size: 12 | "
            f"lm loss: 2.500000E+00 |")


def loaded_line(iteration: int, seconds: float, size: int) -> str:
    return (f"loaded checkpoint from /ckpt/iter_{iteration:07d} at iteration {iteration} in "
            f"{seconds:.3f} s ({size} bytes); layout {{}} -> {{}}")


def event(name: str, at: float, **fields) -> dict:
    """An event ``at`` seconds after :data:`T0`."""
    return {"event": name, "time": T0 + at, **fields}


def launch(at: float, attempt: int, gpus: list[int], tp: int, pp: int, dp: int) -> dict:
    return event("launch", at, attempt=attempt, gpus=gpus, tensor_model_parallel_size=tp,
                 pipeline_model_parallel_size=pp, data_parallel_size=dp,
                 command=["python", "pretrain_gpt.py"])


def plan(at: float, available: list[int], tp: int, pp: int, dp: int) -> dict:
    return event("plan", at, gpus_available=available, tensor_model_parallel_size=tp,
                 pipeline_model_parallel_size=pp, data_parallel_size=dp,
                 num_gpus_used=tp * pp * dp, **LAYOUT)


def save(name: str, at: float, iteration: int, blocked: float, persist: float) -> dict:
    return event(name, at, iteration=iteration, seconds=blocked, bytes=1000, persist_seconds=persist,
                 started_at=T0 + at - persist, kind=name.split("_")[0])


def alert(at: float, gpu: int, reasons: list[str], sample_at: float | None = None) -> dict:
    stamp = datetime.fromtimestamp(T0 + (at if sample_at is None else sample_at), timezone.utc)
    return event("risk_alert", at, gpu=gpu, score=0.9, reasons=reasons, timestamp=stamp.isoformat())


def write_run(run_dir: Path, events: list[dict], logs: dict[int, list[str]]) -> Path:
    """``events.jsonl`` and ``logs/attempt_<N>.log`` (``logs``: attempt -> lines) in
    ``run_dir``, which may be a node's folder."""
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    for attempt, lines in logs.items():
        (run_dir / "logs" / f"attempt_{attempt}.log").write_text("\n".join(lines) + "\n")
    return run_dir
