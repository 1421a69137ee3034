"""The straggler detector (pure: figures and a config in, assessments out), the tracker that
turns them into reports once, the supervisor's step times and drain decision, and the
trainer's side: the slowdown a rehearsal arms and the figures the heartbeat carries."""

import random
import re
import statistics
import time

import pytest

from ftmaster.monitor.stragglers import (Straggler, StragglerConfig, StragglerTracker, assess,
                                         held_slowdowns)
from ftmaster.recovery.planner import PlanError
from ftmaster.stragglers import Found, StragglerWatch, decide_drain
from megatron.training.rehearsal import Slowdown
from megatron.training.step_timing import KEPT, ComputeFigures, ComputeTimer

FOUR = {0: 0, 1: 0, 2: 0, 3: 0}
THREE_WIDE = StragglerConfig(window=3)


def figures(rows: dict[int, list[float]]) -> dict[int, dict[int, float]]:
    return {it: dict(enumerate(ms)) for it, ms in rows.items()}


def by_iteration(history: dict[int, list[float]]) -> dict[int, dict[int, float]]:
    """Per-rank compute times, all of the same iterations, as a heartbeat carries them."""
    return {it: {rank: times[it] for rank, times in history.items() if it < len(times)}
            for it in range(max(map(len, history.values())))}


@pytest.mark.parametrize("history, stages, expected", [
    # the least of the window against the peers' medians
    ({0: [10, 10, 10], 1: [20, 25, 30], 2: [10, 11, 9], 3: [10, 10, 10]}, FOUR, {1: 2.0}),
    # one slow iteration (a busy host) does not make a rank slow
    ({0: [10, 40, 10], 1: [10, 10, 10], 2: [10, 10, 10], 3: [10, 10, 10]}, FOUR, {0: 1.0}),
    # ranks of another pipeline stage are not its peers
    ({0: [30, 30, 30], 1: [30, 30, 30], 2: [10, 10, 10], 3: [10, 10, 10]},
     {0: 0, 1: 0, 2: 1, 3: 1}, {0: 1.0, 2: 1.0}),
    # too few iterations: no assessment yet
    ({0: [10, 10], 1: [30, 30]}, FOUR, {}),
])
def test_assess_compares_a_ranks_least_recent_compute_with_its_peers(history, stages, expected):
    judged = {a.rank: a.slowdown for a in assess(by_iteration(history), stages, THREE_WIDE)}
    for rank, slowdown in expected.items():
        assert judged[rank] == pytest.approx(slowdown)
    assert expected or not judged


def test_each_rank_is_compared_with_the_median_of_its_stages_other_ranks():
    """Read by index from the stage's sorted medians; the same as taking the rank out (two
    iterations: no figure has a neighbour on both sides to be raised to)."""
    rng = random.Random(5)
    stages = {rank: rank % 3 for rank in range(40)}
    history = {rank: [rng.choice([10.0, 12.0, 20.0, 10 + rng.random()]) for _ in range(2)]
               for rank in stages}
    for judged in assess(by_iteration(history), stages, StragglerConfig(window=2)):
        peers = [statistics.median(history[other]) for other in stages
                 if other != judged.rank and stages[other] == stages[judged.rank]]
        assert judged.slowdown == min(history[judged.rank]) / statistics.median(peers)


def test_a_lone_dip_is_raised_to_the_lesser_of_its_neighbours_a_step_is_not():
    """Rank 1 dips at its second figure and steps down at its fourth (window 3): the dip
    reads 18 (its neighbours 20 and 18), the step's first figure its own 10."""
    history = {0: [10.0] * 5, 1: [20.0, 5.0, 18.0, 10.0, 10.0], 2: [10.0] * 5}
    (_, one, _) = assess(by_iteration({r: h[:3] for r, h in history.items()}), FOUR, THREE_WIDE)
    assert one.slowdown == pytest.approx(1.8)  # 20, 18 (raised) and 18 (the newest, as is)
    (_, one, _) = assess(by_iteration(history), FOUR, THREE_WIDE)
    assert (one.slowdown, one.before) == (pytest.approx(1.0), pytest.approx(1.0))


def test_drift_is_against_the_ranks_own_earlier_median():
    history = {0: [10, 10, 10, 20, 20, 20], 1: [20] * 6}
    (zero, one) = assess(by_iteration(history), FOUR, THREE_WIDE)
    assert zero.drift == pytest.approx(2.0) and one.drift == pytest.approx(1.0)


def slow_rows(slow_from: int, until: int, factor: float = 2.0, rank: int = 1):
    return {it: [10.0 * (factor if r == rank and it >= slow_from else 1.0) for r in range(4)]
            for it in range(1, until + 1)}


