"""ftmaster's own TensorBoard scalars (RunBoard): what they write, and a writer that fails."""

import errno
import logging
import struct
from types import SimpleNamespace

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.summary.writer.record_writer import RecordWriter  # noqa: E402

from ftmaster.board import RunBoard  # noqa: E402


def scalars(path, tag):
    """The points of ``tag`` in the event files of a folder, or in one event file."""
    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars(tag)]


def test_an_empty_tensorboard_dir_is_no_board(tmp_path, monkeypatch):
    """As Megatron-LM takes it (no writer); Path("") wrote into the working directory."""
    monkeypatch.chdir(tmp_path)
    assert RunBoard.for_command(["train.py", "--tensorboard-dir", ""], None) is None
    assert list(tmp_path.iterdir()) == []


def test_risk_once_per_iteration_and_failures_at_their_iteration(tmp_path):
    board = RunBoard(tmp_path)
    board.observe_heartbeat({"iteration": 3})
    sample = SimpleNamespace(gpu_id=1, failure_risk=0.25)
    board.observe_samples([sample], [])
    board.observe_samples([sample], ["alert"])
    board.observe_event({"event": "failure", "iteration": 3, "time": 10.0})
    board.close()
    assert scalars(tmp_path, "ftmaster/risk/gpu1") == [(3, 0.25)]
    assert scalars(tmp_path, "ftmaster/alerts") == [(3, 1.0)]
    assert scalars(tmp_path, "ftmaster/failures") == [(3, 1.0)]


def test_the_risk_at_an_iteration_is_its_highest_sample(tmp_path):
    """Samples between two heartbeats (a slow iteration, or training stalled before a failure)
    kept only the first: the peak between them was never on the curve."""
    board = RunBoard(tmp_path)
    board.observe_heartbeat({"iteration": 3})
    for risk in (0.25, 0.875, 0.5):
        board.observe_samples([SimpleNamespace(gpu_id=1, failure_risk=risk)], [])
    board.observe_heartbeat({"iteration": 4})
    board.observe_samples([SimpleNamespace(gpu_id=1, failure_risk=0.5)], [])
    board.observe_samples([SimpleNamespace(gpu_id=1, failure_risk=1.0)], [])
    board.close()
    assert scalars(tmp_path, "ftmaster/risk/gpu1") == [(3, 0.875), (4, 1.0)]


def shown(points):
    """The points TensorBoard plots: its data server takes a step written again for a job
    restarted from a checkpoint, and drops every earlier point at or after that step
    (tensorboard/data/server/reservoir.rs, "preemption")."""
    kept = []
    for step, value in points:
        kept = [point for point in kept if point[0] < step] + [(step, value)]
    return kept


def test_a_relaunch_from_an_older_checkpoint_keeps_the_risk_before_the_failure(tmp_path):
    """GPU 1's risk rose to 0.875 at iteration 17, then it failed and training resumed from
    iteration 10: its risk was written again at 11 and 12, and TensorBoard dropped the points
    from 11 on, the failure's peak with them. Samples while the run redoes iterations count
    at the furthest iteration it reached; new ones from there on."""
    board = RunBoard(tmp_path)
    for iteration, risk in ((15, 0.25), (16, 0.5), (17, 0.875)):
        board.observe_heartbeat({"iteration": iteration})
        board.observe_samples([SimpleNamespace(gpu_id=1, failure_risk=risk)], ["alert"] * (risk > 0.8))
    board.observe_event({"event": "failure", "iteration": 17, "time": 10.0})
    for iteration, risk in ((11, 0.125), (12, 0.125), (16, 0.125), (17, 0.125), (18, 0.25)):
        board.observe_heartbeat({"iteration": iteration})
        board.observe_samples([SimpleNamespace(gpu_id=1, failure_risk=risk)], ["alert"] * (iteration == 12))
    board.observe_event({"event": "failure", "iteration": 12, "time": 20.0})
    board.close()
    risk = scalars(tmp_path, "ftmaster/risk/gpu1")
    assert shown(risk) == risk == [(15, 0.25), (16, 0.5), (17, 0.875), (18, 0.25)]
    assert shown(scalars(tmp_path, "ftmaster/alerts")) == [(17, 2.0)]
    assert shown(scalars(tmp_path, "ftmaster/failures")) == [(17, 1.0), (18, 2.0)]


def event_file(folder):
    (path,) = folder.glob("*tfevents*")
    return path


