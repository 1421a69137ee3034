"""The supervisor's state machine as data: states, triggers, the transition table, decisions.

Pure: no processes, files or clocks, so every transition and decision is table-tested.

::

    STARTING ─launched─> RUNNING ─completed─> SUCCEEDED
                           │  ├─failure─> FAILED ─retry─> PLANNING ─planned─> RELAUNCHING ─launched─> RUNNING
                           │  │             ├─wait─> WAITING ─gpus_back / wait_timed_out─> PLANNING
                           │  │             └─give_up─> GAVE_UP          PLANNING ─no_layout─> GAVE_UP
                           │  └─critical_gpu─> DRAINING ─drained─> PLANNING   (policy drain)
                           │                        └─risk_cleared─> RUNNING
                           └─signalled─> STOPPING ─stopped─> INTERRUPTED
                                            ├─completed─> SUCCEEDED   (training had finished)
                                            └─failure─> FAILED ─signalled─> INTERRUPTED
                                                (a rank failed on its own during the stop)

Across nodes (``--nnodes``) the supervisor starts in PLANNING, whose plan is agreed in a
rendezvous round with the other nodes, and three more paths exist::

    RUNNING / DRAINING ─peers_waiting─> PLANNING        (a peer failed, or a node joined)
    PLANNING ─standby─> STANDBY ─peers_waiting─> PLANNING   (this node got no ranks: a spare)
                           ├─completed─> SUCCEEDED  ├─give_up─> GAVE_UP   (the job ended elsewhere)
    any live state ─store_lost─> REQUEUED             (exit 75: the rendezvous store is gone)
                                (after a stop signal _store_lost gives the stop's trigger)

DRAINING keeps training while it waits for the emergency save, so it can also fail, complete
or be signalled like RUNNING. Once the save is durable it restarts without the GPU only if
that GPU's risk is still critical; a risk that fell back (a false alarm) leaves training
running. An attempt that cannot be started at all (its folders, its processes) gives up
from STARTING or RELAUNCHING. In the states where no training runs (``IDLE_STATES``:
STARTING and RELAUNCHING before their launch, FAILED, WAITING, PLANNING) a signal leads
straight to INTERRUPTED.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass

from ftmaster import exit_codes

POLICIES = ("available", "wait", "drain")
EARLY_EXITS_TO_GIVE_UP = 2


class State(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    FAILED = "failed"
    WAITING = "waiting"
    PLANNING = "planning"
    RELAUNCHING = "relaunching"
    STOPPING = "stopping"
    STANDBY = "standby"
    SUCCEEDED = "succeeded"
    GAVE_UP = "gave_up"
    INTERRUPTED = "interrupted"
    REQUEUED = "requeued"


class Trigger(enum.Enum):
    LAUNCHED = "launched"
    COMPLETED = "completed"
    FAILURE = "failure"
    CRITICAL_GPU = "critical_gpu"
    DRAINED = "drained"
    RISK_CLEARED = "risk_cleared"
    SIGNALLED = "signalled"
    STOPPED = "stopped"
    RETRY = "retry"
    WAIT = "wait"
    GIVE_UP = "give_up"
    GPUS_BACK = "gpus_back"
    WAIT_TIMED_OUT = "wait_timed_out"
    PLANNED = "planned"
    NO_LAYOUT = "no_layout"
    STANDBY = "standby"
    PEERS_WAITING = "peers_waiting"
    STORE_LOST = "store_lost"


S, T = State, Trigger
IDLE_STATES = frozenset({S.STARTING, S.RELAUNCHING, S.FAILED, S.WAITING, S.PLANNING, S.STANDBY})
_TRAINING_EXITS = {T.COMPLETED: S.SUCCEEDED, T.FAILURE: S.FAILED, T.SIGNALLED: S.STOPPING}
TRANSITIONS: dict[tuple[State, Trigger], State] = {
    (S.STARTING, T.LAUNCHED): S.RUNNING,
    **{(S.RUNNING, trigger): state for trigger, state in _TRAINING_EXITS.items()},
    (S.RUNNING, T.CRITICAL_GPU): S.DRAINING,
    **{(S.DRAINING, trigger): state for trigger, state in _TRAINING_EXITS.items()},
    (S.DRAINING, T.DRAINED): S.PLANNING,
    (S.DRAINING, T.RISK_CLEARED): S.RUNNING,
    (S.FAILED, T.RETRY): S.PLANNING,
    (S.FAILED, T.WAIT): S.WAITING,
    (S.FAILED, T.GIVE_UP): S.GAVE_UP,
    (S.WAITING, T.GPUS_BACK): S.PLANNING,
    (S.WAITING, T.WAIT_TIMED_OUT): S.PLANNING,
    (S.PLANNING, T.PLANNED): S.RELAUNCHING,
    (S.PLANNING, T.NO_LAYOUT): S.GAVE_UP,
    (S.PLANNING, T.FAILURE): S.FAILED,  # across nodes: the agreed checkpoint not loadable here
    (S.RELAUNCHING, T.LAUNCHED): S.RUNNING,
    (S.STARTING, T.GIVE_UP): S.GAVE_UP,
    (S.RELAUNCHING, T.GIVE_UP): S.GAVE_UP,
    (S.STOPPING, T.STOPPED): S.INTERRUPTED,
    (S.STOPPING, T.COMPLETED): S.SUCCEEDED,  # the signal came after training's last checkpoint
    (S.STOPPING, T.FAILURE): S.FAILED,  # a rank crashed during the stop: recorded, then stopped
    **{(state, T.SIGNALLED): S.INTERRUPTED for state in IDLE_STATES},
    (S.RUNNING, T.PEERS_WAITING): S.PLANNING,
    (S.DRAINING, T.PEERS_WAITING): S.PLANNING,
    (S.PLANNING, T.STANDBY): S.STANDBY,
    (S.PLANNING, T.GIVE_UP): S.GAVE_UP,
    (S.PLANNING, T.COMPLETED): S.SUCCEEDED,
    (S.STANDBY, T.PEERS_WAITING): S.PLANNING,
    (S.STANDBY, T.COMPLETED): S.SUCCEEDED,
    (S.STANDBY, T.GIVE_UP): S.GAVE_UP,
}
TERMINAL = frozenset({S.SUCCEEDED, S.GAVE_UP, S.INTERRUPTED, S.REQUEUED})
TRANSITIONS.update({(state, T.STORE_LOST): S.REQUEUED for state in State if state not in TERMINAL})


class IllegalTransition(RuntimeError):
    """A trigger that the current state does not accept: a supervisor bug, never input."""


def advance(state: State, trigger: Trigger) -> State:
    try:
        return TRANSITIONS[(state, trigger)]
    except KeyError:
        raise IllegalTransition(f"{trigger.value} is not accepted in state {state.value}") from None


@dataclass(frozen=True)
class FailureOutcome:
    """What to do after a failure, and why when giving up."""

    trigger: Trigger
    reason: str | None = None
    requeue_helps: bool = True
    """When giving up: whether a requeue (fresh processes, maybe fresh nodes) may cure it."""


GIVE_UP_AT_ONCE = {
    "storage": "storage error: a checkpoint could not be written; a relaunch would hit the "
               "same error, so free space or fix the storage first (the error is above)",
    "no_checkpoint": "no checkpoint can be loaded and starting over would throw the run "
                     "away; repair or move them (the reasons are above)",
    "usage": "the training arguments, or the checkpoint under them, need fixing (above)",
    "data": "the training data cannot be read (above): fix or rebuild the corpus; no GPU is "
            "at fault",
    "run_dir": "the run directory is out of room or read-only (above), so training's log and "
               "ftmaster's records cannot be written: free space there or give another "
               "--run-dir, then launch again to resume",
}
"""Causes the trainer reports that a relaunch cannot cure, with what to do."""


def is_early_exit(cause: str, first_exit_code: int | None, trained: bool, unfit: bool) -> bool:
    """Whether a failure counts toward ``EARLY_EXITS_TO_GIVE_UP``: the script ended on its
    own before this attempt's first iteration, with no GPU found unfit. A first rank ended
    by SIGKILL does not count, however early: no error of the script's raises it (the OOM
    killer, an operator or a fault does), and two such kills in the first iteration after
    a resume gave up with "fix the script" and exit 93 (do not requeue)."""
    return (cause == "exit" and not trained and not unfit
            and first_exit_code != -signal.SIGKILL)


def after_failure(*, restarts_done: int, max_restarts: int, early_exits_in_row: int,
                  policy: str, lost_gpus: frozenset[int], cause: str = "exit",
                  nonfinite_again: bool = False) -> FailureOutcome:
    """Give up on what a relaunch cannot cure (a storage error, no loadable checkpoint, bad
    arguments, a NaN loss again from the checkpoint that gave one before), on a script that
    dies before its first iteration twice running, or when the restart budget is spent;
    under ``wait`` wait for lost GPUs; else relaunch."""
    if cause in GIVE_UP_AT_ONCE:
        return FailureOutcome(Trigger.GIVE_UP, GIVE_UP_AT_ONCE[cause], requeue_helps=False)
    if nonfinite_again:
        return FailureOutcome(Trigger.GIVE_UP, "non-finite loss again after resuming from the "
                                               "same checkpoint: the checkpoint, the data or "
                                               "the learning rate is at fault, not a GPU",
                              requeue_helps=False)
    if early_exits_in_row >= EARLY_EXITS_TO_GIVE_UP:
        return FailureOutcome(Trigger.GIVE_UP, f"the script failed before its first iteration "
                                               f"{early_exits_in_row} times in a row: fix the "
                                               "script or its arguments (log tail above)",
                              requeue_helps=False)
    if restarts_done >= max_restarts:
        return FailureOutcome(Trigger.GIVE_UP, f"restart budget spent: {restarts_done} of "
                                               f"--max-restarts {max_restarts}")
    if policy == "wait" and lost_gpus:
        return FailureOutcome(Trigger.WAIT)
    return FailureOutcome(Trigger.RETRY)


def exit_status(state: State, signum: int | None, requeue_helps: bool = True) -> int:
    """ftmaster's exit status: 0 succeeded; on giving up 1 when a requeue may help, 93 when
    it cannot; 75 (EX_TEMPFAIL) when the rendezvous store is gone and the job must be
    requeued; 128 + N when stopped by signal N."""
    if state is State.SUCCEEDED:
        return 0
    if state is State.INTERRUPTED:
        return 128 + (signum or 0)
    if state is State.REQUEUED:
        return exit_codes.REQUEUE
    return exit_codes.GAVE_UP if requeue_helps else exit_codes.DO_NOT_REQUEUE


def requeue_advice(requeue_helps: bool) -> str:
    """The end of every give-up line: whether to requeue, and the exit status that says so."""
    if requeue_helps:
        return f"requeueing may help (exit status {exit_codes.GAVE_UP})"
    return f"do not requeue: a requeue would fail the same way (exit status {exit_codes.DO_NOT_REQUEUE})"
