"""Bounded reads, one worker thread per GPU, so that a wedged GPU blinds only itself.

Every backend that reads GPUs one by one (``nvml``, ``sim``) samples through
:class:`PerGpuReads`:

- each GPU's read for a sample runs as one job on that GPU's own daemon worker, all GPUs at
  once, and the sampler waits for them up to one deadline (``read_timeout_s``; a GPU whose
  set-up is not done, e.g. whose handle is not open yet, gets the longer ``setup_timeout_s``);
- a read that overruns its deadline gives a sample with the fields read so far and the rest
  unknown. While it stays stuck the GPU gets no new job (nothing piles up behind it) and
  reads as unknown; once it has been stuck for ``wedged_after`` samples *and* deadlines it
  is left out of the samples with the condition ``wedged``, so the monitor reports it lost.
  The other GPUs are sampled as usual throughout;
- when every selected GPU (two or more) is stuck that long, the evidence cannot single one
  out: the driver itself looks wedged, and the sample fails with a BackendError instead (the
  monitor reports it and retries) rather than have every GPU retired;
- a read that raises :class:`GpuGone` leaves its GPU out with the given condition;
- only the GPUs selected with :meth:`PerGpuReads.select` are read: an excluded GPU gets no
  call at all;
- :meth:`PerGpuReads.wedge` makes a GPU's reads block until :meth:`PerGpuReads.release`,
  which is how ``--inject wedge`` exercises exactly the path a wedged driver takes.

Workers are daemon threads (not a ThreadPoolExecutor, whose workers are joined at exit) so a
call stuck in the driver can never keep the process from exiting.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterable

from ftmaster.faults import Fault, Injection
from ftmaster.monitor.backends import BackendError
from ftmaster.monitor.sample import GpuSample

log = logging.getLogger("ftmaster.monitor")

WEDGED = "wedged"


class CallTimeout(Exception):
    """A bounded call did not return within its deadline (or an earlier one is still stuck)."""


class GpuGone(Exception):
    """Raised by a GPU's read: the GPU is gone; ``condition`` says how (e.g. ``gpu_is_lost``)."""

    def __init__(self, condition: str) -> None:
        super().__init__(condition)
        self.condition = condition


@dataclass(frozen=True)
class ReadBounds:
    """Deadlines for a backend's driver calls."""

    read_timeout_s: float = 1.0
    """Deadline for one GPU's reads in one sample, all its calls together. Fields not read by
    then are unknown in that sample."""
    setup_timeout_s: float = 30.0
    """Deadline for each set-up step: starting the library, counting GPUs, and a GPU's first
    read, which opens its handle. Without persistence mode opening a handle initialises the
    GPU, over a second each, and a driver may do that for one GPU at a time."""
    wedged_after: int = 3
    """A GPU whose read is still stuck this many consecutive samples later (the one it overran
    in counts) and this many of its deadlines later (read or set-up) is reported lost with
    reason ``wedged``. Both, so that neither back-to-back samples nor one long interval make
    a slow read look wedged."""

    def __post_init__(self) -> None:
        if not (self.read_timeout_s > 0 and self.setup_timeout_s > 0):
            raise ValueError(f"read and set-up deadlines must be > 0 s, got {self.read_timeout_s} "
                             f"and {self.setup_timeout_s}")
        if self.wedged_after < 1:
            raise ValueError(f"wedged_after must be >= 1, got {self.wedged_after}")


