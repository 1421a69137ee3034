"""Slow drifts toward a limit (pure: points and a config in, time left out), and one small
labelled trace replayed: a drift alerts with a quarter of its span left, look-alikes stay
quiet."""

import json
import math
from dataclasses import replace

import pytest

from ftmaster.monitor import tracegen
from ftmaster.monitor.alerts import AlertConfig
from ftmaster.monitor.drifts import (DriftConfig, PeerCount, Persistence, _excursion,
                                     drift_severity, time_left)
from ftmaster.monitor.evaluate import replay
from ftmaster.monitor.sample import GpuSample
from ftmaster.monitor.scorers import AdaptiveScorer, LoadedWindow, Peers, drift_left

CFG = DriftConfig(window_s=600.0)  # the fits below span 10 minutes: half the default
TIMES = [10.0 * i for i in range(61)]  # 10 minutes, a sample every 10 s


def wiggle(i: int) -> float:
    return 0.3 * math.sin(i * 1.7)  # deterministic noise


@pytest.mark.parametrize("values, distance, rising, expected_s", [
    # 0.6 C a minute, 6 C to go: 10 minutes
    ([0.01 * t + wiggle(i) for i, t in enumerate(TIMES)], 6.0, True, 600.0),
    # a clock sinking 20 MHz a minute, 200 MHz above its floor: 10 minutes
    ([-t / 3 + wiggle(i) for i, t in enumerate(TIMES)], -200.0, False, 600.0),
])
def test_a_steady_trend_reaches_its_limit_at_its_slope(values, distance, rising, expected_s):
    assert time_left(TIMES, values, distance, 87.0, CFG, rising) == pytest.approx(expected_s, rel=0.1)


def test_an_accelerating_trend_gets_there_sooner_than_its_slope_says():
    values = [(t / 600) ** 2 * 6 + wiggle(i) for i, t in enumerate(TIMES)]
    left = time_left(TIMES, values, 6.0, 87.0, CFG)
    late_slope = 2 * 6 / 600  # C/s at the end of the window
    assert left is not None and left < 6.0 / late_slope


@pytest.mark.parametrize("values, distance, rising, why", [
    ([wiggle(i) for i in range(61)], 6.0, True, "flat: noise only"),
    ([8 * (1 - math.exp(-t / 90)) + wiggle(i) for i, t in enumerate(TIMES)], 6.0, True,
     "a step that settles"),
    ([8 * (1 - math.exp(-t / 600)) + wiggle(i) for i, t in enumerate(TIMES)], 6.0, True,
     "a slow warm-up that settles"),
    ([0.01 * t for t in TIMES], -1.0, True, "past the limit already: the level detectors'"),
    ([-0.01 * t for t in TIMES], 6.0, True, "moving away from the limit"),
    ([0.01 * t for t in TIMES[:20]], 6.0, True, "too little of the window covered"),
])
def test_no_trend_toward_the_limit_has_no_time_left(values, distance, rising, why):
    assert time_left(TIMES[:len(values)], values, distance, 87.0, CFG, rising) is None, why


def test_severity_ramps_from_the_horizons_start_to_full():
    start, full = CFG.horizon_s
    assert [drift_severity(s, CFG) for s in (None, start + 1, (start + full) / 2, full, 0)] == \
        [0.0, 0.0, pytest.approx(0.5), 1.0, 1.0]


def test_a_trend_counts_once_it_held_through_most_of_the_persistence_time():
    held = Persistence()
    seen = [held.confirmed(t, 300.0 if t % 30 else None, CFG) for t in range(0, 200, 10)]
    assert seen[:9] == [None] * 9  # under persist_s (90 s) of history
    assert 300.0 in seen[10:]  # held two evaluations in three since
    assert all(s is None for t, s in zip(range(0, 200, 10), seen) if t % 30 == 0)


def test_a_trend_fitted_every_30_s_counts_once_it_held_in_four_fits():
    every_other = Persistence()  # half the fits of 90 s, but two of them
    assert not any(every_other.confirmed(t, 300.0 if t % 60 else None, CFG)
                   for t in range(0, 600, 30))
    steady = Persistence()
    seen = [steady.confirmed(t, 300.0, CFG) for t in range(0, 300, 30)]
    assert seen[:3] == [None] * 3 and seen[3:] == [300.0] * 7


