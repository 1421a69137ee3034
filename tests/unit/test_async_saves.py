"""The async save deadline: how long a writer is given, and which save is given up, over a
fake queue and clock (the stuck writer itself: test_checkpoint_integrity.py)."""

import threading
from collections import deque
from types import SimpleNamespace

import pytest

from ftmaster import runfiles
from megatron.training import async_saves
from megatron.training.async_saves import CHECK_EVERY, AsyncSaves
from test_save_requests import single_process_group  # noqa: F401  (a gloo group of one)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeQueue:
    """megatron-core's queue of async calls, in order; a save's writer is done once the test
    says so, and its finalize is the save's agreement."""

    persistent = False

    def __init__(self) -> None:
        self.async_calls: deque = deque()
        self.done: set[str] = set()
        self.stopped: list[str] = []
        self.saves: AsyncSaves | None = None

    def schedule_async_request(self, save: str) -> None:
        self.async_calls.append(SimpleNamespace(save=save, async_caller=SimpleNamespace(
            close=lambda abort, save=save: self.stopped.append(save))))

    def get_num_unfinalized_calls(self) -> int:
        return len(self.async_calls)

    def maybe_finalize_async_calls(self, blocking: bool = False) -> None:
        while self.async_calls and self.async_calls[0].save in self.done:
            self.saves.ended(self.async_calls.popleft().save, complete=True)


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(async_saves.time, "perf_counter", clock)
    return clock


def saves_over(queue: FakeQueue, timeout_s=None, rank_bytes=0, **watched) -> tuple[AsyncSaves, list]:
    given_up, queue.reasons = [], []

    def give_up(save, why):
        given_up.append(save)
        queue.reasons.append(why)

    saves = AsyncSaves(queue, None, timeout_s, give_up, rank_bytes, **watched)
    queue.saves = saves
    return saves, given_up


def look(saves: AsyncSaves, times: int = CHECK_EVERY) -> None:
    for _ in range(times):
        saves.finalize(blocking=False)


@pytest.mark.parametrize("timeout_s, longest_s, rank_bytes, deadline_s", [
    (30.0, 500.0, 10**12, 30.0),  # --async-save-timeout is taken as given
    (None, 0.0, 0, 600.0),  # ten minutes at least
    (None, 100.0, 0, 1000.0),  # ten times the longest async save of the attempt
    (None, 0.0, 20 * 10**9, 2000.0),  # a 20 GB share at 10 MB/s: a first save's time
])
def test_the_deadline_gives_a_writer_ten_times_its_due(clock, timeout_s, longest_s, rank_bytes,
                                                       deadline_s):
    queue = FakeQueue()
    saves, _ = saves_over(queue, timeout_s, rank_bytes)
    saves.start("a", "a")
    clock.now, queue.done = longest_s, {"a"}
    look(saves, 1)
    assert saves.deadline_s() == deadline_s


def test_a_stuck_save_alone_is_given_up_and_the_one_behind_it_teaches_no_deadline(clock):
    """A stuck at 0, B started at 120 and written by 130: at the 10th look past 600 s A is
    given up and B finalized. B waited behind A for most of its time, which is no writer's
    own: the deadline stays at its floor."""
    queue = FakeQueue()
    saves, given_up = saves_over(queue)
    saves.start("A", "A")
    clock.now = 120.0
    saves.start("B", "B")
    queue.done.add("B")
    clock.now = 590.0
    look(saves)
    assert given_up == [] and queue.stopped == []  # not yet past 600 s
    clock.now = 610.0
    look(saves)
    assert given_up == ["A"] and queue.stopped == ["A"] and not queue.async_calls
    assert saves.deadline_s() == 600.0


def test_a_save_behind_a_stuck_one_gets_its_deadline_from_when_it_became_the_oldest(clock):
    queue = FakeQueue()
    saves, given_up = saves_over(queue)
    saves.start("A", "A")
    clock.now = 120.0
    saves.start("B", "B")  # stuck as well
    clock.now = 610.0
    look(saves)
    assert given_up == ["A"]
    clock.now = 1200.0
    look(saves)
    assert given_up == ["A"]  # 590 s since it became the oldest
    clock.now = 1220.0
    look(saves)
    assert given_up == ["A", "B"]


def test_a_dead_persistent_worker_fails_its_save_without_waiting_for_the_deadline(clock):
    """On CUDA megatron-core's persistent worker writes every save; killed (the OOM killer),
    it never says the save is done, and the next save would wait for it."""
    queue = FakeQueue()
    queue.persistent = True
    alive = [True]
    queue.persistent_caller = SimpleNamespace(process=SimpleNamespace(is_alive=lambda: alive[0]))
    saves, given_up = saves_over(queue)
    saves.start("A", "A")
    alive[0] = False  # killed while it writes
    clock.now = 5.0
    look(saves)
    assert given_up == ["A"] and "writer process died" in queue.reasons[0]
    assert queue.persistent_caller is None  # the next save starts a fresh worker


def test_a_persistent_worker_that_died_between_saves_is_replaced_before_the_next(clock):
    """megatron-core would hand the next save to the dead worker and wait for it to stage the
    tensors, for good."""
    queue = FakeQueue()
    queue.persistent = True
    queue.persistent_caller = SimpleNamespace(process=SimpleNamespace(is_alive=lambda: False),
                                              close=lambda abort: None)
    saves, given_up = saves_over(queue)
    saves.start("A", "A")
    assert queue.persistent_caller is None and given_up == []  # nothing was in flight


