"""ftmaster report on multi-node run directories (``node_<R>`` folders): one timeline, one
recovery per round with its root failure, logs merged across nodes, and bad input."""

import json

import pytest
from click.testing import CliRunner

from ftmaster.cli import main
from helpers.synth_run import (T0, alert, event, iteration_line, launch, loaded_line, plan, save,
                               write_run)


def failure(at, attempt, iteration, cause, gpus):
    return event("failure", at, attempt=attempt, iteration=iteration, cause=cause, gpus=gpus,
                 exit_codes={})


def first_generation(node, gpus=(0, 1)):
    """Every node plans TP2 x PP1 x DP2 from the same rendezvous round and launches it."""
    return [plan(0.05 * node, list(gpus), 2, 1, 2), launch(0.1 + 0.05 * node, 1, list(gpus), 2, 1, 2)]


def gpu_loss_on_node_1(run_dir):
    """Rank 0 runs on node 0 (it logs the checkpoint load), the last rank on node 1 (it logs
    the iterations). Node 1 loses GPU 1 to an injected fault after an alert and an emergency
    save; node 0 (and node 2) stop because their peer is waiting: ``peer``. Every node
    relaunches DP3; node 0 records the first resumed iteration. Node 1's relaunch logs every
    5 iterations."""
    node0 = [*first_generation(0),
             alert(40, 1, ["temperature"]),  # node 0's GPU 1, not the one that failed
             save("emergency_save", 55.01, 12, 0.5, 0.8),
             failure(70.8, 1, 16, "peer", [0, 1]),
             plan(72, [0, 1], 1, 1, 3), launch(73, 2, [0, 1], 1, 1, 3),
             event("resumed", 95.25, attempt=2, iteration=13),
             event("complete", 160, iteration=30)]
    node1 = [*first_generation(1),
             alert(50, 1, ["ecc_sbe_rate", "xid_92"]),
             event("checkpoint_request", 50.1, source="monitor", gpu=1),
             save("emergency_save", 55, 12, 0.5, 0.8),
             event("fault_injected", 70, kind="fail", gpu=1, spec="fail:gpu=1,at=iter:16", iteration=16),
             failure(70.25, 1, 16, "device_lost", [1]),
             plan(72.1, [0], 1, 1, 3), launch(73.2, 2, [0], 1, 1, 3),
             event("resumed", 95.3, attempt=2, iteration=13),
             event("complete", 160.1, iteration=30)]
    write_run(run_dir / "node_0", node0, {1: [], 2: [loaded_line(12, 1.5, 4096)]})
    write_run(run_dir / "node_1", node1, {1: [iteration_line(n, 30, 100) for n in range(1, 17)],
                                          2: [iteration_line(15, 30, 300), iteration_line(20, 30, 250)]})
    return run_dir


def run_report(*args):
    return CliRunner().invoke(main, ["report", *map(str, args)])


def reported(run_dir):
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    return result.stdout, json.loads((run_dir / "report.json").read_text())


@pytest.fixture
def two_nodes(tmp_path):
    return reported(gpu_loss_on_node_1(tmp_path / "run"))


def test_one_recovery_with_the_gpu_loss_as_root_and_the_peer_as_consequence(two_nodes):
    _, report = two_nodes
    (round_,) = report["failures"]
    assert (round_["node"], round_["attempt"], round_["cause"], round_["gpus"]) == \
        (1, 1, "device_lost", [1])
    assert round_["consequences"] == [{"node": 0, "attempt": 1, "cause": "peer", "gpus": [0, 1],
                                       "iteration": 16, "time": T0 + 70.8,
                                       "after_root_seconds": pytest.approx(0.55)}]
    assert round_["silent_nodes"] == []
    assert [n["node"] for n in report["nodes"]] == [0, 1] and report["nodes"][1]["events"] == 11


@pytest.mark.parametrize("name, problem", [
    ("node_1/events.jsonl", "is one of the run's own files"),
    ("node_1/peers.json", "is one of the run's own files"),
    ("node_0/logs/report.json", "is in {run_dir}/node_0/logs, a folder the run writes or reads"),
    ("node_1/analysis/report.json", None),
])
def test_a_nodes_own_files_are_refused_for_the_json_and_its_other_folders_are_not(tmp_path, name,
                                                                                  problem):
    run_dir = gpu_loss_on_node_1(tmp_path / "run")
    (run_dir / name).parent.mkdir(exist_ok=True)
    result = run_report(run_dir, "--json-out", run_dir / name)
    if problem is None:
        assert result.exit_code == 0, result.output
        assert json.loads((run_dir / name).read_text())["failures"]
    else:
        assert result.stderr.strip() == (f"Error: --json-out {run_dir / name} "
                                         f"{problem.format(run_dir=run_dir)}: give another path")


