"""``ftmaster monitor`` end to end through click."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftmaster.cli import main
from ftmaster.monitor import tracegen


def invoke(*args):
    return CliRunner().invoke(main, ["monitor", *args])


def test_replay_writes_csv_events_and_flag(tmp_path):
    spec = next(s for s in map(tracegen.random_spec, range(2000, 2100))
                if s.failures and s.duration_s / s.interval_s * s.num_gpus <= 5000)
    trace, _ = tracegen.write_trace(spec, tmp_path / "traces")
    result = invoke("--backend", f"replay:{trace}", "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert len(result.output.strip().splitlines()) == 1 and "alert(s)" in result.output
    run = tmp_path / "run"
    rows = (run / "gpu_metrics.csv").read_text().splitlines()
    assert len(rows) == len(trace.read_text().splitlines())
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert events and all(e["event"] == "risk_alert" and e["timestamp"].startswith("20") for e in events)
    assert json.loads((run / "flags" / "trigger_checkpoint.flag").read_text())["gpu"] in {f.gpu for f in spec.failures}


def test_a_replay_says_which_injections_change_nothing(tmp_path):
    """A replay keeps its alerts to the summary line; the warnings that an injection changes
    nothing went with them. A subprocess: pytest's own log handlers make logging's set-up in
    the command a no-op."""
    trace = tmp_path / "trace.csv"
    assert invoke("--backend", "sim", "--num-gpus", "2", "--interval", "0.01", "--duration",
                  "0.1", "--run-dir", str(tmp_path / "sim")).exit_code == 0
    (tmp_path / "sim" / "gpu_metrics.csv").rename(trace)
    ftmaster = Path(sys.executable).with_name("ftmaster")
    completed = subprocess.run(
        [str(ftmaster), "monitor", "--backend", f"replay:{trace}", "--run-dir", str(tmp_path / "run"),
         "--inject", "degrade:gpu=7,at=0s", "--inject", "wedge:gpu=1,at=0s"],
        capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    assert "--inject degrade:gpu=7,at=0s: GPU 7 is not among the sampled GPUs 0, 1" in completed.stderr
    assert "the replay backend cannot wedge its reads: wedge:gpu=1,at=0s" in completed.stderr
    assert len(completed.stdout.strip().splitlines()) == 1


def test_sim_run_with_injection(tmp_path):
    result = invoke("--backend", "sim", "--run-dir", str(tmp_path), "--interval", "0.1", "--num-gpus", "2",
                    "--duration", "1.5", "--inject", "degrade:gpu=1,at=0.3s")
    assert result.exit_code == 0, result.output
    assert "on GPU 1" in result.output
    # moved on for a trainer beside it, which reads only save_now.flag, as under launch
    assert json.loads((tmp_path / "flags" / "save_now.flag").read_text())["gpu"] == 1
    assert not (tmp_path / "flags" / "trigger_checkpoint.flag").exists()


def test_an_injection_that_never_came_due_is_named_in_the_summary(tmp_path):
    """at=iter:K counts a trainer's iterations in the run directory's heartbeat: without a
    trainer there, the fault never fired, and the summary read as if the rehearsal had run."""
    result = invoke("--backend", "sim", "--run-dir", str(tmp_path), "--interval", "0.05",
                    "--num-gpus", "2", "--duration", "0.3", "--inject", "fail:gpu=1,at=iter:3",
                    "--inject", "degrade:gpu=0,at=0s")
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(
        f"wrote {tmp_path}; never fired: fail:gpu=1,at=iter:3 (at=iter:K waits for a trainer's "
        f"heartbeat in the run directory to reach iteration K)")


def test_a_quiet_run_says_no_alert(tmp_path):
    """It read '0 alert(s) on no GPU'."""
    result = invoke("--backend", "sim", "--run-dir", str(tmp_path), "--interval", "0.05",
                    "--num-gpus", "2", "--duration", "0.2")
    assert result.exit_code == 0, result.output
    assert ", no alert, lost no GPU; wrote" in result.output


def test_a_run_dir_another_ftmaster_uses_is_refused(tmp_path):
    """A launch's (or another monitor's): their rows and flags would interleave."""
    import os

    from ftmaster.lock import RunDirLock

    with RunDirLock(tmp_path):
        result = invoke("--backend", "sim", "--run-dir", str(tmp_path), "--duration", "0")
    one_line_error(result, f"another ftmaster (pid {os.getpid()}) is using {tmp_path}")
    assert not (tmp_path / "gpu_metrics.csv").exists()


def one_line_error(result, words):
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert "Traceback" not in result.output and words in lines[-1], result.output


def test_bad_backend_name(tmp_path):
    one_line_error(invoke("--backend", "magic", "--run-dir", str(tmp_path)), "unknown backend 'magic'")


def test_bad_injection(tmp_path):
    one_line_error(invoke("--backend", "sim", "--run-dir", str(tmp_path), "--inject", "degrade:gpu=1"),
                   "missing at=")


def test_an_injection_waiting_for_an_event_needs_the_launcher(tmp_path):
    one_line_error(invoke("--backend", "sim", "--run-dir", str(tmp_path), "--inject",
                          "degrade:gpu=1,at=1s,after=emergency_save"), "after= needs ftmaster launch")


@pytest.mark.parametrize("spec", ["slow:gpu=1,factor=2,at=1s", "nan:gpu=1,at=iter:3"])
def test_a_fault_of_the_training_rank_needs_the_launcher(spec, tmp_path):
    one_line_error(invoke("--backend", "sim", "--run-dir", str(tmp_path), "--inject", spec),
                   "acts on a training rank, which needs ftmaster launch")


def test_a_fault_on_a_gpu_the_sim_does_not_have_is_refused(tmp_path):
    one_line_error(invoke("--backend", "sim", "--num-gpus", "2", "--run-dir", str(tmp_path),
                          "--inject", "fail:gpu=2,at=1s", "--duration", "0"),
                   "GPU 2 is not one of the sim backend's GPUs 0-1 (--num-gpus 2)")


@pytest.mark.parametrize("count", ["99999999999999999999", "10000000"])
def test_more_sim_gpus_than_a_node_holds_are_refused(count, tmp_path):
    """A list per GPU: the first was a traceback, the second a minute and gigabytes."""
    one_line_error(invoke("--backend", "sim", "--num-gpus", count, "--run-dir", str(tmp_path),
                          "--duration", "0"),
                   f"'--num-gpus': {count} is not in the range 1<=x<=1024")


def test_an_empty_run_dir_is_refused_not_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line_error(invoke("--backend", "sim", "--run-dir", "", "--duration", "0"),
                   "'--run-dir': needs a folder, got an empty value")
    assert list(tmp_path.iterdir()) == []


def test_missing_replay_file(tmp_path):
    one_line_error(invoke("--backend", f"replay:{tmp_path}/nope.csv", "--run-dir", str(tmp_path / "r")),
                   "cannot read")


def test_replaying_into_its_own_file_is_refused(tmp_path):
    one_line_error(invoke("--backend", f"replay:{tmp_path}/gpu_metrics.csv", "--run-dir", str(tmp_path)),
                   "own gpu_metrics.csv")


@pytest.mark.parametrize("content", [b"a,b\n1,2\n", b"\x89PNG\r\n\x1a\n\xff\xfe",
                                     b'"' + b"x" * 200_000 + b"\n"])  # past csv's field limit
def test_foreign_csv_in_the_run_dir_is_refused(tmp_path, content):
    (tmp_path / "gpu_metrics.csv").write_bytes(content)
    one_line_error(invoke("--backend", "sim", "--run-dir", str(tmp_path), "--duration", "0"), "other columns")


@pytest.mark.parametrize("entry", ["events.jsonl", "gpu_metrics.csv"])
def test_a_folder_where_the_run_dir_wants_a_file_is_refused(tmp_path, entry):
    (tmp_path / entry).mkdir()
    one_line_error(invoke("--backend", "sim", "--run-dir", str(tmp_path), "--duration", "0"),
                   f"does not hold ftmaster's layout ({tmp_path / entry} is a folder)")


def test_a_file_where_the_flags_go_is_refused(tmp_path):
    (tmp_path / "flags").write_text("")
    one_line_error(invoke("--backend", "sim", "--run-dir", str(tmp_path), "--duration", "0"),
                   f"({tmp_path / 'flags'} is not a folder)")


def test_a_run_dir_that_cannot_be_looked_at_is_refused_in_one_line(tmp_path):
    run_dir = tmp_path / ("x" * 300)  # past NAME_MAX: every look inside it fails
    one_line_error(invoke("--backend", "sim", "--run-dir", str(run_dir), "--duration", "0"),
                   "is not usable (File name too long); give another --run-dir")
