"""The goodput model's two checkpoint tiers: memory saves persisted to disk in the background,
node crashes that lose host RAM, the optimal memory interval, and the CLI's measured inputs."""

import json
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner
from helpers.synth_run import launcher_events

from ftmaster import goodput
from ftmaster.cli import main
from ftmaster.goodput import GoodputInputs

TWO_TIER = GoodputInputs(run_hours=240.0).periodic_only()
# A save interval with many divisors, so that the best allowed memory interval lies close
# to the continuous optimum; 7,207 s between disk copies.
FINE = replace(TWO_TIER, save_interval=720720, iteration_s=0.01)


def _optimum(x: GoodputInputs) -> int:
    return goodput.optimal_memory_interval(x)["memory_interval"]


@pytest.mark.parametrize("case", [
    {},  # defaults: 1024 GPUs, memory save 5 s, persist 60 s, 12% node crashes
    {"gpus": 8192, "node_failure_share": 0.5},
    {"gpus": 8192, "memory_save_s": 0.5, "node_failure_share": 0.0},
    {"gpus": 8192, "node_failure_share": 1.0},
])
def test_monte_carlo_agrees_with_the_analytic_optimum(case):
    x = replace(TWO_TIER, **case)
    best = goodput.optimal_memory_interval(x)
    model = goodput.analytic(x.two_tier(best["memory_interval"]))
    sim = goodput.simulate(x.two_tier(best["memory_interval"]), runs=100, seed=1)
    assert model["goodput"] == pytest.approx(best["goodput"])
    # The tolerance of the single-tier model's own check (test_goodput.py).
    assert abs(model["goodput"] - sim["goodput"]) < 0.005
    assert sim["failures"] == pytest.approx(model["failures"], rel=0.1)
    assert sim["lost_per_failure_s"] == pytest.approx(model["lost_per_failure_s"], rel=0.1)


def test_the_monte_carlo_prefers_the_analytic_optimum_to_its_neighbours():
    x = replace(TWO_TIER, gpus=8192)
    best = _optimum(x)
    assert best == 250
    simulated = {k: goodput.simulate(x.two_tier(k), runs=100, seed=1) for k in (50, 250, 1000)}
    margin = min(simulated[best]["goodput"] - simulated[k]["goodput"] for k in (50, 1000))
    assert margin > 5 * simulated[best]["goodput_stderr"]


def test_a_slow_copier_persists_every_few_disk_intervals():
    x = replace(TWO_TIER, gpus=4096, save_interval=20, persist_s=100.0, node_failure_share=0.5,
                run_hours=120.0).two_tier(20)
    model = goodput.analytic(x)
    # A disk interval runs 40 s + 5 s blocked; a copy needs 5 + 100 s: every third gets one.
    assert model["disk_copy_interval"] == 60
    sim = goodput.simulate(x, runs=100, seed=1)
    assert abs(model["goodput"] - sim["goodput"]) < 0.005
    assert sim["lost_per_node_crash_s"] == pytest.approx(model["lost_per_node_crash_s"], rel=0.05)


@pytest.mark.parametrize("gpus", [1024, 8192])
@pytest.mark.parametrize("memory_save_s", [0.5, 8.0])
@pytest.mark.parametrize("share", [0.0, 0.5])
def test_optimum_is_a_divisor_next_to_young_with_the_effective_mtbf(gpus, memory_save_s, share):
    """sqrt(2 C_mem MTBF_job / (1 - share)), with its node-crash correction: the optimum is one
    of the two allowed intervals around it."""
    x = replace(FINE, gpus=gpus, memory_save_s=memory_save_s, node_failure_share=share)
    young = goodput.memory_young_daly_interval_s(x) / x.iteration_s
    allowed = goodput.divisors(x.save_interval)
    below = max(d for d in allowed if d <= young)
    above = min(d for d in allowed if d >= young)
    assert 3 * above <= 4 * below  # the divisors are dense enough here for this to mean much
    assert _optimum(x) in (below, above)