def test_detection_and_lead_time_use_the_root_nodes_own_gpu(two_nodes):
    _, report = two_nodes
    (round_,) = report["failures"]
    assert round_["detection_latency"] == {"seconds": pytest.approx(0.25),
                                           "since": "fault_injected fail on node 1 GPU 1"}
    # node 0's alert on its own GPU 1 at +40 is another GPU: the lead is node 1's, at +50
    assert round_["lead_time"]["seconds"] == pytest.approx(20.0)
    assert (round_["lead_time"]["node"], round_["lead_time"]["gpu"]) == (1, 1)


def test_rto_phases_span_nodes_and_logs_are_merged(two_nodes):
    """Plan: node 0's at +72 (the first); launch: node 1's at +73.2 (the last to start);
    resumed: node 0's at +95.25 (the earliest). The load is in node 0's log, the iteration
    times in node 1's: its first line, iteration 15 at 300 ms, stands for 13..15, so loaded
    at 95.25 - 0.3."""
    _, report = two_nodes
    (round_,) = report["failures"]
    assert (round_["restarted_from_iteration"], round_["load_seconds"], round_["load_bytes"]) == \
        (12, 1.5, 4096)
    assert round_["lost_iterations"] == 4
    assert round_["lost_seconds"] == pytest.approx(0.4)  # 13..16 at 100 ms, from node 1's log
    assert round_["phases"] == pytest.approx({"failure_to_plan": 1.75, "plan_to_launch": 1.2,
                                              "launch_to_loaded": 21.75,
                                              "loaded_to_first_iteration": 0.3})
    assert round_["rto_seconds"] == pytest.approx(25.0) == pytest.approx(sum(round_["phases"].values()))
    assert round_["rto_from_fault_seconds"] == pytest.approx(25.25)
    assert round_["resumed"] == {"node": 0, "attempt": 2, "iteration": 13}
    assert round_["new_layout"]["gpus_by_node"] == [{"node": 0, "gpus": [0, 1]},
                                                    {"node": 1, "gpus": [0]}]
    assert "gpus" not in round_["new_layout"]


def test_text_has_a_node_column_and_the_round_block(two_nodes):
    text, report = two_nodes
    timeline = [line for line in text.splitlines() if line.lstrip().startswith("+")]
    assert len(timeline) == len(report["timeline"]) == 20
    assert {row["node"] for row in report["timeline"]} == {0, 1}
    assert "    +70.25 s  node 1   failure            attempt 1 device_lost on GPU 1, last " \
           "iteration 16" in text
    assert "1 failure(s); outcome complete: iteration 30 (node 1)" in text
    assert "failure 1: node 1, attempt 1, device_lost on GPU 1 at +70.25 s" in text
    assert ("  also failed        node 0: peer (attempt 1, GPUs 0, 1) at +70.80 s, 0.550 s "
            "after") in text
    assert "first risk_alert: node 1 GPU 1 score 0.9 at +50.00 s" in text
    assert "RTO                25.000 s to iteration 13 (node 0 attempt 2)" in text
    assert "node 0 GPUs 0, 1; node 1 GPU 0" in text


def three_nodes_two_rounds(run_dir, hung_node_cause="hang"):
    """Round 1 as :func:`gpu_loss_on_node_1`, node 2 a peer too. Round 2: node 0's GPU 0 hangs
    at +120; node 2's ranks hit the collective timeout first (exit at +150), node 0 stops at
    +180 (``hung_node_cause``: its hang check on GPU 0, or its peers seen waiting, which names no
    GPU), node 1 stops for its peers (+181)."""
    gpu_loss_on_node_1(run_dir)
    node2 = [*first_generation(2), failure(71.0, 1, 16, "peer", [0, 1]),
             plan(72.05, [0, 1], 1, 1, 5), launch(73.1, 2, [0, 1], 1, 1, 5),
             failure(150, 2, 30, "exit", [0]), plan(183, [0, 1], 1, 1, 4),
             launch(184, 3, [0, 1], 1, 1, 4),
             event("complete", 230, iteration=60)]
    write_run(run_dir / "node_2", node2, {})
    hang = event("fault_injected", 120, kind="hang", gpu=0, spec="hang:gpu=0", iteration=30)
    second_round = {0: [hang,
                        failure(180, 2, 30, hung_node_cause, [0] if hung_node_cause == "hang" else []),
                        plan(183.01, [1], 1, 1, 4),
                        launch(184.5, 3, [1], 1, 1, 4), event("resumed", 200, attempt=3, iteration=31)],
                    1: [failure(181, 2, 30, "peer", [0]), plan(183.02, [0], 1, 1, 4),
                        launch(184.2, 3, [0], 1, 1, 4)]}
    for node, events in second_round.items():
        path = run_dir / f"node_{node}" / "events.jsonl"
        kept = [json.loads(line) for line in path.read_text().splitlines()]
        kept = [e for e in kept if e["event"] != "complete"] + events
        path.write_text("".join(json.dumps(e) + "\n" for e in kept))
    return run_dir


