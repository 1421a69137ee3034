"""What a save needs of its own: its write results (with --async-save, a disk save's writers
may end during a memory save, and megatron-core's one module-wide queue handed that save the
other's results, so both checkpoints' .metadata described the other's files), and room in the
memory tier."""

import os
import queue
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from ftmaster.recovery.checkpoints import advance_tracker, iteration_dir, list_iterations, read_tracker
from megatron.training import checkpointing

DISK_RESULTS = {0: ["an async disk save's results"]}


class InRankWriter:
    """What the memory tier's slots do with a request's arguments: write, then put the results."""

    @staticmethod
    def files(rank, buckets):
        return ["__0_0.distcp"]

    @staticmethod
    def write(folder, iteration, rank, buckets, results_queue):
        results_queue.put({0: [f"iteration {iteration}'s own results"]})


@pytest.fixture
def shared_queue(monkeypatch):
    """megatron-core's queue, holding the results of a disk save whose writers just ended."""
    shared = queue.SimpleQueue()
    shared.put(DISK_RESULTS)
    monkeypatch.setattr(filesystem_async, "_results_queue", shared)
    return shared


def memory_save(tmp_path, async_saves):
    checkpointer = types.SimpleNamespace(group=None, folder_of=lambda tier: tmp_path,
                                         slots=InRankWriter(), async_saves=async_saves,
                                         disk_records=None)
    return checkpointing._Save(checkpointer, 12, "periodic", "memory", None)


def writer_of(tmp_path, shared):
    writer = FileSystemWriterAsync(tmp_path)
    writer.write_buckets, writer.results_queue = ["a bucket"], shared  # as prepare_write_data sets
    return writer


def test_a_memory_save_takes_its_own_results_while_a_disk_saves_wait(tmp_path, shared_queue):
    save = memory_save(tmp_path, async_saves=object())
    request = save._with_digests(AsyncRequest(print, (0, ["a bucket"], shared_queue), []))
    request.async_fn(*request.async_fn_args)
    save.keep_write_results(writer_of(tmp_path, shared_queue), "global metadata", None)
    assert save.problem is None
    assert save.write_results == ["iteration 12's own results"]
    assert shared_queue.get_nowait() is DISK_RESULTS  # still there for its own save's finalize


