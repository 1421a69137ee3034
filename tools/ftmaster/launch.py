"""``ftmaster launch [OPTIONS] -- SCRIPT ARGS``: train under supervision, recover unattended.

Everything the user can get wrong is checked before anything starts: the ``--``, the script,
the injections, the GPU count, the layout (through the planner), the script's own arguments
(when it is ftmaster's trainer, with its own parser, which imports nothing heavy), the run
directory, the lock and the monitor backend. Each problem ends in one line on stderr and a
non-zero exit, in seconds rather than after two failed launches.

Training gets ``--exit-signal-handler`` added when absent, so that SIGINT, SIGTERM or SIGHUP
to ftmaster (passed on as SIGTERM to every rank) makes training save and exit; SIGKILL follows
after ``--stop-timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import click

from ftmaster import exit_codes, runfiles
from ftmaster.faults import GRAMMAR, Fault, Injection, parse_injection
from ftmaster.gpus import JobGpus, choose_job_gpus, probe, visible_entries
from ftmaster.listener import Listener
from ftmaster.slurm import slurm_defaults, with_explicit_options
from ftmaster.lock import (LOCK_NAME, NO_LOCKS, FolderClaim, FolderInUse, RunDirLock, RunDirLocked,
                           missing_folders, remove_made)
from ftmaster.membership import (BACKENDS, DEFAULT_PORT, NodeMembership, RendezvousConfig,
                                 StoreLost, load_torch_quietly, parse_conf, parse_nnodes,
                                 silent_store, unread_conf_keys)
from ftmaster.board import RunBoard
from ftmaster.console import gpus_text
from ftmaster.metrics import MetricsUnavailable, serve_metrics
from ftmaster.monitor.alerts import AlertConfig
from ftmaster.monitor.backends import BACKEND_NAMES, Backend, BackendError, make_backend
from ftmaster.monitor.backends.bounded import Abandoned, call_while
from ftmaster.monitor.backends.replay import ReplayBackend
from ftmaster.monitor.daemon import MetricsFileError, Monitor, MonitorConfig
from ftmaster.monitor.scorers import SCORER_NAMES, make_scorer
from ftmaster.recovery.cli import (MAX_NODE_GPUS, FiniteFloatRange, FolderPath, InputError,
                                   SeparatedCommand, script_command)
from ftmaster.persist import (DIR_FLAG, make_ours_alone, mark_owner, persist_left_behind, tiers_of,
                              with_memory_dir)
from ftmaster.replica_recovery import (FLAG as REPLICA_FLAG,
                                       unavailable_in as replica_recovery_unavailable)
from ftmaster.monitor.stragglers import StragglerConfig
from ftmaster.recovery.argv_flags import flag_present, flag_value, int_flag, set_flag
from ftmaster.recovery.checkpoints import schedule_on_disk
from ftmaster.recovery.layout_rules import LAYERS_PER_VIRTUAL_STAGE_FLAG, VIRTUAL_STAGES_FLAG
from ftmaster.recovery.megatron_args import ScriptFacts, read_script_args, uses_trainer_parser
from ftmaster.recovery.planner import (HOT_SPARE, MAX_TOLERANCE_PCT, MODES, Plan, PlanError,
                                       plan_layout)
from ftmaster.recovery.training_values import check_script_values
from ftmaster.states import POLICIES, requeue_advice
from ftmaster.supervisor import SCALE_UP_POLICIES, Supervisor, SupervisorConfig, run_files_outage
from ftmaster.replication import MIN_RATE_MB_S, Replication, ReplicationConfig
from ftmaster.warm import WarmStarter, warm_up_for

SAVE_REQUEST_DIR_FLAG = "--emergency-save-flag-dir"
FOLDERS_LAUNCH_READS = ("--save", "--load", "--tensorboard-dir", SAVE_REQUEST_DIR_FLAG, DIR_FLAG)
"""The training command's folders that launch reads itself, each checked to have a value
before any folder is claimed."""
STOP_POLL_S = 0.1
"""How often a wait before the supervisor exists looks for a stop signal."""


def job_gpus(nproc: int | None, backend: str) -> JobGpus:
    """The job's GPUs from ``CUDA_VISIBLE_DEVICES``, the driver (probed only when needed, and
    bounded) and ``--nproc-per-node``; one line on stderr when that fails."""
    entries = visible_entries(os.environ.get("CUDA_VISIBLE_DEVICES"))
    identities = probe() if needs_gpu_probe(nproc, entries, backend) else None
    try:
        chosen = choose_job_gpus(nproc, entries, identities)
    except ValueError as error:
        raise InputError(str(error)) from None
    for gpu, problem in chosen.left_out.items():
        logging.getLogger("ftmaster").warning("GPU %d left out: %s", gpu, problem)
    return chosen


def check_layout(command: Sequence[str], gpus: int, gpus_per_node: int | None,
                 gpu_memory_gb: float | None) -> Plan:
    """The planner's plan for all ``gpus``, which must be the script's own layout.

    Mode ``closest`` picks the script's own layout whenever it is valid on ``gpus``.
    """
    try:
        plan, facts = _first_plan(command, gpus, gpus_per_node, gpu_memory_gb)
    except InputError:
        _blame_gpus_per_node(command, gpus, gpus_per_node, gpu_memory_gb)
        raise
    if _is_own_layout(plan, command):
        return plan
    _blame_gpus_per_node(command, gpus, gpus_per_node, gpu_memory_gb)
    original = facts.original
    raise InputError(
        f"invalid layout: TP {original.tensor_model_parallel_size} x PP "
        f"{original.pipeline_model_parallel_size}"
        f"{_extra_degrees(original.context_parallel_size, original.expert_model_parallel_size)}"
        f"{_pipeline_and_eval(command)} with micro-batch {original.micro_batch_size} and "
        f"global batch {original.global_batch_size} does not fit {gpus} GPUs; the planner "
        f"suggests TP {plan.tensor_model_parallel_size} x PP {plan.pipeline_model_parallel_size}"
        f"{_extra_degrees(plan.context_parallel_size, 1)} x DP {plan.data_parallel_size}"
        f"{_extra_degrees(1, plan.expert_model_parallel_size)}{_pipeline_and_eval(plan.command)}"
        f" with micro-batch {plan.micro_batch_size}")


def _blame_gpus_per_node(command: Sequence[str], gpus: int, gpus_per_node: int | None,
                         gpu_memory_gb: float | None) -> None:
    """Refuse naming ``--gpus-per-node`` when the layout its nodes refused (or no layout at
    all) is the script's own on this one node, which runs every rank."""
    if gpus_per_node is None or gpus_per_node >= gpus:
        return
    whole, _ = _first_plan(command, gpus, None, gpu_memory_gb)
    if _is_own_layout(whole, command):
        raise InputError(
            f"--gpus-per-node {gpus_per_node} splits this node's {gpus} GPUs (--nproc-per-node "
            f"{gpus}) into nodes of {gpus_per_node}, where TP {whole.tensor_model_parallel_size}"
            f" x PP {whole.pipeline_model_parallel_size} does not fit: each node runs whole TP "
            f"groups; give --gpus-per-node {gpus} (or none), or a --tensor-model-parallel-size "
            "that fits its nodes")


