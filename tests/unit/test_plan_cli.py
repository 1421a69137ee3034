"""``ftmaster plan``: the JSON contract, the summary, and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftmaster.cli import main

SCRIPT_ARGS = ["pretrain_gpt.py", "--num-layers", "12", "--hidden-size", "64",
               "--num-attention-heads", "4", "--seq-length", "32",
               "--tensor-model-parallel-size=2", "--pipeline-model-parallel-size", "2",
               "--micro-batch-size", "2", "--global-batch-size", "8", "--save", "/ckpt"]
REWRITTEN = ["pretrain_gpt.py", "--num-layers", "12", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "32",
             "--tensor-model-parallel-size=1", "--pipeline-model-parallel-size", "3",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--save", "/ckpt",
             "--load", "/ckpt"]


def run_plan(*args):
    return CliRunner().invoke(main, ["plan", *args])


def test_json_contract():
    result = run_plan("--gpus", "3", "--json", "--", *SCRIPT_ARGS)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert json.loads(result.stdout) == {
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 3,
        "data_parallel_size": 1, "micro_batch_size": 2, "global_batch_size": 8,
        "num_gpus_used": 3, "command": REWRITTEN}


def test_without_json_flag_stdout_is_still_the_json_and_stderr_the_summary():
    result = run_plan("--gpus", "5", "--gpus-per-node", "4", "--", *SCRIPT_ARGS)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["num_gpus_used"] == 4
    assert result.stderr.splitlines() == [
        "TP 2 x PP 2 x DP 1 on 4 of 5 GPUs, micro-batch 2, global batch 8",
        "command: " + " ".join(SCRIPT_ARGS + ["--load", "/ckpt"])]


def test_paper_mode_and_original_gpus():
    args = [arg for arg in SCRIPT_ARGS if arg not in ("--global-batch-size", "8")]
    result = run_plan("--gpus", "4", "--mode", "paper", "--original-gpus", "8", "--json",
                      "--", *args)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert (plan["tensor_model_parallel_size"], plan["pipeline_model_parallel_size"],
            plan["global_batch_size"]) == (4, 1, 4)  # global batch 2 x DP 2 of the 8 GPUs
    assert plan["command"][-4:] == ["--global-batch-size", "4", "--load", "/ckpt"]


@pytest.mark.parametrize("args, exit_code, message", [
    (["--gpus", "3", *SCRIPT_ARGS], 2, "put -- before the training script"),
    (["--gpus", "3", "--"], 2, "give the training script after --"),
    (["--gpus", "3", "--bogus", "--", *SCRIPT_ARGS], 2, "unexpected '--bogus' before --"),
    (["--gpus", "0", "--", *SCRIPT_ARGS], 2, "Invalid value for '--gpus'"),
    (["--gpus", "three", "--", *SCRIPT_ARGS], 2, "Invalid value for '--gpus'"),
    (["--", *SCRIPT_ARGS], 2, "Missing option '--gpus'"),
    (["--gpus", "3", "--", *SCRIPT_ARGS, "--num-layers=x"], 2,
     "--num-layers must be an integer, got 'x'"),
    (["--gpus", "3", "--", *SCRIPT_ARGS[:1], *SCRIPT_ARGS[3:]], 2,
     "the training arguments need --num-layers N"),
    (["--gpus", "3", "--gpu-memory-gb", "0.001", "--", *SCRIPT_ARGS], 1,
     "no layout fits 3 GPUs in 0.001 GiB per GPU"),
])
def test_bad_input_is_one_line(args, exit_code, message):
    result = run_plan(*args)
    assert result.exit_code == exit_code
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("Error: ") and message in result.stderr


def test_real_command_bad_input_one_line_on_stderr():
    ftmaster = Path(sys.executable).with_name("ftmaster")
    completed = subprocess.run([str(ftmaster), "plan", "--gpus", "3", *SCRIPT_ARGS],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode != 0
    assert completed.stdout == ""
    assert completed.stderr.splitlines() == [
        "Error: put -- before the training script: ... -- SCRIPT ARGS..."]