def test_power_counts_a_rise_toward_its_cap_slower_than_min_slope():
    """A GPU's power rising at 0.00225 of its cap a minute (under ``min_slope``, over
    ``power_min_slope``) has time left; with power's floor at ``min_slope``, none."""
    scorer, cap = AdaptiveScorer(), 400.0
    for t in range(0, 1500, 5):
        sample = GpuSample(timestamp=float(t), gpu_id=0, gpu_utilization=95.0, power_limit=cap,
                           power_draw=340.0 + 0.00225 * cap * t / 60 + 10 * wiggle(t),
                           sm_clock=1900.0, temperature=70.0)
        scorer.update([sample])
    track, cfg = scorer._tracks[0], DriftConfig()
    assert cfg.power_min_slope < 0.00225 < cfg.min_slope
    assert drift_left(track, sample, None, cfg, warm=True) is not None
    assert drift_left(track, sample, None, replace(cfg, power_min_slope=cfg.min_slope),
                      warm=True) is None


@pytest.mark.parametrize("kwargs, words", [
    ({"horizon_s": (300.0, 600.0)}, "horizon must fall"),
    ({"clock_floor": 1.2}, "clock floor"),
    ({"window_s": 0}, "window must be positive"),
    ({"power_spread_block_s": -60.0}, "power spread"),
    ({"power_min_slope": -0.001}, "least slopes"),
])
def test_the_drift_config_is_checked(kwargs, words):
    with pytest.raises(ValueError, match=words):
        DriftConfig(**kwargs)


def test_a_small_trace_alerts_on_its_drift_early_and_never_on_its_look_alikes(tmp_path):
    """Seed 1: a 4-GPU trace whose GPU drifts to 87 C over 22 minutes, with a fleet-wide slow
    warm-up and step to heavier work."""
    spec = tracegen.drift_spec(1)
    assert spec.failures[0].kind == "temperature_drift" and spec.episodes
    csv_path, labels_path = tracegen.write_trace(spec, tmp_path)
    (failure,) = json.loads(labels_path.read_text())["failures"]
    alerts, _, _ = replay(csv_path, AdaptiveScorer(), AlertConfig())
    assert [a.gpu for a in alerts] and {a.gpu for a in alerts} == {failure["gpu"]}
    first = min(a.time for a in alerts)
    span = failure["failure_time"] - failure["precursor_start"]
    assert failure["precursor_start"] <= first and "slow_drift" in alerts[0].reasons
    assert (failure["failure_time"] - first) / span >= 0.25


def test_a_drift_whose_noise_a_cap_clips_still_has_time_left():
    """6 W/min toward a 700 W cap with +-30 W of noise, at it by the end: the last
    minutes' noise is clipped, so the second half's fit comes out slower; within its noise
    that is no settling."""
    values = [min(700.0, 640.0 + 0.1 * t + 30 * math.sin(i * 1.7)) - 600.0
              for i, t in enumerate(TIMES)]
    assert time_left(TIMES, values, 20.0, 700.0, CFG) is not None
    strict = DriftConfig(settle_sigmas=0.0)  # any slowdown past `steady` read as settling
    assert time_left(TIMES, values, 20.0, 700.0, strict) is None


def test_the_drift_window_spans_loaded_time_so_a_checkpoint_dip_keeps_it():
    window = LoadedWindow(600.0)
    for i in range(40):  # 400 s loaded
        window.push(10.0 * i, float(i), loaded_s=10.0 * i)
    for i in range(60, 80):  # 200 s idle in a checkpoint, then 200 s more loaded
        window.push(10.0 * i, float(i), loaded_s=10.0 * (i - 20))
    assert window.times[0] == 0.0 and len(window.times) == 60  # 600 s of load, 790 s of clock
    window.push(800.0, 80.0, loaded_s=610.0)
    assert window.times[0] == 10.0


