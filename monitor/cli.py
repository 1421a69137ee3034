"""``ftmaster monitor``: run the GPU risk monitor on its own."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path
from typing import Iterator

import click

from ftmaster import runfiles
from ftmaster.console import gpus_text
from ftmaster.faults import TELEMETRY_KINDS, TRAINING_FAULTS, parse_injection
from ftmaster.metrics import MetricsUnavailable, serve_metrics
from ftmaster.monitor.alerts import AlertConfig
from ftmaster.monitor.backends import BACKEND_NAMES, Backend, BackendError, make_backend
from ftmaster.monitor.backends.replay import ReplayBackend, ReplayError
from ftmaster.monitor.daemon import MetricsFileError, Monitor, MonitorConfig, injections_log
from ftmaster.monitor.scorers import SCORER_NAMES, make_scorer
from ftmaster.lock import RunDirLock, RunDirLocked
from ftmaster.recovery.cli import MAX_NODE_GPUS, FiniteFloatRange, FolderPath


@click.command("monitor")
@click.option("--backend", "backend_spec", required=True, metavar="|".join(BACKEND_NAMES),
              help="Telemetry source; replay:PATH plays a recorded gpu_metrics.csv as fast as it can.")
@click.option("--run-dir", required=True, type=FolderPath(),
              help="Where gpu_metrics.csv, events.jsonl and flags/ go.")
@click.option("--interval", default=10.0, show_default=True, type=FiniteFloatRange(min=0.01),
              help="Seconds between samples (live backends).")
@click.option("--scorer", default="adaptive", show_default=True, type=click.Choice(SCORER_NAMES))
@click.option("--risk-threshold", default=0.95, show_default=True, type=FiniteFloatRange(0, 1, min_open=True))
@click.option("--num-gpus", default=8, show_default=True,
              type=click.IntRange(min=1, max=MAX_NODE_GPUS),
              help="Virtual GPUs for the sim backend.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for sim and degrade.")
@click.option("--inject", "inject_specs", multiple=True, metavar="KIND:gpu=G,at=iter:K|Ns",
              help=f"Fault to lay over the telemetry (repeatable); KIND: {TELEMETRY_KINDS} "
                   f"(xid needs code=N too: xid:gpu=G,code=N,at=...); no after=.")
@click.option("--duration", default=None, type=FiniteFloatRange(min=0),
              help="Stop after this many seconds (live backends; default: until interrupted).")
@click.option("--metrics-port", default=None, type=click.IntRange(0, 65535),
              help="Serve Prometheus metrics on this port (0: a free one): per-GPU risk, "
                   "DCGM-named telemetry and alerts.")
@click.option("--metrics-addr", default="127.0.0.1", show_default=True,
              help="Address the metrics are served on; 0.0.0.0 for a Prometheus elsewhere.")
def monitor_command(backend_spec: str, run_dir: Path, interval: float, scorer: str,
                    risk_threshold: float, num_gpus: int, seed: int, inject_specs: tuple[str, ...],
                    duration: float | None, metrics_port: int | None, metrics_addr: str) -> None:
    """Sample GPUs, score their failure risk, and request checkpoints on alerts."""
    try:
        injections = [parse_injection(spec) for spec in inject_specs]
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    training = [i for i in injections if i.kind in TRAINING_FAULTS]
    if training:
        raise click.UsageError(f"--inject {training[0]}: {training[0].kind.value} acts on a "
                               f"training rank, which needs ftmaster launch; the monitor alone "
                               f"runs none")
    waiting = [i for i in injections if i.after is not None]
    if waiting:
        raise click.UsageError(f"--inject {waiting[0]}: after= needs ftmaster launch, which "
                               f"follows the run's events; the monitor alone does not")
    outside = [i for i in injections if backend_spec == "sim" and not 0 <= i.gpu < num_gpus]
    if outside:
        raise click.UsageError(f"--inject {outside[0]}: GPU {outside[0].gpu} is not one of the "
                               f"sim backend's GPUs 0-{num_gpus - 1} (--num-gpus {num_gpus})")
    replaying = backend_spec.startswith("replay:")
    if replaying and Path(backend_spec[len("replay:"):]).resolve() == \
            runfiles.metrics_csv_path(run_dir).resolve():
        raise click.UsageError("replay:PATH is this run dir's own gpu_metrics.csv; "
                               "give another --run-dir")
    if (problem := _layout_problem(run_dir)) is not None:
        raise click.ClickException(problem)
    backend = _backend(backend_spec, num_gpus, seed)  # a bad one leaves no run directory
    try:
        with _run_dir_locked(run_dir):
            _monitor(backend, backend_spec, run_dir, interval, scorer, risk_threshold,
                     injections, seed, duration, metrics_port, metrics_addr)
    finally:
        backend.close()


def _backend(backend_spec: str, num_gpus: int, seed: int) -> Backend:
    try:
        return make_backend(backend_spec, num_gpus=num_gpus, seed=seed)
    except ValueError as exc:  # unknown backend name, or ReplayError for a bad file
        raise (click.ClickException if isinstance(exc, ReplayError) else click.UsageError)(str(exc)) from None
    except BackendError as exc:
        raise click.ClickException(f"{backend_spec} backend unavailable: {exc}") from None


def _layout_problem(run_dir: Path) -> str | None:
    """As :func:`runfiles.layout_problem`, with a run directory that cannot even be looked at
    (a name too long, a folder without search permission) as its problem: it is looked at
    before it is made, and its OSError came out as a traceback."""
    try:
        return runfiles.layout_problem(run_dir)
    except OSError as error:
        return f"run directory {run_dir} is not usable ({error.strerror}); give another --run-dir"


@contextlib.contextmanager
def _run_dir_locked(run_dir: Path) -> Iterator[None]:
    """As ``launch`` holds it: two monitors, or a monitor beside a launch, would interleave
    their rows and flags in one run directory."""
    lock = RunDirLock(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except RunDirLocked as error:
        raise click.ClickException(str(error)) from None
    except OSError as error:
        raise click.ClickException(f"run directory {run_dir} is not writable "
                                   f"({error.strerror}); give a writable --run-dir") from None
    if lock.unlocked_because is not None:
        click.echo(f"warning: run directory {run_dir} has no file locks "
                   f"({lock.unlocked_because}): nothing stops a second monitor from using it "
                   "at once", err=True)
    try:
        yield
    finally:
        lock.release()


def _monitor(backend: Backend, backend_spec: str, run_dir: Path, interval: float, scorer: str,
             risk_threshold: float, injections: list, seed: int, duration: float | None,
             metrics_port: int | None, metrics_addr: str) -> None:
    replaying = backend_spec.startswith("replay:")
    logging.basicConfig(level=logging.ERROR if replaying else logging.WARNING,
                        format="%(asctime)s monitor %(levelname)s %(message)s")
    injections_log.setLevel(logging.WARNING)  # a replay's injection that changes nothing too
    try:
        monitor = Monitor(backend, run_dir, scorer=make_scorer(scorer),
                          alert_config=AlertConfig(threshold=risk_threshold),
                          config=MonitorConfig(interval_s=0.0 if replaying else interval),
                          injections=injections, seed=seed)
    except (MetricsFileError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if metrics_port is not None:
        try:
            metrics, url = serve_metrics(metrics_port, metrics_addr, run_dir=run_dir)
        except MetricsUnavailable as exc:
            monitor.close()
            raise click.ClickException(str(exc)) from None
        metrics.watch(monitor)
        click.echo(f"metrics: serving {url}", err=True)
    if replaying:
        monitor.run_to_end()
        monitor.close()
    else:
        _run_live(monitor, duration)
    click.echo(_summary(monitor, backend_spec, run_dir))


def _run_live(monitor: Monitor, duration: float | None) -> None:
    """Sample until ``duration`` or a signal, moving each save request on to a trainer beside
    it, as ``launch``'s listener does: a trainer reads only ``save_now.flag``, and the
    monitor's ``trigger_checkpoint.flag`` reached none."""
    from ftmaster.listener import Listener

    done = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: done.set())
    listener = Listener(monitor.run_dir)
    listener.start()
    monitor.start()
    try:
        done.wait(duration)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        monitor.stop()
        listener.stop()


