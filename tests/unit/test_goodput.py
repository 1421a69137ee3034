"""The goodput model: Young/Daly, Monte Carlo agreement, the paper's Table III, the CLI."""

import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from ftmaster import goodput, goodput_cli, report
from ftmaster.cli import main
from ftmaster.goodput import GoodputInputs

BASE = GoodputInputs()


@pytest.mark.parametrize("gpus, block_s", [(1024, 20.0), (8192, 20.0), (256, 60.0)])
def test_periodic_optimum_matches_young_daly(gpus, block_s):
    x = replace(BASE, gpus=gpus, save_block_s=block_s, save_persist_s=block_s).periodic_only()
    assert block_s * x.failure_rate_s < 1e-3  # where Young's first-order formula applies
    best = goodput.optimal_interval(x)["save_interval"] * x.iteration_s
    young = goodput.young_daly_interval_s(x)
    assert abs(best - young) / young < 0.05


@pytest.mark.parametrize("case", [
    {},  # the defaults: 1024 GPUs, recall 0.5, lead 120 s
    {"gpus": 8192, "recall": 0.9, "lead_s": 600.0},  # a periodic save can fall in the lead
    {"gpus": 8192, "recall": 0.9, "lead_s": 50.0},  # lead shorter than the persist time
    {"gpus": 8192, "recall": 0.9, "gap_frac": 1.0},
])
@pytest.mark.parametrize("proactive", [False, True])
def test_monte_carlo_agrees_with_analytic(case, proactive):
    x = replace(BASE, run_hours=240.0, **case)
    x = x if proactive else x.periodic_only()
    model, sim = goodput.analytic(x), goodput.simulate(x, runs=100, seed=1)
    assert abs(model["goodput"] - sim["goodput"]) < 0.005
    assert sim["failures"] == pytest.approx(model["failures"], rel=0.1)


@pytest.mark.parametrize("false_alarm_rate", [0.01, 0.05])
def test_false_alarms_during_a_save_take_no_extra_saves(false_alarm_rate):
    """Without failures every save is counted analytically; an alarm that arrives while a
    save blocks training must not roll progress back and take that save again."""
    x = replace(BASE, gpu_mtbf_hours=1e12, recall=0.0, false_alarm_rate=false_alarm_rate,
                run_hours=240.0)
    model, sim = goodput.analytic(x), goodput.simulate(x, runs=20, seed=1)
    assert sim["failures"] == 0
    assert sim["save_hours"] == pytest.approx(model["save_hours"], rel=0.01)


def test_a_simulation_of_millions_of_events_is_refused_up_front():
    x = replace(BASE, iteration_s=0.001, save_interval=1)
    with pytest.raises(ValueError, match=r"about 2\.6e\+09 events per run"):
        goodput.simulate(x, runs=2, max_events=1000)


@pytest.mark.parametrize("case, message", [
    # with a predictor, the first-order model has no estimate there: periodic-only's stands in
    (replace(BASE, gpu_mtbf_hours=3.0), r"about 8\.7e\+87 events"),
    (replace(BASE, gpu_mtbf_hours=3.0).single_tier().periodic_only(), r"about 8\.7e\+87 events"),
    (replace(BASE, gpu_mtbf_hours=0.3), "never end: failures outpace progress"),
])
def test_a_simulation_whose_failures_outpace_progress_is_refused_up_front(case, message):
    """It played its whole event budget (10^7 steps, over an hour) before saying so."""
    with pytest.raises(ValueError, match=message):
        goodput.simulate(case, runs=2)


@pytest.mark.parametrize("model", sorted(goodput.PAPER_TABLE_III))
def test_reproduces_paper_table_iii(model):
    checkpoint_s = goodput.paper_checkpoint_s(model)
    got = (goodput.table_iii_overhead_s(checkpoint_s, None),
           goodput.table_iii_overhead_s(checkpoint_s, 0.5),
           goodput.table_iii_overhead_s(checkpoint_s, 0.25))
    assert got == pytest.approx(goodput.PAPER_TABLE_III[model])


def test_857m_is_476_952_1904():
    assert goodput.paper_checkpoint_s("857M") == pytest.approx(9.52)
    assert [goodput.table_iii_overhead_s(9.52, g) for g in (None, 0.5, 0.25)] == \
        pytest.approx([476, 952, 1904])


