"""Each save takes its own write results: with --async-save, a disk save's writers may end
during a memory save, and megatron-core's one module-wide queue handed that save the other's
results (both checkpoints' .metadata then described the other's files)."""

import queue
import types

import pytest
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

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


def memory_save(tmp_path, async_queue):
    checkpointer = types.SimpleNamespace(group=None, folder_of=lambda tier: tmp_path,
                                         slots=InRankWriter(), async_queue=async_queue,
                                         disk_records=None)
    return checkpointing._Save(checkpointer, 12, "periodic", "memory", None)


def writer_of(tmp_path, shared):
    writer = FileSystemWriterAsync(tmp_path)
    writer.write_buckets, writer.results_queue = ["a bucket"], shared  # as prepare_write_data sets
    return writer


def test_a_memory_save_takes_its_own_results_while_a_disk_saves_wait(tmp_path, shared_queue):
    save = memory_save(tmp_path, async_queue=object())
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