@pytest.mark.parametrize("cause", ["hang", "peer"])
def test_three_nodes_two_rounds_and_the_hang_is_the_root_despite_an_earlier_peer_exit(tmp_path, cause):
    text, report = reported(three_nodes_two_rounds(tmp_path / "run", cause))
    first, second = report["failures"]
    assert (first["node"], [c["node"] for c in first["consequences"]]) == (1, [0, 2])
    assert (second["node"], second["cause"], second["attempt"]) == (0, cause, 2)
    assert "root cause         unknown" not in text
    assert [(c["node"], c["cause"]) for c in second["consequences"]] == [(2, "exit"), (1, "peer")]
    assert second["consequences"][0]["after_root_seconds"] == pytest.approx(-30.0)
    assert ("  also failed        node 2: exit (attempt 2, GPU 0) at +150.00 s, 30.000 s "
            "before") in text
    assert second["detection_latency"] == {"seconds": pytest.approx(60.0),
                                           "since": "fault_injected hang on node 0 GPU 0"}
    assert second["rto_seconds"] == pytest.approx(20.0)  # the hang at +180 to resumed at +200
    assert second["phases"]["plan_to_launch"] == pytest.approx(1.5)  # +183 to node 0's +184.5
    assert second["lead_time"] is None  # round 1's alerts are not round 2's
    assert [g["node"] for g in second["new_layout"]["gpus_by_node"]] == [0, 1, 2]


def test_a_node_folder_without_events_is_listed_and_does_not_stop_the_report(tmp_path):
    """Node 1 died before writing anything; node 0's ranks failed on the lost peer."""
    run_dir = tmp_path / "run"
    write_run(run_dir / "node_0", [*first_generation(0), failure(30, 1, 10, "exit", [0]),
                                   plan(32, [0, 1], 2, 1, 1), launch(33, 2, [0, 1], 2, 1, 1),
                                   event("resumed", 50, attempt=2, iteration=6),
                                   event("complete", 80, iteration=30)], {})
    (run_dir / "node_1").mkdir()
    text, report = reported(run_dir)
    assert report["nodes"][1] == {"node": 1, "events": 0,
                                  "outcome": "no events.jsonl: this node recorded nothing"}
    (round_,) = report["failures"]
    assert (round_["node"], round_["consequences"], round_["silent_nodes"]) == (0, [], [])
    assert round_["rto_seconds"] == pytest.approx(20.0)
    assert "  node 1        0 events; no events.jsonl: this node recorded nothing" in text


def test_a_node_that_launched_and_then_recorded_nothing_is_silent(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir / "node_0", [*first_generation(0), failure(30, 1, 10, "exit", [0])], {})
    write_run(run_dir / "node_1", first_generation(1), {})
    text, report = reported(run_dir)
    assert report["failures"][0]["silent_nodes"] == [1]
    assert "  silent nodes       1 (launched, recorded no failure" in text
    assert report["nodes"][1]["outcome"].startswith("no end event")


def test_a_spare_that_saw_the_job_end_has_an_end_and_does_not_stand_for_the_run(tmp_path):
    """Node 2 stood by after losing its only GPU at iteration 12; the job completed at 30."""
    run_dir = tmp_path / "run"
    write_run(run_dir / "node_0", [*first_generation(0), event("complete", 80, iteration=30)], {})
    write_run(run_dir / "node_2", [*first_generation(2),
                                   event("complete", 81, iteration=12, on_other_nodes=True)], {})
    text, report = reported(run_dir)
    assert report["nodes"][1]["outcome"] == (
        "complete: iteration 12 here, then on the other nodes")
    assert report["outcome"] == "complete: iteration 30 (node 0)"


