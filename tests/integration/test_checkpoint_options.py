"""--async-save, --ckpt-assume-constant-structure, --no-load-optim and the resumed LR schedule,
on the real trainer (CPU + gloo)."""

import threading

import pytest

from ftmaster import runfiles
from ftmaster.recovery.checkpoints import checkpoint_problem, iteration_dir, read_tracker
from ftmaster.recovery.manifest import MANIFEST_NAME, read_manifest
from helpers.trainer import SMALL_GPT, iterations, layout_args, run_trainer

pytestmark = pytest.mark.slow

SCHEDULE = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2",
            "--min-lr", "1e-4", "--lr-decay-style", "linear", "--seed", "3"]


class TrackerWatch:
    """Reads the tracker while training runs: every iteration it ever names must already be
    a complete checkpoint, shards included."""

    def __init__(self, save):
        self.save, self.seen, self.incomplete = save, set(), []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        # One last look after the run has ended: on a busy machine the first check (which
        # imports torch's checkpoint reader) can outlast the run, and the final tracker
        # would go unseen.
        while True:
            stopping = self._stop.is_set()
            self._look()
            if stopping:
                return
            self._stop.wait(0.005)

    def _look(self):
        tracked = read_tracker(self.save)
        if tracked is not None and tracked not in self.seen:
            self.seen.add(tracked)
            problem = checkpoint_problem(iteration_dir(self.save, tracked))
            if problem is not None:
                self.incomplete.append((tracked, problem))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def async_saved(tmp_path_factory):
    """Eight iterations at TP1 x PP2 with async saves at 2, 4, 6 and the final one at 8, the
    save plan kept from the first (the resumes below load them on another layout)."""
    root = tmp_path_factory.mktemp("async")
    save, run_dir = root / "save", root / "run"
    with TrackerWatch(save) as watch:
        result = run_trainer(2, SMALL_GPT + SCHEDULE + layout_args(1, 2) + [
            "--train-iters", "8", "--save", str(save), "--save-interval", "2", "--async-save",
            "--ckpt-assume-constant-structure"],
            FTMASTER_RUN_DIR=str(run_dir))
    assert result.returncode == 0, result.stdout[-3000:]
    return save, run_dir, watch, result.stdout


def test_async_save_moves_the_tracker_only_to_complete_checkpoints(async_saved):
    save, run_dir, watch, log = async_saved
    assert watch.incomplete == []
    assert watch.seen and max(watch.seen) == read_tracker(save) == 8
    assert "async periodic save at iteration 2 started; training blocked" in log
    saves = [e for e in runfiles.read_events(run_dir) if e["event"] == "periodic_save"]
    assert [e["iteration"] for e in saves] == [2, 4, 6, 8]
    assert [e["structure"] for e in saves] == ["new", "same", "same", "same"]
    assert all(e["persist_seconds"] >= e["seconds"] for e in saves)
    for iteration in (2, 4, 6, 8):  # the writers' digest sidecars are gone: read and removed
        folder = iteration_dir(save, iteration)
        written = {path.name for path in folder.iterdir()}
        assert written == set(read_manifest(folder).files) | {MANIFEST_NAME}


def resume(save, *extra):
    result = run_trainer(1, SMALL_GPT + SCHEDULE + layout_args(1, 1) + [
        "--train-iters", "10", "--load", str(save), *extra])
    return result, iterations(result.stdout)


def test_no_load_optim_reshards_the_model_alone_and_keeps_the_schedule(async_saved):
    save = async_saved[0]
    full, with_optimizer = resume(save, "--override-opt-param-scheduler")
    bare, without_optimizer = resume(save, "--override-opt-param-scheduler", "--no-load-optim")
    assert full.returncode == 0 and bare.returncode == 0, bare.stdout[-3000:]
    assert sorted(without_optimizer) == [9, 10]
    # Iteration 9's loss is the loaded weights' loss; its update already differs.
    assert without_optimizer[9]["loss"] == pytest.approx(with_optimizer[9]["loss"], rel=1e-5)
    assert without_optimizer[10]["loss"] != pytest.approx(with_optimizer[10]["loss"], rel=1e-5)
    assert [without_optimizer[i]["lr"] for i in (9, 10)] == [with_optimizer[i]["lr"] for i in (9, 10)]


def test_a_checkpoint_of_another_model_shape_is_refused_in_one_line(async_saved):
    """4 heads resumed as 2: the QKV weight keeps its shape, and the trained weights loaded
    silently, cut into other heads (Megatron-LM's check_checkpoint_args refuses it)."""
    result, logged = resume(async_saved[0], "--override-opt-param-scheduler",
                            "--num-attention-heads", "2")
    assert result.returncode != 0 and not logged
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: the checkpoint's model has num_attention_heads 4 where the arguments give 2 "
        "(--num-attention-heads): resume with the checkpoint's model, or start a new run from "
        "its weights"]


def test_a_changed_schedule_is_one_line_unless_told_which_to_follow(async_saved):
    result, logged = resume(async_saved[0])  # --train-iters 10 lengthens the decay of 8
    assert result.returncode != 0 and not logged
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: the learning-rate schedule differs from the checkpoint's (lr_decay_steps 32 in "
        "the checkpoint, 40 now; wd_incr_steps 32 in the checkpoint, 40 now): pass "
        "--override-opt-param-scheduler to follow the arguments, or "
        "--use-checkpoint-opt-param-scheduler to keep the checkpoint's"]
    ranks_output = result.stdout.split("elastic/multiprocessing/api.py")[0]  # torchrun's report follows
    assert "Traceback" not in ranks_output
