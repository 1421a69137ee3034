"""The trainer's process set-up: which GPU a process takes, and the collective timeout on every
group it makes (review points 7 and 11)."""

import subprocess
import sys

import pytest

from helpers.trainer import SMALL_GPT, trainer_env


@pytest.mark.parametrize("env, expected", [
    ({"LOCAL_RANK": "3", "SLURM_LOCALID": "1"}, 3),  # torchrun's wins
    ({"SLURM_LOCALID": "1"}, 1),  # srun started each process itself
    ({"LOCAL_RANK": "", "SLURM_LOCALID": "x"}, 0),
    ({}, 0),
])
def test_a_process_takes_the_gpu_its_launcher_gave_it(monkeypatch, env, expected):
    from megatron.training.training import local_rank

    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert local_rank() == expected


CHECK_TIMEOUTS = """
import sys, torch
from megatron.core import parallel_state
from megatron.training.arguments import parse_args
from megatron.training.training import initialize

args = parse_args(sys.argv[1:])
initialize(args)
groups = {"world": torch.distributed.group.WORLD,
          "tensor": parallel_state.get_tensor_model_parallel_group(),
          "pipeline": parallel_state.get_pipeline_model_parallel_group(),
          "data": parallel_state.get_data_parallel_group()}
for name, group in groups.items():
    print(name, group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
"""


def test_the_distributed_timeout_reaches_every_group():
    """megatron-core's own default for the model-parallel groups is 30 minutes."""
    result = subprocess.run([sys.executable, "-c", CHECK_TIMEOUTS, *SMALL_GPT,
                             "--micro-batch-size", "2", "--global-batch-size", "4",
                             "--train-iters", "1", "--lr", "1e-3",
                             "--distributed-timeout-minutes", "0.25"],
                            capture_output=True, text=True, env=trainer_env(), timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    seconds = dict(line.split() for line in result.stdout.splitlines() if line)
    assert seconds == {name: "15.0" for name in ("world", "tensor", "pipeline", "data")}


@pytest.mark.parametrize("engine, saved, expected", [
    (False, {}, "local"),  # CPU, or no Transformer Engine: what the checkpoint will say
    (True, {}, "transformer_engine"),
    (True, {"transformer_impl": "transformer_engine"}, "transformer_engine"),
    (True, {"transformer_impl": "local"}, "local"),  # saved on CPU: no TE state to load
])
def test_a_resume_keeps_the_layers_its_checkpoint_has_state_for(monkeypatch, engine, saved,
                                                                 expected):
    from argparse import Namespace

    from megatron.training import training

    monkeypatch.setattr(training, "uses_transformer_engine", lambda args: engine)
    assert training.layer_implementation(Namespace(), saved) == expected


@pytest.mark.parametrize("given, default, no_load_optim, saved, expected", [
    # the default on, the checkpoint plain: a relaunch had switched it off (replica recovery
    # at one instance); the distributed optimizer refused the plain checkpoint, exit 2
    (None, True, False, {"use_distributed_optimizer": False}, False),
    (None, True, False, {"use_distributed_optimizer": True}, True),
    (None, True, False, {}, True),  # no checkpoint, or one from before the key
    (None, True, True, {"use_distributed_optimizer": False}, True),  # its state not loaded
    (True, True, False, {"use_distributed_optimizer": False}, True),  # asked for: refused later
    (None, False, False, {"use_distributed_optimizer": True}, False),  # converted on load
])
def test_a_resume_keeps_the_plain_optimizer_its_checkpoint_has_state_for(
        monkeypatch, given, default, no_load_optim, saved, expected):
    from argparse import Namespace

    from megatron.training import model, training

    monkeypatch.setattr(model, "default_distributed_optimizer", lambda args: default)
    args = Namespace(use_distributed_optimizer=given, no_load_optim=no_load_optim,
                     overlap_param_gather=None, distributed_optimizer_by_default=given is None)
    assert training.optimizer_choice(args, saved) is expected


@pytest.mark.parametrize("given, expected", [
    ([], False),  # the default follows the plain checkpoint
    (["--use-distributed-optimizer"], True),  # asked for: refused at the load
    (["--overlap-param-gather"], True),  # it gathers the distributed optimizer's shards
])
def test_parsed_arguments_left_to_the_default_follow_a_plain_checkpoint(
        tmp_path, monkeypatch, given, expected):
    """parse_args resolved the default before the trainer looked, so the rule above never
    applied: under --replica-recovery on CUDA, the relaunch back at two instances refused the
    plain checkpoint of the DP3 relaunch before it (exit 2, the run given up)."""
    from megatron.training import arguments, training

    monkeypatch.setattr(arguments, "_cuda_available", lambda: True)  # as on a CUDA node
    args = arguments.parse_args([
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--mock-data", "--vocab-size", "100", "--micro-batch-size", "1",
        "--train-iters", "4", "--lr", "1e-3", "--replica-recovery",
        "--num-distributed-optimizer-instances", "2", "--save", str(tmp_path / "save"),
        "--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir",
        str(tmp_path / "memory"),
        *given], world_size=4)
    assert args.use_distributed_optimizer
    assert training.optimizer_choice(args, {"use_distributed_optimizer": False}) is expected


@pytest.mark.parametrize("saved, given, refused", [
    ({"num_attention_heads": 4}, {"num_attention_heads": 2}, "num_attention_heads 4"),
    ({"position_embedding_type": "learned_absolute"}, {"position_embedding_type": "rope"},
     "(--position-embedding-type)"),
    ({"add_bias_linear": True}, {"add_bias_linear": False}, "(--disable-bias-linear)"),
    ({"num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 2},
     {"num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 4},
     "2 query groups where the arguments give 4"),
    ({"num_attention_heads": 8}, {"num_attention_heads": 8, "group_query_attention": True,
                                  "num_query_groups": 4}, "8 query groups"),
    ({"num_attention_heads": 4}, {"num_attention_heads": 4}, None),
    ({}, {"num_attention_heads": 2}, None),  # an older or foreign checkpoint without the key
])
def test_a_checkpoint_of_another_model_shape_is_refused(saved, given, refused):
    from argparse import Namespace

    from megatron.training.checkpointing import CheckpointMismatch, _check_model

    if refused is None:
        _check_model(saved, Namespace(**given))
        return
    with pytest.raises(CheckpointMismatch) as raised:
        _check_model(saved, Namespace(**given))
    assert refused in str(raised.value) and "\n" not in str(raised.value)


def test_the_logged_iteration_time_leaves_evaluation_and_checkpointing_out(monkeypatch):
    """Megatron-LM's interval timer stops around evaluation and checkpoint saves: counted,
    the iteration after each read many times its neighbours (282 ms against 9-15 ms)."""
    from megatron.training import training

    clock = iter([100.0, 100.2, 103.2, 103.4])
    monkeypatch.setattr(training.time, "perf_counter", lambda: next(clock))
    window = training.LogWindow(iteration=10)  # 100.0
    with window.left_out():  # an evaluation from 100.2 to 103.2
        pass
    assert window.elapsed_ms(12) == pytest.approx(200.0)  # 0.4 s of training over 2