def test_async_saves_each_get_their_own_queue_from_the_writers_server(tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(checkpointing, "_writers_manager",
                        types.SimpleNamespace(Queue=lambda: made.append(queue.Queue()) or made[-1]))
    assert isinstance(checkpointing.results_queue_of_one_save(in_rank=True), queue.SimpleQueue)
    first = checkpointing.results_queue_of_one_save(in_rank=False)
    second = checkpointing.results_queue_of_one_save(in_rank=False)
    assert made == [first, second] and first is not second


def test_a_writers_server_that_died_is_started_again_for_the_next_async_save(monkeypatch, capsys):
    """The OOM killer takes the Manager server (a process of its own, 270 MB): every later
    async save failed, and the final one ended the run as a storage error."""
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    monkeypatch.setattr(checkpointing, "_writers_manager", None)
    checkpointing.start_writer_results_queue()
    killed = Path(checkpointing._writers_manager.address).parent
    try:
        checkpointing._writers_manager._process.kill()
        checkpointing._writers_manager._process.join(10)
        shutil.rmtree(killed)  # what its exit handlers would have removed
        results = checkpointing.results_queue_of_one_save(in_rank=False)
        results.put("the writers' results")
        assert results.get(timeout=10) == "the writers' results"
        assert "the async writers' result server is gone" in capsys.readouterr().err
    finally:
        checkpointing._writers_manager.shutdown()


def test_a_step_wide_sigterm_leaves_the_writers_server_to_the_exit_save(monkeypatch):
    """SLURM's warning (or scancel --signal=TERM) reaches every process of the step: the
    server exited on it, and the async save in flight, and the exit save, lost its results."""
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    monkeypatch.setattr(checkpointing, "_writers_manager", None)
    checkpointing.start_writer_results_queue()
    try:
        server = checkpointing._writers_manager._process
        os.kill(server.pid, signal.SIGTERM)
        server.join(1.0)
        assert server.is_alive()
        results = checkpointing.results_queue_of_one_save(in_rank=False)
        results.put("the writers' results")
        assert results.get(timeout=10) == "the writers' results"
    finally:
        checkpointing._writers_manager.shutdown()


_RANK_KILLED_WITH_A_WRITERS_SERVER = """
import os, signal
from megatron.training import checkpointing
checkpointing.start_writer_results_queue()
print(checkpointing._writers_manager.address, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_rank_killed_leaves_no_folder_of_its_writers_server_in_tmp():
    """The server listens in a pymp-* folder of /tmp that only its exit handlers remove; killed
    with its rank, it left one behind per rank lost (56 after two days of suites here)."""
    rank = subprocess.run([sys.executable, "-c", _RANK_KILLED_WITH_A_WRITERS_SERVER],
                          capture_output=True, text=True, timeout=120)
    assert rank.returncode == -signal.SIGKILL, rank.stderr
    server_folder = Path(rank.stdout.strip()).parent
    assert server_folder.name.startswith("pymp-")
    deadline = time.monotonic() + 20
    while server_folder.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not server_folder.exists()


def test_short_of_room_a_memory_save_first_prunes_what_no_slot_keeps(tmp_path, monkeypatch):
    """A slot passed over while a persist copy read it (12) is pruned only after a memory save
    succeeds: without this, every later memory save failed for want of the room 12 held."""
    memory = tmp_path / "memory"
    for iteration in (12, 13):
        folder = iteration_dir(memory, iteration)
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(bytes(100))
    advance_tracker(memory, 13)

    def usage(path):
        used = sum(f.stat().st_size for f in memory.rglob("*.distcp"))
        return shutil._ntuple_diskusage(400, used, 400 - used - 100)  # 100 kept for others

    monkeypatch.setattr(checkpointing.shutil, "disk_usage", usage)
    checkpointer = types.SimpleNamespace(
        group=None, folder_of=lambda tier: memory, async_saves=None, disk_records=None,
        last_bytes=100, last_durable_iteration=13, newest_disk_iteration=None,
        slots=types.SimpleNamespace(kept_iterations=lambda: {13}))
    save = checkpointing._Save(checkpointer, 14, "periodic", "memory", None)
    assert save._room_problem() is None
    assert list_iterations(memory) == [13]
    checkpointer.last_bytes = 200
    assert "has 200 bytes free, a checkpoint needs about 200" in save._room_problem()
    assert list_iterations(memory) == [13]  # the tracked one stays


def test_the_prune_before_a_save_keeps_the_checkpoint_training_resumed_from(tmp_path, monkeypatch):
    """A relaunch loaded 20 (a node-local tier whose tracker is at 10: its copy of 20 is a
    part) and has no slots yet: 20 is the newest complete checkpoint, not 10."""
    memory = tmp_path / "memory"
    for iteration in (10, 20):
        iteration_dir(memory, iteration).mkdir(parents=True)
    advance_tracker(memory, 10)
    monkeypatch.setattr(checkpointing.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(400, 400, 0))
    checkpointer = types.SimpleNamespace(
        group=None, folder_of=lambda tier: memory, async_saves=None, disk_records=None,
        last_bytes=100, last_durable_iteration=20, newest_disk_iteration=None,
        slots=types.SimpleNamespace(kept_iterations=lambda: set()))
    assert "has 0 bytes free" in checkpointing._Save(checkpointer, 25, "periodic", "memory",
                                                     None)._room_problem()
    assert list_iterations(memory) == [20, 10]


def test_short_of_room_a_memory_save_prunes_the_tracked_checkpoint_a_disk_save_superseded(
        tmp_path, monkeypatch):
    """A tier with room for one checkpoint: the save after the first did not fit and went to
    disk (iteration 4). The tier's tracked iteration 2, which no load takes before 4, held
    that room for the rest of the run (and of every relaunch): each memory save failed."""
    memory = tmp_path / "memory"
    folder = iteration_dir(memory, 2)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes(100))
    advance_tracker(memory, 2)

    def usage(path):
        used = sum(f.stat().st_size for f in memory.rglob("*.distcp"))
        return shutil._ntuple_diskusage(150, used, 150 - used)

    monkeypatch.setattr(checkpointing.shutil, "disk_usage", usage)
    checkpointer = types.SimpleNamespace(
        group=None, folder_of=lambda tier: memory, async_saves=None, disk_records=None,
        last_bytes=100, last_durable_iteration=4, newest_disk_iteration=4,
        slots=types.SimpleNamespace(kept_iterations=lambda: set()))
    assert checkpointing._Save(checkpointer, 6, "periodic", "memory", None)._room_problem() is None
    assert list_iterations(memory) == [] and read_tracker(memory) is None


def test_a_save_into_the_folder_of_a_failed_one_waits_for_its_removal(tmp_path):
    """A failed save's folder is removed by the janitor; a save at the same iteration (the
    --exit-interval save after a failed periodic one) made the folder again meanwhile, and
    the removal then took the new checkpoint's files from under it, tracker and all."""
    import threading

    gate = threading.Event()
    janitor = checkpointing.Janitor()
    janitor.submit(gate.wait)  # the janitor busy with older work
    checkpointer = types.SimpleNamespace(group=None, folder_of=lambda tier: tmp_path, slots=None,
                                         async_saves=None, disk_records=None, janitor=janitor,
                                         memory_owner=None)
    failed = checkpointing._Save(checkpointer, 30, "periodic", "disk", None)
    failed.path.mkdir()
    failed.folder_made = True  # as its _make_folder made it
    (failed.path / "__0_0.distcp").write_bytes(b"part of a failed save")
    failed.remove_partial_folder()
    again = checkpointing._Save(checkpointer, 30, "exit", "disk", None)
    made = threading.Thread(target=again._make_folder, args=(None,))
    made.start()
    made.join(0.2)
    gate.set()
    made.join()
    janitor.finish()
    assert again.path.is_dir() and not any(again.path.iterdir())


