"""ftmaster launch end to end on CPU: real torchrun, real ranks, real signals (sim monitor)."""

import csv
import json
import os
import re
import signal
import subprocess

import pytest
from click.testing import CliRunner
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ftmaster import runfiles
from ftmaster.cli import main
from ftmaster.recovery.checkpoints import checkpoint_problem, iteration_dir, read_tracker
from helpers.launch import (MetricsScraper, attempt_log, events, launch_argv, losses,
                            processes_mentioning, run_launch, start_launch, train_args,
                            watched_launch)
from helpers.trainer import REPO, iterations, run_trainer, trainer_env, wait_until
from megatron.training.startup import PHASES as STARTUP_PHASES

pytestmark = pytest.mark.slow


def only(run_dir, name):
    found = events(run_dir, name)
    assert len(found) == 1, f"expected one {name} event, got {found}"
    return found[0]


def test_degrade_then_fail_saves_early_replans_on_three_gpus_and_matches_the_loss(tmp_path):
    """The issue's main scenario: TP2 x PP2, degrade GPU 1 at 8, kill it at 16, 30 iterations;
    scraped by Prometheus and written to TensorBoard throughout."""
    run_dir, save, board = tmp_path / "run", tmp_path / "ckpt", tmp_path / "tb"
    # The failure waits for the save the alert asks for (about 3 monitor samples after
    # iteration 8), however fast the machine trains.
    args = train_args(save, 30, 2, 2, 100, "--emergency-save-gap-frac", "0.05", global_batch=24)
    scraper = MetricsScraper(run_dir)
    scraper.start()
    code, output = watched_launch(run_dir, 4, [*args, "--tensorboard-dir", str(board)], "--seed",
                                  "2", "--metrics-port", "0", "--inject", "degrade:gpu=1,at=iter:8",
                                  "--inject", "fail:gpu=1,at=iter:16,after=emergency_save",
                                  stop_watching=scraper.stop)
    assert code == 0, output[-4000:]

    alert = next(e for e in events(run_dir, "risk_alert") if "device_lost" not in e["reasons"])
    assert alert["gpu"] == 1
    saved = only(run_dir, "emergency_save")["iteration"]
    failure = only(run_dir, "failure")
    assert 8 <= saved <= failure["iteration"] and failure["iteration"] >= 16
    assert (failure["attempt"], failure["gpus"], failure["cause"] in ("exit", "device_lost")) == (1, [1], True)
    plan = only(run_dir, "plan")
    assert (plan["gpus_available"], plan["num_gpus_used"], plan["data_parallel_size"]) == ([0, 2, 3], 3, 3)
    relaunch = events(run_dir, "launch")[1]
    assert (relaunch["attempt"], relaunch["gpus"]) == (2, [0, 2, 3])
    assert f"loaded checkpoint from {iteration_dir(save, saved)} at iteration {saved}" in attempt_log(run_dir, 2)
    assert only(run_dir, "resumed")["iteration"] == saved + 1
    assert only(run_dir, "complete")["iteration"] == 30
    assert_startup_phases(run_dir, [False, True])  # the relaunch ran on warm workers
    assert read_tracker(save) == 30 and checkpoint_problem(iteration_dir(save, 30)) is None

    assert_report_and_analysis_tell_the_story(run_dir, tmp_path / "analysis", saved, failure)
    assert_scraped_risk_per_gpu_and_a_failure_counter_that_moves(scraper)
    assert_one_continuous_loss_curve(board, 30, saved)

    reference = run_trainer(4, [str(tmp_path / "ref_ckpt") if a == str(save) else a for a in args])
    assert reference.returncode == 0, reference.stdout[-3000:]
    expected = iterations(reference.stdout)
    recovered = losses(run_dir)
    for it in range(26, 31):
        assert abs(recovered[it] - expected[it]["loss"]) <= 0.03 * expected[it]["loss"], (it, recovered[it])


