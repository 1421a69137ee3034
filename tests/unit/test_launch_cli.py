"""Bad input to ftmaster launch: one line on stderr, a non-zero exit, nothing launched."""

import errno
import os

from click.testing import CliRunner

import pytest

from ftmaster.cli import main
from helpers.trainer import PRETRAIN

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "12",
         "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--vocab-size", "100",
         "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def launch(run_dir, *args, env=None):
    """In-process, so the whole table costs one import of the CLI."""
    result = CliRunner().invoke(main, ["launch", "--run-dir", str(run_dir), *args], env=env)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    return result


@pytest.mark.parametrize("args,message", [
    (["--nproc-per-node", "4", "--monitor-backend", "sim", PRETRAIN, *MODEL],
     "put -- before the training script"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--"], "give the training script after --"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--", "no_such_script.py", *MODEL],
     "training script 'no_such_script.py' not found"),
    (["--nproc-per-node", "6", "--monitor-backend", "sim", "--", PRETRAIN, *MODEL],
     "invalid layout: TP 2 x PP 2 with micro-batch 2 and global batch 12 does not fit 6 GPUs"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--", PRETRAIN, *MODEL[:-4]],
     "invalid layout"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--", PRETRAIN, "--hidden-size", "64"],
     "invalid layout: the training arguments need --num-attention-heads N"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--", PRETRAIN, *MODEL[:-1], "3"],
     "invalid layout: TP 2 x PP 3 with micro-batch 2 and global batch 12 does not fit 4 GPUs"),
    # the node runs all 4 ranks: TP 4 fits it, not the nodes of 2 the planner was told of
    (["--nproc-per-node", "4", "--gpus-per-node", "2", "--monitor-backend", "sim", "--", PRETRAIN,
      *MODEL[:-4], "--tensor-model-parallel-size", "4"],
     "--gpus-per-node 2 splits this node's 4 GPUs (--nproc-per-node 4) into nodes of 2, where "
     "TP 4 x PP 1 does not fit"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--gpu-memory-gb", "0.001", "--",
      PRETRAIN, *MODEL], "invalid layout: no layout fits 4 GPUs in 0.001 GiB per GPU"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--inject", "explode:gpu=1,at=iter:3",
      "--", PRETRAIN, *MODEL], "unknown kind 'explode'"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--inject", "fail:gpu=7,at=iter:3",
      "--", PRETRAIN, *MODEL], "GPU 7 is not one of the job's GPUs 0,1,2,3"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--inject", "fail:gpu=1,at=iter:11",
      "--", PRETRAIN, *MODEL],
     "--inject fail:gpu=1,at=iter:11: training ends at iteration 10 (--train-iters), so it "
     "would never fire"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--cold-restart", "--inject",
      "fail:gpu=1,at=iter:3,after=warm_ready", "--", PRETRAIN, *MODEL],
     "no warm worker starts under --cold-restart, so it would never fire"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--inject",
      "fail:gpu=1,at=iter:3,after=persisted", "--", PRETRAIN, *MODEL],
     "nothing is persisted without the memory tier"),
    # the trainer saves only with --save: the rehearsal waited for a save that never came
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--inject",
      "fail:gpu=1,at=iter:3,after=emergency_save", "--", PRETRAIN, *MODEL],
     "training saves nothing without --save, so it would never fire"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--inject",
      "fail:gpu=1,at=iter:3,after=periodic_save", "--", PRETRAIN, *MODEL],
     "training saves nothing without --save, so it would never fire"),
    # one entry per GPU: a traceback (10^20), or seconds and gigabytes before anything else
    (["--nproc-per-node", "99999999999999999999", "--monitor-backend", "sim", "--", PRETRAIN,
      *MODEL], "'--nproc-per-node': 99999999999999999999 is not in the range 1<=x<=1024"),
    # an unset variable: the run's files went into the working directory (here the layout
    # that does not fit stops it before any is written)
    (["--run-dir", "", "--nproc-per-node", "6", "--monitor-backend", "sim", "--", PRETRAIN,
      *MODEL], "'--run-dir': needs a folder, got an empty value"),
    # unquoted and unset (--run-dir $RUN --): click took -- as the folder, and with a second --
    # among the script's arguments the check for the separator passed
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--run-dir", "--", PRETRAIN, *MODEL],
     "--run-dir needs a value before --"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--rdzv-id", "--", PRETRAIN, *MODEL,
      "--", "x"], "--rdzv-id needs a value before --"),
    # paths that cannot be looked at (here a name too long; for a user, also one under a
    # folder without search permission) were tracebacks
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--", "x" * 300 + ".py", *MODEL],
     f"training script '{'x' * 300}.py': File name too long"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--run-dir", "/tmp/" + "r" * 300, "--",
      PRETRAIN, *MODEL], f"/tmp/{'r' * 300} is not usable (File name too long); give another "
                         "--run-dir"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--", PRETRAIN, *MODEL, "--load",
      "/tmp/" + "s" * 300], f"training arguments: /tmp/{'s' * 300}: File name too long"),
    # a recover fires only while --policy wait waits for a GPU a fail lost: accepted, it
    # rehearsed nothing and said only 'never fired' at the end
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--inject", "fail:gpu=1,at=iter:3",
      "--inject", "recover:gpu=1,at=iter:5", "--", PRETRAIN, *MODEL],
     "--inject recover:gpu=1,at=iter:5: a lost GPU is retired at once under --policy available "
     "(recover needs --policy wait), so it would never fire"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--policy", "wait", "--inject",
      "xid:gpu=1,code=79,at=iter:3", "--inject", "recover:gpu=1,at=iter:5", "--", PRETRAIN, *MODEL],
     "no fail:gpu=1 loses GPU 1 first, so it would never fire"),
    # --run-dir . defaulted the job's id to '' and blamed the endpoint given too
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--nnodes", "1:2", "--node-rank", "0",
      "--rdzv-endpoint", "127.0.0.1:1", "--run-dir", "/", "--", PRETRAIN, *MODEL],
     "--rdzv-id is needed with --nnodes: the run directory has no name to take it from"),
    # a per-node command that forgot --nnodes trained each node alone, saying nothing
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--node-rank", "1", "--rdzv-endpoint",
      "10.0.0.1:29400", "--", PRETRAIN, *MODEL],
     "--rdzv-endpoint, --node-rank: only across nodes (--nnodes MIN:MAX with MAX above 1)"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--nnodes", "1", "--memory-replicas",
      "2", "--", PRETRAIN, *MODEL], "--memory-replicas: only across nodes"),
    (["--nproc-per-node", "4", "--monitor-backend", "bogus", "--", PRETRAIN, *MODEL],
     "unknown backend 'bogus'"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--", PRETRAIN, *MODEL, "--bogus-flag"],
     "training arguments: unrecognized arguments: --bogus-flag"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--", PRETRAIN, *MODEL, "--lr-decay-style",
      "sideways"], "training arguments: argument --lr-decay-style: invalid choice: 'sideways'"),
    # trained iteration 1 into non-finite weights, then relaunched once on the NaN loss
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--", PRETRAIN, *MODEL, "--lr", "inf"],
     "training arguments: --lr must be a finite number, got inf"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--", PRETRAIN, *MODEL, "--save", "ckpt",
      "--non-persistent-ckpt-type"], "--non-persistent-ckpt-type needs a value"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--", PRETRAIN, *MODEL, "--save=",
      "--non-persistent-ckpt-type", "global"], "--save needs a folder, got an empty value"),
    # the monitor's save requests go to RUN_DIR/flags: the trainer would never see one
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--", PRETRAIN, *MODEL,
      "--emergency-save-flag-dir", "elsewhere"],
     "--emergency-save-flag-dir elsewhere: under ftmaster launch the save requests go to"),
    # a drain waits for the save it asks for: without --save it stayed draining, deaf to
    # alerts, for the rest of the run
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--drain-stragglers", "--", PRETRAIN,
      *MODEL], "--drain-stragglers needs the training command's --save: a drain resumes from "
               "the save it asks for"),
    (["--nproc-per-node", "4", "--monitor-backend", "sim", "--policy", "drain", "--", PRETRAIN,
      *MODEL], "--policy drain needs the training command's --save"),
])
def test_bad_input_is_one_line_and_launches_nothing(tmp_path, args, message):
    run_dir = tmp_path / "run"
    result = launch(run_dir, *args)
    assert result.exit_code != 0
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("flag", ["--tensorboard-dir", "--emergency-save-flag-dir", "--load"])
def test_a_flag_launch_reads_given_no_value_is_one_line_for_a_scripts_own_parser(tmp_path, flag):
    """Upstream Megatron-LM's parser is not ours: launch reads these itself, and a bare
    --tensorboard-dir was a ValueError's traceback that left the run directory and --save's
    claim behind."""
    script = tmp_path / "own_pretrain.py"
    script.write_text("")
    run_dir = tmp_path / "run"
    result = launch(run_dir, "--nproc-per-node", "4", "--monitor-backend", "sim", "--",
                    str(script), *MODEL, "--save", str(tmp_path / "ckpt"), flag, "--seed", "1")
    assert result.exit_code == 2, result.stderr
    assert result.stderr.count("\n") == 1 and f"{flag} needs a value" in result.stderr, result.stderr
    assert not run_dir.exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("variable, value", [("FTMASTER_INJECT_KILL", "1:16:forwrd"),
                                             ("FTMASTER_INJECT_STALL", "0:x")])
