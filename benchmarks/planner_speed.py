"""Median time of one ``plan_layout`` call (argv parsing, search, rewrite) per GPU count.

Three jobs, each planned at its original size and for fewer survivors:
GPT-3 175B at TP8 x PP8 x DP16 (1,024 GPUs, global batch 1536), Llama-3-70B at
TP8 x PP8 x DP256 (16,384 GPUs, global batch 2048) and Llama-3-405B at TP8 x PP16 x CP2 x DP512
(131,072 GPUs, global batch 16384), in nodes of 8, with four variants of the planner.

    .venv/bin/python benchmarks/planner_speed.py [--repeats N]
"""

import argparse
import statistics
import time

from ftmaster.recovery.planner import PlanError, plan_layout

GPT3_175B = ["pretrain_gpt.py", "--num-layers", "96", "--hidden-size", "12288",
             "--num-attention-heads", "96", "--seq-length", "2048", "--vocab-size", "50257",
             "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
             "--micro-batch-size", "1", "--global-batch-size", "1536", "--bf16",
             "--use-distributed-optimizer", "--sequence-parallel", "--save", "/ckpt"]
LLAMA = ["--group-query-attention", "--num-query-groups", "8", "--swiglu",
         "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--vocab-size", "128256", "--seq-length", "8192", "--bf16",
         "--use-distributed-optimizer", "--sequence-parallel", "--micro-batch-size", "1",
         "--train-iters", "100000", "--save", "/ckpt"]
LLAMA3_70B = ["pretrain_gpt.py", "--num-layers", "80", "--hidden-size", "8192",
              "--ffn-hidden-size", "28672", "--num-attention-heads", "64", *LLAMA,
              "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8"]
LLAMA3_405B = ["pretrain_gpt.py", "--num-layers", "126", "--hidden-size", "16384",
               "--ffn-hidden-size", "53248", "--num-attention-heads", "128", *LLAMA,
               "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
               "--context-parallel-size", "2", "--decoder-first-pipeline-num-layers", "7",
               "--decoder-last-pipeline-num-layers", "7"]
JOBS = {"GPT-3 175B": (GPT3_175B, 1024, (1, 7, 127, 1021, 1023, 1024)),
        "Llama-3-70B": ([*LLAMA3_70B, "--global-batch-size", "2048"], 16384,
                        (1023, 8184, 16368, 16376, 16383, 16384)),
        "Llama-3-405B": ([*LLAMA3_405B, "--global-batch-size", "16384"], 131072,
                         (65535, 131056, 131064, 131071, 131072))}
VARIANTS = {"closest": {}, "paper": {"mode": "paper"}, "closest+80GiB": {"gpu_memory_gb": 80},
            "closest+80GiB+1%": {"gpu_memory_gb": 80, "global_batch_tolerance_pct": 1.0}}


def median_milliseconds(command: list[str], gpus: int, original: int, options: dict,
                        repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            plan_layout(command, gpus, 8, original_world_size=original, **options)
        except PlanError:
            pass  # "nothing fits" is a planning answer too, and it is timed the same way
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    repeats = parser.parse_args().repeats
    print(f"median of {repeats} calls, milliseconds")
    print(f"{'job':13} {'gpus':>7} " + " ".join(f"{name:>17}" for name in VARIANTS))
    for job, (command, original, gpu_counts) in JOBS.items():
        for gpus in gpu_counts:
            medians = (median_milliseconds(command, gpus, original, options, repeats)
                       for options in VARIANTS.values())
            print(f"{job:13} {gpus:>7} " + " ".join(f"{median:>17.1f}" for median in medians))


if __name__ == "__main__":
    main()
