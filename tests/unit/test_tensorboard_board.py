"""The trainer's TensorBoard writer across relaunches into one folder."""

import re
import time
from types import SimpleNamespace

import pytest
import torch

from megatron.training.tensorboard import Board, wait_past_earlier_files

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


@pytest.fixture
def last_rank(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)


def attempt(folder, first, last):
    args = SimpleNamespace(tensorboard_dir=str(folder), tensorboard_log_interval=1,
                           tensorboard_queue_size=1000)
    board = Board(args, first)
    for iteration in range(first, last + 1):
        board.iteration(iteration, loss=float(iteration), learning_rate=1e-3, batch_size=8,
                        grad_norm=None, loss_scale=None, seconds=0.1)
    board.close()


def steps(folder, tag="lm loss"):
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [e.step for e in accumulator.Scalars(tag)]


def test_a_relaunch_from_scratch_shows_each_iteration_once(tmp_path, last_rank):
    """No checkpoint before the failure: the relaunch trains from iteration 1 again, and what
    the failed attempt wrote from there on is not the run's curve any more."""
    attempt(tmp_path, 1, 6)
    attempt(tmp_path, 1, 9)
    assert steps(tmp_path) == list(range(1, 10))


def test_a_relaunch_from_a_checkpoint_continues_the_curve(tmp_path, last_rank):
    attempt(tmp_path, 1, 6)
    attempt(tmp_path, 5, 9)  # loaded iteration 4
    assert steps(tmp_path) == list(range(1, 10))


def test_a_relaunch_in_the_same_second_still_sorts_after_the_attempt_before(tmp_path, last_rank,
                                                                          monkeypatch):
    """Files of one second sort by pid and a per-process count, as text: count 10 sorted
    before 9, and the first attempt's points purged the relaunch's (the flaky test above,
    under -n 2, whose workers made other writers before)."""
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    attempt(tmp_path, 1, 6)
    attempt(tmp_path, 5, 9)
    assert steps(tmp_path) == list(range(1, 10))
    assert [loss.value for loss in EventAccumulator(str(tmp_path)).Reload().Scalars("lm loss")] \
        == [float(step) for step in range(1, 10)]


def test_a_clock_behind_the_folder_s_newest_file_is_said_not_waited_for(tmp_path, capsys):
    (tmp_path / f"events.out.tfevents.{int(time.time()) + 600}.other-host.7.0").write_bytes(b"")
    started = time.monotonic()
    wait_past_earlier_files(tmp_path, print)
    assert time.monotonic() - started < 1
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and re.fullmatch(
        f"TensorBoard scalars in {re.escape(str(tmp_path))}: this host's clock is (599|600) s "
        "behind an earlier attempt's event file; TensorBoard may show that attempt's points "
        "over this one's", said[0])


def test_a_full_disk_under_the_folder_is_one_line_and_training_goes_on(tmp_path, last_rank, capsys):
    """tensorboard's writer raises its thread's error again at every later call: out of the
    last rank's iteration, that ended training, and each relaunch into the full disk too."""
    class FullDisk:
        calls = 0

        def add_scalar(self, *args):
            FullDisk.calls += 1
            raise OSError(28, "No space left on device")

        flush = close = add_scalar

    args = SimpleNamespace(tensorboard_dir=str(tmp_path), tensorboard_log_interval=1,
                           tensorboard_queue_size=1000)
    board = Board(args, 1)
    board.writer.inner.close()
    board.writer.inner = FullDisk()
    for iteration in (1, 2):
        board.iteration(iteration, loss=1.0, learning_rate=1e-3, batch_size=8, grad_norm=None,
                        loss_scale=None, seconds=0.1)
    board.validation(2, 1.0)
    board.flush()
    board.close()
    assert FullDisk.calls == 1
    assert capsys.readouterr().out.splitlines() == [
        f"warning: TensorBoard scalars in {tmp_path} stop here: OSError: [Errno 28] No space "
        "left on device"]


def test_a_full_disk_as_the_writer_is_made_is_one_line_and_training_goes_on(
        tmp_path, last_rank, monkeypatch, capsys):
    """SummaryWriter writes and flushes its file's first record as it is made: on a full disk
    the last rank's Board raised, and every attempt failed at its start."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    def full(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RecordWriter, "flush", full)
    args = SimpleNamespace(tensorboard_dir=str(tmp_path), tensorboard_log_interval=1,
                           tensorboard_queue_size=1000)
    board = Board(args, 1)
    assert not board.due(1)  # nothing gathered for a writer that stopped
    board.close()
    assert capsys.readouterr().out.splitlines() == [
        f"warning: TensorBoard scalars in {tmp_path} stop here: OSError: [Errno 28] No space "
        "left on device"]


def test_a_folder_that_stops_answering_stops_the_scalars_not_the_caller(monkeypatch):
    """tensorboard's own queue holds ten records: past them every add_scalar blocked, under
    a lock its flush holds too, and on a hung mount the monitor stopped sampling and the
    supervisor stopped at its next event."""
    import threading
    import time

    from ftmaster import scalar_writer
    from ftmaster.scalar_writer import GuardedWriter

    monkeypatch.setattr(scalar_writer, "WAIT_S", 0.3)
    answered = threading.Event()

    class Hung:
        def add_scalar(self, *args):
            answered.wait(30)

        flush = close = add_scalar

    said = []
    writer = GuardedWriter(Hung(), "scalars", said.append)
    started = time.monotonic()
    for step in range(100):
        writer.add_scalar("risk", 0.5, step)
    writer.flush()
    writer.add_scalar("risk", 0.5, 100)
    writer.close()
    answered.set()
    assert time.monotonic() - started < 2
    assert said == ["scalars stop here: TimeoutError: flush did not finish within 0.3 s (the "
                    "folder stopped answering?)"]
