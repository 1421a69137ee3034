"""ftmaster report on generated run directories that follow DESIGN's events and log contract."""

import html
import json
import os
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ftmaster.cli import main
from ftmaster.report import _startup_text
from helpers.synth_run import (LAYOUT, alert, event, iteration_line, launch, loaded_line, plan, save,
                               write_run)


STARTUP_PHASES = {"launch": 0.05, "interpreter": 0.0, "imports": 0.02, "process-group": 1.0,
                  "model-and-optimizer-setup": 2.0, "train/valid/test-data-iterators-setup": 0.3,
                  "checkpoint-search": 0.03, "checkpoint-verify": 0.5, "checkpoint-read": 1.0,
                  "first-iteration": 0.5}


def test_lost_iterations_whose_time_the_log_lacks_say_so_in_words(tmp_path):
    """The hung rank's last iteration is in the heartbeat, not in the log: the line read
    "(RPO; unknown of training)"."""
    run_dir = two_failures(tmp_path / "run")
    log = run_dir / "logs" / "attempt_1.log"
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:-1]))  # no iteration 16
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert "  lost iterations    4 (RPO; training time unknown)\n" in result.output


def two_failures(run_dir):
    """Attempt 1 (TP2 x PP2) loses GPU 1 to an injected fault after an alert and an emergency
    save; attempt 2 (DP3) loses GPU 2, which the monitor reports gone; attempt 3 (DP2) ends.
    Attempt 3 logs every 5 iterations."""
    events = [
        launch(0, 1, [0, 1, 2, 3], 2, 2, 1),
        alert(40, 2, ["temperature"]),  # before failure 1: no lead time for failure 2
        alert(50, 1, ["ecc_sbe_rate", "xid_92"]),
        event("checkpoint_request", 50.1, source="monitor", gpu=1),
        save("emergency_save", 55, 12, 0.5, 0.8),
        event("save_deferred", 56, iteration=13, until_iteration=20),
        event("fault_injected", 70, kind="fail", gpu=1, spec="fail:gpu=1,at=iter:16", iteration=16),
        event("failure", 70.25, attempt=1, iteration=16, cause="device_lost", gpus=[1], exit_codes={}),
        alert(70.3, 1, ["device_lost"]),
        plan(71.75, [0, 2, 3], 1, 1, 3),
        launch(72.75, 2, [0, 2, 3], 1, 1, 3),
        event("resumed", 95.25, attempt=2, iteration=13),
        event("startup", 95.3, phases=STARTUP_PHASES, seconds=22.4, warm=True, ranks=3,
              slowest_rank=2),
        save("periodic_save", 97, 20, 0.25, 1.0),
        alert(110, 2, ["ecc_dbe"]),
        event("failure", 120.5, attempt=2, iteration=25, cause="device_lost", gpus=[2], exit_codes={}),
        alert(120.75, 2, ["device_lost"], sample_at=119.5),  # written after the failure, sampled before
        plan(122.5, [0, 3], 1, 1, 2),
        launch(123, 3, [0, 3], 1, 1, 2),
        event("resumed", 150, attempt=3, iteration=21),
        save("periodic_save", 158, 30, 0.25, 1.0),
        event("complete", 160, iteration=30),
    ]
    logs = {1: [iteration_line(n, 30, 100) for n in range(1, 17)],
            2: [loaded_line(12, 1.5, 4096), iteration_line(13, 30, 500),
                *(iteration_line(n, 30, 200) for n in range(14, 26))],
            3: [loaded_line(20, 2.0, 8192), iteration_line(25, 30, 300), iteration_line(30, 30, 250)]}
    return write_run(run_dir, events, logs)


def run_report(*args):
    return CliRunner().invoke(main, ["report", *map(str, args)])


@pytest.fixture
def reported(tmp_path):
    run_dir = two_failures(tmp_path / "run")
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    return result.stdout, json.loads((run_dir / "report.json").read_text())


def test_first_failure_injected_fault_alert_lead_checkpoint_and_rto_phases(reported):
    _, report = reported
    first = report["failures"][0]
    assert (first["attempt"], first["cause"], first["gpus"], first["iteration"]) == (1, "device_lost", [1], 16)
    assert first["detection_latency"] == {"seconds": pytest.approx(0.25),
                                          "since": "fault_injected fail on GPU 1"}
    assert first["lead_time"]["seconds"] == pytest.approx(20.0)  # fault at 70, alert at 50
    assert first["lead_time"]["gpu"] == 1
    assert first["checkpoint"]["iteration"] == 12 and first["checkpoint"]["kind"] == "emergency"
    assert (first["restarted_from_iteration"], first["lost_iterations"]) == (12, 4)
    assert first["lost_seconds"] == pytest.approx(0.4)  # iterations 13..16 at 100 ms
    assert first["rto_seconds"] == pytest.approx(25.0)
    # loaded at 95.25 - 0.5 (iteration 13's logged time) = 94.75
    assert first["phases"] == pytest.approx({"failure_to_plan": 1.5, "plan_to_launch": 1.0,
                                             "launch_to_loaded": 22.0, "loaded_to_first_iteration": 0.5})
    assert sum(first["phases"].values()) == pytest.approx(first["rto_seconds"])
    assert first["fault_to_failure_seconds"] == pytest.approx(0.25)  # injected at 70
    assert first["rto_from_fault_seconds"] == pytest.approx(25.25)
    assert (first["load_seconds"], first["load_bytes"]) == (1.5, 4096)
    assert first["new_layout"] == {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                   "data_parallel_size": 3, "num_gpus_used": 3, "gpus": [0, 2, 3], **LAYOUT}


def test_second_failure_uses_the_device_lost_sample_time_and_only_its_own_window(reported):
    _, report = reported
    second = report["failures"][1]
    assert second["detection_latency"]["seconds"] == pytest.approx(1.0)  # 120.5 - 119.5
    assert second["detection_latency"]["since"] == "monitor: GPU 2 device_lost"
    assert second["lead_time"]["seconds"] == pytest.approx(9.5)  # alert at 110, not the one at 40
    assert second["checkpoint"]["iteration"] == 20
    assert (second["restarted_from_iteration"], second["lost_iterations"]) == (20, 5)
    assert second["lost_seconds"] == pytest.approx(1.0)
    # Attempt 3 logs every 5 iterations: 300 ms stands for each of 21..25.
    assert second["phases"]["loaded_to_first_iteration"] == pytest.approx(0.3)
    assert second["rto_seconds"] == pytest.approx(29.5)
    assert second["rto_from_fault_seconds"] == pytest.approx(30.5)  # the GPU vanished at 119.5
    assert second["new_layout"]["gpus"] == [0, 3] and second["new_layout"]["data_parallel_size"] == 2
    assert report["outcome"] == "complete: iteration 30"


@pytest.mark.parametrize("ranks, ends", [(1, "its rank ends it"), (3, "the last of 3 ranks ends it")])
def test_the_start_up_line_counts_the_ranks_a_phase_waits_for(ranks, ends):
    startup = {"phases": {"launch": 0.05}, "seconds": 9.5, "warm": False, "ranks": ranks}
    (line, _) = _startup_text(startup)
    assert line == ("  start-up           9.500 s launch to first iteration (cold start; a phase "
                    f"ends when {ends})")


def test_text_has_a_timeline_line_per_event_and_a_block_per_failure(reported):
    text, report = reported
    timeline = [line for line in text.splitlines() if line.lstrip().startswith("+")]
    assert len(timeline) == len(report["timeline"]) == 22
    assert timeline[0].split()[:3] == ["+0.00", "s", "launch"]
    assert timeline[0].split("launch", 1)[1].strip().startswith("attempt 1 on GPUs 0, 1, 2, 3: TP")
    assert any(line.strip().endswith("of GPUs 0, 2, 3") for line in timeline)  # the plan's
    assert "    +70.25 s  failure            attempt 1 device_lost on GPU 1, last iteration 16" in text
    assert "failure 2: attempt 2, device_lost on GPU 2" in text
    assert "  lost iterations    4 (RPO; 0.400 s of training)" in text
    assert "    launch to loaded            22.000 s" in text
    assert ("  start-up           22.400 s launch to first iteration (warm workers; a phase ends when "
            "the last of 3 ranks ends it)\n    launch                                  0.050 s\n") in text
    assert "    train/valid/test-data-iterators-setup   0.300 s\n" in text
    assert report["failures"][0]["startup"] == {"phases": STARTUP_PHASES, "seconds": 22.4,
                                                "warm": True, "ranks": 3, "slowest_rank": 2}
    assert report["failures"][1]["startup"] is None  # its relaunch recorded none
    assert ("  RTO from fault     25.250 s (detection: fault to failure 0.250 s, since "
            "fault_injected fail on GPU 1; then the RTO above)") in text
    assert "new layout         TP 1 x PP 1 x DP 2, micro-batch 2, global batch 12, GPUs 0, 3" in text


def test_last_progress_estimate_without_a_known_fault_time(tmp_path):
    """No injection, no monitor: the last iteration's end comes from the newest event that
    names an iteration plus the log's times (save started at 29.5 for 10; 11 and 12 at 200 ms)."""
    events = [launch(0, 1, [0, 1], 1, 1, 2), save("periodic_save", 30, 10, 0.25, 0.5),
              event("failure", 40, attempt=1, iteration=12, cause="exit", gpus=[1],
                    exit_codes={"1": -9}),
              plan(41, [0, 1], 1, 1, 2), event("gave_up", 41.5, reason="no GPUs left")]
    logs = {1: [iteration_line(n, 50, 200) for n in range(1, 13)]}
    run_dir = write_run(tmp_path / "run", events, logs)
    result = run_report(run_dir, "--json-out", tmp_path / "out.json")
    assert result.exit_code == 0, result.output
    failure = json.loads((tmp_path / "out.json").read_text())["failures"][0]
    assert failure["detection_latency"] == {"seconds": pytest.approx(40 - 29.9),
                                            "since": "last progress (estimated)"}
    assert failure["lead_time"] is None and failure["lost_iterations"] == 2
    assert failure["rto_seconds"] is None and failure["outcome"] == "gave up: no GPUs left"
    # the fault came no earlier than the last progress: detection is measured from there
    assert failure["fault_to_failure_seconds"] == pytest.approx(40 - 29.9)
    assert failure["rto_from_fault_seconds"] is None  # not resumed
    assert "RTO                unknown: gave up: no GPUs left" in result.stdout
    assert "  last checkpoint    iteration 10 (periodic, disk, durable at +30.00 s)" in result.stdout
    assert not (run_dir / "report.json").exists()


