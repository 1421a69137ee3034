"""ftmaster analyze on a generated multi-node run (``node_<R>`` folders): a GPU is (node, GPU)
in the summary and the plots, events come from every node, and a node without samples."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from ftmaster import analyze as analyze_module
from ftmaster import runfiles
from ftmaster.cli import main
from helpers.synth_run import failing_spec, write_nodes_run_dir

# Node 1 loses its GPU 1; nodes 0 and 2 record that as "peer" failures. Other seeds, other data.
SPECS = [failing_spec(gpus=2, hours=0.5, interval_s=5.0, failing_gpu=gpu, seed=node)
         for node, gpu in enumerate((None, 1, None))]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("nodes")
    write_nodes_run_dir(run_dir, SPECS)
    return run_dir


@pytest.fixture
def run_copy(generated, tmp_path):
    return Path(shutil.copytree(generated, tmp_path / "run"))


def run_analyze(target, out):
    return CliRunner().invoke(main, ["analyze", str(target), "--out", str(out)])


@pytest.fixture(scope="module")
def analysed(generated):
    out = generated.parent / "nodes_analysis"
    result = run_analyze(generated, out)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    summary = pd.read_csv(out / "summary.csv", index_col=["node", "gpu"], dtype={"xids": str})
    return summary.fillna({"xids": ""}), out  # an empty cell: no XID, as the table has it


def node_data(run_dir, node):
    folder = run_dir / f"node_{node}"
    return pd.read_csv(runfiles.metrics_csv_path(folder)), runfiles.read_events(folder)


def test_a_row_per_node_and_gpu_from_that_nodes_own_samples_and_alerts(generated, analysed):
    summary, _ = analysed
    assert list(summary.index) == [(node, gpu) for node in range(3) for gpu in range(2)]
    for node in range(3):
        data, events = node_data(generated, node)
        rows = summary.loc[node]
        assert list(rows["samples"]) == list(data.groupby("gpu_id").size())
        assert rows["temperature_max"].to_numpy() == pytest.approx(
            data.groupby("gpu_id")["temperature"].max().to_numpy(), abs=0.01)
        alerts = pd.Series([e["gpu"] for e in events if e["event"] == "risk_alert"], dtype=int)
        expected = alerts.value_counts().reindex(range(2), fill_value=0)
        assert rows["alerts"].to_dict() == expected.to_dict()
    assert summary.loc[(1, 1), "alerts"] >= 2  # the ECC burst's warning, then the lost device
    assert summary.loc[(1, 1), "xids"] == "48"  # the burst's double-bit ECC error
    assert (summary.drop(index=(1, 1))["xids"] == "").all()
    assert summary.loc[(0, 1), "alerts"] == 0  # same GPU id on another node: none of those
    assert summary.loc[(1, 1), "failure_risk_max"] == pytest.approx(1.0, abs=0.01)
    assert summary.loc[(1, 1), "samples"] < summary.loc[(1, 0), "samples"]  # lost at 60%


def summary_of(target):
    """The summary table and alert source, without plots (they take most of the time)."""
    trace = analyze_module.load_trace(target)
    return analyze_module.summarize(trace.frame, trace.events, 0.95)


def test_a_node_folder_alone_is_the_single_node_analysis_of_the_same_rows(generated, analysed):
    summary, out = analysed
    alone, _ = summary_of(generated / "node_1")
    assert list(alone.index.names) == ["gpu"]
    pd.testing.assert_frame_equal(alone, summary.loc[1], check_dtype=False, check_index_type=False,
                                  check_names=False)
    assert analyze_module.to_markdown(alone).startswith("| gpu | samples |")
    assert (out / "summary.md").read_text().startswith("| node | gpu | samples |")
    assert "alerts: risk_alert events (node 0, 1, 2)" in (out / "summary.md").read_text()


def test_plots_have_a_line_per_node_and_gpu_and_every_nodes_events(generated, tmp_path, monkeypatch):
    drawn = {}
    close = analyze_module.plt.close

    def record(fig):
        ax = fig.axes[0]
        markers = {c.get_label(): len(c.get_segments()) for c in ax.collections
                   if not c.get_label().startswith("_")}
        drawn[ax.get_title()] = (ax.get_legend_handles_labels()[1], markers)
        close(fig)

    monkeypatch.setattr(analyze_module.plt, "close", record)
    result = run_analyze(generated, tmp_path / "o")
    assert result.exit_code == 0, result.output
    labels, markers = next(v for title, v in drawn.items() if title.startswith("Failure risk"))
    assert labels[:6] == [f"node {n} GPU {g}" for n in range(3) for g in range(2)]
    failures = sum(e["event"] == "failure" for n in range(3) for e in node_data(generated, n)[1])
    assert markers["failure"] == failures == 3  # node 1's device_lost and two peers
    assert markers["launch / relaunch"] == 6
    assert len(drawn) == len(list((tmp_path / "o").glob("*.png")))


def test_a_node_without_samples_is_left_out_with_a_note(run_copy, tmp_path):
    runfiles.metrics_csv_path(run_copy / "node_2").unlink()
    (run_copy / "node_0" / "gpu_metrics.csv").write_text("")
    result = run_analyze(run_copy, tmp_path / "o")
    assert result.exit_code == 0, result.output
    warnings = result.stderr.strip().splitlines()
    empty, missing = (run_copy / f"node_{node}" / "gpu_metrics.csv" for node in (0, 2))
    assert warnings == [f"warning: node 0 left out: {empty} is empty: expected a gpu_metrics.csv "
                        "header and samples",
                        f"warning: node 2 left out: cannot read {missing}: No such file or directory"]
    summary = pd.read_csv(tmp_path / "o" / "summary.csv")
    assert set(summary["node"]) == {1}
    assert "note: node 2 left out: cannot read" in (tmp_path / "o" / "summary.md").read_text()
    assert "<p>note: node 0 left out:" in (tmp_path / "o" / "report.html").read_text()


def test_a_node_with_a_damaged_csv_is_left_out_with_a_note(run_copy, tmp_path):
    """One node's disk filled or garbled its file: the run's other nodes are still analysed."""
    unreadable, malformed = (runfiles.metrics_csv_path(run_copy / f"node_{node}") for node in (0, 2))
    with unreadable.open("ab") as csv_file:
        csv_file.write(b"\xff\xfe\x00garbage\n")
    with malformed.open("a") as csv_file:
        csv_file.write("2026-01-01T00:00:00Z,GPU-0\n")  # no gpu_id
    result = run_analyze(run_copy, tmp_path / "o")
    assert result.exit_code == 0, result.output
    warnings = result.stderr.strip().splitlines()
    assert [w.split(":")[0] for w in warnings] == ["warning"] * 2
    assert warnings[0].startswith(f"warning: node 0 left out: {unreadable} is malformed (")
    assert warnings[1].startswith(f"warning: node 2 left out: {malformed} is malformed (")
    assert set(pd.read_csv(tmp_path / "o" / "summary.csv")["node"]) == {1}
    assert "note: node 0 left out:" in (tmp_path / "o" / "summary.md").read_text()


def test_a_node_entry_that_is_no_folder_is_said(run_copy, tmp_path):
    """A node's folder that is a link to storage that is gone: its samples were silently
    missing from the merged run."""
    shutil.rmtree(run_copy / "node_2")
    (run_copy / "node_2").symlink_to(tmp_path / "gone")
    result = run_analyze(run_copy, tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert result.stderr == (f"warning: {run_copy / 'node_2'} left out: not a node folder (a "
                             "file, or a link to no folder)\n")
    assert set(pd.read_csv(tmp_path / "o" / "summary.csv")["node"]) == {0, 1}


def test_a_run_whose_every_node_is_damaged_is_one_line_naming_why(run_copy, tmp_path):
    for node in range(3):
        runfiles.metrics_csv_path(run_copy / f"node_{node}").write_text("time,gpu\n1,0\n")
    result = run_analyze(run_copy, tmp_path / "o")
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert "none holds a GPU sample: nothing to analyse (node 0 left out: " in result.output
    assert "node_2/gpu_metrics.csv lacks required column(s) timestamp, gpu_id" in result.output


def test_a_node_without_events_counts_its_samples_over_the_threshold(run_copy):
    runfiles.events_path(run_copy / "node_1").unlink()
    summary, alert_source = summary_of(run_copy)
    data, _ = node_data(run_copy, 1)
    over = data[data["failure_risk"] >= 0.95].groupby("gpu_id").size()
    assert summary.loc[(1, 1), "alerts"] == over[1] > 0
    assert alert_source == "risk_alert events (node 0, 2); samples with failure_risk >= 0.95 (node 1)"


@pytest.mark.parametrize("files, expected", [
    ({}, "has node folders (node_0, node_1) but none holds a GPU sample: nothing to analyse"),
    ({"node_0/gpu_metrics.csv": "timestamp,gpu_id\n"}, "none holds a GPU sample"),
    ({"gpu_metrics.csv": "timestamp,gpu_id\n2026-01-01T00:00:00Z,0\n"},
     "holds both gpu_metrics.csv and node folders (node_0, node_1)"),
])
def test_bad_multi_node_input_is_one_line(tmp_path, files, expected):
    run_dir = tmp_path / "run"
    for node in (0, 1):
        (run_dir / f"node_{node}").mkdir(parents=True)
        (run_dir / f"node_{node}" / "events.jsonl").write_text(json.dumps({"event": "launch",
                                                                            "time": 0}) + "\n")
    for name, text in files.items():
        (run_dir / name).write_text(text)
    result = run_analyze(run_dir, tmp_path / "o")
    assert result.exit_code != 0
    assert expected in result.output and len(result.output.strip().splitlines()) == 1
    assert "Traceback" not in result.output
