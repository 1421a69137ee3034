"""Median time of one ``plan_layout`` call (argv parsing, search, rewrite) per GPU count.

A GPT-3 175B-shaped job (96 layers, hidden 12288, 96 heads, global batch 1536) planned at
TP8 x PP8 x DP16 on 1024 GPUs in nodes of 8, re-planned for fewer survivors.

    .venv/bin/python benchmarks/planner_speed.py [--repeats N]
"""

import argparse
import statistics
import time

from ftmaster.recovery.planner import PlanError, plan_layout

COMMAND = ["pretrain_gpt.py", "--num-layers", "96", "--hidden-size", "12288",
           "--num-attention-heads", "96", "--seq-length", "2048", "--vocab-size", "50257",
           "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
           "--micro-batch-size", "1", "--global-batch-size", "1536", "--save", "/ckpt"]
GPU_COUNTS = (1, 2, 3, 4, 7, 8, 16, 31, 64, 127, 128, 256, 512, 1021, 1023, 1024)
VARIANTS = {"closest": {}, "paper": {"mode": "paper"}, "closest+80GiB": {"gpu_memory_gb": 80}}


def median_microseconds(gpus: int, options: dict, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            plan_layout(COMMAND, gpus, 8, **options)
        except PlanError:
            pass  # "nothing fits" is a planning answer too, and it is timed the same way
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    repeats = parser.parse_args().repeats
    print(f"median of {repeats} calls, microseconds")
    print(f"{'gpus':>5} " + " ".join(f"{name:>14}" for name in VARIANTS))
    for gpus in GPU_COUNTS:
        medians = (median_microseconds(gpus, options, repeats) for options in VARIANTS.values())
        print(f"{gpus:>5} " + " ".join(f"{median:>14.0f}" for median in medians))


if __name__ == "__main__":
    main()
