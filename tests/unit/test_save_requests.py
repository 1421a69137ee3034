"""The save decision: gap filter, deferral, periodic saves, flag identity, SIGTERM."""

import os
import signal

import pytest

from ftmaster.runfiles import write_flag
from ftmaster.goodput import gap_iterations
from megatron.training.save_requests import Decision, SaveRequests, minimum_gap
from helpers.process_group import process_group_of_one


@pytest.fixture(scope="module", autouse=True)
def single_process_group(tmp_path_factory):
    with process_group_of_one(tmp_path_factory.mktemp("pg")):
        yield


@pytest.fixture
def flag(tmp_path):
    return tmp_path / "flags" / "save_now.flag"


def make(flag, save_interval=20, gap_frac=0.25, handle_sigterm=False):
    return SaveRequests(flag, handle_sigterm, gap_frac, save_interval, can_save=True)


def step(requests, iteration, last):
    requests.start_agreement()
    return requests.decide(iteration, last)


@pytest.mark.parametrize("gap_frac, interval, expected", [
    (0.25, 20, 5), (0.25, 100, 25), (0.5, 10, 5), (0.25, 3, 1), (0.0, 20, 1), (0.25, None, 1),
    # 7.000000000000001 and 55.00000000000001 in binary floating point: 8 and 56 were waited
    (0.07, 100, 7), (0.55, 100, 55), (0.07, 101, 8)])
def test_minimum_gap(gap_frac, interval, expected):
    assert minimum_gap(gap_frac, interval) == expected
    assert gap_iterations(gap_frac, interval or 0) == expected  # the goodput model's


def test_no_flag_only_periodic_saves(flag):
    requests = make(flag)
    assert not step(requests, 19, 0).save
    decision = step(requests, 20, 0)
    assert decision.save and not decision.emergency


def test_early_request_is_deferred_then_honoured(flag):
    requests = make(flag)
    write_flag(flag, gpu=1, score=0.99)
    first = step(requests, 21, 20)
    assert not first.save and first.deferred_until == 25
    assert step(requests, 22, 20).deferred_until is None  # reported once
    assert not step(requests, 24, 20).save
    decision = step(requests, 25, 20)
    assert decision.save and decision.emergency


def test_periodic_save_satisfies_a_pending_request(flag):
    requests = make(flag, save_interval=8)  # gap 2
    write_flag(flag)
    assert not step(requests, 7, 6).save
    decision = step(requests, 8, 6)
    assert decision.save and not decision.emergency
    requests.consume(8)
    assert not flag.exists()


@pytest.mark.parametrize("content", [b"", b"{not json", b"\xff\xfe\x00"])
def test_empty_or_malformed_flag_is_a_request(flag, content):
    flag.parent.mkdir(parents=True)
    flag.write_bytes(content)
    decision = step(make(flag), 10, 0)
    assert decision.save and decision.emergency


def test_answered_flag_is_not_asked_twice_but_a_new_one_is(flag):
    requests = make(flag)
    write_flag(flag)
    assert step(requests, 10, 0).emergency
    # the async save is still in flight: the same file is not a second request
    assert not step(requests, 16, 10).save
    write_flag(flag, gpu=2)  # a new request written during the save
    assert step(requests, 17, 10).emergency
    requests.consume(17)
    assert not flag.exists()


def test_a_flag_another_rank_saw_first_is_answered_once(flag):
    requests = make(flag)
    requests.start_agreement()  # this rank samples before the flag appears
    write_flag(flag)
    requests._pending_work.wait()
    requests._buffer[1] = 1  # what the MAX all-reduce gives when another rank saw the flag
    assert requests.decide(10, 0).emergency
    requests.consume(10)
    assert not flag.exists()
    assert not step(requests, 15, 10).save  # no second save for the same request


def test_consume_keeps_a_flag_written_after_the_decision(flag):
    requests = make(flag)
    write_flag(flag)
    assert step(requests, 10, 0).emergency
    write_flag(flag, gpu=3)
    requests.consume(10)
    assert flag.exists()


