"""The monitor loop: sample, lay injected faults over the samples, score, record, alert.

Outputs in ``RUN_DIR`` (DESIGN's run-directory contract):

- ``gpu_metrics.csv``: one row per GPU per sample, DESIGN's columns with ``failure_risk``.
  The header is written once; each sample's rows go out in one ``O_APPEND`` write of whole
  lines, so pandas can read the file while it grows.
- ``events.jsonl``: a ``risk_alert`` event per alert with ``gpu``, ``score``, ``reasons`` and
  ``timestamp`` (the sample's own time, as in the CSV). A ``monitor_error`` event (``error``,
  ``retry_in_s``) marks the start of a run of backend failures. A ``monitor_coverage`` event
  (``unavailable``: hard signals) says, once at the first sample, which hard signals the
  backend cannot show on any GPU; the risk then rests on soft signals for them, so a low
  score is not the all-clear it looks like. A warning says the same. One GPU's own gap (the
  backend's ``unreported_fields``: an NVML GPU whose XID registration failed) is said when it
  opens and when it closes, as a ``monitor_coverage`` event with ``gpu`` (``unavailable``
  empty once the GPU shows them again).
- ``flags/trigger_checkpoint.flag``: written atomically on every alert, JSON with ``gpu``,
  ``score``, ``reasons`` and ``timestamp``.

**Device lost.** A GPU that was sampled before and is missing from a later sample is lost
(see the backends' contract), and so is one the backend names gone (``conditions``:
``gpu_is_lost``, ``wedged``). The monitor then

- adds it to :meth:`Monitor.lost_gpus` and :meth:`Monitor.lost_reasons` (thread-safe; the
  launcher's API): the backend's condition, or ``device_lost`` when it only went missing,
- raises a ``risk_alert`` with score 1.0 and reasons ``["device_lost"]``, plus the condition
  when there is one (``["device_lost", "wedged"]``), as event and flag,
- calls ``on_lost(gpu)`` if given.

A lost GPU that reports again is taken off the lost set and starts with fresh baselines.

**Which GPUs.** :meth:`Monitor.watch` samples only the GPUs the current attempt uses (spares
left unused after a replan are neither read nor scored, so they raise no utilisation
alert); :meth:`Monitor.exclude_gpus` stops watching GPUs for good (a relaunch without them).
Backends that can (``nvml``, ``sim``, ``smi``) stop reading those GPUs at all
(``select_gpus``); for the others the samples are filtered.

**Health evidence.** Every sample and driver condition updates the GPU's
:class:`~ftmaster.monitor.health.GpuEvidence`; :meth:`Monitor.unschedulable_gpus` gives the
GPUs that need a reset or replacement and why. An alert asks for a save; unschedulable tells
the supervisor never to plan on the GPU again. The monitor reports, the supervisor decides.

**Injections** reach the anomaly overlay (telemetry) and, when it has ``inject``, the backend
(``wedge`` blocks the GPU's reads); ``recover`` also clears the GPU's evidence, as a reset would.

**Robustness.** Run in a daemon thread (:meth:`Monitor.start`), a backend error or any
exception in a step is logged and retried with exponential backoff (interval x 2^k, capped),
never fatal. Intervals from 0.1 s to minutes work; all timing decisions (warm-up, cooldown,
``at=Ns`` injections) use the samples' own clock, so a replay decides exactly as live.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from ftmaster import runfiles
from ftmaster.console import gpus_text
from ftmaster.faults import Fault, Injection
from ftmaster.monitor.alerts import AlertConfig, AlertPolicy
from ftmaster.monitor.anomalies import AnomalyOverlay
from ftmaster.monitor.backends import Backend, TraceEnded
from ftmaster.monitor.health import (GpuEvidence, HealthConfig, observe_conditions, observe_sample,
                                     unschedulable_reason)
from ftmaster.monitor.sample import GpuSample, iso_time, to_row, unknown_if_not_finite
from ftmaster.monitor.schema import CSV_COLUMNS
from ftmaster.monitor.scorers import AdaptiveScorer, Assessment, Scorer
from ftmaster.monitor.signals import HARD_SIGNAL_FIELDS, unavailable_hard_signals

log = logging.getLogger("ftmaster.monitor")
injections_log = logging.getLogger("ftmaster.monitor.injections")
"""What a rehearsal's --inject will not do: said where the monitor's other warnings are kept
quiet too (a replay's, whose alerts its summary line gives)."""

DEVICE_LOST = "device_lost"
# Past this many doublings every realistic backoff is at its cap; 2 ** 1024 overflows a float.
MAX_DOUBLINGS = 64


def backoff_delay(failures: int, interval_s: float, max_backoff_s: float) -> float:
    """Seconds to wait after ``failures`` consecutive failed steps: interval x 2^failures, capped."""
    return min(max_backoff_s, max(interval_s, 0.1) * 2 ** min(failures, MAX_DOUBLINGS))


def next_due(due: float, began: float, interval_s: float) -> float:
    """When the step after one due at ``due`` that began at ``began`` is due: a period after
    ``due``, since waiting a period from ``began`` added every late wake-up to the schedule (a
    drift). A step that began early (a refresh) or a period late or more (a backoff, a long
    step) restarts the schedule from ``began``, with no burst to catch up."""
    return due + interval_s if 0.0 <= began - due < interval_s else began + interval_s


@dataclass(frozen=True)
class MonitorConfig:
    interval_s: float = 10.0
    """Seconds between samples (the paper's 10 s); 0 runs back to back (replay)."""
    max_backoff_s: float = 60.0
    """Longest wait between retries after backend errors."""

    def __post_init__(self) -> None:
        if not self.interval_s >= 0:
            raise ValueError(f"interval must be >= 0 s, got {self.interval_s}")
        if not self.max_backoff_s > 0:
            raise ValueError(f"max backoff must be > 0 s, got {self.max_backoff_s}")


@dataclass(frozen=True)
class Alert:
    gpu: int
    score: float
    reasons: tuple[str, ...]
    time: float  # the sample's own time, unix seconds


class MetricsFileError(ValueError):
    """``gpu_metrics.csv`` exists with other columns; appending would corrupt it."""


class MetricsWriter:
    """Appends sample rows to ``gpu_metrics.csv``: header once, whole lines per write. The
    path is followed: a file moved away (logrotate's ``create``, ``mv``) gives way to a new
    one at the path, and one emptied in place (``copytruncate``) gets its header again, where
    the rows went on into the moved file, or headerless into the emptied one (which a
    restarted monitor then refused)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._opened()

    def _opened(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            if os.fstat(fd).st_size == 0:
                _write_whole(fd, self._encode([CSV_COLUMNS]))
            else:
                self._check_header()
                self._drop_torn_tail(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_header(self) -> None:
        try:
            with self.path.open(newline="", errors="replace") as handle:  # binary: not ours
                header = next(csv.reader(handle), [])
        except csv.Error:  # e.g. an unclosed quote running past the field size limit
            header = []
        if tuple(header) != CSV_COLUMNS:
            raise MetricsFileError(f"{self.path} has other columns than gpu_metrics.csv's; "
                                   f"move it away or use another --run-dir")

    @staticmethod
    def _encode(rows: Iterable[Iterable[str]]) -> bytes:
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerows(rows)
        return buffer.getvalue().encode()

    def _drop_torn_tail(self, fd: int) -> None:
        """A row cut short (a writer killed mid-write) would run into the first one appended.
        A header whose line ended there is whole (its columns were checked): it is ended, not
        cut, which left rows without a header."""
        size = os.fstat(fd).st_size
        tail = os.pread(fd, min(size, 1 << 16), max(0, size - (1 << 16)))
        if tail.endswith(b"\n"):
            return
        if b"\n" not in tail and size == len(tail):
            _write_whole(fd, b"\n")
            return
        keep = size - len(tail) + tail.rfind(b"\n") + 1
        log.warning("%s ended in a torn row (%d bytes): dropped", self.path, size - keep)
        os.ftruncate(fd, keep)

    def write(self, samples: list[GpuSample]) -> None:
        if samples:
            self._follow_the_path()
            _write_whole(self._fd, self._encode(to_row(s) for s in samples))

    def _follow_the_path(self) -> None:
        """OSError when the path now holds a file of other columns (the outage says it once)."""
        mine = os.fstat(self._fd)
        try:
            found = os.stat(self.path)
        except FileNotFoundError:
            found = None
        if found is not None and (found.st_dev, found.st_ino) == (mine.st_dev, mine.st_ino):
            if mine.st_size == 0:
                _write_whole(self._fd, self._encode([CSV_COLUMNS]))
            return
        try:
            fd = self._opened()
        except MetricsFileError as error:
            raise OSError(errno.EEXIST, str(error)) from None
        os.close(self._fd)
        self._fd = fd
        log.info("%s was moved or replaced: writing a new one", self.path)

    def close(self) -> None:
        os.close(self._fd)


def _write_whole(fd: int, data: bytes) -> None:
    """All of ``data`` or none of it: a write cut short (a full disk) is taken back, so the
    file stays whole rows."""
    start = os.fstat(fd).st_size
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise


ALERTING_CONDITIONS = ("row_remap_failure",)
"""Driver conditions that alert on a GPU still sampled: it trains on and needs replacing. A
reset required is evidence for the supervisor only: its GPU's reads fail, its rank with them,
and it would alert at every start."""


def with_conditions(assessment: Assessment, conditions: tuple[str, ...]) -> Assessment:
    """A sampled GPU's assessment with the driver's :data:`ALERTING_CONDITIONS` on it as hard
    reasons at full risk: the sample's fields cannot hold them, and the scorer, which reads
    only those, never alerted on a GPU the driver says needs replacing."""
    alerting = tuple(name for name in conditions if name in ALERTING_CONDITIONS)
    if not alerting:
        return assessment
    kept = () if assessment.unknown else assessment.reasons
    return Assessment(1.0, tuple(dict.fromkeys((*kept, *alerting))),
                      tuple(dict.fromkeys((*assessment.hard_reasons, *alerting))))


class Monitor:
    """Watches one backend's GPUs; see the module docstring for what it writes.

    ``run_dir=None`` keeps everything in memory (``alerts``), for evaluation and tests.
    """

    def __init__(self, backend: Backend, run_dir: Path | None, *, scorer: Scorer | None = None,
                 alert_config: AlertConfig | None = None, config: MonitorConfig | None = None,
                 injections: Iterable[Injection] = (), seed: int = 0,
                 on_alert: Callable[[Alert], None] | None = None,
                 on_lost: Callable[[int], None] | None = None,
                 health: HealthConfig | None = None) -> None:
        self.backend = backend
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.scorer = scorer or AdaptiveScorer()
        self.policy = AlertPolicy(alert_config)
        self.config = config or MonitorConfig()
        self.health = health or HealthConfig()
        self.overlay = AnomalyOverlay(seed=seed)
        self.pending_injections = list(injections)
        self._injected_gpus = {i.gpu: i for i in self.pending_injections}
        self.on_alert, self.on_lost = on_alert, on_lost
        self.sample_listeners: list[Callable[[list[GpuSample], list[Alert]], None]] = []
        """Called with each step's scored samples and its alerts (metrics, TensorBoard)."""
        self.alerts: list[Alert] = []
        self.samples_seen = 0
        self._writer = None if self.run_dir is None else MetricsWriter(runfiles.metrics_csv_path(self.run_dir))
        self._outage = runfiles.WriteOutage(log.error, log.info, "the monitor goes on without it")
        self._unwritten_request: dict | None = None
        """A save request whose flag could not be written: tried again at every sample (the
        policy disarmed its GPU, which would not ask again)."""
        self._asked: dict[int, tuple[float, dict]] = {}
        """GPU -> when (in the samples' clock) its last save request was written, and its body."""
        self._lock = threading.Lock()
        self._known: set[int] = set()
        self._lost: dict[int, str] = {}  # lost GPU -> why
        self._excluded: set[int] = set()
        self._watched: frozenset[int] | None = None  # None: every GPU the backend has
        self._evidence: dict[int, GpuEvidence] = {}
        self._unschedulable_logged: set[int] = set()
        self._started_at: float | None = None
        self._heartbeats_from = time.time()
        """A heartbeat written before the monitor started is an earlier run's (``ftmaster
        monitor`` on a run directory kept): its iteration fires no ``at=iter:K``."""
        self._coverage_checked = False
        self._gpu_gaps: dict[int, tuple[str, ...]] = {}  # GPU -> hard signals it cannot show, as said
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._steps = threading.Condition()
        self._steps_started = self._steps_finished = 0
        self._thread: threading.Thread | None = None

    # -- the launcher's API ------------------------------------------------------------------
    def lost_gpus(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._lost)

    def lost_reasons(self) -> dict[int, str]:
        """Why each lost GPU is lost: ``wedged``, ``gpu_is_lost`` (the backend said so) or
        ``device_lost`` (it only went missing)."""
        with self._lock:
            return dict(self._lost)

    def unschedulable_gpus(self) -> dict[int, str]:
        """GPUs whose evidence says they need a reset or replacement, with the reason
        (:func:`~ftmaster.monitor.health.unschedulable_reason`). Excluded or unwatched GPUs
        keep the evidence they had; a ``recover`` injection clears a GPU's."""
        with self._lock:
            reasons = {gpu: unschedulable_reason(evidence, self.health)
                       for gpu, evidence in self._evidence.items()}
        return {gpu: reason for gpu, reason in sorted(reasons.items()) if reason is not None}

    def still_critical(self, gpu: int) -> bool:
        """Lost, or alerted and not yet back below the re-arm level (hysteresis)."""
        with self._lock:
            return gpu in self._lost or self.policy.still_alerting(gpu)

    def watch(self, gpus: Iterable[int] | None) -> None:
        """Sample only ``gpus`` (None: every GPU of the backend) from the next sample on: the
        GPUs the current attempt uses, plus any lost GPU still waited for. The others are
        neither read, scored nor reported lost; their evidence is kept. Excluded GPUs stay out.
        The attempt is a new one: a rank a ``hang`` rehearsal stopped is gone, and its GPU
        (relaunched on, idle for good) read as collapsed and asked for a save every cooldown."""
        with self._lock:
            self.overlay.end_rank_faults()
            self._watched = None if gpus is None else frozenset(gpus)
            for gpu in list(self._known) + list(self._lost):
                if not self._wanted(gpu):
                    self._forget(gpu)
            self._select_backend_gpus()

    def exclude_gpus(self, gpus: Iterable[int]) -> None:
        """Stop watching ``gpus`` for good: no reads, rows, scores or lost reports for them."""
        with self._lock:
            for gpu in gpus:
                self._excluded.add(gpu)
                self._forget(gpu)
            self._select_backend_gpus()

    def _wanted(self, gpu: int) -> bool:
        return gpu not in self._excluded and (self._watched is None or gpu in self._watched)

    def _forget(self, gpu: int) -> None:
        self._known.discard(gpu)
        self._lost.pop(gpu, None)
        self.scorer.forget(gpu)
        self.policy.forget(gpu)

    def _select_backend_gpus(self) -> None:
        select = getattr(self.backend, "select_gpus", None)
        if select is not None:
            select(self._watched, frozenset(self._excluded))

    def refresh(self, timeout_s: float) -> bool:
        """Have the monitor thread sample now, without waiting for its interval, and wait
        until a sample that began after this call is done: the freshest evidence, for a
        decision such as the plan right after a failure (a GPU's XID and its rank's CUDA
        error arrive together, and the next regular sample can be many seconds away).
        False when none was done within ``timeout_s`` (or no thread runs)."""
        if self._thread is None or not self._thread.is_alive():
            return False
        with self._steps:
            wanted = self._steps_started + 1
            self._wake.set()
            return self._steps.wait_for(lambda: self._steps_finished >= wanted, timeout_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ftmaster-monitor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.close()

    def close(self) -> None:
        if self._writer is not None and (self._thread is None or not self._thread.is_alive()):
            self._writer.close()
            self._writer = None
        self.backend.close()

    def run_to_end(self) -> None:
        """Step until the backend's trace ends (replay), as fast as it goes."""
        while True:
            try:
                self.step()
            except TraceEnded:
                return

    # -- one sample ------------------------------------------------------------------------
    def step(self) -> list[Alert]:
        """Take, score and record one sample; returns its alerts. Backend errors propagate."""
        samples = [unknown_if_not_finite(s) for s in self.backend.sample()]
        conditions = dict(getattr(self.backend, "conditions", None) or {})
        now = max((s.timestamp for s in samples), default=time.time())
        if self._started_at is None:
            self._started_at = now
        recovered = self._inject_due(now)
        with self._lock:
            wanted = [s for s in samples if self._wanted(s.gpu_id)]
            # What the backend read, before a rehearsal's overlay took any GPU away: a fail
            # due at the first sample is a GPU lost, not one never seen.
            sampled = sorted({s.gpu_id for s in wanted})
            samples = self.overlay.apply(wanted)
            conditions = {gpu: names for gpu, names in conditions.items() if self._wanted(gpu)}
            newly_lost = self._track_presence(samples, conditions, sampled)
            self._gather_evidence(samples, conditions)
            for gpu in recovered:  # the rehearsal's reset: what was seen before no longer holds
                self._evidence.pop(gpu, None)
                self._unschedulable_logged.discard(gpu)
            assessments = self.scorer.update(samples)
            alerts = []
            for sample in samples:
                assessment = with_conditions(assessments[sample.gpu_id],
                                             conditions.get(sample.gpu_id, ()))
                sample.failure_risk = assessment.score
                alerts += self._decide(sample.gpu_id, sample.timestamp, assessment)
            for gpu in newly_lost:
                reasons = (DEVICE_LOST,) + ((self._lost[gpu],) if self._lost[gpu] != DEVICE_LOST else ())
                alerts += self._decide(gpu, now, Assessment(1.0, reasons, reasons))
        self.samples_seen += len(samples)
        if self._unwritten_request is not None:
            self._request_save(self._unwritten_request)
        for alert in alerts:  # first: the policy has disarmed their GPUs, a failed write below
            self._announce(alert)  # must not cost the checkpoint they ask for
        self._ask_again_while_critical(samples)
        if self._writer is not None:
            self._outage.write(self._writer.path, lambda: self._writer.write(samples))
        if samples and not self._coverage_checked:
            self._coverage_checked = True
            self._report_coverage(samples)
            self._report_unsampled_injections(sampled)
        if samples:
            self._report_gpu_coverage()
        for listener in self.sample_listeners:
            listener(samples, alerts)
        for gpu in newly_lost:
            if self.on_lost is not None:
                self.on_lost(gpu)
        return alerts

    def _inject_due(self, now: float) -> list[int]:
        """Apply the injections now due; returns the GPUs they recovered."""
        if not self.pending_injections:
            return []
        iteration = None
        if self.run_dir is not None:
            heartbeat = runfiles.read_heartbeat(self.run_dir)
            if heartbeat is not None and heartbeat.get("time", self._heartbeats_from) >= self._heartbeats_from:
                iteration = heartbeat["iteration"]
        elapsed = now - self._started_at
        recovered = []
        for injection in [i for i in self.pending_injections if i.due(iteration, elapsed)]:
            log.debug("injecting %s (iteration %s, %.1f s in)", injection, iteration, elapsed)
            self._inject(injection)
            self.pending_injections.remove(injection)
            if injection.kind is Fault.RECOVER:
                recovered.append(injection.gpu)
        return recovered

    def _inject(self, injection: Injection) -> None:
        self.overlay.apply_fault(injection)
        backend_inject = getattr(self.backend, "inject", None)
        if backend_inject is not None:
            backend_inject(injection)
        elif injection.kind is Fault.WEDGE:
            injections_log.warning("the %s backend cannot wedge its reads: %s changes nothing",
                                   self.backend.name, injection)

    def _track_presence(self, samples: list[GpuSample], conditions: dict[int, tuple[str, ...]],
                        sampled: Iterable[int]) -> list[int]:
        """Update the known/lost sets; returns the GPUs lost in this sample. ``sampled``: the
        GPUs the backend read, some of which an injected fault may have taken away."""
        self._known |= set(sampled)
        present = {s.gpu_id for s in samples}
        for gpu in present & set(self._lost):
            log.info("GPU %d reports again", gpu)
            del self._lost[gpu]
            self.scorer.forget(gpu)
            self.policy.forget(gpu)
        gone = {gpu for gpu in conditions if gpu not in present}  # named gone, even if never sampled
        newly_lost = sorted(((self._known - present) | gone) - set(self._lost))
        for gpu in newly_lost:
            self._lost[gpu] = conditions[gpu][0] if gpu in gone else DEVICE_LOST
        self._known |= present
        return newly_lost

    def _gather_evidence(self, samples: list[GpuSample], conditions: dict[int, tuple[str, ...]]) -> None:
        for sample in samples:
            self._evidence[sample.gpu_id] = observe_sample(self._evidence.get(sample.gpu_id, GpuEvidence()),
                                                           sample)
        for gpu, names in conditions.items():
            self._evidence[gpu] = observe_conditions(self._evidence.get(gpu, GpuEvidence()), names)
        for gpu in {s.gpu_id for s in samples} | set(conditions):
            reason = unschedulable_reason(self._evidence[gpu], self.health)
            if reason is not None and gpu not in self._unschedulable_logged:
                self._unschedulable_logged.add(gpu)
                log.warning("GPU %d needs a reset or replacement (%s): unschedulable", gpu, reason)

    def _report_coverage(self, samples: list[GpuSample]) -> None:
        unavailable = unavailable_hard_signals(samples, getattr(self.backend, "reported_fields", None))
        if not unavailable:
            return
        log.warning("hard signals unavailable (%s): risk uses soft signals only for them",
                    ", ".join(unavailable))
        if self.run_dir is not None:
            self._append_event("monitor_coverage", unavailable=unavailable)

    def _report_gpu_coverage(self) -> None:
        """Say when a watched GPU's own coverage changes: hard signals the backend shows on
        other GPUs but cannot show on this one now (its ``unreported_fields``). Unwatched GPUs
        keep what was last said of them."""
        gaps = getattr(self.backend, "unreported_fields", None)
        if gaps is None:
            return
        with self._lock:
            watched = {gpu for gpu in set(gaps) | set(self._gpu_gaps) if self._wanted(gpu)}
        for gpu in sorted(watched):
            fields = gaps.get(gpu, frozenset())
            now = tuple(signal for signal, names in HARD_SIGNAL_FIELDS.items()
                        if all(name in fields for name in names))
            before = self._gpu_gaps.get(gpu, ())
            if now == before:
                continue
            if now:
                log.warning("GPU %d: hard signals unavailable (%s): its risk uses soft signals only for them",
                            gpu, ", ".join(now))
                self._gpu_gaps[gpu] = now
            else:
                log.info("GPU %d: hard signals available again (%s)", gpu, ", ".join(before))
                del self._gpu_gaps[gpu]
            if self.run_dir is not None:
                self._append_event("monitor_coverage", gpu=gpu, unavailable=list(now))

    def _report_unsampled_injections(self, sampled: list[int]) -> None:
        """An injection for a GPU that is not sampled would never show, and the rehearsal
        would pass for one that ran: the sim backend's GPUs are checked before the start, but
        NVML's and a replay's are known only from their first sample (``sampled``, as the
        backend read it)."""
        for gpu, injection in self._injected_gpus.items():
            if gpu not in sampled:
                injections_log.warning("--inject %s: GPU %d is not among the sampled %s; it "
                                       "changes nothing", injection, gpu, gpus_text(sampled))
                if self.run_dir is not None:
                    self._append_event("injection_unsampled", gpu=gpu, spec=str(injection),
                                       sampled=sampled)

    def _decide(self, gpu: int, when: float, assessment: Assessment) -> list[Alert]:
        if not self.policy.decide(gpu, when, assessment):
            return []
        alert = Alert(gpu, assessment.score, assessment.reasons, when)
        self.alerts.append(alert)
        return [alert]

    def _announce(self, alert: Alert) -> None:
        log.warning("risk alert: GPU %d score %.2f (%s)", alert.gpu, alert.score, ", ".join(alert.reasons))
        if self.run_dir is not None:
            body = {"gpu": alert.gpu, "score": alert.score, "reasons": list(alert.reasons),
                    "timestamp": iso_time(alert.time)}
            if DEVICE_LOST not in alert.reasons:  # a lost GPU's rank can take part in no save
                self._request_save(body)
                self._asked[alert.gpu] = (alert.time, body)
            self._outage.append_event(self.run_dir, "risk_alert", **body)
        if self.on_alert is not None:
            self.on_alert(alert)

    def _ask_again_while_critical(self, samples: list[GpuSample]) -> None:
        """A GPU still critical since its alert asks again for a save, once per ``cooldown_s``,
        when no request is pending. The policy alerts once until the GPU re-arms, and its
        request can be gone unanswered: a failed save consumes it, a relaunch clears it."""
        if self.run_dir is None or self._unwritten_request is not None:
            return
        cooldown = self.policy.config.cooldown_s
        for sample in samples:
            gpu, now = sample.gpu_id, sample.timestamp
            asked = self._asked.get(gpu)
            if asked is None or not self.policy.still_alerting(gpu) or gpu in self._lost or \
                    0 <= now - asked[0] < cooldown or self._request_pending():
                continue
            body = {**asked[1], "score": sample.failure_risk, "timestamp": iso_time(now)}
            log.warning("GPU %d is still critical (score %.2f): asking again for a save",
                        gpu, sample.failure_risk)
            self._request_save(body)
            self._asked[gpu] = (now, body)

    def _request_pending(self) -> bool:
        """Whether a save request waits to be moved to training, or to be answered."""
        return any(path(self.run_dir).exists()
                   for path in (runfiles.trigger_flag_path, runfiles.save_now_flag_path))

    def _request_save(self, body: dict) -> None:
        flag = runfiles.trigger_flag_path(self.run_dir)
        written = self._outage.write(flag, lambda: runfiles.write_flag(flag, **body) or True)
        self._unwritten_request = None if written else body

    # -- the thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        failures = 0
        due = time.monotonic()  # when the current step was due
        while not self._stop.is_set():
            began = time.monotonic()
            with self._steps:
                self._steps_started += 1
                number = self._steps_started
            try:
                self._step_and_count(number)
            except TraceEnded:
                return
            except Exception as exc:  # survive anything a backend or a disk throws at us
                if self._stop.is_set():
                    return  # a stop closed the backend under this step: nothing failed
                failures += 1
                delay = backoff_delay(failures, self.config.interval_s, self.config.max_backoff_s)
                log.error("monitor step failed (%s: %s); retrying in %.1f s",
                          type(exc).__name__, exc, delay)
                if failures == 1 and self.run_dir is not None:
                    self._append_event("monitor_error", error=f"{type(exc).__name__}: {exc}",
                                       retry_in_s=round(delay, 3))
            else:
                failures = 0
                due = next_due(due, began, self.config.interval_s)
                delay = max(0.0, due - time.monotonic())
            self._wake.wait(delay)
            self._wake.clear()

    def _step_and_count(self, number: int) -> None:
        """One step; whatever its outcome, it counts as done for :meth:`refresh`."""
        try:
            self.step()
        finally:
            with self._steps:
                self._steps_finished = number
                self._steps.notify_all()

    def _append_event(self, event: str, **fields: object) -> None:
        # A disk problem must neither stop the monitor nor cost it a sample.
        try:
            runfiles.append_event(self.run_dir, event, **fields)
        except OSError as write_error:
            log.error("cannot record %s: %s", event, write_error)
