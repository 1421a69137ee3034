"""ftmaster analyze on a generated run directory: summary values, plots, report, bad input."""

import io
import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from ftmaster import runfiles
from ftmaster.cli import main
from ftmaster.monitor.schema import CSV_COLUMNS
from helpers.synth_run import failing_spec, write_run_dir

RUN = failing_spec(gpus=4, hours=0.5, interval_s=5.0, failing_gpu=2)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """One generated run directory (trace plus monitor replay) for the whole module."""
    run_dir = tmp_path_factory.mktemp("generated")
    write_run_dir(run_dir, RUN)
    return run_dir


@pytest.fixture
def run_copy(generated, tmp_path):
    return Path(shutil.copytree(generated, tmp_path / "run"))


@pytest.fixture(scope="module")
def analysed(generated):
    out = generated.parent / "analysis"
    result = CliRunner().invoke(main, ["analyze", str(generated), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return pd.read_csv(runfiles.metrics_csv_path(generated)), out, runfiles.read_events(generated)


def test_summary_matches_the_data(analysed):
    data, out, events = analysed
    summary = pd.read_csv(out / "summary.csv", index_col="gpu")
    by_gpu = data.groupby("gpu_id")
    assert list(summary.index) == [0, 1, 2, 3]
    assert (summary["samples"] == by_gpu.size()).all()
    assert summary["temperature_max"].to_numpy() == pytest.approx(
        by_gpu["temperature"].max().to_numpy(), abs=0.01)
    assert summary["power_draw_mean"].to_numpy() == pytest.approx(
        by_gpu["power_draw"].mean().to_numpy(), abs=0.01)
    headroom = (data["memory_total"] - data["memory_used"]).groupby(data["gpu_id"]).min()
    assert summary["memory_headroom_min_mib"].to_numpy() == pytest.approx(headroom.to_numpy())
    assert summary.loc[2, "samples"] < summary.loc[0, "samples"]  # lost at 60% of the trace
    sbe = data.loc[data.gpu_id == 2, "ecc_sbe"]
    assert summary.loc[2, "ecc_sbe_new"] == sbe.iloc[-1] - sbe.iloc[0] > 0
    alerts = pd.Series([e["gpu"] for e in events if e["event"] == "risk_alert"]).value_counts()
    assert alerts[2] >= 2  # the ECC burst's warning, then the lost device
    assert summary["alerts"].to_dict() == alerts.reindex(range(4), fill_value=0).to_dict()
    assert summary.loc[2, "failure_risk_max"] == pytest.approx(1.0, abs=0.01)
    assert "| gpu | samples |" in (out / "summary.md").read_text()


def test_plots_and_html_are_written(analysed):
    _, out, _ = analysed
    for name in ("temperature", "power_draw", "gpu_utilization", "failure_risk"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 20_000  # lines, legend and labels, not an empty canvas
    report = (out / "report.html").read_text()
    assert report.count("data:image/png;base64,") >= 5
    assert "<table" in report and "risk_alert events" in report


def test_without_events_alerts_are_samples_over_threshold(run_copy, tmp_path):
    csv_path = runfiles.metrics_csv_path(run_copy)
    runfiles.events_path(run_copy).unlink()
    data = pd.read_csv(csv_path)
    out = tmp_path / "analysis"
    result = CliRunner().invoke(main, ["analyze", str(csv_path), "--out", str(out),
                                       "--risk-threshold", "0.9"])
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(out / "summary.csv", index_col="gpu")
    assert summary.loc[2, "alerts"] == (data.loc[data.gpu_id == 2, "failure_risk"] >= 0.9).sum() > 0


def test_damaged_events_spoil_only_their_own_lines(run_copy, tmp_path, analysed):
    """Bytes that are not UTF-8 (a torn write, a disk error) no longer stop the reading: they
    are replaced, so their line still counts when it is otherwise whole. An alert naming no
    GPU number is skipped."""
    events = runfiles.events_path(run_copy)
    with events.open("ab") as handle:
        handle.write(b'{"event": "risk_alert", "time": 1, "gpu": 2, "note": "\xff\xfe"}\n')
        handle.write(b'{"event": "risk_alert", "time": 2, "gpu": "x"}\n')
        handle.write(b"[" * 100_000 + b"\n")  # nested past the parser's depth
    out = tmp_path / "analysis"
    result = CliRunner().invoke(main, ["analyze", str(run_copy), "--out", str(out)])
    assert result.exit_code == 0, result.output
    before = pd.read_csv(analysed[1] / "summary.csv", index_col="gpu")["alerts"]
    after = pd.read_csv(out / "summary.csv", index_col="gpu")["alerts"]
    assert after.to_dict() == {**before.to_dict(), 2: before[2] + 1}


def test_a_torn_last_row_is_left_out_and_said_in_one_line(run_copy, tmp_path, analysed):
    """A live monitor's (or a killed one's) last row without its newline: read, its value
    cut short ("8" of GPU 1's memory_total) gave a headroom of minus most of the memory."""
    csv_path = runfiles.metrics_csv_path(run_copy)
    row = csv_path.read_text().splitlines()[-1].split(",")
    cut = row[:CSV_COLUMNS.index("memory_total")] + ["8"]
    after = summary_with_a_torn_line(run_copy, tmp_path, csv_path, ",".join(cut))
    assert after.loc[int(row[1]), "memory_headroom_min_mib"] > 0
    pd.testing.assert_frame_equal(after, pd.read_csv(analysed[1] / "summary.csv", index_col="gpu"))


def test_a_torn_last_event_is_left_out_and_said_in_one_line(run_copy, tmp_path, analysed):
    """As ftmaster report says of it (one shared reader): a live run's (or a killed writer's)
    last event without its newline, here whole but for it, was counted silently."""
    alert = json.dumps({"event": "risk_alert", "time": 1, "gpu": 2})
    after = summary_with_a_torn_line(run_copy, tmp_path, runfiles.events_path(run_copy), alert)
    pd.testing.assert_frame_equal(after, pd.read_csv(analysed[1] / "summary.csv", index_col="gpu"))


def summary_with_a_torn_line(run_copy, tmp_path, path, line):
    """analyze's summary.csv once ``line`` is appended to ``path`` without its newline, after
    checking the one warning line it gave."""
    with path.open("a") as handle:
        handle.write(line)
    out = tmp_path / "analysis"
    result = CliRunner().invoke(main, ["analyze", str(run_copy), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stderr == (f"warning: {path}: its last line is incomplete (no newline: "
                             "still being written, or cut short), skipped\n")
    return pd.read_csv(out / "summary.csv", index_col="gpu")


def test_an_events_file_that_cannot_be_read_is_one_line(run_copy, tmp_path):
    events = runfiles.events_path(run_copy)
    events.unlink()
    events.mkdir()
    result = CliRunner().invoke(main, ["analyze", str(run_copy), "--out", str(tmp_path / "a")])
    assert result.exit_code != 0
    assert result.output.strip() == f"Error: cannot read {events}: Is a directory"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["gpu_metrics.csv", "events.jsonl"])
def test_a_fifo_in_a_files_place_is_one_line_not_a_wait_for_a_writer(run_copy, tmp_path, name):
    fifo = run_copy / name
    fifo.unlink()
    os.mkfifo(fifo)
    result = CliRunner().invoke(main, ["analyze", str(run_copy), "--out", str(tmp_path / "a")])
    assert result.exit_code == 1
    assert result.output == (f"Error: cannot read {fifo}: not a regular file (a FIFO, socket or "
                             "device)\n")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["summary.csv", "summary.md", "temperature.png", "report.html"])
def test_a_fifo_in_an_outputs_place_is_one_line_not_a_wait_for_a_reader(run_copy, tmp_path, name):
    out = tmp_path / "a"
    out.mkdir()
    os.mkfifo(out / name)
    result = CliRunner().invoke(main, ["analyze", str(run_copy), "--out", str(out)])
    assert result.exit_code == 1
    assert result.output == f"Error: cannot write {out / name}: a FIFO nobody reads (or a socket)\n"


def test_a_source_whose_name_is_not_utf8_is_analysed(run_copy, tmp_path):
    """A folder named on a machine with another locale (Latin-1 "été")."""
    source = run_copy.rename(tmp_path / os.fsdecode(b"\xe9t\xe9"))
    result = CliRunner().invoke(main, ["analyze", str(source), "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert os.fsencode(source) in (tmp_path / "a" / "report.html").read_bytes()


def test_missing_optional_columns_are_skipped(run_copy, tmp_path):
    csv_path = runfiles.metrics_csv_path(run_copy)
    pd.read_csv(csv_path)[["timestamp", "gpu_id", "temperature"]].to_csv(csv_path, index=False)
    result = CliRunner().invoke(main, ["analyze", str(run_copy), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(tmp_path / "o" / "summary.csv")
    assert "temperature_max" in summary and "power_draw_mean" not in summary
    assert (tmp_path / "o" / "temperature.png").exists()


@pytest.mark.parametrize("content, expected", [
    ("", "is empty"),
    ("timestamp,gpu_id,temperature\n", "no samples"),
    ("time,gpu,temp\n1,0,50\n", "lacks required column"),
    ("timestamp,gpu_id,temperature\n2026-01-01T00:00:00Z,0,hot\n", "malformed"),
    ("timestamp,gpu_id\nyesterday,0\n", "no samples"),
    ("timestamp,gpu_id,temperature\n2026-01-01T00:00:00Z,1.5,50\n", "not a whole number (1.5)"),
    # milliseconds: dates no plot can draw (a traceback from matplotlib)
    ("timestamp,gpu_id,temperature\n1767225600000,0,50\n", "unix seconds up to 2096"),
    ("timestamp,gpu_id,temperature\n2026-01-01T00:00:00Z,-1,50\n", "gpu_id out of range (-1)"),
    ("timestamp,gpu_id,errors\n2026-01-01T00:00:00Z,0,0\n2026-01-01T00:00:10Z,0,0.5\n",
     "errors 0.5, not a whole count"),  # a cast's traceback
    ("timestamp,gpu_id,ecc_dbe\n2026-01-01T00:00:00Z,0,1e30\n", "ecc_dbe 1e+30, not a whole count"),
    ('"' + "x" * 200_000 + "\n", "not a gpu_metrics.csv: field larger than field limit"),
])
def test_bad_csv_is_one_line_and_non_zero(tmp_path, content, expected):
    csv_path = tmp_path / "gpu_metrics.csv"
    csv_path.write_text(content)
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "launch", "time": 0}) + "\n")
    result = CliRunner().invoke(main, ["analyze", str(csv_path), "--out", str(tmp_path / "o")])
    assert result.exit_code != 0
    assert expected in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "Traceback" not in result.output


@pytest.mark.parametrize("stamp", ["0001-01-01T00:00:00Z", "9999-12-31T23:59:59Z", "-5"])
def test_a_timestamp_no_plot_can_draw_leaves_out_its_row_not_the_file(tmp_path, stamp):
    """A year pandas cannot hold (another tool's zero time, a clock gone wrong) is no valid
    timestamp, as garbage is not: its row is left out."""
    csv_path = tmp_path / "gpu_metrics.csv"
    csv_path.write_text(f"timestamp,gpu_id,temperature\n{stamp},0,99\n"
                        "2026-01-01T00:00:00Z,0,50\n2026-01-01T00:00:10Z,0,51\n")
    result = CliRunner().invoke(main, ["analyze", str(csv_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(tmp_path / "o" / "summary.csv")
    assert (summary["samples"][0], summary["temperature_max"][0]) == (2, 51)


@pytest.mark.parametrize("time", [1e12, -1e12, float("nan"), float("inf"), True])
def test_an_event_at_no_drawable_time_is_left_out_and_a_bom_is_read(tmp_path, time):
    csv_path = tmp_path / "gpu_metrics.csv"
    csv_path.write_bytes("\ufefftimestamp,gpu_id,temperature\n".encode() +
                         b"2026-01-01T00:00:00Z,0,50\n2026-01-01T00:00:10Z,0,51\n")
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "failure", "time": time}) + "\n")
    result = CliRunner().invoke(main, ["analyze", str(csv_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output


def test_an_out_folder_that_cannot_be_made_is_one_line(generated, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    result = CliRunner().invoke(main, ["analyze", str(generated), "--out", str(blocker / "o")])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        f"Error: cannot create --out {blocker / 'o'}: Not a directory"]


def test_an_empty_out_is_refused_not_the_working_directory(generated, tmp_path, monkeypatch):
    """An unset variable (--out "$OUT") wrote the ten files into the working directory."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["analyze", str(generated), "--out", ""])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "Error: Invalid value for '--out': needs a folder, got an empty value"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target", [".", "gpu_metrics.csv"])
def test_a_run_directory_is_no_out_folder(run_copy, target):
    """There ftmaster report writes its incident page, report.html: one overwrote the other."""
    page = run_copy / "report.html"
    assert CliRunner().invoke(main, ["report", str(run_copy)]).exit_code == 0
    before = page.read_bytes()
    result = CliRunner().invoke(main, ["analyze", str(run_copy / target), "--out", str(run_copy)])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        f"Error: --out {run_copy} is a run directory, where ftmaster report writes its incident "
        f"page, report.html: give a folder of its own, e.g. {run_copy / 'analysis'}"]
    assert page.read_bytes() == before


@pytest.mark.parametrize("out, folder, run_dir", [
    ("logs", "logs", "."), ("flags", "flags", "."), ("ranks", "ranks", "."),
    ("logs/analysis", "logs", "."), ("node_0/logs", "node_0/logs", "node_0"),
])
def test_a_folder_the_run_writes_is_no_out_folder(run_copy, out, folder, run_dir):
    """As ftmaster report --json-out refuses them (the same check): analyze's files went among
    the run's logs, flags or rank records."""
    if run_dir == "node_0":  # a multi-node run: the node's folder holds the run's layout
        (run_copy / "node_0").mkdir()
        for name in ("events.jsonl", "gpu_metrics.csv"):
            (run_copy / name).rename(run_copy / "node_0" / name)
    out, folder, run_dir = run_copy / out, run_copy / folder, (run_copy / run_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    before = sorted(folder.iterdir())
    result = CliRunner().invoke(main, ["analyze", str(run_copy), "--out", str(out)])
    assert result.exit_code != 0
    where = "is" if out == folder else "is in"
    assert result.output.strip().splitlines() == [
        f"Error: --out {out} {where} {folder}, a folder the run writes or reads: give a folder "
        f"of its own, e.g. {run_dir / 'analysis'}"]
    assert sorted(folder.iterdir()) == before  # nothing written, not even --out made


def analyze_csv(tmp_path, lines):
    """ftmaster analyze on a CSV of ``lines``; (summary.csv as text, summary.md)."""
    csv_path = tmp_path / "gpu_metrics.csv"
    csv_path.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(main, ["analyze", str(csv_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    return (tmp_path / "o" / "summary.csv").read_text(), (tmp_path / "o" / "summary.md").read_text()


@pytest.mark.parametrize("gpu0_power", ["[N/A]", "", "[Not Supported]", "[Unknown Error]"])  # nvidia-smi's
def test_a_metric_one_gpu_never_knew_is_n_a_and_an_empty_csv_cell(tmp_path, gpu0_power):
    summary_csv, summary_md = analyze_csv(tmp_path, [
        "timestamp,gpu_id,power_draw",
        f"2026-01-01T00:00:00Z,0,{gpu0_power}", f"2026-01-01T00:00:01Z,0,{gpu0_power}",
        "2026-01-01T00:00:00Z,1,100", "2026-01-01T00:00:01Z,1,110"])
    assert "| 0 | 2 | 2026-01-01T00:00:00Z | 2026-01-01T00:00:01Z | 0.0 | n/a | n/a | 0 |" \
        in summary_md
    assert "\n0,2,2026-01-01T00:00:00Z,2026-01-01T00:00:01Z,0.0,,,0\n" in summary_csv


def test_a_cell_that_is_no_finite_number_is_unknown_not_an_extreme(tmp_path):
    """inf, -inf and a value past float32 (1e39) are no reading: they neither make a mean or
    a maximum infinite nor count as an alert; and nothing but the summary is printed."""
    csv_path = tmp_path / "gpu_metrics.csv"
    csv_path.write_text("timestamp,gpu_id,temperature,power_draw,failure_risk\n"
                        "2026-01-01T00:00:00Z,0,50,100,0.1\n2026-01-01T00:00:01Z,0,inf,1e39,inf\n"
                        "2026-01-01T00:00:02Z,0,-inf,-inf,0.2\n")
    result = CliRunner().invoke(main, ["analyze", str(csv_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0 and result.stderr == "", result.output
    row = pd.read_csv(tmp_path / "o" / "summary.csv").iloc[0]
    assert row["samples"] == 3
    assert (row["temperature_mean"], row["temperature_max"]) == (50, 50)
    assert (row["power_draw_mean"], row["power_draw_max"]) == (100, 100)
    assert (row["failure_risk_max"], row["alerts"]) == (pytest.approx(0.2), 0)


def test_an_entirely_empty_column_is_n_a_for_every_gpu(tmp_path):
    summary_csv, summary_md = analyze_csv(tmp_path, [
        "timestamp,gpu_id,temperature,power_draw",
        "2026-01-01T00:00:00Z,0,50,", "2026-01-01T00:00:00Z,1,51,"])
    assert summary_md.count("| n/a | n/a |") == 2
    rows = pd.read_csv(io.StringIO(summary_csv), index_col="gpu")
    assert rows[["power_draw_mean", "power_draw_max"]].isna().all().all()


def test_error_counters_count_only_errors_during_the_trace(tmp_path):
    """The counters start at their totals since driver load; a reset (driver reload) does not
    subtract; a GPU that never reports one has no count."""
    summary_csv, _ = analyze_csv(tmp_path, [
        "timestamp,gpu_id,ecc_dbe",
        "2026-01-01T00:00:00Z,0,40", "2026-01-01T00:00:00Z,1,[N/A]",
        "2026-01-01T00:00:01Z,0,41", "2026-01-01T00:00:01Z,1,[N/A]",
        "2026-01-01T00:00:02Z,0,0",  # reloaded
        "2026-01-01T00:00:03Z,0,2"])  # 1 + 2 new
    rows = pd.read_csv(io.StringIO(summary_csv), index_col="gpu")
    assert rows.loc[0, "ecc_dbe_new"] == 3
    assert pd.isna(rows.loc[1, "ecc_dbe_new"])


@pytest.mark.parametrize("readings, new", [
    (["00:00:00Z,0,41", "00:00:01Z,0,2"], 2),  # the reload's first reading: 2 new errors
    (["00:00:00Z,0,5", "00:00:10Z,0,3", "00:00:20Z,0,3"], 3),
    # the clock stepped back between the second and the third reading, written in turn
    (["00:01:40Z,0,0", "00:03:20Z,0,5", "00:02:30Z,0,8", "00:04:10Z,0,8"], 8),
    # float32 reads 16777217 as 16777216: the rise of one went unseen
    (["00:00:00Z,0,16777216", "00:00:01Z,0,16777217"], 1),
])
def test_a_counter_counts_in_the_order_written_and_from_zero_after_a_reset(
        tmp_path, readings, new):
    summary_csv, _ = analyze_csv(tmp_path, ["timestamp,gpu_id,ecc_sbe",
                                            *(f"2026-01-01T{r}" for r in readings)])
    assert pd.read_csv(io.StringIO(summary_csv), index_col="gpu").loc[0, "ecc_sbe_new"] == new


def test_rows_without_a_time_or_gpu_are_left_out_with_a_warning(tmp_path):
    csv_path = tmp_path / "gpu_metrics.csv"
    csv_path.write_text("timestamp,gpu_id,errors\n2026-01-01T00:00:00Z,0,0\noops,0,7\n"
                        "2026-01-01T00:00:20Z,,9\n2026-01-01T00:00:30Z,0,0\n")
    result = CliRunner().invoke(main, ["analyze", str(csv_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert result.stderr == (f"warning: {csv_path}: 2 row(s) without a valid timestamp or gpu_id "
                             "left out\n")
    assert pd.read_csv(tmp_path / "o" / "summary.csv").iloc[0]["samples"] == 2


def test_the_xid_codes_each_gpu_reported_are_listed_in_the_order_first_seen(tmp_path):
    summary_csv, summary_md = analyze_csv(tmp_path, [
        "timestamp,gpu_id,xid",
        "2026-01-01T00:00:00Z,0,", "2026-01-01T00:00:00Z,1,",
        "2026-01-01T00:00:02Z,1,79", "2026-01-01T00:00:01Z,1,48",  # rows out of time order
        "2026-01-01T00:00:03Z,1,48", "2026-01-01T00:00:03Z,0,[N/A]"])
    rows = pd.read_csv(io.StringIO(summary_csv), index_col="gpu", dtype={"xids": str})
    assert rows.loc[1, "xids"] == "48 79"
    assert pd.isna(rows.loc[0, "xids"])
    assert "| 48 79 |" in summary_md
