"""Prometheus metrics: ``ftmaster launch --metrics-port`` and ``ftmaster monitor --metrics-port``.

One registry per ftmaster process, served by ``prometheus_client``'s HTTP server on
``--metrics-addr`` (127.0.0.1 unless the operator opens it). Across nodes each node's
ftmaster serves its own, labelled with its ``node_rank``.

Names and labels follow NVIDIA's DCGM exporter where it has them, so dashboards built on it
read ftmaster's series too: telemetry as ``DCGM_FI_DEV_*`` gauges, per GPU labels ``gpu``,
``UUID`` (empty where the backend knows none), ``modelName`` and ``Hostname``, plus
``node_rank``. A reading the backend could not take removes its series: unknown is absent,
never a stale or zero value. ``DCGM_FI_DEV_XID_ERRORS`` is the last XID the GPU raised, as
DCGM exporter keeps it (absent until one comes). What DCGM has no name for is ``ftmaster_*``:

* ``ftmaster_gpu_failure_risk`` (0-1), ``ftmaster_gpu_alerts_total``,
  ``ftmaster_stragglers_total`` and ``ftmaster_straggler_drains_total``, per GPU;
* ``ftmaster_supervisor_state`` (an enum), ``ftmaster_attempt``, ``ftmaster_attempts_total``,
  ``ftmaster_failures_total{cause}``;
* ``ftmaster_rto_seconds`` (a failure to its first resumed iteration, the report's RTO),
  ``ftmaster_rpo_iterations`` and ``ftmaster_rpo_seconds`` (iterations a failure threw away,
  and those at the step time measured before it), histograms observed at each resume (a
  node left as a spare by the round's plan observes none for its failure);
* ``ftmaster_checkpoint_age_seconds{tier}`` (since the newest save of the tier) and
  ``ftmaster_persist_lag_iterations`` / ``ftmaster_persist_lag_seconds`` (how far the disk
  copy trails the memory tier; absent until the memory tier's first checkpoint, so a run
  without one shows no lag rather than a 0 that reads as persisted);
* ``ftmaster_iteration``, ``ftmaster_samples_per_second``, ``ftmaster_step_seconds``.

Everything is fed from what ftmaster already reads: the monitor's scored samples, the run's
events and the trainer's heartbeat. No update blocks on a scrape.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Protocol

from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, make_wsgi_app

from ftmaster import runfiles
from ftmaster.addresses import bind_address, host_port
from ftmaster.states import State

GPU_LABELS = ("gpu", "UUID", "modelName", "Hostname", "node_rank")
NODE_LABELS = ("Hostname", "node_rank")

# GpuSample field -> (DCGM exporter field, its help); the units are DCGM's.
DCGM_FIELDS = {
    "temperature": ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)."),
    "power_draw": ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."),
    "gpu_utilization": ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."),
    "memory_utilization": ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %)."),
    "memory_used": ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."),
    "sm_clock": ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)."),
    "power_limit": ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "Power management limit (in W)."),
    "xid": ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered."),
    "ecc_sbe": ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors."),
    "ecc_dbe": ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors."),
    "pcie_replay": ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "Total number of PCIe retries."),
    "throttle_reasons": ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
                         "Throttling reasons bitmask (NVML clocks event reasons)."),
}
SAVE_EVENTS = ("emergency_save", "periodic_save")
KEPT_SAVE_TIMES = 64
RTO_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 3600)
RPO_ITERATION_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)
RPO_SECOND_BUCKETS = (0, 1, 5, 10, 30, 60, 300, 600, 1800, 3600, 7200)


class Observer(Protocol):
    """What the supervisor tells the metrics and TensorBoard."""

    def observe_state(self, state: State) -> None: ...

    def observe_event(self, event: dict) -> None: ...

    def observe_heartbeat(self, heartbeat: dict | None) -> None: ...

    def observe_persisting(self, persisting: bool) -> None: ...


@dataclass(frozen=True)
class Recovered:
    """A failure answered by a resume."""

    rto_s: float
    """From the failure to the first resumed iteration (the report's RTO)."""
    loaded: int | None
    """The iteration the relaunch loaded, where it said; else the one before its first (0: it
    started from scratch)."""
    lost_iterations: int | None
    """The failure's last iteration less the loaded one (the RPO in iterations)."""


class Recoveries:
    """Pairs each round of failures with the resume that ends it, from one node's events."""

    def __init__(self, node_rank: int | None = None) -> None:
        """``node_rank``: this node's across nodes (None on a single node)."""
        self._node_rank = node_rank
        self._failure: dict | None = None
        self._loaded: int | None = None

    def observe(self, event: dict) -> Recovered | None:
        """The recovery ``event`` completes, if it does."""
        kind = event.get("event")
        if kind == "failure":
            if self._failure is None:  # the first of a round is its start
                self._failure, self._loaded = event, None
        elif kind == "plan" and self._stands_by(event):
            # The job resumes on the other nodes, unseen here: this node's next resume is a
            # later round's, and timing the failure to it would add the rounds between.
            self._failure = None
        elif kind == "checkpoint_loaded":
            self._loaded = event.get("iteration")
        elif kind == "resumed" and self._failure is not None:
            failure, self._failure = self._failure, None
            first = event.get("iteration")
            loaded = (self._loaded if isinstance(self._loaded, int)
                      else first - 1 if isinstance(first, int) and first >= 1 else None)
            last = failure.get("iteration")
            return Recovered(max(0.0, event["time"] - failure["time"]), loaded,
                             max(0, last - loaded) if isinstance(last, int) and loaded is not None
                             else None)
        return None

    def _stands_by(self, plan: dict) -> bool:
        """Whether ``plan`` gives this node no ranks (a spare for the round)."""
        nodes, ranks = plan.get("nodes"), plan.get("ranks_per_node")
        if self._node_rank is None or not isinstance(nodes, list) or not isinstance(ranks, list) \
                or self._node_rank not in nodes or len(ranks) != len(nodes):
            return False  # a single node, or a plan from before the fields: it runs here
        return ranks[nodes.index(self._node_rank)] == 0


@dataclass(frozen=True)
class MetricsConfig:
    """Where the metrics are served and how this node is labelled."""

    port: int
    """TCP port of ``/metrics``; 0 takes a free one (the ``metrics`` event names it)."""
    addr: str = "127.0.0.1"
    """Address to bind: loopback unless opened on purpose (``0.0.0.0`` for a remote Prometheus)."""
    hostname: str = field(default_factory=socket.gethostname)
    """The ``Hostname`` label, as DCGM exporter sets it."""
    node_rank: int | None = None
    """The ``node_rank`` label across nodes; empty on a single node."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--metrics-port must be 0-65535, got {self.port}")
        if not self.addr:
            raise ValueError("--metrics-addr must name an address")


def _is_gpu(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


SCRAPE_TIMEOUT_S = 10.0
"""How long a connection may stay silent: prometheus_client's server kept a thread and a file
descriptor for every idle one (a port scan, a stuck health check) for good, and with the
descriptors gone the heartbeat's reads failed and a healthy attempt looked hung."""


class _Handler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT_S

    def log_message(self, *args) -> None:  # a scrape is no console line
        pass


def _serve_http(family, ip: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """prometheus_client's threaded WSGI server for ``registry``, with idle connections
    closed after :data:`SCRAPE_TIMEOUT_S`; served by a daemon thread."""

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = family

        def handle_error(self, request, client_address) -> None:
            pass  # a client gone or silent: nothing the run needs to hear of

    server = make_server(ip, port, make_wsgi_app(registry), Server, handler_class=_Handler)
    threading.Thread(target=server.serve_forever, name="ftmaster-metrics", daemon=True).start()
    return server


class Metrics:
    """The registry and its updates; :meth:`serve` starts the HTTP server."""

    def __init__(self, config: MetricsConfig | None = None) -> None:
        """Without a config the metrics are kept, not served (no ``--metrics-port``)."""
        self.config = config
        self.registry = registry = CollectorRegistry()
        hostname = config.hostname if config else socket.gethostname()
        node_rank = config.node_rank if config else None
        self._node = (hostname, "" if node_rank is None else str(node_rank))
        self._uuids: dict[int, str] = {}
        self._names: dict[int, str] = {}
        self._labelled: dict[int, tuple[str, ...]] = {}
        """Each GPU's labels at its last series."""
        self._with_series: set[int] = set()  # the GPUs the last sample gave values
        self._xids: dict[int, int] = {}  # GPU -> the last XID it raised
        self._lock = threading.Lock()
        self.risk = Gauge("ftmaster_gpu_failure_risk", "The monitor's failure risk score (0-1).",
                          GPU_LABELS, registry=registry)
        self.telemetry = {name: Gauge(dcgm, text, GPU_LABELS, registry=registry)
                          for name, (dcgm, text) in DCGM_FIELDS.items()}
        self.alerts = Counter("ftmaster_gpu_alerts", "Risk alerts raised for the GPU.",
                              GPU_LABELS, registry=registry)
        self.stragglers = Counter("ftmaster_stragglers", "Times the GPU was named a straggler.",
                                  GPU_LABELS, registry=registry)
        self.straggler_drains = Counter("ftmaster_straggler_drains", "Times the GPU was "
                                        "drained as a straggler.", GPU_LABELS, registry=registry)
        self.state = Enum("ftmaster_supervisor_state", "The supervisor's state.", NODE_LABELS,
                          states=[s.value for s in State], registry=registry)
        self.attempt = Gauge("ftmaster_attempt", "The current attempt's number.", NODE_LABELS,
                             registry=registry)
        self.attempts = Counter("ftmaster_attempts", "Attempts launched.", NODE_LABELS,
                                registry=registry)
        self.failures = Counter("ftmaster_failures", "Failed attempts, by cause.",
                                NODE_LABELS + ("cause",), registry=registry)
        self.rto = Histogram("ftmaster_rto_seconds", "From a failure to its first resumed "
                             "iteration.", NODE_LABELS, buckets=RTO_BUCKETS, registry=registry)
        self.rpo_iterations = Histogram("ftmaster_rpo_iterations", "Iterations a failure "
                                        "threw away.", NODE_LABELS,
                                        buckets=RPO_ITERATION_BUCKETS, registry=registry)
        self.rpo_seconds = Histogram("ftmaster_rpo_seconds", "Training time a failure threw "
                                     "away, at the step time before it.", NODE_LABELS,
                                     buckets=RPO_SECOND_BUCKETS, registry=registry)
        self.checkpoint_age = Gauge("ftmaster_checkpoint_age_seconds", "Since the newest "
                                    "checkpoint of the tier.", NODE_LABELS + ("tier",),
                                    registry=registry)
        self.persist_lag_iterations = Gauge("ftmaster_persist_lag_iterations", "The newest "
                                            "memory checkpoint's iteration less the newest "
                                            "on disk.", NODE_LABELS, registry=registry)
        self.persist_lag_seconds = Gauge("ftmaster_persist_lag_seconds", "Since the oldest "
                                         "memory checkpoint newer than the disk's was taken "
                                         "(0: disk is current).", NODE_LABELS, registry=registry)
        self.iteration = Gauge("ftmaster_iteration", "The last completed iteration.",
                               NODE_LABELS, registry=registry)
        self.samples_per_second = Gauge("ftmaster_samples_per_second", "Training samples per "
                                        "second, between the last two heartbeats.", NODE_LABELS,
                                        registry=registry)
        self.step_seconds = Gauge("ftmaster_step_seconds", "Seconds per iteration, between "
                                  "the last two heartbeats.", NODE_LABELS, registry=registry)
        self._saves: dict[str, tuple[int, float]] = {}  # tier -> (iteration, time) newest
        self._taken: dict[str, dict[int, float]] = {}  # tier -> iteration -> when it was taken
        """The newest ``KEPT_SAVE_TIMES`` saves of each tier: a resume from one older than those
        (every newer one failing its checks) dates the age from the newest save's time."""
        self._unpersisted: dict[int, float] = {}  # memory saves newer than the disk's: time
        self._recoveries = Recoveries(node_rank)
        self._on_disk: int | None = None  # the newest iteration durable on disk
        self._persisting = True  # this node copies the memory tier to disk
        self._beat: tuple[int, int, float] | None = None  # iteration, samples, time
        self._step_s: float | None = None

    # -- serving ---------------------------------------------------------------------------
    def serve(self) -> str:
        """Start the HTTP server (a daemon thread); returns the URL it serves. OSError when the
        address cannot be bound, or its name not looked up in time (:func:`bind_address`:
        prometheus_client's own lookup would wait on a hung resolver for good)."""
        assert self.config is not None, "metrics without a config are not served"
        family, address = bind_address(self.config.addr, self.config.port)
        server = _serve_http(family, address[0], self.config.port, self.registry)
        host, port = server.server_address[:2]
        return f"http://{host_port(host, port)}/metrics"

    def close(self) -> None:
        """Nothing to flush: the server thread ends with the process."""

    # -- the monitor -----------------------------------------------------------------------
    def watch(self, monitor) -> None:
        """Feed on ``monitor``'s scored samples and alerts, with its backend's GPU UUIDs
        where it knows them (NVML)."""
        uuids = getattr(monitor.backend, "uuids", None)

        def observe(samples, alerts) -> None:
            if uuids is not None:
                self._uuids.update(uuids())
            self.observe_samples(samples, alerts)

        monitor.sample_listeners.append(observe)

    def observe_samples(self, samples: Iterable, alerts: Iterable) -> None:
        """One scored sample per GPU (``GpuSample``) and the alerts it raised. A GPU the
        sample leaves out (lost, retired, unanswered) keeps no series: its last values would
        read as current."""
        sampled = set()
        for sample in samples:
            if sample.gpu_name:  # an unread first sample named it "" for good
                self._names[sample.gpu_id] = sample.gpu_name
            sampled.add(sample.gpu_id)
            self._set_gpu(sample.gpu_id, lambda name: self._reading(sample, name))
        for gpu in self._with_series - sampled:
            self._set_gpu(gpu, lambda name: None)
        self._with_series = sampled
        for alert in alerts:
            self.alerts.labels(*self._gpu_labels(alert.gpu)).inc()

    def _reading(self, sample, name: str):
        """The sample's ``name``; for the XID, the last one the GPU raised, as DCGM exporter
        keeps it: a sample holds one only in the interval it came, which a scrape between
        two samples (every 15 s against the monitor's 10) would miss."""
        value = getattr(sample, name)
        if name != "xid":
            return value
        if value is not None:
            self._xids[sample.gpu_id] = value
        return self._xids.get(sample.gpu_id)

    def _set_gpu(self, gpu: int, value_of: Callable[[str], object]) -> None:
        labels = self._gpu_labels(gpu)
        before = self._labelled.get(gpu, labels)
        if before != labels:  # a UUID or name learnt since: the old series would stay as it was
            for gauge in (self.risk, *self.telemetry.values()):
                self._set(gauge, before, None)
        self._labelled[gpu] = labels
        self._set(self.risk, labels, value_of("failure_risk"))
        for name, gauge in self.telemetry.items():
            self._set(gauge, labels, value_of(name))

    def _gpu_labels(self, gpu: int) -> tuple[str, ...]:
        return (str(gpu), self._uuids.get(gpu, ""), self._names.get(gpu, ""), *self._node)

    @staticmethod
    def _set(gauge: Gauge, labels: tuple[str, ...], value) -> None:
        if value is None:  # unknown: no series, not a stale one
            try:
                gauge.remove(*labels)
            except KeyError:
                pass
        else:
            gauge.labels(*labels).set(float(value))

    # -- the supervisor --------------------------------------------------------------------
    def observe_state(self, state: State) -> None:
        self.state.labels(*self._node).state(state.value)
        if state not in (State.RUNNING, State.DRAINING):  # nothing trains: no pace to show
            self._beat = None
            for gauge in (self.step_seconds, self.samples_per_second):
                self._set(gauge, self._node, None)

    def observe_heartbeat(self, heartbeat: dict | None) -> None:
        if not heartbeat:
            return
        point = (heartbeat["iteration"], heartbeat.get("consumed_samples"),
                 float(heartbeat.get("time", time.time())))
        self.iteration.labels(*self._node).set(point[0])
        previous, self._beat = self._beat, point
        if previous is None or point[0] <= previous[0] or point[2] <= previous[2]:
            return
        elapsed = point[2] - previous[2]
        self._step_s = elapsed / (point[0] - previous[0])
        self.step_seconds.labels(*self._node).set(self._step_s)
        if isinstance(point[1], int) and isinstance(previous[1], int):
            self.samples_per_second.labels(*self._node).set((point[1] - previous[1]) / elapsed)

    def observe_event(self, event: dict) -> None:
        """One line of the run's ``events.jsonl`` (the supervisor's, the monitor's or the
        trainer's), in order."""
        kind = event.get("event")
        recovered = self._recoveries.observe(event)
        if recovered is not None:
            self._recovered(recovered)
        if kind == "launch":
            self.attempts.labels(*self._node).inc()
            if isinstance(event.get("attempt"), int):
                self.attempt.labels(*self._node).set(event["attempt"])
        elif kind == "failure":
            self.failures.labels(*self._node, str(event.get("cause", "unknown"))).inc()
        elif kind in SAVE_EVENTS:
            self._saved(event)
        elif kind == "replica_merge":  # the survivors' state, merged into the memory tier
            self._saved({**event, "tier": "memory"})
        elif kind == "persisted":
            self._persisted(event.get("iteration"))
        elif kind == "checkpoint_loaded":
            self._resumed_from(event.get("iteration"))
        elif kind in ("straggler", "straggler_drained") and _is_gpu(event.get("gpu")):
            counter = self.stragglers if kind == "straggler" else self.straggler_drains
            counter.labels(*self._gpu_labels(event["gpu"])).inc()

    def _recovered(self, recovered: Recovered) -> None:
        self.rto.labels(*self._node).observe(recovered.rto_s)
        if recovered.lost_iterations is not None:
            self.rpo_iterations.labels(*self._node).observe(recovered.lost_iterations)
            if self._step_s is not None:
                self.rpo_seconds.labels(*self._node).observe(recovered.lost_iterations * self._step_s)

    def _saved(self, event: dict) -> None:
        tier, iteration = event.get("tier", "disk"), event.get("iteration")
        if not isinstance(iteration, int):
            return
        # The state's age counts from when the save took it, not from when it was durable
        # (an async disk save's write can take minutes).
        taken = event["started_at"] if runfiles.is_finite_number(event.get("started_at")) \
            else event["time"]
        with self._lock:
            if tier == "memory":
                self._unpersisted[iteration] = taken
        self._newest(tier, iteration, taken)
        if tier == "memory":
            self._update_lag_iterations()
        else:
            self._persisted(iteration)

    def _newest(self, tier: str, iteration: int, taken: float) -> None:
        """The tier's newest checkpoint is ``iteration``, taken at ``taken``."""
        with self._lock:
            times = self._taken.setdefault(tier, {})
            times[iteration] = taken
            if len(times) > KEPT_SAVE_TIMES:  # a long run saves for weeks
                del times[min(times)]
            first = tier not in self._saves
            if first or iteration >= self._saves[tier][0]:
                self._saves[tier] = (iteration, taken)
        if first:
            self.checkpoint_age.labels(*self._node, tier).set_function(
                lambda: time.time() - self._saves[tier][1])
            if tier == "memory" and self._persisting:  # none before its first checkpoint
                self.persist_lag_seconds.labels(*self._node).set_function(self._lag_seconds)

    def _persisted(self, iteration) -> None:
        """A copy of ``iteration`` is durable on disk: a disk save, or a memory checkpoint
        copied (its age on disk counts from when it was taken)."""
        if not isinstance(iteration, int):
            return
        with self._lock:
            taken = self._unpersisted.get(iteration)
            for older in [i for i in self._unpersisted if i <= iteration]:
                del self._unpersisted[older]
            self._on_disk = iteration if self._on_disk is None else max(self._on_disk, iteration)
        if taken is not None:
            self._newest("disk", iteration, taken)
        self._update_lag_iterations()

    def _resumed_from(self, iteration) -> None:
        """Training loaded ``iteration``: any newer checkpoint was set aside (a node took it
        with it, or it failed its checksums), so it is never persisted nor on disk, and the
        saves of the iterations redone from here are each tier's newest."""
        if not isinstance(iteration, int):
            return
        with self._lock:
            for newer in [i for i in self._unpersisted if i > iteration]:
                del self._unpersisted[newer]
            for tier, (newest, taken) in self._saves.items():
                kept = {i: t for i, t in self._taken.get(tier, {}).items() if i <= iteration}
                self._taken[tier] = kept
                if kept:  # the age is the newest kept save's: a set-aside one was younger
                    self._saves[tier] = (max(kept), kept[max(kept)])
                else:
                    self._saves[tier] = (min(newest, iteration), taken)
            if self._on_disk is not None:
                self._on_disk = min(self._on_disk, iteration)
        self._update_lag_iterations()

    def observe_persisting(self, persisting: bool) -> None:
        """Whether this node's ftmaster copies the memory tier to disk (one node does: across
        nodes the others never see a copy land, and their lag only grew)."""
        self._persisting = persisting
        if persisting:
            self._update_lag_iterations()
            if "memory" in self._saves:
                self.persist_lag_seconds.labels(*self._node).set_function(self._lag_seconds)
            return
        for gauge in (self.persist_lag_iterations, self.persist_lag_seconds):
            with contextlib.suppress(KeyError):
                gauge.remove(*self._node)

    def _update_lag_iterations(self) -> None:
        memory = self._saves.get("memory")
        if memory is not None and self._persisting:
            self.persist_lag_iterations.labels(*self._node).set(
                max(0, memory[0] - (self._on_disk if self._on_disk is not None else 0)))

    def _lag_seconds(self) -> float:
        with self._lock:
            return time.time() - min(self._unpersisted.values()) if self._unpersisted else 0.0


class MetricsUnavailable(ValueError):
    """``--metrics-port``/``--metrics-addr`` cannot be served; the message says why."""


def serve_metrics(port: int, addr: str, node_rank: int | None = None,
                  run_dir: Path | None = None) -> tuple[Metrics, str]:
    """Metrics served on ``addr:port``, and their URL, which ``run_dir``'s ``metrics`` event
    names too: port 0 picks a free one, which a scraper set up from the events must learn."""
    try:
        metrics = Metrics(MetricsConfig(port=port, addr=addr, node_rank=node_rank))
        url = metrics.serve()
    except ValueError as error:
        raise MetricsUnavailable(str(error)) from None
    except OSError as error:
        raise MetricsUnavailable(f"cannot serve metrics on {host_port(addr, port)} "
                                 f"({error.strerror or error}); give another --metrics-port "
                                 f"or --metrics-addr") from None
    if run_dir is not None:
        runfiles.append_event(run_dir, "metrics", url=url)
    return metrics, url
