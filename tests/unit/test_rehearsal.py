"""The trainer's side of injected faults: what a rank on a GPU with an XID sees."""

import os
import signal

import pytest

from megatron.training import rehearsal


@pytest.mark.parametrize("xid, text", [
    (95, "CUDA error: uncorrectable ECC error encountered (rehearsal: XID 95 on this GPU)"),
    (79, "CUDA error: unspecified launch failure (the GPU has fallen off the bus)"),
    (13, "CUDA error: unknown error (rehearsal: XID 13 on this GPU)"),
])
def test_cuda_error_message(xid, text):
    assert rehearsal.cuda_error_message(xid).startswith(text.split(" (rehearsal")[0])
    assert f"XID {xid}" in rehearsal.cuda_error_message(xid)


def test_per_local_rank_reads_only_this_ranks_entries(monkeypatch):
    monkeypatch.setenv(rehearsal.NAN_ENV, "1:7, 0:3,1:9")
    assert rehearsal.nan_iterations(1) == {7, 9}
    assert rehearsal.nan_iterations(2) == frozenset()
    monkeypatch.setenv(rehearsal.NAN_ENV, "one:7")
    with pytest.raises(ValueError, match="expected LOCAL_RANK:VALUE"):
        rehearsal.nan_iterations(1)


@pytest.mark.parametrize("variable, good, bad, expected, arm", [
    (rehearsal.NAN_ENV, "0:3", "1:7:2", "LOCAL_RANK:VALUE", rehearsal.nan_iterations),
    (rehearsal.SLOW_ENV, "0:3:2", "1:8", "LOCAL_RANK:ITERATION:FACTOR", rehearsal.Slowdown),
    (rehearsal.SLOW_ENV, "0:3:2", "1:8:fast", "LOCAL_RANK:ITERATION:FACTOR", rehearsal.Slowdown),
    (rehearsal.KILL_ENV, "0:3:forward", "x:4:forward", "LOCAL_RANK:ITERATION:POINT",
     rehearsal.arm_kill_points),
])
def test_a_malformed_entry_is_refused_even_for_another_rank(monkeypatch, variable, good, bad,
                                                            expected, arm):
    monkeypatch.setenv(variable, f"{good},{bad}")
    with pytest.raises(ValueError, match=f"^{variable}=.*: expected {expected}"):
        arm(5)


def test_slowdowns_are_this_ranks_from_their_iteration(monkeypatch):
    monkeypatch.delenv("FTMASTER_RANK_DIR", raising=False)
    monkeypatch.setenv(rehearsal.SLOW_ENV, "1:8:2,0:3:4,1:12:1.5")
    slowdown = rehearsal.Slowdown(1)
    assert [slowdown.current(i) for i in (7, 8, 12)] == [1.0, 2.0, 2.0]


def test_nothing_is_armed_outside_a_rehearsal(monkeypatch):
    monkeypatch.delenv(rehearsal.CUDA_ERROR_ENV, raising=False)
    before = signal.getsignal(rehearsal.CUDA_ERROR_SIGNAL)
    rehearsal.arm_cuda_errors(0)
    assert signal.getsignal(rehearsal.CUDA_ERROR_SIGNAL) is before


def test_a_rank_on_a_gpu_with_an_xid_fails_at_start_up(monkeypatch):
    monkeypatch.setenv(rehearsal.CUDA_ERROR_ENV, "0:95,2:79")
    with pytest.raises(RuntimeError, match="uncorrectable ECC error"):
        rehearsal.arm_cuda_errors(0)


def test_an_xid_while_training_raises_the_cuda_error_where_the_rank_is(monkeypatch, tmp_path):
    monkeypatch.setenv(rehearsal.CUDA_ERROR_ENV, "")
    monkeypatch.setenv("FTMASTER_RANK_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    (tmp_path / "cuda_error_1").write_text("48")
    before = signal.getsignal(rehearsal.CUDA_ERROR_SIGNAL)
    try:
        rehearsal.arm_cuda_errors(1)
        with pytest.raises(RuntimeError, match=r"uncorrectable ECC error .*XID 48"):
            os.kill(os.getpid(), rehearsal.CUDA_ERROR_SIGNAL)
            signal.sigtimedwait([], 0.5)  # give the handler a chance to run
    finally:
        signal.signal(rehearsal.CUDA_ERROR_SIGNAL, before)


def _rank_reaching_kill_point(run_dir, spec: str) -> int:
    """A process as local rank 0 of an attempt that arms its kills and reaches iteration 3's
    forward; its exit status."""
    import subprocess
    import sys

    script = ("from megatron.training import rehearsal\n"
              "rehearsal.arm_kill_points(0)\n"
              "rehearsal.kill_point('forward', 3)\n")
    env = {**os.environ, rehearsal.KILL_ENV: spec, "FTMASTER_RUN_DIR": str(run_dir)}
    return subprocess.run([sys.executable, "-c", script], env=env, timeout=60).returncode


def test_an_injected_kill_fires_once_per_run_directory(tmp_path):
    """Every attempt of a run inherits FTMASTER_INJECT_KILL: the relaunch that resumed from
    before the kill's iteration killed itself there again, attempt after attempt, until the
    restart budget was spent, where the rehearsal meant one lost GPU."""
    run = tmp_path / "run"
    assert _rank_reaching_kill_point(run, "0:3:forward") == -signal.SIGKILL
    assert _rank_reaching_kill_point(run, "0:3:forward") == 0
    assert _rank_reaching_kill_point(run, "0:3:update,0:3:forward") == 0  # listed otherwise
    assert _rank_reaching_kill_point(tmp_path / "another run", "0:3:forward") == -signal.SIGKILL


def test_an_xid_sent_before_the_rank_armed_its_handler_is_the_cuda_error(tmp_path):
    """The supervisor signals a rank as soon as its guard records its pid; a rank still in its
    imports (seconds of them) was killed by the bare SIGUSR2, and the root cause read "killed
    by SIGUSR2 without an error of its own", not the rehearsed CUDA error."""
    import subprocess
    import sys
    import time

    from ftmaster.attempt import read_rank_records

    (tmp_path / "cuda_error_0").write_text("95")
    script = tmp_path / "rank.py"
    script.write_text("import time\ntime.sleep(1.5)  # its imports\n"
                      "from megatron.training import rehearsal\nrehearsal.arm_cuda_errors(0)\n"
                      "time.sleep(30)\n")
    env = {**os.environ, "FTMASTER_RANK_DIR": str(tmp_path), "LOCAL_RANK": "0", "RANK": "0",
           rehearsal.CUDA_ERROR_ENV: ""}
    guard = subprocess.Popen([sys.executable, "-m", "ftmaster.guard", "rank", str(script)],
                             env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while 0 not in read_rank_records(tmp_path, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(read_rank_records(tmp_path, 1)[0].pid, rehearsal.CUDA_ERROR_SIGNAL)
        _, err = guard.communicate(timeout=60)
    finally:
        guard.kill()
    assert guard.returncode == 1, err[-2000:]
    assert "uncorrectable ECC error" in err and "XID 95" in err
