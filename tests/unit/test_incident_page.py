"""report.html, the incident page ``ftmaster report`` writes: every failure with its RTO and
RPO, the timeline, risk around each failure, goodput; numbers rounded; and, where Debian's
chromium is installed, rendered by a real headless browser."""

import json
import re
import shutil
import subprocess

import matplotlib.pyplot as plt
import pytest

from ftmaster.incident import human, job_gpus
from ftmaster.monitor.daemon import MetricsWriter
from ftmaster.monitor.sample import GpuSample
from helpers.synth_run import T0
from test_report import run_report, two_failures

CHROMIUM = shutil.which("chromium")


def with_samples(run_dir):
    """A sample every 2 s for GPUs 0-3 over the run, GPU 1's risk rising before its fault
    (float32-looking values, as a real CSV holds)."""
    writer = MetricsWriter(run_dir / "gpu_metrics.csv")
    for step in range(81):
        at = 2.0 * step
        writer.write([GpuSample(T0 + at, gpu, "NVIDIA H100", temperature=35.650002 + gpu,
                                memory_used=16311.799805, memory_total=81559.0,
                                failure_risk=min(1.0, max(0.0, (at - 40) / 30)) if gpu == 1 else 0.05)
                      for gpu in range(4)])
    writer.close()
    return run_dir


@pytest.fixture
def page(tmp_path):
    run_dir = with_samples(two_failures(tmp_path / "run"))
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert f"wrote {run_dir / 'report.json'} and {run_dir / 'report.html'}" in result.output
    return run_dir / "report.html", json.loads((run_dir / "report.json").read_text())


def test_samples_that_cannot_be_read_are_said_not_passed_off_as_none(tmp_path):
    """A damaged gpu_metrics.csv (bytes that are no UTF-8, from a disk error or a bad copy)
    leaves the page without risk plots: that is said, since the run did have samples."""
    run_dir = with_samples(two_failures(tmp_path / "run"))
    with (run_dir / "gpu_metrics.csv").open("ab") as handle:
        handle.write(b"\xff\xfe garbage\n")
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith(f"warning: {run_dir / 'gpu_metrics.csv'} is malformed (")
    assert result.stderr.endswith("; the incident page has no risk plots\n")
    assert len(result.stderr.splitlines()) == 1


def text_of(html_page):
    return re.sub(r'src="data:image/png;base64,[^"]*"', "", html_page)


def test_every_failure_with_its_rto_rpo_and_plots_and_goodput(page):
    path, report = page
    body = text_of(path.read_text())
    for number, failure in enumerate(report["failures"], 1):
        assert f"Failure {number}: {failure['cause']}" in body
        assert f"RTO <b>{human(failure['rto_seconds'], 's')}</b>" in body
        assert f"RPO <b>{human(failure['lost_iterations'])} iteration(s)</b>" in body
    # the timeline, then per failure its phases and its risk plot
    assert path.read_text().count("data:image/png;base64,") == 1 + 2 * len(report["failures"])
    assert "attempt 3: TP1 x PP1 x DP2" in body and "<h2>Goodput</h2>" in body
    assert "this run: <b>" in body and "periodic-only" in body


def _launch(node, gpus):
    return {"event": "launch", "node": node, "gpus": gpus}


def _round_plan(node, number, used):
    return {"event": "plan", "node": node, "round": number, "num_gpus_used": used}


@pytest.mark.parametrize("events, gpus", [
    ([], 1),
    ([{"event": "launch", "gpus": [0, 1, 2, 3]}, {"event": "launch", "gpus": [0, 2, 3]}], 4),
    # node 1 fails, standby node 2 takes its place: 8 GPUs, not 12
    ([_round_plan(0, 1, 8), _launch(0, [0, 1, 2, 3]), _round_plan(1, 1, 8),
      _launch(1, [0, 1, 2, 3]), _round_plan(0, 2, 8), _launch(0, [0, 1, 2, 3]),
      _round_plan(2, 2, 8), _launch(2, [0, 1, 2, 3])], 8),
    # the job shrank after a failure: the model takes the job at its largest
    ([_round_plan(0, 1, 8), _round_plan(1, 1, 8), _round_plan(0, 2, 6), _round_plan(1, 2, 6)], 8),
    # no round plans (recorded before they were written): each node's largest launch, added up
    ([_launch(0, [0, 1]), _launch(1, [0, 1]), _launch(1, [0])], 4),
])
def test_the_modelled_goodput_counts_the_jobs_gpus_once(events, gpus):
    assert job_gpus(events) == gpus