def test_held_slowdowns_is_the_least_ratio_that_would_have_named_each_rank():
    """Rank 1 reads 1.6x for 3 iterations and 1.4x for 4 more (window 1): named at 1.4, not
    1.6; an unknown figure leaves its run as it was, as the tracker does."""
    rows = {it: [10.0, 10.0 * (1.6 if it < 3 else 1.4 if it < 7 else 1.0), 10.0, 10.0]
            for it in range(10)}
    config = StragglerConfig(ratio=1.3, iterations=4, window=1)
    held = held_slowdowns(figures(rows), FOUR, config)
    assert held[1] == pytest.approx(1.4) and held[0] == pytest.approx(1.0)
    # an unknown figure is neither slow nor fast: 1.4x at 3, 4, 6 and 7 is a run of four,
    # at 3, 4 and 6 a run of three
    for slow, expected in (((3, 4, 6, 7), 1.4), ((3, 4, 6), 1.0)):
        gapped = figures({it: [10.0, 14.0 if it in slow else 10.0, 10.0, 10.0]
                          for it in range(10)}) | {5: {0: 10.0, 1: None, 2: 10.0, 3: 10.0}}
        assert held_slowdowns(gapped, FOUR, config)[1] == pytest.approx(expected)
        tracker = StragglerTracker(StragglerConfig(ratio=1.4, iterations=4, window=1))
        assert [s.rank for s in tracker.observe(gapped, FOUR)] == ([1] if expected > 1 else [])
    # the tracker names rank 1 at exactly that ratio, and not just above it
    for ratio, named in ((1.4, [1]), (1.41, [])):
        tracker = StragglerTracker(StragglerConfig(ratio=ratio, iterations=4, window=1))
        assert [s.rank for s in tracker.observe(figures(rows), FOUR)] == named


def test_a_rank_slow_for_the_set_iterations_is_reported_once():
    tracker = StragglerTracker(StragglerConfig(ratio=1.3, iterations=4, window=3))
    found = tracker.observe(figures(slow_rows(8, 30)), FOUR)
    assert [(s.rank, s.iteration, s.since, s.slowdown) for s in found] == [(1, 13, 8, 2.0)]
    assert tracker.observe(figures({31: [10, 20, 10, 10]}), FOUR) == []


@pytest.mark.parametrize("unknown_at", [(), (9,), (9, 11, 13), tuple(range(9, 30, 2))])
def test_a_straggler_is_slow_since_its_windows_first_figure_however_many_are_unknown(unknown_at):
    """Its window holds its last four figures: with unknown ones between, it spans more
    iterations than four. Counted back four iterations from where its run began, a rank
    slow from 8 and unknown at every odd iteration was slow "since 11", and the step time
    the drain calibrates on (up to the iteration before) took in three slowed steps."""
    rows = figures(slow_rows(8, 30))
    for iteration in unknown_at:
        rows[iteration][1] = None
    (found,) = StragglerTracker().observe(rows, FOUR)
    assert found.since == 8

@pytest.mark.parametrize("fast_at, namings", [((20,), [(11, 8)]), ((20, 21), [(11, 8), (25, 22)])])
def test_with_one_iteration_to_name_a_lone_fast_figure_lets_no_straggler_go(fast_at, namings):
    """--straggler-iterations 1: one fast figure let a named rank go while the same figure
    was held as a dip, so the next slow one named the same slowdown (since 8) a second
    time. Two fast ones in a row let it go, and a slowdown after them is named anew."""
    rows = slow_rows(8, 30)
    for iteration in fast_at:
        rows[iteration][1] = 10.0
    found = StragglerTracker(StragglerConfig(iterations=1)).observe(figures(rows), FOUR)
    assert [(s.iteration, s.since) for s in found] == namings

def test_by_default_a_rank_slowed_2x_from_iteration_8_is_reported_at_14_and_a_5_iteration_burst_never():
    tracker = StragglerTracker()
    assert [s.iteration for s in tracker.observe(figures(slow_rows(8, 30)), FOUR)] == [14]
    burst = {it: [10.0, 13.0 if 20 <= it < 25 else 10.0, 10.0, 10.0] for it in range(1, 40)}
    assert StragglerTracker().observe(figures(burst), FOUR) == []


@pytest.mark.parametrize("dip, named", [(9, 14), (10, 14), (11, 14), (12, 14), (13, 14),
                                        (14, 15), (8, 15)])
def test_a_straggler_that_dips_once_is_named_at_14_unless_at_its_first_or_last_slow_one(dip, named):
    """A lone fast figure holds the run until the next one: slow, it was a dip. A CI run's
    2x straggler was named at 18, its run broken by one figure for the window's 4
    iterations. A dip at 14 is known to be one only at 15; one at 8 is where the slowdown
    begins, as far as the figures tell (since 9)."""
    rows = slow_rows(8, 30)
    rows[dip][1] = 10.0
    (found,) = StragglerTracker().observe(figures(rows), FOUR)
    assert (found.iteration, found.since) == (named, 8 if dip > 8 else 9)
    assert held_slowdowns(figures(rows), FOUR, StragglerConfig())[1] == pytest.approx(2.0)