def assert_scraped_risk_per_gpu_and_a_failure_counter_that_moves(scraper):
    assert len(scraper.scrapes) >= 5, len(scraper.scrapes)
    for gpu in "0123":  # every GPU's risk, while it was watched
        assert any(v is not None for v in scraper.values("ftmaster_gpu_failure_risk", gpu=gpu))
    risk = scraper.values("ftmaster_gpu_failure_risk", gpu="1")
    assert max(risk) >= 0.95  # degraded: it alerted
    failures = scraper.values("ftmaster_failures_total")
    assert failures[0] == 0 and failures[-1] >= 1  # it moved while we watched
    assert scraper.values("ftmaster_rto_seconds_count")[-1] == 1
    assert scraper.values("ftmaster_attempts_total")[-1] == 2


def assert_one_continuous_loss_curve(board, iterations, saved):
    """Both attempts wrote to one folder; tensorboard's own reader sees one curve, each
    iteration once, the relaunch's values from the iteration after the checkpoint on."""
    accumulator = EventAccumulator(str(board), size_guidance={"scalars": 0})
    accumulator.Reload()
    loss = accumulator.Scalars("lm loss")
    assert [e.step for e in loss] == list(range(1, iterations + 1))
    files = sorted(board.glob("events.out.tfevents.*"))
    assert len(files) == 2  # one per attempt (the last rank of each)
    relaunch_start = min(e.wall_time for e in loss if e.step == saved + 1)
    assert all(e.wall_time >= relaunch_start for e in loss if e.step > saved)
    ours = EventAccumulator(str(board / "ftmaster"), size_guidance={"scalars": 0})
    ours.Reload()
    assert {"ftmaster/risk/gpu1", "ftmaster/failures", "ftmaster/rto_seconds"} <= set(
        ours.Tags()["scalars"])


def assert_startup_phases(run_dir, warm):
    """One startup event per attempt, warm as given; a relaunch's phases add up to the time
    from its launch to its first iteration (as the supervisor saw it, polling every 0.1 s)."""
    startups = events(run_dir, "startup")
    assert [s["warm"] for s in startups] == warm
    for launch, startup, resumed in zip(events(run_dir, "launch")[1:], startups[1:],
                                        events(run_dir, "resumed")):
        assert list(startup["phases"]) == list(STARTUP_PHASES)
        assert startup["phases"]["checkpoint-read"] > 0
        took = resumed["time"] - launch["time"]
        assert sum(startup["phases"].values()) == pytest.approx(took, rel=0.1, abs=0.2), startup