def test_lists_read_as_their_items_not_as_python(page):
    """A reason, a layout's GPUs, a failure's: ``xid_92``, not ``['xid_92']``."""
    body = text_of(page[0].read_text())
    assert "reasons ecc_sbe_rate, xid_92<" in body
    assert "GPUs 0, 1, 2, 3<" in body and "gpus_available 0, 2, 3," in body
    assert "Failure 1: device_lost on GPU 1 at" in body and "gpus 1, iteration 16" in body
    assert not re.search(r"\[[^\]]*\]", re.sub(r"<[^>]*>", "", body.split("<body>")[-1]))


def test_no_number_on_the_page_is_unrounded(page):
    path, _ = page
    body = text_of(path.read_text())
    assert not re.findall(r"\d\.\d{3,}", body), re.findall(r".{30}\d\.\d{3,}.{10}", body)


def test_goodput_reads_in_per_cent_so_close_strategies_differ(page):
    """Two decimals of the fraction read 0.9975 and 0.9994 both as 1.00: no loss at all."""
    body = text_of(page[0].read_text())
    modelled = re.findall(r"<tr><td>[a-z -]+</td><td class='n'>([^<]*)</td></tr>", body)
    assert len(modelled) == 3 and all(re.fullmatch(r"\d{1,3}\.\d\d%", v) for v in modelled)
    assert re.search(r"this run: <b>\d{1,3}\.\d\d%</b>", body)


def test_a_launch_without_its_layout_reads_as_unknown_degrees(tmp_path):
    run_dir = two_failures(tmp_path / "run")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    for event in events:
        if event["event"] == "launch":
            for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                        "data_parallel_size"):
                event.pop(key, None)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert run_report(run_dir).exit_code == 0
    body = text_of((run_dir / "report.html").read_text())
    assert "attempt 1: TP? x PP? x DP?" in body and "None" not in body