def test_two_fast_figures_in_a_row_break_the_run_and_a_burst_needs_7_slow_iterations():
    rows = slow_rows(8, 30)
    rows[10][1] = rows[11][1] = 10.0
    assert [s.iteration for s in StragglerTracker().observe(figures(rows), FOUR)] == [18]
    for length, dip, named in ((6, None, []), (6, 23, []), (7, None, [26]), (7, 23, [26])):
        burst = {it: [10.0, 16.0 if 20 <= it < 20 + length and it != dip else 10.0, 10.0, 10.0]
                 for it in range(1, 40)}
        assert [s.iteration for s in StragglerTracker().observe(figures(burst), FOUR)] == named
        held = held_slowdowns(figures(burst), FOUR, StragglerConfig())[1]
        assert held == pytest.approx(1.6 if named else 1.0)


def test_only_a_windows_lowest_dip_is_raised_a_rank_slow_every_other_iteration_is_not_named():
    """Every fast figure of a rank slow every other iteration lies under both its neighbours:
    raised, each of them, it was named at 2.0x, slow at 4 of 7 iterations. Slow 3 in 4, it
    is named: one fast figure in every window."""
    for pattern, named in (((20.0, 10.0), []), ((20.0, 20.0, 20.0, 10.0), [1])):
        rows = {it: [10.0, pattern[it % len(pattern)], 10.0, 10.0] for it in range(1, 40)}
        assert [s.rank for s in StragglerTracker().observe(figures(rows), FOUR)] == named
        held = held_slowdowns(figures(rows), FOUR, StragglerConfig())[1]
        assert held == pytest.approx(2.0 if named else 1.0)


def test_held_slowdowns_forgets_a_rank_silent_for_the_span_a_naming_rests_on():
    """Rank 2 is slow at 3-7, dips at 8, says nothing at 9-15 (the tracker forgets it), then
    is slow at 16-18 only: no run of 4 slow judgments, at any ratio."""
    rows = {it: {0: 10.0, 1: 10.0, 3: 10.0} for it in range(1, 25)}
    for it in range(1, 25):
        if not 9 <= it <= 15:
            rows[it][2] = 20.0 if 3 <= it <= 7 or 16 <= it <= 18 else 10.0
    held = held_slowdowns(rows, FOUR, StragglerConfig())[2]
    assert held < 1.5 and StragglerTracker().observe(rows, FOUR) == []


def test_iterations_seen_before_are_ignored_and_missing_figures_are_unknown():
    tracker = StragglerTracker(StragglerConfig(ratio=1.3, iterations=4, window=3))
    rows = slow_rows(8, 12)
    assert tracker.observe(figures(rows), FOUR) == []
    assert tracker.observe(figures(rows), FOUR) == []  # the same heartbeat polled twice
    # iteration 13 lacks rank 1's figure: its run neither grows nor breaks
    assert tracker.observe({13: {0: 10.0, 2: 10.0, 3: 10.0}}, FOUR) == []
    (found,) = tracker.observe(figures({14: [10, 20, 10, 10]}), FOUR)
    assert (found.rank, found.iteration) == (1, 14)


def test_a_straggler_that_recovers_rearms_after_as_many_fast_iterations():
    tracker = StragglerTracker(StragglerConfig(ratio=1.3, iterations=2, window=1))
    rows = {1: [10, 20, 10, 10], 2: [10, 20, 10, 10], 3: [10, 10, 10, 10],
            4: [10, 20, 10, 10], 5: [10, 20, 10, 10]}
    assert [s.iteration for s in tracker.observe(figures(rows), FOUR)] == [2]  # one dip: same
    rows = {6: [10] * 4, 7: [10] * 4, 8: [10, 20, 10, 10], 9: [10, 20, 10, 10]}
    assert [s.iteration for s in tracker.observe(figures(rows), FOUR)] == [9]


def test_a_straggler_that_dips_for_an_iteration_is_the_same_straggler():
    """By default one fast iteration (20) made a 4-iteration window's least fast 4 times in a
    row: rank 1 was let go as fast again and named anew at 27, one event every 8 iterations
    for a rank slow 7 iterations in 8."""
    tracker = StragglerTracker()
    rows = slow_rows(8, 40)
    rows[20][1] = 10.0
    assert [s.iteration for s in tracker.observe(figures(rows), FOUR)] == [14]
    assert tracker.still_slow(1)
    slow_7_in_8 = {it: [10.0, 10.0 if it % 8 == 0 else 20.0, 10.0, 10.0] for it in range(1, 200)}
    assert len(StragglerTracker().observe(figures(slow_7_in_8), FOUR)) == 1


