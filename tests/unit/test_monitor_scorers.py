"""Scorers and alert policy: hard signals, the paper's cap, adaptive quality on generated traces."""

import random

import pytest

from ftmaster.monitor import tracegen
from ftmaster.monitor.alerts import AlertConfig, AlertPolicy
from ftmaster.monitor.evaluate import evaluate
from ftmaster.monitor.sample import GpuSample
from ftmaster.monitor.scorers import (AdaptiveConfig, AdaptiveScorer, Assessment, PaperConfig, PaperScorer,
                                      UNKNOWN_SCORE, make_scorer)
from ftmaster.monitor.signals import hard_reasons, worst_xid

T0 = 1_750_000_000.0


def sample(t, gpu=0, **values):
    base = dict(temperature=65.0, power_draw=500.0, gpu_utilization=95.0, memory_used=1000.0,
                memory_total=80000.0, errors=0, ecc_sbe=0, ecc_dbe=0, throttle_reasons=0,
                power_limit=700.0, retired_pages_pending=0, recovery_action=0)
    return GpuSample(timestamp=t, gpu_id=gpu, **{**base, **values})


@pytest.mark.parametrize("change, reason", [
    ({"ecc_dbe": 1}, "ecc_dbe"), ({"errors": 3}, "ecc_dbe"), ({"xid": 79}, "xid_79"), ({"xid": 95}, "xid_95"),
    ({"recovery_action": 2}, "recovery_action_2"), ({"retired_pages_pending": 1}, "retired_pages_pending"),
])
def test_hard_signals_are_critical_at_once(change, reason):
    scorer = AdaptiveScorer()
    scorer.update([sample(T0)])
    (assessment,) = scorer.update([sample(T0 + 1, **change)]).values()
    assert assessment.score == 1.0 and reason in assessment.hard_reasons


def test_soft_or_unknown_values_are_not_hard():
    assert hard_reasons({"ecc_dbe": 0}, sample(T0, xid=13)) == []  # an application XID
    assert hard_reasons({}, sample(T0, ecc_dbe=4)) == []  # no reference yet
    assert hard_reasons({"ecc_dbe": 5}, sample(T0, ecc_dbe=0)) == []  # counter reset
    assert worst_xid([13, 94, 79]) == 79 and worst_xid([13, 31]) == 13 and worst_xid([]) is None


@pytest.mark.parametrize("known, pending, hard", [
    ({}, 1, False),  # set before the monitor started: old news (review point 9)
    ({"retired_pages_pending": 1}, 1, False),  # still set: already reported
    ({"retired_pages_pending": 0}, 1, True),  # set while watched
    ({"retired_pages_pending": 0}, None, False),
])
def test_the_sticky_pending_flag_is_hard_only_when_it_rises(known, pending, hard):
    assert ("retired_pages_pending" in hard_reasons(known, sample(T0, retired_pages_pending=pending))) == hard


@pytest.mark.parametrize("counter", ["ecc_dbe", "errors"])
def test_a_counter_rise_across_a_failed_read_is_still_hard(counter):
    scorer = AdaptiveScorer()
    scorer.update([sample(T0, **{counter: 0})])
    assert scorer.update([sample(T0 + 1, **{counter: None})])[0].score < 1.0
    (assessment,) = scorer.update([sample(T0 + 2, **{counter: 1})]).values()
    assert assessment.score == 1.0 and assessment.hard_reasons == ("ecc_dbe",)


def test_corrected_errors_across_a_failed_read_still_count():
    scorer = AdaptiveScorer()
    for k in range(120):  # 20 minutes at 10 s: warm, no corrected errors
        scorer.update([sample(T0 + 10 * k)])
    scorer.update([sample(T0 + 1200, ecc_sbe=None)])
    (assessment,) = scorer.update([sample(T0 + 1210, ecc_sbe=20)]).values()
    assert "sbe_acceleration" in assessment.reasons


def test_unknown_telemetry_is_not_healthy():
    blank = GpuSample(timestamp=T0, gpu_id=0)
    for scorer in (AdaptiveScorer(), PaperScorer()):
        (assessment,) = scorer.update([blank]).values()
        assert assessment.score == 0.5 and assessment.reasons == ("telemetry_unknown",)