@pytest.mark.parametrize("value, unit, text", [
    (None, "", "unknown"), (3, "", "3"), (12345, "", "12,345"), (16311.799805, "", "16,312"),
    (35.650002, "", "35.7"), (9.1945, "s", "9.19 s"), (0.0634, "s", "0.06 s"),
    (0.001, "s", "< 0.01 s"), (2.0, "", "2"), ("exit", "", "exit"),
])
def test_numbers_read_as_people_write_them(value, unit, text):
    assert human(value, unit) == text


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install chromium)")
def test_the_page_renders_in_headless_chromium(page, tmp_path):
    path, report = page
    browse = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
    dom = subprocess.run([*browse, "--dump-dom", path.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    for number in range(1, len(report["failures"]) + 1):
        assert f"Failure {number}:" in dom
    shot = tmp_path / "page.png"
    subprocess.run([*browse, f"--screenshot={shot}", "--window-size=1280,3000", path.as_uri()],
                   capture_output=True, timeout=120, check=True)
    pixels = plt.imread(shot)
    assert pixels.shape[:2] == (3000, 1280)
    assert pixels[:1500].std() > 0.05  # figures and text drawn, not a blank page


def test_the_timeline_table_names_an_exit_save_as_the_report_does(tmp_path):
    from helpers.synth_run import event, launch, write_run

    run_dir = write_run(tmp_path / "run", [
        launch(0, 1, [0, 1], 1, 1, 2),
        event("periodic_save", 30, iteration=12, seconds=0.2, bytes=1000, kind="exit",
              started_at=T0 + 29.8),
        event("stopped", 31, signal="SIGTERM", exit_code=0)], {1: []})
    assert run_report(run_dir).exit_code == 0
    body = text_of((run_dir / "report.html").read_text())
    assert "<td>exit_save</td>" in body and "<td>periodic_save</td>" not in body


def test_the_page_tells_a_straggler_and_its_drain(tmp_path):
    from helpers.synth_run import event, launch, plan, write_run

    run_dir = write_run(tmp_path / "run", [
        launch(0, 1, [0, 1, 2, 3], 1, 1, 4),
        event("straggler", 10, gpu=1, rank=1, iteration=14, since=8, slowdown=2.1, step_s=1.2,
              healthy_step_s=0.6),
        event("drain", 11, gpu=1, reason="straggler", decided_by="the job runs 1.2 s/iteration",
              step_s=1.2, estimated_step_s=0.8),
        event("straggler_drained", 14, gpu=1), plan(15, [0, 2, 3], 1, 1, 3),
        launch(16, 2, [0, 2, 3], 1, 1, 3),
        event("straggler_drain_result", 30, attempt=2, step_s=0.8, slowed_step_s=1.2)], {1: [], 2: []})
    assert run_report(run_dir).exit_code == 0
    body = text_of((run_dir / "report.html").read_text())
    assert "<h2>Stragglers</h2>" in body and "straggler: GPU 1 computed 2.1x slower" in body
    assert "0.8 s/iteration after the drain" in body
    assert "<td>drain</td><td>gpu 1, reason straggler, decided_by the job runs" in body


def test_the_runs_goodput_counts_only_the_iterations_it_trained():
    """A run that started from a checkpoint (``--load`` of an earlier job) trained the
    iterations after it: those before it took none of this run's wall time."""
    from ftmaster.incident import observed_goodput

    events = [{"event": "launch", "time": 0.0, "attempt": 1},
              {"event": "checkpoint_loaded", "time": 5.0, "iteration": 1000},
              {"event": "complete", "time": 205.0, "iteration": 1100}]
    seen = observed_goodput({"iteration_s": 1.0}, events)
    assert (seen["iterations"], seen["useful_s"]) == (100, 100.0)
    assert seen["goodput"] == pytest.approx(100 / 205)


def test_a_relaunchs_load_is_not_the_runs_start():
    """Iterations redone after a failure are lost work, not a later start."""
    from ftmaster.incident import observed_goodput

    events = [{"event": "launch", "time": 0.0, "attempt": 1},
              {"event": "failure", "time": 50.0, "iteration": 40, "attempt": 1},
              {"event": "launch", "time": 60.0, "attempt": 2},
              {"event": "checkpoint_loaded", "time": 65.0, "iteration": 30},
              {"event": "complete", "time": 135.0, "iteration": 100}]
    seen = observed_goodput({"iteration_s": 1.0}, events)
    assert (seen["iterations"], seen["useful_s"]) == (100, 100.0)


def test_iterations_a_run_redid_and_then_gave_up_on_are_not_its_progress():
    """Attempt 1 reached 25; the relaunch resumed from 10 and the run gave up at 15: what it
    holds is iteration 10 (the page said 25 iterations of useful work, then 15)."""
    from ftmaster.incident import observed_goodput

    events = [{"event": "launch", "time": 0.0, "attempt": 1},
              {"event": "failure", "time": 50.0, "iteration": 25, "attempt": 1},
              {"event": "launch", "time": 60.0, "attempt": 2},
              {"event": "checkpoint_loaded", "time": 65.0, "iteration": 10},
              {"event": "failure", "time": 70.0, "iteration": 15, "attempt": 2},
              {"event": "gave_up", "time": 70.1, "reason": "restart budget spent"}]
    seen = observed_goodput({"iteration_s": 1.0}, events)
    assert seen["iterations"] == 10


def test_a_run_that_failed_last_holds_its_newest_checkpoint_not_the_failures_iteration():
    from ftmaster.incident import observed_goodput

    events = [{"event": "launch", "time": 0.0, "attempt": 1},
              {"event": "periodic_save", "time": 50.0, "iteration": 50},
              {"event": "failure", "time": 95.0, "iteration": 90, "attempt": 1},
              {"event": "gave_up", "time": 96.0, "reason": "restart budget spent"}]
    seen = observed_goodput({"iteration_s": 1.0}, events)
    assert seen["iterations"] == 50 and seen["goodput"] == pytest.approx(50 / 96)


def test_a_first_attempt_that_failed_before_training_leaves_the_runs_start_at_its_load():
    """A new run directory loads an earlier job's 1000; attempt 1 fails at start-up (a bad GPU
    at NCCL's start), attempt 2 loads 1000 and trains to 1100: the page counted 1100
    iterations, goodput 1."""
    from ftmaster.incident import observed_goodput

    events = [{"event": "launch", "time": 0.0, "attempt": 1},
              {"event": "failure", "time": 10.0, "iteration": None, "attempt": 1,
               "before_first_iteration": True},
              {"event": "launch", "time": 15.0, "attempt": 2},
              {"event": "checkpoint_loaded", "time": 20.0, "iteration": 1000},
              {"event": "complete", "time": 121.5, "iteration": 1100}]
    seen = observed_goodput({"iteration_s": 1.0}, events)
    assert seen["iterations"] == 100 and seen["goodput"] == pytest.approx(100 / 121.5)


def test_a_stop_while_waiting_for_gpus_is_not_progress():
    """Stopped while waiting after a failure at 90, saved at 50: the stop names the failed
    attempt's 90, and the page read 0.90 where the same run giving up read 0.50."""
    from ftmaster.incident import observed_goodput

    events = [{"event": "launch", "time": 0.0, "attempt": 1},
              {"event": "periodic_save", "time": 50.0, "iteration": 50},
              {"event": "failure", "time": 95.0, "iteration": 90, "attempt": 1},
              {"event": "waiting", "time": 96.0},
              {"event": "stopped", "time": 100.0, "iteration": 90, "state": "waiting"}]
    assert observed_goodput({"iteration_s": 1.0}, events)["iterations"] == 50


def test_a_live_runs_progress_since_its_last_failure_counts():
    """Still running: resumed after a failure at 40 and saved 300 since. Its progress is the
    saved 300 over the 400 s so far, not the failure's 40."""
    from ftmaster.incident import observed_goodput

    events = [{"event": "launch", "time": 0.0, "attempt": 1},
              {"event": "failure", "time": 50.0, "iteration": 40, "attempt": 1},
              {"event": "launch", "time": 60.0, "attempt": 2},
              {"event": "checkpoint_loaded", "time": 65.0, "iteration": 30},
              {"event": "resumed", "time": 70.0, "iteration": 31, "attempt": 2},
              {"event": "periodic_save", "time": 400.0, "iteration": 300}]
    seen = observed_goodput({"iteration_s": 1.0}, events)
    assert (seen["iterations"], seen["wall_s"]) == (300, 400.0)


def test_a_drained_attempt_ends_where_its_relaunch_starts():
    """A drain records no end of its own attempt: its bar ended at the run's end, under the
    relaunch's."""
    from ftmaster.incident import _attempts

    events = [{"event": "launch", "time": 0.0, "attempt": 1},
              {"event": "drain", "time": 21.0, "gpu": 1, "reason": "straggler"},
              {"event": "straggler_drained", "time": 26.0, "gpu": 1},
              {"event": "launch", "time": 28.0, "attempt": 2},
              {"event": "complete", "time": 100.0, "iteration": 50}]
    assert [(a["attempt"], a["end"]) for a in _attempts(events)] == [(1, 28.0), (2, 100.0)]


def test_a_relaunch_that_loaded_nothing_reads_the_same_on_the_page_as_in_the_text(tmp_path):
    """The relaunch after the failure loaded no checkpoint: the text said "no checkpoint
    loaded", the page "restarted from iteration unknown", as if a load went unrecorded."""
    from helpers.synth_run import event, launch, write_run

    events = [launch(0, 1, [0, 1], 1, 1, 2),
              event("failure", 30, attempt=1, iteration=5, cause="exit", gpus=[1], exit_codes={}),
              launch(31, 2, [0, 1], 1, 1, 2), event("resumed", 40, attempt=2, iteration=1),
              event("complete", 60, iteration=10)]
    run_dir = write_run(tmp_path / "run", events, {})
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert "restarted from     no checkpoint loaded" in result.stdout
    body = text_of((run_dir / "report.html").read_text())
    assert "restarted from: no checkpoint loaded;" in body and "iteration unknown" not in body


def test_a_load_recorded_without_its_time_is_where_the_text_says_it_restarted(tmp_path):
    """A checkpoint_loaded event whose seconds are not a number still names the iteration
    loaded: the text said "no checkpoint loaded" while the page named the iteration."""
    from helpers.synth_run import event, launch, write_run

    events = [launch(0, 1, [0, 1], 1, 1, 2),
              event("failure", 30, attempt=1, iteration=5, cause="exit", gpus=[1], exit_codes={}),
              launch(31, 2, [0, 1], 1, 1, 2),
              event("checkpoint_loaded", 35, iteration=4, path="ckpt/iter_0000004", seconds=None),
              event("resumed", 40, attempt=2, iteration=5), event("complete", 60, iteration=10)]
    run_dir = write_run(tmp_path / "run", events, {})
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    assert "restarted from     iteration 4\n" in result.stdout
    assert "restarted from: iteration 4;" in text_of((run_dir / "report.html").read_text())
