"""The supervisor's state machine and its decisions, as tables."""

import signal

import pytest

from ftmaster.states import (TERMINAL, TRANSITIONS, IllegalTransition, State, Trigger, advance,
                             after_failure, exit_status, is_early_exit, requeue_advice)

S, T = State, Trigger

LEGAL = [
    (S.STARTING, T.LAUNCHED, S.RUNNING),
    (S.RUNNING, T.COMPLETED, S.SUCCEEDED),
    (S.RUNNING, T.FAILURE, S.FAILED),
    (S.RUNNING, T.SIGNALLED, S.STOPPING),
    (S.RUNNING, T.CRITICAL_GPU, S.DRAINING),
    (S.DRAINING, T.DRAINED, S.PLANNING),
    (S.DRAINING, T.RISK_CLEARED, S.RUNNING),
    (S.DRAINING, T.COMPLETED, S.SUCCEEDED),
    (S.DRAINING, T.FAILURE, S.FAILED),
    (S.DRAINING, T.SIGNALLED, S.STOPPING),
    (S.FAILED, T.RETRY, S.PLANNING),
    (S.FAILED, T.WAIT, S.WAITING),
    (S.FAILED, T.GIVE_UP, S.GAVE_UP),
    (S.WAITING, T.GPUS_BACK, S.PLANNING),
    (S.WAITING, T.WAIT_TIMED_OUT, S.PLANNING),
    (S.WAITING, T.SIGNALLED, S.INTERRUPTED),
    (S.PLANNING, T.PLANNED, S.RELAUNCHING),
    (S.PLANNING, T.NO_LAYOUT, S.GAVE_UP),
    (S.PLANNING, T.FAILURE, S.FAILED),
    (S.RELAUNCHING, T.LAUNCHED, S.RUNNING),
    (S.STARTING, T.GIVE_UP, S.GAVE_UP),  # the attempt could not be started
    (S.RELAUNCHING, T.GIVE_UP, S.GAVE_UP),
    (S.STOPPING, T.STOPPED, S.INTERRUPTED),
    (S.STOPPING, T.COMPLETED, S.SUCCEEDED),  # the signal came after training's last checkpoint
    (S.STOPPING, T.FAILURE, S.FAILED),  # a rank failed on its own during the stop
    # nothing is training: a signal ends the run at once
    (S.STARTING, T.SIGNALLED, S.INTERRUPTED),
    (S.RELAUNCHING, T.SIGNALLED, S.INTERRUPTED),
    (S.FAILED, T.SIGNALLED, S.INTERRUPTED),
    (S.PLANNING, T.SIGNALLED, S.INTERRUPTED),
    # across nodes: a round agreed with the other nodes
    (S.RUNNING, T.PEERS_WAITING, S.PLANNING),
    (S.DRAINING, T.PEERS_WAITING, S.PLANNING),
    (S.PLANNING, T.STANDBY, S.STANDBY),
    (S.PLANNING, T.GIVE_UP, S.GAVE_UP),
    (S.PLANNING, T.COMPLETED, S.SUCCEEDED),
    (S.STANDBY, T.PEERS_WAITING, S.PLANNING),
    (S.STANDBY, T.COMPLETED, S.SUCCEEDED),
    (S.STANDBY, T.GIVE_UP, S.GAVE_UP),
    (S.STANDBY, T.SIGNALLED, S.INTERRUPTED),
    # the store is gone: requeue, from wherever the supervisor is
    *((s, T.STORE_LOST, S.REQUEUED) for s in State if s not in TERMINAL),
]


@pytest.mark.parametrize("state,trigger,expected", LEGAL)
def test_legal_transitions(state, trigger, expected):
    assert advance(state, trigger) is expected


def test_the_table_is_exactly_the_legal_list():
    assert TRANSITIONS == {(s, t): n for s, t, n in LEGAL}


@pytest.mark.parametrize("state,trigger", [
    (s, t) for s in State for t in Trigger if (s, t) not in TRANSITIONS])
def test_every_other_pair_is_illegal(state, trigger):
    with pytest.raises(IllegalTransition, match=trigger.value):
        advance(state, trigger)


def test_terminal_states_lead_nowhere_and_every_other_state_leads_somewhere():
    sources = {s for s, _ in TRANSITIONS}
    assert sources.isdisjoint(TERMINAL)
    assert sources | TERMINAL == set(State)