def test_paper_score_is_capped_at_075_unless_errors_are_filled():
    # Everything as bad as it gets: hot, full memory, wild power, collapsed utilisation, heating fast.
    history = [sample(T0 + 10 * k, temperature=40 + 6 * k, power_draw=100 if k % 2 else 700,
                      gpu_utilization=100 if k < 9 else 0, memory_used=80000.0, errors=k) for k in range(10)]
    published, with_errors = PaperScorer(), PaperScorer(PaperConfig(errors_term=True))
    for s in history:
        score = published.update([s])[0].score
        full = with_errors.update([s])[0].score
    assert score == pytest.approx(0.75)
    assert full == pytest.approx(1.0)


def test_configs_are_validated():
    with pytest.raises(ValueError, match="slope_c_per_min"):
        AdaptiveConfig(slope_c_per_min=(2.0, 1.0))
    with pytest.raises(ValueError, match="threshold"):
        AlertConfig(threshold=1.5)
    with pytest.raises(ValueError, match="unknown scorer"):
        make_scorer("magic")


def test_alert_policy_cooldown_rearm_and_new_hard_reasons():
    policy = AlertPolicy(AlertConfig(threshold=0.9, cooldown_s=100, rearm_margin=0.3))
    high, low = Assessment(0.95, ("temperature_trend",)), Assessment(0.1)
    assert policy.decide(0, 0, high)
    assert not policy.decide(0, 200, high)  # still high: not re-armed
    assert not policy.decide(0, 210, low)
    assert policy.decide(0, 220, high)  # re-armed and cooled down
    assert not policy.decide(0, 230, low) and not policy.decide(0, 240, high)  # cooldown
    assert policy.decide(0, 241, Assessment(1.0, ("xid_79",), ("xid_79",)))  # hard: at once
    assert not policy.decide(0, 242, Assessment(1.0, ("xid_79",), ("xid_79",)))  # but only once


def test_a_wall_clock_stepped_back_does_not_hold_a_re_armed_gpus_alert_back():
    """An hour back after an alert at 10,000 s: the re-armed GPU's alerts waited until the
    clock passed 10,100 s again."""
    policy = AlertPolicy(AlertConfig(threshold=0.9, cooldown_s=100, rearm_margin=0.3))
    high, low = Assessment(0.95, ("temperature_trend",)), Assessment(0.1)
    assert policy.decide(0, 10_000, high) and not policy.decide(0, 10_400, low)
    assert policy.decide(0, 10_400 - 3600, high)


def test_a_gpu_stays_alerting_until_its_score_falls_to_the_rearm_level():
    policy = AlertPolicy(AlertConfig(threshold=0.9, rearm_margin=0.3))
    assert not policy.still_alerting(0)
    policy.decide(0, 0, Assessment(0.95, ("temperature_trend",)))
    policy.decide(0, 10, Assessment(0.7))  # below the threshold, above the re-arm level 0.6
    assert policy.still_alerting(0)
    policy.decide(0, 20, Assessment(0.5))
    assert not policy.still_alerting(0) and not policy.still_alerting(1)


def test_a_sample_of_which_nothing_was_read_neither_rearms_nor_alerts():
    """Its 0.5 read as a score fallen below the re-arm level: a GPU with a sticky hard reason
    (a reset required) whose reads failed now and then alerted again each time, and a drain
    was cancelled as "risk fell"; at a threshold of 0.5 a failed read alone was an alert."""
    hard = Assessment(1.0, ("recovery_action_1",), ("recovery_action_1",))
    unknown = Assessment(UNKNOWN_SCORE, ("telemetry_unknown",))
    policy = AlertPolicy(AlertConfig(threshold=0.95))
    assert policy.decide(0, 0.0, hard)
    assert not policy.decide(0, 10.0, unknown) and policy.still_alerting(0)
    assert not policy.decide(0, 20.0, hard)
    assert not AlertPolicy(AlertConfig(threshold=0.5)).decide(0, 0.0, unknown)


def test_hot_but_steady_gpu_with_noise_never_alerts():
    rng = random.Random(7)
    scorer, policy = AdaptiveScorer(), AlertPolicy()
    alerts = 0
    for k in range(1500):  # about 4 hours at 10 s
        t = T0 + 10 * k
        batch = [sample(t, gpu=g, temperature=round((84 if g == 3 else 68) + rng.gauss(0, 1)),
                        power_draw=550 * (1 + rng.gauss(0, 0.03)), gpu_utilization=95 + rng.gauss(0, 2))
                 for g in range(4)]
        for gpu, assessment in scorer.update(batch).items():
            alerts += policy.decide(gpu, t, assessment)
    assert alerts == 0