def test_a_second_launch_on_the_folder_continues_after_the_first(tmp_path):
    """A SLURM requeue, or an operator relaunching after gave_up, starts another ftmaster on
    the same folder. Its board began at iteration 0 with both counts at 0: the risk sampled
    before its first heartbeat went to step 0 and TensorBoard dropped the first launch's whole
    curve, and the counts began again at 1. It continues at the furthest iteration and the
    counts the folder holds; GPU 1's peak there (the failure's) stays the highest sample."""
    first = RunBoard(tmp_path)
    for iteration, risk in ((15, 0.25), (16, 0.875)):
        first.observe_heartbeat({"iteration": iteration})
        first.observe_samples([SimpleNamespace(gpu_id=1, failure_risk=risk)], ["alert"])
    first.observe_event({"event": "failure", "iteration": 16, "time": 10.0})
    first.close()
    first_file = event_file(tmp_path)
    second = RunBoard(tmp_path)
    second.observe_samples([SimpleNamespace(gpu_id=1, failure_risk=0.125)], ["alert"])
    second.observe_heartbeat({"iteration": 11})
    second.observe_samples([SimpleNamespace(gpu_id=1, failure_risk=0.125)], [])
    second.observe_event({"event": "failure", "iteration": 11, "time": 20.0})
    second.observe_heartbeat({"iteration": 17})
    second.observe_samples([SimpleNamespace(gpu_id=1, failure_risk=0.5)], [])
    second.close()
    (second_file,) = set(tmp_path.glob("*tfevents*")) - {first_file}

    def across_launches(tag):
        written = scalars(second_file, tag)
        assert min(step for step, _ in written) >= 16
        return shown(scalars(first_file, tag) + written)

    assert across_launches("ftmaster/risk/gpu1") == [(15, 0.25), (16, 0.875), (17, 0.5)]
    assert across_launches("ftmaster/alerts") == [(15, 1.0), (16, 3.0)]
    assert across_launches("ftmaster/failures") == [(16, 2.0)]


def test_a_file_it_cannot_read_to_the_end_counts_for_what_it_read(tmp_path, caplog):
    """A launch killed mid-write leaves a truncated record; another tool's file may hold no
    events at all. Neither may end the launch: what they hold before the fault counts."""
    first = RunBoard(tmp_path)
    for iteration in (5, 9):
        first.observe_event({"event": "failure", "iteration": iteration, "time": 1.0})
    first.close()
    killed = event_file(tmp_path)
    killed.write_bytes(killed.read_bytes()[:-3])  # the failure at 9 is cut
    with open(tmp_path / "events.out.tfevents.9999999999.other", "wb") as other:
        RecordWriter(other).write(b"\xff" * 16)  # framed, but not an event
    with caplog.at_level(logging.WARNING, logger="ftmaster"):
        board = RunBoard(tmp_path)
    assert board.iteration == 5
    assert len(caplog.records) == 1 and "DecodeError" in caplog.text
    board.observe_event({"event": "failure", "time": 2.0})
    board.close()
    (written,) = set(tmp_path.glob("*tfevents*")) - {killed, tmp_path / other.name}
    assert scalars(written, "ftmaster/failures") == [(5, 2.0)]


def test_a_record_whose_length_is_damaged_ends_the_file_where_it_lies(tmp_path, caplog):
    """A flipped bit in a record's length would read the rest of the file out of step: every
    later event garbage, or a step far beyond the run's."""
    first = RunBoard(tmp_path)
    for iteration in (5, 9):
        first.observe_event({"event": "failure", "iteration": iteration, "time": 1.0})
    first.close()
    damaged = event_file(tmp_path)
    data = bytearray(damaged.read_bytes())
    starts = [0]
    while starts[-1] < len(data):  # each record: length (8), its CRC (4), body, body's CRC (4)
        starts.append(starts[-1] + 16 + struct.unpack_from("<Q", data, starts[-1])[0])
    data[starts[-2]] ^= 0x01  # the last record's length: the failure at 9
    damaged.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ftmaster"):
        board = RunBoard(tmp_path)
    assert board.iteration == 5 and "damaged length" in caplog.text
    board.close()


class FullDisk:
    """tensorboard's writer once its thread failed: every call raises the error again."""

    def __init__(self):
        self.calls = 0

    def _fail(self, *args, **kwargs):
        self.calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    add_scalar = flush = close = _fail


