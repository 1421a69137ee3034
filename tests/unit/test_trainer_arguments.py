"""pretrain_gpt.py argument validation: every bad input is one line and a non-zero exit."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megatron.training.arguments import ArgumentError, _is_writable_dir, parse_args

from helpers.trainer import PRETRAIN, REPO

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "100"]


def with_args(*extra, drop=()):
    argv = list(BASE)
    for flag in drop:
        index = argv.index(flag)
        del argv[index:index + 2]
    return argv + list(extra)


@pytest.mark.parametrize("argv, world_size, message", [
    (with_args("--tensor-model-parallel-size", "3"), 3,
     "--num-attention-heads (4) is not divisible by --tensor-model-parallel-size (3)"),
    (with_args("--pipeline-model-parallel-size", "3"), 3,
     "--num-layers (4) is not divisible by --pipeline-model-parallel-size (3)"),
    (with_args("--global-batch-size", "6"), 2,
     "--global-batch-size (6) is not divisible by --micro-batch-size (2) x data-parallel size (2)"),
    (with_args("--tensor-model-parallel-size", "2"), 3,
     "world size 3 is not divisible by tensor (2) x pipeline (1) parallel size"),
    (with_args("--group-query-attention", "--num-query-groups", "3"), 1,
     "--num-attention-heads (4) is not divisible by --num-query-groups (3)"),
    (with_args("--bogus-flag", "1"), 1, "unrecognized arguments: --bogus-flag 1"),
    (with_args("--data-path", "/nonexistent/corpus", drop=()), 1,
     "give exactly one of --mock-data or --data-path PREFIX"),
    (with_args(drop=("--vocab-size",)), 1, "NullTokenizer needs --vocab-size"),
    (with_args("--lr-warmup-iters", "5", "--train-iters", "3"), 1, "--lr-warmup-iters (5)"),
    # the decay the user gave in iterations, not the samples derived from it
    (with_args("--lr-warmup-iters", "2", "--global-batch-size", "12"), 1,
     "the warm-up --lr-warmup-iters (2) must be shorter than the decay --train-iters (2)"),
    # megatron-core's scheduler asserts a decay of a step or more, once launched
    (with_args("--train-iters", "0"), 1,
     "the learning rate's decay needs at least one step: --train-iters is 0; give a positive one "
     "or --lr-decay-iters N"),
    (with_args("--train-samples", "0", drop=("--train-iters",)), 1, "or --lr-decay-samples N"),
    # the lengths as given: no --lr-decay-samples was, and no --train-samples of -48
    (with_args("--train-samples", "8", "--lr-warmup-samples", "8", drop=("--train-iters",)), 1,
     "the warm-up --lr-warmup-samples (8) must be shorter than the decay --train-samples (8)"),
    (with_args("--global-batch-size", "-12"), 1, "--global-batch-size must be a positive integer"),
    (with_args("--train-iters", "0", "--lr-decay-iters", "4", "--lr-warmup-iters", "4"), 1,
     "the warm-up --lr-warmup-iters (4) must be shorter than the decay --lr-decay-iters (4)"),
    (with_args("--bf16", "--fp16"), 1, "--bf16 and --fp16 are mutually exclusive"),
    # the world size is checked before the data-parallel size and batch derived from it
    (with_args("--tensor-model-parallel-size", "2"), 1,
     "world size 1 is not divisible by tensor (2) x pipeline (1) parallel size"),
    (with_args("--split", "abc"), 1, "--split must be up to three non-negative numbers"),
    (with_args("--split", "1,2,3,4"), 1, "--split must be up to three non-negative numbers"),
    # megatron-core reads runs of digits and dots: 1e2,1 split 1:2:1 there, 1e2,1,1 asserted
    *((with_args("--split", split), 1, "--split must be up to three non-negative numbers")
      for split in ("1e2,1", "1e2,1,1", "1_0,1", "inf,1")),
    (with_args("--split", "0,100,0"), 1, "leaves no training data"),
    (with_args("--eval-iters", "2", "--eval-interval", "-1"), 1,
     "--eval-interval must be a positive"),
    # Megatron-LM divides by it without evaluations too
    *((with_args("--eval-iters", iters, "--eval-interval", "0"), 1,
       "--eval-interval must not be 0: Megatron-LM divides by it to size the validation data")
      for iters in ("2", "0")),
    (with_args("--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"), 1,
     "mutually exclusive"),
    # Megatron-LM's recipe flags
    (with_args("--num-attention-heads", "12", "--hidden-size", "96", "--group-query-attention",
               "--num-query-groups", "3", "--tensor-model-parallel-size", "2"), 2,
     "--num-query-groups (3) must be a multiple or a divisor of --tensor-model-parallel-size (2)"),
    (with_args("--hidden-size", "66"), 1,
     "--hidden-size (66) is not divisible by --num-attention-heads (4); give --kv-channels"),
    (with_args("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
               "3"), 2, "--num-layers (4) is not divisible by --pipeline-model-parallel-size (2) x "
                        "--num-layers-per-virtual-pipeline-stage (3)"),
    (with_args("--num-layers-per-virtual-pipeline-stage", "2"), 1,
     "a virtual pipeline (interleaved schedule) needs --pipeline-model-parallel-size > 1"),
    (with_args("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
               "2", "--global-batch-size", "6"), 2,
     "the interleaved schedule needs the 3 micro-batches per step to be a multiple of "
     "--pipeline-model-parallel-size (2)"),
    (with_args("--sequence-parallel", "--seq-length", "33", "--max-position-embeddings", "64",
               "--tensor-model-parallel-size", "2"), 2, "--sequence-parallel splits the sequence"),
    (with_args("--recompute-method", "uniform"), 1,
     "--recompute-method needs --recompute-granularity full"),
    (with_args("--train-samples", "40"), 1, "give exactly one of --train-iters and --train-samples"),
    (with_args("--train-samples", "40", "--lr-warmup-iters", "2", drop=("--train-iters",)), 1,
     "with --train-samples give the learning rate's schedule in samples too, not "
     "--lr-warmup-iters"),
    (with_args("--overlap-param-gather", "--no-use-distributed-optimizer"), 1,
     "--overlap-param-gather needs the distributed optimizer"),
    (with_args("--lr-decay-samples", "8"), 1,
     "with --train-iters give the learning rate's schedule in iters too, not --lr-decay-samples"),
    (with_args("--replica-recovery"), 1,
     "--replica-recovery needs --non-persistent-ckpt-type global"),
    (with_args("--num-distributed-optimizer-instances", "2", "--no-use-distributed-optimizer"), 4,
     "--num-distributed-optimizer-instances above 1 needs the distributed optimizer"),
    (with_args("--num-distributed-optimizer-instances", "2", "--use-distributed-optimizer"), 3,
     "--num-distributed-optimizer-instances (2) must divide the data-parallel size (3)"),
    (with_args("--num-distributed-optimizer-instances", "0"), 1,
     "--num-distributed-optimizer-instances must be at least 1, not 0"),
    (with_args("--save="), 1, "--save needs a folder, got an empty value"),
    (with_args("--load", ""), 1, "--load needs a folder, got an empty value"),
    # the trainer wrote no scalars, ftmaster its own into the working directory
    (with_args("--tensorboard-dir", ""), 1, "--tensorboard-dir needs a folder, got an empty value"),
    (with_args("--save", "ckpt", "--non-persistent-ckpt-type", "global",
               "--non-persistent-global-ckpt-dir="), 1,
     "--non-persistent-global-ckpt-dir needs a folder, got an empty value"),
    *((with_args("--save", "ckpt", "--async-save", "--async-save-timeout", value), 1,
       f"--async-save-timeout must be a positive number of seconds, got {value}")
      for value in ("0", "-5", "nan", "inf")),
])
def test_invalid_combinations_are_rejected(argv, world_size, message):
    with pytest.raises(ArgumentError) as caught:
        parse_args(argv, world_size=world_size)
    assert message in str(caught.value)


@pytest.mark.parametrize("flag, value", [("--hidden-dropout", "2"), ("--attention-dropout", "-0.5"),
                                         ("--hidden-dropout", "nan")])
def test_a_dropout_that_is_no_probability_is_refused(flag, value):
    # torch's Dropout refused it only once the model was built, in a traceback
    with pytest.raises(ArgumentError, match=f"{flag} must be a probability between 0 and 1, got"):
        parse_args(with_args(flag, value), world_size=1)


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_an_init_method_std_that_is_no_deviation_is_refused(value):
    # a negative one was a traceback from torch's normal_ as the model was built
    with pytest.raises(ArgumentError, match=f"--init-method-std must be a finite standard "
                                            f"deviation >= 0, got {value}"):
        parse_args(with_args("--init-method-std", value), world_size=1)


@pytest.mark.parametrize("flag, value, wanted", [
    ("--norm-epsilon", "-1", "a finite number >= 0"), ("--norm-epsilon", "nan", "a finite number >= 0"),
    ("--rotary-base", "0", "a positive integer")])
def test_a_norm_epsilon_or_rotary_base_that_makes_the_loss_nan_is_refused(flag, value, wanted):
    # taken, the first loss was NaN and the run ended as if the training had diverged
    with pytest.raises(ArgumentError, match=f"{flag} must be {wanted}, got"):
        parse_args(with_args(flag, value, "--position-embedding-type", "rope"), world_size=1)


@pytest.mark.parametrize("flag, value, wanted", [
    ("--adam-beta1", "1.5", "in [0, 1)"), ("--adam-beta2", "-1", "in [0, 1)"),
    ("--adam-beta2", "nan", "in [0, 1)"), ("--adam-eps", "-1", "a finite number >= 0"),
    ("--weight-decay", "-1", ">= 0"), ("--weight-decay", "inf", "a finite number")])
def test_adam_settings_torch_refuses_are_refused_before_the_launch(flag, value, wanted):
    # torch's Adam raised them as the optimizer was built, in a traceback
    with pytest.raises(ArgumentError, match=re.escape(f"{flag} must be {wanted}, got")):
        parse_args(with_args(flag, value), world_size=1)


@pytest.mark.parametrize("value", ["0", "-64"])
def test_a_vocab_padding_multiple_below_one_is_refused(value):
    # 0 divided by zero as the vocabulary was padded; -64 padded it below the tokenizer's
    # size, and the embedding's lookup failed with an IndexError
    with pytest.raises(ArgumentError, match=f"--make-vocab-size-divisible-by must be a positive "
                                            f"integer, got {value}"):
        parse_args(with_args("--make-vocab-size-divisible-by", value), world_size=1)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e15", "1.4e12", "0", "0.001"])
def test_a_distributed_timeout_that_is_no_duration_is_refused(value):
    # the process group's set-up raised them (gloo: "Invalid timeout"; timedelta: nan, inf,
    # 1e15 overflowed it; 1.4e12 overflowed torch's nanoseconds: "timed out after -8e15 ms";
    # 0 "timed out after 0ms" connecting to the store)
    with pytest.raises(ArgumentError, match=f"--distributed-timeout-minutes must be a number "
                                            f"of minutes from 0.1 to 10\\^7, got"):
        parse_args(with_args("--distributed-timeout-minutes", value), world_size=1)


def test_an_infinite_emergency_gap_is_refused(tmp_path):
    # inf was taken, and ceil(inf x --save-interval) overflowed as the trainer started
    with pytest.raises(ArgumentError, match=f"--emergency-save-gap-frac must be a finite number "
                                            f">= 0, got"):
        parse_args(with_args("--emergency-save-gap-frac", "inf", "--save", str(tmp_path),
                             "--save-interval", "2"), world_size=1)


@pytest.mark.parametrize("seed, pp, top", [("-1", 1, 2**32 - 1), (str(2**32 - 100), 2, 2**32 - 101),
                                           ("0", 1, 2**32 - 1)])
def test_a_seed_numpy_or_megatron_refuses_is_refused(seed, pp, top):
    # numpy.random.seed raised it once the process group was up, on the rank it did not fit;
    # Megatron-LM refuses 0 (its _set_random_seed), which trained here
    with pytest.raises(ArgumentError, match=f"--seed must be between 1 and {top}, got {seed}"):
        parse_args(with_args("--seed", seed, "--pipeline-model-parallel-size", str(pp)),
                   world_size=pp)


@pytest.mark.parametrize("extra, world_size, message", [
    (["--recompute-granularity", "full"], 1,
     "--recompute-granularity full needs --recompute-method uniform or block"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
      "3"], 1, "groups of --recompute-num-layers (3) layers, which must divide the 4 layers"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
      "4", "--pipeline-model-parallel-size", "2"], 2,
     "must divide the 2 layers of each pipeline chunk"),
])
def test_a_full_recompute_megatron_core_cannot_run_is_refused(extra, world_size, message):
    # megatron-core raised these once the model was built: a ValueError, or an IndexError
    # from the uniform method's last group reaching past the chunk's layers
    with pytest.raises(ArgumentError, match=re.escape(message)):
        parse_args(with_args(*extra), world_size=world_size)


@pytest.mark.parametrize("extra, refused", [
    (["--lr-decay-iters", "-5"], "--lr-decay-iters must be >= 0, got -5"),
    (["--lr-warmup-iters", "-2"], "--lr-warmup-iters must be >= 0, got -2"),
    (["--exit-interval", "-1"], "--exit-interval must be >= 0, got -1"),
    (["--train-samples", "8", "--lr-warmup-samples", "-4"], "--lr-warmup-samples must be >= 0"),
])
def test_a_negative_schedule_length_is_refused(extra, refused):
    # a negative decay was blamed on "--train-iters 0"; the others were taken
    argv = with_args(*extra, drop=("--train-iters",) if "--train-samples" in extra else ())
    with pytest.raises(ArgumentError, match=refused):
        parse_args(argv, world_size=1)


@pytest.mark.parametrize("lr, refused", [
    ("nan", "need --lr (nan) >= --min-lr (0.0) >= 0"),
    # Megatron-LM takes it, and its first update makes every weight non-finite: a NaN loss at
    # iteration 2, relaunched once by ftmaster before it gave up
    ("inf", "--lr must be a finite number, got inf"),
])
def test_a_learning_rate_that_cannot_train_is_refused(lr, refused):
    with pytest.raises(ArgumentError, match=re.escape(refused)):
        parse_args(with_args("--lr", lr), world_size=1)


def test_missing_data_path_names_the_file(tmp_path):
    argv = [a for a in BASE if a != "--mock-data"] + ["--data-path", str(tmp_path / "corpus"),
                                                      "--tokenizer-type", "ByteLevelTokenizer"]
    with pytest.raises(ArgumentError, match=r"corpus\.bin does not exist"):
        parse_args(argv, world_size=1)


def test_real_data_names_its_tokenizer(tmp_path):
    argv = [a for a in BASE if a != "--mock-data"] + ["--data-path", str(tmp_path / "corpus")]
    with pytest.raises(ArgumentError, match="--data-path needs --tokenizer-type"):
        parse_args(argv, world_size=1)


@pytest.mark.parametrize("data_path, message", [
    (["1.0", "a", "2.0"], "needs WEIGHT PREFIX pairs, got 3 values"),
    (["1.0", "a", "b", "c"], "'b' is not a weight"),
    (["1.0", "a", "-2", "c"], "--data-path weight -2 is negative"),
    # these reached megatron-core's blend: "cannot read the training data ...: AssertionError: "
    # (exit 79, as if the corpus were corrupt), or "weight nan is negative"
    (["0", "a", "1", "c"], "--data-path weight 0 is 0: leave its prefix out instead"),
    (["0", "a"], "--data-path weight 0 is 0"),
    (["inf", "a", "1", "c"], "--data-path weight inf is not a finite number"),
    (["1", "a", "nan", "c"], "--data-path weight nan is not a finite number"),
])
def test_weighted_data_path_must_pair_weights_and_prefixes(data_path, message):
    argv = [a for a in BASE if a != "--mock-data"] + ["--tokenizer-type", "ByteLevelTokenizer",
                                                      "--data-path", *data_path]
    with pytest.raises(ArgumentError, match=message):
        parse_args(argv, world_size=1)


def test_a_data_cache_path_that_is_no_folder_is_refused(tmp_path):
    # megatron-core's dataset builder failed on it with a bare Exception, mock data or real
    (tmp_path / "file").write_text("")
    for path in (tmp_path / "file", tmp_path / "file" / "cache"):
        with pytest.raises(ArgumentError, match=f"--data-cache-path {path} is not a folder you "
                                                f"can write to"):
            parse_args(with_args("--data-cache-path", str(path)), world_size=1)
    cache = tmp_path / "new" / "cache"
    assert parse_args(with_args("--data-cache-path", str(cache)), world_size=1).data_cache_path


def test_split_takes_slashes_and_fewer_parts():
    assert parse_args(with_args("--split", "90/10", "--eval-iters", "1"), world_size=1).split == "90/10"


def test_unwritable_save_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ArgumentError, match="is not writable"):
        parse_args(with_args("--save", str(blocker / "ckpt")), world_size=1)


@pytest.mark.parametrize("refused", [
    ["--non-persistent-ckpt-type", "local"],
    ["--keep-emergency", "-1"],
    ["--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir", "{tmp}/memory",
     "--emergency-save-gap-frac", "inf"],
    ["--data-cache-path", "{tmp}/cache", "--non-persistent-ckpt-type", "local"],
])
def test_a_refused_command_makes_no_folder(tmp_path, refused):
    """The writability checks made the folders they checked: a launch refused by a later
    check left a stray --save (a mistyped path stayed behind as a folder)."""
    argv = with_args("--save", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb"),
                     *(arg.format(tmp=tmp_path) for arg in refused))
    with pytest.raises(ArgumentError):
        parse_args(argv, world_size=1)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_to_be_made_is_checked_at_its_nearest_existing_parent(tmp_path):
    (tmp_path / "file").write_text("")
    (tmp_path / "locked").mkdir(mode=0o500)
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")  # mkdir would fail on it
    for parent, writable in ((tmp_path, True), (tmp_path / "file", False),
                             (tmp_path / "locked", os.geteuid() == 0),
                             (tmp_path / "dangling", False)):
        assert _is_writable_dir(parent / "a" / "b") == writable
    assert not _is_writable_dir(tmp_path / "dangling")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dangling", "file", "locked"]


def test_a_tensorboard_dir_that_is_a_file_is_refused(tmp_path):
    # SummaryWriter's makedirs raised FileExistsError on the last rank, a traceback
    (tmp_path / "board").write_text("a file")
    with pytest.raises(ArgumentError, match="--tensorboard-dir .*board is not writable"):
        parse_args(with_args("--tensorboard-dir", str(tmp_path / "board")), world_size=1)


def test_a_load_folder_that_cannot_hold_checkpoints_is_refused(tmp_path):
    (tmp_path / "weights.pt").write_text("a file, not a checkpoint folder")
    with pytest.raises(ArgumentError, match="--load .*weights.pt is a file: give the checkpoint folder"):
        parse_args(with_args("--load", str(tmp_path / "weights.pt")), world_size=1)
    with pytest.raises(ArgumentError, match="--load .*typo does not exist"):
        parse_args(with_args("--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "typo")),
                   world_size=1)
    # Megatron-LM's first run: --save X --load X where X does not exist yet
    first = tmp_path / "new"
    assert parse_args(with_args("--save", str(first), "--load", str(first)), world_size=1).load == str(first)
    assert parse_args(with_args("--load", str(tmp_path)), world_size=1).load == str(tmp_path)


def test_defaults_follow_megatron():
    args = parse_args(with_args(), world_size=4)
    assert args.data_parallel_size == 4
    assert args.global_batch_size == 8
    assert args.ffn_hidden_size == 256
    assert args.num_query_groups == 4
    assert args.max_position_embeddings == 32


@pytest.mark.parametrize("extra, message", [
    (["--unknown-thing"], "unrecognized arguments: --unknown-thing"),
    (["--tensor-model-parallel-size", "3"], "world size 1 is not divisible by tensor (3)"),
])
def test_script_prints_one_line_and_exits_nonzero(extra, message):
    result = subprocess.run([sys.executable, PRETRAIN, *BASE, *extra], capture_output=True,
                            text=True, cwd=REPO, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only rule")
def test_fp16_needs_cuda_and_bf16_runs_on_cpu():
    with pytest.raises(ArgumentError, match="--fp16 needs CUDA"):
        parse_args(with_args("--fp16"), world_size=1)
    assert parse_args(with_args("--bf16"), world_size=1).bf16


REPLICAS = ["--save", "SAVE", "--non-persistent-ckpt-type", "global", "--replica-recovery"]


@pytest.mark.parametrize("extra, distributed, param_gather, unavailable", [
    ((), True, True, False),  # CUDA's defaults
    (REPLICAS, False, False, False),  # one instance would have no replica: off
    ((*REPLICAS, "--num-distributed-optimizer-instances", "2"), True, False, False),
    ((*REPLICAS, "--num-distributed-optimizer-instances", "2", "--overlap-param-gather"),
     True, True, False),
    ((*REPLICAS, "--use-distributed-optimizer"), True, False, True),
])
def test_replica_recovery_keeps_the_distributed_optimizer_only_with_replicas_of_its_state(
        monkeypatch, tmp_path, extra, distributed, param_gather, unavailable):
    from ftmaster.recovery.replicas import unavailable_reason
    from megatron.training import arguments, model
    monkeypatch.setattr(arguments, "_cuda_available", lambda: True)
    monkeypatch.setattr(model.torch.cuda, "is_available", lambda: True)
    extra = [str(tmp_path / "save") if arg == "SAVE" else arg for arg in extra]
    args = parse_args(with_args(*extra), world_size=4)
    assert model.uses_distributed_optimizer(args) is distributed
    assert model._overlap_param_gather(args) is param_gather
    args.use_distributed_optimizer = model.uses_distributed_optimizer(args)
    reason = unavailable_reason(args.replica_recovery, args.use_distributed_optimizer,
                                args.num_distributed_optimizer_instances)
    assert (reason is not None) is unavailable
    if unavailable:
        assert "--num-distributed-optimizer-instances 2 or more" in reason and "\n" not in reason


def test_tensorboard_flags_take_megatron_names_and_need_the_package(monkeypatch, tmp_path):
    args = parse_args(with_args("--tensorboard-dir", str(tmp_path), "--tensorboard-log-interval",
                                "5", "--tensorboard-queue-size", "10"), world_size=1)
    assert (args.tensorboard_dir, args.tensorboard_log_interval, args.tensorboard_queue_size) == (
        str(tmp_path), 5, 10)
    with pytest.raises(ArgumentError, match="--tensorboard-log-interval must be a positive"):
        parse_args(with_args("--tensorboard-log-interval", "0"), world_size=1)
    monkeypatch.setattr("megatron.training.arguments.tensorboard_installed", lambda: False)
    with pytest.raises(ArgumentError, match="--tensorboard-dir needs the tensorboard package"):
        parse_args(with_args("--tensorboard-dir", str(tmp_path)), world_size=1)
    assert parse_args(with_args(), world_size=1).tensorboard_dir is None  # no package needed


def refusal_as_another_user(argv) -> str:
    """What parse_args refuses, in a child that is not root (root reads any folder); "" when
    it accepts."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.close(read)
        said = ""
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            parse_args(argv, world_size=1)
        except ArgumentError as problem:
            said = str(problem)
        except BaseException as error:
            said = f"raised {type(error).__name__}: {error}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        said = pipe.read()
    os.waitpid(pid, 0)
    return said


