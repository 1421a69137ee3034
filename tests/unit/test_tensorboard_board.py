"""The trainer's TensorBoard writer across relaunches into one folder."""

from types import SimpleNamespace

import pytest
import torch

from megatron.training.tensorboard import Board

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
