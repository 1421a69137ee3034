"""Straggler detection: latency in iterations for slowdowns of 1.2x, 1.5x and 2x, and what the
per-rank timing costs an iteration.

    .venv/bin/python benchmarks/stragglers.py [--repeats 3] [--iters 40] [--healthy 3]

Latency: ``ftmaster launch`` on 4 CPU ranks (TP1 x PP1 x DP4, the e2e test's model), with
``--inject slow:gpu=1,factor=F,at=iter:8``; the latency is the iteration of the ``straggler``
event less 8 ("-" when no event came before the run ended), medians over the repeats, at the
default ``--straggler-ratio`` and ``--straggler-iterations``, with the slowdown each event
reported. The event's ``iteration`` is that of the last figure that named it; an iteration's
figure rides the next one's agreement and reaches the heartbeat after the one after, so
training had gone further when it was named: "trained" counts from 8 to the iteration training
had reached then (the event's ``named_at_iteration``).

Noise: the e2e test's healthy run (100 iterations, one micro-batch a rank), ``--healthy``
times; for each, the highest slowdown a healthy rank held for ``--straggler-iterations`` in a
row (the least ratio that would have named it), replayed from the heartbeat's figures, and the
default ratio's margin over it.

Spikes: simulated, no launch: 4 ranks of one stage, each figure within 3% of the others,
and one healthy rank 1.6-2x slower at random iterations (each with probability p); out of
``--simulated`` runs of 100 iterations (seeded), how many name it. A detector that forgives
a straggler's lone dip must not take a rank slow at some iterations only for one.

Overhead: in this process, what each rank adds per iteration: the two timing marks (the thread's
CPU time each on CPU), reading the last iteration's figure,
recording the figures, and local rank 0's heartbeat with them against one without (the
figures ride the save agreement's all-reduce: its tensor grows by one int64 per rank).
"""

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from e2e.test_launch_stragglers import straggler_args  # noqa: E402
from helpers.launch import ComputeFiguresWatcher, events, run_launch, watched_launch  # noqa: E402

from ftmaster import runfiles  # noqa: E402
from ftmaster.monitor.stragglers import (StragglerConfig, StragglerTracker,  # noqa: E402
                                         held_slowdowns)
from ftmaster.stragglers import WARMUP_ITERATIONS  # noqa: E402
from megatron.training.step_timing import KEPT, ComputeFigures, ComputeTimer  # noqa: E402

FACTORS = (1.2, 1.5, 2.0)
SLOW_FROM = 8


def latency(factor: float, iters: int, root: Path) -> tuple[int, float, int] | None:
    """Iterations from the slowdown to the figure that named it, the slowdown it reported,
    and iterations from the slowdown to where training was when it was named."""
    run_dir = root / "run"
    result = run_launch(run_dir, 4, straggler_args(root / "ckpt", iters), "--inject",
                        f"slow:gpu=1,factor={factor},at=iter:{SLOW_FROM}", timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:]
    found = [e for e in events(run_dir, "straggler") if e["gpu"] == 1]
    if not found:
        return None
    return (found[0]["iteration"] - SLOW_FROM, found[0]["slowdown"],
            found[0]["named_at_iteration"] - SLOW_FROM)


def healthy_noise(root: Path, config: StragglerConfig) -> tuple[float, int]:
    """The highest slowdown a rank of a healthy run held for ``config.iterations`` in a row,
    and the straggler events the run raised."""
    run_dir = root / "run"
    watcher = ComputeFiguresWatcher(run_dir)
    watcher.start()
    code, output = watched_launch(run_dir, 4, straggler_args(root / "ckpt", 100, global_batch=8),
                                  stop_watching=watcher.stop, timeout=1800)
    assert code == 0, output[-3000:]
    warm = dict(sorted(watcher.figures.items())[WARMUP_ITERATIONS:])
    return max(held_slowdowns(warm, watcher.stages, config).values()), len(
        events(run_dir, "straggler"))