def test_a_rehearsal_variable_that_cannot_be_read_is_one_line(tmp_path, monkeypatch, variable, value):
    """Every rank read it at its start and failed with a traceback, which ftmaster took for
    every rank failing, and relaunched."""
    monkeypatch.setenv(variable, value)
    result = launch(tmp_path / "run", "--nproc-per-node", "4", "--monitor-backend", "sim", "--",
                    PRETRAIN, *MODEL)
    assert result.exit_code != 0 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"Error: {variable}={value!r}: expected LOCAL_RANK:")
    assert result.stderr.count("\n") == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("value, message", [
    (["--max-position-embeddings", "16"],
     "--max-position-embeddings (16) is smaller than --seq-length (32)"),
    (["--log-interval", "0"], "--log-interval must be a positive integer, got 0"),
    (["--lr-warmup-fraction", "1.5"],
     "--lr-warmup-fraction must be below 1 (a warm-up shorter than the decay), got 1.5"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1.0"),
    (["--hidden-dropout", "-0.1"], "--hidden-dropout must be a probability between 0 and 1, "
                                   "got -0.1"),
    (["--eval-interval", "0"],
     "--eval-interval must not be 0: Megatron-LM divides by it to size the validation data"),
    (["--lr-decay-samples", "60"],
     "with --train-iters give the learning rate's schedule in iters too, not --lr-decay-samples"),
])
@pytest.mark.parametrize("upstream", [False, True])
def test_a_value_megatron_lm_refuses_is_refused_before_any_launch(tmp_path, upstream, value,
                                                                  message):
    """Megatron-LM refuses it once every rank has started; relaunching cannot fix a typo. A
    script with its own parser (upstream Megatron-LM's) is refused with the same line."""
    script = PRETRAIN
    if upstream:
        script = tmp_path / "pretrain_gpt.py"
        script.write_text("from megatron.training import pretrain\n")
    result = launch(tmp_path / "run", "--nproc-per-node", "4", "--monitor-backend", "sim", "--",
                    str(script), *MODEL, *value)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [f"Error: training arguments: {message}"]
    assert not (tmp_path / "run").exists()


def test_a_launch_refused_after_the_trainer_checks_leaves_no_folder(tmp_path, monkeypatch):
    """The trainer's checks made --save and the memory folder; a check after them refused
    the launch and left both (the one in /dev/shm took its tmpfs room)."""
    monkeypatch.chdir(tmp_path)
    result = launch(tmp_path / "run", "--nproc-per-node", "4", "--monitor-backend", "sim",
                    "--", PRETRAIN, *MODEL, "--save", "ckpt", "--non-persistent-ckpt-type",
                    "global", "--non-persistent-global-ckpt-dir", "memory",
                    "--emergency-save-flag-dir", "elsewhere")
    assert result.exit_code == 2, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_launch_refused_for_a_save_in_use_leaves_no_run_directory(tmp_path):
    """The run directory was made and locked before --save was claimed: each launch refused
    for a --save another run writes left one (a new timestamped one without --run-dir)."""
    from ftmaster.lock import FolderClaim

    other = FolderClaim(tmp_path / "ckpt", "host:/elsewhere", tmp_path / "elsewhere")
    other.acquire()
    try:
        result = launch(tmp_path / "runs" / "new", "--nproc-per-node", "4", "--monitor-backend",
                        "sim", "--", PRETRAIN, *MODEL, "--save", str(tmp_path / "ckpt"))
    finally:
        other.release()
    # Another job's: it lives on through a requeue of this one, so the wrapper must not loop.
    assert result.exit_code == 93, result.stderr
    assert result.stderr.count("\n") == 1 and "is written by another run" in result.stderr
    assert result.stderr.endswith("; do not requeue: a requeue would fail the same way "
                                  "(exit status 93)\n")
    assert not (tmp_path / "runs").exists()


def test_a_launch_refused_after_its_claims_leaves_nothing_it_made(tmp_path):
    """A --metrics-port in use is found once the run directory is locked, --save claimed and
    the memory tier's folder picked: the refusal left the run directory (its lock and metrics
    file), the claim's folders in a --save it made, and the memory folder in /dev/shm, whose
    run directory a later launch then warned it could not see."""
    import socket
    from pathlib import Path

    from ftmaster.persist import DIR_FLAG, flag_value, with_memory_dir

    run_dir = tmp_path / "runs" / f"refused-{tmp_path.name}"
    args, _ = with_memory_dir([*MODEL, "--non-persistent-ckpt-type", "global"], run_dir)
    memory = Path(flag_value(args, DIR_FLAG) or tmp_path / "no room in /dev/shm")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = launch(run_dir, "--nproc-per-node", "4", "--monitor-backend", "sim",
                        "--metrics-port", str(taken.getsockname()[1]), "--", PRETRAIN, *MODEL,
                        "--save", str(tmp_path / "ckpt" / "gpt"),
                        "--non-persistent-ckpt-type", "global")
    assert result.exit_code != 0 and "Address already in use" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == [] and not memory.exists()


def test_a_refused_launch_keeps_what_was_there_before_it(tmp_path):
    """Only what the launch made goes: a --run-dir and a --save that held an earlier run's
    files keep them all."""
    import socket

    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    for folder in (run_dir, save):
        folder.mkdir()
        (folder / "earlier.txt").write_text("an earlier run's")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = launch(run_dir, "--nproc-per-node", "4", "--monitor-backend", "sim",
                        "--metrics-port", str(taken.getsockname()[1]), "--", PRETRAIN, *MODEL,
                        "--save", str(save))
    assert result.exit_code != 0 and "Address already in use" in result.stderr, result.stderr
    assert (run_dir / "earlier.txt").exists() and (save / "earlier.txt").exists()


def test_a_launch_refused_after_its_board_started_leaves_no_event_file(tmp_path):
    """ftmaster's TensorBoard writer makes its event file at once: a launch refused after it
    (warm workers that cannot start) left one more file in the board's folder, no scalar in
    it, each time."""
    run_dir, tensorboard = tmp_path / "run", tmp_path / "tb"
    (run_dir / "logs" / "warm_workers.log").mkdir(parents=True)  # no log: no warm workers
    board = tensorboard / "ftmaster"
    board.mkdir(parents=True)
    (board / "earlier.txt").write_text("an earlier run's")
    result = launch(run_dir, "--nproc-per-node", "4", "--monitor-backend", "sim", "--",
                    PRETRAIN, *MODEL, "--tensorboard-dir", str(tensorboard))
    assert result.exit_code != 0 and "cannot start the warm workers" in result.stderr, \
        result.stderr
    assert [path.name for path in board.iterdir()] == ["earlier.txt"]


def test_no_gpu_and_no_nproc_is_one_line(tmp_path):
    result = launch(tmp_path / "run", "--monitor-backend", "sim", "--", PRETRAIN, *MODEL,
                    env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.exit_code != 0
    assert result.stderr == ("Error: no GPU is visible: give --nproc-per-node N (on a machine "
                             "without GPUs, with --monitor-backend sim)\n")


def test_unwritable_run_dir_is_one_line(tmp_path):
    parent = tmp_path / "a_file"  # a folder cannot be made inside a file, not even by root
    parent.write_text("")
    result = launch(parent / "run", "--nproc-per-node", "4", "--monitor-backend", "sim", "--",
                    PRETRAIN, *MODEL)
    assert result.exit_code != 0
    assert result.stderr == (f"Error: run directory {parent / 'run'} is not writable (Not a "
                             "directory); give a writable --run-dir\n")


def test_an_unwritable_tensorboard_dir_is_one_line(tmp_path):
    """ftmaster writes its own scalars beside the trainer's: it met the folder first, with a
    traceback. The trainer's arguments now refuse it, before anything starts."""
    parent = tmp_path / "a_file"
    parent.write_text("")
    result = launch(tmp_path / "run", "--nproc-per-node", "4", "--monitor-backend", "sim", "--",
                    PRETRAIN, *MODEL, "--tensorboard-dir", str(parent / "tb"))
    assert result.exit_code != 0
    assert result.stderr == (f"Error: training arguments: --tensorboard-dir {parent / 'tb'} is "
                             f"not writable: choose a directory you can write to\n")


def test_a_full_disk_under_the_tensorboard_dir_names_the_folder(tmp_path, monkeypatch):
    """A write that fails names no file: the line read "cannot write to None"."""
    def full_disk(command, node_rank):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("ftmaster.launch.RunBoard.for_command", full_disk)
    result = launch(tmp_path / "run", "--nproc-per-node", "4", "--monitor-backend", "sim", "--",
                    PRETRAIN, *MODEL, "--tensorboard-dir", str(tmp_path / "tb"))
    assert result.exit_code == 2  # bad input, as an unwritable --run-dir: never requeued
    assert result.stderr == (f"Error: --tensorboard-dir: cannot write to {tmp_path / 'tb' / 'ftmaster'} "
                             "(No space left on device)\n")


@pytest.mark.parametrize("entry,kind,problem", [
    ("flags", "file", "flags is not a folder"),
    ("logs", "file", "logs is not a folder"),
    ("events.jsonl", "folder", "events.jsonl is a folder"),
    ("gpu_metrics.csv", "folder", "gpu_metrics.csv is a folder"),
    ("heartbeat.json", "folder", "heartbeat.json is a folder"),
])
def test_a_run_dir_not_in_ftmasters_layout_is_one_line(tmp_path, entry, kind, problem):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if kind == "file":
        (run_dir / entry).write_text("")
    else:
        (run_dir / entry).mkdir()
    result = launch(run_dir, "--nproc-per-node", "4", "--monitor-backend", "sim", "--",
                    PRETRAIN, *MODEL)
    assert result.exit_code != 0
    assert result.stderr == (f"Error: run directory {run_dir} does not hold ftmaster's layout "
                             f"({run_dir / problem}); give another --run-dir\n")
    assert {path.name for path in run_dir.iterdir()} == {entry, "ftmaster.lock"}  # nothing launched


def test_warm_workers_that_cannot_start_are_one_line_and_leave_nothing(tmp_path):
    """The warm pool writes its workers' output to RUN_DIR/logs/warm_workers.log: a file it
    could not open ended the launch in a traceback, leaving the --save claim behind."""
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    (run_dir / "logs" / "warm_workers.log").mkdir(parents=True)
    result = launch(run_dir, "--nproc-per-node", "4", "--monitor-backend", "sim", "--",
                    PRETRAIN, *MODEL, "--save", str(save))
    # 2, as every refused launch: 1 is a give-up that fresh nodes may cure, which
    # scripts/slurm/train.sbatch requeues (three times, each failing alike)
    assert result.exit_code == 2
    assert result.stderr == (f"Error: cannot start the warm workers: "
                             f"{run_dir / 'logs' / 'warm_workers.log'} (Is a directory); give "
                             f"a --run-dir ftmaster can write, or --cold-restart\n")
    assert not save.exists()