def test_a_figure_that_is_no_time_is_unknown_never_slow_nor_fast():
    """A NaN (JSON takes one) compared as slow for every rank it was a peer of: the healthy
    ranks 0, 2 and 3 were named with a slowdown of nan. A negative one made a slow rank fast."""
    for bad in (float("nan"), float("inf"), -5.0, 0, "20", True, None, 10 ** 400):
        rows = slow_rows(8, 30)
        for it in range(10, 30):
            rows[it][2] = bad  # a peer's
        assert [s.rank for s in StragglerTracker().observe(figures(rows), FOUR)] == [1], bad
        rows = slow_rows(8, 30)
        rows[13][1] = bad  # the straggler's own, in its slow run: the run waits an iteration
        assert [(s.rank, s.iteration, s.slowdown) for s in StragglerTracker().observe(
            figures(rows), FOUR)] == [(1, 15, 2.0)], bad


def test_a_peer_without_recent_figures_is_no_yardstick_when_every_rank_slows():
    """PP2 x DP2, a hot room: every rank computes 2x slower from iteration 30, and rank 1,
    rank 0's only peer, has had no figure since 20 (unknown). Rank 0 was named 2x slower
    than rank 1's figures of before 20."""
    rows = {it: [10.0 * (2 if it >= 30 else 1), 10.0, 30.0 * (2 if it >= 30 else 1), 30.0]
            for it in range(4, 60)}
    for it in range(20, 60):
        rows[it][1] = None
        rows[it][3] = 60.0 if it >= 30 else 30.0
    found = StragglerTracker().observe(figures(rows), {0: 0, 1: 0, 2: 1, 3: 1})
    assert found == []


def test_a_rank_of_unknown_stage_has_no_peers():
    """Ranks 1 and 3, of unknown stages, were compared as if of one (rank 1 named 3x)."""
    history = {0: [10, 10, 10], 1: [30, 30, 30], 2: [10, 10, 10], 3: [10, 10, 10]}
    judged = {a.rank: a.slowdown for a in assess(by_iteration(history), {0: 0, 2: 0}, THREE_WIDE)}
    assert judged == {0: 1.0, 2: 1.0}


@pytest.mark.parametrize("compute", [
    [1, 2], "x", {"ms": [1, 2]}, {"ms": {"abc": [1, 2]}}, {"ms": {"10.0": [1, 2]}},
    {"ms": {"10": None}}, {"ms": {"10": 5}}, {"stages": 3, "ms": {}}, {"stages": "ab", "ms": {}},
    {"ms": {"9" * 5000: [1, 2]}},
])
def test_a_heartbeat_the_trainer_did_not_write_names_no_one_and_ends_nothing(compute):
    watch = StragglerWatch(StragglerConfig(), drain=False, drain_window_s=600)
    watch.new_attempt([0, 1, 2, 3], 0)
    for it in range(1, 30):
        assert watch.observe({"iteration": it, "time": float(it), "compute": compute}) == []
    assert watch.observe({"iteration": 30, "time": None}) == []
    assert watch.observe({"iteration": 31, "time": "soon"}) == []
    assert watch.observe({"iteration": 32, "time": 10 ** 400}) == []


def test_a_straggler_whose_replica_mate_is_slow_too_says_so():
    """TP2 x DP2: ranks 0 and 1 are one replica. Rank 0 slows in every layer and rank 1, its
    tensor-parallel partner, waits for it in every all-reduce: both are slow against ranks 2
    and 3, and neither can be told for the culprit."""
    tracker = StragglerTracker(StragglerConfig(ratio=1.3, iterations=4, window=3))
    rows = {it: [20.0 if it >= 8 else 10.0] * 2 + [10.0, 10.0] for it in range(1, 30)}
    found = tracker.observe(figures(rows), FOUR, {0: 0, 1: 0, 2: 1, 3: 1})
    assert [(s.rank, s.slow_mates) for s in found] == [(0, (1,)), (1, (0,))]
    assert tracker.slow_mates(0) == (1,) and tracker.slow_mates(2) == ()
    # alone in its replica (DP only), a straggler has none
    tracker = StragglerTracker(StragglerConfig(ratio=1.3, iterations=4, window=3))
    (alone,) = tracker.observe(figures(slow_rows(8, 30)), FOUR, {0: 0, 1: 1, 2: 2, 3: 3})
    assert alone.slow_mates == ()