def test_a_nodes_lost_supervisor_is_its_round_of_silence_not_a_failure_at_its_rejoin(tmp_path):
    """Node 1's ftmaster was SIGKILLed after iteration 10 (last alive at 24) and started again
    at 100: node 0 had recovered without it at 25; node 1 rejoined at the next round."""
    run_dir = tmp_path / "run"
    write_run(run_dir / "node_0", [*first_generation(0), failure(25, 1, 10, "peer", [0, 1]),
                                   plan(27, [0, 1], 2, 1, 1), launch(28, 2, [0, 1], 2, 1, 1),
                                   event("resumed", 40, attempt=2, iteration=9),
                                   event("complete", 200, iteration=30)], {})
    write_run(run_dir / "node_1", [*first_generation(1),
                                   event("failure", 100, attempt=1, iteration=10, gpus=[],
                                         cause="supervisor_lost", exit_codes={}, lost_at=T0 + 24),
                                   event("complete", 200.5, iteration=30)], {})
    text, report = reported(run_dir)
    (round_,) = report["failures"]
    assert (round_["node"], round_["cause"], round_["time"]) == (1, "supervisor_lost", T0 + 24)
    assert [c["node"] for c in round_["consequences"]] == [0]


def test_a_round_of_peers_only_has_an_unknown_root_cause(tmp_path):
    """Node 2 launched, then died without writing; nodes 0 and 1 stopped for it."""
    run_dir = tmp_path / "run"
    write_run(run_dir / "node_0", [*first_generation(0), failure(31, 1, 10, "peer", [0, 1])], {})
    write_run(run_dir / "node_1", [*first_generation(1), save("periodic_save", 25, 8, 0.1, 0.2),
                                   failure(30, 1, 10, "peer", [0, 1])],
              {1: [iteration_line(n, 30, 100) for n in range(1, 11)]})  # the progress is known
    write_run(run_dir / "node_2", first_generation(2), {})
    text, report = reported(run_dir)
    assert report["failures"][0]["fault_at"] is not None  # the last progress
    (round_,) = report["failures"]
    assert (round_["node"], round_["cause"], round_["silent_nodes"]) == (1, "peer", [2])
    assert "  root cause         unknown: every node that recorded this failure says peer" in text


def test_a_nodes_join_is_said_a_scale_up_not_a_failure_of_unknown_cause(tmp_path):
    """Node 2 joins: nodes 0 and 1 stop for the larger round, each recording a peer failure
    with reason rejoin. The report said 'root cause unknown', sending an operator after a
    failure that never happened."""
    run_dir = tmp_path / "run"
    for node in (0, 1):
        write_run(run_dir / f"node_{node}",
                  [*first_generation(node), {**failure(30 + node, 1, 10, "peer", []),
                                             "reason": "rejoin"}], {})
    text, report = reported(run_dir)
    (round_,) = report["failures"]
    assert round_["scale_up"] is True
    assert "  cause              a node joined: the attempt stopped for a larger round " \
           "(a scale-up), no fault" in text
    assert "root cause         unknown" not in text


def test_one_nodes_folder_alone_is_a_single_node_report(tmp_path):
    run_dir = gpu_loss_on_node_1(tmp_path / "run")
    _, report = reported(run_dir / "node_1")
    assert "nodes" not in report and all("node" not in row for row in report["timeline"])
    (only,) = report["failures"]
    assert "node" not in only and "consequences" not in only
    assert only["new_layout"]["gpus"] == [0]
    assert only["detection_latency"]["since"] == "fault_injected fail on GPU 1"


def test_folders_that_are_not_node_ranks_leave_a_single_node_run_alone(tmp_path):
    events = [launch(0, 1, [0], 1, 1, 1), event("complete", 5, iteration=5)]
    run_dir = write_run(tmp_path / "run", events, {})
    (run_dir / "node_backup").mkdir()
    (run_dir / "node_2").write_text("a file, not a folder")
    _, report = reported(run_dir)
    assert "nodes" not in report and len(report["timeline"]) == 2


@pytest.mark.parametrize("command", [["report"], ["goodput", "--runs", "0", "--run-dir"]])
def test_a_node_entry_that_is_no_folder_is_said_once(tmp_path, command):
    """A node's folder replaced by a file, or a link to storage that is gone: its events were
    silently missing from the merged run."""
    run_dir = gpu_loss_on_node_1(tmp_path / "run")
    (run_dir / "node_2").write_text("a file, not a folder")
    (run_dir / "node_3").symlink_to(tmp_path / "gone")
    result = CliRunner().invoke(main, [*command, str(run_dir)])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        f"warning: {run_dir / f'node_{node}'} left out: not a node folder (a file, or a link to "
        "no folder)" for node in (2, 3)]


