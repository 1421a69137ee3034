"""``ftmaster plan``: the JSON contract, the summary, nodes, the tolerance, one-line errors."""

import json
import shlex
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftmaster.cli import main
from test_planner_megatron_check import LLAMA3_70B, command, megatron_problems

SCRIPT_ARGS = ["pretrain_gpt.py", "--num-layers", "12", "--hidden-size", "64",
               "--num-attention-heads", "4", "--seq-length", "32",
               "--tensor-model-parallel-size=2", "--pipeline-model-parallel-size", "2",
               "--micro-batch-size", "2", "--global-batch-size", "8", "--save", "/ckpt"]
REWRITTEN = ["pretrain_gpt.py", "--num-layers", "12", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "32",
             "--tensor-model-parallel-size=1", "--pipeline-model-parallel-size", "3",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--save", "/ckpt",
             "--load", "/ckpt"]
DESIGN_KEYS = {"tensor_model_parallel_size", "pipeline_model_parallel_size",
               "data_parallel_size", "micro_batch_size", "global_batch_size", "num_gpus_used",
               "command"}
# The issue's Llama-3-70B: 80 layers, TP8 x PP8, global batch 2048, micro-batch 1.
LLAMA3_70B_TP8_PP8 = command(**LLAMA3_70B, tp=8, pp=8, mbs=1, gbs=2048,
                             extra=("--sequence-parallel", "--save", "/ckpt"))


def run_plan(*args):
    return CliRunner().invoke(main, ["plan", *args])


def test_json_contract():
    result = run_plan("--gpus", "3", "--mode", "paper", "--json", "--", *SCRIPT_ARGS)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    plan = json.loads(result.stdout)
    assert {key: plan[key] for key in DESIGN_KEYS} == {
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 3,
        "data_parallel_size": 1, "micro_batch_size": 2, "global_batch_size": 8,
        "num_gpus_used": 3, "command": REWRITTEN}
    assert set(plan) - DESIGN_KEYS == {
        "context_parallel_size", "expert_model_parallel_size",
        "virtual_pipeline_model_parallel_size", "ranks_per_node", "idle_gpus",
        "original_global_batch_size", "estimated_step_seconds", "throughput_vs_original",
        "estimated_memory_gib", "reason", "warnings"}
    assert (plan["ranks_per_node"], plan["idle_gpus"], plan["warnings"]) == ([3], 0, [])


def test_without_json_flag_stdout_is_still_the_json_and_stderr_the_summary():
    result = run_plan("--gpus", "5", "--gpus-per-node", "4", "--original-gpus", "4", "--",
                      *SCRIPT_ARGS)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["num_gpus_used"] == 4
    lines = result.stderr.splitlines()
    assert lines[:2] == ["TP 2 x PP 2 x DP 1 on 4 of 5 GPUs (1 idle), micro-batch 2, global batch 8",
                         "ranks per node: 4, 0"]
    assert re.fullmatch(r"estimated throughput: 100\.0% of the original layout's; step \S+ s, "
                        r"peak memory \S+ GiB; why: the original layout fits \(hot spare\)",
                        lines[2])
    assert lines[3:] == ["command: " + " ".join(SCRIPT_ARGS + ["--load", "/ckpt"])]


def test_the_summarys_command_is_quoted_for_a_shell():
    """A folder with a space read "--save my ckpt": pasted into a shell, another argv."""
    args = [a if a != "/ckpt" else "/my ckpt" for a in SCRIPT_ARGS]
    result = run_plan("--gpus", "4", "--", *args)
    assert result.exit_code == 0, result.output
    command = result.stderr.splitlines()[-1].removeprefix("command: ")
    assert shlex.split(command) == json.loads(result.stdout)["command"]
    assert "'/my ckpt'" in command


@pytest.mark.parametrize("original, words", [
    ([], "unknown against the original layout (give --original-gpus)"),
    (["--original-gpus", "3"], "unknown: the original layout and batch do not run on --original-gpus 3"),
])
def test_a_throughput_with_nothing_to_compare_with_says_why(original, words):
    result = run_plan("--gpus", "3", *original, "--", *SCRIPT_ARGS)  # TP2 x PP2: 4 GPUs
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[2].startswith(f"estimated throughput: {words}; step ")


def test_a_tiny_models_step_and_memory_do_not_read_as_zero():
    """Rounded to whole microseconds and hundredths of a GiB, they read "step 0 s, peak memory
    0 GiB" (the JSON 0.0 too); a positive estimate keeps its two significant digits."""
    result = run_plan("--gpus", "4", "--", "pretrain_gpt.py", "--num-layers", "2",
                      "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "64",
                      "--max-position-embeddings", "64", "--micro-batch-size", "1",
                      "--global-batch-size", "8", "--vocab-size", "128")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert 0 < plan["estimated_step_seconds"] < 5e-7 and 0 < plan["estimated_memory_gib"] < 0.005
    assert (f"step {plan['estimated_step_seconds']:.4g} s, peak memory "
            f"{plan['estimated_memory_gib']:g} GiB;") in result.stderr.splitlines()[2]
    assert " step 0 s" not in result.stderr and " 0 GiB" not in result.stderr


