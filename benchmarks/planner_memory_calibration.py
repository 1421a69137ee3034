"""The planner's memory estimate against published measurements and known-good layouts.

Measured peaks are Megatron-LM's own CI golden values (``mem-max-allocated-bytes``, i.e.
``torch.cuda.max_memory_allocated``, logged by the last rank on DGX H100) in
NVIDIA/Megatron-LM ``tests/functional_tests/test_cases/gpt/*/golden_values_dev_dgx_h100.json``
(commit d98e8a6); the commands are those tests' ``model_config.yaml``. Known-good layouts are
rows of NeMo's published H100 performance table (``docs/source/performance/
performance_summary.md``, NeMo 24.07; NeMo enables the distributed optimizer, sequence
parallelism with TP > 1, flash attention and FP8) and the issue's Llama-3-70B layouts: they
ran on 80 GB GPUs, so the planner must not refuse them.

    .venv/bin/python benchmarks/planner_memory_calibration.py
"""

from ftmaster.recovery.memory_estimate import RESERVE_GIB
from ftmaster.recovery.planner import plan_layout

GPU_MEMORY_GIB = 80

LLAMA3_8B_GEOMETRY = [  # gpt3_7b_*_memory_speed: Llama-3-8B shape with a 4h (GeLU) MLP
    "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
    "--group-query-attention", "--num-query-groups", "8", "--untie-embeddings-and-output-weights",
    "--global-batch-size", "8", "--seq-length", "8192", "--max-position-embeddings", "8192",
    "--vocab-size", "131073", "--use-distributed-optimizer", "--bf16"]
GPT_15B = [  # gpt3_15b_8t_release: Nemotron-style 15B, squared ReLU, 256k vocabulary
    "--tensor-model-parallel-size", "8", "--use-distributed-optimizer", "--sequence-parallel",
    "--disable-bias-linear", "--micro-batch-size", "4", "--global-batch-size", "384",
    "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
    "--num-layers", "32", "--hidden-size", "6144", "--num-attention-heads", "48",
    "--group-query-attention", "--num-query-groups", "8", "--seq-length", "4096",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--bf16", "--vocab-size", "256000"]
# (name, command, GPUs, measured peak GiB, note)
MEASURED = [
    ("Llama-3-8B shape, TP4 DP2, mbs 2, seq 8192", [*LLAMA3_8B_GEOMETRY, "--micro-batch-size", "2",
     "--tensor-model-parallel-size", "4"], 8, 53.22, "gpt3_7b_tp4_pp1_memory_speed"),
    ("Llama-3-8B shape, PP4 VPP8 DP2, mbs 1, seq 8192", [*LLAMA3_8B_GEOMETRY, "--micro-batch-size", "1",
     "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1"], 8, 56.55,
     "gpt3_7b_tp1_pp4_memory_speed (last stage)"),
    ("GPT 15B, TP8 SP DP16, mbs 4, seq 4096", GPT_15B, 128, 26.23,
     "gpt3_15b_8t_release; 16 nodes: the only DP that matches its measured steady-state "
     "allocation of 13.27 GB"),
]

LLAMA3_70B = ["--num-layers", "80", "--hidden-size", "8192", "--ffn-hidden-size", "28672",
              "--num-attention-heads", "64", "--group-query-attention", "--num-query-groups", "8",
              "--swiglu", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
              "--disable-bias-linear", "--vocab-size", "128256", "--bf16", "--use-distributed-optimizer",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "1"]
LLAMA3_8B = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
             "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
             "--swiglu", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
             "--disable-bias-linear", "--vocab-size", "128256", "--bf16", "--use-distributed-optimizer",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "1"]
LLAMA2_7B = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008",
             "--num-attention-heads", "32", "--swiglu", "--untie-embeddings-and-output-weights",
             "--position-embedding-type", "rope", "--disable-bias-linear", "--vocab-size", "32000",
             "--bf16", "--use-distributed-optimizer", "--hidden-dropout", "0", "--attention-dropout",
             "0", "--micro-batch-size", "1", "--seq-length", "4096"]
LLAMA2_70B = [*LLAMA3_70B[:LLAMA3_70B.index("--vocab-size")], "--vocab-size", "32000", "--bf16",
              "--use-distributed-optimizer", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--micro-batch-size", "1", "--seq-length", "4096"]
GPT3_175B = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
             "--seq-length", "2048", "--vocab-size", "50257", "--bf16", "--use-distributed-optimizer",
             "--sequence-parallel", "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size",
             "8", "--num-layers-per-virtual-pipeline-stage", "2"]