def test_the_peers_count_changes_only_when_the_new_count_lasts():
    peers = PeerCount()
    assert not peers.changed(0.0, 8, lasting_s=60.0)
    assert not peers.changed(10.0, 7, lasting_s=60.0)  # one GPU's sample missing
    assert not peers.changed(20.0, 8, lasting_s=60.0)
    assert [peers.changed(t, 7, lasting_s=60.0) for t in (30.0, 60.0, 90.0, 100.0)] == \
        [False, False, True, False]  # lost for good: once, after a minute


def test_only_peers_at_work_are_a_loaded_gpus_reference():
    """A peer that collapses (its power falls 350 W) would read, in the median of two, as a
    175 W rise of every other GPU toward its cap."""
    samples = [GpuSample(timestamp=0.0, gpu_id=g, gpu_utilization=util, power_draw=power,
                         sm_clock=1900.0, temperature=70.0)
               for g, util, power in ((0, 95.0, 540.0), (1, 93.0, 560.0), (2, 4.0, 190.0),
                                      (3, 96.0, 530.0))]
    peers = Peers.of(samples, loaded_util=70.0)
    assert (peers.count, peers.loaded) == (4, 3)
    assert peers.power[0] == 545.0 and peers.power[1] == 535.0  # GPU 2 is in neither
    assert 2 not in peers.power  # nor a reference for itself while it idles


def test_an_unread_utilisation_is_no_drift_toward_the_limit():
    """GPU 0's utilisation unread for 15 minutes, its temperature, power and clock read and
    flat: with no peers' median for it, its raw 70 C went into windows that held its part
    against its peers (about 0): a steep rise, a slow_drift score of 1.0 after 4 minutes."""
    scorer = AdaptiveScorer()

    def samples(t, util0):
        return [GpuSample(timestamp=t, gpu_id=g, temperature=70.0 + 0.3 * wiggle(int(t) + g),
                          power_draw=300.0, power_limit=400.0, sm_clock=1980.0,
                          gpu_utilization=util0 if g == 0 else 98.0) for g in range(4)]
    for t in range(0, 3600, 15):
        scorer.update(samples(float(t), 98.0))
    scores = [scorer.update(samples(float(t), None))[0].score for t in range(3600, 4500, 15)]
    assert max(scores) < 0.5, max(scores)


def loaded_run(scorer, start, seconds, temperature, util=95.0):
    """Feed one GPU a sample every 5 s; ``temperature(t)`` from the stretch's start."""
    for t in range(0, seconds, 5):
        scorer.update([GpuSample(timestamp=start + t, gpu_id=0, gpu_utilization=util,
                                 power_draw=500.0, power_limit=700.0, sm_clock=1900.0,
                                 temperature=temperature(t))])
    return start + seconds


@pytest.mark.parametrize("break_s, cooled_c, temperature_back_s", [
    (15, 0.5, 30),  # a stall: back at its level at once, counted after the load settle
    (240, 15.0, 300),  # a checkpoint: 15 C cooler, its rebound never counted
])
def test_power_and_clock_count_half_a_minute_after_a_break_temperature_once_back(
        break_s, cooled_c, temperature_back_s):
    scorer = AdaptiveScorer()
    steady = 70.0
    t = loaded_run(scorer, 0.0, 600, lambda _: steady)
    t = loaded_run(scorer, t, break_s, lambda _: steady - cooled_c, util=5.0)
    track = scorer._tracks[0]
    before = {name: len(getattr(track, name).times) for name in ("drift_temp", "drift_power")}
    rebound = lambda s: steady - cooled_c * math.exp(-s / 120.0)  # noqa: E731
    loaded_run(scorer, t, 45, rebound)
    assert len(track.drift_power.times) > before["drift_power"]  # from 30 s on
    resumed = len(track.drift_temp.times) > before["drift_temp"]
    assert resumed == (temperature_back_s <= 45)
    loaded_run(scorer, t + 45, temperature_back_s + 10 - 45, rebound)
    assert min(s for s in track.drift_temp.times if s > t) >= t + temperature_back_s