def assert_report_and_analysis_tell_the_story(run_dir, out, saved, failure):
    """ftmaster report, analyze and goodput on the launch's own run directory."""
    runner = CliRunner()
    result = runner.invoke(main, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    (reported,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert reported["checkpoint"]["iteration"] == reported["restarted_from_iteration"] == saved
    assert reported["lost_iterations"] == failure["iteration"] - saved
    assert reported["lead_time"]["gpu"] == 1 and reported["lead_time"]["seconds"] > 0
    assert reported["new_layout"]["gpus"] == [0, 2, 3]
    assert reported["startup"]["warm"] is True
    assert sum(reported["phases"].values()) == pytest.approx(reported["rto_seconds"], rel=1e-6)
    assert f"lost iterations    {failure['iteration'] - saved} (RPO" in result.output
    page = (run_dir / "report.html").read_text()
    assert "Failure 1: " in page and f"RPO <b>{failure['iteration'] - saved} iteration(s)</b>" in page

    result = runner.invoke(main, ["analyze", str(run_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = {row["gpu"]: row for row in csv.DictReader((out / "summary.csv").open())}
    assert float(summary["1"]["failure_risk_max"]) >= 0.95 and int(summary["1"]["alerts"]) >= 1
    assert all(float(summary[g]["failure_risk_max"]) < 0.95 for g in ("0", "2", "3"))
    assert (out / "failure_risk.png").stat().st_size > 10_000
    assert not re.search(r"\d\.\d{3,}", (out / "summary.md").read_text())  # no float32 noise

    result = runner.invoke(main, ["goodput", "--run-dir", str(run_dir), "--runs", "0", "--json"])
    assert result.exit_code == 0, result.output
    goodput = json.loads(result.stdout)
    assert {"iteration_s", "restart_s", "save_block_s"} <= set(goodput["measured"])
    assert 0 < goodput["inputs"]["restart_s"] <= reported["rto_from_fault_seconds"]


def test_hang_and_two_failures_are_recovered_cold_then_sigterm_saves_and_exits(tmp_path):
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    hang_timeout = 10  # above the longest periodic save: a save writes no heartbeat
    ftmaster = start_launch(run_dir, 3, train_args(save, 200, 1, 1, 3), "--cold-restart",
                            "--hang-timeout", str(hang_timeout),
                            "--inject", "hang:gpu=0,at=iter:4", "--inject", "fail:gpu=2,at=iter:7",
                            "--inject", "fail:gpu=1,at=iter:10")
    try:
        wait_until(lambda: len(events(run_dir, "resumed")) == 3, timeout=400, interval=0.5,
                   what="three relaunches resuming")
        wait_until(lambda: (runfiles.read_heartbeat(run_dir) or {}).get("iteration", 0) >= 12,
                   timeout=120, interval=0.2, what="progress after the last relaunch")
        ftmaster.send_signal(signal.SIGTERM)
        output, _ = ftmaster.communicate(timeout=180)
    finally:
        if ftmaster.poll() is None:
            ftmaster.kill()
    assert ftmaster.returncode == 128 + signal.SIGTERM, output[-4000:]

    injected = {e["kind"] + str(e["gpu"]): e for e in events(run_dir, "fault_injected")}
    failures = events(run_dir, "failure")
    assert [(f["attempt"], f["cause"]) for f in failures][0] == (1, "hang")
    assert failures[0]["gpus"] == [0]  # the stopped rank
    assert failures[0]["time"] - injected["hang0"]["time"] <= hang_timeout + 2
    assert [(f["attempt"], f["gpus"]) for f in failures[1:]] == [(2, [2]), (3, [1])]
    assert [p["gpus_available"] for p in events(run_dir, "plan")] == [[0, 1, 2], [0, 1], [0]]
    assert [e["gpus"] for e in events(run_dir, "launch")] == [[0, 1, 2], [0, 1, 2], [0, 1], [0]]
    assert [r["attempt"] for r in events(run_dir, "resumed")] == [2, 3, 4]
    assert_startup_phases(run_dir, [False] * 4)  # --cold-restart: torchrun every time

    stopped = only(run_dir, "stopped")
    assert stopped["exit_code"] == 0
    last_log = attempt_log(run_dir, 4)
    assert f"exiting on SIGTERM after iteration {read_tracker(save)}" in last_log
    assert not processes_mentioning(f"{tmp_path}/")  # the run's and its checkpoints' folder


def test_wait_policy_gets_all_four_gpus_back_locks_refuse_a_second_and_sigkill_leaves_nothing(tmp_path):
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    args = train_args(save, 200, 2, 2, 2)
    ftmaster = subprocess.Popen(
        launch_argv(run_dir, 4, args, "--policy", "wait", "--wait-timeout", "120",
                    "--inject", "fail:gpu=1,at=iter:2", "--inject", "recover:gpu=1,at=1s"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=trainer_env(), cwd=REPO,
        start_new_session=True)
    try:
        wait_until(lambda: events(run_dir, "resumed"), timeout=300, interval=0.5, what="relaunch")
        second = CliRunner().invoke(main, ["launch", *launch_argv(run_dir, 4, args)[4:]])
        assert second.exit_code != 0
        assert second.stderr == (f"Error: another ftmaster (pid {ftmaster.pid}) is using {run_dir}; "
                                 "wait for it to end or give another --run-dir\n")
        other_run = CliRunner().invoke(main, ["launch", *launch_argv(tmp_path / "run2", 4, args)[4:]])
        assert other_run.exit_code == 93
        assert other_run.stderr.startswith(f"Error: --save {save} is written by another run (host ")
        assert f"pid {ftmaster.pid}, run_dir {run_dir}); give another --save, or stop that run " \
               f"first (if its host is down, remove {save}/.ftmaster_jobs/" in other_run.stderr
        assert processes_mentioning(str(save))
        wait_until(lambda: len(events(run_dir, "startup")) == 2, timeout=60, what="startup 2")
        assert [e["warm"] for e in events(run_dir, "startup")] == [False, True]
        os.killpg(ftmaster.pid, signal.SIGKILL)
        ftmaster.wait()
        wait_until(lambda: not processes_mentioning(f"{tmp_path}/"), timeout=30,
                   what="every training process and warm worker to die with ftmaster")
    finally:
        if ftmaster.poll() is None:
            os.killpg(ftmaster.pid, signal.SIGKILL)

    assert only(run_dir, "failure")["gpus"] == [1]
    assert only(run_dir, "waiting")["gpus"] == [1]
    assert only(run_dir, "gpus_back")["gpus"] == [1]
    plan = only(run_dir, "plan")
    assert (plan["gpus_available"], plan["num_gpus_used"]) == ([0, 1, 2, 3], 4)
    assert events(run_dir, "launch")[1]["gpus"] == [0, 1, 2, 3]


def test_a_script_that_fails_before_its_first_iteration_twice_is_a_user_error(tmp_path):
    run_dir = tmp_path / "run"
    script = tmp_path / "broken.py"
    script.write_text("import sys\nprint('boom: --lr is missing', file=sys.stderr)\nsys.exit(3)\n")
    argv = launch_argv(run_dir, 1, train_args(tmp_path / "ckpt", 10))
    argv[argv.index("--") + 1] = str(script)
    result = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=trainer_env(), cwd=REPO, timeout=300)
    assert result.returncode == 93, result.stdout[-4000:]  # a crash loop: a requeue loops too
    assert "; do not requeue: a requeue would fail the same way (exit status 93)" in result.stdout
    assert "boom: --lr is missing" in result.stdout
    failures = events(run_dir, "failure")
    assert [(f["cause"], f["gpus"], f["exit_codes"]) for f in failures] == [("exit", [0], {"0": 3})] * 2
    gave_up = only(run_dir, "gave_up")
    assert "before its first iteration 2 times" in gave_up["reason"]
    assert "boom: --lr is missing" in gave_up["root_cause"]  # for the report
    assert len(events(run_dir, "launch")) == 2


def test_drain_policy_restarts_without_the_alerting_gpu_after_its_emergency_save(tmp_path):
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    # A TP1 iteration takes tens of milliseconds while the alert needs a few monitor samples
    # (about 2 s), so the run must be long enough for the drain to happen before it ends.
    args = train_args(save, 150, 1, 1, 1000, "--emergency-save-gap-frac", "0.03")
    result = run_launch(run_dir, 2, args, "--policy", "drain", "--inject", "degrade:gpu=1,at=iter:3")
    assert result.returncode == 0, result.stdout[-4000:]
    drain = only(run_dir, "drain")
    saved = only(run_dir, "emergency_save")
    assert drain["gpu"] == 1 and saved["time"] > drain["time"]
    assert not events(run_dir, "failure")
    plan = only(run_dir, "plan")
    assert (plan["gpus_available"], plan["num_gpus_used"]) == ([0], 1)
    assert events(run_dir, "launch")[1]["gpus"] == [0]
    assert only(run_dir, "resumed")["iteration"] == saved["iteration"] + 1
    assert only(run_dir, "complete")["iteration"] == 150
