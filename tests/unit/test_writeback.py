"""Writeback pacing: each 8 MB's writeback starts as it is written; the writer waits for the
range 32 MB behind, so a save's dirty pages stay few."""

import ctypes
import errno

import pytest

from ftmaster.recovery import writeback
from ftmaster.recovery.manifest import DigestingWriter, digest_file

MB = 1 << 20


def test_writeback_starts_each_step_and_waits_for_the_one_a_lag_behind(monkeypatch):
    calls = []
    monkeypatch.setattr(writeback, "_CALL", lambda fd, offset, length, flags: calls.append(
        (offset // MB, length // MB, "wait" if flags == writeback._WAIT else "start")) or 0)
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


def failing(code: int, on_flags: int):
    """A sync_file_range that fails with ``code`` on calls with ``on_flags``."""
    calls = []

    def call(fd, offset, length, flags):
        calls.append(flags)
        if flags != on_flags:
            return 0
        ctypes.set_errno(code)
        return -1

    return call, calls


def test_a_failed_writeback_is_raised_not_left_to_an_fsync_that_no_longer_sees_it(monkeypatch):
    """The wait advances the file's writeback error cursor: the fsync that ends the file would
    then return 0, so the error the wait reports is the only report of it."""
    call, _ = failing(errno.EIO, writeback._WAIT)
    monkeypatch.setattr(writeback, "_CALL", call)
    pacer = writeback.Writeback(fd=7)
    with pytest.raises(OSError) as raised:
        for end in range(MB, 65 * MB, MB):
            pacer.written(end)
    assert raised.value.errno == errno.EIO


def test_a_failed_start_is_raised(monkeypatch):
    call, _ = failing(errno.ENOSPC, writeback._START)
    monkeypatch.setattr(writeback, "_CALL", call)
    with pytest.raises(OSError) as raised:
        writeback.Writeback(fd=7).written(8 * MB)
    assert raised.value.errno == errno.ENOSPC


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ESPIPE, errno.ENOSYS])
def test_a_file_that_cannot_be_paced_is_written_unpaced(monkeypatch, code):
    call, calls = failing(code, writeback._START)
    monkeypatch.setattr(writeback, "_CALL", call)
    pacer = writeback.Writeback(fd=7)
    for end in range(MB, 65 * MB, MB):
        pacer.written(end)
    assert calls == [writeback._START] and not pacer.due(64 * MB)
