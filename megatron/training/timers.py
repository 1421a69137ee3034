"""Time spent in a block, added up under a name."""

from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def seconds_into(totals: dict[str, float], name: str):
    """Add the block's wall time to ``totals[name]`` (which starts at 0)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