def cheap_specs(seeds):
    # Every seed whose trace is small enough for a unit test: a rule, not a hand-picked list.
    specs = [tracegen.random_spec(s) for s in seeds]
    return [s for s in specs if s.duration_s / s.interval_s * s.num_gpus <= 16_000]


def test_adaptive_meets_its_goals_on_generated_traces_and_paper_cannot(tmp_path):
    specs = cheap_specs(range(2000, 2030))
    traces = [tracegen.write_trace(spec, tmp_path) for spec in specs]
    adaptive = evaluate(traces, AdaptiveScorer, AlertConfig())
    assert adaptive["precursor_failures"] >= 10
    assert adaptive["recall"] >= 0.85, adaptive
    assert adaptive["median_lead_s"] >= 120, adaptive
    assert adaptive["false_per_100_gpu_hours"] <= 1.0, adaptive
    paper = evaluate(traces, PaperScorer, AlertConfig())
    assert paper["predicted"] == 0  # capped at 0.75, it never reaches 0.95


def test_a_clock_stepped_back_keeps_the_soft_signals_on():
    """A wall clock stepped back an hour (NTP) made the loaded time negative and left every
    window holding "later" points: no soft signal counted until the clock caught up (found in
    review)."""
    scorer = AdaptiveScorer()
    for k in range(240):  # 40 minutes at 10 s: warm
        scorer.update([sample(T0 + 10 * k, gpu=g) for g in range(4)])
    back = T0 + 2400 - 3600
    for k in range(30):  # five minutes of hardware slowdown on GPU 0 after the step
        batch = [sample(back + 10 * k, gpu=g, throttle_reasons=0x8 if g == 0 else 0) for g in range(4)]
        assessment = scorer.update(batch)[0]
    assert "throttling" in assessment.reasons and assessment.score >= 0.95


def test_a_huge_power_reading_does_not_crash_the_paper_scorer():
    """A finite but absurd cell (a corrupt replayed row) raised OverflowError in the power
    spread: replay ended in a traceback, a live monitor failed every step for a window
    (found in review)."""
    scorer = PaperScorer()
    scorer.update([sample(T0, power_draw=1e200)])
    (assessment,) = scorer.update([sample(T0 + 10, power_draw=500.0)]).values()
    assert "power" in assessment.reasons


def test_a_precursor_starting_at_time_zero_opens_its_window_there():
    """A precursor_start of 0 (a trace timed from 0) read as none: its window began at the
    failure, so an alert during the precursor was false and the failure not predicted (found
    in review)."""
    from ftmaster.monitor.daemon import Alert
    from ftmaster.monitor.evaluate import judge

    failure = {"gpu": 0, "failure_time": 600.0, "has_precursor": True, "precursor_start": 0.0}
    result = judge([Alert(0, 0.97, ("temperature_trend",), 120.0)], [failure], grace_s=60.0,
                   episode_gap_s=1800.0)
    assert (result.predicted, result.leads_s, result.false_episodes) == (1, [480.0], 0)


def test_a_temperature_unread_for_a_minute_is_unknown_not_a_crash():
    """With no temperature read within the level window, its mean divided by zero: the whole
    update raised, so the monitor scored, recorded and alerted on no GPU until the reads came
    back, a lost or failing peer's hard signal included (found in review)."""
    scorer = AdaptiveScorer()
    for k in range(100):
        scorer.update([sample(T0 + 10 * k, gpu=g) for g in range(4)])
    for k in range(100, 112):  # two minutes without GPU 0's temperature
        batch = [sample(T0 + 10 * k, gpu=g, temperature=None if g == 0 else 65.0,
                        xid=79 if (g, k) == (1, 111) else None) for g in range(4)]
        out = scorer.update(batch)
    assert out[1].hard_reasons == ("xid_79",) and out[0].score < 0.95


