"""Replay labelled traces through the monitor and measure how well it predicts failures.

Definitions (per trace, then pooled):

- An alert on GPU g is *true* when it falls in a labelled failure's window on g: from the
  precursor's start (the failure time for sudden failures) to ``grace_s`` after the failure.
  Every other alert is false.
- A failure with a precursor is *predicted* when a true alert comes strictly before the
  failure time; its lead is failure time minus the first such alert. Recall counts predicted
  failures among failures with precursors.
- False alerts on one GPU less than ``episode_gap_s`` apart form one false-alarm *episode*;
  the rate is per 100 GPU-hours of telemetry (each GPU from its first to its last row).
- Precision = failures (any kind) with a true alert before the failure time / (those +
  false-alarm episodes). Alerts at the failure itself (device lost, fatal XID) are true but
  predict nothing, so they count in neither.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ftmaster.monitor.alerts import AlertConfig
from ftmaster.monitor.backends.replay import ReplayBackend
from ftmaster.monitor.daemon import Alert, Monitor, MonitorConfig
from ftmaster.monitor.scorers import Scorer


@dataclass
class TraceResult:
    precursor_failures: int
    predicted: int
    leads_s: list[float]
    alerted_failures: int  # failures (any kind) with a true alert before they happened
    false_episodes: int
    gpu_hours: float
    samples: int


def replay(csv_path: Path, scorer: Scorer, alert_config: AlertConfig) -> tuple[list[Alert], float, int]:
    """The alerts a replay raises, the trace's GPU-hours, and how many samples it scored."""
    backend = ReplayBackend(csv_path)
    monitor = Monitor(backend, None, scorer=scorer, alert_config=alert_config,
                      config=MonitorConfig(interval_s=0.0))
    monitor.run_to_end()
    gpu_hours = sum(end - begin for begin, end in backend.gpu_spans().values()) / 3600.0
    return monitor.alerts, gpu_hours, monitor.samples_seen


def judge(alerts: list[Alert], failures: list[dict], grace_s: float, episode_gap_s: float) -> TraceResult:
    """Match one trace's alerts to its labelled failures (see the module docstring)."""
    predicted, leads, alerted = 0, [], 0
    false: dict[int, list[float]] = {}
    # None, not 0 (a trace timed from 0), means no precursor
    windows = [(f["gpu"], f["failure_time"] if f["precursor_start"] is None else f["precursor_start"],
                f["failure_time"] + grace_s) for f in failures]
    for alert in alerts:
        if not any(g == alert.gpu and lo <= alert.time <= hi for g, lo, hi in windows):
            false.setdefault(alert.gpu, []).append(alert.time)
    for failure, (gpu, lo, hi) in zip(failures, windows):
        true_times = [a.time for a in alerts if a.gpu == gpu and lo <= a.time <= hi]
        early = [t for t in true_times if t < failure["failure_time"]]
        alerted += bool(early)
        if failure["has_precursor"] and early:
            predicted += 1
            leads.append(failure["failure_time"] - min(early))
    episodes = 0
    for times in false.values():
        episodes += 1 + sum(1 for a, b in zip(times, times[1:]) if b - a >= episode_gap_s)
    return TraceResult(sum(f["has_precursor"] for f in failures), predicted, leads, alerted, episodes, 0.0, 0)


def evaluate(traces: list[tuple[Path, Path]], make_scorer: Callable[[], Scorer], alert_config: AlertConfig,
             grace_s: float = 60.0, episode_gap_s: float = 1800.0) -> dict:
    """Pooled quality numbers over (csv, labels) pairs; a fresh scorer per trace."""
    results = []
    for csv_path, labels_path in traces:
        failures = json.loads(Path(labels_path).read_text())["failures"]
        alerts, gpu_hours, samples = replay(csv_path, make_scorer(), alert_config)
        result = judge(alerts, failures, grace_s, episode_gap_s)
        result.gpu_hours, result.samples = gpu_hours, samples
        results.append(result)
    return summarize(results)


def summarize(results: list[TraceResult]) -> dict:
    precursor = sum(r.precursor_failures for r in results)
    predicted = sum(r.predicted for r in results)
    leads = [lead for r in results for lead in r.leads_s]
    alerted = sum(r.alerted_failures for r in results)
    episodes = sum(r.false_episodes for r in results)
    gpu_hours = sum(r.gpu_hours for r in results)
    return {
        "traces": len(results),
        "gpu_hours": gpu_hours,
        "samples": sum(r.samples for r in results),
        "precursor_failures": precursor,
        "predicted": predicted,
        "recall": predicted / precursor if precursor else float("nan"),
        "median_lead_s": statistics.median(leads) if leads else float("nan"),
        "false_episodes": episodes,
        "false_per_100_gpu_hours": 100.0 * episodes / gpu_hours if gpu_hours else float("nan"),
        "precision": alerted / (alerted + episodes) if alerted + episodes else float("nan"),
    }