@pytest.mark.parametrize("restarts,early,policy,lost,trigger,reason", [
    (0, 0, "available", {1}, T.RETRY, None),
    (0, 1, "available", set(), T.RETRY, None),  # one early exit is retried
    (0, 2, "available", set(), T.GIVE_UP, "before its first iteration 2 times"),
    (3, 0, "available", set(), T.GIVE_UP, "restart budget spent: 3 of --max-restarts 3"),
    (2, 0, "wait", {1}, T.WAIT, None),
    (2, 0, "wait", set(), T.RETRY, None),  # nothing lost: nothing to wait for
    (3, 0, "wait", {1}, T.GIVE_UP, "restart budget"),
    (0, 0, "drain", {2}, T.RETRY, None),
])
def test_after_failure(restarts, early, policy, lost, trigger, reason):
    outcome = after_failure(restarts_done=restarts, max_restarts=3, early_exits_in_row=early,
                            policy=policy, lost_gpus=frozenset(lost))
    assert outcome.trigger is trigger
    assert (outcome.reason is None) if reason is None else reason in outcome.reason


@pytest.mark.parametrize("cause,first_exit_code,trained,unfit,early", [
    ("exit", 1, False, False, True),  # the script raised before training: its error
    ("exit", None, False, False, True),  # torchrun's own status, no rank's
    ("exit", -signal.SIGSEGV, False, False, True),  # a crash the script may cause each time
    ("exit", -signal.SIGKILL, False, False, False),  # the OOM killer, an operator, a fault
    ("exit", 1, True, False, False),  # it trained: the script works
    ("exit", 1, False, True, False),  # a GPU found unfit is the cause
    ("hang", None, False, False, False),
    ("usage", 2, False, False, False),  # given up at once, for its own reason
])
def test_only_a_script_ending_on_its_own_before_training_is_an_early_exit(
        cause, first_exit_code, trained, unfit, early):
    assert is_early_exit(cause, first_exit_code, trained, unfit) is early


@pytest.mark.parametrize("cause,again,trigger,reason", [
    ("storage", False, T.GIVE_UP, "storage error"),  # a relaunch would hit the same full disk
    ("no_checkpoint", False, T.GIVE_UP, "no checkpoint can be loaded"),
    ("usage", False, T.GIVE_UP, "arguments"),
    ("data", False, T.GIVE_UP, "training data cannot be read"),  # on any GPU, on any node
    ("nonfinite", False, T.RETRY, None),  # once: from the newest valid checkpoint
    ("peer_read", False, T.RETRY, None),  # the next round agrees anew on what nodes hold
    ("nonfinite", True, T.GIVE_UP, "non-finite loss again after resuming from the same"),
    ("exit", False, T.RETRY, None),
    ("hang", False, T.RETRY, None),
])
def test_what_a_relaunch_cannot_cure_ends_the_run_at_once(cause, again, trigger, reason):
    outcome = after_failure(restarts_done=0, max_restarts=3, early_exits_in_row=0,
                            policy="available", lost_gpus=frozenset(), cause=cause,
                            nonfinite_again=again)
    assert outcome.trigger is trigger
    assert (outcome.reason is None) if reason is None else reason in outcome.reason
    assert outcome.requeue_helps is (trigger is not T.GIVE_UP)  # neither would a requeue


@pytest.mark.parametrize("early,restarts,requeue_helps", [
    (2, 0, False),  # a crash loop: a requeue loops again
    (0, 3, True),  # the budget spent on failing hardware: fresh nodes may do
])
def test_a_give_up_says_whether_a_requeue_may_help(early, restarts, requeue_helps):
    outcome = after_failure(restarts_done=restarts, max_restarts=3, early_exits_in_row=early,
                            policy="available", lost_gpus=frozenset())
    assert (outcome.trigger, outcome.requeue_helps) == (T.GIVE_UP, requeue_helps)
    advice = requeue_advice(requeue_helps)
    assert advice.endswith(f"(exit status {exit_status(S.GAVE_UP, None, requeue_helps)})")
    assert advice.startswith("requeueing may help" if requeue_helps else "do not requeue")


@pytest.mark.parametrize("state,signum,requeue_helps,status", [
    (S.SUCCEEDED, None, True, 0), (S.GAVE_UP, None, True, 1), (S.GAVE_UP, None, False, 93),
    (S.INTERRUPTED, 15, True, 143), (S.INTERRUPTED, 2, True, 130), (S.REQUEUED, None, True, 75)])
def test_exit_status(state, signum, requeue_helps, status):
    assert exit_status(state, signum, requeue_helps) == status
