"""The trainer on CUDA as Megatron-LM users run it: bf16, the distributed optimizer and its
resharded checkpoint, --no-load-optim refreshing the master weights, the asynchronous save,
overlapped gradient reduce and parameter gather, an fp16 distributed state resumed on the plain
optimizer with its loss scale, and a checkpoint saved on CPU resumed on a GPU. Each test skips without the GPUs it needs."""

import pytest

from ftmaster.recovery.checkpoints import list_iterations, read_tracker
from helpers.gpu import needs_gpus
from helpers.launch import events
from helpers.trainer import (SMALL_GPT, TINY_LLAMA, assert_follows, from_iteration_3, iterations,
                             layout_args, run_trainer, train)

pytestmark = pytest.mark.gpu

BF16_LLAMA = TINY_LLAMA + ["--bf16"]
PLAIN_OPTIMIZER = [a for a in BF16_LLAMA if a != "--use-distributed-optimizer"] + [
    "--no-use-distributed-optimizer"]  # on CUDA it is on by default, as Megatron-LM users run


@needs_gpus(1)
def test_bf16_training_saves_and_resumes_on_cuda(tmp_path):
    save = tmp_path / "save"
    common = SMALL_GPT + ["--micro-batch-size", "2", "--lr", "1e-3", "--bf16"]
    first = run_trainer(1, common + ["--train-iters", "10", "--save", str(save),
                                     "--save-interval", "5", "--exit-interval", "5"])
    assert first.returncode == 0, first.stdout[-3000:]
    assert "saved periodic checkpoint at iteration 5" in first.stdout
    second = run_trainer(1, common + ["--train-iters", "10", "--load", str(save)])
    assert second.returncode == 0, second.stdout[-3000:]
    assert "loaded checkpoint from" in second.stdout
    assert min(iterations(second.stdout)) == 6


@needs_gpus(4)
@pytest.mark.parametrize("nproc", [1, 3], ids=["tp1pp1", "dp3"])
def test_distributed_optimizer_state_reshards_from_tp2pp2(tmp_path, nproc):
    save = tmp_path / "save"
    reference = train(4, BF16_LLAMA + layout_args(2, 2) + ["--sequence-parallel"], save)
    resume = from_iteration_3(save, tmp_path)
    assert_follows(train(nproc, BF16_LLAMA + layout_args(1, 1), resume, "--load", str(resume)),
                   reference)


@needs_gpus(2)
def test_distributed_optimizer_state_reshards_from_tp2_on_two_gpus(tmp_path):
    """The reshard for a GPU owner with two GPUs: TP2 to DP2."""
    save = tmp_path / "save"
    reference = train(2, BF16_LLAMA + layout_args(2, 1) + ["--sequence-parallel"], save)
    resume = from_iteration_3(save, tmp_path)
    assert_follows(train(2, BF16_LLAMA + layout_args(1, 1), resume, "--load", str(resume)),
                   reference)


@needs_gpus(2)
def test_overlapped_grad_reduce_and_param_gather_follow_the_plain_run(tmp_path):
    # Both overlaps are on by default with the distributed optimizer on CUDA: off for the plain run
    plain = train(2, BF16_LLAMA + layout_args(1, 1) + ["--no-overlap-grad-reduce",
                                                       "--no-overlap-param-gather"],
                  tmp_path / "plain")
    overlapped = train(2, BF16_LLAMA + layout_args(1, 1) + ["--overlap-grad-reduce",
                                                            "--overlap-param-gather"],
                       tmp_path / "overlapped")
    for it in plain:
        assert abs(overlapped[it]["loss"] - plain[it]["loss"]) <= 0.02 * plain[it]["loss"], it


@needs_gpus(1)
def test_no_load_optim_in_bf16_keeps_the_loaded_weights(tmp_path):
    save = tmp_path / "save"
    reference = train(1, PLAIN_OPTIMIZER + layout_args(1, 1), save)
    resume = from_iteration_3(save, tmp_path)
    resumed = train(1, PLAIN_OPTIMIZER + layout_args(1, 1), resume, "--load", str(resume),
                    "--no-load-optim")
    assert abs(resumed[4]["loss"] - reference[4]["loss"]) <= 0.05 * reference[4]["loss"]