def _first_plan(command: Sequence[str], gpus: int, gpus_per_node: int | None,
                gpu_memory_gb: float | None) -> tuple[Plan, ScriptFacts]:
    """The planner's first plan and the script's facts; one line when either is refused."""
    try:
        plan = plan_layout(command, gpus, gpus_per_node, mode="closest", gpu_memory_gb=gpu_memory_gb,
                           original_world_size=gpus)
        return plan, read_script_args(command[1:], original_world_size=gpus)
    except (PlanError, ValueError) as error:
        raise InputError(f"invalid layout: {error}") from None


def _is_own_layout(plan: Plan, command: Sequence[str]) -> bool:
    """Whether ``plan`` is the command's own layout, unchanged. Anything else means Megatron
    would refuse the command there (its context, expert or virtual pipeline size included,
    not only TP, PP and the batch; the planner takes the largest VPP that divides a stage
    where the command's does not)."""
    return plan.reason == HOT_SPARE and _virtual_flags(plan.command) == _virtual_flags(command)


def _pipeline_and_eval(argv: Sequence[str]) -> str:
    """The interleaving flags (past PP 1) and the evaluation micro-batch a layout's text
    names, where given."""
    stages, layers, eval_micro = (flag_value(argv, flag) for flag in (
        VIRTUAL_STAGES_FLAG, LAYERS_PER_VIRTUAL_STAGE_FLAG, "--eval-micro-batch-size"))
    interleaved = bool(_virtual_flags(argv))
    return ((f", VPP {stages}" if interleaved and stages else "")
            + (f", {layers} layers per virtual stage" if interleaved and layers else "")
            + (f", eval micro-batch {eval_micro}" if eval_micro else ""))


def _virtual_flags(argv: Sequence[str]) -> tuple[str | None, ...]:
    """The command's interleaving flags (rewritten away at PP 1, where they mean nothing)."""
    if (int_flag(argv, "--pipeline-model-parallel-size") or 1) == 1:
        return ()
    return tuple(flag_value(argv, flag)
                 for flag in (LAYERS_PER_VIRTUAL_STAGE_FLAG, VIRTUAL_STAGES_FLAG))


def _extra_degrees(context: int, expert: int) -> str:
    """CP and EP for a layout's text, where they are not the default."""
    return (f" x CP {context}" if context > 1 else "") + (f", EP {expert}" if expert > 1 else "")


def optimizer_reshard_warning(argv: Sequence[str]) -> str | None:
    """Upstream Megatron-LM's distributed optimizer saves a DP-reshardable state by default,
    which its load refuses on another TP or PP ("(TP, PP) mismatch after resume"): every
    relaunch on a new layout would fail at its load. ftmaster's trainer always saves it fully
    reshardable."""
    args = argv[1:]
    if uses_trainer_parser(Path(argv[0])) or not flag_present(args, "--use-distributed-optimizer") \
            or flag_present(args, "--dist-ckpt-optim-fully-reshardable"):
        return None
    return ("--use-distributed-optimizer without --dist-ckpt-optim-fully-reshardable: Megatron-LM "
            "loads such a checkpoint only on the same TP and PP, so a relaunch on a new layout "
            "would fail at its load; add the flag (a --no-load-optim given does not help: "
            "relaunches from the run's own checkpoints load their optimizer state)")


def check_trainer_arguments(command: Sequence[str], world_size: int) -> None:
    """The trainer's own validation of its arguments, once, before the first launch."""
    if not uses_trainer_parser(Path(command[0])):
        return
    from megatron.training.arguments import ArgumentError, parse_args
    from megatron.training.rehearsal import environment_problem

    try:
        parse_args(list(command[1:]), world_size=world_size)
    except ArgumentError as error:
        raise InputError(f"training arguments: {error}") from None
    problem = environment_problem()
    if problem is not None:
        raise InputError(problem)


def _injections(specs: Sequence[str], gpus: tuple[int, ...]) -> tuple[Injection, ...]:
    try:
        injections = tuple(parse_injection(spec) for spec in specs)
    except ValueError as error:
        raise InputError(str(error)) from None
    for injection in injections:
        if injection.gpu not in gpus:
            raise InputError(f"--inject {injection}: GPU {injection.gpu} is not one of the "
                             f"job's GPUs {','.join(map(str, gpus))}")
    return injections


def _check_injections_fire(injections: Sequence[Injection], argv: Sequence[str],
                           cold_restart: bool, policy: str) -> None:
    """A fault that can never fire would rehearse nothing, silently: one at an iteration
    training never reaches, or waiting for what this launch never does."""
    for injection in injections:
        never = _why_never(injection, argv, cold_restart) or \
            _why_no_recovery(injection, injections, policy)
        if never is not None:
            raise InputError(f"--inject {injection}: {never}, so it would never fire")


def _why_no_recovery(injection: Injection, injections: Sequence[Injection],
                     policy: str) -> str | None:
    """A ``recover`` fires while its GPU is lost and not yet retired: only a ``fail`` loses
    a GPU (an XID or a wedge makes it unschedulable), and only ``--policy wait`` waits for
    it before the next plan retires it."""
    if injection.kind is not Fault.RECOVER:
        return None
    if policy != "wait":
        return f"a lost GPU is retired at once under --policy {policy} (recover needs --policy wait)"
    if not any(i.kind is Fault.FAIL and i.gpu == injection.gpu for i in injections):
        return f"no fail:gpu={injection.gpu} loses GPU {injection.gpu} first"
    return None


def _why_never(injection: Injection, argv: Sequence[str], cold_restart: bool) -> str | None:
    try:
        last = int_flag(argv, "--train-iters", positive=False)
    except ValueError:  # the trainer's own check says so
        last = None  # --train-samples too: the iterations depend on the batch schedule
    if last is not None and (injection.at_iteration or 0) > last:
        return f"training ends at iteration {last} (--train-iters)"
    if injection.after == "warm_ready" and cold_restart:
        return "no warm worker starts under --cold-restart"
    if injection.after == "persisted" and tiers_of(argv) is None:
        return "nothing is persisted without the memory tier (--non-persistent-ckpt-type global)"
    if injection.after in ("emergency_save", "periodic_save") and flag_value(argv, "--save") is None:
        return "training saves nothing without --save"
    return None