def write_events(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


LAUNCH = json.dumps({"event": "launch", "time": 1}) + "\n"


@pytest.mark.parametrize("files, expected", [
    ({}, "has node folders (node_0, node_1) but none holds an event: nothing to report"),
    ({"node_0/events.jsonl": ""}, "but none holds an event"),
    ({"node_0/events.jsonl": LAUNCH, "node_1/events.jsonl": LAUNCH + "{oops\n"},
     "node_1/events.jsonl line 2 is not a JSON object"),
    ({"events.jsonl": LAUNCH, "node_0/events.jsonl": LAUNCH},
     "holds both events.jsonl and node folders (node_0, node_1): give one node's folder, e.g. "),
])
def test_bad_multi_node_input_is_one_line(tmp_path, files, expected):
    for node in (0, 1):
        (tmp_path / f"node_{node}").mkdir()
    for name, text in files.items():
        write_events(tmp_path / name, text)
    result = run_report(tmp_path)
    assert result.exit_code == 1 and result.stdout == ""
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("folder", ["", "node_0"])
def test_a_nodes_second_failure_before_any_launch_is_another_round(tmp_path, folder):
    """As on a single node, where a failure is recorded and then, by the next supervisor, the
    attempt it lost: one node never fails twice in one round."""
    run_dir = tmp_path / "run"
    write_run(run_dir / folder, [launch(0, 1, [0, 1], 1, 1, 2), failure(10, 1, 5, "exit", [1]),
                                 failure(20, 1, 5, "supervisor_lost", []), plan(21, [0, 1], 1, 1, 2),
                                 launch(22, 2, [0, 1], 1, 1, 2)], {})
    _, report = reported(run_dir)
    assert [f["cause"] for f in report["failures"]] == ["exit", "supervisor_lost"]


def test_a_peer_failure_is_never_the_root_even_when_its_clock_says_first(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir / "node_0", [*first_generation(0), failure(70.2, 1, 16, "peer", [0, 1])], {})
    write_run(run_dir / "node_1", [*first_generation(1), failure(70.25, 1, 16, "exit", [1])], {})
    _, report = reported(run_dir)
    (round_,) = report["failures"]
    assert (round_["node"], round_["cause"]) == (1, "exit")
    assert round_["consequences"][0]["after_root_seconds"] == pytest.approx(-0.05)


def test_the_incident_page_says_whose_each_row_and_failure_is_and_counts_the_jobs_gpus(tmp_path):
    run_dir = gpu_loss_on_node_1(tmp_path / "run")
    reported(run_dir)
    page = (run_dir / "report.html").read_text()
    assert "<th>node</th>" in page and "<td class='n'>1</td><td>failure</td>" in page
    assert "Failure 1: node 1 device_lost on GPU 1 at" in page
    assert "also failed        node 0: peer" not in page and "also failed node 0: peer" in page
    assert "4 GPUs" in page  # 2 on each node, not the 2 of one


def test_a_marker_goes_on_its_own_nodes_row():
    from ftmaster.incident import _attempts, _row_at

    events = [{"event": "launch", "time": 1.0, "attempt": 1, "node": 0},
              {"event": "launch", "time": 2.0, "attempt": 1, "node": 1},
              {"event": "failure", "time": 5.0, "attempt": 1, "node": 0}]
    attempts = _attempts(events)
    assert _row_at(attempts, events[2]) == 0  # node 0's, not node 1's later launch
    assert [a["end"] for a in attempts] == [5.0, 5.0]  # node 1's attempt ends with the last event


def test_a_node_whose_samples_are_damaged_is_said_to_be_missing_from_the_risk_plots(tmp_path):
    """The page's risk plots merge every node's gpu_metrics.csv; a node whose file is damaged
    is left out of them with a note, which report dropped: the plots silently lacked it."""
    from test_incident_page import with_samples

    run_dir = gpu_loss_on_node_1(tmp_path / "run")
    with_samples(run_dir / "node_0")
    (run_dir / "node_1" / "gpu_metrics.csv").write_bytes(b"\xff\xfe garbage\n")
    result = run_report(run_dir)
    assert result.exit_code == 0, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"warning: node 1 left out: {run_dir / 'node_1' / 'gpu_metrics.csv'} ")
    assert line.endswith("; the incident page's risk plots lack this node")
