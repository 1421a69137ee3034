"""Stragglers end to end, on 4 CPU ranks at TP1 x PP1 x DP4: a GPU slowed 2x from iteration 8
is named by iteration 14, reported (console, event, ftmaster report), and with
--drain-stragglers drained when the cost model says the GPUs left run faster; and a healthy
100-iteration run raises nothing, with margin."""

import dataclasses
import subprocess
import sys

import pytest

from ftmaster.monitor.stragglers import StragglerConfig, held_slowdowns
from ftmaster.stragglers import WARMUP_ITERATIONS
from helpers.launch import ComputeFiguresWatcher, events, run_launch, train_args, watched_launch
from helpers.trainer import REPO

pytestmark = pytest.mark.slow

# Compute long enough (about 0.1 s a rank) that a 2x slowdown is not lost in the host's noise.
WIDER = {"--hidden-size": "192", "--seq-length": "128", "--max-position-embeddings": "128"}
SLOW = ("--inject", "slow:gpu=1,factor=2,at=iter:8")


def straggler_args(save, iters, save_interval=1000, global_batch=24):
    """DP 4 and DP 3 alike divide the global batch."""
    args = train_args(save, iters, 1, 1, save_interval, global_batch=global_batch)
    for flag, value in WIDER.items():
        args[args.index(flag) + 1] = value
    return args


def report_text(run_dir):
    return subprocess.run([sys.executable, "-m", "ftmaster.cli", "report", str(run_dir)],
                          capture_output=True, text=True, cwd=REPO, check=True).stdout


def figures_seen(watcher: ComputeFiguresWatcher, last: int = 20) -> str:
    """Each rank's compute per iteration up to ``last``, in ms, for a failure's message."""
    rows = (f"{it:3d}: " + " ".join("-" if ms is None else f"{ms:7.1f}"
                                    for _, ms in sorted(ranks.items()))
            for it, ranks in sorted(watcher.figures.items()) if it <= last)
    return "\n".join(("compute ms by iteration, rank 0 first:", *rows))


def test_a_slowed_gpu_is_named_a_straggler_and_reported(tmp_path):
    run_dir = tmp_path / "run"
    watcher = ComputeFiguresWatcher(run_dir)
    watcher.start()
    code, output = watched_launch(run_dir, 4, straggler_args(tmp_path / "ckpt", 40), *SLOW,
                                  stop_watching=watcher.stop)
    assert code == 0, output[-4000:]
    (found,) = events(run_dir, "straggler")
    assert (found["gpu"], found["iteration"] <= 14) == (1, True), figures_seen(watcher)
    assert found["named_at_iteration"] >= found["iteration"]  # its figures lag training
    assert found["slowdown"] >= StragglerConfig().ratio
    # Both step times are measured; the one before the slowdown is no reference (at iteration
    # 3-8 a run may still be warming up: 0.35 s/iteration there against 0.33 slowed, once).
    # It needs two steps between the warm-up (iterations 1-3) and the first slow iteration: on
    # a busy host rank 1 once computed slowly from 6 and was named from there, leaving one
    # step, so none was measured (unit: test_a_straggler_slow_from_just_after_the_warm_up_...).
    # Named from 8, the heartbeats of 4-7 precede it, and polls 0.1 s apart read 3 of them.
    healthy = found["healthy_step_s"]
    assert found["step_s"] > 0
    assert healthy > 0 if found["since"] >= 8 else healthy is None or healthy > 0
    assert "straggler: GPU 1 computes" in output
    assert len(events(run_dir, "launch")) == 1 and not events(run_dir, "drain")
    assert "straggler: GPU 1 computed" in report_text(run_dir)


def test_drain_stragglers_relaunches_without_the_gpu_when_the_cost_model_says_so(tmp_path):
    run_dir = tmp_path / "run"
    # --save-interval 20: the drain's agreed save is due 5 iterations after the last (gap 0.25)
    # 6 micro-batches a rank: the compute the straggler slows is most of the step, as on GPUs,
    # not the 4 ranks' contention for this host's 2 cores.
    result = run_launch(run_dir, 4, straggler_args(tmp_path / "ckpt", 40, 20, 48), *SLOW,
                        "--drain-stragglers")
    assert result.returncode == 0, result.stdout[-4000:]
    (found,) = events(run_dir, "straggler")
    drains = events(run_dir, "drain")
    assert len(drains) == 1, result.stdout[-4000:]
    (drain,) = drains
    assert (found["gpu"], drain["gpu"], drain["reason"]) == (1, 1, "straggler")
    assert drain["estimated_step_s"] < drain["step_s"]
    assert "straggler: draining GPU 1: the job runs" in result.stdout
    first, second = events(run_dir, "launch")
    assert first["gpus"] == [0, 1, 2, 3] and second["gpus"] == [0, 2, 3]
    # The plan estimates as the drain's decision did, not from attempt 1's slowed steps.
    assert events(run_dir, "plan")[-1]["estimated_step_seconds"] == pytest.approx(
        drain["estimated_step_s"])
    (after,) = events(run_dir, "straggler_drain_result")
    assert after["attempt"] == 2 and after["slowed_step_s"] == drain["step_s"]
    (loaded,) = events(run_dir, "checkpoint_loaded")
    # The drain's own save (or the periodic one), before the end; named early, a straggler
    # may be kept at first and drained when weighed again (supervisor.REWEIGH_ITERATIONS).
    assert loaded["iteration"] < 40
    assert events(run_dir, "complete")
    text = report_text(run_dir)
    assert "drained (draining GPU 1" in text and "s/iteration after the drain" in text


def test_a_healthy_run_raises_no_straggler_with_margin(tmp_path):
    """No event; and replayed, no rank held the ratio for even half the iterations an event
    needs."""
    run_dir = tmp_path / "run"
    watcher = ComputeFiguresWatcher(run_dir)
    watcher.start()
    # One micro-batch a rank: the least compute, so the host's noise weighs the most (and the
    # run takes half the time of three).
    args = straggler_args(tmp_path / "ckpt", 100, global_batch=8)
    code, output = watched_launch(run_dir, 4, args, stop_watching=watcher.stop, timeout=900)
    assert code == 0, output[-4000:]
    assert events(run_dir, "straggler") == [], output[-4000:]
    assert len(watcher.figures) >= 90, sorted(watcher.figures)
    config = StragglerConfig()
    half = dataclasses.replace(config, iterations=config.iterations // 2 + 1)
    warm = dict(sorted(watcher.figures.items())[WARMUP_ITERATIONS:])
    held = held_slowdowns(warm, watcher.stages, half)
    assert max(held.values()) < config.ratio, held