def test_a_load_folder_this_user_cannot_list_is_refused_in_one_line():
    """Another user's checkpoint folder (or one without read permission): the checkpoint
    search would list it and raise PermissionError on rank 0, a traceback."""
    with tempfile.TemporaryDirectory() as base:
        os.chmod(base, 0o777)  # the child may make its --save there
        theirs = Path(base) / "theirs"
        theirs.mkdir()
        (theirs / "latest_checkpointed_iteration.txt").write_text("10\n")
        theirs.chmod(0o300)  # neither its owner nor others may list it
        said = refusal_as_another_user(with_args("--load", str(theirs), "--save", f"{base}/mine"))
        theirs.chmod(0o700)
    assert said.startswith(f"--load {theirs} cannot be read"), said


@pytest.mark.parametrize("extra, world_size", [
    (("--num-layers-per-virtual-pipeline-stage", "4"), 1),  # PP 1, every layer in one chunk
    (("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
      "--global-batch-size", "6"), 2),  # 3 micro-batches: the plain schedule takes them
    (("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "1"), 2),
])
def test_one_virtual_stage_per_rank_is_the_plain_schedule(extra, world_size):
    """Megatron-LM's validate_args makes a VPP of 1 None: kept, it selected the interleaved
    schedule with one chunk, which refused PP 1 and micro-batch counts the plain one runs, and
    `ftmaster plan` writes such flags when a relaunch drops the pipeline."""
    args = parse_args(with_args(*extra), world_size=world_size)
    assert args.virtual_pipeline_model_parallel_size is None


def test_a_path_that_cannot_be_looked_at_is_an_argument_error(tmp_path):
    """A name too long raised OSError, a symlink loop RuntimeError (Path.resolve): tracebacks
    in every rank, and out of launch's check."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ArgumentError, match="File name too long"):
        parse_args(with_args("--load", str(tmp_path / ("s" * 300))), world_size=1)
    with pytest.raises(ArgumentError, match="does not exist"):
        parse_args(with_args("--save", str(tmp_path / "ck"), "--load", str(loop)), world_size=1)


def test_group_query_attention_without_a_group_count_is_multi_query_as_in_megatron_lm():
    """It was refused, naming a flag the user never gave, where Megatron-LM trains one group."""
    args = parse_args(with_args("--group-query-attention"), world_size=1)
    assert args.num_query_groups == 1


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_rotary_percent_below_zero_is_refused(value):
    """Below 0 it failed as megatron-core built the model (a traceback, taken for a crash)."""
    with pytest.raises(ArgumentError, match=f"--rotary-percent must be a number >= 0, got {value}"):
        parse_args(with_args("--position-embedding-type", "rope", "--rotary-percent", value),
                   world_size=1)


def test_a_save_folder_whose_name_is_too_long_is_refused_before_training(tmp_path):
    """It passed the check, and every rank failed at the first save's mkdir."""
    with pytest.raises(ArgumentError, match="--save"):
        parse_args(with_args("--save", str(tmp_path / ("s" * 300) / "ckpt")), world_size=1)


@pytest.mark.parametrize("split, evaluations", [("100,0,0", 0), ("100", 0), ("98,2,0", 2)])
def test_a_split_without_a_validation_part_runs_without_evaluation(split, evaluations):
    """Megatron-LM's do_valid: a pretraining command with --split 100,0,0 and the default
    --eval-iters was refused here, where it trains there without evaluating."""
    args = parse_args(with_args("--split", split, "--eval-iters", "2", "--eval-interval", "4"),
                      world_size=1)
    assert args.eval_iters == evaluations


@pytest.mark.parametrize("swiglu", [[], ["--swiglu"]])
def test_without_linear_biases_a_gelu_model_builds_on_cuda(monkeypatch, swiglu):
    """On CUDA the fused bias-GeLU stayed on with --disable-bias-linear, which megatron-core's
    TransformerConfig refuses ("add_bias_linear must also be True"): a traceback on every rank
    at the model's build. Megatron-LM's validate_args turns the fusion off."""
    import torch

    from megatron.training.model import transformer_config

    args = parse_args(with_args("--disable-bias-linear", *swiglu), world_size=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = transformer_config(args)
    assert not config.add_bias_linear
    assert config.bias_activation_fusion == bool(swiglu)
