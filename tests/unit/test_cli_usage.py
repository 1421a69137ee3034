"""Usage errors of every ftmaster command are one line on stderr, as every other refusal."""

import pytest
from click.testing import CliRunner

from ftmaster.cli import main


@pytest.mark.parametrize("args, message", [
    (["bogus"], "No such command 'bogus'."),
    (["--bogus"], "No such option '--bogus'."),
    (["report"], "Missing argument 'RUN_DIR'."),
    (["report", "--bogus", "x"], "No such option '--bogus'."),
    (["analyze", ".", "--risk-threshold", "2"],
     "Invalid value for '--risk-threshold': 2.0 is not in the range 0<=x<=1."),
    (["monitor", "--run-dir", "x", "--scorer", "bogus"],
     "Invalid value for '--scorer': 'bogus' is not one of 'adaptive', 'paper'."),
    (["monitor", "--run-dir", "x", "--backend", "bogus"],
     "unknown backend 'bogus'; choose one of nvml, smi, sim, replay:PATH"),
    (["goodput", "--gpus", "x"], "Invalid value for '--gpus': 'x' is not a valid integer."),
    (["plan"], "put -- before the training script: ... -- SCRIPT ARGS..."),
    # an unquoted unset variable (--run-dir $RUN --): the monitor wrote into ./--
    (["monitor", "--backend", "sim", "--run-dir", "--"],
     "Invalid value for '--run-dir': needs a folder, got '--'"),
    (["plan", "--gpus", "--", "x"], "--gpus needs a value before --"),
    # nan passes every bound of click's FloatRange: it reached a traceback, or ran
    (["monitor", "--run-dir", "x", "--interval", "nan"],
     "Invalid value for '--interval': 'nan' is not a finite number."),
    (["launch", "--replication-rate", "nan", "--", "x"],
     "Invalid value for '--replication-rate': 'nan' is not a finite number."),
    # a paced chunk outlasted a peer's timeout, so no copy ever completed (and below 1e-288
    # the pace's sleep overflowed, a traceback per copy)
    (["launch", "--replication-rate", "0.001", "--", "x"],
     "Invalid value for '--replication-rate': 0.001 is not in the range "
     "0.01<=x<=1000000000.0."),
    (["launch", "--hang-timeout", "inf", "--", "x"],
     "Invalid value for '--hang-timeout': 'inf' is not a finite number."),
    (["plan", "--measured-step-s", "NaN", "--", "x"],
     "Invalid value for '--measured-step-s': 'NaN' is not a finite number."),
    (["analyze", ".", "--risk-threshold", "nan"],
     "Invalid value for '--risk-threshold': 'nan' is not a finite number."),
    (["monitor", "--run-dir", "x", "--duration", "1e10"],  # beyond a thread's wait
     "Invalid value for '--duration': 10000000000.0 is not in the range 0<=x<=1000000000.0."),
])
def test_a_usage_error_is_one_line(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert result.stderr == f"Error: {message}\n"
    assert not (tmp_path / "x").exists()  # refused before any run directory is made


def test_no_command_prints_the_help():
    result = CliRunner().invoke(main, [], prog_name="ftmaster")
    assert result.exit_code == 2
    assert result.stderr.startswith("Usage: ftmaster [OPTIONS] COMMAND [ARGS]...")
    assert "report" in result.stderr
