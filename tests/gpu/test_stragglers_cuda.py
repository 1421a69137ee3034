"""Straggler timing on CUDA: a rank's compute is the device's time between two events on its
stream, read one iteration later with no synchronisation of its own; end to end, a GPU slowed
2x is named a straggler on 4 GPUs as on 4 CPU ranks."""

import time

import pytest
import torch

from ftmaster.monitor.stragglers import StragglerConfig
from helpers.gpu import job_gpu, needs_gpus
from helpers.launch import events, run_launch, train_args
from megatron.training.step_timing import ComputeTimer

pytestmark = pytest.mark.gpu

BUSY_CYCLES = 200_000_000
"""``torch.cuda._sleep``'s spin: about 0.1-0.2 s of device time at 1-2 GHz."""


def device_seconds(work) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


@needs_gpus(1)
def test_compute_is_the_devices_time_between_the_marks_not_the_hosts():
    torch.cuda.init()
    reference = device_seconds(lambda: torch.cuda._sleep(BUSY_CYCLES))
    timer = ComputeTimer(cuda=True)
    timer.start()
    host_start = time.perf_counter()
    torch.cuda._sleep(BUSY_CYCLES)  # queued: the host goes on at once
    timer.reduction_entered()
    host_seconds = time.perf_counter() - host_start
    torch.cuda.synchronize()  # in training, the loss's read does this
    timer.start()  # the next iteration: the last one's figure becomes readable
    measured = timer.previous_microseconds() / 1e6
    assert host_seconds < reference / 4, (host_seconds, reference)
    assert measured == pytest.approx(reference, rel=0.2)


@needs_gpus(1)
def test_an_iteration_still_on_the_device_has_no_figure_until_it_lands():
    """``previous_microseconds`` asks the event first: before the device reaches it the
    figure is 0 (``elapsed_time`` would raise cudaErrorNotReady), and the same marks read
    the device's time once it has."""
    torch.cuda.init()
    reference = device_seconds(lambda: torch.cuda._sleep(BUSY_CYCLES))
    timer = ComputeTimer(cuda=True)
    timer.start()
    torch.cuda._sleep(BUSY_CYCLES)
    timer.reduction_entered()
    timer.start()  # nothing synchronised: the last iteration is still on the device
    assert timer.previous_microseconds() == 0
    torch.cuda.synchronize()
    assert timer.previous_microseconds() / 1e6 == pytest.approx(reference, rel=0.2)


@needs_gpus(1)
def test_the_compute_so_far_waits_for_the_device():
    """A rehearsal's slowdown sleeps in proportion to ``seconds_so_far``: on CUDA it drains
    the device first, so queued work counts, not just the host's queuing of it."""
    torch.cuda.init()
    reference = device_seconds(lambda: torch.cuda._sleep(BUSY_CYCLES))
    timer = ComputeTimer(cuda=True)
    timer.start()
    torch.cuda._sleep(BUSY_CYCLES)
    assert timer.seconds_so_far() >= 0.8 * reference


@needs_gpus(4)
@pytest.mark.timeout(1800)  # a first CUDA start compiles and loads kernels (test_launch_cuda.py)
def test_a_gpu_slowed_2x_is_named_a_straggler(tmp_path):
    run_dir = tmp_path / "run"
    args = train_args(tmp_path / "ckpt", 40, 1, 1, 1000, "--bf16", global_batch=24)
    slowed = job_gpu(1, 4)
    result = run_launch(run_dir, 4, args, "--inject", f"slow:gpu={slowed},factor=2,at=iter:8",
                        timeout=1500)
    assert result.returncode == 0, result.stdout[-4000:]
    (found,) = events(run_dir, "straggler")
    assert (found["gpu"], found["iteration"] <= 14) == (slowed, True)
    assert found["slowdown"] >= StragglerConfig().ratio
    assert f"straggler: GPU {slowed} computes" in result.stdout