def spiky_runs_named(share: float, runs: int, config: StragglerConfig, seed: int = 11) -> int:
    """Of ``runs`` simulated 100-iteration runs, those in which rank 1, 1.6-2x slower at a
    ``share`` of its iterations at random, is named."""
    rng, stages = random.Random(seed), {rank: 0 for rank in range(4)}
    named = 0
    for _ in range(runs):
        figures = {it: {rank: 10.0 * rng.uniform(0.97, 1.03) * (
            rng.uniform(1.6, 2.0) if rank == 1 and rng.random() < share else 1.0)
            for rank in stages} for it in range(1, 101)}
        named += bool(StragglerTracker(config).observe(figures, stages))
    return named


def microseconds(action, repeats: int = 20000) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        action()
    return (time.perf_counter() - start) / repeats * 1e6


def overhead(ranks: int = 4) -> dict[str, float]:
    timer, figures = ComputeTimer(cuda=False), ComputeFigures([0] * ranks, list(range(ranks)))
    for iteration in range(KEPT):
        figures.record(iteration, [40_000 + r for r in range(ranks)])

    def marks():
        timer.start()
        timer.reduction_entered()
        timer.previous_microseconds()

    with tempfile.TemporaryDirectory(prefix="ftmaster-stragglers-") as tmp:
        run_dir = Path(tmp)
        return {
            "timing marks and read": microseconds(marks),
            "figures recorded": microseconds(lambda: figures.record(KEPT, [40_000] * ranks)),
            "heartbeat with figures": microseconds(lambda: runfiles.write_heartbeat(
                run_dir, 1, 8, 1, compute=figures.heartbeat()), 2000),
            "heartbeat without": microseconds(lambda: runfiles.write_heartbeat(run_dir, 1, 8, 1),
                                              2000),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--healthy", type=int, default=3, help="healthy runs for the noise")
    parser.add_argument("--simulated", type=int, default=200, help="simulated runs per share")
    options = parser.parse_args()
    config = StragglerConfig()
    print(f"straggler ratio {config.ratio}, {config.iterations} iterations in a row, window "
          f"{config.window}; 4 CPU ranks, slowed from iteration {SLOW_FROM}, "
          f"{options.iters} iterations")
    print(f"{'factor':>7s} {'latency (iterations)':>22s} {'median':>7s} {'trained':>10s} "
          f"{'median':>7s}  slowdowns reported")
    with tempfile.TemporaryDirectory(prefix="ftmaster-stragglers-") as tmp:
        for factor in FACTORS:
            found = [latency(factor, options.iters, Path(tmp) / f"{factor}-{repeat}")
                     for repeat in range(options.repeats)]
            columns = []
            for which in (0, 2):  # the naming figure's lag, then training's
                detected = [f[which] for f in found if f is not None]
                columns.append(" ".join("-" if f is None else str(f[which]) for f in found))
                columns.append(f"{statistics.median(detected):g}"
                               if len(detected) > len(found) / 2 else "-")
            reported = " ".join(f"{f[1]:.2f}" for f in found if f is not None)
            print(f"{factor:7.2f} {columns[0]:>22s} {columns[1]:>7s} {columns[2]:>10s} "
                  f"{columns[3]:>7s}  {reported}", flush=True)
        print(f"\nhealthy 100-iteration runs: the highest slowdown a rank held for "
              f"{config.iterations} iterations in a row")
        for run in range(options.healthy):
            held, raised = healthy_noise(Path(tmp) / f"healthy-{run}", config)
            print(f"  run {run + 1}: {held:.3f} (the ratio {config.ratio} is "
                  f"{config.ratio / held:.2f}x it), {raised} straggler events", flush=True)
    print(f"\nsimulated healthy rank 1.6-2x slower at random iterations: runs of 100 "
          f"iterations that name it, of {options.simulated}")
    for share in (0.1, 0.2, 0.3):
        print(f"  slow at {share:.0%} of its iterations: "
              f"{spiky_runs_named(share, options.simulated, config)}", flush=True)
    print(f"\nper-iteration cost of the timing ({4} ranks' figures, {KEPT} iterations kept):")
    for name, cost in overhead().items():
        print(f"  {name:24s} {cost:8.2f} us")


if __name__ == "__main__":
    main()