def test_a_straggler_whose_figures_stop_is_unknown_not_still_slow():
    """Rank 1 was named, then its figures stopped (iteration 20 on). It stayed slow for the
    rest of the attempt: rank 0, of its replica, named at 35, was said to be slow beside it
    (and kept from a drain for it). Back with slow figures, rank 1 is named anew."""
    config = StragglerConfig(ratio=1.3, iterations=4, window=3)
    tracker = StragglerTracker(config)
    replicas = {0: 0, 1: 0, 2: 1, 3: 1}
    rows = slow_rows(8, 40)
    for it in range(20, 41):
        rows[it][1] = None
        rows[it][0] = 20.0 if it >= 30 else 10.0
    found = tracker.observe(figures(rows), FOUR, replicas)
    assert [(s.rank, s.iteration, s.slow_mates) for s in found] == [(1, 13, ()), (0, 35, ())]
    assert not tracker.still_slow(1) and tracker.slow_mates(0) == ()
    # a gap shorter than the span a naming rests on (window + iterations - 1) keeps it
    short = StragglerTracker(config)
    rows = slow_rows(8, 30)
    for it in range(20, 25):  # 5 iterations, the span is 6
        rows[it][1] = None
    assert [s.iteration for s in short.observe(figures(rows), FOUR, replicas)] == [13]
    assert short.still_slow(1)
    # back and slow after the long gap: named anew
    again = tracker.observe(figures({it: [20.0, 20.0, 10.0, 10.0] for it in range(41, 50)}),
                            FOUR, replicas)
    assert [(s.rank, s.slow_mates) for s in again] == [(1, (0,))]


@pytest.mark.parametrize("back_at, named", [(1.9, True), (1.0, False)])
def test_a_straggler_silent_then_back_is_not_known_fast_until_named_anew_or_fast(back_at, named):
    """Silent for longer than a naming's span, a named rank is unknown: not still slow (it
    is no slow mate, and not drained), yet not known fast either. Back at 1.9x it read as fast
    until named anew, so a drain of another straggler weighed the GPUs left without it."""
    tracker = StragglerTracker()
    rows = slow_rows(8, 28, factor=1.9)
    for it in range(20, 27):  # 7 iterations: the naming's span
        rows[it][1] = None
    rows[27][1] = rows[28][1] = 10.0 * back_at  # back, for fewer than ``iterations``
    assert [s.iteration for s in tracker.observe(figures(rows), FOUR)] == [14]
    assert not tracker.still_slow(1) and tracker.not_known_fast(1)
    later = slow_rows(1, 40, factor=back_at)  # the iterations seen already are ignored
    assert [s.rank for s in tracker.observe(figures(later), FOUR)] == ([1] if named else [])
    assert tracker.still_slow(1) is named and tracker.not_known_fast(1) is named
    assert not tracker.not_known_fast(0)


@pytest.mark.parametrize("kwargs, words", [
    ({"ratio": 1.0}, "ratio must be above 1"),
    ({"iterations": 0}, "iterations must be at least 1"),
    ({"window": 0}, "window must be at least 1"),
    ({"window": 40}, "history .* must hold at least two windows"),
])
def test_the_config_is_checked(kwargs, words):
    with pytest.raises(ValueError, match=words):
        StragglerConfig(**kwargs)


def beat(iteration, time_s, rows=None):
    body = {"iteration": iteration, "time": time_s}
    if rows:
        body["compute"] = {"stages": [0, 0, 0, 0],
                           "ms": {str(it): ms for it, ms in rows.items()}}
    return body


def test_the_watch_maps_ranks_to_gpus_and_measures_the_step_before_and_after():
    watch = StragglerWatch(StragglerConfig(ratio=1.3, iterations=4, window=3), drain=False,
                           drain_window_s=600)
    watch.new_attempt([4, 5, 6, 7], 0)
    found = []
    for it in range(1, 31):  # 1 s per iteration, 2 s once rank 1 slows at 12
        time_s = it + max(0, it - 11)  # a heartbeat is written as its iteration ends
        found += watch.observe(beat(it, time_s, {it - 1: slow_rows(12, 40)[it - 1]} if it > 1 else None))
    (straggler,) = found
    assert straggler.gpu == 5 and straggler.straggler.since == 12
    assert straggler.healthy_step_s == pytest.approx(1.0)
    assert straggler.step_s == pytest.approx(2.0)


def test_the_step_before_the_slowdown_holds_no_slow_iteration():
    """Resumed at 7, so after the warm-up one healthy step precedes the slowdown at 12: the
    step that ends at iteration 12's heartbeat is the first slow one, not a healthy one (with
    it the median read 1.5 s), so there is no healthy measure."""
    watch = StragglerWatch(StragglerConfig(), drain=True, drain_window_s=600)
    watch.new_attempt([0, 1, 2, 3], 0)
    found, time_s = [], 0.0
    for it in range(7, 30):
        time_s += 2.0 if it >= 12 else 1.0
        found += watch.observe(beat(it, time_s, {it - 1: slow_rows(12, 40)[it - 1]} if it > 7 else None))
    (straggler,) = found
    assert straggler.straggler.since == 12 and straggler.healthy_step_s is None