@pytest.mark.parametrize("fails", [False, True], ids=["read", "unread"])
def test_an_alert_on_corrected_errors_holds_while_their_count_is_unread(fails):
    """A GPU alerting on a burst of corrected errors whose count then failed to read (a GPU
    whose memory is failing) fell to 0.71 within a minute and re-armed: its unknown count read
    as healthier than a count with no new errors, whose alert holds for the window."""
    scorer, policy, burst = AdaptiveScorer(), AlertPolicy(AlertConfig()), 0
    for k in range(150):  # 25 minutes at 10 s: warm, no corrected errors
        scorer.update([sample(T0 + 10 * k, gpu) for gpu in range(4)])
    for k in range(150, 160):
        burst += 2 ** (k - 150)
        (assessed, *_) = scorer.update([sample(T0 + 10 * k, gpu, ecc_sbe=burst if gpu == 0 else 0)
                                        for gpu in range(4)]).values()
    assert assessed.score == 1.0 and policy.decide(0, T0 + 1590, assessed)
    for k in range(160, 172):  # two minutes: the count unread, or read with no new errors
        (assessed, *_) = scorer.update([sample(T0 + 10 * k, gpu, ecc_sbe=None if fails else burst)
                                        if gpu == 0 else sample(T0 + 10 * k, gpu)
                                        for gpu in range(4)]).values()
        policy.decide(0, T0 + 10 * k, assessed)
    assert assessed.score == 1.0 and policy.still_alerting(0)

def test_a_power_limit_read_that_fails_is_no_swing_of_the_power():
    """380 W of a 400 W limit, steady, on four GPUs; GPU 0's limit unread at 5 samples in a
    row (a read past its deadline between the draw and the limit): the draw over 700 W there
    read as power instability, score 1.0 and an emergency save."""
    scorer = AdaptiveScorer()
    scores = []
    for k in range(200):
        unread = k >= 150 and k < 160
        assessed = scorer.update([sample(T0 + 10 * k, gpu, power_draw=380.0, power_limit=None
                                         if unread and gpu == 0 else 400.0) for gpu in range(4)])
        scores.append(assessed[0].score)
    assert max(scores[100:]) < 0.5, max(scores[100:])


@pytest.mark.parametrize("power", [500.0, None], ids=["with-power", "no-power-reading"])
def test_a_score_holds_while_a_signal_the_gpu_showed_is_unread(power):
    """A failed temperature read took its severity to 0 and the score decayed: a GPU that
    alerted on heat re-armed, and its drain was called off, as its reads began to fail. A
    signal the GPU never shows (no power reading) holds nothing: its score still falls once
    it cools."""
    scorer, scores = AdaptiveScorer(), []

    def step(k, temperature):
        batch = [sample(T0 + 10 * k, gpu=g, power_draw=power,
                        temperature=temperature if g == 0 else 65.0) for g in range(4)]
        scores.append(scorer.update(batch)[0].score)

    for k in range(100):
        step(k, 65.0)
    for k in range(100, 130):
        step(k, 95.0)
    hot = scores[-1]
    for k in range(130, 142):
        step(k, None)
    assert hot > 0.5 and scores[-1] == hot
    for k in range(142, 154):
        step(k, 65.0)
    assert scores[-1] < hot


def test_one_unread_temperature_of_the_only_peer_keeps_the_others_baseline():
    """2 GPUs; GPU 1 warms 1.5 C a minute to 15 C over its peer. One failed read of GPU 0's
    temperature read as "no peers": GPU 1's scale restarted twice and its baseline was
    relearnt at its hot level, and its score fell to 0 while it stayed 15 C hotter."""
    def run(unread_at):
        scorer, scores, baselines = AdaptiveScorer(), [], []
        for i in range(260):
            t = T0 + 10 * i
            hotter = min(max(i - 120, 0), 60) * 0.25
            out = scorer.update([sample(t, 0, temperature=None if i == unread_at else 65.0,
                                        sm_clock=1800.0),
                                 sample(t, 1, temperature=65.0 + hotter, sm_clock=1800.0)])
            scores.append(out[1].severities.get("temperature_trend", 0.0)
                          if hasattr(out[1], "severities") else out[1].score)
            baselines.append(scorer._tracks[1].baseline)
        return scores, baselines

    reference, reference_baselines = run(unread_at=None)
    scores, baselines = run(unread_at=135)
    # one point fewer in its windows, no more: the baseline and the score stay the reference's
    assert max(abs(a - b) for a, b in zip(baselines[136:], reference_baselines[136:])) < 0.05
    assert max(abs(a - b) for a, b in zip(scores[136:], reference[136:])) < 0.05