# Megatron-LM's legacy folder; a torch_dist checkpoint without our manifest (shards alone
# are what a save of ours killed mid-write leaves, and are removed)
@pytest.mark.parametrize("foreign", ["mp_rank_00/model_optim_rng.pt", ".metadata"])
def test_a_disk_save_sets_another_tools_folder_aside_and_a_failure_removes_only_its_own(
        tmp_path, foreign):
    """A Megatron-LM checkpoint copied into --save without its tracker (legacy, or torch_dist
    without our manifest): the save at its iteration wrote into it, and the failed save's
    clean-up removed the folder, someone's only weights with it."""
    events = []
    janitor = checkpointing.Janitor()
    checkpointer = types.SimpleNamespace(group=None, folder_of=lambda tier: tmp_path, slots=None,
                                         async_saves=None, disk_records=None, janitor=janitor,
                                         memory_owner=None, own_states=checkpointing.OwnStates(),
                                         event=lambda name, **fields: events.append(name))
    weights = iteration_dir(tmp_path, 100) / foreign
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"someone's only weights")
    save = checkpointing._Save(checkpointer, 100, "periodic", "disk", None)
    assert save._make_folder(None) == (None, False, None)
    assert events == ["checkpoint_set_aside"] and not any(save.path.iterdir())
    (kept,) = tmp_path.glob("iter_0000100.discarded-*")
    assert (kept / foreign).read_bytes() == b"someone's only weights"
    save.remove_partial_folder()  # the save failed
    janitor.finish()
    assert (kept / foreign).exists() and not save.path.exists()


def test_a_folder_that_could_not_be_set_aside_is_not_removed_by_the_failed_save(tmp_path,
                                                                                 monkeypatch):
    janitor = checkpointing.Janitor()
    checkpointer = types.SimpleNamespace(group=None, folder_of=lambda tier: tmp_path, slots=None,
                                         async_saves=None, disk_records=None, janitor=janitor,
                                         memory_owner=None, own_states=checkpointing.OwnStates(),
                                         event=lambda name, **fields: None)
    weights = iteration_dir(tmp_path, 100) / "__0_0.distcp"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"someone's only weights")
    (weights.parent / ".metadata").write_bytes(b"its plan")

    def refused(self, target):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(Path, "rename", refused)
    save = checkpointing._Save(checkpointer, 100, "periodic", "disk", None)
    problem, _, _ = save._make_folder(None)
    assert problem.startswith(f"creating {save.path}: ")
    save.remove_partial_folder()
    janitor.finish()
    assert weights.read_bytes() == b"someone's only weights"


def test_a_room_check_that_fails_is_the_saves_problem_not_an_exception(tmp_path, monkeypatch):
    """Rank 0 alone makes the folder and checks the room while the other ranks wait for its
    answer in a broadcast: an OSError there must become the save's problem, or they would
    wait out the distributed timeout."""
    def gone(path):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(checkpointing.shutil, "disk_usage", gone)
    checkpointer = types.SimpleNamespace(
        group=None, folder_of=lambda tier: tmp_path, async_saves=None, disk_records=None,
        janitor=checkpointing.Janitor(), last_bytes=100, last_durable_iteration=20,
        slots=types.SimpleNamespace(claim=lambda previous, path: False,
                                    kept_iterations=lambda: set()))
    problem, refilled, found = checkpointing._Save(checkpointer, 25, "periodic", "memory",
                                                   None)._make_folder(20)
    assert problem.startswith(f"making room in {tmp_path}: ") and not refilled and found is None