def watch_slowed_at_8(first_polled, noisy_from=8):
    """4 ranks at 1 s per iteration, 2 s once rank 1 is slowed at 8; rank 1's own figures are
    slow from ``noisy_from`` (a busy host); polled first at ``first_polled``, every iteration on,
    each heartbeat carrying the last 16 iterations' figures as the trainer writes them."""
    watch = StragglerWatch(StragglerConfig(), drain=False, drain_window_s=600)
    watch.new_attempt([0, 1, 2, 3], 0)
    rows, found = slow_rows(noisy_from, 40), []
    for it in range(first_polled, 31):
        body = beat(it, it + max(0, it - 7), {i: rows[i] for i in range(max(1, it - 16), it)})
        found += watch.observe({**body, "first_iteration": 1})
    (straggler,) = found
    return straggler


def test_the_warm_up_counts_from_the_attempts_first_iteration_not_the_first_one_polled():
    """A supervisor that first reads iteration 4's heartbeat still has iterations 4-7 healthy
    after the attempt's 3 warm-up iterations (the heartbeat says the attempt began at 1)."""
    straggler = watch_slowed_at_8(first_polled=4)
    assert straggler.straggler.since == 8
    assert straggler.healthy_step_s == pytest.approx(1.0)


def test_a_straggler_slow_from_just_after_the_warm_up_has_no_healthy_step():
    """Rank 1 computed slowly from iteration 6 (a busy host), so the window names it from 6:
    after the warm-up (iterations 1-3) only the step from 4 to 5 precedes it, one step, no
    median. The e2e run that saw ``since`` 6 had this, not a missed measurement."""
    straggler = watch_slowed_at_8(first_polled=1, noisy_from=6)
    assert straggler.straggler.since == 6 and straggler.healthy_step_s is None
    assert watch_slowed_at_8(first_polled=1, noisy_from=7).healthy_step_s == pytest.approx(1.0)


def test_a_straggler_on_another_node_is_compared_but_left_to_that_node_to_name():
    """Node 1 holds global ranks 2 and 3 on its GPUs 0 and 1; rank 1 (node 0's) slows."""
    found = {}
    for offset in (0, 2):
        watch = StragglerWatch(StragglerConfig(ratio=1.3, iterations=4, window=3), drain=False,
                               drain_window_s=600)
        watch.new_attempt([0, 1], offset)
        found[offset] = [f for it in range(2, 31)
                         for f in watch.observe(beat(it, it, {it - 1: slow_rows(12, 40)[it - 1]}))]
    assert [(f.gpu, f.straggler.rank) for f in found[0]] == [(1, 1)]
    assert found[2] == []


def test_a_drain_is_weighed_on_the_steps_seen_since_the_slowdown_until_now():
    watch = StragglerWatch(StragglerConfig(), drain=True, drain_window_s=600)
    watch.new_attempt([0, 1, 2, 3], 0)
    for it in range(1, 10):
        watch.observe(beat(it, float(it)))
    named_early = found_with(None)  # since iteration 8: one step seen
    assert watch.remeasured(named_early) is named_early
    for it in range(10, 20):  # 3 s per iteration from 10 on
        watch.observe(beat(it, 9.0 + 3 * (it - 9)))
    assert watch.remeasured(named_early).step_s == pytest.approx(3.0)


class _Plan:
    tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size = 1, 1, 3

    def __init__(self, step, global_batch_size=16):
        self.estimated_step_seconds, self.global_batch_size = step, global_batch_size


def found_with(step_s, healthy=1.0):
    return Found(1, Straggler(1, 13, 8, 2.0, 2.0, 20.0, 10.0), step_s, healthy)


@pytest.mark.parametrize("found, estimate, drain, words", [  # calibrated on 1.0 s
    (found_with(2.0), lambda: _Plan(1.33), True, r"^draining GPU 1: the job runs 2.000 s/iteration"
                                                  r".* estimates 1.330 s/iteration on the 3 GPUs"
                                                  r".*calibrated on the original layout's "
                                                  r"1.000 s/iteration without the slowdown$"),
    (found_with(1.2), lambda: _Plan(1.33), False, "^keeping GPU 1: the job runs 1.200"),
    (found_with(2.0), lambda: (_ for _ in ()).throw(PlanError("no layout fits")), False,
     r"the 3 GPUs left cannot run the job \(no layout fits\)"),
    (found_with(2.0), lambda: _Plan(None), False,
     r"^keeping GPU 1: the cost model has no step estimate for the 3 GPUs left$"),
])
def test_the_drain_decision_names_the_estimate_that_decided(found, estimate, drain, words):
    decision = decide_drain(found, 3, estimate, 1.0, 16)
    assert decision.drain is drain
    assert re.search(words, decision.line), decision.line
    assert "\n" not in decision.line


def test_one_gpu_left_is_said_in_the_singular():
    """Draining one of 2 GPUs read "on the 1 GPUs left"."""
    decision = decide_drain(found_with(2.0), 1, lambda: _Plan(1.33), 1.0, 16)
    assert "estimates 1.330 s/iteration on the GPU left (TP1" in decision.line, decision.line