def _summary(monitor: Monitor, backend_spec: str, run_dir: Path) -> str:
    alerted = sorted({a.gpu for a in monitor.alerts})
    alerts = (f"{len(monitor.alerts)} alert(s) on {gpus_text(alerted)}" if alerted
              else "no alert")
    text = (f"{backend_spec}: {monitor.samples_seen} GPU samples, {alerts}, "
            f"lost {gpus_text(sorted(monitor.lost_gpus()))}")
    unschedulable = monitor.unschedulable_gpus()
    if unschedulable:
        text += ", unschedulable " + ", ".join(f"GPU {gpu} ({reason})" for gpu, reason in unschedulable.items())
    text += f"; wrote {run_dir}"
    backend = monitor.backend
    if isinstance(backend, ReplayBackend) and backend.skipped:
        text += f"; skipped {backend.skipped} malformed row(s), first: {backend.problems[0]}"
    return text + _never_fired(monitor.pending_injections)


def _never_fired(injections: list) -> str:
    """The summary's note of the injections the run ended before: one at an iteration waits
    for a trainer that the monitor alone may never see."""
    if not injections:
        return ""
    note = f"; never fired: {', '.join(map(str, injections))}"
    if any(injection.at_iteration is not None for injection in injections):
        note += (" (at=iter:K waits for a trainer's heartbeat in the run directory to reach "
                 "iteration K)")
    return note