def test_node_gpus_places_whole_tp_groups_and_keeps_spares():
    result = run_plan("--node-gpus", "2,1,2", "--mode", "paper", "--", *SCRIPT_ARGS)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert (plan["tensor_model_parallel_size"], plan["ranks_per_node"]) == (2, [2, 0, 2])
    assert "ranks per node: 2, 0, 2" in result.stderr.splitlines()


def test_the_issues_llama3_70b_one_node_lost_with_a_1_percent_tolerance():
    result = run_plan("--gpus", "16376", "--gpus-per-node", "8", "--global-batch-tolerance", "1",
                      "--", *LLAMA3_70B_TP8_PP8)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["num_gpus_used"] >= 0.99 * 16376
    assert abs(plan["global_batch_size"] - 2048) <= 0.01 * 2048
    assert megatron_problems(plan["command"][1:], plan["num_gpus_used"], plan["ranks_per_node"]) == []
    assert "--train-samples" in plan["command"] and "--train-iters" not in plan["command"]


def test_the_issues_llama3_70b_exact_rule_warns_in_one_line():
    result = run_plan("--gpus", "16376", "--gpus-per-node", "8", "--", *LLAMA3_70B_TP8_PP8)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["global_batch_size"] == 2048 and 2048 % plan["data_parallel_size"] == 0
    assert plan["num_gpus_used"] == 10240
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1
    assert re.fullmatch(r"warning: the exact global batch 2048 leaves 6136 of 16376 GPUs \(37\.5%\) "
                        r"idle; --global-batch-tolerance \S+ would use \d+ with global batch \d+",
                        warnings[0])