FP8 = ["--fp8-format", "hybrid"]
TP_PP = "--tensor-model-parallel-size", "--pipeline-model-parallel-size"

# (name, command, GPUs)
KNOWN_GOOD = [
    ("issue: Llama-3-70B TP8 PP8 SP, seq 8192, 2048 x 1", [*LLAMA3_70B, "--seq-length", "8192",
     "--sequence-parallel", TP_PP[0], "8", TP_PP[1], "8", "--global-batch-size", "2048"], 16384),
    ("issue: Llama-3-70B TP8 PP4 SP, seq 8192", [*LLAMA3_70B, "--seq-length", "8192",
     "--sequence-parallel", TP_PP[0], "8", TP_PP[1], "4", "--global-batch-size", "2048"], 16384),
    ("NeMo: Llama-3-8B TP1 CP2 DP4, seq 8192, FP8", [*LLAMA3_8B, "--seq-length", "8192",
     "--context-parallel-size", "2", "--global-batch-size", "128", *FP8], 8),
    ("NeMo: Llama-3-70B TP4 PP4 CP2 VP5, seq 8192, FP8", [*LLAMA3_70B, "--seq-length", "8192",
     "--sequence-parallel", TP_PP[0], "4", TP_PP[1], "4", "--context-parallel-size", "2",
     "--num-layers-per-virtual-pipeline-stage", "4", "--global-batch-size", "128", *FP8], 64),
    ("NeMo: Llama-2-7B TP1 DP8, seq 4096, FP8", [*LLAMA2_7B, "--global-batch-size", "128", *FP8], 8),
    ("NeMo: Llama-2-70B TP4 PP4 VP20, seq 4096, FP8", [*LLAMA2_70B, "--sequence-parallel",
     TP_PP[0], "4", TP_PP[1], "4", "--num-layers-per-virtual-pipeline-stage", "1",
     "--global-batch-size", "128", *FP8], 64),
    ("NeMo: GPT3-175B TP4 PP8 VP6, mbs 1, seq 2048, FP8", [*GPT3_175B, "--micro-batch-size", "1",
     "--global-batch-size", "256", *FP8], 128),
    ("NeMo: GPT3-175B TP4 PP8 VP6, mbs 2, seq 2048, FP8", [*GPT3_175B, "--micro-batch-size", "2",
     "--global-batch-size", "2048", *FP8], 512),
]


def estimate_gib(args: list[str], gpus: int) -> float:
    """The estimate for the command's own layout on ``gpus`` (the busiest rank)."""
    plan = plan_layout(["pretrain_gpt.py", *args], gpus, 8, original_world_size=gpus)
    assert plan.reason == "the original layout fits (hot spare)"
    return plan.estimated_memory_gib


def fits(args: list[str], gpus: int) -> bool:
    plan = plan_layout(["pretrain_gpt.py", *args], gpus, 8, original_world_size=gpus,
                       gpu_memory_gb=GPU_MEMORY_GIB)
    return plan.reason == "the original layout fits (hot spare)"


def main() -> None:
    print("measured peak allocated memory (Megatron-LM CI, DGX H100) vs the estimate")
    print(f"{'configuration':52} {'GPUs':>5} {'estimate':>9} {'measured':>9} {'error':>7}")
    errors = []
    for name, args, gpus, measured, _source in MEASURED:
        estimate = estimate_gib(args, gpus)
        errors.append(estimate / measured - 1)
        print(f"{name:52} {gpus:>5} {estimate:>8.2f}G {measured:>8.2f}G {errors[-1]:>+7.1%}")
    print(f"mean absolute error {sum(map(abs, errors)) / len(errors):.1%}, "
          f"worst {max(errors, key=abs):+.1%}")
    print(f"\nknown-good layouts on {GPU_MEMORY_GIB} GiB GPUs (estimate + {RESERVE_GIB} GiB "
          "reserve must fit)")
    for name, args, gpus in KNOWN_GOOD:
        print(f"{name:60} {gpus:>6} {estimate_gib(args, gpus):>7.1f}G  "
              f"{'kept' if fits(args, gpus) else 'REFUSED'}")


if __name__ == "__main__":
    main()
