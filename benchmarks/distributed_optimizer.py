"""Step time, save time and checkpoint size with and without the distributed optimizer.

    .venv/bin/python benchmarks/distributed_optimizer.py [--ranks 2] [--iters 12] [--repeats 3]

Trains a small Llama-style GPT (Megatron-LM's recipe flags, hidden 256, 4 layers) on
``--ranks`` data-parallel CPU ranks, with ``--use-distributed-optimizer`` (Adam state sharded
over DP, fully reshardable checkpoint) and with ``--no-use-distributed-optimizer`` (state
replicated on every rank), saving once at the end. Prints the median step time (iterations
after the second), the save's seconds and bytes, and the ratios. On CPU the collectives are
gloo's, so the step-time ratio shows ftmaster's overhead, not a GPU's NCCL balance.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.trainer import SAVE_LINE, TINY_LLAMA, iterations, layout_args, run_trainer  # noqa: E402

WIDER = {"--hidden-size": "256", "--num-attention-heads": "8", "--kv-channels": "32",
         "--num-query-groups": "4", "--seq-length": "128", "--max-position-embeddings": "128",
         "--vocab-size": "1000"}


def model_args(iters: int) -> list[str]:
    args = [a for a in TINY_LLAMA if a != "--use-distributed-optimizer"]
    for flag, value in {**WIDER, "--train-iters": str(iters)}.items():
        args[args.index(flag) + 1] = value
    return args + layout_args(1, 1)


def one_run(ranks: int, iters: int, optimizer_flag: str, save: Path) -> tuple[float, float, int]:
    result = run_trainer(ranks, model_args(iters) + [optimizer_flag, "--save", str(save),
                                                     "--save-interval", str(iters)], timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]
    steps = [line["elapsed_ms"] for it, line in iterations(result.stdout).items() if it > 2]
    _, seconds, size = SAVE_LINE.search(result.stdout).groups()
    return statistics.median(steps), float(seconds), int(size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    flags = {"distributed": "--use-distributed-optimizer",
             "replicated": "--no-use-distributed-optimizer"}
    runs = {name: [] for name in flags}
    with tempfile.TemporaryDirectory(prefix="ftmaster-distopt-") as tmp:
        for repeat in range(options.repeats):
            for name, flag in flags.items():  # interleaved, so drift hits both alike
                runs[name].append(one_run(options.ranks, options.iters, flag,
                                          Path(tmp) / f"{name}{repeat}"))
    medians = {name: [statistics.median(column) for column in zip(*rows)]
               for name, rows in runs.items()}
    print(f"{options.ranks} DP ranks on CPU, {options.iters} iterations, "
          f"medians of {options.repeats} runs")
    print(f"{'optimizer state':16s} {'step ms':>9s} {'save s':>8s} {'bytes':>12s}")
    for name, (step, save_s, size) in medians.items():
        print(f"{name:16s} {step:9.1f} {save_s:8.3f} {size:12d}")
    (step_d, save_d, size_d), (step_r, save_r, size_r) = medians["distributed"], medians["replicated"]
    print(f"distributed / replicated: step {step_d / step_r:.2f}, save {save_d / save_r:.2f}, "
          f"bytes {size_d / size_r:.2f}")


if __name__ == "__main__":
    main()
