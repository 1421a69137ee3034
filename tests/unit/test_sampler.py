"""Global sample order is independent of the data-parallel size."""

import pytest

from megatron.training.data import micro_batch_indices


def iteration_samples(consumed, global_batch, micro, dp):
    per_rank = global_batch // (micro * dp)
    return [index for rank in range(dp)
            for batch in micro_batch_indices(consumed, micro, rank, dp, per_rank)
            for index in batch]


@pytest.mark.parametrize("micro, dp", [(2, 1), (2, 3), (1, 4), (4, 3), (6, 2)])
def test_each_iteration_covers_exactly_the_next_global_batch(micro, dp):
    for consumed in (0, 72, 84):
        samples = iteration_samples(consumed, 24, micro, dp)
        assert sorted(samples) == list(range(consumed, consumed + len(samples)))


def test_resume_under_new_dp_repeats_and_skips_nothing():
    before = [s for it in range(6) for s in iteration_samples(it * 12, 12, 2, 1)]
    after = [s for it in range(6, 12) for s in iteration_samples(it * 12, 12, 2, 3)]
    assert sorted(before + after) == list(range(144))