class _Job:
    """One call to run on a worker; ``done`` is set once it returned or raised."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.name = getattr(fn, "__name__", repr(fn))
        self.started = time.monotonic()
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except BaseException as exc:  # handed back to whoever waits, who decides
            self.error = exc
        finally:
            self.done.set()

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class Worker:
    """A daemon thread that runs one job at a time, each with a deadline."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stuck: _Job | None = None
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Job:
        job = _Job(fn, args)
        self._jobs.put(job)
        return job

    def stuck_call(self) -> _Job | None:
        """The job that overran its deadline and has still not returned, if any."""
        if self._stuck is not None and self._stuck.done.is_set():
            self._stuck = None
        return self._stuck

    def call(self, timeout_s: float, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on this worker; CallTimeout past ``timeout_s`` or while an earlier call
        is still stuck (the new one would only queue behind it)."""
        stuck = self.stuck_call()
        if stuck is not None:
            raise CallTimeout(f"{stuck.name} has been stuck for "
                              f"{time.monotonic() - stuck.started:.1f} s")
        job = self.submit(fn, *args)
        if not job.done.wait(timeout_s):
            self._stuck = job
            raise CallTimeout(f"{job.name} did not return within {timeout_s:g} s")
        return job.result()

    def stop(self) -> None:
        """Let the thread end after its current job (a stuck one ends when the call returns)."""
        self._jobs.put(None)


def call_once_bounded(name: str, timeout_s: float, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a fresh daemon thread; CallTimeout past ``timeout_s`` (the thread is
    left to the stuck call)."""
    worker = Worker(name)
    try:
        return worker.call(timeout_s, fn, *args)
    finally:
        worker.stop()


STOP_POLL_S = 0.1
"""How often a wait that a stop signal abandons looks for it: well within SLURM's grace."""


class Abandoned(Exception):
    """The caller stopped waiting for a call that still runs (left to its daemon thread)."""


def call_while(name: str, wanted: Callable[[], bool], poll_s: float, fn: Callable[..., Any],
               *args: Any) -> Any:
    """``fn(*args)`` on a fresh daemon thread, asking ``wanted()`` every ``poll_s`` while it
    runs; Abandoned once that says no (``wanted`` may raise too). For calls that block in C++,
    such as torch's store, where a signal's Python handler runs only once they return."""
    worker = Worker(name)
    try:
        job = worker.submit(fn, *args)
        while not job.done.wait(poll_s):
            if not wanted():
                raise Abandoned(f"{job.name} abandoned after "
                                f"{time.monotonic() - job.started:.1f} s")
        return job.result()
    finally:
        worker.stop()


@dataclass
class Reading:
    """One GPU's read in progress: the sample it fills and the driver conditions it met
    (``reset_required``, ``row_remap_failure``: states the CSV columns cannot hold)."""

    sample: GpuSample
    conditions: list[str] = field(default_factory=list)
    calling: str = "its first call"
    """The call in progress, named when the read gets stuck."""

    def note(self, condition: str) -> None:
        if condition not in self.conditions:
            self.conditions.append(condition)


ReadFn = Callable[[int, Reading], None]


class PerGpuReads:
    """Samples a set of GPUs, each on its own worker, within :class:`ReadBounds`."""

    def __init__(self, gpus: Iterable[int], bounds: ReadBounds, name: str) -> None:
        self.bounds = bounds
        self.name = name
        self.gpus = frozenset(gpus)
        self._selected = self.gpus
        self._workers: dict[int, Worker] = {}
        self._workers_lock = threading.Lock()  # a stop closes them while a sample may start more
        self._closed = False
        self._stuck: dict[int, tuple[_Job, Reading, float]] = {}  # job, its reading, its deadline
        self._stuck_samples: dict[int, int] = {}
        self._wedges: dict[int, threading.Event] = {}
        self._wedged: set[int] = set()  # reported wedged, not answered since
        self.conditions: dict[int, tuple[str, ...]] = {}
        """Per GPU, the driver conditions of the latest sample; GPUs left out have theirs here."""

    def select(self, gpus: Iterable[int]) -> None:
        """Read only ``gpus`` (ids this reader does not have are ignored) from the next sample on."""
        self._selected = self.gpus & frozenset(gpus)

    def wedge(self, gpu: int) -> None:
        """Make every read of ``gpu`` block, as in a wedged driver, until :meth:`release`."""
        self._wedges.setdefault(gpu, threading.Event())

    def release(self, gpu: int) -> None:
        gate = self._wedges.pop(gpu, None)
        if gate is not None:
            gate.set()

    def close(self) -> None:
        with self._workers_lock:
            self._closed, workers = True, list(self._workers.values())
            self._workers.clear()
        for gpu in list(self._wedges):
            self.release(gpu)
        for worker in workers:
            worker.stop()

    def read(self, read_one: ReadFn, now: float, set_up: Container[int] | None = None) -> list[GpuSample]:
        """One sample of every selected GPU: ``read_one(gpu, reading)`` fills ``reading``.

        GPUs not in ``set_up`` (None: all are) get the set-up deadline."""
        selected = sorted(self._selected)
        for gpu in [g for g, (job, _, _) in self._stuck.items() if job.done.is_set()]:
            log.info("%s: GPU %d answers again", self.name, gpu)
            del self._stuck[gpu]  # its late result belongs to a past sample
            self._stuck_samples.pop(gpu, None)
            self._wedged.discard(gpu)
        jobs = {}
        for gpu in selected:
            if gpu not in self._stuck:
                ready = set_up is None or gpu in set_up
                deadline = self.bounds.read_timeout_s if ready else self.bounds.setup_timeout_s
                jobs[gpu] = self._start(gpu, read_one, now) + (deadline,)
        for job, _, deadline in jobs.values():
            job.done.wait(max(0.0, job.started + deadline - time.monotonic()))
        samples: dict[int, GpuSample | None] = {}
        conditions: dict[int, tuple[str, ...]] = {}
        overran = []
        for gpu in selected:
            job, reading, deadline = jobs.get(gpu) or self._stuck[gpu]
            if job.done.is_set():
                samples[gpu] = self._finished(gpu, job, reading, fresh=gpu in jobs, now=now)
            else:
                overran.append(gpu)
                samples[gpu] = self._overran(gpu, (job, reading, deadline), fresh=gpu in jobs, now=now)
            if reading.conditions:
                conditions[gpu] = tuple(reading.conditions)
        wedged = [gpu for gpu in overran if samples[gpu] is None]
        if wedged and len(selected) >= 2 and len(overran) == len(selected):
            if len(wedged) == len(selected):
                raise BackendError(f"all {len(selected)} GPUs have been stuck in the driver for "
                                   f"several deadlines: the driver looks wedged, not one GPU")
            # Every GPU is stuck, some only a little less long: the driver, not one GPU, until
            # the others answer; naming the first one wedged would retire a healthy GPU. One
            # named already stays out: brought back, it would be reported lost again next time.
            held_back = [gpu for gpu in wedged if gpu not in self._wedged]
            samples.update({gpu: GpuSample(timestamp=now, gpu_id=gpu) for gpu in held_back})
            wedged = [gpu for gpu in wedged if gpu in self._wedged]
        for gpu in wedged:
            conditions[gpu] = (WEDGED,)
        self._report_wedged(wedged)
        self.conditions = conditions
        return [sample for sample in samples.values() if sample is not None]

    def _report_wedged(self, wedged: list[int]) -> None:
        for gpu in wedged:
            if gpu not in self._wedged:
                self._wedged.add(gpu)
                job, reading, _ = self._stuck[gpu]
                log.warning("%s: GPU %d has been stuck in %s for %.1f s: wedged",
                            self.name, gpu, reading.calling, time.monotonic() - job.started)

    def _start(self, gpu: int, read_one: ReadFn, now: float) -> tuple[_Job, Reading]:
        with self._workers_lock:
            if self._closed:
                raise BackendError(f"{self.name}: closed while sampling")
            worker = self._workers.get(gpu)
            if worker is None:
                worker = self._workers[gpu] = Worker(f"{self.name}-gpu{gpu}")
        reading = Reading(GpuSample(timestamp=now, gpu_id=gpu))
        return worker.submit(self._gated, read_one, gpu, reading), reading

    def _gated(self, read_one: ReadFn, gpu: int, reading: Reading) -> None:
        gate = self._wedges.get(gpu)
        if gate is not None:
            reading.calling = "an injected wedge"
            gate.wait()
        read_one(gpu, reading)

    def _finished(self, gpu: int, job: _Job, reading: Reading, fresh: bool,
                  now: float) -> GpuSample | None:
        """The sample of a GPU whose read returned: None (left out) when it found the GPU
        gone; unknown when it was stuck and returned only while this sample waited, since what
        it read belongs to the sample it began in (and carries that sample's time)."""
        self._stuck_samples.pop(gpu, None)
        self._wedged.discard(gpu)
        if isinstance(job.error, GpuGone):  # how it went comes first: it is why it is lost
            reading.conditions = [job.error.condition] + [c for c in reading.conditions
                                                          if c != job.error.condition]
            return None
        if job.error is not None:  # a bug or an odd binding: what was read stands, the rest is unknown
            log.debug("%s: reading GPU %d failed: %r", self.name, gpu, job.error)
        return reading.sample if fresh else GpuSample(timestamp=now, gpu_id=gpu)

    def _overran(self, gpu: int, stuck: tuple[_Job, Reading, float], fresh: bool,
                 now: float) -> GpuSample | None:
        """The sample of a GPU whose read has not returned: partial when it overran just now,
        unknown while it stays stuck, None (left out: wedged) once stuck long enough."""
        self._stuck[gpu] = stuck
        job, reading, deadline = stuck
        count = self._stuck_samples[gpu] = self._stuck_samples.get(gpu, 0) + 1
        stuck_s = time.monotonic() - job.started
        if count >= self.bounds.wedged_after and stuck_s >= self.bounds.wedged_after * deadline:
            return None
        if fresh:
            log.warning("%s: GPU %d is stuck in %s; its unread fields are unknown",
                        self.name, gpu, reading.calling)
            return copy.copy(reading.sample)
        return GpuSample(timestamp=now, gpu_id=gpu)


class PerGpuBackend:
    """The monitor's controls of a backend that reads through :class:`PerGpuReads` (``_reads``)."""

    _reads: PerGpuReads

    @property
    def conditions(self) -> dict[int, tuple[str, ...]]:
        """Driver conditions per GPU in the latest sample; GPUs left out have theirs here."""
        return self._reads.conditions

    def select_gpus(self, watched: Iterable[int] | None, excluded: Iterable[int]) -> None:
        """Read only ``watched`` (None: every GPU of this backend) minus ``excluded``."""
        gpus = self._reads.gpus if watched is None else frozenset(watched)
        self._reads.select(gpus - frozenset(excluded))

    def inject(self, injection: Injection) -> None:
        """``wedge``: every read of the GPU blocks, as in a wedged driver, until a ``recover``."""
        if injection.kind is Fault.WEDGE:
            self._reads.wedge(injection.gpu)
        elif injection.kind is Fault.RECOVER:
            self._reads.release(injection.gpu)