@pytest.mark.parametrize("kind, ended_at, final", [
    ("periodic", 8, True),  # the async save --exit-interval left its own to
    ("periodic", None, False),  # mid-run: training goes on, a later save comes
    ("exit", None, True)])
def test_a_failed_save_of_the_iteration_training_stopped_at_fails_the_end(kind, ended_at, final):
    """--exit-interval at 8 (of 40) skips its own save while an async periodic save of 8 is
    under way; that save failing as the end waited for it left the run saying success (its
    heartbeat finished, exit 0) without its last checkpoint."""
    from megatron.training.training import Trainer, _OneSave

    trainer = Trainer.__new__(Trainer)
    trainer._final_save_failure, trainer._ended_at = None, ended_at
    trainer._consume_answered_flag = lambda iteration: None
    trainer.state = types.SimpleNamespace(iteration=8, consumed_train_samples=32)
    trainer.args = types.SimpleNamespace(train_samples=160, train_iters=None)
    failure = checkpointing.SaveFailure(8, Path("/save/iter_0000008"), kind, "disk", "ENOSPC")
    trainer._on_save_failed(_OneSave(), failure)
    assert (trainer._final_save_failure is failure) is final


class SavesAsCalled:
    """A checkpointer whose saves are durable at once, each one noted."""

    def __init__(self, memory_dir):
        self.memory_dir, self.last_saved_iteration, self.saves = memory_dir, None, []

    def finalize_async(self):
        pass

    def on_disk_at(self, iteration):
        return (self.saves[-1][1:] == ("disk", iteration)) if self.saves else False

    def save(self, state, kind, tier, on_durable, on_failed):
        self.last_saved_iteration = state.iteration
        self.saves.append((kind, tier, state.iteration))
        on_durable(types.SimpleNamespace(iteration=state.iteration))
        return 0.1


def trainer_at_the_exit_interval(requests, checkpointer, monkeypatch):
    """A trainer ending iteration 10 of 100, with --exit-interval 10 and every save noted."""
    from megatron.training import training

    monkeypatch.setattr(training, "kill_point", lambda *args: None)
    trainer = training.Trainer.__new__(training.Trainer)
    trainer.args = types.SimpleNamespace(exit_interval=10, save="/save", train_iters=100)
    trainer.state = types.SimpleNamespace(iteration=10, consumed_train_samples=40)
    trainer.checkpointer, trainer.requests = checkpointer, requests
    trainer.model = types.SimpleNamespace(sync_params=lambda: None)
    trainer.figures = types.SimpleNamespace(record=lambda *args: None)
    trainer._event, trainer._retry_on_disk = (lambda *args, **fields: None), None
    trainer._on_durable = lambda save, durable: requests.consume(durable.iteration)
    trainer._on_save_failed = lambda *args: None
    return trainer


def test_a_periodic_save_at_the_exit_interval_answers_a_flag_written_during_its_iteration(
        tmp_path, monkeypatch):
    """The agreement sampled before the monitor wrote the flag; the periodic save at 10 is the
    run's last (--exit-interval skips its own): it left the flag, and the next run on the
    folder saved unasked."""
    from megatron.training.save_requests import SaveRequests

    flag = tmp_path / "save_now.flag"
    requests = SaveRequests(flag, handle_sigterm=False, gap_frac=0.25, save_interval=10,
                            can_save=True, group=object())
    requests._pending_work, requests._issue_seconds = types.SimpleNamespace(wait=lambda: None), 0
    flag.write_text("")
    checkpointer = SavesAsCalled(None)
    assert trainer_at_the_exit_interval(requests, checkpointer, monkeypatch)._after_iteration()
    assert checkpointer.saves == [("periodic", "disk", 10)] and not flag.exists()


def test_an_interval_memory_save_at_the_exit_interval_leaves_the_state_to_the_exit_save(
        tmp_path, monkeypatch):
    """A --non-persistent-save-interval save due at --exit-interval's stop went to memory,
    then the exit save wrote the same iteration to disk, which a persist raced."""
    from megatron.training.save_requests import SaveRequests

    requests = SaveRequests(None, handle_sigterm=False, gap_frac=0.25, save_interval=100,
                            can_save=True, memory_interval=5)
    checkpointer = SavesAsCalled(tmp_path)
    assert trainer_at_the_exit_interval(requests, checkpointer, monkeypatch)._after_iteration()
    assert checkpointer.saves == [("exit", "disk", 10)]


