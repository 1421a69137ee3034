"""runfiles.read_heartbeat: what the live supervisor takes as training's progress."""

import json
import os
import threading

import pytest

from ftmaster import runfiles


def _write(run_dir, **body):
    runfiles.heartbeat_path(run_dir).write_text(json.dumps(body) + "\n")


def test_a_whole_heartbeat_is_read(tmp_path):
    runfiles.write_heartbeat(tmp_path, iteration=7, consumed_samples=56, first_iteration=5,
                             finished=True)
    beat = runfiles.read_heartbeat(tmp_path)
    assert (beat["iteration"], beat["first_iteration"], beat["finished"]) == (7, 5, True)


@pytest.mark.parametrize("body", [
    {"iteration": True},  # a bool is an int in Python: it read as iteration 1
    {"iteration": -3},
    {"iteration": 7, "finished": "false"},  # a non-empty string read as finished
    {"iteration": 7, "finished": 1},
    {"iteration": 7, "first_iteration": "5"},
    {"iteration": 7, "first_iteration": False},
    {"iteration": 7, "time": "now"},
    {"iteration": 7, "time": float("nan")},
    {"iteration": 7, "evaluated": "3"},
])
def test_a_malformed_heartbeat_is_unknown_not_progress_or_finished(tmp_path, body):
    _write(tmp_path, **body)
    assert runfiles.read_heartbeat(tmp_path) is None


def test_a_fifo_for_the_heartbeat_is_unknown_not_a_wait_for_a_writer(tmp_path):
    os.mkfifo(runfiles.heartbeat_path(tmp_path))
    result = []
    reader = threading.Thread(target=lambda: result.append(runfiles.read_heartbeat(tmp_path)),
                              daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # let the stuck open go before failing
        with open(runfiles.heartbeat_path(tmp_path), "w"):
            pass
        pytest.fail("read_heartbeat waited for a writer to the FIFO")
    assert result == [None]