def test_a_gain_the_line_cannot_show_drains_nothing_and_a_tie_says_so():
    """An estimate 0.4 ms under the step now drained GPU 1 on a line that read 1.200 against
    1.200: a restart for no gain the line could show."""
    for estimate in (1.2, 1.1996):
        decision = decide_drain(found_with(1.2), 3, lambda: _Plan(estimate), 1.0, 16)
        assert not decision.drain
        assert re.search(r"^keeping GPU 1: the job runs 1.200 s/iteration with it .*; the cost "
                         r"model estimates the same 1.200 s/iteration on the 3 GPUs left",
                         decision.line), decision.line


def test_the_gpus_left_are_weighed_on_the_jobs_global_batch():
    """--global-batch-tolerance 10, 4 GPUs at batch 16 slowed to 1.3 s/iteration: the 3 left
    train batch 15 at 1.25 s/iteration, fewer samples an iteration, 1.333 s for 16. GPU 1 was
    drained on 1.25 against 1.3, for a job that then trained slower."""
    decision = decide_drain(found_with(1.3), 3, lambda: _Plan(1.25, global_batch_size=15), 1.0,
                            16)
    assert not decision.drain
    assert re.search(r"^keeping GPU 1: the job runs 1.300 s/iteration with it .*; the cost "
                     r"model estimates 1.250 s/iteration on the 3 GPUs left \(TP1 x PP1 x DP3, "
                     r"global batch 15\): 1.333 s for the job's 16 samples, calibrated",
                     decision.line), decision.line
    decision = decide_drain(found_with(1.4), 3, lambda: _Plan(1.25, global_batch_size=15), 1.0,
                            16)
    assert decision.drain and "1.333 s for the job's 16 samples" in decision.line


def test_a_cost_model_that_gives_no_estimate_is_not_said_to_find_no_layout():
    """A step the model could not be calibrated on read as "the 3 GPUs left cannot run the
    job", though the planner had a layout for them."""
    too_short = ValueError("a measured step time of 1e-300 s is too short to calibrate the "
                           "cost model on")
    decision = decide_drain(found_with(2.0), 3, lambda: (_ for _ in ()).throw(too_short), 1e-300,
                            16)
    assert not decision.drain
    assert decision.line == ("keeping GPU 1: the cost model has no step estimate for the 3 GPUs "
                             "left (a measured step time of 1e-300 s is too short to calibrate "
                             "the cost model on)"), decision.line


def test_an_uncalibrated_cost_model_drains_nothing():
    """Its seconds are not this host's: 1.33 estimated against 2.0 measured says nothing."""
    decision = decide_drain(found_with(2.0), 3, lambda: _Plan(1.33), None, 16)
    assert not decision.drain
    assert decision.line.startswith("keeping GPU 1: no step of the original layout without the "
                                    "slowdown is measured"), decision.line


def test_a_drain_is_weighed_with_the_straggler_that_would_stay():
    """GPU 1 at 2.0x and GPU 2 at 1.9x: GPU 1 was drained on the healthy estimate for the GPUs
    left, GPU 2 among them, and the job then ran at GPU 2's pace, slower than before."""
    staying = Found(2, Straggler(2, 13, 8, 1.9, 1.9, 1800.0, 1000.0), 1.9, 1.0)
    decision = decide_drain(found_with(2.0), 3, lambda: _Plan(1.33), 1.0, 16,
                            held_back_by=staying)
    assert not decision.drain
    assert re.search(r"estimates 1.330 s/iteration on the 3 GPUs left \(TP1 x PP1 x DP3\), "
                     r"plus the 0.800 s GPU 2 computes beyond its peers \(1.90x\): 2.130 "
                     r"s/iteration, calibrated", decision.line), decision.line
    barely = Found(2, Straggler(2, 13, 8, 1.2, 1.2, 1200.0, 1000.0), 1.2, 1.0)
    assert decide_drain(found_with(2.0), 3, lambda: _Plan(1.33), 1.0, 16,
                        held_back_by=barely).drain


def test_one_drain_per_window():
    watch = StragglerWatch(StragglerConfig(), drain=True, drain_window_s=600)
    assert watch.drain_allowed(1000.0)
    watch.drained(1000.0, 2.0)
    assert not watch.drain_allowed(1500.0) and watch.drain_allowed(1600.0)
    watch.new_attempt([0, 2, 3], 0)
    assert watch.drained_step_s == 2.0  # reported beside the new attempt's


def test_a_slowdown_is_armed_at_its_iteration_or_read_from_its_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FTMASTER_RANK_DIR", str(tmp_path))
    monkeypatch.setenv("FTMASTER_INJECT_SLOW", "1:8:2.0,0:3:5")
    slowdown = Slowdown(1)
    assert (slowdown.current(7), slowdown.current(8)) == (1.0, 2.0)
    (tmp_path / "slow_1").write_text("3.5\n")
    assert slowdown.current(1) == 3.5
    (tmp_path / "slow_1").write_text("garbage")  # mid-write: the factor as it was
    assert slowdown.current(1) == 3.5


