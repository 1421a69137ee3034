"""Writeback pacing: each 8 MB's writeback starts as it is written; the writer waits for the
range 32 MB behind, so a save's dirty pages stay few."""

from ftmaster.recovery import writeback
from ftmaster.recovery.manifest import DigestingWriter, digest_file

MB = 1 << 20


def test_writeback_starts_each_step_and_waits_for_the_one_a_lag_behind(monkeypatch):
    calls = []
    monkeypatch.setattr(writeback, "_CALL", lambda fd, offset, length, flags: calls.append(
        (offset // MB, length // MB, "wait" if flags == writeback._WAIT else "start")))
    pacer = writeback.Writeback(fd=7)
    for end in range(MB, 65 * MB, MB):
        pacer.written(end)
    starts = [(offset, length) for offset, length, kind in calls if kind == "start"]
    waits = [(offset, length) for offset, length, kind in calls if kind == "wait"]
    assert starts == [(offset, 8) for offset in range(0, 64, 8)]
    assert waits == [(0, 8), (8, 8), (16, 8), (24, 8)]  # never closer than 32 MB behind


def test_a_paced_file_holds_what_was_written(tmp_path):
    block = bytes(range(256)) * (MB // 256)
    with DigestingWriter(tmp_path / "f") as writer:
        for _ in range(20):
            writer.write(block)
    assert (tmp_path / "f").read_bytes() == block * 20
    assert writer.digest() == digest_file(tmp_path / "f")