def test_a_writer_that_fails_is_said_once_and_never_raises_into_the_run(tmp_path, caplog):
    """It raised out of the monitor's step (whose lost GPUs were then never told) and out of
    the supervisor, which ended the run."""
    board = RunBoard(tmp_path)
    board.writer.inner.close()
    full = board.writer.inner = FullDisk()
    with caplog.at_level(logging.ERROR, logger="ftmaster"):
        board.observe_samples([SimpleNamespace(gpu_id=0, failure_risk=0.5)], ["alert"])
        board.observe_event({"event": "failure", "iteration": 1, "time": 1.0})
        board.observe_event({"event": "resumed", "iteration": 2, "time": 5.0})
        board.close()
    assert full.calls == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"ftmaster's TensorBoard scalars in {tmp_path} stop here: OSError: [Errno 28] No space "
        "left on device"]


@pytest.mark.parametrize("code, raised", [(errno.ENOSPC, False), (errno.EACCES, True)])
def test_a_board_that_cannot_write_its_first_record_stops_on_a_full_disk_only(
        tmp_path, monkeypatch, caplog, code, raised):
    """SummaryWriter writes and flushes its file's first record as it is made: on a full disk
    ``launch`` refused the run (a requeue onto it never started); a folder it may not write
    still refuses it."""
    def fail(self):
        raise OSError(code, "cannot write")

    monkeypatch.setattr(RecordWriter, "flush", fail)
    if raised:
        with pytest.raises(OSError):
            RunBoard(tmp_path)
        return
    with caplog.at_level(logging.ERROR, logger="ftmaster"):
        board = RunBoard(tmp_path)
        board.observe_event({"event": "failure", "iteration": 1, "time": 1.0})
        board.close()
    assert board.writer.stopped
    assert [r.getMessage() for r in caplog.records] == [
        f"ftmaster's TensorBoard scalars in {tmp_path} stop here: OSError: [Errno {code}] "
        "cannot write"]


def recover(board, failed_at, loaded, seconds, time):
    """One failure at iteration ``failed_at`` and the relaunch that resumed from ``loaded``."""
    board.observe_event({"event": "failure", "iteration": failed_at, "time": time})
    board.observe_event({"event": "checkpoint_loaded", "iteration": loaded})
    board.observe_event({"event": "resumed", "iteration": loaded + 1, "time": time + seconds})


def test_two_recoveries_from_one_checkpoint_are_both_on_the_curves(tmp_path):
    """A failure before the next checkpoint after a relaunch (or after a drain) resumes from
    the checkpoint the first one did: both were written at its iteration, and TensorBoard kept
    only the later. The second is one step past the first."""
    board = RunBoard(tmp_path)
    recover(board, failed_at=120, loaded=100, seconds=30.0, time=10.0)
    recover(board, failed_at=105, loaded=100, seconds=20.0, time=100.0)
    board.close()
    assert shown(scalars(tmp_path, "ftmaster/rto_seconds")) == [(100, 30.0), (101, 20.0)]
    assert shown(scalars(tmp_path, "ftmaster/rpo_iterations")) == [(100, 20.0), (101, 5.0)]


def test_a_recovery_from_an_older_checkpoint_keeps_the_earlier_ones(tmp_path):
    """The memory tier lost with a node, the relaunch resumed from disk, before the iteration an
    earlier recovery resumed from: written at its own iteration it dropped that recovery's
    point. It is keyed past it, as the risk is past the furthest iteration."""
    board = RunBoard(tmp_path)
    recover(board, failed_at=210, loaded=200, seconds=30.0, time=10.0)
    recover(board, failed_at=230, loaded=100, seconds=90.0, time=100.0)
    board.close()
    assert shown(scalars(tmp_path, "ftmaster/rto_seconds")) == [(200, 30.0), (201, 90.0)]
    assert shown(scalars(tmp_path, "ftmaster/rpo_iterations")) == [(200, 10.0), (201, 130.0)]


def test_another_launch_keys_its_recoveries_past_the_earlier_launches(tmp_path):
    """A requeue that resumes from the checkpoint the last launch's recovery did. The steps
    moved past a shared one are not iterations the run reached: the risk stays at the
    furthest iteration."""
    first = RunBoard(tmp_path)
    first.observe_heartbeat({"iteration": 100})
    recover(first, failed_at=100, loaded=100, seconds=30.0, time=10.0)
    recover(first, failed_at=100, loaded=100, seconds=40.0, time=100.0)
    first.close()
    second = RunBoard(tmp_path)
    assert second.iteration == 100
    recover(second, failed_at=100, loaded=100, seconds=50.0, time=200.0)
    second.close()
    assert shown(scalars(tmp_path, "ftmaster/rto_seconds")) == [(100, 30.0), (101, 40.0),
                                                               (102, 50.0)]
