"""The async save deadline (pure; the stuck writer itself: test_checkpoint_integrity.py)."""

import pytest

from megatron.training.async_saves import AsyncSaves


@pytest.mark.parametrize("timeout_s, longest_s, rank_bytes, deadline_s", [
    (30.0, 500.0, 10**12, 30.0),  # --async-save-timeout is taken as given
    (None, 0.0, 0, 600.0),  # ten minutes at least
    (None, 100.0, 0, 1000.0),  # ten times the longest async save of the attempt
    (None, 0.0, 20 * 10**9, 2000.0),  # a 20 GB share at 10 MB/s: a first save's time
])
def test_the_deadline_gives_a_writer_ten_times_its_due(timeout_s, longest_s, rank_bytes, deadline_s):
    saves = AsyncSaves(queue=None, group=None, timeout_s=timeout_s, abandon=None,
                       rank_bytes=rank_bytes)
    if longest_s:
        saves.ended(object(), longest_s)
    assert saves.deadline_s() == deadline_s