def _missing_folders(folder: Path, option: str | None = None) -> list[Path]:
    """:func:`missing_folders`, with a folder that cannot be looked at (under one without
    search permission, a name too long) refused in one line: it came out as a traceback."""
    try:
        return missing_folders(folder)
    except OSError as error:
        raise InputError(f"{folder} is not usable ({error.strerror})"
                         + (f"; give another {option}" if option else "")) from None


class HeldFolders:
    """The run directory's lock and the claims on the checkpoint folders, released together.
    A launch refused while it holds them withdraws them, and what it made goes with them:
    the run directory, a claimed folder, the memory folder it picked; never what was there
    before it (a refused launch left them each time: a new timestamped run directory without
    --run-dir, a mistyped --save, a /dev/shm folder whose run a later launch could not find)."""

    def __init__(self, config: SupervisorConfig, rendezvous: RendezvousConfig | None) -> None:
        self._made = [_missing_folders(config.run_dir, "--run-dir")]
        try:
            self._lock = _lock_run_dir(config.run_dir)
        except RunDirHeld:  # another launch's: its lock file and run directory are its own
            raise
        except InputError:  # not another launch's lock: what this one made can go
            if self._made[0]:
                with contextlib.suppress(OSError):
                    (config.run_dir / LOCK_NAME).unlink()
            remove_made(self._made[0], whole=False)
            raise
        self._claims: list[FolderClaim] = []
        try:
            for claim in _claim_checkpoint_folders(config, rendezvous):
                self._claims.append(claim)  # each as it is held: a later refusal withdraws it
        except click.ClickException:
            self.withdraw()
            raise

    def will_make(self, folder: Path) -> None:
        """``folder`` is about to be made, and goes on a withdrawal unless it exists now."""
        self._made.append(_missing_folders(folder))

    def close(self) -> None:
        for claim in reversed(self._claims):
            claim.release()
        self._claims = []
        self._lock.release()

    def withdraw(self) -> None:
        """For a refused launch: released, and what it made removed (the run directory
        under its lock, so no other launch writes there meanwhile)."""
        for claim in reversed(self._claims):
            claim.withdraw()
        self._claims = []
        for made in self._made:
            remove_made(made)
        self._made = []
        self._lock.release()


def _claim_checkpoint_folders(config: SupervisorConfig, rendezvous: RendezvousConfig | None):
    """``--save``, and the memory tier's folder unless ftmaster picked it, for this job alone;
    yields each claim once it is held."""
    try:
        tiers = tiers_of(config.command[1:])
        save = flag_value(config.command[1:], "--save")
    except ValueError as error:  # a flag without its value, for a script not Megatron's
        raise InputError(str(error)) from None
    folders = {"--save": save}
    if tiers is not None and config.scratch_memory_dir is None:  # one ftmaster picked is the run's
        folders[DIR_FLAG] = str(tiers.memory)
    run_dir = config.run_dir.resolve()
    job = _job_identity(run_dir, rendezvous)
    for flag, folder in folders.items():
        if folder is not None:
            claim = _claim(FolderClaim(Path(folder), job, run_dir, flag))
            if claim is not None:
                yield claim


def _job_identity(run_dir: Path, rendezvous: RendezvousConfig | None) -> str:
    """What the nodes of one job share, and no other job: SLURM's job step (its every node
    and requeue: a requeued script's srun is the same step), or the job's run directory
    outside a step (two launches in one salloc shell, or one batch script, are two runs);
    else the rendezvous id (torch elastic's identity of a job; its endpoint may be spelt
    differently on each node), else this host's run directory."""
    slurm_job = os.environ.get("SLURM_JOB_ID")
    if slurm_job:
        step = os.environ.get("SLURM_STEP_ID")
        within = f"step {step}" if step else os.path.realpath(run_dir)
        return f"slurm job {os.environ.get('SLURM_CLUSTER_NAME', '')}/{slurm_job} {within}"
    if rendezvous is not None:
        return f"rendezvous {rendezvous.run_id}"
    return f"{socket.gethostname()}:{run_dir}"


class AnotherJobsFolder(click.ClickException):
    """A checkpoint folder another job writes: that job lives on through a requeue of this
    one, which would be refused the same way (and the sbatch wrapper requeues exit 1)."""

    exit_code = exit_codes.DO_NOT_REQUEUE


def _claim(claim: FolderClaim) -> FolderClaim | None:
    """The claim held; None where the filesystem has no locks (said once)."""
    folder = f"{claim.flag} {claim.folder.parent}"
    try:
        claim.acquire()
    except FolderInUse as error:
        raise AnotherJobsFolder(f"{error}; {requeue_advice(False)}") from None
    except OSError as error:
        if error.errno not in NO_LOCKS:
            advice = "" if error.errno == errno.ETIMEDOUT else f"; give a writable {claim.flag}"
            raise InputError(f"cannot claim {folder} for this run ({error.strerror}){advice}") \
                from None
        logging.getLogger("ftmaster").warning(
            "%s has no file locks (%s): nothing stops another run from writing over this "
            "one's checkpoints there", folder, error.strerror)
        return None
    return claim


class RunDirHeld(InputError):
    """Another ftmaster holds the run directory (exit 2, as every refused launch)."""