def test_a_checkpoint_the_run_started_from_bounds_what_a_failure_before_any_save_lost(tmp_path):
    """The run resumed an earlier job's checkpoint of 100 (no save event of it here), failed
    at 105 before saving, and gave up: 5 iterations are lost, not 105."""
    events = [launch(0, 1, [0, 1], 1, 1, 2),
              event("checkpoint_loaded", 5, iteration=100, path="ckpt/iter_0000100", tier="disk",
                    seconds=0.5),
              event("failure", 40, attempt=1, iteration=105, cause="exit", gpus=[1], exit_codes={}),
              event("gave_up", 41, reason="no restarts left")]
    logs = {1: [loaded_line(100, 0.5, 4096), *(iteration_line(n, 200, 100) for n in range(101, 106))]}
    result = run_report(write_run(tmp_path / "run", events, logs))
    assert result.exit_code == 0, result.output
    (failure,) = json.loads((tmp_path / "run" / "report.json").read_text())["failures"]
    assert (failure["lost_iterations"], failure["lost_seconds"]) == (5, pytest.approx(0.5))
    assert failure["checkpoint"]["iteration"] == 100
    assert "  last checkpoint    iteration 100 (loaded, disk, durable at +5.00 s)" in result.stdout


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_fresh_start_logged_every_5_iterations_knows_the_time_a_failure_lost(tmp_path, nodes):
    """No checkpoint, --log-interval 5: the line at 5 is the mean of iterations 1-5, timed
    from the start as after a load, but only a load anchored it, so 1-4 had no time and the
    failure at 10 lost 'unknown' seconds. Across nodes the start line is rank 0's and the
    iteration lines the last stage's, on another node."""
    events = [launch(0, 1, [0, 1], 1, 1, 2),
              event("failure", 20, attempt=1, iteration=10, cause="exit", gpus=[1], exit_codes={}),
              event("gave_up", 21, reason="no restarts left")]
    start, lines = "training from iteration 0 to 30", [iteration_line(n, 30, 1000) for n in (5, 10)]
    run_dir = write_run(tmp_path / "run", events, {1: [start, *lines] if nodes == 1 else lines})
    if nodes == 2:  # rank 0's node: its log holds the start line alone
        (run_dir / "logs").rename(run_dir / "last_stage_logs")
        for node, text in ((0, start), (1, None)):
            logs = run_dir / f"node_{node}" / "logs"
            logs.mkdir(parents=True)
            if text is None:
                (run_dir / "last_stage_logs").rename(logs)
            else:
                (logs / "attempt_1.log").write_text(text + "\n")
    from ftmaster.report import _read_logs

    attempts = [(None, 1)] if nodes == 1 else [(0, 1), (1, 1)]
    assert _read_logs(run_dir, attempts).seconds_between(0, 10) == pytest.approx(10.0)
    if nodes == 1:
        assert run_report(run_dir).exit_code == 0
        (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
        assert (failure["lost_iterations"], failure["lost_seconds"]) == (10, pytest.approx(10.0))


def test_a_failure_before_the_attempts_first_iteration_is_detected_since_its_launch(tmp_path):
    """The supervisor records such a failure at the iteration the attempt resumes from, with
    before_first_iteration: the last progress is the launch, not unknown."""
    events = [launch(0, 1, [0, 1], 1, 1, 2), save("periodic_save", 30, 10, 0.25, 0.5),
              event("failure", 40, attempt=1, iteration=12, cause="exit", gpus=[1], exit_codes={}),
              plan(41, [0], 1, 1, 1), launch(42, 2, [0], 1, 1, 1),
              event("failure", 50, attempt=2, iteration=10, cause="exit", gpus=[0], exit_codes={},
                    before_first_iteration=True),
              event("gave_up", 50.5, reason="no GPUs left")]
    run_dir = write_run(tmp_path / "run", events, {1: [iteration_line(n, 50, 200) for n in range(1, 13)]})
    assert run_report(run_dir).exit_code == 0
    second = json.loads((run_dir / "report.json").read_text())["failures"][1]
    assert second["detection_latency"] == {"seconds": pytest.approx(8.0),
                                           "since": "last progress (estimated)"}
    assert second["lost_iterations"] == 0


def test_a_non_finite_loss_is_detected_since_training_recorded_it(tmp_path):
    """The trainer's nonfinite event is the fault's own time: detection is the supervisor's
    1 s after it, not an estimate from the last completed iteration (unknown here: the log
    has no times)."""
    events = [launch(0, 1, [0, 1], 1, 1, 2), save("periodic_save", 20, 10, 0.25, 0.5),
              event("nonfinite", 40, iteration=14, what="loss"),
              event("failure", 41, attempt=1, iteration=13, cause="nonfinite", gpus=[], exit_codes={}),
              plan(42, [0, 1], 1, 1, 2), launch(43, 2, [0, 1], 1, 1, 2),
              event("resumed", 52, attempt=2, iteration=11),
              event("nonfinite", 55, iteration=14, what="loss")]
    run_dir = write_run(tmp_path / "run", events, {})
    assert run_report(run_dir).exit_code == 0
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert failure["detection_latency"] == {"seconds": pytest.approx(1.0),
                                            "since": "nonfinite loss at iteration 14"}
    assert failure["rto_from_fault_seconds"] == pytest.approx(12.0)


def test_a_relaunch_that_started_from_scratch_lost_every_iteration(tmp_path):
    """The only checkpoint, in the memory tier, went with the failure; the relaunch loaded
    nothing and resumed at iteration 1: all 16 iterations are lost, as the metrics say, not
    the 2 after the checkpoint that was gone."""
    events = [launch(0, 1, [0, 1, 2], 1, 1, 3),
              {**save("periodic_save", 30, 14, 0.1, 0.2), "tier": "memory"},
              event("failure", 40, attempt=1, iteration=16, cause="device_lost", gpus=[1], exit_codes={}),
              plan(41, [0, 2], 1, 1, 2), launch(42, 2, [0, 2], 1, 1, 2),
              event("resumed", 50, attempt=2, iteration=1)]
    logs = {1: [iteration_line(n, 20, 100) for n in range(1, 17)], 2: [iteration_line(1, 20, 100)]}
    run_dir = write_run(tmp_path / "run", events, logs)
    assert run_report(run_dir).exit_code == 0
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert (failure["lost_iterations"], failure["lost_seconds"]) == (16, pytest.approx(1.6))


def test_an_older_runs_failure_before_any_iteration_lost_nothing_after_its_load(tmp_path):
    """Older supervisors recorded such a failure's iteration as null: its log, which loaded
    10 and trained nothing, says where its state was."""
    events = [launch(0, 1, [0, 1, 2], 1, 1, 3), save("periodic_save", 20, 10, 0.25, 0.5),
              event("failure", 30, attempt=1, iteration=12, cause="exit", gpus=[1], exit_codes={}),
              plan(31, [0, 2], 1, 1, 2), launch(32, 2, [0, 2], 1, 1, 2),
              event("failure", 40, attempt=2, iteration=None, cause="exit", gpus=[2], exit_codes={}),
              plan(41, [0], 1, 1, 1), launch(42, 3, [0], 1, 1, 1),
              event("resumed", 50, attempt=3, iteration=11)]
    logs = {1: [iteration_line(n, 20, 100) for n in range(1, 13)], 2: [loaded_line(10, 0.5, 4096)],
            3: [loaded_line(10, 0.5, 4096), iteration_line(11, 20, 100)]}
    run_dir = write_run(tmp_path / "run", events, logs)
    assert run_report(run_dir).exit_code == 0
    second = json.loads((run_dir / "report.json").read_text())["failures"][1]
    assert (second["iteration"], second["lost_iterations"]) == (10, 0)


def test_a_checkpoint_gone_before_a_relaunch_from_scratch_is_no_later_failures(tmp_path):
    """The relaunch after the memory checkpoint of 14 went with the failure trained from
    iteration 1 and failed at 5 before saving: those 5 are lost, and there is no checkpoint
    (the report said 14, and 0 lost)."""
    events = [launch(0, 1, [0, 1, 2], 1, 1, 3),
              {**save("periodic_save", 30, 14, 0.1, 0.2), "tier": "memory"},
              event("failure", 40, attempt=1, iteration=16, cause="device_lost", gpus=[1], exit_codes={}),
              plan(41, [0, 2], 1, 1, 2), launch(42, 2, [0, 2], 1, 1, 2),
              event("resumed", 50, attempt=2, iteration=1),
              event("failure", 60, attempt=2, iteration=5, cause="exit", gpus=[2], exit_codes={}),
              event("gave_up", 61, reason="restart budget spent")]
    run_dir = write_run(tmp_path / "run", events, {})
    assert run_report(run_dir).exit_code == 0
    second = json.loads((run_dir / "report.json").read_text())["failures"][1]
    assert (second["checkpoint"], second["lost_iterations"]) == (None, 5)
    # the relaunch's own save, recorded before the supervisor saw its first iteration, stays
    events.insert(5, {**save("periodic_save", 49, 1, 0.1, 0.2), "tier": "memory"})
    run_dir = write_run(tmp_path / "again", events, {})
    assert run_report(run_dir).exit_code == 0
    second = json.loads((run_dir / "report.json").read_text())["failures"][1]
    assert (second["checkpoint"]["iteration"], second["lost_iterations"]) == (1, 4)


def test_a_memory_checkpoint_before_a_failure_is_complete_not_durable(tmp_path):
    events = [launch(0, 1, [0, 1], 1, 1, 2),
              {**save("periodic_save", 30, 10, 0.25, 0.5), "tier": "memory"},
              event("failure", 40, attempt=1, iteration=12, cause="exit", gpus=[1]),
              event("gave_up", 41.5, reason="no GPUs left")]
    result = run_report(write_run(tmp_path / "run", events, {}))
    assert result.exit_code == 0, result.output
    assert "  last checkpoint    iteration 10 (periodic, memory, complete at +30.00 s)" in result.stdout


def test_a_run_without_failures_prints_its_timeline_and_says_so(tmp_path):
    events = [launch(0, 1, [0], 1, 1, 1), save("periodic_save", 10, 5, 0.1, 0.2),
              event("complete", 12, iteration=10)]
    run_dir = write_run(tmp_path / "run", events, {1: [iteration_line(n, 10, 50) for n in range(1, 11)]})
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert "no failures in this run" in result.stdout
    assert "periodic checkpoint of iteration 5 durable" in result.stdout
    report = json.loads((run_dir / "report.json").read_text())
    assert report["failures"] == [] and [r["event"] for r in report["timeline"]] == \
        ["launch", "periodic_save", "complete"]


@pytest.mark.parametrize("content, expected", [
    (None, "events.jsonl does not exist"),
    ("", "has no events"),
    ('{"event": "launch", "time": 1}\n{"event": "launch" "time": 2}\n{"event": "launch", "time": 3}\n',
     "line 2 is not a JSON object"),
    ('{"event": "launch", "time": "noon"}\n', "line 1 is not a JSON object"),
    ('{"event": "launch", "time": 1%s}\n' % ("0" * 400), "line 1 is not a JSON object"),
    ('[1, 2]\n', "line 1 is not a JSON object"),
    ("[" * 100_000 + "\n", "line 1 is not a JSON object"),  # nested past the parser's depth
    ('{"event": "launch", "time": 1}\n{"event": "failure", "time": 2, "gpus": 3}\n',
     'line 2: "gpus" of a failure event must be a list of integers, not 3'),
    ('{"event": "failure", "time": 2, "gpus": "13"}\n', 'must be a list of integers, not "13"'),
    ('{"event": "failure", "time": 2, "iteration": "16"}\n', '"iteration" of a failure event'),
    ('{"event": "risk_alert", "time": 2, "gpu": [1]}\n', '"gpu" of a risk_alert event'),
    ('{"event": "risk_alert", "time": 2, "reasons": "device_lost"}\n', "a list of strings"),
    ('{"event": "periodic_save", "time": 2, "started_at": "noon"}\n', "a finite number"),
    ('{"event": "emergency_save", "time": 2, "iteration": "3"}\n', '"iteration" of an emergency_save'),
    ('{"event": "startup", "time": 2, "phases": {}, "seconds": "1.5"}\n',
     '"seconds" of a startup event must be a finite number, not "1.5"'),
    ('{"event": "startup", "time": 2, "phases": {}, "seconds": 1%s}\n' % ("0" * 400),
     # a value quoted whole made a 400-character line
     '"seconds" of a startup event must be a finite number, not ' + "1" + "0" * 17 + "..." + "0" * 19 + '; fix'),
    ('{"event": "failure", "time": 2, "gpus": "%s"}\n' % ("x" * 400),
     'must be a list of integers, not "' + "x" * 17 + "..." + "x" * 18 + '"; fix'),
    ('{"event": "launch", "time": 1, "attempt": 1, "gpus": 5}\n',
     '"gpus" of a launch event must be a list of integers, not 5'),
    ('{"event": "launch", "time": 1, "attempt": 1, "gpus": "01"}\n', 'not "01"'),
    ('{"event": "straggler", "time": 2, "gpu": "1", "slowdown": 2}\n', '"gpu" of a straggler event'),
    ('{"event": "replica_merge", "time": 2, "iteration": 5, "seconds": "0.5"}\n',
     '"seconds" of a replica_merge event must be a finite number, not "0.5"'),
    ('{"event": "replica_merge", "time": 2, "iteration": 5, "merge_seconds": null}\n',
     '"merge_seconds" of a replica_merge event'),
    # each a traceback before (a field the report computes with that it did not check)
    ('{"event": "replica_dump", "time": 2, "ranks": 5}\n',
     '"ranks" of a replica_dump event must be a list of integers, not 5'),
    ('{"event": "replica_gathered", "time": 2, "bytes": 1%s}\n' % ("0" * 309), "a finite number"),
    ('{"event": "complete", "time": 2, "iteration": 1%s}\n' % ("0" * 309), "an integer or null"),
    ('{"event": "failure", "time": 2, "gpus": [1], "node": null}\n',
     '"node" of a failure event must be an integer, not null'),
    ('{"event": "fresh_start", "time": 2, "folders": [1]}\n', "a list of strings, not [1]"),
    # a traceback at the first print (UnicodeEncodeError), and in the page's matplotlib
    ('{"event": "gave_up", "time": 1, "reason": "\\ud800"}\n', "holds a lone surrogate escape"),
    ('{"event": "launch", "time": 1, "attempt": 1, "tensor_model_parallel_size": "$\\\\frac{$"}\n',
     '"tensor_model_parallel_size" of a launch event must be an integer or null'),
])
def test_bad_events_are_one_line_on_stderr_and_non_zero(tmp_path, content, expected):
    if content is not None:
        (tmp_path / "events.jsonl").write_text(content)
    result = run_report(tmp_path)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_a_monitor_alone_that_raised_no_alert_is_said_in_one_line(tmp_path):
    """It wrote its samples and no events.jsonl: 'give a run directory written by ftmaster
    launch', where the README promised it would read as one of ftmaster monitor alone."""
    (tmp_path / "gpu_metrics.csv").write_text("timestamp,gpu_id\n")
    result = run_report(tmp_path)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "events.jsonl does not exist: ftmaster monitor alone ran here and raised no alert " \
           "(ftmaster analyze" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_torn_last_line_is_left_out_and_said_in_one_line(tmp_path):
    """A live run (or one killed mid-write) leaves a last line without its newline: the
    report is of everything before it, not an error."""
    run_dir = two_failures(tmp_path / "run")
    assert run_report(run_dir).exit_code == 0
    whole = (run_dir / "report.json").read_text()
    events = run_dir / "events.jsonl"
    with events.open("a") as handle:
        handle.write('{"event": "failure", "time": 170, "attempt": 3, "itera')
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert result.stderr == (f"warning: {events}: its last line is incomplete (no newline: still "
                             "being written, or cut short), skipped\n")
    assert (run_dir / "report.json").read_text() == whole


def test_a_line_a_full_disk_cut_short_is_left_out_and_said_in_one_line(tmp_path):
    """append_event, out of room, writes what fits of a line; the next event, once there is
    room, ends it with a newline first, so that it loses only itself."""
    run_dir = two_failures(tmp_path / "run")
    assert run_report(run_dir).exit_code == 0
    whole = (run_dir / "report.json").read_text()
    events = run_dir / "events.jsonl"
    lines = events.read_text().splitlines(keepends=True)
    events.write_text("".join(lines[:5]) + '{"event": "fault_injected", "time": 1780000069.5, "ki\n'
                      + "".join(lines[5:11]) + '{"event": "save_deferred", "time": 17800\n'
                      + "".join(lines[11:]))
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert result.stderr == (f"warning: {events} lines 6, 13: cut short (a write that failed, e.g. "
                             "on a full disk), skipped\n")
    assert (run_dir / "report.json").read_text() == whole


@pytest.mark.timeout(30)
def test_a_fifo_for_the_events_file_is_one_line_not_a_wait_for_a_writer(tmp_path):
    run_dir = two_failures(tmp_path / "run")
    events = run_dir / "events.jsonl"
    events.unlink()
    os.mkfifo(events)
    result = run_report(run_dir)
    assert result.exit_code == 1
    assert result.stderr == f"Error: cannot read {events}: not a regular file (a FIFO, socket or device)\n"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fifo_name, message", [
    ("out.json", "cannot write {fifo}"),
    ("run/report.html", "cannot make the incident page: {fifo}")])