def test_young_without_node_crashes_is_sqrt_2_c_mtbf():
    x = replace(FINE, node_failure_share=0.0, memory_save_s=2.0)
    assert goodput.memory_young_daly_interval_s(x) == pytest.approx(
        (2 * 2.0 / x.failure_rate_s) ** 0.5)


@pytest.mark.parametrize("sweep, values, slope", [
    ("memory_save_s", [0.125, 0.5, 2.0, 8.0, 32.0], 0.5),
    ("gpus", [256, 1024, 4096, 16384], -0.5),  # the job's MTBF is 1 / gpus
])
def test_optimum_scales_as_the_square_root(sweep, values, slope):
    x = replace(FINE, node_failure_share=0.0, memory_save_s=2.0)
    optima = [_optimum(replace(x, **{sweep: v})) for v in values]
    fitted = np.polyfit(np.log(values), np.log(optima), 1)[0]
    assert fitted == pytest.approx(slope, abs=0.05)


def test_with_only_node_crashes_the_memory_tier_buys_nothing_beyond_the_disk_tier():
    x = replace(TWO_TIER, gpus=8192, node_failure_share=1.0)
    best = goodput.optimal_memory_interval(x)
    assert best["memory_interval"] == x.save_interval  # no memory save between disk copies
    # ... which is a single disk tier saving as fast as the memory tier and durable after
    # the background copy.
    disk = replace(x, save_block_s=x.memory_save_s,
                   save_persist_s=x.memory_save_s + x.persist_s).single_tier()
    single = goodput.analytic(disk)
    # Not exactly equal: the single tier is solved exactly, the two tiers to first order in
    # the failure rate, which takes a failure's phase as uniform (0.1% and 1.5% apart here).
    assert best["goodput"] == pytest.approx(single["goodput"], rel=2e-3)
    assert best["lost_per_failure_s"] == pytest.approx(single["lost_per_failure_s"], rel=0.02)
    for more_often in goodput.divisors(x.save_interval)[:-1]:
        assert goodput.analytic(x.two_tier(more_often))["goodput"] < best["goodput"]
    assert goodput.memory_young_daly_interval_s(x) == float("inf")


def test_with_no_node_crashes_and_free_memory_saves_a_failure_loses_one_interval_at_most():
    x = replace(TWO_TIER, gpus=16384, gpu_mtbf_hours=5000.0, run_hours=24.0,
                memory_save_s=0.0, node_failure_share=0.0)
    best = goodput.optimal_memory_interval(x)
    assert best["memory_interval"] == 1
    assert best["lost_per_failure_s"] == pytest.approx(x.iteration_s / 2)
    interval_s = 5 * x.iteration_s
    sim = goodput.simulate(x.two_tier(5), runs=20, seed=1)
    assert sim["failures"] > 50
    assert sim["lost_per_failure_s"] == pytest.approx(interval_s / 2, rel=0.1)
    assert interval_s * 0.9 < sim["worst_lost_s"] <= interval_s + 1e-6


def test_the_memory_tier_inputs_leave_the_single_tier_alone():
    x = replace(TWO_TIER, recall=0.5, false_alarm_rate=1e-4)
    other = replace(x, memory_save_s=0.1, persist_s=7.0, node_failure_share=0.9)
    assert goodput.analytic(other) == goodput.analytic(x)
    assert goodput.simulate(other, runs=5, seed=3) == goodput.simulate(x, runs=5, seed=3)
    assert goodput.optimal_interval(other) == goodput.optimal_interval(x)


def test_the_two_tier_model_has_no_predictor():
    x = replace(TWO_TIER, recall=0.5, memory_interval=10)
    for model in (goodput.analytic, goodput.simulate, goodput.optimal_memory_interval):
        with pytest.raises(ValueError, match="the two-tier model has no predictor"):
            model(x)


