"""Emergency saves inside the training loop at TP2xPP2 on 4 CPU ranks."""

import signal

import pytest

from ftmaster import runfiles
from ftmaster.recovery.checkpoints import (
    find_loadable_checkpoint,
    iteration_dir,
    list_iterations,
    read_tracker,
)
from helpers.trainer import (
    SMALL_GPT,
    iterations,
    kill_session,
    run_trainer,
    start_trainer,
    wait_until,
    worker_with_local_rank,
)

pytestmark = pytest.mark.slow

TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3"]


def heartbeat_iteration(run_dir):
    beat = runfiles.read_heartbeat(run_dir)
    return beat["iteration"] if beat else 0


def events_named(run_dir, name):
    return [event for event in runfiles.read_events(run_dir) if event["event"] == name]


def drop_flag_at(run_dir, iteration, content):
    """Write the flag once training reaches ``iteration``; returns the last completed iteration
    just before and just after the write, which bracket the iteration the flag appeared at
    (on a busy host training can move on between the two reads)."""
    wait_until(lambda: heartbeat_iteration(run_dir) >= iteration, 180, what=f"iteration {iteration}")
    flag = runfiles.save_now_flag_path(run_dir)
    flag.parent.mkdir(parents=True, exist_ok=True)
    before = heartbeat_iteration(run_dir)
    flag.write_bytes(content)
    return before, heartbeat_iteration(run_dir)


def emergency_after(run_dir, iteration):
    saves = wait_until(lambda: [e for e in events_named(run_dir, "emergency_save")
                                if e["iteration"] > iteration], 120,
                       what=f"an emergency save after iteration {iteration}")
    return saves[0]["iteration"]


@pytest.fixture(scope="module")
def flagged_run(tmp_path_factory):
    """One run: an empty flag, a malformed flag, and a valid flag right after periodic save 20."""
    root = tmp_path_factory.mktemp("emergency")
    run_dir, save = root / "run", root / "save"
    log = root / "train.log"
    process = start_trainer(4, SMALL_GPT + TP2PP2 + BATCH + [
        "--train-iters", "25", "--save", str(save), "--save-interval", "20"],
        log, FTMASTER_RUN_DIR=str(run_dir))
    try:
        seen = {"empty": drop_flag_at(run_dir, 5, b"")}
        seen["empty_saved"] = emergency_after(run_dir, 0)
        seen["malformed"] = drop_flag_at(run_dir, seen["empty_saved"] + 6, b"{not json")
        seen["malformed_saved"] = emergency_after(run_dir, seen["empty_saved"])
        wait_until(lambda: events_named(run_dir, "periodic_save"), 180, what="periodic save 20")
        seen["after_periodic"] = drop_flag_at(run_dir, 20, b'{"gpu": 1, "score": 0.99}')
        returncode = process.wait(timeout=240)
    finally:
        kill_session(process)
    output = log.read_text()
    assert returncode == 0, output[-3000:]
    return run_dir, save, seen, output


def test_flags_become_checkpoints_within_two_iterations(flagged_run):
    _, save, seen, _ = flagged_run
    for flag in ("empty", "malformed"):
        before, after = seen[flag]
        assert before < seen[f"{flag}_saved"] <= after + 2, (flag, seen)
    for iteration in (seen["empty_saved"], seen["malformed_saved"]):
        assert (iteration_dir(save, iteration) / "ftmaster_save.json").exists()


def test_request_after_periodic_save_waits_for_the_gap(flagged_run):
    run_dir, save, seen, _ = flagged_run
    before, after = seen["after_periodic"]
    assert 20 <= before and after < 25
    deferred = [e for e in events_named(run_dir, "save_deferred") if e["iteration"] > 20]
    assert deferred and deferred[0]["until_iteration"] == 25
    assert [e["iteration"] for e in events_named(run_dir, "emergency_save")][-1] == 25
    assert not set(range(21, 25)) & set(list_iterations(save))
    assert not runfiles.save_now_flag_path(run_dir).exists()  # consumed after the save