def _lock_run_dir(run_dir: Path) -> RunDirLock:
    lock = RunDirLock(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except RunDirLocked as error:
        raise RunDirHeld(str(error)) from None
    except OSError as error:
        raise InputError(f"run directory {run_dir} is not writable ({error.strerror}); "
                         "give a writable --run-dir") from None
    problem = runfiles.layout_problem(run_dir)
    if problem is not None:
        lock.release()
        raise InputError(problem)
    if lock.unlocked_because is not None:
        logging.getLogger("ftmaster").warning(
            "run directory %s has no file locks (%s): nothing stops a second ftmaster from "
            "using it at once", run_dir, lock.unlocked_because)
    return lock


def _backend(spec: str, gpus: tuple[int, ...], seed: int) -> Backend:
    try:
        backend = make_backend(spec, num_gpus=len(gpus), seed=seed, gpu_ids=gpus)
    except BackendError as error:
        raise InputError(f"{spec} monitor backend unavailable ({error}); on a "
                                   "machine without NVIDIA GPUs use --monitor-backend sim") from None
    except ValueError as error:
        raise InputError(str(error)) from None
    if isinstance(backend, ReplayBackend):
        _say_which_gpus_replay(spec, backend.recorded_gpus, gpus)
    return backend


def _say_which_gpus_replay(spec: str, recorded: set[int], gpus: tuple[int, ...]) -> None:
    """A job GPU the trace lacks is never sampled: it would pass for a healthy one."""
    log = logging.getLogger("ftmaster")
    unseen = [gpu for gpu in gpus if gpu not in recorded]
    if unseen:
        log.warning("--monitor-backend %s records no row of %s of the job: their risk is "
                    "unknown for the whole run (no alert can come from them), not healthy",
                    spec, gpus_text(unseen))
    others = sorted(recorded - set(gpus))
    if others:
        log.info("--monitor-backend %s: the rows of %s (not the job's) are not played", spec,
                 gpus_text(others))


def _monitor(backend: Backend, run_dir: Path, seed: int, interval: float, scorer: str,
             threshold: float) -> Monitor:
    try:
        return Monitor(backend, run_dir, scorer=make_scorer(scorer),
                       alert_config=AlertConfig(threshold=threshold),
                       config=MonitorConfig(interval_s=interval), seed=seed)
    except (MetricsFileError, OSError) as error:
        backend.close()
        raise InputError(str(error)) from None


def _observers(options: dict, rendezvous: RendezvousConfig | None, monitor: Monitor,
               config: SupervisorConfig, held: HeldFolders) -> list:
    """What watches the run beside the supervisor, fed by the monitor too: the metrics
    (``--metrics-port``, served) and ftmaster's TensorBoard scalars (the training command's
    ``--tensorboard-dir``), whose folder a refused launch takes away again."""
    node_rank = None if rendezvous is None else rendezvous.node_rank
    observers = []
    if options["metrics_port"] is not None:
        try:
            metrics, url = serve_metrics(options["metrics_port"], options["metrics_addr"],
                                         node_rank, config.run_dir)
        except MetricsUnavailable as error:
            raise InputError(str(error)) from None
        logging.getLogger("ftmaster").info("metrics: serving %s", url)
        observers.append(metrics)
    folder = RunBoard.folder_for(list(config.command), node_rank)
    if folder is not None:
        held.will_make(folder)
    try:
        board = RunBoard.for_command(list(config.command), node_rank)
    except OSError as error:  # e.g. a path under a file, or a folder it may not write to
        _close_all(observers)
        raise InputError(f"--tensorboard-dir: cannot write to "
                         f"{runfiles.failed_path(error, folder)} "
                         f"({error.strerror or error})") from None
    if board is not None:
        observers.append(board)
    for observer in observers:
        observer.watch(monitor)
    return observers


def stop_signals() -> list[int]:
    """The signals that stop training with a save: SIGINT, SIGTERM, and SIGHUP (a closed
    terminal or ssh session, as torchrun takes it) unless ignored, as under ``nohup``. By
    default SIGHUP ended ftmaster at once, and its ranks with it (``PR_SET_PDEATHSIG``),
    unsaved."""
    hang_up = [] if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else [signal.SIGHUP]
    return [signal.SIGINT, signal.SIGTERM, *hang_up]


class StopSignals:
    """ftmaster's handlers of the stop signals from the start of a launch to its end, the
    caller's back after it. Each signal asks the supervisor to stop. One that comes before
    the supervisor exists (cutting short the wait for a rendezvous store, :func:`_membership`)
    waits for it, which records the stop and launches nothing (a
    Ctrl-C there was click's "Aborted!" and exit 1, or an abort inside torch's import); one
    after the outcome is final changes nothing (with the defaults back there, a SIGTERM
    made a completed run's exit status 143)."""

    def __init__(self) -> None:
        self._supervisor: Supervisor | None = None
        self._early: int | None = None
        self._lock = threading.Lock()
        self._signals = frozenset(stop_signals())
        # A Python handler runs in the main thread between two of its bytecodes, maybe while
        # that thread holds the lock of the event the supervisor polls (Event.wait): setting
        # it there deadlocked ftmaster. The handler does nothing; the interpreter's C handler
        # writes each signal's number to this pipe, and a thread reads it and acts.
        self._wakeup, wakeup_end = os.pipe()
        os.set_blocking(wakeup_end, False)
        self._callers = {sig: signal.signal(sig, _noted) for sig in self._signals}
        self._wakeup_caller = signal.set_wakeup_fd(wakeup_end, warn_on_full_buffer=False)
        self._wakeup_end = wakeup_end
        threading.Thread(target=self._read_signals, name="ftmaster-stop-signals",
                         daemon=True).start()

    def _read_signals(self) -> None:
        """Until :meth:`close` closes the pipe's other end."""
        with open(self._wakeup, "rb", buffering=0) as pipe:
            while numbers := pipe.read(64):
                for signum in numbers:
                    if signum in self._signals:
                        self._caught(signum)

    def _caught(self, signum: int) -> None:
        with self._lock:
            if self._supervisor is None:
                self._early = self._early or signum  # the first, as request_stop keeps it
                return
        self._supervisor.request_stop(signum)

    def came_early(self) -> bool:
        """Whether a signal came before the supervisor exists, to stop what it waits for."""
        return self._early is not None

    def hand_to(self, supervisor: Supervisor) -> None:
        with self._lock:
            self._supervisor = supervisor
        if self._early is not None:
            supervisor.request_stop(self._early)

    def close(self) -> None:
        for sig, handler in self._callers.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._wakeup_caller)
        os.close(self._wakeup_end)  # the reader sees the pipe's end


def _noted(signum: int, frame) -> None:
    """A stop signal's Python handler: :class:`StopSignals` acts on it in its own thread."""


def _supervise(supervisor: Supervisor, monitor: Monitor, listener: Listener,
               stops: StopSignals) -> int:
    stops.hand_to(supervisor)
    monitor.start()
    listener.start()
    try:
        return supervisor.run()
    finally:
        listener.stop()
        monitor.stop()


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("ftmaster-%Y%m%d-%H%M%S", time.gmtime())


def needs_gpu_probe(nproc: int | None, visible: tuple[str, ...] | None, backend: str) -> bool:
    """The driver is asked (which, bounded, can take seconds on a wedged one) unless
    ``--nproc-per-node`` is given on a backend that watches no real GPU, or the user hid
    every GPU; always for GPUs named by UUID, which only NVML maps to indices."""
    if visible == ():
        return False
    if visible is not None and not all(entry.isdigit() for entry in visible):
        return True
    return nproc is None or not (backend == "sim" or backend.startswith("replay:"))