@pytest.mark.parametrize("args, exit_code, message", [
    (["--gpus", "3", *SCRIPT_ARGS], 2, "put -- before the training script"),
    (["--gpus", "3", "--"], 2, "give the training script after --"),
    (["--gpus", "3", "--bogus", "--", *SCRIPT_ARGS], 2, "unexpected '--bogus' before --"),
    (["--gpus", "0", "--", *SCRIPT_ARGS], 2, "Invalid value for '--gpus'"),
    (["--gpus", "three", "--", *SCRIPT_ARGS], 2, "Invalid value for '--gpus'"),
    (["--", *SCRIPT_ARGS], 2, "give --gpus N (with --gpus-per-node M across nodes) or --node-gpus"),
    (["--gpus", "3", "--node-gpus", "4", "--", *SCRIPT_ARGS], 2,
     "give either --node-gpus or --gpus [--gpus-per-node], not both"),
    (["--node-gpus", "8,x", "--", *SCRIPT_ARGS], 2,
     "--node-gpus takes GPU counts separated by commas, got '8,x'"),
    (["--node-gpus", "8,-1", "--", *SCRIPT_ARGS], 2, "--node-gpus counts must be 0 or more"),
    # one node of 10^11 GPUs was planned, where launch and monitor take at most 1024
    (["--gpus", "99999999999", "--", *SCRIPT_ARGS], 2,
     "--gpus 99999999999 on one node is more than 1024 GPUs: give --gpus-per-node"),
    (["--gpus", "2048", "--gpus-per-node", "2048", "--", *SCRIPT_ARGS], 2,
     "Invalid value for '--gpus-per-node': 2048 is not in the range 1<=x<=1024"),
    (["--node-gpus", "8,99999999999", "--", *SCRIPT_ARGS], 2,
     "--node-gpus counts must be 0 or more and at most 1024 (a node's GPUs), got '8,99999999999'"),
    (["--node-gpus", ",".join(["1"] * 1_000_001), "--", *SCRIPT_ARGS], 2,
     "--node-gpus lists more than 10^6 nodes"),
    (["--gpus", "3", "--global-batch-tolerance", "51", "--", *SCRIPT_ARGS], 2,
     "Invalid value for '--global-batch-tolerance'"),
    (["--gpus", "3", "--measured-step-s", "1", "--", *SCRIPT_ARGS], 2,
     "--measured-step-s 1 needs --original-gpus N, the GPU count that step was measured on"),
    # TP 2 x PP 2 does not divide 6 GPUs: the message names the layout and both flags
    (["--gpus", "6", "--original-gpus", "6", "--measured-step-s", "1", "--", *SCRIPT_ARGS], 2,
     "--measured-step-s 1 is a step of the command's TP 2 x PP 2 with micro-batch 2 and global "
     "batch 8, which Megatron would not run on --original-gpus 6: give the GPU count that step "
     "was measured on"),
    (["--gpus", "3", "--", *[arg for arg in SCRIPT_ARGS if arg not in ("--global-batch-size", "8")]],
     2, "--global-batch-size is absent, so it is --micro-batch-size 2 x the data-parallel size "
        "of the original launch: give --original-gpus N or add --global-batch-size"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--num-layers=x"], 2,
     "--num-layers must be an integer, got 'x'"),
    # a value quoted whole made a 400-character line
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--num-layers", "1" * 400], 2,
     "--num-layers must be at most 10^12, got " + "1" * 18 + "..." + "1" * 19 + "\n"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--num-layers", "x" * 400], 2,
     "--num-layers must be an integer, got '" + "x" * 12 + "..." + "x" * 13 + "'\n"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--lr", "x" * 400], 2,
     "--lr must be a number, got '" + "x" * 12 + "..." + "x" * 13 + "'\n"),
    # the planner's trial division of a 10^23 batch never ended
    pytest.param(["--gpus", "1000000001", "--gpus-per-node", "1000", "--", *SCRIPT_ARGS], 2,
                 "--gpus 1000000001 with --gpus-per-node 1000 is more than 10^6 nodes",
                 marks=pytest.mark.timeout(30)),  # a node list of 10^9 ran out of memory
    pytest.param(["--gpus", "3", "--", *SCRIPT_ARGS, "--global-batch-size", "1" + "0" * 23], 2,
                 "--global-batch-size must be at most 10^12, got 1" + "0" * 23,
                 marks=pytest.mark.timeout(30)),
    pytest.param(["--gpus", "3", "--", *SCRIPT_ARGS[:13], *SCRIPT_ARGS[15:],
                  "--step-batch-size-schedule", "0:1e23"], 2,
                 "--step-batch-size-schedule batch sizes must be at most 10^12",
                 marks=pytest.mark.timeout(30)),
    (["--gpus", "3", "--", *SCRIPT_ARGS[:1], *SCRIPT_ARGS[3:]], 2,
     "the training arguments need --num-layers N"),
    (["--gpus", "3", "--gpu-memory-gb", "0.001", "--", *SCRIPT_ARGS], 1,
     "no layout fits 3 GPUs in 0.001 GiB per GPU"),
    # Megatron-LM refuses these (validate_args, OptimizerParamScheduler) once launched: a plan
    # for them is a relaunch that cannot start
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--max-position-embeddings", "1"], 2,
     "--max-position-embeddings (1) is smaller than --seq-length (32)"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--lr", "nan"], 2, "need --lr (nan) >= --min-lr (0.0) >= 0"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--lr", "1e-3", "--min-lr", "-1"], 2,
     "need --lr (0.001) >= --min-lr (-1.0) >= 0"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--train-iters", "-5"], 2,
     "the learning rate's decay needs at least one step: --train-iters is -5"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--train-samples", "80", "--lr-warmup-samples", "80"], 2,
     "the warm-up --lr-warmup-samples (80) must be shorter than the decay --train-samples (80)"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--save-interval", "0"], 2,
     "--save-interval must be a positive integer, got 0"),
    # the first iteration's log divided by it (0), or asserted a positive one (-1)
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--log-interval", "0"], 2,
     "--log-interval must be a positive integer, got 0"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--log-interval=-1"], 2,
     "--log-interval must be a positive integer, got -1"),
    # the warm-up, this fraction of the decay, must be shorter than it
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--train-iters", "10", "--lr-warmup-fraction", "1"], 2,
     "--lr-warmup-fraction must be below 1 (a warm-up shorter than the decay), got 1.0"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--train-samples", "80", "--lr-warmup-fraction", "nan"],
     2, "--lr-warmup-fraction must be below 1 (a warm-up shorter than the decay), got nan"),
    # the scheduler's constant weight decay
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--weight-decay", "-0.1"], 2,
     "--weight-decay must be >= 0, got -0.1"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--weight-decay", "nan", "--weight-decay-incr-style",
      "constant"], 2, "--weight-decay must be >= 0, got nan"),
    # torch's Dropout, as the model is built
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--hidden-dropout", "1.5"], 2,
     "--hidden-dropout must be a probability between 0 and 1, got 1.5"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--attention-dropout=nan"], 2,
     "--attention-dropout must be a probability between 0 and 1, got nan"),
    # sizing the validation data as the datasets are built, evaluations or not
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--eval-iters", "0", "--eval-interval", "0"], 2,
     "--eval-interval must not be 0: Megatron-LM divides by it to size the validation data"),
    # validate_args: one unit for the whole schedule, and one way to give the warm-up
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--train-iters", "10", "--lr-warmup-samples", "5"], 2,
     "with --train-iters give the learning rate's schedule in iters too, not "
     "--lr-warmup-samples"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--train-iters", "10", "--train-samples", "80"], 2,
     "with --train-iters give the learning rate's schedule in iters too, not --train-samples"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--train-samples", "80", "--lr-decay-iters", "2",
      "--lr-warmup-iters", "1"], 2, "with --train-samples give the learning rate's schedule in "
                                    "samples too, not --lr-decay-iters and --lr-warmup-iters"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--train-iters", "10", "--lr-warmup-fraction", "0.1",
      "--lr-warmup-iters", "2"], 2, "give either --lr-warmup-fraction or --lr-warmup-iters, "
                                    "not both"),
    # validate_args asserts min_lr <= lr with --skip-train too; RL builds its optimizer, so the
    # scheduler, unless --no-load-optim, and runs the training loop
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--lr", "1e-3", "--min-lr", "1", "--skip-train"], 2,
     "need --lr (0.001) >= --min-lr (1.0)"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--train-iters", "-5", "--skip-train",
      "--perform-rl-step"], 2, "the learning rate's decay needs at least one step"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--log-interval", "0", "--skip-train",
      "--perform-rl-step", "--no-load-optim"], 2,
     "--log-interval must be a positive integer, got 0"),
])
def test_bad_input_is_one_line(args, exit_code, message):
    result = run_plan(*args)
    assert result.exit_code == exit_code
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("Error: ") and message in result.stderr