def test_the_heartbeat_keeps_the_last_iterations_figures_in_ms():
    figures = ComputeFigures([0, 0, 1, 1], [0, 1, 0, 1])
    assert figures.heartbeat() is None
    figures.record(0, [0, 0, 0, 0])  # nothing measured: nothing kept
    for iteration in range(1, KEPT + 5):
        figures.record(iteration, [1500, 0, 2500, 3000])
    body = figures.heartbeat()
    assert body["stages"] == [0, 0, 1, 1] and len(body["ms"]) == KEPT
    assert body["replicas"] == [0, 1, 0, 1]
    assert body["ms"][str(KEPT + 4)] == [1.5, None, 2.5, 3.0]


def test_the_compute_timer_reads_the_last_complete_iteration():
    timer = ComputeTimer(cuda=False)
    assert timer.previous_microseconds() == 0
    timer.start()
    timer.reduction_entered()
    timer.start()  # the next iteration: the last one is readable
    assert timer.previous_microseconds() >= 1
    timer.start()  # an iteration that never reached the reduction (an evaluation)
    assert timer.previous_microseconds() == 0


def _busy(seconds: float) -> None:
    """Compute on this thread's core for ``seconds`` of its CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_a_cpu_figure_leaves_out_the_time_the_rank_was_off_its_core():
    """On a busy 2-core host a healthy rank's thread lost its core, its lock or its read to
    other work for tens of ms at a time without waiting on a run queue: counted, a healthy
    rank of 2 was named a straggler at 1.35x."""
    timer = ComputeTimer(cuda=False)
    timer.start()
    time.sleep(0.2)
    timer.reduction_entered()
    timer.start()
    assert 1 <= timer.previous_microseconds() < 50_000


def test_a_rehearsed_slowdown_makes_a_cpu_figure_factor_times_its_compute():
    timer = ComputeTimer(cuda=False)
    timer.start()
    _busy(0.05)
    timer.slow_down(2.0)
    timer.reduction_entered()
    timer.start()
    assert 95_000 <= timer.previous_microseconds() < 130_000


def test_the_calibration_is_the_lesser_of_the_step_before_and_the_step_now_less_the_extra():
    found = Found(1, Straggler(1, 13, 8, 2.0, 2.0, 500.0, 250.0), 0.6, 0.9)
    assert found.without_extra_s() == pytest.approx(0.35)
    assert found.calibration_s() == pytest.approx(0.35)  # the step before was a warm-up's
    # the typical extra, not the least: 600 ms median against the peers' 250
    typical = Found(1, Straggler(1, 13, 8, 2.0, 2.0, 500.0, 250.0, 600.0), 0.99, 0.62)
    assert typical.without_extra_s() == pytest.approx(0.64)
    assert typical.calibration_s() == pytest.approx(0.62)  # the host made the wait longer
    assert Found(1, Straggler(1, 13, 8, 2.0, 2.0, 500.0, 250.0), None, None).calibration_s() is None


def test_the_step_after_a_drain_is_a_median_no_save_in_two_steps_decides():
    """Two steps after the warm-up, one holding a save, made a drain that sped the job up
    read as twice slower."""
    watch = StragglerWatch(StragglerConfig(), drain=True, drain_window_s=600)
    watch.new_attempt([0, 2, 3], 0)
    times = {17: 0.0, 18: 1.2, 19: 2.4, 20: 3.6, 21: 7.1, 22: 8.3}  # 20 -> 21 holds a save
    for iteration, at in times.items():
        watch.observe(beat(iteration, at, None))
    assert watch.step_seconds() is not None  # what the result was reported on before
    assert watch.step_seconds(least=5) is None
    for iteration, at in ((23, 9.5), (24, 10.7), (25, 11.9)):
        watch.observe(beat(iteration, at, None))
    assert watch.step_seconds(least=5) == pytest.approx(1.2)


class _PendingEvent:
    """A CUDA event the device has not reached yet: ``elapsed_time`` raises, as CUDA's
    ``cudaErrorNotReady`` does."""

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return False

    def elapsed_time(self, other) -> float:
        raise RuntimeError("CUDA error: device not ready")


def test_a_cuda_iteration_the_device_has_not_finished_has_no_figure_yet(monkeypatch):
    """With --clip-grad 0 and the NaN guard off, nothing synchronises a first pipeline stage
    (its loss is not computed there): its last iteration may still be on the device when
    the next one starts."""
    import torch

    monkeypatch.setattr(torch.cuda, "Event", _PendingEvent)
    timer = ComputeTimer(cuda=True)
    timer.start()
    timer.reduction_entered()
    timer.start()
    assert timer.previous_microseconds() == 0