def test_a_fifo_in_an_outputs_place_is_one_line_not_a_wait_for_a_reader(tmp_path, fifo_name, message):
    run_dir = two_failures(tmp_path / "run")
    fifo = tmp_path / fifo_name
    os.mkfifo(fifo)
    result = run_report(run_dir, "--json-out", tmp_path / "out.json")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == (f"Error: {message.format(fifo=fifo)}: a FIFO "
                                              "nobody reads (or a socket)")


def test_a_full_disk_under_the_incident_page_names_the_page(tmp_path):
    """A write that fails names no file: the line read "cannot make the incident page: None"."""
    run_dir = two_failures(tmp_path / "run")
    (run_dir / "report.html").symlink_to("/dev/full")  # every write: ENOSPC
    result = run_report(run_dir)
    assert result.exit_code == 1
    assert result.stderr == (f"Error: cannot make the incident page: {run_dir / 'report.html'}: "
                             "No space left on device\n")


def test_a_run_directory_that_takes_no_files_still_gets_its_report_read(tmp_path):
    """A run directory on a read-only mount: the default JSON failed without a word of what
    to do, and with --json-out elsewhere the incident page failed before any text, so no
    report could be had at all. (/dev/full stands for the mount: every write fails.)"""
    run_dir = two_failures(tmp_path / "run")
    (run_dir / "report.json").symlink_to("/dev/full")
    result = run_report(run_dir)
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == (f"Error: cannot write {run_dir / 'report.json'}: No space left on "
                             "device (--json-out FILE writes it elsewhere)\n")
    (run_dir / "report.html").symlink_to("/dev/full")
    result = run_report(run_dir, "--json-out", tmp_path / "out.json")
    assert result.exit_code == 1
    assert "failure 2:" in result.stdout and json.loads((tmp_path / "out.json").read_text())
    assert result.stderr == (f"Error: cannot make the incident page: {run_dir / 'report.html'}: "
                             "No space left on device\n")