def test_a_common_state_that_does_not_pickle_fails_the_save_at_its_agreement(tmp_path):
    """Raised on rank 0 alone, before the planning's collectives the other ranks had entered:
    they waited there until the process-group timeout."""
    save = checkpointing._Save.__new__(checkpointing._Save)
    save.path, save.problem, save.small_files = tmp_path, None, {}
    save._write_common({"a lock": __import__("threading").Lock()})
    assert save.problem.startswith("serialising common.pt: ")
    assert not (tmp_path / "common.pt").exists() and save.small_files == {}


def _writers_sigterm(answer):
    from megatron.training import checksums

    checksums._ignore_step_wide_sigterm()
    answer.put(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)


def test_a_writer_ignores_a_step_wide_sigterm_and_the_rank_keeps_its_own():
    """A writer process (the rank's multiprocessing child) died on SLURM's step-wide SIGTERM
    mid-save; the rank itself must keep the SIGTERM its exit save answers."""
    import multiprocessing

    from megatron.training import checksums

    context = multiprocessing.get_context("fork")
    answer = context.SimpleQueue()
    writer = context.Process(target=_writers_sigterm, args=(answer,))
    writer.start()
    writer.join(30)
    assert answer.get() is True
    before = signal.getsignal(signal.SIGTERM)
    checksums._ignore_step_wide_sigterm()  # in the rank: not a writer
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_save_s_blocked_seconds_follow_it_to_its_event_and_no_further(in_flight, monkeypatch,
                                                                        capsys):
    """Under --async-save a memory save is synchronous: its callback ran inside the call, and
    the seconds kept for it afterwards stayed for the run (one per memory save), below an
    "async ... started" line for a save already done."""
    from megatron.training import training

    durable = checkpointing.DurableSave(8, Path("/m/iter_0000008"), "periodic", "memory", 0.0,
                                        0.9, 100, 0.0, 0.0, {}, {}, True)
    ends = []

    def save(state, kind, tier, on_durable, on_failed):
        ends.append(lambda: on_durable(durable))
        if not in_flight:
            ends.pop()()
        return 0.25

    trainer = training.Trainer.__new__(training.Trainer)
    trainer.model = types.SimpleNamespace(sync_params=lambda: None)
    trainer.state = types.SimpleNamespace(iteration=8)
    trainer.args = types.SimpleNamespace(keep_emergency=None, exit_interval=0)
    trainer.checkpointer = types.SimpleNamespace(save=save, async_saves=object())
    trainer.board, trainer._training_done = None, lambda: False
    trainer._consume_answered_flag = lambda iteration: None
    events = []
    trainer._event = lambda name, **fields: events.append(fields["seconds"])
    monkeypatch.setattr(training, "log_rank0", print)
    trainer.save("periodic", "memory")
    for end in ends:
        end()
    assert events == [0.25 if in_flight else 0.9]
    assert ("async periodic save at iteration 8 in memory started" in capsys.readouterr().out) \
        is in_flight


class FinalizingFirst:
    """--async-save's persistent queue as the checkpointer sees it: a save starts only once
    the one in flight is finalized, here failed, from inside the new save's call."""

    def __init__(self, checkpointer) -> None:
        self.checkpointer, self.in_flight = checkpointer, None

    def start(self, save, request) -> None:
        if self.in_flight is not None:
            self.checkpointer.saved(self.in_flight, checkpointing.SaveFailure(
                self.in_flight.iteration, self.in_flight.path, "periodic", "disk", "ENOSPC"))
        self.in_flight = save

    def ended(self, save, complete: bool) -> None:
        pass


def test_an_async_save_failing_as_the_next_one_starts_ends_itself_not_the_next(tmp_path,
                                                                               monkeypatch):
    """The checkpointer kept one failure callback, its newest save's: an async save that
    failed as the next one finalized it ended that next save instead (its blocked seconds
    never kept, its event's seconds the time to durable), and never itself."""
    checkpointer = checkpointing.Checkpointer.__new__(checkpointing.Checkpointer)
    checkpointer.group, checkpointer.slots, checkpointer.disk_records = None, None, None
    checkpointer.async_saves = FinalizingFirst(checkpointer)
    checkpointer.folder_of = lambda tier: tmp_path
    checkpointer.last_durable_iteration, checkpointer.event = 4, lambda name, **fields: None
    checkpointer._state_dict = lambda state, **options: {}
    monkeypatch.setattr(checkpointing._Save, "request", lambda save, state_dict: "a request")
    monkeypatch.setattr(checkpointing, "_rank", lambda: 1)
    told = []
    for iteration in (8, 12):
        checkpointer.save(types.SimpleNamespace(iteration=iteration), "periodic",
                          on_failed=lambda failure, mine=iteration: told.append(
                              (mine, failure.iteration)))
    assert told == [(8, 8)]