@pytest.mark.parametrize("schedule", [
    # Megatron-LM takes each: a negative warm-up is none, and a negative length with a decay
    # of its own trains nothing
    ["--train-iters", "10", "--lr-warmup-iters", "-1"],
    ["--train-iters", "10", "--lr-warmup-fraction", "-0.5"],
    ["--train-iters", "10", "--lr-warmup-fraction", "0.99"],
    # a weight decay that changes takes its values from --start/--end-weight-decay
    ["--train-iters", "10", "--weight-decay", "-0.1", "--weight-decay-incr-style", "linear",
     "--start-weight-decay", "0", "--end-weight-decay", "0.1"],
    ["--train-iters", "10", "--hidden-dropout", "1", "--attention-dropout", "0"],
    # no clipping (it clips only above 0), and Transformer Engine's FusedAdam checks nothing
    ["--train-iters", "10", "--clip-grad", "nan"],
    ["--train-iters", "10", "--clip-grad", "-1"],
    ["--train-iters", "10", "--adam-beta1", "1.5", "--adam-beta2", "1", "--adam-eps", "0"],
    ["--train-iters", "10", "--weight-decay", "inf"],
    # validate_args checks the schedule's unit only for training
    ["--train-iters", "10", "--lr-warmup-samples", "5", "--skip-train"],
    ["--train-iters", "10", "--lr-warmup-samples", "0", "--lr-warmup-fraction", "0.1"],
    # neither sizes the validation data by the interval
    ["--train-iters", "10", "--eval-interval", "0", "--full-validation"],
    ["--train-iters", "10", "--eval-interval", "0", "--skip-train"],
    # --skip-train builds no optimizer, so no scheduler, and runs no training loop
    ["--train-iters", "-5", "--skip-train"],
    ["--train-samples", "80", "--lr-warmup-samples", "80", "--skip-train"],
    ["--train-iters", "10", "--lr-warmup-fraction", "1", "--skip-train"],
    ["--train-iters", "10", "--weight-decay", "-0.1", "--skip-train"],
    ["--train-iters", "10", "--lr", "1e-3", "--min-lr", "-1", "--skip-train"],
    ["--train-iters", "10", "--log-interval", "0", "--skip-train"],
    ["--train-iters", "-5", "--skip-train", "--perform-rl-step", "--no-load-optim"],
    ["--train-iters", "-5", "--lr-decay-iters", "10"],
    ["--train-iters", "10", "--lr", "1e-3", "--min-lr", "1e-3", "--max-position-embeddings", "32"],
])
def test_what_megatron_accepts_is_planned(schedule):
    assert run_plan("--gpus", "3", "--json", "--", *SCRIPT_ARGS, *schedule).exit_code == 0


def test_a_save_interval_without_save_is_left_to_the_script():
    unsaved = [arg for arg in SCRIPT_ARGS if arg not in ("--save", "/ckpt")]
    assert run_plan("--gpus", "3", "--json", "--", *unsaved, "--save-interval", "0").exit_code == 0


def test_real_command_bad_input_one_line_on_stderr():
    ftmaster = Path(sys.executable).with_name("ftmaster")
    completed = subprocess.run([str(ftmaster), "plan", "--gpus", "3", *SCRIPT_ARGS],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode != 0
    assert completed.stdout == ""
    assert completed.stderr.splitlines() == [
        "Error: put -- before the training script: ... -- SCRIPT ARGS..."]
