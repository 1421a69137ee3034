"""The paper's gap filter: an emergency save waits until ``iteration - last_checkpoint >=
ceil(gap_frac x save_interval)``. The trainer applies it (``save_requests``) and the goodput
model counts with it (``ftmaster goodput``, which imports no torch): one rule for both."""

from __future__ import annotations

import math

GAP_DIGITS = 9
"""The product is rounded to this many decimals before its ceiling: 0.07 x 100 is
7.000000000000001 in binary floating point, whose ceiling, 8, is an iteration more than asked."""


def minimum_gap(gap_frac: float, save_interval: int | None) -> int:
    """Iterations an emergency save waits after the last checkpoint: at least the next one,
    so that gap_frac 0 (or no --save-interval) turns the filter off."""
    if not save_interval:
        return 1
    return max(1, math.ceil(round(gap_frac * save_interval, GAP_DIGITS)))