def test_a_page_rewritten_is_never_seen_torn_and_a_failed_rewrite_leaves_the_one_before(tmp_path):
    """The page and the JSON were truncated and written in place: a browser refreshing it saw
    it empty or cut short, and a full disk mid-write replaced the last good page by a torn
    one. A symbolic link to the page stays one."""
    from ftmaster import runfiles

    page = tmp_path / "report.html"
    page.write_text("the page before")
    with pytest.raises(OSError), runfiles.open_output(page) as handle:
        handle.write("half a pa")
        assert page.read_text() == "the page before"
        raise OSError(28, "No space left on device")
    assert page.read_text() == "the page before" and os.listdir(tmp_path) == ["report.html"]
    (tmp_path / "linked.html").symlink_to(page)
    page.chmod(0o640)
    with runfiles.open_output(tmp_path / "linked.html", errors="surrogateescape") as handle:
        handle.write("the new page")
    assert (tmp_path / "linked.html").is_symlink() and page.read_text() == "the new page"
    assert page.stat().st_mode & 0o777 == 0o640  # its mode kept; a new one's by the umask:
    before = os.umask(0o077)
    try:
        with runfiles.open_output(tmp_path / "private.json") as handle:
            handle.write("{}")
    finally:
        os.umask(before)
    assert (tmp_path / "private.json").stat().st_mode & 0o777 == 0o600


@pytest.mark.timeout(30)
def test_the_json_goes_to_dev_null_or_a_fifo_someone_reads(tmp_path):
    """What a shell user writes to: /dev/null, and a pipe (``--json-out /dev/stdout | jq``)."""
    run_dir = two_failures(tmp_path / "run")
    assert run_report(run_dir, "--json-out", "/dev/null").exit_code == 0
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the reader is there first
    try:
        result = run_report(run_dir, "--json-out", fifo)  # a few KB: within the pipe's buffer
        assert result.exit_code == 0, result.output
        assert json.loads(os.read(reader, 1 << 16))["failures"]
    finally:
        os.close(reader)