def test_gap_frac_zero_leaves_one_iteration_as_the_trainer_does():
    assert goodput.table_iii_overhead_s(9.52, 0.0) == pytest.approx(500_000 * 9.52)
    assert replace(BASE, gap_frac=0.0).gap_s == BASE.iteration_s
    out = CliRunner().invoke(main, ["goodput", "--gap-frac", "0", "--runs", "0", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["worst_case_save_hours"] == pytest.approx(
        720 * 3600 / BASE.iteration_s * BASE.save_block_s / 3600)


def test_proactive_pays_with_high_recall_and_enough_lead():
    x = replace(BASE, gpus=4096, recall=0.9, lead_s=300.0)
    assert x.lead_s > x.save_persist_s + x.iteration_s
    proactive, periodic = goodput.analytic(x), goodput.analytic(x.periodic_only())
    assert proactive["goodput"] > periodic["goodput"]
    assert proactive["lost_hours"] < 0.5 * periodic["lost_hours"]
    best_p = goodput.optimal_interval(x, tune_gap=True)["goodput"]
    assert best_p >= goodput.optimal_interval(x.periodic_only())["goodput"]


def test_no_lead_means_no_gain():
    x = replace(BASE, recall=1.0, lead_s=0.0, false_alarm_rate=0.0)
    # periodic-only is exact, the proactive model first order: 1e-4 apart here
    assert goodput.analytic(x)["goodput"] == pytest.approx(
        goodput.analytic(x.periodic_only())["goodput"], rel=2e-4)


@pytest.mark.parametrize("bad", [
    {"gpus": 0}, {"gpus": 2.5}, {"gpu_mtbf_hours": 0.0}, {"iteration_s": -1.0},
    {"recall": 1.5}, {"gap_frac": -0.1}, {"save_block_s": 30.0, "save_persist_s": 10.0},
    {"save_interval": 0}, {"lead_s": float("nan")}, {"run_hours": float("inf")},
    {"restart_s": 10**400},  # an integer past float range, as JSON may hold
])
def test_bad_inputs_are_rejected(bad):
    with pytest.raises(ValueError):
        replace(BASE, **bad)


def _run_dir(tmp_path):
    """GPU 1 fails at 195 s, detected at 200 s; iteration 15 completes again at 290.5 s."""
    events = [{"event": "launch", "time": 0.0, "attempt": 0, "gpus": [0, 1]},
              {"event": "periodic_save", "time": 100.0, "iteration": 10, "seconds": 4.0},
              {"event": "emergency_save", "time": 150.0, "iteration": 14, "seconds": 6.0,
               "persist_seconds": 9.0},
              {"event": "fault_injected", "time": 195.0, "kind": "fail", "gpu": 1},
              {"event": "failure", "time": 200.0, "attempt": 0, "iteration": 16, "gpus": [1]},
              {"event": "plan", "time": 201.0, "gpus_available": [0]},
              {"event": "launch", "time": 202.0, "attempt": 1, "gpus": [0]},
              {"event": "resumed", "time": 290.5, "attempt": 1, "iteration": 15}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "logs").mkdir()
    lines = [f"iteration {i}/20 | consumed samples: {i * 8} | elapsed time per iteration "
             f"(ms): {ms} | learning rate: 1.0E-04 | global batch size: 8 | lm loss: 5.0E+00 |"
             for i, ms in ((1, 400.0), (2, 500.0), (3, 600.0))]
    (tmp_path / "logs" / "attempt_0.log").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_cli_reads_measured_inputs(tmp_path):
    run_dir = _run_dir(tmp_path)
    out = CliRunner().invoke(main, ["goodput", "--run-dir", str(run_dir), "--save-block-s",
                                    "5", "--runs", "0", "--json"])
    assert out.exit_code == 0, out.output
    body = json.loads(out.output)
    assert body["measured"] == ["iteration_s", "restart_s", "save_persist_s"]
    assert body["inputs"]["iteration_s"] == pytest.approx(0.5)
    assert body["inputs"]["restart_s"] == pytest.approx(95.0)  # fault to resumed less one iteration
    assert body["inputs"]["save_persist_s"] == pytest.approx(9.0)
    assert body["inputs"]["save_block_s"] == 5.0  # the command line wins
    assert body["proactive"]["optimum"]["save_interval"] >= 1


def test_a_restart_cut_short_by_another_failure_is_no_restart_time(tmp_path):
    """The relaunch fails before its first iteration (fault at 209 s): the first failure's
    RTO runs through the second's recovery, so it measures two restarts, not one. The restart
    time is the second's alone: 1 s to detect, 80.5 s to resume, less one iteration."""
    run_dir = _run_dir(tmp_path)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    resumed = events.pop()
    events += [{"event": "fault_injected", "time": 209.0, "kind": "fail", "gpu": 0},
               {"event": "failure", "time": 210.0, "attempt": 1, "iteration": 14, "gpus": [0],
                "before_first_iteration": True},
               {"event": "plan", "time": 211.0, "gpus_available": [1]},
               {"event": "launch", "time": 212.0, "attempt": 2, "gpus": [1]},
               {**resumed, "attempt": 2}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    measured = goodput_cli.measure(run_dir, report.load_events(run_dir))
    assert measured["restart_s"] == pytest.approx(1.0 + 80.5 - 0.5)


def test_ftmasters_own_loss_is_no_restart_time(tmp_path):
    """ftmaster killed at 400 s and started again by hand at 4000 s: its RTO spans the hour
    no ftmaster ran, and the median restart time read 1865 s, not the GPU failure's."""
    run_dir = _run_dir(tmp_path)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    events += [{"event": "failure", "time": 4000.0, "attempt": 1, "iteration": 60,
                "cause": "supervisor_lost", "lost_at": 400.0},
               {"event": "launch", "time": 4001.0, "attempt": 2, "gpus": [0]},
               {"event": "resumed", "time": 4090.0, "attempt": 2, "iteration": 55}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    measured = goodput_cli.measure(run_dir, report.load_events(run_dir))
    assert measured["restart_s"] == pytest.approx(95.0)


def test_a_nodes_join_is_no_restart_time(tmp_path):
    """A scale-up regroups with no fault: its stop, round and relaunch are no fault's
    restart, and counted they moved the median."""
    run_dir = _run_dir(tmp_path)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    events += [{"event": "failure", "time": 400.0, "attempt": 1, "iteration": 60,
                "cause": "peer", "reason": "rejoin", "gpus": []},
               {"event": "launch", "time": 401.0, "attempt": 2, "gpus": [0]},
               {"event": "resumed", "time": 700.0, "attempt": 2, "iteration": 55}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    measured = goodput_cli.measure(run_dir, report.load_events(run_dir))
    assert measured["restart_s"] == pytest.approx(95.0)


def test_a_torn_last_log_line_is_no_iteration_time(tmp_path):
    """A log cut short mid-line (a full disk, a killed rank): "(ms): 9" of "900.0" is no
    9 ms iteration."""
    run_dir = _run_dir(tmp_path)
    with (run_dir / "logs" / "attempt_0.log").open("a") as log:
        log.write("iteration 4/20 | consumed samples: 32 | elapsed time per iteration (ms): 9")
    out = CliRunner().invoke(main, ["goodput", "--run-dir", str(run_dir), "--runs", "0", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["inputs"]["iteration_s"] == pytest.approx(0.5)


def test_a_log_that_cannot_be_read_is_left_out_in_one_line_not_a_traceback(tmp_path, monkeypatch):
    """A log ftmaster may not read (another user's, mode 600) ended goodput --run-dir in a
    PermissionError traceback, and report's incident page in 'cannot make the incident page:
    logs/attempt_0.log'. Its iteration times are unknown; the other logs still count."""
    run_dir = _run_dir(tmp_path)
    (run_dir / "logs" / "attempt_1.log").write_text(
        "iteration 4/20 | consumed samples: 32 | elapsed time per iteration (ms): 900.0 |\n")
    unreadable = run_dir / "logs" / "attempt_0.log"
    open_log = report.open_log

    def denied(path):
        if path == unreadable:
            raise PermissionError(13, "Permission denied", str(path))
        return open_log(path)

    monkeypatch.setattr(report, "open_log", denied)
    out = CliRunner().invoke(main, ["goodput", "--run-dir", str(run_dir), "--runs", "0", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["inputs"]["iteration_s"] == pytest.approx(0.9)
    assert out.stderr == (f"warning: cannot read {unreadable}: Permission denied; its iteration "
                          "times are left out of the measured ones\n")


def test_cli_says_which_input_in_an_error_was_measured(tmp_path):
    run_dir = _run_dir(tmp_path)  # its saves are durable 9 s after they start
    bad = CliRunner().invoke(main, ["goodput", "--run-dir", str(run_dir), "--save-block-s",
                                    "20", "--runs", "0"])
    assert bad.exit_code == 2  # bad input, as click's own usage errors
    assert bad.output.strip() == (
        "Error: --save-persist-s (until durable) must be >= --save-block-s (blocked) "
        f"(--save-persist-s 9: measured in {run_dir})")


@pytest.mark.parametrize("value, shown", [
    (True, "true"), ("4.0", '"4.0"'), (math.nan, "NaN"), (math.inf, "Infinity"), (-4.0, "-4.0"),
    (10**400, "1" + "0" * 17 + "..." + "0" * 19)],
    ids=["true", "string", "nan", "infinite", "negative", "past_float_range"])
@pytest.mark.parametrize("field", ["seconds", "persist_seconds"])
def test_a_saves_time_that_is_no_time_is_left_out_of_the_measured_ones(tmp_path, field, value, shown):
    """A damaged or foreign event: JSON true counted as 1 s (a bool is an int to Python),
    NaN, infinity and an integer past float range (JSON integers have no bound) made the
    whole command fail, a negative time shifted the median. The other save still measures."""
    run_dir = _run_dir(tmp_path)
    events = (run_dir / "events.jsonl").read_text().splitlines()
    save = json.loads(events[1])
    assert save["event"] == "periodic_save"
    events[1] = json.dumps({**save, field: value})
    (run_dir / "events.jsonl").write_text("\n".join(events) + "\n")
    out = CliRunner().invoke(main, ["goodput", "--run-dir", str(run_dir), "--runs", "0", "--json"])
    assert out.exit_code == 0, out.output
    measured = {"seconds": ("save_block_s", 6.0), "persist_seconds": ("save_persist_s", 9.0)}
    name, seconds = measured[field]
    assert json.loads(out.stdout)["inputs"][name] == seconds  # the emergency save's alone
    assert out.stderr == ("warning: 1 emergency_save/periodic_save event(s) left out of the "
                          f"measured times: their {field} is no time in seconds (such as "
                          f"{shown})\n")


@pytest.mark.parametrize("mtbf_hours", [5e5, 1e12])
def test_the_optimum_of_a_long_mtbf_is_searched_within_the_run(mtbf_hours):
    """An MTBF far beyond the run once made the search's grid as long as it (24 GB at 1e12
    hours): no interval beyond the run's iterations is tried."""
    x = GoodputInputs(gpus=1, gpu_mtbf_hours=mtbf_hours, run_hours=100.0, iteration_s=2.0)
    with np.errstate(all="ignore"):
        best = goodput.optimal_interval(x, tune_gap=True)
    assert 1 <= best["save_interval"] <= 100 * 3600 / 2 * 1.08 + 2


RANGE = "(beyond any real run; the model's arithmetic overflows past it)"


@pytest.mark.parametrize("args, message", [
    # each input finite, the run's iterations not: an OverflowError traceback from round()
    (["--iteration-s", "1e-310"], "--iteration-s must be a number from 10^-12 to 10^12"),
    (["--run-hours", "1e308"], "--run-hours must be a number from 10^-12 to 10^12"),
    # the job's failure rate underflowed to 0: "cannot evaluate these inputs
    # (ZeroDivisionError: float division by zero)"; or overflowed to infinity, the same
    (["--gpu-mtbf-hours", "1e308"], "--gpu-mtbf-hours must be a number from 10^-12 to 10^12"),
    (["--gpu-mtbf-hours", "5e-324"], "--gpu-mtbf-hours must be a number from 10^-12 to 10^12"),
    (["--memory-save-s", "1e308"], "--memory-save-s must be a finite number >= 0, at most 10^12"),
    (["--persist-s", "1e308"], "--persist-s must be a finite number >= 0, at most 10^12"),
    # a traceback: the error's own message formatted the count as a float
    (["--gpus", str(10**400)], "--gpus must be an integer from 1 to 10^12"),
])
def test_an_input_past_the_models_range_is_refused_with_the_reason(args, message):
    bad = CliRunner().invoke(main, ["goodput", "--runs", "0", *args])
    assert bad.exit_code == 2 and isinstance(bad.exception, SystemExit), bad.output
    assert bad.output == f"Error: {message} {RANGE}\n"


def test_a_failure_rate_past_the_models_range_is_refused_at_its_option():
    bad = CliRunner().invoke(main, ["goodput", "--runs", "0", "--gpu-failure-rate", "1e-300"])
    assert bad.exit_code == 2 and "'--gpu-failure-rate': 1e-300 is not in the range" in bad.output


@pytest.mark.parametrize("args", [
    ["--iteration-s", "1e-12"],  # an iteration of 10^-300 s printed a 300-digit wall time
    ["--gpus", "1", "--gpu-mtbf-hours", "1e12", "--iteration-s", "1e-12", "--run-hours", "1e12",
     "--save-block-s", "1e12", "--save-persist-s", "1e12"],
    ["--iteration-s", "1e12", "--save-interval", str(10**12), "--run-hours", "1e12"],
])
def test_the_extremes_the_model_takes_print_no_number_longer_than_the_models_precision(args):
    out = CliRunner().invoke(main, ["goodput", "--runs", "0", *args])
    assert out.exit_code == 0, out.output
    assert max(map(len, re.findall(r"\d+", out.output))) <= 13, out.output


@pytest.mark.parametrize("args, message", [
    # numpy's own words, naming no option: "Error: expected non-negative integer"
    (["--runs", "2", "--seed", "-1"], "Invalid value for '--seed': -1 is not in the range x>=0."),
    # 10^12 raised numpy's MemoryError, 10^9 was killed for its memory
    (["--runs", "1000000000000"], "--runs must be at most 1000000 (each run's state is held in "
                                  "memory), not 1000000000000"),
    (["--runs", "1000001"], "not 1000001"),
    # the job's failure rate underflowed to 0: a ZeroDivisionError traceback from the model
    (["--runs", "0", "--gpu-mtbf-hours", "1.7e308", "--run-hours", "1e-9"],
     "--gpu-mtbf-hours must be a number from 10^-12 to 10^12"),
])
def test_inputs_the_model_cannot_take_are_one_line(args, message):
    bad = CliRunner().invoke(main, ["goodput", *args])
    assert bad.exit_code == 2 and isinstance(bad.exception, SystemExit), bad.exception
    assert message in bad.output and len(bad.output.strip().splitlines()) == 1, bad.output


def test_cli_table_and_one_line_errors():
    runner = CliRunner()
    out = runner.invoke(main, ["goodput", "--runs", "20", "--run-hours", "100"])
    assert out.exit_code == 0, out.output
    for text in ("periodic-only", "proactive", "goodput (Monte Carlo)",
                 "Young/Daly sqrt(2 C MTBF_job), the periodic-only reference:"):
        assert text in out.output
    for args, message in ((["--recall", "2"], "--recall must be between 0 and 1"),
                          (["--runs", "1"], "--runs must be 0 (analytic model only) or at least 2"),
                          (["--runs", "-3"], "not -3")):
        bad = runner.invoke(main, ["goodput", *args])
        assert bad.exit_code == 2
        assert message in bad.output and len(bad.output.strip().splitlines()) == 1


# Where the save costs as much as the job's MTBF (1 GPU, MTBF 1 h, a 1 h save): the first
# order model says goodput 0 there while the job still progresses.
COSTLY = GoodputInputs(gpus=1, gpu_mtbf_hours=1.0, iteration_s=10.0, save_block_s=3600.0,
                       save_persist_s=3600.0, restart_s=60.0, save_interval=300,
                       run_hours=200.0).periodic_only()


def daly_higher_order_s(block_s, mtbf_s):
    """Daly (2006), the published higher-order estimate of the optimum, for C < 2 MTBF."""
    ratio = block_s / (2 * mtbf_s)
    return math.sqrt(2 * block_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - block_s


def test_periodic_only_is_exact_where_the_save_costs_the_mtbf():
    model, sim = goodput.analytic(COSTLY), goodput.simulate(COSTLY, runs=40, seed=3)
    assert model["goodput"] == pytest.approx(sim["goodput"], rel=0.02)
    assert model["failures"] == pytest.approx(sim["failures"], rel=0.02)
    best_s = goodput.optimal_interval(COSTLY)["save_interval"] * COSTLY.iteration_s
    exact_s = goodput.daly_exact_interval_s(COSTLY)
    assert best_s == pytest.approx(exact_s, rel=0.01)
    assert exact_s == pytest.approx(daly_higher_order_s(3600.0, 3600.0), rel=0.02)
    # and where C << MTBF the exact optimum is Young's
    assert goodput.daly_exact_interval_s(BASE) == pytest.approx(
        goodput.young_daly_interval_s(BASE), rel=0.01)


@pytest.mark.parametrize("value", [-1 / math.e, -0.3, -0.1353, -1e-9, 0.0])
def test_lambert_w0_inverts_w_exp_w(value):
    w = goodput.lambert_w0(value)
    assert -1 <= w <= 0 and w * math.exp(w) == pytest.approx(value, abs=1e-12)


def strict_json(text):
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_the_json_is_valid_where_the_save_costs_the_mtbf_and_names_what_has_no_estimate():
    args = ["goodput", "--gpus", "1", "--gpu-mtbf-hours", "1", "--save-block-s", "3600",
            "--save-persist-s", "3600", "--iteration-s", "10", "--run-hours", "100",
            "--runs", "0", "--json"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    body = strict_json(out.output)
    assert 0 < body["periodic_only"]["analytic"]["goodput"] < body["periodic_only"]["optimum"]["goodput"]
    assert body["proactive"]["analytic"] is None
    assert "spans 4.78 of the job's MTBF" in body["proactive"]["no_estimate"]
    table = CliRunner().invoke(main, args[:-1])
    assert "proactive: a save interval with its save spans" in table.output
    assert "Daly's exact optimum" in table.output


def test_the_monte_carlo_plays_the_predictor_where_the_proactive_model_has_no_estimate():
    """The first-order model's infinite failure count there is no reason to refuse it."""
    args = ["goodput", "--gpus", "1", "--gpu-mtbf-hours", "1", "--save-block-s", "3600",
            "--save-persist-s", "3600", "--iteration-s", "10", "--save-interval", "300",
            "--restart-s", "60", "--run-hours", "20", "--runs", "20", "--json"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    body = strict_json(out.output)
    assert body["proactive"]["analytic"] is None and body["proactive"]["no_estimate"]
    assert body["proactive"]["monte_carlo"]["goodput"] == pytest.approx(
        body["periodic_only"]["monte_carlo"]["goodput"], rel=0.1)


def test_a_value_without_a_finite_estimate_is_null_and_named():
    body = goodput_cli._json_body(BASE, {}, {"two_tier": {"analytic": {
        "wall_hours": np.float64(np.inf), "goodput": np.float64(0.0)}}})
    assert body["two_tier"]["analytic"] == {"wall_hours": None, "goodput": 0.0}
    assert body["unbounded"]["fields"] == ["two_tier.analytic.wall_hours"]
    strict_json(json.dumps(body, allow_nan=False))


def test_the_help_says_which_defaults_follow_other_inputs():
    """--help said 5 and 60 where the defaults are a quarter of --save-block-s and
    --save-persist-s (``--save-persist-s 600`` gives a persist of 600)."""
    out = CliRunner().invoke(main, ["goodput", "--help"], terminal_width=200)
    assert "[default: a quarter of --save-block-s]" in out.output
    assert "[default: --save-persist-s]" in out.output


def test_a_save_that_found_its_checkpoint_on_disk_is_no_save_time(tmp_path):
    """An exit save at the iteration a persist had already copied writes nothing (0.01 s,
    ``already_on_disk``): counted, it halved the measured cost of a save."""
    run_dir = _run_dir(tmp_path)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    events += [{"event": "periodic_save", "time": 300.0, "iteration": 20, "seconds": 0.01,
                "tier": "disk", "already_on_disk": True},
               {"event": "periodic_save", "time": 301.0, "iteration": 20, "seconds": 0.02,
                "persist_seconds": 0.02, "tier": "disk", "already_on_disk": True}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    measured = goodput_cli.measure(run_dir, report.load_events(run_dir))
    assert measured["save_block_s"] == pytest.approx(5.0)  # of the 4 s and 6 s saves
    assert measured["save_persist_s"] == pytest.approx(9.0)