@pytest.mark.parametrize("bad, message", [
    ({"memory_interval": 300}, r"memory_interval \(300\) must divide save_interval \(1000\), "
                               r"as every disk copy is of a memory save: 250 does"),
    ({"memory_interval": -1}, "memory_interval must be an integer >= 0"),
    ({"memory_interval": 2.0}, "memory_interval must be an integer >= 0"),
    ({"memory_save_s": -1.0}, "memory_save_s must be a finite number >= 0"),
    ({"persist_s": float("nan")}, "persist_s must be a finite number >= 0"),
    ({"node_failure_share": 1.5}, "node_failure_share must be between 0 and 1"),
])
def test_bad_tier_inputs_are_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        replace(TWO_TIER, **bad)


# ---- the command line ------------------------------------------------------------------------

def test_cli_shows_the_two_tiers_at_the_optimum_unless_given():
    runner = CliRunner()
    out = runner.invoke(main, ["goodput", "--runs", "0", "--json"])
    assert out.exit_code == 0, out.output
    tiers = json.loads(out.output)["two_tier"]
    assert tiers["given"] is False
    assert tiers["memory_interval"] == tiers["optimum"]["memory_interval"] == 500
    assert tiers["analytic"]["goodput"] == pytest.approx(tiers["optimum"]["goodput"])
    assert tiers["young_daly"]["memory_interval"] == pytest.approx(
        goodput.memory_young_daly_interval_s(GoodputInputs()) / 2.0)

    out = runner.invoke(main, ["goodput", "--runs", "0", "--json", "--memory-interval", "100"])
    tiers = json.loads(out.output)["two_tier"]
    assert tiers["given"] is True and tiers["memory_interval"] == 100
    assert tiers["analytic"]["goodput"] < tiers["optimum"]["goodput"]


def test_cli_table_has_a_two_tier_column_and_its_monte_carlo():
    out = CliRunner().invoke(main, ["goodput", "--runs", "20", "--run-hours", "100",
                                    "--node-failure-share", "1"])
    assert out.exit_code == 0, out.output
    header = next(line for line in out.output.splitlines() if "periodic-only" in line)
    assert header.split() == ["periodic-only", "proactive", "two-tier"]
    montecarlo = next(line for line in out.output.splitlines() if "(Monte Carlo)" in line)
    assert montecarlo.count("±") == 3
    for text in ("memory 1000", "(the optimum; none between disk copies)",
                 "100% of failures", "none, every failure loses host RAM"):
        assert text in out.output


def test_cli_leaves_out_a_two_tier_monte_carlo_too_long_to_run():
    """Free memory saves make one every iteration optimal: 1.3 million events per run."""
    out = CliRunner().invoke(main, ["goodput", "--runs", "2", "--memory-save-s", "0",
                                    "--node-failure-share", "0"])
    assert out.exit_code == 0, out.output
    assert "two-tier Monte Carlo left out: about 1.3e+06 events per run" in out.output


@pytest.mark.parametrize("args, message", [
    (["--memory-interval", "300"], "must divide --save-interval (1000)"),
    (["--memory-interval", str(10**400)], "--memory-interval (" + "1" + "0" * 17 + "..." + "0" * 19 + ") must divide"),
    (["--node-failure-share", "2"], "--node-failure-share must be between 0 and 1"),
    (["--memory-save-s", "-1"], "--memory-save-s must be a finite number >= 0"),
    (["--persist-s", "inf"], "--persist-s must be a finite number >= 0"),
    # Not left to hang in the divisor search of the suggestion or of the two-tier optimum.
    (["--save-interval", str(10**20)], "--save-interval must be an integer from 1 to 10^12"),
    (["--save-interval", str(10**20), "--memory-interval", "7"], "from 1 to 10^12"),
    # The option given is named, not the one it stands for.
    (["--gpu-failure-rate", "nan"], "'--gpu-failure-rate': 'nan' is not a finite number"),
    (["--gpu-failure-rate", "1" * 400],
     "'--gpu-failure-rate': '" + "1" * 12 + "..." + "1" * 13 + "' is not a finite number"),
    (["--gpu-failure-rate", "0"], "'--gpu-failure-rate': 0.0 is not in the range 1e-12<=x"),
])
def test_cli_tier_errors_are_one_line(args, message):
    bad = CliRunner().invoke(main, ["goodput", "--runs", "0", *args])
    assert bad.exit_code != 0
    assert message in bad.output and len(bad.output.strip().splitlines()) == 1