def test_events_carry_blocking_time_and_bytes(flagged_run):
    run_dir, _, _, _ = flagged_run
    for event in events_named(run_dir, "emergency_save"):
        assert event["seconds"] > 0 and event["bytes"] > 0
        assert event["persist_seconds"] >= event["seconds"] * 0.5


def test_emergency_checkpoint_reloads_at_tp1pp1(flagged_run):
    _, save, _, _ = flagged_run
    assert read_tracker(save) == 25
    result = run_trainer(1, SMALL_GPT + BATCH + ["--train-iters", "26", "--load", str(save),
                                                 "--override-opt-param-scheduler"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert "at iteration 25" in result.stdout and "'tensor_model_parallel_size': 1" in result.stdout
    assert min(iterations(result.stdout)) == 26


def test_sigkill_during_emergency_save_keeps_previous_checkpoint(tmp_path):
    run_dir, save = tmp_path / "run", tmp_path / "save"
    wider = SMALL_GPT + ["--hidden-size", "256", "--num-attention-heads", "8"]  # a slower save
    process = start_trainer(4, wider + TP2PP2 + BATCH + [
        "--train-iters", "1000", "--save", str(save), "--save-interval", "4",
        "--distributed-timeout-minutes", "0.5"], tmp_path / "train.log",
        FTMASTER_RUN_DIR=str(run_dir))
    try:
        wait_until(lambda: read_tracker(save) == 4, 180, what="periodic checkpoint 4")
        before, after = drop_flag_at(run_dir, 6, b"")
        victim = worker_with_local_rank(process, 1)
        started = wait_until(lambda: [it for it in list_iterations(save) if it > 4], 60,
                             interval=0.002, what="the emergency save to start")
        victim.send_signal(signal.SIGKILL)
        returncode = process.wait(timeout=120)  # torchrun tears the other ranks down
    finally:
        kill_session(process)
    assert returncode != 0
    assert before < started[0] <= after + 2
    assert read_tracker(save) == 4
    assert find_loadable_checkpoint(save).iteration == 4
    result = run_trainer(1, wider + BATCH + ["--train-iters", "5", "--load", str(save),
                                             "--override-opt-param-scheduler"])
    assert result.returncode == 0 and min(iterations(result.stdout)) == 5, result.stdout[-3000:]


def test_a_trainer_without_ftmaster_removes_the_flag_it_answered(tmp_path):
    """--emergency-save-flag-dir and no run directory: the answered flag is removed all the
    same, or the next run on that folder takes an emergency save it was never asked for."""
    flag, save = tmp_path / "flags" / runfiles.SAVE_NOW_FLAG, tmp_path / "save"
    runfiles.write_flag(flag, source="test")
    result = run_trainer(1, SMALL_GPT + BATCH + [
        "--train-iters", "3", "--save", str(save), "--emergency-save-gap-frac", "0",
        "--emergency-save-flag-dir", str(flag.parent)])
    assert result.returncode == 0, result.stdout[-3000:]
    assert "saved emergency checkpoint at iteration 1" in result.stdout
    assert not flag.exists()


@pytest.mark.parametrize("end, saved", [
    (["--train-iters", "3"], "saved final checkpoint at iteration 3"),
    (["--train-iters", "10", "--exit-interval", "2"], "saved exit checkpoint at iteration 2"),
], ids=["final", "exit-interval"])
def test_the_last_save_answers_a_request_still_waiting_out_the_gap(tmp_path, end, saved):
    """The gap (25 iterations from the start) outlasts the run: the save that ends it answers
    the request, and its flag goes with it, or the next run on the folder saves unasked."""
    flag, save = tmp_path / "flags" / runfiles.SAVE_NOW_FLAG, tmp_path / "save"
    runfiles.write_flag(flag, source="test")
    result = run_trainer(1, SMALL_GPT + BATCH + end + [
        "--save", str(save), "--save-interval", "100",
        "--emergency-save-flag-dir", str(flag.parent)])
    assert result.returncode == 0, result.stdout[-3000:]
    assert saved in result.stdout and "emergency checkpoint" not in result.stdout
    assert not flag.exists()