class ConsoleFormatter(logging.Formatter):
    """``12:00:01 ftmaster: message``, with ``warning:``/``error:`` where they apply."""

    PREFIXES = {logging.WARNING: "warning: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}

    def __init__(self) -> None:
        super().__init__("%(asctime)s ftmaster: %(prefix)s%(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        record.prefix = self.PREFIXES.get(record.levelno, "")
        return super().format(record)


def _console_logging() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(ConsoleFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])


@click.command("launch", cls=SeparatedCommand,
               context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--nproc-per-node", type=click.IntRange(min=1, max=MAX_NODE_GPUS), default=None,
              help="Ranks (GPUs) of the first attempt. Default: the visible GPU count.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=None,
              help="GPUs per node for the planner (TP stays in a node). Default: one node. "
                   "Across nodes each node's GPUs are one node.")
@click.option("--run-dir", type=FolderPath(), default=None,
              help="Run directory (flags, events, metrics, logs). Default: runs/ftmaster-<UTC time>.")
@click.option("--monitor-backend", default="nvml", show_default=True, metavar="|".join(BACKEND_NAMES),
              help="GPU telemetry; sim simulates one GPU per rank (CPU rehearsals).")
@click.option("--monitor-interval", default=10.0, show_default=True, type=FiniteFloatRange(min=0.05),
              help="Seconds between monitor samples.")
@click.option("--scorer", default="adaptive", show_default=True, type=click.Choice(SCORER_NAMES))
@click.option("--risk-threshold", default=0.95, show_default=True,
              type=FiniteFloatRange(0, 1, min_open=True))
@click.option("--policy", default="available", show_default=True, type=click.Choice(POLICIES),
              help="available: relaunch on the GPUs left; wait: wait --wait-timeout for lost GPUs "
                   "first; drain: on a GPU alert, wait for the emergency save, then, if the GPU's "
                   "risk is still critical, relaunch without it before it fails.")
@click.option("--max-restarts", default=3, show_default=True, type=click.IntRange(min=0))
@click.option("--hang-timeout", default=300.0, show_default=True, type=FiniteFloatRange(min=0, min_open=True),
              help="Seconds without a new iteration that count as a hang.")
@click.option("--startup-timeout", default=1800.0, show_default=True,
              type=FiniteFloatRange(min=0, min_open=True),
              help="Seconds a launch may take to its first iteration (load included).")
@click.option("--wait-timeout", default=600.0, show_default=True, type=FiniteFloatRange(min=0, min_open=True),
              help="Policy wait: seconds to wait for lost GPUs before relaunching without them.")
@click.option("--stop-timeout", default=120.0, show_default=True, type=FiniteFloatRange(min=0, min_open=True),
              help="On SIGINT/SIGTERM/SIGHUP: seconds training may take to save and exit before SIGKILL.")
@click.option("--plan-mode", default="closest", show_default=True, type=click.Choice(MODES),
              help="The planner's ranking for relaunches.")
@click.option("--gpu-memory-gb", default=None, type=FiniteFloatRange(min=0, min_open=True),
              help="Per-GPU memory for the planner's estimate.")
@click.option("--global-batch-tolerance", default=0.0, show_default=True, metavar="PCT",
              type=FiniteFloatRange(min=0, max=MAX_TOLERANCE_PCT),
              help="Let a relaunch use a global batch within PCT percent of the original when "
                   "that uses more GPUs or trains faster; the schedule is then rewritten in "
                   "samples, so the run ends at the same sample count. 0: the batch is kept.")
@click.option("--progress-interval", default=10.0, show_default=True,
              type=FiniteFloatRange(min=0, min_open=True),
              help="Seconds between progress lines (iteration, loss, speed, last checkpoint, ETA).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the sim backend and degrade.")
@click.option("--inject", "inject_specs", multiple=True, metavar="KIND:gpu=G,at=iter:K|Ns",
              help=f"Fault to inject (repeatable): {GRAMMAR}. degrade: the GPU's telemetry "
                   "worsens until the monitor alerts; fail: its rank is killed and the GPU is "
                   "lost; hang: its rank stops; xid: the telemetry shows XID N, the rank dies "
                   "of the CUDA error it brings, and ranks started on the GPU fail at start-up "
                   "until a recover; wedge: every telemetry read of the GPU blocks, as a wedged "
                   "driver does; nan (at=iter:K): the rank's loss and gradients become NaN at "
                   "that iteration; slow (factor=F): the rank computes F times slower from then "
                   "on, a straggler; recover: a lost GPU comes back under --policy wait and "
                   "forgets its XID and wedge (a retired GPU stays retired).")
@click.option("--straggler-ratio", default=StragglerConfig.ratio, show_default=True,
              type=FiniteFloatRange(min=1, min_open=True),
              help="A rank whose compute per iteration (until it enters the gradient "
                   "reduction) is this many times its peers' median is slow.")
@click.option("--straggler-iterations", default=StragglerConfig.iterations, show_default=True,
              type=click.IntRange(min=1),
              help="Consecutive slow iterations before a rank is reported as a straggler "
                   "(console, a straggler event, ftmaster report).")
@click.option("--drain-stragglers", is_flag=True,
              help="Drain a straggler's GPU (agreed save, relaunch without it) when the cost "
                   "model says the GPUs left run faster; at most one per "
                   "--straggler-drain-window, never below the planner's minimum.")
@click.option("--straggler-drain-window", default=600.0, show_default=True,
              type=FiniteFloatRange(min=0), help="Seconds between two straggler drains.")
@click.option("--metrics-port", default=None, type=click.IntRange(0, 65535),
              help="Serve Prometheus metrics on this port (0: a free one; the metrics event "
                   "and the console name it): per-GPU risk and DCGM-named telemetry, alerts, "
                   "the supervisor's state, attempts, failures by cause, RTO and RPO, "
                   "checkpoint age, persist lag, iteration speed. Each node serves its own.")
@click.option("--metrics-addr", default="127.0.0.1", show_default=True,
              help="Address the metrics are served on; 0.0.0.0 for a Prometheus elsewhere.")
@click.option("--nnodes", default=None, metavar="N|MIN:MAX",
              help="Nodes of the job, as torchrun takes them; each node runs one ftmaster. "
                   "Default (or 1): this node alone.")
@click.option("--rdzv-endpoint", default=None, metavar="HOST[:PORT]",
              help=f"The rendezvous store (port {DEFAULT_PORT} by default; an IPv6 address in "
                   "brackets, [fd00::1]:29400); with c10d, the ftmaster on that host serves it.")
@click.option("--rdzv-backend", default="c10d", show_default=True, type=click.Choice(BACKENDS))
@click.option("--rdzv-id", default=None,
              help="The job's id, the same on every node. Default: the --run-dir folder's "
                   "name (under SLURM: the job's id, with -r<N> after a requeue).")
@click.option("--rdzv-conf", default=None, metavar="K=V,...",
              help="torch elastic's rendezvous settings, durations in whole seconds: "
                   "join_timeout, last_call_timeout, keep_alive_interval, "
                   "keep_alive_max_attempt, read_timeout, is_host...")
@click.option("--node-rank", default=None, type=click.IntRange(min=0),
              help="This node's stable identity: plans order nodes by it, never by hostname.")
@click.option("--local-addr", default=None,
              help="The address other nodes reach this node at. Default: its FQDN.")
@click.option("--memory-replicas", default=1, show_default=True, type=click.IntRange(min=1),
              help="Across nodes with the memory tier in ftmaster's node-local folders: how "
                   "many peers' shards each node holds a copy of (the next nodes by node rank).")
@click.option("--replication-rate", default=1000.0, show_default=True,
              type=FiniteFloatRange(min=MIN_RATE_MB_S), metavar="MB/S",
              help="The most each node sends to its peers' copies, in MB per second, so that "
                   "copies never take the network from training.")
@click.option("--scale-up", default="at-save", show_default=True,
              type=click.Choice(SCALE_UP_POLICIES),
              help="When another node waits for a new round (it joined, came back or lost a "
                   "GPU): stop training now, or after an agreed save.")
@click.option("--cold-restart", is_flag=True,
              help="Start every attempt as a new torchrun, its ranks as new interpreters. "
                   "Default: ranks go to warm workers that imported torch, megatron-core and "
                   "the trainer ahead of time.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- SCRIPT ARGS")
@click.pass_context
def launch_command(ctx: click.Context, command: tuple[str, ...], **options) -> None:
    """Train SCRIPT under torchrun; on a failure, replan TP/PP/DP and resume unattended."""
    stops = StopSignals()
    ctx.call_on_close(stops.close)
    argv = script_command(ctx, command)
    try:
        found = Path(argv[0]).is_file()
    except OSError as error:  # under a folder without search permission, a name too long
        raise InputError(f"training script {argv[0]!r}: {error.strerror}") from None
    if not found:
        raise InputError(f"training script {argv[0]!r} not found")
    slurm_notes = apply_slurm_defaults(options)
    rendezvous = rendezvous_config(options)
    if rendezvous is None:
        _refuse_node_options_given(ctx)
    else:
        load_torch_quietly()
    _console_logging()
    for key in unread_conf_keys(rendezvous.conf if rendezvous is not None else {}):
        logging.getLogger("ftmaster").warning("--rdzv-conf %s: torch reads no such setting; "
                                              "it is ignored", key)
    if rendezvous is not None and options["drain_stragglers"]:
        logging.getLogger("ftmaster").warning("--drain-stragglers drains on one node only: "
                                              "across nodes stragglers are named, not drained")
    devices = job_gpus(options["nproc_per_node"], options["monitor_backend"])
    config = supervisor_config(argv, devices, rendezvous, options)
    for note in slurm_notes:
        logging.getLogger("ftmaster").info(note)
    if (unavailable := replica_recovery_unavailable(argv[1:])) is not None:
        logging.getLogger("ftmaster").warning("%s", unavailable)
    if (unshardable := optimizer_reshard_warning(argv)) is not None:
        logging.getLogger("ftmaster").warning("%s", unshardable)
    backend = _backend(options["monitor_backend"], devices.ids, options["seed"])
    try:
        held = HeldFolders(config, rendezvous)
    except click.ClickException:
        backend.close()
        raise
    refusal = contextlib.ExitStack()  # what a refused launch undoes, the newest first
    refusal.callback(held.withdraw)
    try:
        if rendezvous is None:
            config = _take_over_left_memory(config, argv, held)
        monitor = _monitor(backend, config.run_dir, options["seed"], options["monitor_interval"],
                           options["scorer"], options["risk_threshold"])
        refusal.callback(monitor.close)
        observers = _observers(options, rendezvous, monitor, config, held)
        refusal.callback(_withdraw_all, observers)
        membership = _membership(rendezvous, len(devices.ids), argv[1:], stops, config.run_dir)
        replication = _replication(config, membership, options, held)
        if replication is not None:
            refusal.callback(replication.close)
        starter = None if options["cold_restart"] else _warm_starter(config, len(devices.ids))
    except click.ClickException:
        refusal.close()
        raise
    except EndedBeforeJoining as ended:  # its end is recorded in the run directory: kept
        _close_all(observers)
        monitor.close()
        held.close()
        sys.exit(ended.status)
    try:
        code = _supervise(Supervisor(config, monitor, membership, starter, observers,
                                     replication), monitor, Listener(config.run_dir), stops)
    finally:
        _close_all(observers)
        if starter is not None:
            starter.close()
        if membership is not None:
            membership.stop_keep_alive()
        held.close()
    sys.exit(code)


def apply_slurm_defaults(options: dict) -> tuple[str, ...]:
    """Under ``srun``, the rendezvous options SLURM's environment gives (``--rdzv-id``,
    ``--node-rank``, ``--rdzv-endpoint``, ``--nnodes``) where none was given on the command
    line; returns the lines to log where a given one replaced SLURM's."""
    try:
        chosen, notes = with_explicit_options(
            slurm_defaults(os.environ), rdzv_id=options["rdzv_id"],
            node_rank=options["node_rank"], rdzv_endpoint=options["rdzv_endpoint"],
            nnodes=options["nnodes"])
    except ValueError as error:
        raise InputError(str(error)) from None
    options.update(dataclasses.asdict(chosen))
    return notes


def rendezvous_config(options: dict) -> RendezvousConfig | None:
    """The rendezvous of a multi-node job; None for one node (``--nnodes`` absent or 1)."""
    if options["nnodes"] is None:
        return None
    try:
        min_nodes, max_nodes = parse_nnodes(options["nnodes"])
        if max_nodes == 1:
            return None
        why = {"run_dir": " (a folder every node can write, shared)",
               "rdzv_endpoint": f" (SLURM's gives none: {options['nodelist_problem']})"
               if options.get("nodelist_problem") else ""}
        for name in ("rdzv_endpoint", "node_rank", "run_dir"):
            if options[name] is None:
                raise ValueError(f"--nnodes {options['nnodes']} needs --{name.replace('_', '-')}"
                                 + why.get(name, ""))
        config = RendezvousConfig(
            endpoint=options["rdzv_endpoint"],
            run_id=options["rdzv_id"] or _folder_name(options["run_dir"]),
            min_nodes=min_nodes, max_nodes=max_nodes, node_rank=options["node_rank"],
            backend=options["rdzv_backend"], local_addr=options["local_addr"],
            conf=_with_store_host(parse_conf(options["rdzv_conf"]), options))
    except ValueError as error:
        raise InputError(str(error)) from None
    # With c10d the node at the endpoint serves the store there: metrics bound first took the
    # port, and torch's store client, connected to them, waited for an answer for good.
    port = options["metrics_port"]
    if port and config.backend == "c10d" and port == config.store_port:
        raise InputError(f"--metrics-port {port} is the rendezvous store's port "
                         f"(--rdzv-endpoint {config.endpoint}): give another")
    return config


def _folder_name(folder: Path) -> str:
    """``folder``'s name as given (every node writes the same shared path), or for ``.`` and
    ``..`` the real one; empty for ``/``."""
    name = Path(folder).name
    return Path(os.path.realpath(folder)).name if name in ("", ".", "..") else name


def _with_store_host(conf: dict[str, str], options: dict) -> dict[str, str]:
    """``--rdzv-conf`` with SLURM's ``is_host`` for a c10d store at its endpoint, unless given."""
    host = options.get("store_host")
    if host is None or "is_host" in conf or options["rdzv_backend"] != "c10d":
        return conf
    return {**conf, "is_host": "1" if host else "0"}


def supervisor_config(argv: list[str], devices: JobGpus, rendezvous: RendezvousConfig | None,
                      options: dict) -> SupervisorConfig:
    """Everything checked, as the supervisor's configuration. Across nodes each node keeps its
    files in ``RUN_DIR/node_<R>``, and the first rendezvous round plans the layout."""
    gpus = devices.ids
    injections = _injections(options["inject_specs"], gpus)
    run_dir = options["run_dir"] or default_run_dir()
    world = len(gpus) if rendezvous is None else len(gpus) * rendezvous.max_nodes
    try:
        check_script_values(argv[1:])
        for flag in FOLDERS_LAUNCH_READS:  # a script with its own parser: not checked before
            flag_value(argv[1:], flag)
    except ValueError as error:
        raise InputError(f"training arguments: {error}") from None
    argv, scratch = _with_memory_tier(argv, run_dir, rendezvous)
    first_plan = None
    if rendezvous is None:
        first_plan = check_layout(argv, len(gpus), options["gpus_per_node"],
                                  options["gpu_memory_gb"])
    else:
        run_dir = runfiles.node_dir(run_dir, rendezvous.node_rank)
    check_trainer_arguments(argv, world)
    if rendezvous is not None:
        _check_node_options(argv, len(gpus), options)
    _check_save_requests_reach_training(argv, run_dir)
    _check_drains_can_resume(argv, options)
    _check_injections_fire(injections, argv, options["cold_restart"], options["policy"])
    return SupervisorConfig(
        run_dir=run_dir, command=tuple(argv), first_plan=first_plan, gpus=gpus, devices=devices,
        gpus_per_node=options["gpus_per_node"], policy=options["policy"],
        max_restarts=options["max_restarts"], hang_timeout_s=options["hang_timeout"],
        startup_timeout_s=options["startup_timeout"], wait_timeout_s=options["wait_timeout"],
        stop_timeout_s=options["stop_timeout"], plan_mode=options["plan_mode"],
        gpu_memory_gb=options["gpu_memory_gb"], injections=injections,
        progress_interval_s=options["progress_interval"], scale_up=options["scale_up"],
        global_batch_tolerance_pct=options["global_batch_tolerance"],
        scratch_memory_dir=scratch,
        stragglers=StragglerConfig(ratio=options["straggler_ratio"],
                                   iterations=options["straggler_iterations"]),
        drain_stragglers=options["drain_stragglers"],
        straggler_drain_window_s=options["straggler_drain_window"])


MULTI_NODE_OPTIONS = ("rdzv_endpoint", "rdzv_backend", "rdzv_id", "rdzv_conf", "node_rank",
                      "local_addr", "memory_replicas", "replication_rate", "scale_up")


def _refuse_node_options_given(ctx: click.Context) -> None:
    """A single-node launch given options only a multi-node one reads: a per-node command
    that forgot ``--nnodes`` trained each node alone, saying nothing. Only options on the
    command line: SLURM's defaults fill some in for single-node steps too."""
    given = [name for name in MULTI_NODE_OPTIONS
             if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise InputError(f"{flags}: only across nodes (--nnodes MIN:MAX with MAX above 1); "
                         "this launch is a single node's")


def _check_node_options(argv: list[str], node_gpus: int, options: dict) -> None:
    """Across nodes no launch check plans the first layout: the first round does, taking
    each node's GPUs as one node. Options that contradict that were silently not applied."""
    per_node = options["gpus_per_node"]
    if per_node is not None and per_node < node_gpus:
        raise InputError(f"--gpus-per-node {per_node} is below this node's {node_gpus} GPUs "
                         "(--nproc-per-node): across nodes the planner takes each node's GPUs "
                         "as one node and would not apply it; give no --gpus-per-node")
    if options["nproc_per_node"] is not None:
        _check_whole_tensor_groups(argv, options["nproc_per_node"])


def _check_whole_tensor_groups(argv: list[str], nproc: int) -> None:
    """The planner keeps TP groups within nodes: with ranks per node that no whole number of
    TP groups fills, the first round silently trained another layout."""
    try:
        tensor = int_flag(argv[1:], "--tensor-model-parallel-size", 1)
    except ValueError as error:  # a script with its own parser: not checked before
        raise InputError(f"training arguments: {error}") from None
    if nproc % tensor:
        raise InputError(f"--nproc-per-node {nproc} is not a multiple of "
                         f"--tensor-model-parallel-size {tensor}: across nodes each node runs "
                         "whole TP groups (Megatron-LM keeps TP within a node), so the first "
                         f"round would train another layout; give a TP that divides {nproc}")


def _check_save_requests_reach_training(argv: list[str], run_dir: Path) -> None:
    """The monitor's alerts, drains and agreed saves ask for a save in ``RUN_DIR/flags``: a
    trainer watching another folder would never take one."""
    watched = flag_value(argv[1:], SAVE_REQUEST_DIR_FLAG)
    if watched is not None and Path(watched).resolve() != runfiles.flags_dir(run_dir).resolve():
        raise InputError(f"{SAVE_REQUEST_DIR_FLAG} {watched}: under ftmaster launch the save "
                         f"requests go to {runfiles.flags_dir(run_dir)}; give no "
                         f"{SAVE_REQUEST_DIR_FLAG}")


def _check_drains_can_resume(argv: list[str], options: dict) -> None:
    """A drain relaunches without the GPU once the save it asks for is made: with no
    ``--save`` none ever is, and the run stayed draining (deaf to alerts) until it ended."""
    if flag_value(argv[1:], "--save") is not None:
        return
    for given, flag in ((options["policy"] == "drain", "--policy drain"),
                        (options["drain_stragglers"], "--drain-stragglers")):
        if given:
            raise InputError(f"{flag} needs the training command's --save: a drain resumes "
                             "from the save it asks for")


def _with_memory_tier(argv: list[str], run_dir: Path,
                      rendezvous: RendezvousConfig | None) -> tuple[list[str], Path | None]:
    """The memory tier's folder: one in ``/dev/shm`` per run unless given (returned as the
    second value when ftmaster picked it); across nodes one per node, which peer copies
    (:mod:`replication`) make whole. A folder given across nodes must be one every node sees."""
    args = argv[1:]
    node_rank = None if rendezvous is None else rendezvous.node_rank
    try:
        chosen, note = with_memory_dir(args, run_dir, node_rank=node_rank)
    except ValueError as error:  # a flag without its value; the trainer's checks come later
        raise InputError(str(error)) from None
    if note is not None and note.startswith("warning: "):
        logging.getLogger("ftmaster").warning(note.removeprefix("warning: "))
    elif note is not None:
        logging.getLogger("ftmaster").info(note)
    picked = flag_value(chosen, DIR_FLAG) if chosen != args else None
    if rendezvous is not None and REPLICA_FLAG in args and picked is None:
        raise InputError(f"{REPLICA_FLAG} across nodes needs ftmaster's node-local memory "
                         f"folders in /dev/shm: give no {DIR_FLAG}"
                         + (f" ({note})" if note else ""))
    return [argv[0], *chosen], None if picked is None else Path(picked)


def _take_over_left_memory(config: SupervisorConfig, argv: list[str],
                           held: HeldFolders) -> SupervisorConfig:
    """On one node, with ``--save`` claimed and a memory folder not given: take over what a
    stopped run on the same ``--save`` left in ``/dev/shm`` under another run directory
    (:func:`persist_left_behind`), before training loads; pick ``/dev/shm`` again when that
    freed the room it lacked; and say which run the folder ftmaster picked serves."""
    log = logging.getLogger("ftmaster")

    def say(line: str) -> None:
        if line.startswith("warning: "):
            log.warning(line.removeprefix("warning: "))
        else:
            log.info(line)

    tiers = tiers_of(config.command[1:])
    if tiers is None or flag_value(argv[1:], DIR_FLAG) is not None:
        return config
    load = flag_value(config.command[1:], "--load")
    resumes = load is not None and Path(load).resolve() == tiers.disk.resolve()
    try:
        removed = persist_left_behind(config.scratch_memory_dir, tiers.disk, resumes, say)
    except OSError as error:
        log.warning("looking for memory tiers an earlier run left: %s", error)
        removed = 0
    if removed and config.scratch_memory_dir is None:
        chosen, scratch = _with_memory_tier(argv, config.run_dir, None)
        if scratch is not None:
            plan = config.first_plan
            config = dataclasses.replace(
                config, command=tuple(chosen), scratch_memory_dir=scratch,
                first_plan=plan and dataclasses.replace(plan, command=tuple(
                    set_flag(list(plan.command), DIR_FLAG, str(scratch)))))
    if config.scratch_memory_dir is not None:
        held.will_make(config.scratch_memory_dir)
        try:
            mark_owner(config.scratch_memory_dir, tiers.disk, config.run_dir)
        except OSError as error:
            log.warning("cannot say which run %s serves: %s", config.scratch_memory_dir, error)
    return config


def _end_without_the_store(lost: StoreLost, args: Sequence[str], run_dir: Path) -> None:
    """No store to join: a requeue, unless ``--save`` holds the schedule's last checkpoint
    (the other nodes completed the job and left with the store before this node started).
    Recorded as the supervisor records a store lost later: else a node started again after
    its ftmaster was killed still reads, in ``ftmaster report``, as killed."""
    log, run_files = logging.getLogger("ftmaster"), run_files_outage()
    saved = schedule_on_disk(args)
    if saved is None:
        run_files.append_event(run_dir, "store_lost", reason=str(lost))
        log.error("%s; requeue the job (exit status 75)", lost)
        raise EndedBeforeJoining(exit_codes.REQUEUE)
    run_files.append_event(run_dir, "complete", iteration=saved, on_other_nodes=True)
    log.warning("%s, and --save holds training's last checkpoint, iteration %d: the job has "
                "completed", lost, saved)
    raise EndedBeforeJoining(0)


class EndedBeforeJoining(Exception):
    """The job ended for this node before it joined (no store); ``status`` is the exit
    status, given once the launch closed what it opened and released its folders."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _replication(config: SupervisorConfig, membership: NodeMembership | None,
                 options: dict, held: HeldFolders) -> Replication | None:
    """Peer copies, for a memory tier in the node-local folder ftmaster picked (made here),
    served at the address the membership looked up; one line when that folder cannot be made
    (the address was checked when the membership looked it up)."""
    if membership is None or config.scratch_memory_dir is None:
        return None
    held.will_make(config.scratch_memory_dir)
    try:
        make_ours_alone(config.scratch_memory_dir)  # a relaunch takes it again only then
        return Replication(ReplicationConfig(
            config.scratch_memory_dir, config.run_dir, membership.config.node_rank,
            options["memory_replicas"], options["replication_rate"] * 1e6, membership.bind_host))
    except OSError as error:
        raise InputError(
            f"cannot serve this node's memory tier from "
            f"{runfiles.failed_path(error, config.scratch_memory_dir)} "
            f"({error.strerror or error})") from None


def _warm_starter(config: SupervisorConfig, gpus: int) -> WarmStarter:
    """The warm pool, its workers started; one line when they cannot be (their output file
    under the run directory cannot be opened, no process can be started)."""
    run_files = run_files_outage()
    try:
        return WarmStarter(gpus, config.run_dir, warm_up_for(config.command),
                           on_ready=lambda fields: run_files.append_event(config.run_dir,
                                                                          "warm_ready", **fields))
    except OSError as error:
        where = f": {error.filename}" if error.filename else ""
        raise InputError(f"cannot start the warm workers{where} "
                                   f"({error.strerror or error}); give a --run-dir ftmaster "
                                   "can write, or --cold-restart") from None


def _close_all(observers: Sequence) -> None:
    for observer in observers:
        observer.close()


def _withdraw_all(observers: Sequence) -> None:
    """A refused launch's observers closed, a board's event file taken away again."""
    for observer in observers:
        (observer.withdraw if isinstance(observer, RunBoard) else observer.close)()


def _membership(rendezvous: RendezvousConfig | None, launch_gpus: int, args: Sequence[str],
                stops: StopSignals, run_dir: Path) -> NodeMembership | None:
    """This node's seat; ``args`` are the training arguments as given, before ftmaster set
    this node's own (its memory folder), which every node's must match. A stop signal ends
    the wait for the store at once (torch's connect blocks in C++ for ``read_timeout`` and
    more, so scancel's SIGKILL came first, with nothing recorded): the seat is left
    unconnected, and the supervisor, handed the stop, records it and never joins. A store
    silent past torch's ``read_timeout`` and a margin is lost, or, when a listener took
    torch's connection, another program's port (:func:`silent_store`): torch's client
    waited for it for good, saying nothing."""
    if rendezvous is None:
        return None
    deadline = time.monotonic() + rendezvous.store_timeout_s

    def wanted() -> bool:
        if time.monotonic() > deadline:
            raise silent_store(rendezvous)
        return not stops.came_early()

    try:
        seat = NodeMembership(rendezvous, launch_gpus=launch_gpus, args=args, connect=False)
        call_while("ftmaster-rendezvous-store", wanted, STOP_POLL_S, seat.connect)
    except Abandoned:
        pass
    except StoreLost as lost:
        _end_without_the_store(lost, args, run_dir)
    except ValueError as error:
        raise InputError(str(error)) from None
    return seat
