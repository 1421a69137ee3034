"""The planner at scale: GPUs used and estimated throughput after losing 1 GPU, 1 node and
2 nodes, under the exact global batch and a 1% tolerance, and the planner's time.

Jobs (nodes of 8 H100s, 80 GiB, sequence 8192, micro-batch 1, distributed optimizer, SP):
  1,024 GPUs    Llama-3-70B  TP8 x PP8 x DP16, global batch 256
  16,384 GPUs   Llama-3-70B  TP8 x PP8 x DP256, global batch 2048 (the issue's)
  131,072 GPUs  Llama-3-405B TP8 x PP16 x CP2 x DP512, first/last stages of 7 layers,
                global batch 16384

Throughput is the cost model's estimate against the original layout on all GPUs.

    .venv/bin/python benchmarks/planner_scale.py [--repeats N]
"""

import argparse
import statistics
import time

from ftmaster.recovery.planner import plan_nodes
from planner_speed import LLAMA3_405B, LLAMA3_70B

JOBS = {1024: [*LLAMA3_70B, "--global-batch-size", "256"],
        16384: [*LLAMA3_70B, "--global-batch-size", "2048"],
        131072: [*LLAMA3_405B, "--global-batch-size", "16384"]}
GPU_MEMORY_GIB = 80


def losses(gpus: int) -> dict[str, list[int]]:
    nodes = gpus // 8
    return {"1 GPU": [8] * (nodes - 1) + [7], "1 node": [8] * (nodes - 1),
            "2 nodes": [8] * (nodes - 2)}


def timed_plan(command: list[str], nodes: list[int], original: int, tolerance: float,
               repeats: int):
    times, plan = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_nodes(command, nodes, original_world_size=original,
                          gpu_memory_gb=GPU_MEMORY_GIB, global_batch_tolerance_pct=tolerance)
        times.append(time.perf_counter() - start)
    return plan, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    print(f"{'GPUs':>7} {'lost':>8} {'tol':>4} {'layout':>22} {'batch':>6} {'used':>7} "
          f"{'share':>7} {'throughput':>10} {'plan ms':>8}")
    for gpus, command in JOBS.items():
        for lost, nodes in losses(gpus).items():
            for tolerance in (0.0, 1.0):
                plan, seconds = timed_plan(command, nodes, gpus, tolerance, repeats)
                layout = (f"TP{plan.tensor_model_parallel_size} PP{plan.pipeline_model_parallel_size}"
                          f" CP{plan.context_parallel_size} DP{plan.data_parallel_size}")
                print(f"{gpus:>7} {lost:>8} {tolerance:>3g}% {layout:>22} "
                      f"{plan.global_batch_size:>6} {plan.num_gpus_used:>7} "
                      f"{plan.num_gpus_used / sum(nodes):>7.1%} "
                      f"{plan.throughput_vs_original:>10.1%} {seconds * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