def loss_scales(folder) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {event.step: event.value for event in accumulator.Scalars("loss-scale")}


@needs_gpus(2)
def test_an_fp16_distributed_state_resumes_on_the_plain_optimizer_with_its_loss_scale(tmp_path):
    """The scale is the inner optimizers' (megatron-core's ChainedOptimizer has none): it was
    looked for on the chain, and the resumed run began again at 2^32, skipping steps."""
    fp16 = TINY_LLAMA + ["--fp16"] + layout_args(1, 1)
    plain = [a for a in fp16 if a != "--use-distributed-optimizer"] + ["--no-use-distributed-optimizer"]
    save = tmp_path / "save"
    train(2, fp16, save, "--tensorboard-dir", str(tmp_path / "reference"))
    resume = from_iteration_3(save, tmp_path)
    train(2, plain, resume, "--load", str(resume), "--tensorboard-dir", str(tmp_path / "resumed"))
    reference, resumed = loss_scales(tmp_path / "reference"), loss_scales(tmp_path / "resumed")
    assert [resumed[it] for it in (4, 5, 6)] == [reference[it] for it in (4, 5, 6)]


@needs_gpus(1)
def test_async_save_is_complete_and_resumes(tmp_path):
    save = tmp_path / "save"
    reference = train(1, BF16_LLAMA + layout_args(1, 1), save, "--async-save")
    assert read_tracker(save) == 6
    resume = from_iteration_3(save, tmp_path)
    assert_follows(train(1, BF16_LLAMA + layout_args(1, 1), resume, "--load", str(resume),
                         "--async-save"), reference)


@needs_gpus(1)
@pytest.mark.parametrize("limit, env, reason", [
    (["--async-save-timeout", "5"], {}, "past the async save deadline of 5 s"),
    ([], {"FTMASTER_HANG_TIMEOUT": "8"}, "75% of ftmaster's --hang-timeout of 8 s")])
def test_a_stuck_persistent_writer_is_given_up_and_a_fresh_one_saves_on(tmp_path, limit, env, reason):
    """On CUDA the async writer is one persistent worker, stopped here at the save of
    iteration 3 (as on a file system that stopped answering). The save of 6 waits for it as
    megatron-core's worker makes it wait, without a heartbeat, but only until
    ``--async-save-timeout`` or, under ftmaster, most of its hang timeout: the save of 3
    fails, and a fresh worker writes 6."""
    save, run_dir = tmp_path / "save", tmp_path / "run"
    result = run_trainer(1, [*BF16_LLAMA, *layout_args(1, 1), "--save", str(save),
                             "--save-interval", "3", "--async-save", *limit],
                         FTMASTER_RUN_DIR=str(run_dir), FTMASTER_INJECT_STALL="0:3", **env)
    assert result.returncode == 0, result.stdout[-3000:]
    (failed,) = events(run_dir, "save_failed")
    assert failed["iteration"] == 3 and reason in failed["reason"]
    assert read_tracker(save) == 6 and list_iterations(save) == [6]


@needs_gpus(1)
def test_a_checkpoint_saved_on_cpu_resumes_on_a_gpu(tmp_path):
    # Explicit: the optimizer's default differs between CPU (replicated) and CUDA (distributed).
    args = [a for a in TINY_LLAMA if a != "--use-distributed-optimizer"] + layout_args(1, 1) + [
        "--no-use-distributed-optimizer"]
    save = tmp_path / "save"
    reference = run_trainer(1, [*args, "--save", str(save), "--save-interval", "3"],
                            CUDA_VISIBLE_DEVICES="")
    assert reference.returncode == 0, reference.stdout[-3000:]
    resume = from_iteration_3(save, tmp_path)
    assert_follows(train(1, args, resume, "--load", str(resume)), iterations(reference.stdout),
                   band=0.05)
