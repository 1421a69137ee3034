"""The supervisor: drives :mod:`ftmaster.states` with real processes, files and the monitor.

Each state has one handler that does that state's work and returns a trigger; the table in
:mod:`ftmaster.states` says where it leads. Handlers poll every ``poll_interval_s``.

**GPUs.** ``gpus`` lists the GPU ids (NVML indices) of the first attempt; local rank ``r``
of an attempt runs on that attempt's ``gpus[r]`` (``CUDA_VISIBLE_DEVICES`` lists them in that
order, by UUID where NVML gave them: see :mod:`ftmaster.gpus`). With the ``sim`` backend on a
CPU machine a "GPU" is a virtual slot: the local rank index of the first attempt, 0..N-1. The
monitor watches the GPUs of the current attempt only.

**Health.** The monitor reports evidence; the supervisor decides. A GPU the monitor reports
lost, or whose evidence says it needs a reset or replacement (a critical XID, a double-bit
ECC error, a recovery action, a failed row remap, ``RESET_REQUIRED``, a wedged driver), is
retired at the next plan, which names it and why (``gpus_retired``), and never planned on
again. Before deciding, the supervisor has the monitor sample at once (an XID and the CUDA
error it causes arrive together; the next regular sample can be seconds away). A failure
while such a GPU was in the attempt is a hardware failure: never counted as the script's
early exit.

**Failures.** A rank that exits non-zero, no new heartbeat iteration and no checkpoint file
written for ``hang_timeout_s`` (``hang``; before the first heartbeat of an attempt the limit is
``startup_timeout_s``), or a GPU of the attempt that the monitor reports lost or a ``fail``
injection marks lost (``device_lost``). The rank that failed first names the cause: its exit
status says whether the trainer stopped on a NaN loss (``nonfinite``), a storage error
(``storage``), no loadable checkpoint (``no_checkpoint``), its arguments (``usage``) or a
peer that failed while a memory checkpoint was read from it (``peer_read``), none of which is
put on a GPU, nor is a plain exit or hang while the run directory is out of room
(``run_dir``: each attempt's log is training's own output); anything else is an ``exit`` on
that rank's GPU. The whole attempt is killed at once: gloo cannot abort a collective, so the
survivors would otherwise wait out their timeout. A GPU lost at planning time is dropped for
good (the monitor stops watching it); a hang or a plain exit relaunches on the same GPUs. A
relaunch cannot cure a storage error, a full run directory, a missing checkpoint or bad
arguments, nor a NaN loss that came back from the same checkpoint: those end the run at
once, with every failure of the run in one line and the root cause (the first failed rank's
exception, when a rank ended it) on the console. Training that has finished and made its last
checkpoint durable is never a hang, however long its exit takes; training that exits 0 on a
signal ftmaster did not send, before its schedule's end, is a failure, resumed.

**Across nodes** (a :class:`~ftmaster.membership.NodeMembership`), every plan is agreed in a
rendezvous round: this node publishes the GPUs it can schedule, every node runs the same
planner on the same per-node list (``plan_nodes``), and each starts a static torchrun for
that generation with its share of the ranks; a node given none stands by. A failure here
joins the next round; a peer waiting for one (a failure elsewhere, or a node that joined)
stops the local attempt and joins too: at once with ``scale_up="now"``, after an agreed save
with ``"at-save"``. The restart budget counts rounds, job-wide. When the rendezvous store is
gone, the local attempt is killed and the supervisor ends with exit status 75: requeue the
job; after a stop signal it ends as the stop instead (a requeue would undo a scancel). Only the end of the whole job closes the rendezvous.

**Continuity.** Attempt numbers continue those already in the run directory: a supervisor
started again on it (after its predecessor was killed) records the attempt that died with it
as a ``supervisor_lost`` failure and resumes from ``--save``.

**Injections** (``--inject``) are applied here, on the heartbeat's iteration or seconds since
the supervisor started, and handed to the monitor's telemetry at the same moment:
``fail`` SIGKILLs the rank on that GPU and marks the GPU lost, ``hang`` SIGSTOPs it,
``degrade`` only changes telemetry, ``recover`` (which waits until its GPU is lost) brings a
lost GPU back (and clears its injected XID and wedge). ``nan`` is handed to the next attempt
that runs on its GPU, whose rank poisons its gradients at that iteration. ``xid`` shows the
XID in the telemetry and makes the rank on that GPU raise the CUDA error it brings (SIGUSR2,
armed only in rehearsals); until a ``recover``, a rank started on that GPU fails at start-up
the same way (see ``megatron.training.rehearsal``). ``wedge`` makes the monitor's reads of the
GPU block.
"""

from __future__ import annotations

import functools
import logging
import shutil
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import psutil

from ftmaster import runfiles
from ftmaster.attempt import (Attempt, classify_exits, failed_despite_the_stop, send_signal,
                              with_exit_signal_handler)
from ftmaster.console import (END_EVENTS, SAVE_EVENTS, FileTail, Progress, describe_event, gpus_text,
                              new_events)
from ftmaster.faults import CUDA_ERROR_ENV, CUDA_ERROR_SIGNAL, Fault, Injection
from ftmaster.gpus import JobGpus
from ftmaster.membership import (UNTOLD_END, JobEnded, JoinTimedOut, NodeMembership, NodeRecord,
                                 Round, StoreLost)
from ftmaster.metrics import Observer
from ftmaster.monitor.backends.bounded import Abandoned, CallTimeout, Worker, call_while
from ftmaster.monitor.daemon import DEVICE_LOST, Alert, Monitor
from ftmaster.monitor.stragglers import StragglerConfig, positive_figure
from ftmaster.persist import Persisted, PersistError, Persister, PersistSuperseded, tiers_of
from ftmaster.replication import MemoryAgreement, Replication, ReplicationFailed, rank_ranges
from ftmaster.retirements import boot_id, carried_over
from ftmaster.recovery.argv_flags import flag_present, int_flag
from ftmaster.recovery.batch_schedule import read_step_schedule
from ftmaster.recovery.checkpoints import (folder_written_at, holds_checkpoints, iteration_dir,
                                           list_iterations, newest_held, newest_on_disk,
                                           read_save_kind, read_tracker, remove_abandoned_writes,
                                           same_folder, schedule_on_disk, unmark_peer_copies)
from ftmaster.recovery.megatron_args import (STARTING_WEIGHTS_ONLY, flag_value, resume_from_save,
                                             uses_trainer_parser)
from ftmaster.recovery.manifest import MANIFEST_NAME
from ftmaster.recovery.planner import (MAX_TOLERANCE_PCT, MODES, Plan, PlanError,
                                       plan_layout, plan_nodes)
from ftmaster.recovery.torchrun import StaticWorld, shutdown_timeout_env
from ftmaster.replica_recovery import FLAG as REPLICA_FLAG
from ftmaster.replica_recovery import (DUMP_TIMEOUT_S, MERGE_TIMEOUT_S, ReplicaRecovery,
                                       request_flag_path)
from ftmaster.states import (IDLE_STATES, POLICIES, TERMINAL, State, Trigger, advance,
                             after_failure, exit_status, is_early_exit, requeue_advice)
from ftmaster.stragglers import Found, StragglerWatch, decide_drain
from ftmaster.warm import LaunchCancelled, WarmStarter

# Read by megatron.training.rehearsal (the trainer side of injected faults).
NAN_INJECTION_ENV = "FTMASTER_INJECT_NAN"
SLOW_INJECTION_ENV = "FTMASTER_INJECT_SLOW"
SLOW_FILE_PREFIX = "slow_"
"""``RANK_DIR/slow_<local rank>`` holds the factor an injected ``slow`` slows that rank by,
from the moment it is due (``at=Ns`` or ``after=``; ``at=iter:K`` is armed at launch)."""
# How long a decision waits for the monitor's fresh sample (reads are bounded well below).
EVIDENCE_TIMEOUT_S = 5.0
# How long a node lets its own ranks end on their own after a peer announced the round's
# failure with a cause every rank shares (a refused fresh start, a non-finite loss, a peer
# that failed a memory checkpoint's load): they end on every node at once, and each node
# should report its own ranks' error, not "peer".
# Any other cause stops the ranks at once (they may be blocked on a dead peer, or parked
# for a replica dump).
PEER_FAILURE_GRACE_S = 2.0
SHARED_CAUSES = ("usage", "nonfinite", "peer_read")
SCALE_UP_POLICIES = ("now", "at-save")
CHECKPOINT_LOOK_S = 5.0
"""How long a look at the checkpoint folders (is an idle attempt still writing a save?) may
hold the supervisor up: on a file system that stopped answering it never returns
(:meth:`Supervisor._seconds_since_checkpoint_write` says what no answer counts as)."""
PERSIST_WAIT_NOTICE_S = 30.0
"""At the run's end, how often the wait for the last persist copy says it is still waiting."""

log = logging.getLogger("ftmaster")
LOG_TAIL_LINES = 30
SUSPENDED_GAP_S = 60.0
"""A gap this long between two polls of a running attempt: the job step was stopped and
resumed (SLURM's ``scontrol suspend``, gang scheduling's SIGSTOP), ranks with it; the hang
timer skips it. Counted, a suspension past ``--hang-timeout`` was a hang at every resume."""
DRAIN_RESULT_STEPS = 5
"""Steps between heartbeats the step time after a straggler's drain is the median of."""
REWEIGH_ITERATIONS = 5
"""Iterations after which a straggler the cost model kept is weighed again, on every step
measured since it slowed the job: named early, its slowdown is under-measured (on 4 CPU ranks
a 2x straggler was named at 1.40x and kept, then held the job at 1.3 s/iteration, against the
1.1 estimated without it, to the attempt's end)."""