def _save(time: float, iteration: int, seconds: float, **fields) -> dict:
    return {"event": "periodic_save", "time": time, "iteration": iteration, "seconds": seconds,
            **fields}


def _persisted(time: float, iteration: int, **fields) -> dict:
    return {"event": "persisted", "time": time, "iteration": iteration, "bytes": 1 << 20,
            **fields}


def _tiered_run_dir(tmp_path):
    """launcher_events' run (one failure, an emergency save after the alert) with the save
    in the memory tier, saves of both tiers and the supervisor's persisted copies."""
    start = 1000.0
    labels = {"start_time": start, "num_gpus": 4,
              "failures": [{"gpu": 1, "failure_time": start + 100}]}
    events = launcher_events(labels, [{"gpu": 1, "time": start + 50, "reasons": ["ecc_dbe"]}])
    for event in events:
        if event["event"] == "emergency_save":
            event["tier"] = "memory"  # 8.5 s blocked, as launcher_events writes it
    events += [
        _save(start + 10, 2, 0.5, tier="memory"), _save(start + 20, 4, 0.7, tier="memory"),
        _save(start + 30, 6, 3.0, tier="disk", persist_seconds=9.0),
        _save(start + 35, 7, 5.0),  # no tier: written before the memory tier, to disk
        _save(start + 36, 8, 99.0, tier="tape"),  # unknown: neither
        _persisted(start + 40, 4, seconds=2.0), _persisted(start + 62, 27, seconds=4.0),
        _persisted(start + 63, 28),  # no seconds: unknown
    ]
    (tmp_path / "events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in sorted(events, key=lambda e: e["time"])))
    return tmp_path


def test_cli_reads_tiers_and_persisted_copies_from_the_run_dir(tmp_path):
    run_dir = _tiered_run_dir(tmp_path)
    out = CliRunner().invoke(main, ["goodput", "--run-dir", str(run_dir), "--runs", "0",
                                    "--json"])
    assert out.exit_code == 0, out.output
    body = json.loads(out.output)
    assert {"memory_save_s", "persist_s", "save_block_s", "save_persist_s"} <= set(body["measured"])
    inputs = body["inputs"]
    assert inputs["memory_save_s"] == pytest.approx(0.7)  # median of 0.5, 0.7 and 8.5
    assert inputs["persist_s"] == pytest.approx(3.0)  # median of 2 and 4 seconds
    assert inputs["save_block_s"] == pytest.approx(4.0)  # disk and untiered: 3 and 5
    assert inputs["save_persist_s"] == pytest.approx(9.0)
    assert body["two_tier"]["analytic"]["goodput"] > 0


def test_cli_measures_no_tier_where_the_events_have_none(tmp_path):
    run_dir = _tiered_run_dir(tmp_path)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    untiered = [{k: v for k, v in e.items() if k != "tier"} for e in events
                if e["event"] != "persisted" and e.get("tier") != "tape"]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in untiered))
    out = CliRunner().invoke(main, ["goodput", "--run-dir", str(run_dir), "--runs", "0",
                                    "--json", "--persist-s", "30"])
    assert out.exit_code == 0, out.output
    body = json.loads(out.output)
    assert "memory_save_s" not in body["measured"] and "persist_s" not in body["measured"]
    # The default's ratio to the disk's block, not a memory tier slower than the disk measured.
    assert body["inputs"]["memory_save_s"] == pytest.approx(
        body["inputs"]["save_block_s"] * GoodputInputs.memory_save_s / GoodputInputs.save_block_s)
    assert body["inputs"]["memory_save_s"] < GoodputInputs.memory_save_s
    assert body["inputs"]["persist_s"] == 30.0
    assert body["inputs"]["save_block_s"] == pytest.approx(3.0)  # 0.5 0.7 3 5 8.5: all disk now