def test_a_trend_held_before_a_checkpoint_dip_counts_again_a_few_fits_after_it():
    """A dip reads no trend, but what held before it still counts: after the load settles the
    trend is confirmed again within a few fits, not a whole persistence time later."""
    scorer = AdaptiveScorer()
    ramp = lambda s: 60.0 + 0.5 * s / 60.0  # noqa: E731 (0.5 C a minute toward 87 C)
    t = loaded_run(scorer, 0.0, 1500, ramp)
    track = scorer._tracks[0]
    assert track.drift_left_s is not None
    t = loaded_run(scorer, t, 60, lambda s: ramp(1500 + s), util=5.0)
    assert track.drift_left_s is None  # nothing is read in the dip
    confirmed_at = None
    for step in range(0, 180, 5):
        loaded_run(scorer, t + step, 5, lambda s: ramp(1560 + step + s))
        if confirmed_at is None and track.drift_left_s is not None:
            confirmed_at = step
    cfg = scorer.config.drift
    assert confirmed_at is not None
    assert cfg.load_settle_s <= confirmed_at < cfg.load_settle_s + cfg.persist_s


def test_a_drift_that_began_within_the_window_counts_once_the_gpu_left_its_usual_level():
    """Flat-to-falling for half the window, then 0.36 C a minute: over the whole window the
    slope is under ``min_slope``, its second half well over. It counts only for a GPU whose
    level now stands clear of where it usually ran (the look-back before the window); a GPU
    that has run this hot all along merely wanders."""
    cfg = DriftConfig(window_s=600.0, excursion_lookback_s=1200.0)
    values = [(-0.0015 * t if t < 300 else -0.45 + 0.006 * (t - 300)) + wiggle(i)
              for i, t in enumerate(TIMES)]
    past_times = [10.0 * i - 1200.0 for i in range(120)]
    usual = (past_times, [wiggle(i) for i in range(120)])
    as_hot = (past_times, [1.2 + wiggle(i) for i in range(120)])
    assert time_left(TIMES, values, 1.0, 87.0, cfg, before=usual) is not None
    assert time_left(TIMES, values, 1.0, 87.0, cfg) is None  # no look-back: no excursion known
    assert time_left(TIMES, values, 1.0, 87.0, cfg, before=as_hot) is None
    off = DriftConfig(window_s=600.0, excursion_lookback_s=1200.0, late_min_t=0.0)
    assert time_left(TIMES, values, 1.0, 87.0, off, before=usual) is None  # that path off


def test_a_power_level_has_left_its_usual_one_by_the_spread_of_its_minute_means():
    """Power's samples swing by +-25 W about a level that barely wanders: against their own
    spread a 40 W rise is inside the noise (2.5 of 25 W is 62 W), against the spread of its
    minute means (about 8 W) it stands clear, as the fitted end level it is compared with does."""
    cfg = DriftConfig(window_s=600.0, excursion_lookback_s=1200.0)
    noise = [25.0 * (1 if i % 2 else -1) * (0.5 + (i * 7919 % 11) / 10) for i in range(180)]
    past = ([10.0 * i - 1200.0 for i in range(120)], noise[:120])
    values = [40.0 * t / 600.0 + noise[120 + i % 60] for i, t in enumerate(TIMES)]
    slope = 40.0 / 600.0
    assert _excursion(past, TIMES, values, slope, 50.0, 1.0, cfg, spread_block_s=60.0)
    assert not _excursion(past, TIMES, values, slope, 50.0, 1.0, cfg)  # the samples' spread


def test_the_points_before_the_drift_window_are_kept_for_its_look_back():
    window = LoadedWindow(600.0, past_s=300.0)
    for i in range(100):  # 1000 s loaded
        window.push(10.0 * i, float(i), loaded_s=10.0 * i)
    assert window.times[0] == 390.0 and list(window.before) == [float(i) for i in range(9, 39)]
    assert list(window.before_times) == [10.0 * i for i in range(9, 39)]