@dataclass(frozen=True)
class SupervisorConfig:
    run_dir: Path
    """The run directory (DESIGN's contract); attempt logs go to its ``logs/``."""
    command: tuple[str, ...]
    """``SCRIPT ARGS...`` as the user gave them; every relaunch is planned from these."""
    first_plan: Plan | None
    """The layout of the first attempt, checked against all of ``gpus``; None across nodes,
    where the first rendezvous round plans it."""
    gpus: tuple[int, ...]
    """GPU ids of the first attempt, in local-rank order."""
    devices: JobGpus | None = None
    """How attempts tell CUDA their GPUs (UUIDs, hidden GPUs); None: by index."""
    gpus_per_node: int | None = None
    """Passed to the planner: TP stays within one node. None: a single node."""
    policy: str = "available"
    """``available``, ``wait`` or ``drain`` (see ``ftmaster launch --help``)."""
    max_restarts: int = 3
    """Relaunches allowed before giving up."""
    hang_timeout_s: float = 300.0
    """No new iteration for this long is a hang."""
    startup_timeout_s: float = 1800.0
    """No first iteration for this long after a launch is a hang."""
    wait_timeout_s: float = 600.0
    """Policy ``wait``: how long to wait for lost GPUs before relaunching without them."""
    stop_timeout_s: float = 120.0
    """After SIGTERM, how long training may take to save and exit before SIGKILL."""
    poll_interval_s: float = 0.1
    """How often processes, heartbeat and monitor are checked."""
    plan_mode: str = "closest"
    """The planner's mode."""
    gpu_memory_gb: float | None = None
    """Per-GPU memory for the planner's estimate; None: not checked."""
    injections: tuple[Injection, ...] = ()
    """Faults to inject (rehearsals)."""
    progress_interval_s: float = 10.0
    """Seconds between progress lines on the console."""
    scale_up: str = "at-save"
    """Across nodes, when a peer waits for a new round: ``now`` stops training at once;
    ``at-save`` first asks for an agreed save, and stops once it is durable."""
    scratch_memory_dir: Path | None = None
    """A memory-tier folder ftmaster picked for this run (in ``/dev/shm``): removed once the
    run ended (succeeded, stopped or gave up) and everything in it is on disk, since it holds
    node memory."""
    global_batch_tolerance_pct: float = 0.0
    """How far (percent) a relaunch may move the global batch for a better layout; the
    schedule is then rewritten in samples (see ``ftmaster.recovery.batch_schedule``)."""
    stragglers: StragglerConfig = StragglerConfig()
    """When a slow rank is reported as a straggler."""
    drain_stragglers: bool = False
    """Drain a straggler's GPU when the cost model says the job runs faster without it."""
    straggler_drain_window_s: float = 600.0
    """At most one straggler drained per this many seconds."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("the training command is empty")
        if not self.gpus or len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"gpus must be distinct and non-empty, got {list(self.gpus)}")
        if self.first_plan is not None and self.first_plan.num_gpus_used != len(self.gpus):
            raise ValueError(f"the first plan uses {self.first_plan.num_gpus_used} GPUs, "
                             f"not the {len(self.gpus)} given")
        if self.scale_up not in SCALE_UP_POLICIES:
            raise ValueError(f"scale-up must be one of {', '.join(SCALE_UP_POLICIES)}, got "
                             f"{self.scale_up!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.plan_mode not in MODES:
            raise ValueError(f"plan mode must be one of {', '.join(MODES)}, got {self.plan_mode!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.global_batch_tolerance_pct <= MAX_TOLERANCE_PCT:
            raise ValueError(f"the global batch tolerance must be within 0 and "
                             f"{MAX_TOLERANCE_PCT:g} percent, got {self.global_batch_tolerance_pct:g}")
        for name in ("hang_timeout_s", "startup_timeout_s", "wait_timeout_s", "stop_timeout_s",
                     "poll_interval_s", "progress_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class Injector:
    """The injections not yet applied; ``recover`` waits until its GPU is lost, ``after=EVENT``
    until the run recorded that event."""

    def __init__(self, injections: tuple[Injection, ...]) -> None:
        self.pending = list(injections)
        self.seen_events: set[str] = set()
        self.handed: list[Injection] = []
        """The armed injections handed to the running attempt."""
        self.reached: int | None = None
        """The furthest iteration the running attempt is known to have trained."""
        self.first: int | None = None
        """The first iteration the running attempt trained (a resume past a ``nan``'s
        iteration never poisons it: the trainer poisons that iteration alone)."""

    def saw(self, event: dict) -> None:
        self.seen_events.add(event["event"])
        if event["event"] == "nonfinite":  # a poisoned step that killed the attempt counts
            self.trained(event.get("iteration"))

    def trained(self, iteration: int | None, first: int | None = None) -> None:
        if isinstance(iteration, int) and (self.reached is None or iteration > self.reached):
            self.reached = iteration
        if isinstance(first, int) and self.first is None:
            self.first = first

    def take_due(self, iteration: int | None, elapsed_s: float, lost: frozenset[int]) -> list[Injection]:
        seen = frozenset(self.seen_events)
        due = [i for i in self.pending if i.due(iteration, elapsed_s, seen) and not _armed(i)
               and (i.kind is not Fault.RECOVER or i.gpu in lost)]
        for injection in due:
            self.pending.remove(injection)
        return due

    def take_armed(self, gpus: Sequence[int]) -> list[Injection]:
        """The injections handed to the attempt that runs on these GPUs, at its launch
        (once): ``nan``, and ``slow`` at an iteration, so that it starts exactly there. Those
        the last attempt ended before reaching are pending again: that fault never happened."""
        self.pending.extend(self._not_reached())
        taken = [i for i in self.pending if _armed(i) and i.gpu in gpus]
        for injection in taken:
            self.pending.remove(injection)
        self.handed, self.reached, self.first = taken, None, None
        return taken

    def unfired(self) -> list[Injection]:
        """What never fired: the pending, and those the last attempt ended before reaching."""
        return self.pending + self._not_reached()

    def _not_reached(self) -> list[Injection]:
        return [i for i in self.handed if self.reached is None or i.at_iteration > self.reached
                or i.kind is Fault.NAN and self.first is not None and i.at_iteration < self.first]


def _armed(injection: Injection) -> bool:
    return injection.kind is Fault.NAN or (injection.kind is Fault.SLOW and injection.after is None
                                           and injection.at_iteration is not None)


def run_files_outage() -> runfiles.WriteOutage:
    """How ftmaster writes its run files: a run directory out of room mid-run is said, and
    supervising goes on."""
    return runfiles.WriteOutage(log.error, log.info, "ftmaster supervises on without that record")


class Supervisor:
    def __init__(self, config: SupervisorConfig, monitor: Monitor,
                 membership: NodeMembership | None = None,
                 starter: WarmStarter | None = None, observers: Sequence[Observer] = (),
                 replication: Replication | None = None) -> None:
        self.config = config
        self.replication = replication  # peer copies of a node-local memory tier
        self._stop_requested = threading.Event()
        self.agreement = (MemoryAgreement(membership, replication, self._stop_requested)
                          if replication is not None and membership is not None else None)
        self._dumped: tuple | None = None  # across nodes: (round, dump folder, nodes, ranks per node)
        self._round_failed_for: int | None = None  # the agreed iteration a catch-up failed a round for
        self.observers = tuple(observers)  # the metrics endpoint, TensorBoard
        self.starter = starter  # warm workers; None: every attempt under torchrun
        self.run_dir = Path(config.run_dir)
        self.run_files = run_files_outage()
        self.monitor = monitor
        self.membership = membership
        self.round: Round | None = None
        self.world: StaticWorld | None = None
        self._rejoin_requested_at: float | None = None
        self._peer_failure_seen: tuple[int, float] | None = None  # (attempt, monotonic time)
        monitor.on_alert = self._on_alert
        self.injector = Injector(config.injections)
        self.attempt: Attempt | None = None
        self.plan = config.first_plan
        self.next_gpus = config.gpus
        self.restarts = 0
        self.early_exits_in_row = 0
        self.retired: dict[int, str] = {}  # GPU -> why it is never planned on again
        self.injected_lost: set[int] = set()
        self.injected_xids: dict[int, int] = {}  # GPU -> XID needing a reset, until a recover
        # The trainer's handler turns an XID's signal into the CUDA error, and its rank holds
        # the signal until the handler is armed; another script has none (the signal kills).
        self._rehearses_xids = (any(i.kind is Fault.XID for i in config.injections)
                                and uses_trainer_parser(Path(config.command[0])))
        self.signum: int | None = None
        if starter is not None:
            starter.stop_waiting_on(self._stop_requested)
        self._alerts: deque[Alert] = deque()
        self._started = time.monotonic()
        self._progress: tuple[int | None, float] = (None, 0.0)
        self._polled_at: float | None = None  # the last poll of a running attempt (suspensions)
        self._finished_at: float | None = None
        self._resume_point = 0  # the iteration the current attempt starts from
        self._loaded_iteration: int | None = None  # the checkpoint it loaded, once it says so
        self._schedule_saved: int | None = None  # training's last checkpoint, durable on disk
        self._training_command: list[str] = list(config.command)  # the running attempt's
        self._nonfinite_from: set[int] = set()  # checkpoints a NaN loss came back from
        self._nonfinite_again = False
        self._last_failure: tuple[str, int | None] = ("exit", None)  # cause, first local rank
        self._failures: list[str] = []  # each failure's line, for the give-up's summary
        self._failed_since_launch = False  # a give-up now ends the run on that failure
        self._last_checkpoint: dict | None = None
        self._original_step_s: float | None = None  # measured on the original layout
        self.stragglers = StragglerWatch(config.stragglers, config.drain_stragglers,
                                         config.straggler_drain_window_s)
        self._straggler_to_drain: Found | None = None
        self._straggler_waiting: Found | None = None
        """The straggler kept for the drain window, to be weighed once it is over."""
        self._straggler_ambiguous: Found | None = None
        """The straggler kept while a rank of its model replica is slow too (said once)."""
        self._straggler_kept: tuple[Found, int | None] | None = None
        """The straggler the cost model kept, and the iteration it was weighed at."""
        self._stragglers_behind: list[Found] = []
        """Stragglers kept while a slower one is weighed (one drain at a time)."""
        self._drain_reason: str | None = None  # why the GPU being drained goes
        self._drain_step_s: float | None = None  # a straggler's: the job's step with it
        self._unslowed_step_s: float | None = None
        """The step this attempt's layout takes without the straggler it is draining (the
        drain's calibration): its own steps were slowed."""
        self.tiers = tiers_of(config.command[1:])
        self._remove_abandoned_writes()
        if self.tiers is not None and replication is None:
            try:
                unmark_peer_copies(self.tiers.memory)
            except OSError as error:
                log.warning("letting go of an earlier run's marks in %s: %s", self.tiers.memory,
                            error)
        # Across nodes one node's ftmaster copies the memory tier to disk: node 0 from the
        # shared folder; with node-local folders, the node of the trainer's rank 0 in the
        # round (its folder gets the manifest first), from its own folder once peer copies
        # made it whole, else from the nodes that hold each file.
        self._persists_here = membership is None or (
            replication is None and membership.config.node_rank == 0)
        self._tell("observe_persisting", self._persists_here)
        self.persister = (Persister(self.tiers.memory, self.tiers.disk)
                          if self.tiers is not None and (self._persists_here or replication)
                          else None)
        self._memory_kind_read: tuple[tuple | None, str | None] = (None, None)
        self.replicas = (ReplicaRecovery(self.run_dir, self.tiers.memory, self.tiers.disk,
                                         self._event, starter)
                         if REPLICA_FLAG in config.command and self.tiers is not None else None)
        self._last_persist_start = time.monotonic()
        self.progress: Progress | None = None
        self.events_tail = FileTail(runfiles.events_path(self.run_dir))
        self._checkpoint_looks = Worker("ftmaster-checkpoint-look")
        self._looks_unanswered_since: float | None = None
        self._evaluated: int | None = None
        """The validation steps the last heartbeat said were done at its iteration."""
        self._loaded_elsewhere: int | None = None
        """The newest iteration this run loaded from outside its own tiers (its --load)."""
        self.attempts_before = self._take_over_previous_attempts()
        self._drain_gpu: int | None = None
        self._drain_since = 0.0
        self._requeue_helps = True  # on giving up: whether a requeue may cure it
        self._handlers: dict[State, Callable[[], Trigger]] = {
            State.STARTING: functools.partial(self._launch, State.STARTING),
            State.RELAUNCHING: self._launch,
            State.RUNNING: self._watch, State.DRAINING: self._drain, State.FAILED: self._decide,
            State.WAITING: self._wait, State.PLANNING: self._plan, State.STOPPING: self._stop,
            State.STANDBY: self._standby,
        }

    # -- entry points --------------------------------------------------------------------------
    def request_stop(self, signum: int) -> None:
        """From a signal handler: stop training gracefully and end. A second signal (an
        impatient Ctrl-C) changes nothing: the first is the one that stopped the run, said
        on the console, and its number is in the exit status and the ``stopped`` event."""
        if self.signum is None:
            self.signum = signum
        self._stop_requested.set()

    def run(self) -> int:
        """Supervise until a terminal state; returns ftmaster's exit status."""
        # Across nodes even the first layout is agreed in a rendezvous round; and the first
        # plan leaves out GPUs an earlier supervisor on this run directory retired.
        state = State.STARTING if self.membership is None and not self.retired else State.PLANNING
        self._tell("observe_state", state)
        try:
            while state not in TERMINAL:
                # A signal where nothing trains needs no handler: nothing to save or stop.
                idle_stop = state in IDLE_STATES and self._stop_requested.is_set()
                try:
                    trigger = self._stopped_idle(state) if idle_stop else self._handlers[state]()
                except StoreLost as lost:
                    trigger = self._store_lost(lost, state)
                except Abandoned:  # a store call that a stop signal cut short
                    trigger = self._stopped_without_the_store(state)
                new_state = advance(state, trigger)
                log.info("state: %s -> %s (%s)", state.value, new_state.value, trigger.value)
                state = new_state
                self._tell("observe_state", state)
                self._follow_events()  # observers see a failure before the relaunch
            for injection in self.injector.unfired():  # a rehearsal that rehearsed less than asked
                log.warning("--inject %s never fired: its moment did not come in this run", injection)
        finally:
            if self.attempt is not None:
                self.attempt.kill()
            self._finish_persisting()
            if self.replication is not None:
                self.replication.close()
        # Whatever the end (a SLURM time limit's SIGTERM too): the folder is node RAM, and
        # the check below keeps it while it holds a checkpoint the disk tier lacks.
        self._remove_scratch_memory()
        return exit_status(state, self.signum, self._requeue_helps)

    def _stopped_idle(self, state: State) -> Trigger:
        """A signal where nothing trains, seen before a handler or by one that waits (for
        GPUs, warm workers, a rendezvous round, as a spare): recorded as a stop of training
        is, so the run has its end (a report would run the last failure's recovery on into
        the next launch on the run directory)."""
        self._event("stopped", signal=self.signum, exit_code=None,
                    iteration=self._state_iteration(), state=state.value)
        return Trigger.SIGNALLED

    # -- shared checks --------------------------------------------------------------------------
    def _on_alert(self, alert: Alert) -> None:
        self._alerts.append(alert)

    def lost_gpus(self) -> frozenset[int]:
        return frozenset((self.monitor.lost_gpus() | self.injected_lost) - set(self.retired))

    def _waitable_gpus(self) -> frozenset[int]:
        """Lost GPUs that may come back: one that needs a reset or replacement never does."""
        return self.lost_gpus() - set(self.monitor.unschedulable_gpus())

    def _unfit_gpus(self) -> dict[int, str]:
        """GPUs not to plan on, with the reason: lost (how, where the monitor knows),
        unschedulable by the monitor's evidence, or still held by a rank that outlived its kill."""
        reasons = self.monitor.lost_reasons()
        unfit = {gpu: reasons.get(gpu, "lost") for gpu in self.lost_gpus()}
        stuck = self.attempt.stuck_gpus if self.attempt is not None else {}
        return {**unfit, **stuck, **self.monitor.unschedulable_gpus()}

    def _heartbeat_iteration(self) -> int | None:
        heartbeat = runfiles.read_heartbeat(self.run_dir)
        return None if heartbeat is None else heartbeat["iteration"]

    def _state_iteration(self) -> int:
        """The iteration training's state is at: the last one the attempt completed, else the
        one it resumed from (never unknown)."""
        completed = self._progress[0]
        return self._resume_point if completed is None else completed

    def _tell(self, method: str, *args) -> None:
        for observer in self.observers:
            getattr(observer, method)(*args)

    def _event(self, name: str, **fields) -> None:
        self.run_files.append_event(self.run_dir, name, **fields)

    def _ask_for_a_save(self, source: str, reason: str, gpu: int | None = None) -> None:
        """The flag says who asked and why as the monitor's do (DESIGN: gpu, reasons)."""
        flag = runfiles.trigger_flag_path(self.run_dir)
        self.run_files.write(flag, lambda: runfiles.write_flag(flag, source=source, gpu=gpu,
                                                               reasons=[reason]))

    def _remove_abandoned_writes(self) -> None:
        """The temp files of atomic writes killed mid-write (by an earlier ftmaster's end, its
        trainers', its persist and peer copies') in the folders this ftmaster runs on: a
        trainer writes its heartbeat every iteration, and a memory tier is RAM. One a live
        writer holds (an orphaned trainer, another node's) is kept."""
        started = psutil.Process().create_time()
        for folder in (self.run_dir, runfiles.flags_dir(self.run_dir)):
            runfiles.remove_abandoned_temp_files(folder, started)
        save = flag_value(self.config.command[1:], "--save")
        tiers = {Path(save)} if save else set()
        for tier in tiers | ({self.tiers.memory} if self.tiers is not None else set()):
            try:
                remove_abandoned_writes(tier, started)
            except OSError as error:
                log.warning("removing what killed writes left in %s: %s", tier, error)

    def _take_over_previous_attempts(self) -> int:
        """How many attempts this run directory has seen; the last one, if it never ended,
        died with the supervisor that ran it and is recorded as such."""
        self.events_tail.skip_to_end()
        events = runfiles.read_events(self.run_dir)
        launches = [e for e in events if e["event"] == "launch" and isinstance(e.get("attempt"), int)]
        if not launches:
            return 0
        carried = carried_over(events, boot_id(), self.config.gpus, self._uuids())
        if carried:
            self._retire({gpu: f"retired by the ftmaster before this one ({why})"
                          for gpu, why in carried.items()})
        self._carry_over_the_drain_window(events)
        self._carry_over_the_injections(events)
        self._carry_over_the_calibration(events)
        last = max(launches, key=lambda e: e["attempt"])
        if not any(e["event"] in END_EVENTS and e["time"] >= last["time"] for e in events):
            # Killed, maybe with its attempt failed: where its newest checkpoint went. A reboot
            # that killed it emptied /dev/shm too, and the resume from disk's older one must
            # say what was lost. (One that ran to its end removed its memory folder only once
            # disk held it all.)
            self._last_checkpoint = next((e for e in reversed(events) if e["event"] in SAVE_EVENTS
                                          and isinstance(e.get("iteration"), int)), None)
        ended = any(e["event"] in ("failure", "complete", "stopped") and e.get("attempt", last["attempt"])
                    == last["attempt"] and e["time"] >= last["time"] for e in events)
        if not ended:
            heartbeat = runfiles.read_heartbeat(self.run_dir) or {}
            iteration = heartbeat.get("iteration")  # unknown, not 0, when unreadable
            alive = [t for t in (heartbeat.get("time"), events[-1]["time"])
                     if isinstance(t, (int, float))]
            self._event("failure", attempt=last["attempt"], iteration=iteration,
                        cause="supervisor_lost", gpus=[], exit_codes={},
                        lost_at=max(alive, default=None))
            log.warning("attempt %d of %s ended with the ftmaster that ran it, %s; continuing "
                        "as attempt %d", last["attempt"], self.run_dir,
                        "at an unknown iteration" if iteration is None
                        else f"after iteration {iteration}", last["attempt"] + 1)
        return last["attempt"]

    def _carry_over_the_injections(self, events: list[dict]) -> None:
        """A fault the ftmaster before this one injected on this run directory (a requeue, a
        restart) is not injected again: resumed past it, every ``at=iter:K`` was due at once,
        a ``degrade`` alerted again and a ``fail`` killed its GPU a second time after a reboot.
        One handed to an attempt (``nan``, ``slow`` at an iteration) counts once the run
        got to its iteration, by its events or by the last heartbeat (an attempt killed with
        its supervisor recorded no event past its last save)."""
        injected = [e for e in events if e["event"] == "fault_injected"]
        heartbeat = (runfiles.read_heartbeat(self.run_dir) or {}).get("iteration")
        reached = max([e["iteration"] for e in events if e["event"] != "fault_injected"
                       and isinstance(e.get("iteration"), int)]
                      + ([heartbeat] if isinstance(heartbeat, int) else []), default=None)
        done = {e.get("spec") for e in injected if not e.get("armed")} | {
            e.get("spec") for e in injected if e.get("armed") and reached is not None
            and isinstance(e.get("iteration"), int) and e["iteration"] <= reached}
        for injection in [i for i in self.injector.pending if str(i) in done]:
            self.injector.pending.remove(injection)
            log.info("--inject %s: injected by the ftmaster before this one on %s; not again",
                     injection, self.run_dir)

    def _carry_over_the_calibration(self, events: list[dict]) -> None:
        """The original layout's step, as the ftmaster before this one last measured it (its
        plans record it): started again on a shrunk layout (retirements carried over), every
        straggler was kept with nothing to calibrate the cost model on. The original layout,
        run again, measures it anew."""
        measured = [e["original_step_s"] for e in events if e["event"] == "plan"
                    and positive_figure(e.get("original_step_s")) is not None]
        if measured:
            self._original_step_s = measured[-1]

    def _carry_over_the_drain_window(self, events: list[dict]) -> None:
        """A straggler the ftmaster before this one drained holds the window still: started
        again (killed, requeued), a supervisor drained a second GPU at once."""
        drained = [e["time"] for e in events if e["event"] == "straggler_drained"
                   and isinstance(e.get("time"), (int, float))]
        if drained:
            self.stragglers.drained(max(drained), None)

    def _apply_injections(self, iteration: int | None) -> None:
        """``iteration``: the one this poll read (read again, the heartbeat may be a step on
        from the progress the poll recorded, and the fault would be told at the one before)."""
        elapsed = time.monotonic() - self._started
        for injection in self.injector.take_due(iteration, elapsed, self.lost_gpus()):
            if not self._apply(injection):
                self.injector.pending.append(injection)  # its rank has not started yet

    def _apply(self, injection: Injection) -> bool:
        gpu, kind = injection.gpu, injection.kind
        if gpu in self.retired and kind is not Fault.RECOVER:
            log.warning("not injected: %s: GPU %d is retired (%s)", injection, gpu, self.retired[gpu])
            return True
        # A killed attempt (a fault due while waiting for GPUs) has no rank left to take it.
        on_attempt = self.attempt is not None and gpu in self.attempt.gpus and \
            not self.attempt.killed
        if kind in (Fault.HANG, Fault.SLOW) and not on_attempt:  # a rank's fault: none to take it
            log.warning("not injected: %s: no rank trains on GPU %d", injection, gpu)
            return True
        if kind in (Fault.FAIL, Fault.HANG, Fault.XID, Fault.SLOW) and on_attempt:
            pid = self.attempt.pid_on_gpu(gpu)
            if pid is None:
                return False
            local_rank = self.attempt.gpus.index(gpu)
            if kind is Fault.XID:
                (self.attempt.rank_dir / f"cuda_error_{local_rank}").write_text(str(injection.code))
            if kind is Fault.SLOW:  # the rank reads it at its next iteration
                runfiles.atomic_write_text(self.attempt.rank_dir / f"{SLOW_FILE_PREFIX}{local_rank}",
                                           f"{injection.factor}\n", durable=False)
            else:
                send_signal(pid, {Fault.FAIL: signal.SIGKILL, Fault.HANG: signal.SIGSTOP,
                                  Fault.XID: CUDA_ERROR_SIGNAL}[kind])
        if kind is Fault.FAIL:
            self.injected_lost.add(gpu)
        elif kind is Fault.XID and injection.code in self.monitor.health.unschedulable_xids:
            # A GPU that needs a reset fails every rank started on it; after an application
            # XID (13, 31, 43, 45) a new process runs there as before.
            self.injected_xids[gpu] = injection.code
        elif kind is Fault.RECOVER:
            self.injected_lost.discard(gpu)
            self.injected_xids.pop(gpu, None)
        self.monitor.pending_injections.append(injection.at_once())
        self._event("fault_injected", kind=kind.value, gpu=gpu, spec=str(injection),
                    iteration=self._state_iteration())
        log.info("injected %s", injection)
        return True

    def _check_training(self) -> Trigger | None:
        """One poll of a running attempt: completion, failure, or None to keep going."""
        attempt = self.attempt
        heartbeat = runfiles.read_heartbeat(self.run_dir)
        iteration = self._track_progress(heartbeat)
        self._tell("observe_heartbeat", heartbeat)
        self._watch_stragglers(heartbeat)
        self._apply_injections(iteration)
        self._follow_events()
        self._show_progress(heartbeat)
        self._persist_when_due()
        if self.replication is not None:
            self._report_replicated(self.replication.take_results())
        if self.agreement is not None and self.round is not None:
            self.agreement.keep_replicated(self.round.number,
                                           [node.node_rank for node in self.round.nodes],
                                           decides=self._persists_here)
        code = attempt.exit_code()  # first: the records are complete once the ranks have ended
        failed = attempt.failed_ranks()
        if failed or (code is not None and code != 0):
            return self._ranks_failed(failed, self._recorded_errors(), code, iteration)
        if code == 0:
            return self._complete() if self._finished() else self._stopped_early(iteration)
        lost = sorted(self.lost_gpus() & set(attempt.gpus))
        if lost:
            return self._failure("device_lost", iteration, lost, {})
        if (heartbeat or {}).get("finished"):
            return self._wait_for_exit_after_finishing()
        if self._hung():
            return self._failure("hang", iteration, attempt.stopped_gpus(), {})
        stop = self._stop_requested  # a store no packet reaches holds a call past SLURM's grace
        peer_failure = self.membership.peer_failure(stop) if self.membership is not None else None
        if peer_failure is not None:
            if peer_failure in SHARED_CAUSES and not self._peer_grace_over():
                return None
            return self._failure("peer", iteration, [], {})
        if self.membership is not None and self.membership.peers_waiting(stop):
            return self._rejoin(iteration)
        if iteration is None and self.membership is not None and self.membership.node_dropped(stop):
            log.warning("a node of this round left the rendezvous (its keep-alive expired) "
                        "before training's first iteration: its ranks will never start")
            return self._failure("peer", iteration, [], {})
        return None

    def _ranks_failed(self, failed: dict, errors: dict[int, str], torchrun_code: int | None,
                      iteration: int | None) -> Trigger:
        """The failure of the ``failed`` ranks (none: of torchrun), the first one's cause."""
        report = classify_exits(failed, self.attempt.gpus, errors)
        first = failed.get(report.first_local_rank)
        return self._failure(report.cause, iteration, list(report.gpus),
                             report.exit_codes or {"torchrun": torchrun_code},
                             report.first_local_rank, first.exit_code if first else None)

    def _recorded_errors(self) -> dict[int, str]:
        return self.attempt.recorded_errors(range(len(self.attempt.gpus)))

    def _peer_grace_over(self) -> bool:
        """Whether this attempt's ranks had PEER_FAILURE_GRACE_S since a peer's failure was
        first seen to end on their own (a poll before this one sees them end)."""
        now = time.monotonic()
        if self._peer_failure_seen is None or self._peer_failure_seen[0] != self.attempt.number:
            self._peer_failure_seen = (self.attempt.number, now)
        return now - self._peer_failure_seen[1] >= PEER_FAILURE_GRACE_S

    def _rejoin(self, iteration: int | None) -> Trigger | None:
        """A peer waits for a new round: stop here and join it, at once (``scale_up`` now)
        or once a save asked for now is durable (``at-save``). A peer that failed makes
        this attempt's collectives fail first anyway, which joins the round as a failure."""
        if self.config.scale_up == "at-save":
            if self._rejoin_requested_at is None:
                self._rejoin_requested_at = time.time()
                self._ask_for_a_save(source="rendezvous", reason="a node waits for a new round")
                log.info("a node waits for a new round: asking for a save first")
            if not self._saved_since(self._rejoin_requested_at):
                return None
        self._rejoin_requested_at = None
        # reason: a node's join, no fault (the report and goodput's restart time tell them apart)
        self._event("failure", attempt=self.attempt.number, iteration=self._state_iteration(),
                    cause="peer", gpus=[], exit_codes={}, reason="rejoin",
                    before_first_iteration=iteration is None, unfit_gpus=[])
        log.warning("attempt %d stopped: a node waits for a new round", self.attempt.number)
        self._kill_attempt()
        return Trigger.PEERS_WAITING

    def _newest_checkpoint_text(self) -> str:
        last = self._last_checkpoint
        if last is not None:
            return f"iteration {last['iteration']} ({last.get('tier', 'disk')})"
        if self._loaded_iteration is not None:
            return f"iteration {self._loaded_iteration} (the one this attempt loaded)"
        return "none this ftmaster saw saved"

    def _finished(self) -> bool:
        """Whether training that exited 0 ended its schedule: ftmaster's trainer says so in its
        last heartbeat (a script that writes none is taken at its word). Read afresh: the
        poll's own read came before the exit, and the last heartbeat just before it."""
        heartbeat = runfiles.read_heartbeat(self.run_dir)
        return heartbeat is None or heartbeat.get("finished") is not False

    def _training_finished(self) -> bool:
        """Whether training's schedule ended: its last checkpoint durable on disk, or (without
        ``--save``) its last heartbeat saying so."""
        return self._schedule_saved is not None or bool(
            (runfiles.read_heartbeat(self.run_dir) or {}).get("finished"))

    def _ends_the_schedule(self, save: dict) -> bool:
        """Whether ``save`` is training's last, on disk: its final save, one the trainer says
        ends the schedule (``ends_schedule``: a periodic save at its last iteration, under
        ``--train-samples`` too), or the periodic one at ``--train-iters``."""
        # The running attempt's: a relaunch at another global batch trains to --train-samples
        train_iters = flag_value(self._training_command[1:], "--train-iters")
        return save.get("tier", "disk") == "disk" and isinstance(save.get("iteration"), int) and (
            save.get("kind") == "final" or save.get("ends_schedule") is True
            or str(save["iteration"]) == train_iters)

    def _complete_despite(self, cause: str) -> Trigger:
        """Training's schedule ended with its last checkpoint durable on disk before its
        processes failed (a GPU lost, a rank killed in its exit): nothing is left to train,
        and a relaunch would only load that checkpoint and end."""
        log.warning("training's last checkpoint, iteration %d, is durable: the %s that came after "
                    "it ends nothing", self._schedule_saved, cause)
        self._kill_attempt()
        self._progress = (self._schedule_saved, time.monotonic())
        return self._complete()

    def _stopped_early(self, iteration: int | None) -> Trigger:
        """Training saved and exited on a SIGTERM that ftmaster did not send (one rank
        signalled from outside): a failure, resumed from the checkpoint it saved."""
        log.warning("training stopped at iteration %s on a signal ftmaster did not send, before "
                    "the end of its schedule: resuming it", self._state_iteration())
        return self._failure("exit", iteration, [], {"torchrun": 0})

    def _complete(self, tell_peers: bool = True, on_other_nodes: bool = False) -> Trigger:
        """``on_other_nodes``: the job completed while this node trained none of its end (as
        :meth:`_job_ended` records it), which the report and goodput tell apart."""
        self._follow_events()
        self._event("complete", iteration=self._state_iteration(),
                    **({"on_other_nodes": True} if on_other_nodes else {}))
        log.info("training complete at iteration %d", self._state_iteration())
        if tell_peers and self.membership is not None:
            self.membership.end_job("complete", self._stop_requested)
        return Trigger.COMPLETED

    def _store_lost(self, lost: StoreLost, state: State) -> Trigger:
        """A requeue, unless this node's training had finished its schedule, its last
        checkpoint durable, or ``--save`` holds that checkpoint (the other nodes completed
        the job, and the store's host left with it, while this node joined): then the job
        is done, whatever became of its rendezvous; or unless a stop signal came first: the
        same scancel or time limit stopped the store's host sooner, and a requeue would undo
        the cancel."""
        finished = (state in (State.RUNNING, State.DRAINING)
                    and (runfiles.read_heartbeat(self.run_dir) or {}).get("finished"))
        if self._stop_requested.is_set() and not finished:
            log.warning("the job's rendezvous is gone (%s) after signal %s: ending as the stop",
                        lost, self.signum)
            return self._stopped_without_the_store(state)
        saved = None if finished else schedule_on_disk(self._training_command[1:])
        if self.attempt is not None:
            self._kill_attempt()
        if finished or saved is not None:
            log.warning("the job's rendezvous is gone (%s), after training finished%s", lost,
                        "" if saved is None else f": --save holds its last checkpoint, "
                        f"iteration {saved}")
            if saved is not None:
                self._progress = (saved, time.monotonic())
            trained_here = state in (State.RUNNING, State.DRAINING)
            # no store left to tell them through
            return self._complete(tell_peers=False, on_other_nodes=not trained_here)
        self._event("store_lost", reason=str(lost))
        log.error("the job's rendezvous is gone (%s): requeue the job (exit status 75)", lost)
        return Trigger.STORE_LOST

    def _stopped_without_the_store(self, state: State) -> Trigger:
        """The stop a signal asked for, the store gone or a call to it cut short by the
        signal: training still running is stopped as any signal stops it (STOPPING: its
        ranks save and exit); in STOPPING their stop is over (the store failed the announce
        of a rank's failure during it)."""
        if state in IDLE_STATES:
            return self._stopped_idle(state)
        if state is not State.STOPPING:
            return Trigger.SIGNALLED
        self._event("stopped", signal=self.signum, exit_code=self.attempt.exit_code(),
                    iteration=self._state_iteration())
        return Trigger.STOPPED

    def _wait_for_exit_after_finishing(self) -> Trigger | None:
        """Training ended with its last checkpoint durable: only its exit remains. One that
        does not come within the stop timeout (a rank stuck in teardown) is cut short."""
        now = time.monotonic()
        self._finished_at = self._finished_at or now
        if now - self._finished_at < self.config.stop_timeout_s:
            return None
        log.warning("training finished at iteration %d but its processes did not exit within "
                    "%g s; stopping them", self._state_iteration(), self.config.stop_timeout_s)
        self._kill_attempt()
        return self._complete()

    def _track_progress(self, heartbeat: dict | None) -> int | None:
        """The attempt's last iteration; records progress time and the ``resumed`` event."""
        iteration = (heartbeat or {}).get("iteration")
        last, _ = self._progress
        evaluated = (heartbeat or {}).get("evaluated")
        if iteration is not None and iteration == last and evaluated not in (None, self._evaluated):
            self._progress = (iteration, time.monotonic())  # an evaluation's step
        self._evaluated = evaluated
        if iteration is not None and iteration != last:
            self._progress = (iteration, time.monotonic())
            self.injector.trained(iteration, heartbeat.get("first_iteration"))
            # A relaunch that trained ends the row of early exits, whatever ends it (a drain,
            # a rejoin, a failure: only a failure's count reset it)
            self.early_exits_in_row = 0
            first = heartbeat.get("first_iteration") or iteration
            # The poll may first see a later iteration than the first one completed. One that
            # loaded training's last checkpoint trained nothing: it resumed nothing either.
            if last is None and self.attempt.number > 1 and first <= iteration:
                self._event("resumed", attempt=self.attempt.number, iteration=first)
        return iteration

    def _follow_events(self) -> None:
        """Show the trainer's new events and keep what the decisions need."""
        for event in new_events(self.events_tail):
            self._tell("observe_event", event)
            self.injector.saw(event)
            described = describe_event(event)
            if described is not None:
                log.log(*described)
            if event["event"] == "checkpoint_loaded":
                self._loaded_iteration = event.get("iteration")
                self._note_loaded_elsewhere(event)
                if self.persister is not None and isinstance(self._loaded_iteration, int):
                    self.persister.resumed_from(self._loaded_iteration)
                known = (self._last_checkpoint or {}).get("iteration")
                if self.progress is not None and known != self._loaded_iteration:
                    self.progress.last_checkpoint = event
            elif event["event"] in SAVE_EVENTS:
                self._last_checkpoint = event
                if self._ends_the_schedule(event):
                    self._schedule_saved = event["iteration"]
                if self.replication is not None and event.get("tier") == "memory":
                    self.replication.saved(event["iteration"])
                if self.progress is not None:
                    self.progress.last_checkpoint = event

    def _show_progress(self, heartbeat: dict | None) -> None:
        line = self.progress.line(heartbeat, time.time()) if self.progress else None
        if line is not None:
            log.info(line)

    def _hung(self) -> bool:
        self._skip_a_suspension()
        last, since = self._progress
        limit = self.config.startup_timeout_s if last is None else self.config.hang_timeout_s
        idle = time.monotonic() - since
        # The folders are listed only once training is idle: --save may be a shared filesystem.
        return idle > limit and is_hung(idle, limit, self._seconds_since_checkpoint_write())

    def _skip_a_suspension(self) -> None:
        """Moves the last progress on by a gap of SUSPENDED_GAP_S or more since the last poll."""
        now = time.monotonic()
        polled, self._polled_at = self._polled_at, now
        if polled is not None and now - polled > SUSPENDED_GAP_S:
            last, since = self._progress
            self._progress = (last, since + (now - polled))
            log.warning("no poll of the running attempt for %.0f s (the job suspended and "
                        "resumed?): the hang timer skips that time", now - polled)

    def _seconds_since_checkpoint_write(self) -> float | None:
        """None when no checkpoint file is known to be written. A look that gets no answer
        within ``CHECKPOINT_LOOK_S`` does not hold up the supervisor: slow is not stopped (a
        save that loads a parallel file system slows the listing of its own thousands of
        shards, and was killed as hung mid-save), so no answer counts as a write as long ago
        as the looks started going unanswered; a ``--save`` that stopped answering is a hang
        once that is longer than the hang timeout."""
        save = flag_value(self.config.command[1:], "--save")
        folders = ([Path(save)] if save is not None else []) + (
            [self.tiers.memory] if self.tiers is not None else [])
        try:
            written = [t for t in self._look(lambda: list(map(last_checkpoint_write, folders)))
                       if t is not None]
        except CallTimeout:
            if self._looks_unanswered_since is None:
                self._looks_unanswered_since = time.monotonic()
            return time.monotonic() - self._looks_unanswered_since
        self._looks_unanswered_since = None
        return time.time() - max(written) if written else None

    # -- the memory tier ------------------------------------------------------------------------
    def _persist_when_due(self, now: bool = False, at_end: bool = False) -> None:
        """Copy the newest memory checkpoint to disk in the background: after an emergency
        save, at once when ``now`` (an attempt failed), otherwise at most once per
        ``--save-interval`` iterations' worth of time. A copy asked for ``now`` that cannot
        start yet (one under way, or a look at the tiers unanswered) is due at the next poll.
        At the end (``at_end``) the tiers are read here, unbounded, and --save not looked at:
        the look thread may still be stuck on an earlier look, and the end waits for the copy
        anyway, whose own look tells whether disk lacks it."""
        if self.persister is None:
            return
        self._report_persisted()
        if not self._persists_here:
            return
        try:  # reads of the tiers, which must not hold up the supervisor (a hung mount)
            newest, agreed = self._look(self.persister.newest_memory_checkpoint,
                                        unbounded=at_end), None
            if newest is None and self.agreement is not None and self.round is not None:
                agreed = self.agreement.current(self.round.number,
                                                [node.node_rank for node in self.round.nodes])
                newest = None if agreed is None else agreed.iteration
            if not self.persister.may_need_copy(newest, retry_now=now):
                return
            if not at_end and not self._look(self.persister.newer_than_disk, newest):
                return
            kind = None if now else self._look(self._memory_kind, newest)
        except CallTimeout:
            if now:
                self._last_persist_start = float("-inf")
            return  # asked again at the next poll
        due = (now or kind == "emergency"
               or time.monotonic() - self._last_persist_start >= self._persist_interval_s())
        if due and self.persister.start(
                newest, None if agreed is None else self.replication.fetcher(agreed)):
            self._last_persist_start = time.monotonic()
        elif now:
            self._last_persist_start = float("-inf")

    def _look(self, read: Callable, *args, unbounded: bool = False):
        """``read(*args)`` on the look thread; CallTimeout past CHECKPOINT_LOOK_S (or while an
        earlier look is still unanswered). ``unbounded``: on this thread, for as long as it
        takes."""
        if unbounded:
            return read(*args)
        return self._checkpoint_looks.call(CHECKPOINT_LOOK_S, read, *args)

    def _memory_kind(self, iteration: int) -> str | None:
        """The kind of the memory tier's checkpoint ``iteration``, read again when its
        manifest is another file: a resume set a timeline aside, and the new one saved the
        same iteration (an emergency save where the old one's was periodic)."""
        manifest = iteration_dir(self.persister.memory_dir, iteration) / MANIFEST_NAME
        try:
            found = manifest.stat()
            key = (iteration, found.st_ino, found.st_mtime_ns)
        except OSError:  # a node-local copy's manifest is named for its node: read each time
            key = None
        if key is None or self._memory_kind_read[0] != key:
            self._memory_kind_read = (key, read_save_kind(iteration_dir(
                self.persister.memory_dir, iteration)))
        return self._memory_kind_read[1]

    def _persist_interval_s(self) -> float:
        """``--save-interval`` iterations at the measured speed; 0 (every memory checkpoint)
        without one, or before a speed is known."""
        interval = flag_value(self.config.command[1:], "--save-interval")
        pace = self.progress.seconds_per_iteration if self.progress is not None else None
        if interval is None or pace is None:
            return 0.0
        return int(interval) * pace

    def _report_persisted(self) -> None:
        for result in self.persister.take_results():
            if isinstance(result, Persisted):
                # Each result is dated when the copy ended, as a launch is when it began: read
                # here, it waited for this poll, which a launch's wait for warm workers holds off.
                self._event("persisted", time=result.finished_at, iteration=result.iteration,
                            path=str(result.path), seconds=round(result.seconds, 4),
                            bytes=result.bytes, fetched_bytes=result.fetched_bytes)
                log.info("persisted the memory checkpoint of iteration %d to %s in %.2f s "
                         "(%.1f MB)", result.iteration, result.path, result.seconds,
                         result.bytes / 1e6)
            elif isinstance(result, PersistSuperseded):
                self._event("persist_superseded", time=result.finished_at, reason=str(result))
                log.info("a memory checkpoint was not persisted: %s", result)
                self._last_persist_start = float("-inf")  # no copy landed: the newer one is due
                if self.agreement is not None:
                    self.agreement.outdated()
            elif isinstance(result, PersistError):
                self._event("persist_failed", time=result.finished_at, reason=str(result))
                log.warning("persisting a memory checkpoint failed: %s", result)

    def _report_replicated(self, results: list) -> None:
        """The events of ``results``, then what this node holds now, published: the events
        first, since a stop signal abandons a publish to a hung store."""
        for result in results:
            if isinstance(result, ReplicationFailed):
                self._event("replication_failed", iteration=result.iteration, reason=result.reason)
                log.warning("copying memory checkpoint %d from a peer failed: %s",
                            result.iteration, result.reason)
                continue
            from_node, copied = result
            self._event("replicated", iteration=copied.iteration, from_node=from_node,
                        to_node=self.membership.config.node_rank, bytes=copied.bytes,
                        seconds=round(copied.seconds, 4), missing=list(copied.missing),
                        memory_bytes=self.replication.used_bytes())
        if results and self.round is not None:
            self.agreement.publish(self.round.number)  # what this node holds changed

    def _remove_scratch_memory(self) -> None:
        folder = self.config.scratch_memory_dir
        if folder is None or self.tiers is None or not folder.is_dir():
            return
        # A part of a checkpoint newer than disk counts: a run that gave up across nodes
        # may still persist it from the peers.
        newest = newest_held(folder)
        try:
            disk = newest_on_disk(self.tiers.disk)
        except OSError as error:  # unknown: the folder may hold the run's newest alone
            log.warning("kept the memory tier %s: %s cannot be read (%s), so whether it holds "
                        "every checkpoint in it is unknown", folder, self.tiers.disk,
                        error.strerror or error)
            return
        if newest is None or (disk is not None and disk >= newest):
            shutil.rmtree(folder, ignore_errors=True)
            log.info("removed the memory tier %s: every checkpoint in it is on disk", folder)
        else:  # node RAM holds the run's newest checkpoint alone: say where, before a reboot
            log.warning("kept the memory tier %s: its checkpoint of iteration %d is not on disk "
                        "(the newest in %s is %s); launch again with --run-dir %s to resume "
                        "from it", folder, newest, self.tiers.disk,
                        "none" if disk is None else f"iteration {disk}", self.run_dir)

    def _finish_persisting(self) -> None:
        """The end of the run waits for its last copy; the newest memory checkpoint is made
        durable if the disk tier lacks it."""
        if self.persister is None:
            return
        self._await_persist_copy()
        self._persist_when_due(now=True, at_end=True)
        self._await_persist_copy()
        self._report_persisted()

    def _await_persist_copy(self) -> None:
        """Wait for the copy under way, saying every :data:`PERSIST_WAIT_NOTICE_S` why the
        run has not ended: a slow or hung ``--save`` holds the end as long as the copy takes,
        and a stop signal does not cut it short (the memory tier is the node's RAM)."""
        waited = 0.0
        while self.persister.busy:
            self.persister.wait(PERSIST_WAIT_NOTICE_S)
            if self.persister.busy:
                waited += PERSIST_WAIT_NOTICE_S
                log.warning("the run ends once the memory checkpoint of iteration %s is on "
                            "disk in %s: still copying after %.0f s", self.persister.last_requested,
                            self.persister.save_dir, waited)

    def _failure(self, cause: str, iteration: int | None, gpus: list[int], codes: dict,
                 first_local_rank: int | None = None,
                 first_exit_code: int | None = None) -> Trigger:
        self._follow_events()  # the trainer's last words (a NaN loss, a failed save) come first
        if self._schedule_saved is not None:
            return self._complete_despite(cause)
        attempt = self.attempt
        room = runfiles.room_problem(self.run_dir) if cause in ("exit", "hang") else None
        if room is not None:  # the ranks' own output had nowhere to go: no GPU is at fault
            log.error("the run directory cannot take training's output: %s", room)
            cause, gpus = "run_dir", []
        self._last_failure = (cause, first_local_rank)
        self._failed_since_launch = True
        if self.membership is not None:
            # the other nodes stop (and dump) now; after a signal, only if the store answers at once
            self.membership.announce_failure(cause, self._stop_requested)
        self.monitor.refresh(EVIDENCE_TIMEOUT_S)
        unfit = {g: why for g, why in self._unfit_gpus().items() if g in attempt.gpus}
        self._event("failure", attempt=attempt.number, iteration=self._state_iteration(),
                    cause=cause, gpus=gpus, exit_codes=codes,
                    before_first_iteration=iteration is None,
                    unfit_gpus=self._gpu_entries(unfit))
        when = ("before its first iteration" if iteration is None
                else f"after iteration {iteration}")
        where = f" on {gpus_text(gpus)}" if gpus else ""
        hardware = "; hardware: " + ", ".join(f"GPU {g} {why}" for g, why in sorted(unfit.items()))
        failed = f"attempt {attempt.number} failed ({cause}) {when}{where}"
        self._failures.append(failed)
        log.error("%s%s", failed, hardware if unfit else "")
        dump = self._dump_replicas(cause, gpus, iteration)
        if dump is not None and self.membership is not None:
            # Across nodes one merge runs over every node's dumps, after the next round formed
            self._dumped = (self.round.number, dump, self.round.nodes, self.plan.ranks_per_node)
            dump = None
        merging = (self.replicas.start_merge(dump, self._stop_requested) if dump is not None
                   else None)
        self._kill_attempt()
        if merging is not None:
            try:
                self.replicas.finish_merge(merging, self._stop_requested)
            except Abandoned:  # nothing will load it: FAILED ends the run as the stop
                log.info("replica recovery: the merge was stopped by signal %s", self.signum)
        elif dump is not None:  # no cut, or a stop: its dumps go, now that no rank writes one
            shutil.rmtree(dump, ignore_errors=True)
        self._persist_when_due(now=True)  # in parallel with the replan and relaunch
        early = is_early_exit(cause, first_exit_code, self._progress[0] is not None, bool(unfit))
        self.early_exits_in_row = self.early_exits_in_row + 1 if early else 0
        if cause == "nonfinite":
            self._nonfinite_again = self._loaded_iteration in self._nonfinite_from
            self._nonfinite_from.add(self._loaded_iteration)
        return Trigger.FAILURE

    def _dump_replicas(self, cause: str, culprits: list[int], iteration: int | None) -> Path | None:
        """Before the kill: the survivors' dumps (``--replica-recovery``), or None."""
        if self.replicas is None:
            return None
        return self.replicas.dump_if_useful(self.attempt, cause, culprits, iteration,
                                            self.plan.data_parallel_size, self._stop_requested)

    def _sleep(self) -> None:
        self._stop_requested.wait(self.config.poll_interval_s)

    # -- state handlers ------------------------------------------------------------------------
    def _launch(self, state: State = State.RELAUNCHING) -> Trigger:
        plan, gpus = self.plan, self.next_gpus
        number = self.attempts_before + 1 if self.attempt is None else self.attempt.number + 1
        self._resume_point, self._loaded_iteration, self._nonfinite_again = 0, None, False
        self._schedule_saved = None
        # A save asked of the last attempt for a waiting peer is not this one's: any save since
        # would let the next peer's wait stop it at once, with no save of its own.
        self._rejoin_requested_at = None
        try:
            command = self._command_for(number, plan)
        except OSError as error:  # --save or the memory tier unreadable: a stale NFS handle, EIO
            self._give_up(f"attempt {number} could not start: its checkpoint folders cannot be "
                          f"read: {error}")
            return Trigger.GIVE_UP
        self._training_command = command = with_exit_signal_handler(command)
        devices = self.config.devices or JobGpus(self.config.gpus)
        self.monitor.watch(gpus)
        # Across nodes, warm only when every node of the round starts warm (Round.warm).
        warm = self.starter if self.round is None or self.round.warm else None
        try:
            self._clear_previous_attempt()
            attempt = Attempt(self.run_dir, number, command, gpus,
                              self._attempt_env(devices, gpus), world=self.world, starter=warm)
        except OSError as error:  # its folders (a run directory out of room) or its processes
            # A run directory that is full or read-only: a requeue meets it again
            room = runfiles.room_problem(self.run_dir)
            self._give_up(f"attempt {number} could not start: {room or error}",
                          requeue_helps=room is None)
            return Trigger.GIVE_UP
        except LaunchCancelled:  # stopped while it waited for warm workers: nothing trains
            return self._stopped_idle(state)  # a restarted ftmaster's first launch waits too
        self.attempt, self._failed_since_launch = attempt, False
        self._progress, self._finished_at = (None, time.monotonic()), None
        self._polled_at = None
        self.stragglers.new_attempt(gpus, 0 if self.world is None else self.world.rank_offset)
        # Found on the last attempt's figures: weighed no more.
        self._straggler_to_drain = self._straggler_waiting = self._straggler_ambiguous = None
        self._drain_gpu = None  # a drain ends with its attempt
        self._straggler_kept, self._stragglers_behind = None, []
        self._unslowed_step_s = None
        self.progress = Progress(self.attempt.log_path, self.config.progress_interval_s,
                                 time.time())
        self.progress.last_checkpoint = self._last_checkpoint
        # Timed when the launch began: waiting for warm workers still importing is part of it.
        self._event("launch", time=self.attempt.started_at, attempt=number, gpus=list(gpus),
                    boot=boot_id(),
                    tensor_model_parallel_size=plan.tensor_model_parallel_size,
                    pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
                    data_parallel_size=plan.data_parallel_size, command=self.attempt.argv)
        log.info("attempt %d: TP %d x PP %d x DP %d on %s; log %s", number,
                    plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size,
                    plan.data_parallel_size, gpus_text(gpus), self.attempt.log_path)
        return Trigger.LAUNCHED

    def _command_for(self, number: int, plan: Plan) -> list[str]:
        """The job's very first launch runs as the user gave it (across nodes, in the first
        round's layout). Every later one resumes in its round's layout: a node joining a
        later round included, since its peers load the job's newest checkpoint."""
        if number == 1 and self.membership is None:
            return list(self.config.command)
        if number == 1 and self.round is not None and self.round.number == 1:
            return list(plan.command)
        return self._resuming(plan.command)

    def _attempt_env(self, devices, gpus: Sequence[int]) -> dict[str, str]:
        """The attempt's environment: its GPUs, the faults armed for it, the hang timeout
        a wait that blocks training must end before (``async_saves``), and torchrun's wait
        for its ranks when it is signalled too."""
        return {**devices.cuda_env(gpus), **self._armed_injections(gpus),
                runfiles.HANG_TIMEOUT_ENV: repr(self.config.hang_timeout_s),
                **shutdown_timeout_env(self.config.stop_timeout_s)}

    def _armed_injections(self, gpus: Sequence[int]) -> dict[str, str]:
        """The attempt's environment for injected faults on its GPUs: ``nan`` and ``slow`` at
        an iteration (handed over once) and, in a rehearsal with XIDs, the GPUs still
        carrying one."""
        env = {}
        armed = self.injector.take_armed(gpus)
        for injection in armed:
            self._event("fault_injected", kind=injection.kind.value, gpu=injection.gpu,
                        spec=str(injection), iteration=injection.at_iteration, armed=True)
            log.info("armed %s for the attempt on %s", injection, gpus_text(gpus))
        for kind, variable in ((Fault.NAN, NAN_INJECTION_ENV), (Fault.SLOW, SLOW_INJECTION_ENV)):
            specs = [f"{list(gpus).index(i.gpu)}:{i.at_iteration}"
                     + ("" if i.factor is None else f":{i.factor}") for i in armed if i.kind is kind]
            if specs:
                env[variable] = ",".join(specs)
        if self._rehearses_xids:
            env[CUDA_ERROR_ENV] = ",".join(f"{list(gpus).index(gpu)}:{code}" for gpu, code
                                           in self.injected_xids.items() if gpu in gpus)
        return env

    def _resuming(self, command: Sequence[str]) -> list[str]:
        # The folder's contents, not a validation of the shards: that would import torch here
        # and add a second to every recovery, and the trainer validates and falls back itself.
        # Any tracker or iter_* folder counts: an unreadable tracker is never a fresh start.
        save = flag_value(command[1:], "--save")
        folders = [Path(save)] if save is not None else []
        if self.tiers is not None:
            folders.append(self.tiers.memory)
        held = [folder for folder in folders if holds_checkpoints(folder)]
        self._warn_if_memory_tier_lost(held)
        has_checkpoint = bool(held)
        if has_checkpoint:
            self._resume_point = max(read_tracker(folder) or 0 for folder in held)
        if has_checkpoint and self._resume_point < (self._loaded_elsewhere or 0):
            # Another run's older checkpoint there, and none of this run's yet: switched, the
            # relaunch loaded it (without --no-load-optim)
            log.warning("--save holds only iteration %d, older than the --load checkpoint (%d) "
                        "this run started from: relaunching from --load", self._resume_point,
                        self._loaded_elsewhere)
            has_checkpoint, self._resume_point = False, self._loaded_elsewhere
        load = flag_value(command[1:], "--load")
        load_is_save = load is not None and save is not None and same_folder(Path(load), save)
        resumed = [command[0], *resume_from_save(command[1:], has_checkpoint,
                                                 load_is_save=load_is_save,
                                                 saved_there=self._last_checkpoint is not None)]
        if resumed != list(command):
            dropped = [flag for flag in STARTING_WEIGHTS_ONLY if flag_present(command, flag)]
            log.warning("relaunching with --load %s: the newest checkpoint is there%s", save,
                        f" (without {' '.join(dropped)}, given for the weights the run started "
                        "from)" if dropped else "")
        return resumed

    def _note_loaded_elsewhere(self, event: dict) -> None:
        """A load from a folder that is neither --save nor the memory tier (the run's --load
        of the weights it started from): the newest such iteration."""
        save = flag_value(self.config.command[1:], "--save")
        own = [Path(folder) for folder in (save, self.tiers and self.tiers.memory) if folder]
        path, iteration = event.get("path"), event.get("iteration")
        if not isinstance(path, str) or not isinstance(iteration, int):
            return
        if not any(same_folder(Path(path).parent, folder) for folder in own):
            self._loaded_elsewhere = max(self._loaded_elsewhere or 0, iteration)

    def _warn_if_memory_tier_lost(self, held: list[Path]) -> None:
        """The newest checkpoint went to the memory tier, which now holds none (a node reboot
        or a container restart empties /dev/shm): the resume falls back to disk, and says so."""
        last = self._last_checkpoint or {}
        if self.tiers is None or last.get("tier") != "memory" or self.tiers.memory in held:
            return
        self._event("memory_tier_lost", path=str(self.tiers.memory), iteration=last["iteration"])
        log.warning("the memory tier %s no longer holds checkpoints (the newest was iteration %d): "
                    "resuming from the disk tier's newest", self.tiers.memory, last["iteration"])

    def _clear_previous_attempt(self) -> None:
        """A heartbeat or save request left by a killed attempt means nothing to the next one
        (a request raised by the GPU just lost would only cost an extra save)."""
        for path in (runfiles.heartbeat_path(self.run_dir), runfiles.trigger_flag_path(self.run_dir),
                     runfiles.save_now_flag_path(self.run_dir), request_flag_path(self.run_dir)):
            path.unlink(missing_ok=True)

    def _watch(self) -> Trigger:
        return self._train_until(self._critical_gpu)

    def _drain(self) -> Trigger:
        """Train on until a checkpoint newer than the alert is durable, then stop."""
        return self._train_until(self._drained)

    def _train_until(self, check: Callable[[], Trigger | None]) -> Trigger:
        """Poll training until it ends, fails, is signalled, or ``check`` returns a trigger."""
        while True:
            if self._stop_requested.is_set():
                return self._failed_before_the_stop() or Trigger.SIGNALLED
            outcome = self._check_training() or check()
            if outcome is not None:
                return outcome
            self._sleep()

    def _failed_before_the_stop(self) -> Trigger | None:
        """A rank that failed since the last poll, before the signal, is the run's failure
        with its root cause, as it is a poll earlier (the stop then ends the run from FAILED);
        it was recorded only as a 'stopped' event with torchrun's non-zero exit status."""
        if not self.attempt.failed_ranks() and self.attempt.exit_code() in (None, 0):
            return None
        return self._check_training()

    def _watch_stragglers(self, heartbeat: dict | None) -> None:
        layout_unknown = self.stragglers.peerless is None
        for found in self.stragglers.observe(heartbeat):
            straggler = found.straggler
            mates = straggler.slow_mates
            log.warning("straggler: GPU %d computes %.2fx slower than its peers (%.1f ms against "
                        "%.1f ms per iteration) since iteration %d%s", found.gpu,
                        straggler.slowdown, straggler.compute_ms, straggler.peers_ms,
                        straggler.since, f"; {self._slow_too(mates)}, and either may hold the "
                                         "other up" if mates else "")
            # its figures reach the heartbeat two iterations after theirs: training is there
            named_at = heartbeat.get("iteration") if heartbeat else None
            self._event("straggler", gpu=found.gpu, rank=straggler.rank,
                        slowdown=straggler.slowdown, iteration=straggler.iteration,
                        named_at_iteration=named_at, since=straggler.since,
                        drift=straggler.drift, compute_ms=straggler.compute_ms,
                        peers_ms=straggler.peers_ms, typical_ms=straggler.typical_ms,
                        step_s=found.step_s,
                        healthy_step_s=found.healthy_step_s, slow_mates=list(mates),
                        slow_mate_gpus=[self.stragglers.gpu_of(rank) for rank in mates])
            if self.config.drain_stragglers and self.membership is None:  # one node only
                self._weigh_first(found)
        if layout_unknown and self.stragglers.peerless:
            self._say_no_straggler_can_be_named()
        self._report_drain_result()

    def _say_no_straggler_can_be_named(self) -> None:
        """Once per attempt: a slowed GPU of this layout goes unnamed (and undrained), which
        silence would pass off as health."""
        log.log(logging.WARNING if self.config.drain_stragglers else logging.INFO,
                "stragglers: no straggler can be named on this layout: each pipeline stage has "
                "one rank, so no rank has a peer doing the same work to be compared with%s",
                " (--drain-stragglers drains none)" if self.config.drain_stragglers else "")

    def _weigh_first(self, found: Found) -> None:
        """One drain at a time: the slowest straggler is weighed; another is kept, and said.
        One named while a drain is under way waits for it (the next attempt names it anew),
        unless it is the GPU being drained: that one leaves, kept by nothing. A GPU named
        anew (slow again after a recovery) is in line once, with its newest figures: it was
        said kept behind itself, and weighed (and said kept) once per time it was named."""
        pending = self._straggler_to_drain
        if pending is not None and pending.gpu == found.gpu:
            pending = None
        self._stragglers_behind = [f for f in self._stragglers_behind if f.gpu != found.gpu]
        slower = pending is None or found.straggler.slowdown > pending.straggler.slowdown
        kept, self._straggler_to_drain = (pending, found) if slower else (found, pending)
        if self._drain_gpu is not None:
            if found.gpu != self._drain_gpu:
                self._keep_straggler(found.gpu, f"GPU {self._drain_gpu} is being drained (one "
                                                f"drain at a time); weighed after it, if still slow")
        elif kept is not None:
            self._keep_straggler(kept.gpu, f"GPU {self._straggler_to_drain.gpu} is slower and "
                                           "weighed first (one drain at a time)")
        if kept is not None:
            self._stragglers_behind.append(kept)

    def _next_behind(self) -> Found | None:
        """The slowest straggler kept behind another that is still slow, taken from the queue.
        One whose figures stopped stays in it: unknown is never healthy, and a drain of
        another counts it slow among the GPUs left (:meth:`_slowest_staying`)."""
        tracker = self.stragglers.tracker
        self._stragglers_behind = sorted(
            (f for f in self._stragglers_behind if tracker.not_known_fast(f.straggler.rank)),
            key=lambda f: f.straggler.slowdown)
        slow = [f for f in self._stragglers_behind if tracker.still_slow(f.straggler.rank)]
        if not slow:
            return None
        self._stragglers_behind.remove(slow[-1])
        return slow[-1]

    def _slow_too(self, mates: Sequence[int]) -> str:
        """Ranks of a straggler's model replica slow with it: they wait for each other."""
        return (f"{self.stragglers.describe_ranks(mates)} of its model replica "
                f"{'is' if len(mates) == 1 else 'are'} slow too (tensor-parallel partners and "
                f"pipeline neighbours wait for each other)")

    def _keep_straggler(self, gpu: int, why: str) -> None:
        log.info("keeping GPU %d: %s", gpu, why)
        self._event("straggler_kept", gpu=gpu, reason=why)

    def _report_drain_result(self) -> None:
        """After a straggler's drain: the new attempt's step time beside the slowed one's."""
        slowed = self.stragglers.drained_step_s
        if slowed is None:
            return
        # Five steps at least: the median of two was one with a save in it (2.3 s for 1.2).
        now = self.stragglers.step_seconds(least=DRAIN_RESULT_STEPS)
        if now is None:
            return
        self.stragglers.drained_step_s = None
        log.info("straggler drained: %.3f s/iteration now, against %.3f s/iteration with it",
                 now, slowed)
        self._event("straggler_drain_result", attempt=self.attempt.number,
                    step_s=now, slowed_step_s=slowed)

    def _drain_straggler(self) -> Trigger | None:
        """``--drain-stragglers``: an agreed save, then a relaunch without the straggler's GPU,
        when the cost model says the GPUs left run the job faster than it runs now."""
        found, self._straggler_to_drain = self._straggler_to_drain, None
        now = time.time()
        if (found is None or found.gpu not in self.attempt.gpus or len(self.attempt.gpus) < 2
                or self.membership is not None):
            return None
        if self.restarts >= self.config.max_restarts:
            self._keep_straggler(found.gpu, f"no restart left (--max-restarts "
                                            f"{self.config.max_restarts})")
            return None
        if not self.stragglers.tracker.still_slow(found.straggler.rank):
            # Fast again since it was named (a new slowdown names it anew): the next in line.
            # Silent since (unknown) it stays counted slow among the GPUs a drain leaves.
            if self.stragglers.tracker.not_known_fast(found.straggler.rank):
                self._stragglers_behind.append(found)
            self._straggler_to_drain = self._next_behind()
            return None
        if not self.stragglers.drain_allowed(now):
            if found is not self._straggler_waiting:  # said once; weighed when the window ends
                self._straggler_waiting = found
                self._keep_straggler(found.gpu, f"a straggler was drained less than "
                                                f"{self.config.straggler_drain_window_s:g} s ago; "
                                                f"weighed again once that is over, if still slow")
            self._straggler_to_drain = found
            return None
        mates = self.stragglers.tracker.slow_mates(found.straggler.rank)
        if mates:  # weighed again once they are fast: draining the wrong one gains nothing
            if found is not self._straggler_ambiguous:  # said once
                self._straggler_ambiguous = found
                self._keep_straggler(found.gpu, f"{self._slow_too(mates)}: the figures cannot "
                                                f"tell which one holds the job up")
            self._straggler_to_drain = found
            return None
        if self._weighed_lately(found):
            self._straggler_to_drain = found
            return None
        named, found = found, self.stragglers.remeasured(found)
        if found.step_s is None:  # too few heartbeats since the slowdown: weighed at the next
            self._straggler_to_drain = named
            return None
        left = self._gpus_left_without(found.gpu)
        # The planner calibrates on the original layout's step: this attempt's own measure
        # without the slowdown is that only while the attempt runs the original layout.
        unslowed = found.calibration_s() if self._on_original_layout() else None
        calibration = unslowed or self._original_step_s
        decision = decide_drain(found, len(left), lambda: plan_layout(
            self.config.command, len(left), self.config.gpus_per_node,
            original_world_size=len(self.config.gpus), measured_step_s=calibration,
            **self._planner_options()), calibration, self.plan.global_batch_size,
            self._slowest_staying(left))
        if not decision.drain:
            self._kept_by_the_cost_model(named, decision.line)
            return None
        log.warning("straggler: %s", decision.line)
        self._drain_step_s, self._unslowed_step_s = found.step_s, calibration
        self._ask_for_a_save(source="straggler", gpu=found.gpu, reason=decision.line)
        self._drain_gpu, self._drain_since = found.gpu, now
        self._drain_reason = (f"drained: a straggler ({found.straggler.slowdown:.2f}x slower "
                              f"than its peers)")
        self._event("drain", gpu=found.gpu, reason="straggler", decided_by=decision.line,
                    step_s=found.step_s, estimated_step_s=decision.estimated_step_s)
        return Trigger.CRITICAL_GPU

    def _slowest_staying(self, left: Sequence[int]) -> Found | None:
        """The slowest straggler kept among the GPUs ``left`` and not known to be fast again
        (still slow, or unknown since): they would run at its pace."""
        still = [f for f in self._stragglers_behind
                 if f.gpu in left and self.stragglers.tracker.not_known_fast(f.straggler.rank)]
        return max(still, key=Found.extra_s, default=None)

    def _weighed_lately(self, found: Found) -> bool:
        """Whether the cost model kept ``found`` fewer than REWEIGH_ITERATIONS ago."""
        if not self._kept_last(found):
            return False
        weighed_at, now = self._straggler_kept[1], self.stragglers.last_iteration
        return None not in (weighed_at, now) and now < weighed_at + REWEIGH_ITERATIONS

    def _kept_by_the_cost_model(self, found: Found, line: str) -> None:
        """Kept, and weighed again while it stays slow (REWEIGH_ITERATIONS); said once."""
        if not self._kept_last(found):
            log.warning("straggler: %s; weighed again every %d iterations while it stays slow",
                        line, REWEIGH_ITERATIONS)
            self._event("straggler_kept", gpu=found.gpu, reason=line)
        self._straggler_kept = (found, self.stragglers.last_iteration)
        self._straggler_to_drain = found

    def _kept_last(self, found: Found) -> bool:
        """Whether ``found`` is the straggler the cost model kept last."""
        return self._straggler_kept is not None and self._straggler_kept[0] is found

    def _critical_gpu(self) -> Trigger | None:
        """Policy drain: a GPU of this attempt that alerted, while restarts remain; and a
        straggler under ``--drain-stragglers``."""
        if self._straggler_to_drain is not None:
            trigger = self._drain_straggler()
            if trigger is not None:
                return trigger
        while self._alerts:
            alert = self._alerts.popleft()
            if (self.config.policy == "drain" and DEVICE_LOST not in alert.reasons
                    and alert.gpu in self.attempt.gpus and len(self.attempt.gpus) > 1
                    and self.restarts < self.config.max_restarts
                    and self._runs_without(alert.gpu)):
                self._drain_gpu, self._drain_since = alert.gpu, time.time()
                self._drain_reason, self._drain_step_s = None, None
                self._event("drain", gpu=alert.gpu, score=alert.score, reasons=list(alert.reasons))
                return Trigger.CRITICAL_GPU
        return None

    def _gpus_left_without(self, gpu: int) -> list[int]:
        """The GPUs a relaunch without ``gpu`` plans on. One lost while no rank used it is
        retired only by that plan: counted, a drain was weighed on a GPU it would not get."""
        out = {*self.retired, *self._unfit_gpus(), gpu}
        return [g for g in self.config.gpus if g not in out]

    def _runs_without(self, gpu: int) -> bool:
        """Whether the planner has a layout for the GPUs left without ``gpu``; said when not."""
        left = self._gpus_left_without(gpu)
        try:
            self._next_plan(len(left))
        except PlanError as error:
            log.warning("keeping GPU %d despite its alert: without it no layout fits (%s)",
                        gpu, error)
            self._event("drain_cancelled", gpu=gpu, reason=f"no layout without it: {error}")
            return False
        return True

    def _next_plan(self, gpus_here: int) -> Plan:
        """The plan of a relaunch with ``gpus_here`` GPUs on this node. Across nodes it is the
        next round's: the other nodes' GPUs count too, and the job's original size is theirs
        together (this node's alone is no job Megatron ran, and can refuse the arguments)."""
        if self.round is None:
            return plan_layout(self.config.command, gpus_here, self.config.gpus_per_node,
                               original_world_size=len(self.config.gpus), **self._planner_options())
        node_gpus = list(self.round.node_gpus)
        node_gpus[self.round.me] = gpus_here
        return plan_nodes(self.config.command, node_gpus,
                          original_world_size=self.round.original_world_size(
                              self.membership.config.max_nodes), **self._planner_options())

    def _drained(self) -> Trigger | None:
        if not self._saved_since(self._drain_since):
            return None
        if (runfiles.read_heartbeat(self.run_dir) or {}).get("finished"):
            return None  # the save was training's last: it completes, nothing to drain
        if self._drain_reason is None and not self.monitor.still_critical(self._drain_gpu):
            self._event("drain_cancelled", gpu=self._drain_gpu,
                        reason="risk fell below the re-arm level before the restart")
            self._drain_gpu = None
            return Trigger.RISK_CLEARED
        self._kill_attempt()
        self._retire_and_record({self._drain_gpu: self._drain_reason
                                 or "drained: its risk stayed critical after the emergency save"})
        if self._drain_reason is not None:  # a straggler's: the window and result count from here
            self.stragglers.drained(time.time(), self._drain_step_s)
            self._event("straggler_drained", gpu=self._drain_gpu)
        return Trigger.DRAINED

    def _saved_since(self, since: float) -> bool:
        return any(e["event"] in ("emergency_save", "periodic_save") and e["time"] >= since
                   for e in runfiles.read_events(self.run_dir))

    def _decide(self) -> Trigger:
        cause, _ = self._last_failure
        outcome = after_failure(restarts_done=self.restarts, max_restarts=self.config.max_restarts,
                                early_exits_in_row=self.early_exits_in_row,
                                policy=self.config.policy, lost_gpus=self._waitable_gpus(),
                                cause=cause, nonfinite_again=self._nonfinite_again)
        if outcome.trigger is Trigger.GIVE_UP:
            self._give_up(outcome.reason, outcome.requeue_helps)
        return outcome.trigger

    def _give_up(self, reason: str, requeue_helps: bool = True) -> None:
        """A give-up before a failure was relaunched (its decision, or the plan for it, a wait
        included) ends the run on that failure: its root cause is said, and kept for the report."""
        root_cause = self._say_failures() if self._failed_since_launch else None
        self._requeue_helps = requeue_helps
        advice = requeue_advice(requeue_helps)
        self._event("gave_up", reason=reason, requeue=requeue_helps,
                    **({} if root_cause is None else {"root_cause": root_cause}))
        log.error("giving up: %s; %s", reason, advice)
        if self.membership is not None:
            self.membership.end_job(f"gave up on node {self.membership.config.node_rank}: "
                                    f"{reason}; {advice}", self._stop_requested)

    def _say_failures(self) -> str | None:
        """The run's failures in one line; returns what training said of the last one."""
        _, first_rank = self._last_failure
        log.error("the run's failures: %s", "; ".join(self._failures))
        if first_rank is not None:  # a rank ended it: its own words (ftmaster's are above)
            root_cause = self.attempt.root_cause(first_rank, LOG_TAIL_LINES)
            log.error("root cause, from %s:\n%s", self.attempt.log_path, root_cause)
        else:  # a GPU lost or a hang has no words of training's own, unless it said some
            root_cause = self.attempt.stated_errors()
        return root_cause

    def _wait(self) -> Trigger:
        waited_for = sorted(self._waitable_gpus())
        self._event("waiting", gpus=waited_for, timeout=self.config.wait_timeout_s)
        deadline = time.monotonic() + self.config.wait_timeout_s
        while True:
            if self._stop_requested.is_set():
                return self._stopped_idle(State.WAITING)
            self._apply_injections(self._heartbeat_iteration())
            if not self._waitable_gpus():
                self._event("gpus_back", gpus=waited_for)
                return Trigger.GPUS_BACK
            if time.monotonic() >= deadline:
                self._event("wait_timeout", gpus=sorted(self._waitable_gpus()))
                return Trigger.WAIT_TIMED_OUT
            self._sleep()

    def _retire(self, gpus: dict[int, str]) -> dict[int, str]:
        """Drop ``gpus`` for good: no more planning or monitoring for them. Returns those not
        retired before."""
        new = {gpu: why for gpu, why in gpus.items() if gpu not in self.retired}
        for gpu, why in new.items():
            log.warning("retiring GPU %d: %s", gpu, why)
        self.retired.update(new)
        self.monitor.exclude_gpus(gpus)
        return new

    def _retire_and_record(self, gpus: dict[int, str]) -> None:
        """:meth:`_retire`, recorded at once (a ``retired`` event) where no plan follows at
        once: a supervisor that ended before its next plan (a give-up, a lost store, a signal)
        left the next one on the same boot to plan on them again (:mod:`retirements`)."""
        new = self._retire(gpus)
        if new:
            self._event("retired", gpus_retired=self._gpu_entries(new))

    def _kill_attempt(self) -> None:
        """The attempt killed; a GPU that one of its ranks outlived the kill on is retired."""
        self.attempt.kill()
        self._retire_stuck_gpus()

    def _retire_stuck_gpus(self) -> None:
        if self.attempt.stuck_gpus:
            self._retire_and_record(self.attempt.stuck_gpus)

    def _plan(self) -> Trigger:
        self._measure_original_layout()
        self.monitor.refresh(EVIDENCE_TIMEOUT_S)
        self._retire(self._unfit_gpus())
        available = [g for g in self.config.gpus if g not in self.retired]
        if self.membership is not None:
            return self._plan_round(available)
        try:
            plan = plan_layout(self.config.command, len(available), self.config.gpus_per_node,
                               original_world_size=len(self.config.gpus),
                               measured_step_s=self._original_step_s, **self._planner_options())
        except (PlanError, ValueError) as error:
            self._give_up(f"no layout for {gpus_text(available)}: {error}")
            return Trigger.NO_LAYOUT
        self.plan, self.next_gpus = plan, tuple(available[:plan.num_gpus_used])
        # The first plan of a restarted ftmaster (leaving out the GPUs an earlier one retired)
        # relaunches nothing: counted, it spent one of --max-restarts before anything failed.
        self.restarts += self.attempt is not None
        self._plan_event(available)
        return Trigger.PLANNED

    def _planner_options(self) -> dict:
        return {**self._flag_options(), "consumed_samples": self._consumed_at_least()}

    def _flag_options(self) -> dict:
        """The planner's options from ftmaster's own flags (alike on every node)."""
        return {"mode": self.config.plan_mode, "gpu_memory_gb": self.config.gpu_memory_gb,
                "global_batch_tolerance_pct": self.config.global_batch_tolerance_pct}

    def _consumed_at_least(self) -> int | None:
        """Under ``--step-batch-size-schedule``, the samples the newest checkpoint on disk
        consumed: a relaunch resumes there or later, so the batches passed before it need not
        divide by the new data-parallel size (planned as at sample 0, they idled GPUs or
        found no layout). None without a schedule, or when ``--save`` cannot be read."""
        args = self.config.command[1:]
        save = flag_value(args, "--save")
        try:
            schedule = read_step_schedule(args, int_flag(args, "--seq-length", 1))
            if schedule is None or save is None:
                return None
            newest = self._look(newest_on_disk, Path(save))
        except (ValueError, OSError, CallTimeout):
            return None
        return None if newest is None else schedule.consumed_after(newest)

    def _measure_original_layout(self) -> None:
        """The step time of an attempt on the original layout (median of its logged
        iterations after the first two, or without a straggler drained from it), which
        calibrates the planner's cost model. A straggler named and kept slowed those
        iterations: the lesser of their median and the attempt's step without it."""
        if self.attempt is None or not self._on_original_layout():
            return
        if self._unslowed_step_s is not None:  # the drain's decision line and the plan agree
            self._original_step_s = self._unslowed_step_s
            return
        measures = [s for s in (self.progress.steady_step_s(), self.stragglers.unslowed_step_s)
                    if s is not None]
        if measures:
            self._original_step_s = min(measures)

    def _on_original_layout(self) -> bool:
        """Whether the attempt runs the original layout, whose step calibrates the planner
        (a relaunch on it too: its plan's estimates are calibrated, the first plan's not)."""
        original = self.config.first_plan
        return original is not None and self.plan is not None and \
            self.plan.layout() == original.layout()

    def _uuids(self) -> dict[int, str]:
        return dict(self.config.devices.uuids) if self.config.devices is not None else {}

    def _gpu_entries(self, reasons: dict[int, str]) -> list[dict]:
        """``[{gpu, reason, uuid}]`` for an event: the UUID where NVML gave one, so that a
        supervisor started again on other GPUs (another container's, indices from 0) carries
        over the GPU and not its index."""
        uuids = self._uuids()
        return [{"gpu": gpu, "reason": why, **({"uuid": uuids[gpu]} if gpu in uuids else {})}
                for gpu, why in sorted(reasons.items())]

    def _plan_event(self, available: list[int], **fields) -> None:
        for warning in self.plan.warnings:  # e.g. the exact batch rule idling many GPUs
            log.warning("plan: %s", warning)
        self._event("plan", gpus_available=available, boot=boot_id(),
                    gpus_retired=self._gpu_entries(self.retired),
                    original_step_s=self._original_step_s, **fields,
                    **{k: v for k, v in self.plan.as_json().items() if k != "command"})

    def _plan_round(self, available: list[int]) -> Trigger:
        """Join a rendezvous round, plan on every node's GPUs, and take this node's share."""
        started = time.monotonic()
        try:
            joined = self._join(available)
        except JobEnded as ended:
            return self._job_ended(ended.outcome)
        except JoinTimedOut as error:
            self._give_up(f"the rendezvous: {error}")
            return Trigger.NO_LAYOUT
        except ValueError as error:  # e.g. two nodes with the same --node-rank
            self._give_up(str(error), requeue_helps=False)
            return Trigger.NO_LAYOUT
        if joined is None:
            return self._stopped_idle(State.PLANNING)
        previous, self.round = self.round, joined
        self.restarts = joined.number - 1
        self._event("round", number=joined.number, nodes=[n.node_rank for n in joined.nodes],
                    node_gpus=list(joined.node_gpus), seconds=round(time.monotonic() - started, 3))
        try:
            # No measured step time here: every node must plan on the same inputs.
            plan = plan_nodes(self.config.command, joined.node_gpus,
                              original_world_size=joined.original_world_size(
                                  self.membership.config.max_nodes),
                              consumed_samples=joined.consumed_samples, **self._flag_options())
        except PlanError as error:
            self._give_up(f"no layout for nodes of {', '.join(map(str, joined.node_gpus))} GPUs: "
                          f"{error}")
            return Trigger.NO_LAYOUT
        except ValueError as error:  # the arguments, which across nodes no launch check read
            self._give_up(f"invalid layout: {error}", requeue_helps=False)
            return Trigger.NO_LAYOUT
        mine = plan.ranks_per_node[joined.me]
        active = [i for i, ranks in enumerate(plan.ranks_per_node) if ranks]
        if self.replication is not None and joined.secret is not None:
            rank0_here = bool(active) and active[0] == joined.me
            self.replication.new_round(joined.secret, joined.nodes, joined.me, plan.ranks_per_node)
            try:
                self._merge_dumps_across_nodes(joined.nodes[active[0]] if active else None,
                                               rank0_here, previous)
                unloadable = self._catch_up_on_agreed_memory(joined, rank0_here)
            except Abandoned:  # a signal while it waited for another node's word
                return self._stopped_idle(State.PLANNING)
            if unloadable is not None and self._fails_the_round(unloadable):
                return self._catch_up_failed(joined, unloadable)
            self._persists_here = rank0_here
            self._tell("observe_persisting", rank0_here)
        if self.replicas is not None and mine:
            self.replicas.round = (joined.number, rank_ranges(plan.ranks_per_node)[joined.me].start)
        self.plan, self.next_gpus = plan, tuple(available[:mine])
        self._plan_event(available, round=joined.number,
                         nodes=[node.node_rank for node in joined.nodes])
        if not mine:
            log.info("round %d: no ranks for this node; standing by", joined.number)
            return Trigger.STANDBY
        master = joined.nodes[active[0]]
        self.world = StaticWorld(len(active), active.index(joined.me), master.addr, master.port,
                                 rank_offset=sum(plan.ranks_per_node[:joined.me]),
                                 world_size=sum(plan.ranks_per_node))
        log.info("round %d: %d node(s), ranks per node %s; this node runs %d as node %d, master "
                 "%s:%d", joined.number, len(active), list(plan.ranks_per_node), mine,
                 self.world.node_rank, master.addr, master.port)
        return Trigger.PLANNED

    def _catch_up_on_agreed_memory(self, joined: Round,
                                   rank0_here: bool) -> ReplicationFailed | None:
        """Every node says what its tier holds; the node of rank 0 names the newest memory
        checkpoint complete on the round's nodes, and each node makes it loadable here.
        Returns why it is not loadable here, if it is not."""
        self.agreement.publish(joined.number)
        # With replica recovery, rank 0's node first merges the failed round's dumps; a node
        # that dumped none (a spare, a restarted ftmaster) did not wait for that merge.
        merging_s = MERGE_TIMEOUT_S + DUMP_TIMEOUT_S if self.replicas is not None else 0.0
        agreed = self.agreement.decide(joined.number, [node.node_rank for node in joined.nodes],
                                       rank0_here, decider_busy_s=merging_s)
        self._event("memory_agreed", round=joined.number,
                    iteration=None if agreed is None else agreed.iteration)
        results = self.replication.catch_up(agreed, rank0_here, self._stop_requested)
        self._report_replicated(results)
        return next((r for r in results if isinstance(r, ReplicationFailed)), None)

    def _fails_the_round(self, failed: ReplicationFailed) -> bool:
        """Whether a catch-up given up fails the round: once per agreed checkpoint. Given up
        for it in an earlier round too, the peer is more than flaky (a port its network
        drops), and every round would fail until --max-restarts is spent: this one launches,
        and the ranks resume from an older checkpoint."""
        if failed.iteration != self._round_failed_for:
            return True
        log.warning("the catch-up on memory checkpoint %d failed in an earlier round too: "
                    "launching; the ranks resume from an older checkpoint", failed.iteration)
        return False

    def _catch_up_failed(self, joined: Round, failed: ReplicationFailed) -> Trigger:
        """The agreed checkpoint cannot be loaded on this node: the round fails here, and the
        next one agrees and catches up anew, within the restart budget. Launched, every rank
        would skip it and resume from an older checkpoint, and that load sets aside every
        node's copy of the agreed one as newer than what it resumed (the next memory save
        prunes them): the newest state, whole on the other nodes, lost for one flaky peer."""
        line = (f"round {joined.number} failed on this node: the agreed memory checkpoint of "
                f"iteration {failed.iteration} could not be made loadable here ({failed.reason})")
        log.error("%s; the round fails (a new one tries again, within --max-restarts) rather "
                  "than resume from an older checkpoint, which would set it aside on every node",
                  line)
        self._failures.append(line)
        self._last_failure, self._round_failed_for = ("catch_up", None), failed.iteration
        self._event("catch_up_failed", round=joined.number, iteration=failed.iteration,
                    reason=failed.reason)
        self.membership.announce_failure("catch_up", self._stop_requested)  # the others stop
        return Trigger.FAILURE

    def _merge_dumps_across_nodes(self, merger: NodeRecord | None, rank0_here: bool,
                                  previous: Round | None) -> None:
        """Replica recovery across nodes: ``merger``, the node of the new round's rank 0,
        gathers every live node's dumps of the failed round and merges them (the relaunch's
        catch-up then copies the merged checkpoint to every node); the others wait for its
        word, if it was in that round. Without dumps of its own it says "none" at once: it
        fell back (a hang with no culprit), and a node that dumped waited out the whole merge
        timeout (320 s)."""
        if self._dumped is None:
            if rank0_here and previous is not None and self.replicas is not None:
                self.membership.announce(f"replica_merge/{previous.number}", "none",
                                         self._stop_requested)
            return
        number, folder, nodes, ranks_per_node = self._dumped
        self._dumped = None
        word = f"replica_merge/{number}"
        if not rank0_here:
            try:
                self._wait_for_the_merge(word, merger, nodes, number)
            finally:  # a stop too: the dumps are of use to the merger alone
                shutil.rmtree(folder, ignore_errors=True)
            return
        gathered = self.replication.gather_dumps(folder, nodes, ranks_per_node,
                                                 self._stop_requested)
        for result in gathered:
            if isinstance(result, ReplicationFailed):
                log.warning("replica recovery: %s", result.reason)
            else:
                self._event("replica_gathered", from_node=result.node_rank, bytes=result.bytes,
                            seconds=round(result.seconds, 4))
        merging = self.replicas.start_merge(folder, self._stop_requested)
        if merging is None:  # no cut, or a stop: the failed round's ranks are gone, its dumps go
            shutil.rmtree(folder, ignore_errors=True)
        merged = (None if merging is None
                  else self.replicas.finish_merge(merging, self._stop_requested))
        self.membership.announce(word, "none" if merged is None else f"iteration {merged}",
                                 self._stop_requested)

    def _wait_for_the_merge(self, word: str, merger: NodeRecord | None, nodes: Sequence,
                            number: int) -> None:
        """A node that dumped but merges nothing: the merger's word, if it was in the failed
        round ``number`` of ``nodes``; Abandoned on a stop."""
        if merger is not None and merger.node_rank in {node.node_rank for node in nodes}:
            said = self.membership.announcement(word, MERGE_TIMEOUT_S + DUMP_TIMEOUT_S,
                                                self._stop_requested)
            log.info("replica recovery: the merge on rank 0's node %s", "said " + said
                     if said is not None else "said nothing in time")
        else:
            log.info("replica recovery: rank 0's node was not in round %d, whose dumps "
                     "are dropped", number)

    def _can_start_warm(self) -> bool:
        """Whether this node's next launch could be warm: not its first (DESIGN)."""
        started = self.attempt is not None or self.attempts_before > 0
        return started and self.starter is not None and self.starter.ready_to_start

    def _join(self, available: list[int]) -> Round | None:
        """Join the next round on a thread (it blocks until the round completes), so that a
        signal still ends the run at once; None when one did."""
        started = time.monotonic()

        def wanted() -> bool:
            if self._stop_requested.is_set():
                return False
            # Each try at a round has its deadline (the earlier join's try is no start for this one)
            try_started = max(started, self.membership.try_started_at)
            if time.monotonic() > try_started + self.membership.config.join_timeout_s:
                # stuck on a store no packet reaches
                raise StoreLost(f"joining the rendezvous at {self.membership.config.endpoint} "
                                f"did not end within {self.membership.config.join_timeout_s:g} s")
            return True

        log.info("joining a rendezvous round with %s", gpus_text(available))
        try:
            return call_while("ftmaster-rendezvous", wanted, self.config.poll_interval_s,
                              self.membership.join, available, self._can_start_warm(),
                              None if self.replication is None else self.replication.url,
                              self._consumed_at_least())
        except Abandoned:
            return None

    def _job_ended(self, outcome: str) -> Trigger:
        """The job ended on other nodes while this one waited."""
        self.membership.acknowledge(self._stop_requested)
        saved = schedule_on_disk(self._training_command[1:]) if outcome == UNTOLD_END else None
        if saved is not None:  # untold, but --save holds the schedule's last checkpoint
            outcome, self._progress = "complete", (saved, time.monotonic())
        if outcome == "complete":
            self._event("complete", iteration=self._state_iteration(), on_other_nodes=True)
            log.info("the job completed on the other nodes")
            return Trigger.COMPLETED
        # The node that gave up said whether a requeue helps; every node exits alike.
        self._requeue_helps = requeue_advice(False) not in outcome
        self._event("gave_up", reason=outcome, requeue=self._requeue_helps)
        log.error("the job ended: %s", outcome)
        return Trigger.GIVE_UP

    def _standby(self) -> Trigger:
        """No ranks here this round: a spare, until a new round or the end of the job."""
        stop = self._stop_requested
        try:
            while not stop.wait(self.config.poll_interval_s):
                # node 0 persists a shared memory folder, with ranks this round or without
                self._persist_when_due()
                outcome = self.membership.outcome(stop)
                if outcome is not None:
                    return self._job_ended(outcome)
                if self.membership.peers_waiting(stop):
                    return Trigger.PEERS_WAITING
                if self.membership.node_dropped(stop):  # no one else may ever join again
                    log.warning("a node of this round left the rendezvous (its keep-alive "
                                "expired): this spare joins a new round")
                    return Trigger.PEERS_WAITING
        except Abandoned:  # a signal while a store read hung
            pass
        return self._stopped_idle(State.STANDBY)

    def _stop(self) -> Trigger:
        log.warning("signal %s: asking training to save and exit", self.signum)
        code = self.attempt.stop(self.config.stop_timeout_s)
        # a rank that outlived the stop's SIGKILL: the requeued ftmaster must not plan on it
        self._retire_stuck_gpus()
        iteration = self._track_progress(runfiles.read_heartbeat(self.run_dir))
        self._follow_events()
        if self._training_finished():  # the signal came too late to stop anything
            log.info("training had finished before the signal: nothing was stopped")
            return self._complete()
        if code is None:
            log.error("training did not save and exit within --stop-timeout %g s: killed; the "
                      "newest checkpoint is %s", self.config.stop_timeout_s,
                      self._newest_checkpoint_text())
        failed = self.attempt.failed_ranks()
        errors = self._recorded_errors() if failed else {}
        raced = failed_despite_the_stop(failed, errors, killed_at_deadline=code is None)
        if raced:  # the run's failure, with its root cause; the stop then ends it from FAILED
            return self._ranks_failed(raced, errors, code, iteration)
        self._event("stopped", signal=self.signum, exit_code=code,
                    iteration=self._state_iteration())
        return Trigger.STOPPED


def is_hung(idle_s: float, limit_s: float, since_checkpoint_write_s: float | None) -> bool:
    """No new iteration for more than ``limit_s`` and no checkpoint file written within it.

    A save writes no heartbeat while its files are being written, yet it is progress; a rank
    that wedges during or after a save stops writing, and is a hang ``limit_s`` later.
    """
    return idle_s > limit_s and (since_checkpoint_write_s is None or since_checkpoint_write_s >= limit_s)


def last_checkpoint_write(save_dir: Path) -> float | None:
    """When the newest ``iter_*`` folder last changed (unix time); None without one. A folder
    whose files change while it is read (a save renaming them) counts as written now."""
    newest = list_iterations(save_dir)[:1]
    if not newest:
        return None
    try:
        return folder_written_at(iteration_dir(save_dir, newest[0]))
    except OSError:
        return time.time()