@pytest.mark.timeout(60)
def test_json_out_to_stdout_leaves_the_pipe_to_the_json(tmp_path):
    """``--json-out /dev/stdout | jq``, as the README shows it: the text report went to
    stdout after the JSON, and jq (or json.load) met it as extra data. With the JSON on stdout
    the text goes to stderr."""
    run_dir = two_failures(tmp_path / "run")
    done = subprocess.run([sys.executable, "-m", "ftmaster.cli", "report", str(run_dir),
                           "--json-out", "/dev/stdout"], capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["failures"]
    assert "failure 1:" in done.stderr and "wrote /dev/stdout" in done.stderr


@pytest.mark.timeout(60)
def test_json_out_to_dev_null_with_stdout_there_too_prints_nothing_on_stderr(tmp_path):
    """``--json-out /dev/null >/dev/null`` (the incident page alone, from cron or a batch
    script): /dev/null is where stdout goes, so the text report went to stderr, into the
    terminal or the job's error log. No reader shares a sink with the JSON."""
    run_dir = two_failures(tmp_path / "run")
    done = subprocess.run([sys.executable, "-m", "ftmaster.cli", "report", str(run_dir),
                           "--json-out", os.devnull], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert "failure 1:" not in done.stderr and "wrote" not in done.stderr


def test_a_torn_last_log_line_is_not_read(tmp_path):
    """A log cut short mid-line (a full disk, a killed rank) holds a figure cut short: "(ms): 2"
    of "200.0" is no 2 ms iteration, but an unknown one, as if the line were not there."""
    run_dir = two_failures(tmp_path / "run")
    log = run_dir / "logs" / "attempt_2.log"
    whole = log.read_text().splitlines(keepends=True)
    log.write_text("".join(whole[:-1]))
    assert run_report(run_dir).exit_code == 0
    without = (run_dir / "report.json").read_text()
    log.write_text("".join(whole[:-1]) + whole[-1].split("(ms): ")[0] + "(ms): 2")
    assert run_report(run_dir).exit_code == 0
    assert (run_dir / "report.json").read_text() == without


def test_a_run_dir_whose_name_is_not_utf8_gets_its_report_and_page(tmp_path):
    """A folder named on a machine with another locale (Latin-1 "été")."""
    run_dir = two_failures(tmp_path / os.fsdecode(b"\xe9t\xe9"))
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert os.fsencode(run_dir) in (run_dir / "report.html").read_bytes()


def test_a_garbled_iteration_line_is_not_read(tmp_path):
    """Ranks writing one log at once can garble a figure ("1.2.3"): such a line is skipped,
    as an unknown time, not read as a number nor a traceback."""
    events = [launch(0, 1, [0], 1, 1, 1), event("complete", 12, iteration=3)]
    garbled = iteration_line(2, 3, 50).replace("50.0", "5.0.0")
    assert garbled != iteration_line(2, 3, 50)
    run_dir = write_run(tmp_path / "run", events,
                        {1: [iteration_line(1, 3, 50), garbled, iteration_line(3, 3, 50)]})
    for command in (["report", run_dir], ["goodput", "--run-dir", run_dir, "--runs", "0", "--json"]):
        result = CliRunner().invoke(main, list(map(str, command)))
        assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["inputs"]["iteration_s"] == 0.05


@pytest.mark.parametrize("own, problem", [
    ("events.jsonl", "is one of the run's own files"),
    ("report.html", "is one of the run's own files"),
    ("heartbeat.json", "is one of the run's own files"),
    ("ftmaster.lock", "is one of the run's own files"),
    ("logs/attempt_1.log", "is in {run_dir}/logs, a folder the run writes or reads"),
    ("flags/save_now.flag", "is in {run_dir}/flags, a folder the run writes or reads"),
])
def test_the_json_is_never_written_over_the_runs_own_files(tmp_path, own, problem):
    """Nor over the incident page written beside it, nor what a live run reads (any
    ``save_now`` flag is a save request)."""
    run_dir = two_failures(tmp_path / "run")
    (run_dir / own).parent.mkdir(exist_ok=True)
    if not (run_dir / own).exists():
        (run_dir / own).write_text("{}\n")
    before = (run_dir / own).read_bytes()
    result = run_report(run_dir, "--json-out", run_dir / own)
    assert result.exit_code == 1
    assert result.stderr.strip() == (f"Error: --json-out {run_dir / own} "
                                     f"{problem.format(run_dir=run_dir)}: give another path")
    assert (run_dir / own).read_bytes() == before


@pytest.mark.parametrize("name", ["incident-2.json", "analysis/report.json"])
def test_the_json_may_go_into_the_run_dir_under_a_name_of_its_own(tmp_path, name):
    """In a folder of its own too: that is no file of the run's."""
    run_dir = two_failures(tmp_path / "run")
    (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
    result = run_report(run_dir, "--json-out", run_dir / name)
    assert result.exit_code == 0, result.output
    assert json.loads((run_dir / name).read_text())["failures"]


def test_a_missing_run_dir_is_one_line(tmp_path):
    result = run_report(tmp_path / "nowhere")
    assert result.exit_code == 1
    assert result.stderr.strip() == f"Error: {tmp_path / 'nowhere'} is not a directory: give an " \
                                    "ftmaster run directory"


def test_a_supervisor_started_again_on_the_run_reports_its_resume(tmp_path):
    """ftmaster SIGKILLed after iteration 14 and started again 60 s later: the new one records
    the lost attempt and relaunches at once (no plan). The report says where it restarted from
    and its RTO, and measures detection from the last progress."""
    events = [launch(0, 1, [0, 1], 1, 1, 2), save("periodic_save", 30, 10, 0.25, 0.5),
              event("failure", 100, attempt=1, iteration=14, cause="supervisor_lost", gpus=[],
                    exit_codes={}),
              launch(100.5, 2, [0, 1], 1, 1, 2),
              event("checkpoint_loaded", 108, iteration=10, path="ckpt/iter_0000010", seconds=0.2),
              event("resumed", 109, attempt=2, iteration=11), event("complete", 120, iteration=20)]
    logs = {1: [iteration_line(n, 20, 200) for n in range(1, 15)],
            2: [loaded_line(10, 0.2, 4096), *(iteration_line(n, 20, 500) for n in range(11, 21))]}
    run_dir = write_run(tmp_path / "run", events, logs)
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert (failure["restarted_from_iteration"], failure["outcome"]) == (10, "resumed")
    assert failure["rto_seconds"] == pytest.approx(9.0)
    assert failure["phases"]["failure_to_plan"] == pytest.approx(0.5)  # to the launch: no plan
    assert failure["detection_latency"]["since"] == "last progress (estimated)"
    progress = 29.5 + 4 * 0.2  # the save of 10 started at 29.5, then 11..14 at 200 ms
    assert failure["fault_to_failure_seconds"] == pytest.approx(100 - progress)
    assert failure["rto_from_fault_seconds"] == pytest.approx(109 - progress)
    assert "restarted from     iteration 10 (load 0.200 s" in result.stdout
    assert "failure 1: attempt 1, supervisor_lost at +100.00 s" in result.stdout  # no "on no GPU"


@pytest.mark.parametrize("end", ["gave_up", "stopped"])
def test_a_failure_that_ended_the_run_has_no_rto_when_ftmaster_is_started_again(tmp_path, end):
    """The operator's restart minutes later is a new start, not the failure's recovery."""
    events = [launch(0, 1, [0, 1, 2], 1, 1, 3), save("periodic_save", 20, 10, 0.25, 0.5),
              event("failure", 30, attempt=1, iteration=12, cause="exit", gpus=[1], exit_codes={}),
              plan(31, [0, 2], 1, 1, 2), launch(32, 2, [0, 2], 1, 1, 2),
              event(end, 33, reason="the training arguments need fixing", signal="SIGINT"),
              launch(300, 3, [0, 1, 2], 1, 1, 3), event("resumed", 310, attempt=3, iteration=11),
              event("complete", 320, iteration=20)]
    run_dir = write_run(tmp_path / "run", events, {1: [iteration_line(n, 20, 100) for n in range(1, 13)]})
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert failure["rto_seconds"] is None and failure["outcome"] != "resumed"
    assert failure["new_layout"]["gpus"] == [0, 2]  # the relaunch it planned, not attempt 3's
    assert "RTO                unknown: " in result.stdout


def test_a_give_up_names_what_training_said_of_its_last_failure(tmp_path):
    said = "error: --save ckpt already holds checkpoints of another run: pass --load ckpt"
    events = [launch(0, 1, [0, 1], 1, 1, 2),
              event("failure", 3, attempt=1, iteration=None, cause="usage", gpus=[], exit_codes={}),
              event("gave_up", 3.5, reason="the training arguments, or the checkpoint under them, "
                    "need fixing (above)", requeue=False, root_cause=said)]
    run_dir = write_run(tmp_path / "run", events, {1: [said]})
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert failure["root_cause"] == said
    assert ("RTO                unknown: gave up: the training arguments, or the checkpoint under "
            "them, need fixing\n  root cause, from training's output:\n    " + said) in result.stdout


def test_replica_recovery_counts_every_nodes_dump_and_tells_the_merge_from_its_start(tmp_path):
    events = [launch(0, 1, [0, 1], 1, 1, 2),
              event("failure", 30, attempt=1, iteration=16, cause="device_lost", gpus=[1], exit_codes={}),
              event("replica_dump", 30.1, ranks=[0], seconds=0.052, bytes=1_500_000, refused={}),
              event("replica_dump", 30.2, ranks=[2, 3], seconds=0.085, bytes=2_980_000, refused={}),
              event("replica_gathered", 31, from_node=1, bytes=2_980_000, seconds=0.022),
              event("replica_merge", 33, iteration=16, shards=3, seconds=1.9806, merge_seconds=0.0077,
                    warm=True, path="m/iter_0000016", bytes=4_480_000),
              plan(34, [0], 1, 1, 1), launch(35, 2, [0], 1, 1, 1),
              event("resumed", 40, attempt=2, iteration=17)]
    run_dir = write_run(tmp_path / "run", events, {1: [], 2: [loaded_line(16, 0.1, 4096)]})
    result = run_report(run_dir)
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    replica = failure["replica"]
    assert (replica["ranks"], replica["bytes"], replica["dump_seconds"]) == ([0, 2, 3], 4_480_000, 0.085)
    assert (replica["merge_seconds"], replica["merge_wait_seconds"]) == (0.0077, 1.9806)
    assert ("replica recovery   iteration 16 from the survivors: dump 0.085 s (3 rank(s), 4.5 MB), "
            "gathered 3.0 MB from the other nodes in 0.022 s, merge 0.008 s (1.981 s with starting "
            "its process)") in result.stdout


def test_a_lost_rendezvous_store_is_the_runs_end(tmp_path):
    events = [launch(0, 1, [0, 1], 1, 1, 2),
              event("store_lost", 30, reason="connection refused by 10.0.0.1:29400")]
    run_dir = write_run(tmp_path / "run", events, {1: []})
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert "store_lost: the job's rendezvous store is gone (connection refused by " \
           "10.0.0.1:29400): requeue the job (exit status 75)" in result.stdout


def test_a_load_only_the_events_tell_is_the_restart_point(tmp_path):
    """One node looked at alone: the "loaded checkpoint" line is in rank 0's node's log."""
    events = [launch(0, 1, [0, 1], 1, 1, 2), save("periodic_save", 20, 10, 0.25, 0.5),
              event("failure", 30, attempt=1, iteration=12, cause="device_lost", gpus=[1], exit_codes={}),
              plan(31, [0], 1, 1, 1), launch(32, 2, [0], 1, 1, 1),
              event("checkpoint_loaded", 35, iteration=10, path="ckpt/iter_0000010", seconds=0.5,
                    bytes=4096), event("resumed", 37, attempt=2, iteration=11)]
    run_dir = write_run(tmp_path / "run", events, {1: [iteration_line(n, 20, 100) for n in range(1, 13)],
                                                    2: []})
    result = run_report(run_dir)
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert (failure["restarted_from_iteration"], failure["load_seconds"], failure["load_bytes"],
            failure["lost_iterations"]) == (10, 0.5, 4096, 2)
    assert "restarted from     iteration 10 (load 0.500 s, 4096 bytes)" in result.stdout


def test_a_failure_whose_ftmaster_was_lost_before_resuming_has_no_rto(tmp_path):
    """The successor started hours later records the lost attempt: that wait is the operator's,
    no part of the first failure's recovery."""
    events = [launch(0, 1, [0, 1, 2], 1, 1, 3), save("periodic_save", 20, 10, 0.25, 0.5),
              event("failure", 100, attempt=1, iteration=12, cause="exit", gpus=[1], exit_codes={}),
              plan(101, [0, 2], 1, 1, 2), launch(102, 2, [0, 2], 1, 1, 2),
              event("failure", 10000, attempt=2, iteration=None, cause="supervisor_lost", gpus=[],
                    exit_codes={}),
              launch(10001, 3, [0, 2], 1, 1, 2), event("resumed", 10010, attempt=3, iteration=11)]
    run_dir = write_run(tmp_path / "run", events, {1: [iteration_line(n, 20, 100) for n in range(1, 13)]})
    assert run_report(run_dir).exit_code == 0
    first, lost = json.loads((run_dir / "report.json").read_text())["failures"]
    assert first["rto_seconds"] is None
    assert first["outcome"] == "the ftmaster recovering it was lost before resuming"
    assert lost["rto_seconds"] == 10.0


def test_a_failure_whose_relaunch_failed_too_recovers_at_the_resume_that_ended_both(tmp_path):
    events = [launch(0, 1, [0, 1, 2], 1, 1, 3), save("periodic_save", 20, 10, 0.25, 0.5),
              event("failure", 30, attempt=1, iteration=12, cause="device_lost", gpus=[1], exit_codes={}),
              plan(31, [0, 2], 1, 1, 2), launch(32, 2, [0, 2], 1, 1, 2),
              event("failure", 34, attempt=2, iteration=None, cause="device_lost", gpus=[2],
                    exit_codes={}),
              plan(35, [0], 1, 1, 1), launch(36, 3, [0], 1, 1, 1),
              event("resumed", 40, attempt=3, iteration=11), event("complete", 50, iteration=20)]
    run_dir = write_run(tmp_path / "run", events, {1: [iteration_line(n, 20, 100) for n in range(1, 13)]})
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    first, second = json.loads((run_dir / "report.json").read_text())["failures"]
    assert (first["outcome"], first["rto_seconds"], first["later_failures"]) == ("resumed", 10.0, 1)
    assert (second["outcome"], second["rto_seconds"], second["later_failures"]) == ("resumed", 6.0, 0)
    assert "RTO                10.000 s to iteration 11 (attempt 3), through 1 more failure(s) " \
           "of its relaunch" in result.stdout


def test_a_lost_supervisors_unknown_iteration_is_read_from_the_attempts_log(tmp_path):
    events = [launch(0, 1, [0, 1], 1, 1, 2), save("periodic_save", 30, 10, 0.25, 0.5),
              event("failure", 100, attempt=1, iteration=None, cause="supervisor_lost", gpus=[],
                    exit_codes={}),
              launch(100.5, 2, [0, 1], 1, 1, 2), event("resumed", 109, attempt=2, iteration=11)]
    logs = {1: [iteration_line(n, 20, 200) for n in range(1, 15)], 2: [loaded_line(10, 0.2, 4096)]}
    run_dir = write_run(tmp_path / "run", events, logs)
    assert run_report(run_dir).exit_code == 0
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert (failure["iteration"], failure["lost_iterations"]) == (14, 4)


@pytest.mark.parametrize("kind, alert_reasons", [
    ("wedge", ["device_lost", "wedged"]),  # the alert came 3.85 s after the wedge
    ("xid", ["xid_79"]),
])
def test_detection_runs_from_the_injection_whatever_the_fault(tmp_path, kind, alert_reasons):
    events = [launch(0, 1, [0, 1], 1, 1, 2),
              event("fault_injected", 50, kind=kind, gpu=1, spec=f"{kind}:gpu=1,at=iter:5", iteration=5),
              alert(53.85, 1, alert_reasons),
              event("failure", 53.9, attempt=1, iteration=5, cause="device_lost", gpus=[1], exit_codes={}),
              plan(54, [0], 1, 1, 1), launch(54.5, 2, [0], 1, 1, 1),
              event("resumed", 64, attempt=2, iteration=1), event("complete", 70, iteration=5)]
    logs = {1: [iteration_line(n, 5, 200) for n in range(1, 6)], 2: [iteration_line(1, 5, 300)]}
    run_dir = write_run(tmp_path / "run", events, logs)
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert failure["detection_latency"] == {"seconds": pytest.approx(3.9),
                                            "since": f"fault_injected {kind} on GPU 1"}
    assert failure["rto_from_fault_seconds"] == pytest.approx(14.0)
    assert "RTO from fault     14.000 s (detection: fault to failure 3.900 s" in result.stdout


def test_an_alert_that_shows_the_fault_itself_is_its_earliest_evidence(tmp_path):
    """No injection (a real XID): detection runs from the XID's sample, not the last progress."""
    events = [launch(0, 1, [0, 1], 1, 1, 2), alert(51, 1, ["xid_79"], sample_at=50.5),
              event("failure", 52, attempt=1, iteration=5, cause="exit", gpus=[1], exit_codes={"1": 1})]
    run_dir = write_run(tmp_path / "run", events, {1: [iteration_line(n, 5, 200) for n in range(1, 6)]})
    assert run_report(run_dir).exit_code == 0
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert failure["detection_latency"] == {"seconds": pytest.approx(1.5), "since": "monitor: GPU 1 xid_79"}


@pytest.mark.parametrize("warning", ["xid_92", "xid_63", "xid_154"])
def test_a_warning_xid_before_the_gpus_loss_is_the_lead_not_the_fault(tmp_path, warning):
    """Real hardware: an XID 92 alert (the monitor asks for a save), then the GPU is lost. The
    XID was taken for the fault: 'no alert before the fault', and detection and the RTO from
    fault ran over the whole lead."""
    events = [launch(0, 1, [0, 1], 1, 1, 2), alert(13, 1, [warning]),
              alert(16.4, 1, ["device_lost"]),
              event("failure", 16.5, attempt=1, iteration=5, cause="device_lost", gpus=[1],
                    exit_codes={})]
    run_dir = write_run(tmp_path / "run", events, {1: [iteration_line(n, 5, 200) for n in range(1, 6)]})
    assert run_report(run_dir).exit_code == 0
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert failure["detection_latency"] == {"seconds": pytest.approx(0.1),
                                            "since": "monitor: GPU 1 device_lost"}
    assert failure["lead_time"]["seconds"] == pytest.approx(3.4)


def test_a_fault_injected_after_a_failure_is_not_its_cause(tmp_path):
    """A crash with no injection, then an injected fault on the same GPU in the relaunch: the
    first failure's window runs on to the second, and its detection came out at -80 s."""
    events = [launch(0, 1, [0, 1], 1, 1, 2), event("resumed", 5, attempt=1, iteration=1),
              event("failure", 20, attempt=1, iteration=15, cause="exit", gpus=[0],
                    exit_codes={"0": 1}),
              plan(21, [0, 1], 1, 1, 2), launch(22, 2, [0, 1], 1, 1, 2),
              event("resumed", 30, attempt=2, iteration=1),
              event("fault_injected", 100, kind="fail", gpu=0, spec="fail:gpu=0,at=100s"),
              event("failure", 101, attempt=2, iteration=60, cause="exit", gpus=[0],
                    exit_codes={"0": -9}),
              event("gave_up", 102, reason="no GPUs left")]
    logs = {1: [iteration_line(n, 100, 1000) for n in range(1, 16)],
            2: [iteration_line(n, 100, 1000) for n in range(1, 61)]}
    run_dir = write_run(tmp_path / "run", events, logs)
    assert run_report(run_dir).exit_code == 0
    first, second = json.loads((run_dir / "report.json").read_text())["failures"]
    assert first["detection_latency"]["since"] == "last progress (estimated)"
    assert 0 <= first["detection_latency"]["seconds"] <= 15
    assert second["detection_latency"] == {"seconds": pytest.approx(1.0),
                                           "since": "fault_injected fail on GPU 0"}


def test_a_replayed_traces_sample_time_is_not_the_faults(tmp_path):
    """With --monitor-backend replay:PATH the samples carry the recording's times: a
    device_lost sampled years before the run made detection 91918740 s."""
    events = [launch(0, 1, [0, 1], 1, 1, 2), event("resumed", 5, attempt=1, iteration=1),
              alert(51, 1, ["device_lost"], sample_at=-10 ** 8),
              event("failure", 52, attempt=1, iteration=5, cause="device_lost", gpus=[1],
                    exit_codes={})]
    run_dir = write_run(tmp_path / "run", events, {1: [iteration_line(n, 5, 200) for n in range(1, 6)]})
    assert run_report(run_dir).exit_code == 0
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert failure["detection_latency"] == {"seconds": pytest.approx(1.0),
                                            "since": "monitor: GPU 1 device_lost"}


def test_an_armed_injection_is_no_sign_of_progress(tmp_path):
    """A slow:...,at=iter:10 is armed at the launch, its event naming iteration 10: the last
    progress before a hang at iteration 12 was taken from the launch, not from iteration 12's
    end (0.1 + 2 iterations of the log, where training was really 1 s in)."""
    events = [launch(0, 1, [0, 1], 1, 1, 2),
              event("fault_injected", 0.1, kind="slow", gpu=1, iteration=10, armed=True,
                    spec="slow:gpu=1,factor=50,at=iter:10"),
              event("resumed", 5, attempt=1, iteration=1),
              event("failure", 100, attempt=1, iteration=12, cause="hang", gpus=[], exit_codes={})]
    logs = {1: [iteration_line(n, 100, 1000) for n in range(1, 13)]}
    run_dir = write_run(tmp_path / "run", events, logs)
    assert run_report(run_dir).exit_code == 0
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert failure["detection_latency"] == {"seconds": pytest.approx(100 - (5 + 11)),
                                            "since": "last progress (estimated)"}


def test_timeline_labels_say_what_happened(tmp_path):
    """A final save is no periodic one, a memory save is complete (not durable), a failure on
    no GPU names none, and a nan fault armed at a launch says so (it fires later)."""
    events = [launch(0, 1, [0, 1], 1, 1, 2),
              event("fault_injected", 0.01, kind="nan", gpu=1, spec="nan:gpu=1,at=iter:7",
                    iteration=7, armed=True),
              {**save("periodic_save", 5, 4, 0.1, 0.2), "tier": "memory"},
              event("failure", 8, attempt=1, iteration=7, cause="nonfinite", gpus=[], exit_codes={"1": 65}),
              plan(9, [0, 1], 1, 1, 2), launch(9.5, 2, [0, 1], 1, 1, 2),
              event("resumed", 15, attempt=2, iteration=5),
              {**save("periodic_save", 20, 10, 0.1, 0.2), "kind": "final"},
              event("complete", 21, iteration=10)]
    run_dir = write_run(tmp_path / "run", events, {1: [], 2: []})
    text = run_report(run_dir).stdout
    assert "fault_armed        nan armed on GPU 1 for iteration 7 (at the launch)" in text
    assert "periodic_save      periodic checkpoint of iteration 4 complete (memory)" in text
    assert "final_save         final checkpoint of iteration 10 durable (disk)" in text
    assert "failure            attempt 1 nonfinite, last iteration 7" in text
    assert "failure 1: attempt 1, nonfinite at +8.00 s" in text


def test_a_saves_time_or_size_that_is_none_reads_as_unknown():
    """Left to goodput to skip (it measures the other saves), they were printed as they came:
    'training blocked True s, -1 s to complete'."""
    from ftmaster.report import describe

    said = describe({"event": "periodic_save", "time": 1.0, "iteration": 4, "kind": "periodic",
                     "seconds": True, "persist_seconds": -1, "bytes": "3 MB"})
    assert said.endswith("training blocked ? s, ? s to complete, ? bytes"), said
    said = describe({"event": "periodic_save", "time": 1.0, "iteration": 4, "kind": "periodic",
                     "seconds": 0.25, "persist_seconds": 1.0, "bytes": 4096})
    assert said.endswith("training blocked 0.25 s, 1.0 s to complete, 4096 bytes"), said


@pytest.mark.parametrize("fields, text", [
    ({"exit_code": 0}, "signal 15 at iteration 41: training exited with status 0"),
    ({"exit_code": None}, "signal 15 at iteration 41: training was killed at the stop timeout"),
    ({"exit_code": None, "state": "waiting"},
     "signal 15 at iteration 41: nothing was training (waiting)"),
])
def test_a_stop_says_how_training_ended_not_an_exit_status_that_is_not_ftmasters(fields, text):
    from ftmaster.report import describe

    assert describe({"event": "stopped", "time": 1.0, "signal": 15, "iteration": 41, **fields}) == text


def test_a_straggler_is_drained_only_once_its_gpu_left_and_its_result_is_its_own():
    """GPU 1's drain was cut short by another failure; GPU 2's was done. The result measured
    after GPU 2 left is not GPU 1's, and GPU 1 was never drained."""
    from ftmaster.report import stragglers

    def straggler(at, gpu):
        return event("straggler", at, gpu=gpu, rank=gpu, iteration=14, since=8, slowdown=3.0,
                     step_s=1.3, healthy_step_s=0.5)

    events = [straggler(10, 1), event("drain", 11, gpu=1, reason="straggler", decided_by="d1"),
              event("failure", 12, attempt=1, iteration=15, cause="exit", gpus=[2]),
              straggler(30, 2), event("drain", 31, gpu=2, reason="straggler", decided_by="d2"),
              event("straggler_drained", 35, gpu=2),
              event("straggler_drain_result", 50, attempt=3, step_s=0.9, slowed_step_s=1.3)]
    first, second = stragglers(events)
    assert (first["action"], first["step_s_after_drain"]) == (
        "drain decided, not done (the attempt ended first)", None)
    assert (second["action"], second["step_s_after_drain"]) == ("drained", 0.9)


def test_a_drain_whose_next_attempt_failed_early_takes_no_later_drains_result():
    """GPU 1 was drained; attempt 2 failed before its step was measured, so GPU 1's drain has
    no result. GPU 2 was drained from attempt 3 and attempt 4 measured 0.9 s: the report gave
    that to GPU 1's drain too."""
    from ftmaster.report import stragglers

    def straggler(at, gpu):
        return event("straggler", at, gpu=gpu, rank=gpu, iteration=14, since=8, slowdown=3.0,
                     step_s=1.3, healthy_step_s=0.5)

    events = [straggler(10, 1), event("drain", 11, gpu=1, reason="straggler", decided_by="d1"),
              event("straggler_drained", 12, gpu=1),
              event("failure", 20, attempt=2, iteration=22, cause="exit", gpus=[3]),
              straggler(30, 2), event("drain", 31, gpu=2, reason="straggler", decided_by="d2"),
              event("straggler_drained", 35, gpu=2),
              event("straggler_drain_result", 50, attempt=4, step_s=0.9, slowed_step_s=1.3)]
    first, second = stragglers(events)
    assert (first["action"], first["step_s_after_drain"]) == ("drained", None)
    assert (second["action"], second["step_s_after_drain"]) == ("drained", 0.9)


def test_a_gpu_named_again_is_judged_on_what_followed_each_naming():
    """GPU 1 was named, kept by the cost model, fast again, then named again and drained: the
    first naming was kept, not drained (it took the later naming's drain before), and a
    naming with a slow replica mate says so."""
    from ftmaster.report import straggler_text, stragglers

    def straggler(at, **fields):
        return event("straggler", at, gpu=1, rank=1, iteration=14, since=8, slowdown=2.0,
                     step_s=1.3, healthy_step_s=0.5, **fields)

    events = [straggler(10, slow_mates=[0]), event("straggler_kept", 11, gpu=1, reason="k1"),
              straggler(40), event("drain", 41, gpu=1, reason="straggler", decided_by="d2"),
              event("straggler_drained", 45, gpu=1)]
    first, second = stragglers(events)
    assert (first["action"], first["decided_by"]) == ("kept", "k1")
    assert (second["action"], second["decided_by"]) == ("drained", "d2")
    assert "(found at 14; rank 0 of its model replica slow too, either may hold the other up)" \
        in straggler_text(first)
    assert "replica" not in straggler_text(second)


def test_a_straggler_kept_for_the_window_then_weighed_is_reported_by_the_last_decision():
    """GPU 2, named 28 s after a drain, was kept for the 35 s window, then weighed once it was
    over and kept by the cost model: the report said only "weighed again once that is over",
    as if it never had been."""
    from ftmaster.report import stragglers

    window = "a straggler was drained less than 35 s ago; weighed again once that is over"
    weighed = "keeping GPU 2: the job runs 1.420 s/iteration with it; the cost model estimates"
    events = [event("straggler", 54, gpu=2, rank=1, iteration=36, since=30, slowdown=1.9,
                    step_s=1.28, healthy_step_s=0.87),
              event("straggler_kept", 54.1, gpu=2, reason=window),
              event("straggler_kept", 61.7, gpu=2, reason=weighed)]
    (kept,) = stragglers(events)
    assert (kept["action"], kept["decided_by"]) == ("kept", weighed)


def test_a_straggler_names_its_slow_replica_mates_by_gpu_as_the_console_does():
    """After GPU 1 was drained, attempt 2 ran ranks 0, 1, 2 on GPUs 0, 2, 3. The console said
    'GPU 2 of its model replica is slow too'; the report said 'rank 1', which reads as the
    drained GPU 1. An event from before slow_mate_gpus still names ranks."""
    from ftmaster.report import straggler_text, stragglers

    named = dict(gpu=0, rank=0, iteration=14, since=8, slowdown=1.5, step_s=1.3,
                 healthy_step_s=0.5, slow_mates=[1])
    (now,) = stragglers([event("straggler", 10, **named, slow_mate_gpus=[2])])
    (older,) = stragglers([event("straggler", 10, **named)])
    assert now["slow_mate_gpus"] == [2]
    assert "(found at 14; GPU 2 of its model replica slow too" in straggler_text(now)
    assert "(found at 14; rank 1 of its model replica slow too" in straggler_text(older)


def test_a_kept_straggler_names_its_gpu_and_an_unmeasured_step_says_so():
    """The timeline read 'GPU 0 is slower and weighed first' for GPU 1 kept, and 'the job ran
    1.765 s/iteration, None before'."""
    from ftmaster.report import describe

    assert describe(event("straggler_kept", 1, gpu=1, reason="GPU 0 is slower and weighed "
                          "first (one drain at a time)")) == \
        "keeping GPU 1: GPU 0 is slower and weighed first (one drain at a time)"
    line = "keeping GPU 1: the job runs 2.000 s/iteration with it"
    assert describe(event("straggler_kept", 1, gpu=1, reason=line)) == line
    text = describe(event("straggler", 1, gpu=1, rank=1, slowdown=2.0, compute_ms=20.0,
                          peers_ms=10.0, since=8, step_s=None, healthy_step_s=None))
    assert text.endswith("the job ran at a step not yet measured, not measured before")
    assert "None" not in text


def test_a_checkpoint_set_aside_by_a_resume_is_no_later_failures_last_checkpoint(tmp_path):
    """Iteration 20 failed its checksums, the relaunch resumed from 10 (20 set aside), and
    the relaunch failed at 15 before saving again: its last checkpoint is 10, and 5 iterations
    are lost; the report named the discarded 20 and said none were."""
    events = [launch(0, 1, [0, 1], 1, 1, 2),
              save("periodic_save", 5, 10, 0.2, 0.2), save("periodic_save", 9, 20, 0.1, 0.1),
              event("failure", 10, attempt=1, iteration=25, cause="device_lost", gpus=[1], exit_codes={}),
              plan(10.1, [0], 1, 1, 1), launch(10.2, 2, [0], 1, 1, 1),
              event("checkpoint_skipped", 13, iteration=20, path="ckpt/iter_0000020", reason="checksum"),
              event("checkpoint_loaded", 14, iteration=10, path="ckpt/iter_0000010", seconds=0.25),
              event("resumed", 14.5, attempt=2, iteration=11),
              event("failure", 15, attempt=2, iteration=15, cause="exit", gpus=[0], exit_codes={}),
              event("gave_up", 15.1, reason="restart budget spent")]
    run_dir = write_run(tmp_path / "run", events,
                        {1: [iteration_line(n, 40, 100) for n in range(1, 26)],
                         2: [loaded_line(10, 0.25, 4096), *(iteration_line(n, 40, 100) for n in range(11, 16))]})
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    second = json.loads((run_dir / "report.json").read_text())["failures"][1]
    assert second["checkpoint"]["iteration"] == 10
    assert second["lost_iterations"] == 5


def still_going(run_dir):
    """A run whose last event is a save: no end event (yet)."""
    return write_run(run_dir, [launch(0, 1, [0, 1], 1, 1, 2), save("periodic_save", 5, 10, 0.2, 0.5)],
                     {1: [iteration_line(n, 30, 100) for n in range(1, 11)]})


def test_an_end_before_a_requeued_ftmasters_launch_is_not_the_runs_outcome(tmp_path):
    """A preemption's stop, then a requeued ftmaster that resumed on the same run directory
    and was killed: the report said 'stopped: signal 15', the earlier ftmaster's end."""
    run_dir = write_run(tmp_path / "run", [
        launch(0, 1, [0, 1], 1, 1, 2), save("periodic_save", 10, 10, 0.5, 0.5),
        event("stopped", 20, signal=15, exit_code=0, iteration=14),
        launch(100, 2, [0, 1], 1, 1, 2),
        event("checkpoint_loaded", 105, iteration=10, path="/c", seconds=1.0, bytes=10),
        event("resumed", 106, attempt=2, iteration=11)],
        {1: [iteration_line(n, 30, 1000) for n in range(1, 15)],
         2: [loaded_line(10, 1, 10), iteration_line(11, 30, 1000)]})
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert json.loads((run_dir / "report.json").read_text())["outcome"].startswith(
        "no end event")


@pytest.mark.parametrize("held", [True, False])
def test_a_run_without_an_end_says_whether_its_ftmaster_lives(tmp_path, held):
    """It said "still running, or ftmaster itself was killed" either way, while the run
    directory's lock tells them apart: the kernel drops a killed holder's flock. (The pid is
    the test worker's, so it is no parameter: xdist's workers must collect the same ids.)"""
    from ftmaster.lock import RunDirLock

    outcome = (f"no end event: still running (pid {os.getpid()} on host {socket.gethostname()})"
               if held else
               "no end event: ftmaster was killed (no live holder of the run directory lock)")

    run_dir = still_going(tmp_path / "run")
    lock = RunDirLock(run_dir)
    lock.acquire()  # as the ftmaster of this run; released below, as at its SIGKILL
    if not held:
        lock.release()
    result = run_report(run_dir)
    lock.release()
    assert result.exit_code == 0, result.output
    assert f"outcome {outcome}\n" in result.output
    assert json.loads((run_dir / "report.json").read_text())["outcome"] == outcome
    assert html.escape(outcome) in (run_dir / "report.html").read_text()
    with RunDirLock(run_dir):  # the report left the lock free
        pass


def test_a_run_directory_without_its_lock_file_cannot_tell(tmp_path):
    run_dir = still_going(tmp_path / "run")  # copied without ftmaster.lock, say
    result = run_report(run_dir)
    assert "outcome no end event (still running, or ftmaster itself was killed)" in result.output


def test_a_checkpoint_removed_by_a_resume_reads_as_the_console_said_it():
    """The timeline read 'checkpoint_set_aside iteration=10 path=.../iter_0000015
    moved_to=None': the resumed iteration beside a newer folder, and Python's None, where the
    console had said the folder was removed and why."""
    from ftmaster.report import describe

    text = describe(event("checkpoint_set_aside", 1, iteration=10,
                          path="/ckpt/iter_0000015", moved_to=None))
    assert text == ("/ckpt/iter_0000015 removed (left by a save that never finished: nothing "
                    "in it could be loaded): newer than the resumed iteration 10")
    assert describe(event("fresh_start", 1, folders=["/ckpt"])) == \
        "no checkpoint in /ckpt; starting from scratch"


def test_an_alert_the_fault_raised_is_no_lead_time_and_the_text_says_before_the_fault(tmp_path):
    """An XID at +20 s raised its alert at +20.1 s and the rank died at +21 s: no lead time,
    as the JSON says, but the text read 'no alert before the failure' above the alert that
    came before it."""
    run_dir = write_run(tmp_path / "run", [
        launch(0, 1, [0, 1], 1, 1, 2),
        event("fault_injected", 20, kind="xid", gpu=1, spec="xid:gpu=1,code=79,at=iter:9",
              iteration=9),
        alert(20.1, 1, ["xid_79"]),
        event("failure", 21, attempt=1, iteration=9, cause="exit", gpus=[1], exit_codes={"1": 1}),
    ], {1: [iteration_line(n, 20, 100.0) for n in range(1, 10)]})
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert "  lead time          no alert before the fault at +20.00 s\n" in result.output


def test_a_monitor_alone_that_ended_is_not_reported_as_a_killed_ftmaster(tmp_path):
    """``ftmaster monitor --backend replay:...`` ran its trace to the end and exited, as it
    does, with no end event: the report said 'ftmaster was killed'."""
    from ftmaster.lock import RunDirLock

    run_dir = write_run(tmp_path / "run", [alert(1, 1, ["xid_79"]), alert(2, 1, ["device_lost"])], {})
    with RunDirLock(run_dir):  # as the monitor held it while it ran
        pass
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    outcome = ("no launch event: no training ran here (a run directory of ftmaster monitor "
               "alone, or an ftmaster launch killed before its first attempt)")
    assert f"outcome {outcome}\n" in result.output
    assert json.loads((run_dir / "report.json").read_text())["outcome"] == outcome


def test_a_relaunch_killed_before_it_resumed_did_not_restart_from_scratch(tmp_path):
    """ftmaster was killed while its relaunch started: the report said 'restarted from no
    checkpoint loaded' (a fresh start, which would have lost 9 iterations) under a checkpoint
    of iteration 5 and 4 lost iterations."""
    run_dir = write_run(tmp_path / "run", [
        launch(0, 1, [0, 1], 1, 1, 2), save("periodic_save", 5, 5, 0.1, 0.1),
        event("failure", 10, attempt=1, iteration=9, cause="exit", gpus=[1], exit_codes={"1": 1}),
        plan(10.5, [0], 1, 1, 1), launch(11, 2, [0], 1, 1, 1),
    ], {1: [iteration_line(n, 20, 100.0) for n in range(1, 10)]})
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert "  restarted from     nothing: no relaunch resumed\n" in result.output
    assert "  lost iterations    4 (RPO;" in result.output


@pytest.mark.parametrize("cause, reason, line", [
    ("exit", "xid_79", "failure 1: attempt 1, exit on GPU 1 (hardware: GPU 1 xid_79) at +21.00 s"),
    ("device_lost", "device_lost", "failure 1: attempt 1, device_lost on GPU 1 at +21.00 s")])
def test_a_failure_names_the_hardware_evidence_the_console_named(tmp_path, cause, reason, line):
    """XID 79 killed GPU 1's rank: the console said 'attempt 1 failed (exit) after iteration 9
    on GPU 1; hardware: GPU 1 xid_79', the report only 'exit on GPU 1', in text and JSON. A
    lost device, its own evidence, is not named twice."""
    run_dir = write_run(tmp_path / "run", [
        launch(0, 1, [0, 1], 1, 1, 2),
        event("failure", 21, attempt=1, iteration=9, cause=cause, gpus=[1], exit_codes={},
              unfit_gpus=[{"gpu": 1, "reason": reason}]),
    ], {1: [iteration_line(n, 20, 100.0) for n in range(1, 10)]})
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert f"{line}, last completed iteration 9\n" in result.output
    failure = json.loads((run_dir / "report.json").read_text())["failures"][0]
    assert failure["unfit_gpus"] == [{"gpu": 1, "reason": reason}]


def test_unfit_gpus_that_are_no_list_of_gpus_and_reasons_are_refused_in_one_line(tmp_path):
    run_dir = write_run(tmp_path / "run", [
        launch(0, 1, [0, 1], 1, 1, 2),
        event("failure", 21, attempt=1, iteration=9, cause="exit", gpus=[1], unfit_gpus=["1"]),
    ], {})
    result = run_report(run_dir)
    assert result.exit_code == 1
    assert result.stderr == (f"Error: {run_dir / 'events.jsonl'} line 2: \"unfit_gpus\" of a "
                             "failure event must be a list of {\"gpu\": integer, \"reason\": "
                             "string} objects, not [\"1\"]; fix or remove that line\n")



def test_a_node_whose_dumps_rank_0s_node_merged_is_not_said_to_have_fallen_back(tmp_path):
    """One node's folder of a run across nodes: its ranks dumped, rank 0's node gathered and
    merged them, and this node loaded the merged checkpoint (no iteration lost). It records no
    merge of its own; the report said 'fell back: no merge' beside 'lost iterations 0'."""
    events = [launch(0, 1, [0, 1], 1, 1, 2),
              event("failure", 30, attempt=1, iteration=10, cause="device_lost", gpus=[1], exit_codes={}),
              event("replica_dump", 30.1, ranks=[2], seconds=0.1155, bytes=1_490_491, refused={}),
              plan(34, [0], 1, 1, 1), launch(35, 2, [0], 1, 1, 1),
              event("resumed", 40, attempt=2, iteration=11)]
    run_dir = write_run(tmp_path / "run", events, {1: [], 2: [loaded_line(10, 0.1, 4096)]})
    result = run_report(run_dir)
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    assert (failure["replica"]["iteration"], failure["replica"]["fallback"]) == (None, None)
    assert "fell back" not in result.stdout
    assert ("replica recovery   dump 0.116 s (1 rank(s), 1.5 MB); no merge or fallback recorded "
            "here: stopped first, or merged on rank 0's node (across nodes; report the whole run "
            "directory)") in result.stdout


def test_an_attempts_log_read_with_a_jump_no_interval_explains_nor_a_number_past_18_digits(
        tmp_path):
    """A line jumping to iteration 5,000,000,000 had every iteration before it take its time
    (22 GB, then MemoryError); a byte count of 5000 digits was a ValueError of int()."""
    from ftmaster.report import read_attempt_log

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "attempt_1.log").write_text(
        "loaded checkpoint from /c at iteration 1 in 0.5 s (%s bytes); layout\n" % ("1" * 5000)
        + "".join(f"iteration {i}/ 10 | x | elapsed time per iteration (ms): 100.0 | \n"
                  for i in (1, 3, 5_000_000_000)))
    log = read_attempt_log(tmp_path, 1)
    assert log.loaded_iteration is None and sorted(log.iteration_s) == [1, 2, 3]


def test_two_alerts_at_once_one_of_no_gpu_name_a_peer_failures_moment(tmp_path):
    """Tied in time, the alerts were ordered by their GPUs too: None against 1, a TypeError."""
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"event": "launch", "time": 1000.0, "attempt": 1, "gpus": [0, 1]},
        {"event": "risk_alert", "time": 1005.0, "gpu": None, "reasons": ["device_lost"]},
        {"event": "risk_alert", "time": 1005.0, "gpu": 1, "reasons": ["device_lost"]},
        {"event": "failure", "time": 1010.0, "attempt": 1, "iteration": 5, "cause": "peer",
         "gpus": []}]))
    result = run_report(tmp_path)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("missing", ["fault_injected", "risk_alert"])
