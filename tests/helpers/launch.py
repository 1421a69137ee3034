"""Run ``ftmaster launch`` end to end on CPU: the small GPT, its arguments, and run-dir reads."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from ftmaster import runfiles
from helpers.trainer import PRETRAIN, REPO, SMALL_GPT, iterations, trainer_env

# Global batch 12 (and 24) divides by DP 1, 2, 3 and 4 with micro-batch 2 or less.
GLOBAL_BATCH = 12


def train_args(save: Path, iters: int, tp: int = 1, pp: int = 1, save_interval: int = 100,
               *extra: str, global_batch: int = GLOBAL_BATCH) -> list[str]:
    """SMALL_GPT with a short gloo timeout, so a lost rank never blocks a test for long."""
    args = [*SMALL_GPT, "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--micro-batch-size", "2",
            "--global-batch-size", str(global_batch), "--train-iters", str(iters),
            "--lr", "1e-2", "--min-lr", "1e-4", "--lr-warmup-iters", "2",
            "--lr-decay-style", "cosine", "--save", str(save), "--save-interval", str(save_interval),
            *extra]
    timeout_at = args.index("--distributed-timeout-minutes") + 1
    args[timeout_at] = "0.5"
    return args


def launch_argv(run_dir: Path, nproc: int, args: list[str], *options: str) -> list[str]:
    return [sys.executable, "-m", "ftmaster.cli", "launch", "--run-dir", str(run_dir),
            "--nproc-per-node", str(nproc), "--monitor-backend", "sim", "--monitor-interval", "0.5",
            *options, "--", PRETRAIN, *args]


def start_launch(run_dir: Path, nproc: int, args: list[str], *options: str) -> subprocess.Popen:
    """ftmaster in the background, its own output (not training's) in a text pipe."""
    return subprocess.Popen(launch_argv(run_dir, nproc, args, *options), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=trainer_env(), cwd=REPO)


def run_launch(run_dir: Path, nproc: int, args: list[str], *options: str,
               timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(launch_argv(run_dir, nproc, args, *options), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=trainer_env(), cwd=REPO,
                          timeout=timeout)


def watched_launch(run_dir: Path, nproc: int, args: list[str], *options: str,
                   stop_watching, timeout: float = 600) -> tuple[int, str]:
    """ftmaster run to its end while the caller watches it; ``stop_watching()`` once it ends
    (or fails to); returns its exit status and output."""
    ftmaster = start_launch(run_dir, nproc, args, *options)
    try:
        output, _ = ftmaster.communicate(timeout=timeout)
    finally:
        stop_watching()
        if ftmaster.poll() is None:
            ftmaster.kill()
    return ftmaster.returncode, output


def events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in runfiles.read_events(run_dir) if e["event"] == name]


def attempt_log(run_dir: Path, attempt: int) -> str:
    return (runfiles.logs_dir(run_dir) / f"attempt_{attempt}.log").read_text()


def losses(run_dir: Path) -> dict[int, float]:
    """Iteration -> loss over all attempts; a later attempt overrides a repeated iteration."""
    found: dict[int, float] = {}
    for log in sorted(runfiles.logs_dir(run_dir).glob("attempt_*.log"),
                      key=lambda p: int(p.stem.split("_")[1])):
        found.update({it: rec["loss"] for it, rec in iterations(log.read_text()).items()})
    return found


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line or environment contains ``text`` (e.g. a test's
    checkpoint folder or run directory); helpers such as multiprocessing servers show it only
    in the environment they inherit."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            environment = " ".join(process.environ().values())
        except psutil.Error:
            environment = ""
        if text in " ".join(process.info["cmdline"] or ()) or text in environment:
            found.append(process)
    return found


class MetricsScraper(threading.Thread):
    """Scrapes a launch's ``/metrics`` (the URL from its ``metrics`` event) every ``every_s``
    until :meth:`stop`; ``scrapes`` holds each scrape's families by name."""

    def __init__(self, run_dir: Path, every_s: float = 0.3) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.every_s = run_dir, every_s
        self.scrapes: list[dict] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            served = events(self.run_dir, "metrics") if runfiles.events_path(self.run_dir).exists() else []
            if not served:
                continue
            try:
                text = urllib.request.urlopen(served[0]["url"], timeout=2).read().decode()
            except OSError:
                continue
            self.scrapes.append({f.name: f for f in text_string_to_metric_families(text)})

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)

    def values(self, family: str, **labels) -> list[float]:
        """The sample ``family`` (with ``labels`` among its own) took in each scrape, in order."""
        found = []
        for scrape in self.scrapes:
            samples = [s.value for f in scrape.values() for s in f.samples
                       if s.name == family and labels.items() <= s.labels.items()]
            found.append(sum(samples) if samples else 0.0)
        return found


class ComputeFiguresWatcher(threading.Thread):
    """Reads a launch's heartbeat every 20 ms until :meth:`stop`: every rank's compute figure
    per iteration (``figures``: iteration -> {rank: ms or None}) and pipeline stage
    (``stages``). The heartbeat holds 16 iterations, so none is missed."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.figures: dict[int, dict[int, float | None]] = {}
        self.stages: dict[int, int] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.02):
            try:
                beat = json.loads((self.run_dir / "heartbeat.json").read_text())
            except (OSError, ValueError):
                continue
            compute = beat.get("compute") or {}
            self.stages.update(enumerate(compute.get("stages") or []))
            self.figures.update({int(it): dict(enumerate(ms))
                                 for it, ms in (compute.get("ms") or {}).items()})

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)