def test_corrected_errors_counted_over_a_read_outage_are_no_burst():
    """A steady corrected error every 2 minutes, GPU 1's counter unread for 30 minutes: the
    whole rise landed at the first read after, in the recent window, an acceleration and an
    alert (0.96)."""
    def worst(unread):
        scorer, policy, errors, alerts, top = AdaptiveScorer(), AlertPolicy(), 0, 0, 0.0
        for i in range(500):
            t = T0 + 10 * i
            errors += i % 12 == 0 and i > 0
            out = scorer.update([sample(t, g, ecc_sbe=None if g == 1 and unread(i) else
                                        (errors if g == 1 else 0)) for g in range(4)])
            top = max(top, out[1].score)
            alerts += policy.decide(1, t, out[1])
        return top, alerts

    steady = worst(lambda i: False)
    assert worst(lambda i: 200 <= i < 380) == (pytest.approx(steady[0], abs=0.1), 0)


@pytest.mark.parametrize("idle_minutes", [20, 60])
def test_a_gpu_back_from_idling_is_judged_against_its_loaded_power_spread(idle_minutes):
    """One GPU (no peers' spread) at 450 +- 50 W, then idle at a flat 80 W, then the same
    load again: the idle flatness counted as steady and became its usual spread, and its
    usual spread under load then read as instability (alerts at 0.97 and 1.0)."""
    rng = random.Random(3)
    scorer, policy, alerts = AdaptiveScorer(), AlertPolicy(), []
    loaded, idle = 180, idle_minutes * 6
    for i in range(loaded + idle + 180):
        t = T0 + 10 * i
        idling = loaded <= i < loaded + idle
        (assessment,) = scorer.update([sample(
            t, gpu_utilization=0.0 if idling else 95.0, temperature=40.0 if idling else 65.0,
            power_draw=80 + rng.uniform(-1, 1) if idling else 450 + rng.uniform(-50, 50))]).values()
        if policy.decide(0, t, assessment):
            alerts.append((i, assessment.reasons))
        if i == loaded - 1:
            usual = scorer._tracks[0].spread_baseline
        if i == loaded + idle - 1:
            after_idling = scorer._tracks[0].spread_baseline
    assert alerts == []
    assert after_idling == pytest.approx(usual, rel=0.3)  # not the idle 80 W's flatness


def test_power_read_again_after_an_outage_is_no_spread_with_the_points_before_it():
    """GPU 1's power unread for 30 minutes while the fleet went from 500 W to 430 W: the 16
    points a power window keeps however old spanned both levels once reads came back, a
    spread far above the peers', and an alert (1.0) on a steady GPU."""
    rng = random.Random(1)
    scorer, policy, alerts = AdaptiveScorer(), AlertPolicy(), []
    for i in range(320):
        t = T0 + 10 * i
        out = scorer.update([sample(t, g, power_draw=None if g == 1 and 100 <= i < 280 else
                                    (500.0 if i < 150 else 430.0) + rng.uniform(-3, 3))
                             for g in range(4)])
        if policy.decide(1, t, out[1]):
            alerts.append((i, out[1].reasons))
    assert alerts == []


def test_a_peer_whose_temperature_stays_unread_leaves_the_trend_read_on_the_gpus_own_scale():
    """2 GPUs, GPU 1's temperature unread from a minute before GPU 0 heats 30 C in 5
    minutes: skipping every point while the peer stayed unread left the trend unread, and
    the alert came 9 samples later, from the slow-drift detector alone."""
    scorer, policy, first = AdaptiveScorer(), AlertPolicy(), None
    for i in range(720):
        t = T0 + 10 * i
        heat = min(max(0, i - 360) * 30 / 30, 30)
        out = scorer.update([sample(t, 0, temperature=65.0 + heat),
                             sample(t, 1, temperature=None if i >= 350 else 65.0)])
        if policy.decide(0, t, out[0]) and first is None:
            first = (i - 360, out[0].reasons)
    assert first is not None and "temperature_trend" in first[1] and first[0] <= 13