def test_a_fault_or_an_alert_naming_no_gpu_is_on_no_failed_gpu(tmp_path, missing):
    """A peer's failure counts any GPU of its node: an injected fault or an alert written
    without its ``gpu`` matched too, and its lookup raised KeyError: a traceback."""
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"event": "launch", "time": 100.0, "attempt": 1, "gpus": [0, 1]},
        {"event": "fault_injected", "time": 101.0, "kind": "fail"} if missing == "fault_injected"
        else {"event": "risk_alert", "time": 101.0, "score": 0.9, "reasons": ["temperature"]},
        {"event": "failure", "time": 102.0, "attempt": 1, "cause": "peer", "iteration": 5,
         "gpus": []}]))
    result = run_report(tmp_path)
    assert result.exit_code == 0, result.output
    (failure,) = json.loads((tmp_path / "report.json").read_text())["failures"]
    assert failure["lead_time"] is None and failure["detection_latency"]["since"] != missing


def test_a_garbled_first_iteration_in_another_nodes_log_fills_no_gap_past_the_cap():
    """Node 0's log loaded iteration 0, node 1's first line said iteration 10**18: merging
    the two filled every iteration between, and the report grew past 1.8 GB in 6 s."""
    from ftmaster.report import MAX_LOGGED_GAP, AttemptLog, merge_logs

    loaded = AttemptLog(loaded_iteration=0, load_seconds=1.0, load_bytes=10)
    for first, filled in ((10**18, 0), (MAX_LOGGED_GAP + 1, 0),
                          (MAX_LOGGED_GAP, MAX_LOGGED_GAP - 1)):
        merged = merge_logs([loaded, AttemptLog(unanchored_first=(first, 0.5))])
        assert len(merged.iteration_s) == filled