def test_the_last_save_answers_a_request_still_waiting_out_the_gap(flag):
    """Training ends (or exits) before the request's gap has passed: the save of the last
    state answers it, so the flag does not ask the next run on the folder for a save."""
    requests = make(flag)
    write_flag(flag)
    assert step(requests, 21, 20).deferred_until == 25
    requests.answer_with_last_save(21)
    requests.consume(21)
    assert not flag.exists()


def test_the_last_save_keeps_a_flag_written_after_it_started(flag):
    requests = make(flag)
    write_flag(flag)
    assert not step(requests, 21, 20).save
    requests.answer_with_last_save(21)
    write_flag(flag, gpu=3)  # during the final save: not answered by it
    requests.consume(21)
    assert flag.exists()


def test_the_last_save_keeps_the_answer_of_a_save_in_flight(flag):
    requests = make(flag)
    write_flag(flag)
    assert step(requests, 10, 0).emergency  # in flight
    requests.answer_with_last_save(12)  # the same file: the same answer, the save at 10's
    requests.consume(10)
    assert not flag.exists()
    requests.answer_with_last_save(12)  # no flag now: nothing new to answer
    write_flag(flag, gpu=2)
    requests.consume(12)
    assert flag.exists()


def test_an_older_saves_end_leaves_the_flag_a_newer_save_answers(flag):
    """A periodic async save at 100 in flight, a flag at 101 deferred, the emergency save at
    125 answers it: the save at 100 ending removed the flag while 125 still wrote (and, on
    CUDA, before it wrote anything), and the monitor saw no request pending."""
    requests = make(flag, save_interval=100)
    assert step(requests, 100, 0).save  # periodic, still writing
    write_flag(flag)
    assert step(requests, 101, 100).deferred_until == 125
    assert step(requests, 125, 100).emergency
    requests.consume(100)  # the periodic save ends
    assert flag.exists()
    requests.consume(125)
    assert not flag.exists()


def test_gap_zero_saves_at_once(flag):
    requests = make(flag, gap_frac=0.0)
    write_flag(flag)
    assert step(requests, 21, 20).emergency


def test_sigterm_requests_save_and_exit(flag):
    requests = make(None, handle_sigterm=True)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        decision = step(requests, 7, 0)
        assert decision.save and decision.exit
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_inactive_without_triggers_runs_no_collective():
    requests = SaveRequests(None, False, 0.25, 20, can_save=True)
    assert not requests.active
    assert step(requests, 20, 0).save


def test_memory_interval_saves_go_between_periodic_ones(flag):
    requests = SaveRequests(flag, False, 0.25, 20, can_save=True, memory_interval=4)
    decisions = {it: step(requests, it, 0) for it in (3, 4, 8, 20)}
    assert not decisions[3].save
    assert decisions[4].save and decisions[4].memory and decisions[8].memory
    assert decisions[20].save and not decisions[20].memory  # the periodic one, on disk


def test_a_memory_interval_save_answers_a_pending_request(flag):
    requests = SaveRequests(flag, False, 0.25, 100, can_save=True, memory_interval=2)
    write_flag(flag, gpu=1, score=0.99)
    assert step(requests, 11, 10).deferred_until == 35  # gap 25 from the memory save at 10
    decision = step(requests, 12, 10)
    assert decision.save and decision.memory and not decision.emergency


def test_the_agreement_carries_each_ranks_compute_time_in_its_own_slot(flag):
    """One rank here: its slot holds its figure, and the save decision is unchanged."""
    requests = SaveRequests(flag, False, 0.25, 20, can_save=True, ranks=1, rank=0)
    requests.start_agreement(compute_us=12345)
    assert requests.decide(1, 0) == Decision()
    assert requests.compute_us == [12345]
    write_flag(flag, source="test")
    requests.start_agreement(compute_us=777)
    assert requests.decide(6, 0).emergency and requests.compute_us == [777]