def test_the_peers_own_rise_shortens_the_time_left_once_the_gpu_left_its_usual_level():
    """The trend is the GPU's part against its peers, the distance its whole signal's: in a
    fleet that warms, its signal rises by its peers' rise too. That counts only for a GPU that
    left its usual level: a healthy GPU in a warm-up keeps its own estimate."""
    cfg = DriftConfig(window_s=600.0, excursion_lookback_s=1200.0, slope_lead=0.0)
    values = [0.01 * t + wiggle(i) for i, t in enumerate(TIMES)]  # 0.6 C a minute
    warming = [60.0 + 0.005 * t for t in TIMES]  # the peers: 0.3 C a minute
    past_times = [10.0 * i - 1200.0 for i in range(120)]
    usual = (past_times, [wiggle(i) for i in range(120)])
    as_high = (past_times, [5.5 + wiggle(i) for i in range(120)])
    own = time_left(TIMES, values, 6.0, 87.0, cfg, before=usual)
    assert own == pytest.approx(600.0, rel=0.1)
    assert time_left(TIMES, values, 6.0, 87.0, cfg, before=usual, peers=warming) == \
        pytest.approx(400.0, rel=0.1)
    assert time_left(TIMES, values, 6.0, 87.0, cfg, before=as_high, peers=warming) == own
    assert time_left(TIMES, values, 6.0, 87.0, cfg, peers=warming) == own  # no look-back
    cooling = [60.0 - 0.005 * t for t in TIMES]
    assert time_left(TIMES, values, 6.0, 87.0, cfg, before=usual, peers=cooling) == own
    off = DriftConfig(window_s=600.0, excursion_lookback_s=1200.0, peer_rise=0.0,
                      slope_lead=0.0)
    assert time_left(TIMES, values, 6.0, 87.0, off, before=usual, peers=warming) == own
    with pytest.raises(ValueError):
        DriftConfig(peer_rise=1.5)


def test_a_limit_that_follows_the_peers_is_closed_on_by_only_the_rest_of_their_fall():
    """The clock floor, taken against the peers, is a share of their clock: when the fleet's
    clock falls, the floor falls with it, and only the rest of their fall closes the gap."""
    cfg = DriftConfig(window_s=600.0, excursion_lookback_s=1200.0, slope_lead=0.0)
    values = [-0.1 * t + wiggle(i) for i, t in enumerate(TIMES)]  # its own part: -6 MHz a minute
    falling = [1400.0 - 0.05 * t for t in TIMES]  # the peers' clock: -3 MHz a minute
    past_times = [10.0 * i - 1200.0 for i in range(120)]
    usual = (past_times, [wiggle(i) for i in range(120)])

    def left(**follows):
        return time_left(TIMES, values, -60.0, 980.0, cfg, False, usual, falling, **follows)

    assert left() == pytest.approx(60.0 / (0.1 + 0.05), rel=0.1)
    assert left(limit_follows=0.7) == pytest.approx(60.0 / (0.1 + 0.3 * 0.05), rel=0.1)
    assert left(limit_follows=1.0) == time_left(TIMES, values, -60.0, 980.0, cfg, False, usual)


def test_the_drift_window_keeps_the_peers_median_beside_each_point():
    window = LoadedWindow(600.0)
    for i in range(100):
        window.push(10.0 * i, float(i), loaded_s=10.0 * i, peer=2.0 * i)
    assert list(window.peers) == [2.0 * v for v in window.values]


def test_an_accelerating_drift_is_timed_at_its_slope_at_the_windows_end_once_it_left_its_level():
    """A fit's slope is that of its middle: a drift that speeds up is faster at the window's
    end, where its distance is measured from, by a quarter-window of its acceleration. That
    lead counts only for a GPU that left its usual level (a warm-up's wander accelerates too)."""
    cfg = DriftConfig(window_s=600.0, excursion_lookback_s=1200.0)
    values = [(t / 600) ** 2 * 6 + wiggle(i) for i, t in enumerate(TIMES)]
    past_times = [10.0 * i - 1200.0 for i in range(120)]
    usual = (past_times, [wiggle(i) for i in range(120)])
    led = time_left(TIMES, values, 6.0, 87.0, cfg, before=usual)
    unled = time_left(TIMES, values, 6.0, 87.0, cfg)  # no look-back: no excursion known
    off = DriftConfig(window_s=600.0, excursion_lookback_s=1200.0, slope_lead=0.0)
    assert led is not None and unled is not None and led < 0.9 * unled
    assert time_left(TIMES, values, 6.0, 87.0, off, before=usual) == unled
    with pytest.raises(ValueError):
        DriftConfig(slope_lead=0.3)