@pytest.fixture
def waiting_clock(clock, monkeypatch):
    """The clock, also as unix time, moved on by each poll of a blocking wait; ``clock.at``
    runs a step once the clock reaches its time."""
    clock.at = {}

    def sleep(seconds):
        clock.now += seconds
        for when in [when for when in clock.at if clock.now >= when]:
            clock.at.pop(when)()

    monkeypatch.setattr(async_saves.time, "sleep", sleep)
    monkeypatch.setattr(async_saves.time, "time", clock)
    return clock


def test_a_blocking_wait_gives_up_writers_idle_for_most_of_the_hang_timeout(waiting_clock):
    """The end of training waits for a save whose writers stopped writing at 5 s: without
    a heartbeat, ftmaster would take the wait for a hang at 300 s and relaunch. It is given
    up once the wait has lasted 225 s, the saves behind it complete and training ends."""
    queue = FakeQueue()
    saves, given_up = saves_over(queue, hang_timeout_s=300.0, written_at=lambda save: 5.0)
    saves.start("A", "A")
    waiting_clock.now = 10.0
    saves.start("final", "final")
    queue.done.add("final")
    saves.finalize(blocking=True)
    assert given_up == ["A"] and not queue.async_calls
    assert 235.0 <= waiting_clock.now <= 235.0 + CHECK_EVERY * async_saves.POLL_S + 1e-6
    assert "wrote nothing for 225.5 s, 75% of ftmaster's --hang-timeout of 300 s" in queue.reasons[0]


def test_a_blocking_wait_waits_for_a_slow_save_that_still_writes(waiting_clock):
    """As the supervisor, which takes a checkpoint file written as progress."""
    queue = FakeQueue()
    saves, given_up = saves_over(queue, hang_timeout_s=300.0,
                                 written_at=lambda save: waiting_clock.now - 5.0)
    saves.start("A", "A")
    waiting_clock.at[400.0] = lambda: queue.done.add("A")
    saves.finalize(blocking=True)
    assert given_up == [] and waiting_clock.now >= 400.0


@pytest.mark.parametrize("hang_timeout_s, blocking", [(None, True), (300.0, False)])
def test_idle_writers_wait_for_the_deadline_unless_a_supervised_wait_blocks_training(
        waiting_clock, hang_timeout_s, blocking):
    """Without a supervisor (plain torchrun) there is no hang timeout to beat, and while
    training goes on (looks that do not block) its heartbeats show it alive."""
    queue = FakeQueue()
    saves, given_up = saves_over(queue, hang_timeout_s=hang_timeout_s,
                                 written_at=lambda save: 0.0)
    saves.start("A", "A")
    waiting_clock.now = 200.0
    if blocking:
        saves.finalize(blocking=True)
    else:
        look(saves)
    assert given_up == (["A"] if blocking else [])
    if blocking:
        assert waiting_clock.now >= 600.0 and "async save deadline of 600 s" in queue.reasons[0]


def test_a_look_at_the_folder_that_never_answers_ends_the_wait_once_that_lasts(
        waiting_clock, monkeypatch):
    """On a file system that stopped answering, a stat may never return: the look runs off
    the training thread, and its silence counts as a write when it began, so the wait
    still ends, once the silence has lasted 75% of the hang timeout."""
    monkeypatch.setattr(async_saves, "LOOK_WAIT_S", 0.01)
    answered = threading.Event()
    queue = FakeQueue()
    saves, given_up = saves_over(queue, hang_timeout_s=300.0,
                                 written_at=lambda save: answered.wait() and waiting_clock.now)
    saves.start("A", "A")
    saves.finalize(blocking=True)
    answered.set()
    assert given_up == ["A"] and 450.0 <= waiting_clock.now < 451.0


def test_a_slow_look_at_a_save_still_writing_gives_nothing_up(waiting_clock, monkeypatch):
    """A parallel file system loaded by the save's own writers lists its folder slowly: a
    look that did not answer in time counted as no write since the wait began, and a save
    that was writing all along was given up at 75% of the hang timeout."""
    monkeypatch.setattr(async_saves, "LOOK_WAIT_S", 0.01)
    looks = iter(range(1000))
    queue = FakeQueue()

    def written_at(save):
        if next(looks) % 2 == 0:  # every other look answers too late (time.sleep is the clock's)
            threading.Event().wait(0.05)
        return waiting_clock.now - 5.0

    saves, given_up = saves_over(queue, hang_timeout_s=300.0, written_at=written_at)
    saves.start("A", "A")
    waiting_clock.at[400.0] = lambda: queue.done.add("A")
    saves.finalize(blocking=True)
    assert given_up == [] and waiting_clock.now >= 400.0


def test_a_rank_that_does_not_look_gives_nothing_up_on_its_own(waiting_clock):
    """Only each node's first rank looks (written_at given); the others put in no idle time,
    and with no look at all nothing is given up before the deadline."""
    queue = FakeQueue()
    saves, given_up = saves_over(queue, hang_timeout_s=300.0)
    saves.start("A", "A")
    waiting_clock.at[400.0] = lambda: queue.done.add("A")
    saves.finalize(blocking=True)
    assert given_up == [] and waiting_clock.now >= 400.0


@pytest.mark.parametrize("value, seconds", [
    ("300.0", 300.0), ("8", 8.0), (None, None), ("", None), ("soon", None), ("0", None),
    ("-5", None), ("inf", None), ("nan", None)])
def test_the_hang_timeout_handed_to_the_trainer_is_a_positive_number_or_none(
        monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv(runfiles.HANG_TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(runfiles.HANG_TIMEOUT_ENV, value)
    assert runfiles.hang_timeout_from_env() == seconds
