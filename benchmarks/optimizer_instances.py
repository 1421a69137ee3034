"""Megatron-LM's partial distributed optimizer at DP 4: memory, step time and dump bytes for
1, 2 and 4 instances.

    .venv/bin/python benchmarks/optimizer_instances.py [--hidden 512] [--iters 8] [--repeats 3]

For each N, 4 CPU ranks train a Llama-style GPT (benchmarks/distributed_optimizer.py's model,
``--hidden`` wide) with ``--use-distributed-optimizer --num-distributed-optimizer-instances
N`` and print:

- the difference N makes to the planner's memory estimate for the same command (its Adam
  state per rank is over DP x CP / N);
- the ranks' peak resident memory, measured: ``ru_maxrss`` of the largest rank (torchrun's
  reaped children), which on CPU holds the whole state; its growth over N = 1 is what the
  instances cost;
- the median step time (iterations after the second);
- with ``--replica-recovery`` and the memory tier, local rank 1 killed at iteration 3: each
  survivor's dump, in bytes and seconds (the optimizer slices are the part N changes; the
  model's tensors are the same in every dump). N = 1 refuses to dump (no replica); the plain
  optimizer's dump is the last row, for comparison.
"""

import argparse
import multiprocessing
import resource
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from distributed_optimizer import model_args  # noqa: E402
from helpers.replicas import dump_after_a_kill  # noqa: E402
from helpers.trainer import iterations, run_trainer  # noqa: E402
from planner_memory_calibration import estimate_gib  # noqa: E402

from ftmaster.recovery.replicas import dump_folder  # noqa: E402

RANKS = 4
MIB = 2 ** 20


def command(hidden: int, iters: int, instances: int) -> list[str]:
    args = model_args(iters)
    for flag, value in {"--hidden-size": str(hidden), "--ffn-hidden-size": str(hidden * 8 // 3),
                        "--global-batch-size": "8", "--micro-batch-size": "1"}.items():
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    if instances == 0:
        return args + ["--no-use-distributed-optimizer"]
    return args + ["--use-distributed-optimizer", "--num-distributed-optimizer-instances",
                   str(instances)]


def _train(args: list[str]) -> tuple[float, float]:
    result = run_trainer(RANKS, args, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:]
    steps = [line["elapsed_ms"] for it, line in iterations(result.stdout).items() if it > 2]
    # The largest reaped descendant's peak resident set (Linux: KiB); this process is fresh.
    return statistics.median(steps), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def train_once(args: list[str]) -> tuple[float, float]:
    """(median step ms, the largest rank's peak RSS in MiB) of one run, from a forked
    process of its own (``ru_maxrss`` of reaped children only ever grows)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(_train, args).result()


def dump_once(args: list[str], root: Path) -> tuple[float, float, str | None]:
    """(mean dump bytes, mean dump seconds, a refusal) of the survivors."""
    memory = root / "memory"
    replica = [*args, "--save", str(root / "save"), "--save-interval", "100",
               "--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir",
               str(memory), "--replica-recovery", "--exit-signal-handler"]
    reports = dump_after_a_kill(RANKS, replica, root / "log.txt", root / "run",
                                dump_folder(memory, 1), 1, "3:update")
    refused = next((r.refused for r in reports if r.refused), None)
    dumped = [r for r in reports if not r.refused]
    if not dumped:
        return float("nan"), float("nan"), refused
    return (statistics.mean(r.bytes for r in dumped), statistics.mean(r.seconds for r in dumped),
            refused)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    counts = (1, 2, 4)
    runs = {n: [] for n in counts}
    for _ in range(options.repeats):  # interleaved, so drift hits every N alike
        for n in counts:
            runs[n].append(train_once(command(options.hidden, options.iters, n)))
    print(f"DP {RANKS} on CPU, hidden {options.hidden}, {options.iters} iterations, "
          f"medians of {options.repeats} runs")
    print(f"{'N':>2s} {'estimate +MiB':>14s} {'peak RSS MiB':>13s} {'+MiB':>7s} "
          f"{'step ms':>9s} {'step ratio':>11s}")
    base_estimate = estimate_gib(command(options.hidden, options.iters, 1), RANKS)
    base_rss = statistics.median(r for _, r in runs[1])
    base_step = statistics.median(s for s, _ in runs[1])
    for n in counts:
        step = statistics.median(s for s, _ in runs[n])
        rss = statistics.median(r for _, r in runs[n])
        extra = estimate_gib(command(options.hidden, options.iters, n), RANKS) - base_estimate
        print(f"{n:2d} {extra * 1024:14.1f} {rss:13.0f} {rss - base_rss:7.0f} {step:9.1f} "
              f"{step / base_step:11.2f}")
    print(f"\n{'dump':>10s} {'bytes/rank MiB':>15s} {'seconds':>8s}")
    with tempfile.TemporaryDirectory(prefix="ftmaster-instances-") as tmp:
        for n, name in ((1, "N = 1"), (2, "N = 2"), (4, "N = 4"), (0, "plain")):
            size, seconds, refused = dump_once(command(options.hidden, 40, n), Path(tmp) / name)
            line = f"{name:>10s} {size / MIB:15.1f} {seconds:8.3f}"
            print(line + (f"  refused: {refused[:90]}" if refused else ""))


if __name__ == "__main__":
    main()
