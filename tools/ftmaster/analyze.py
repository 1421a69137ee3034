"""``ftmaster analyze CSV_OR_RUN_DIR --out DIR``: what the GPUs did, as tables and plots.

Writes into DIR:

* ``summary.csv`` and ``summary.md``: one row per GPU (samples, time span, mean/max
  temperature, power and utilisation, smallest memory headroom, errors new during the trace,
  XID codes seen, max risk, alerts); a value the trace never knew (``[N/A]`` throughout) is
  an empty CSV cell and ``n/a`` in Markdown and HTML;
* one PNG per metric with every GPU over time, and ``failure_risk.png`` with the alert
  threshold; when ``events.jsonl`` is beside the CSV, vertical markers for emergency saves,
  failures, plans and launches;
* ``report.html``: the tables and the PNGs (base64), one self-contained file.

DIR is never a run directory: there ``report.html`` is ``ftmaster report``'s incident page. Nor
is it a folder the run writes or reads (``flags/``, ``logs/``, ``ranks/``) or one inside it,
as ``ftmaster report --json-out`` refuses them (the same check).

Large traces (a week at 1 s for 8 GPUs is about 4.8 M rows) stay cheap: only the needed
columns are read, with explicit dtypes and in chunks (so the timestamp strings of only one
chunk are alive at a time), and plots are drawn from at most ``PLOT_BINS`` time bins per GPU,
each keeping its min and max so that spikes stay visible.

**Several nodes.** A run directory with ``node_<R>`` folders (``ftmaster launch --nnodes``) is
analysed as one run. GPU ids are per node (NVML indices), so each node's samples gain a
``node`` column and a GPU is ``(node, gpu)`` throughout: the summary has ``node`` and ``gpu``
columns, one row per pair; the plots have a line per pair, labelled ``node R GPU g`` (its own
colour; one line style per node, so that colours that repeat past 20 lines stay apart); the
event markers come from every node's ``events.jsonl``. Alerts are counted per node: its
``risk_alert`` events where it has events, else its samples over the threshold, and the
summary says which nodes used which. A node whose ``gpu_metrics.csv`` is missing or holds no
sample (a node that died before its first one) is left out, and a note says so in
``summary.md``, ``report.html`` and on stderr; a malformed CSV on any node is an error, and so
is a run where no node has a sample. ``RUN_DIR/node_<R>`` analyses that node alone; a CSV or a
run directory without node folders gives the single-node output, unchanged.
"""

from __future__ import annotations

import base64
import csv
import html
import os
from dataclasses import dataclass
from pathlib import Path

import click
import matplotlib

matplotlib.use("Agg")  # headless: no display on training nodes
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ftmaster import runfiles  # noqa: E402
from ftmaster.monitor.alerts import AlertConfig  # noqa: E402
from ftmaster.monitor.schema import CSV_COLUMNS, RISK_COLUMN  # noqa: E402
from ftmaster.recovery.cli import FiniteFloatRange, FolderPath  # noqa: E402
from ftmaster.report import is_int, node_folders, run_path_problem, write_for_people  # noqa: E402

REQUIRED = ("timestamp", "gpu_id")
INDEX_NAMES = {"node": "node", "gpu_id": "gpu"}  # series key column -> summary column
NODE_LINE_STYLES = ("-", "--", "-.", ":")
PLOT_BINS = 2000
CHUNK_ROWS = 1_000_000


@dataclass(frozen=True)
class Metric:
    """A numeric column that is plotted."""

    column: str
    """Its name in gpu_metrics.csv."""
    title: str
    """Plot title and y-axis label."""
    unit: str
    """Unit for the y-axis label."""


PLOTTED = (Metric("temperature", "Temperature", "°C"), Metric("power_draw", "Power draw", "W"),
           Metric("gpu_utilization", "GPU utilisation", "%"),
           Metric("memory_utilization", "Memory utilisation", "%"),
           Metric("memory_used", "Memory used", "MiB"), Metric("sm_clock", "SM clock", "MHz"),
           Metric(RISK_COLUMN, "Failure risk", "score 0-1"))
COUNTERS = ("errors", "ecc_sbe", "ecc_dbe")  # cumulative since the driver loaded
MISSING = "n/a"  # how a value the trace never knew reads in Markdown and HTML
NUMERIC = tuple(dict.fromkeys([m.column for m in PLOTTED] + ["memory_total", *COUNTERS, "xid"]))
EVENT_STYLES = {  # event -> (legend label, colour, line style, width); grey, so no GPU's colour
    "emergency_save": ("emergency save", "black", "--", 1.4),
    "failure": ("failure", "black", "-", 2.4),
    "plan": ("plan", "dimgray", ":", 1.8),
    "launch": ("launch / relaunch", "dimgray", "-.", 1.4),
}


def _fail(message: str) -> click.ClickException:
    return click.ClickException(message)


class NoSamples(click.ClickException):
    """A CSV that holds no sample: bad input on its own; among nodes, a node that recorded
    nothing."""


@dataclass(frozen=True)
class Trace:
    """What is analysed."""

    frame: pd.DataFrame
    """Samples: ``time``, ``gpu_id``, the metrics, and ``node`` for a multi-node run."""
    events: list[dict]
    """Events with a numeric time, each with its ``node`` for a multi-node run."""
    source: Path
    """The CSV, or the run directory of a multi-node run."""
    notes: tuple[str, ...] = ()
    """Nodes left out, and why."""


def series_keys(frame: pd.DataFrame) -> list[str]:
    """The columns that name one GPU's series: GPU ids repeat across nodes."""
    return ["node", "gpu_id"] if "node" in frame else ["gpu_id"]


# ---- reading ---------------------------------------------------------------------------------

LATEST_TIME = 4e9
"""Unix seconds of 2096: a later time (milliseconds, garbage) is no date a plot can draw."""


def _header(csv_path: Path) -> list[str]:
    try:
        handle, _ = runfiles.open_whole_lines(csv_path, newline="", encoding="utf-8-sig",
                                              errors="replace")  # a torn header is none
        with handle:
            header = next(csv.reader(handle), [])
    except FileNotFoundError as exc:
        raise NoSamples(f"cannot read {csv_path}: {exc.strerror}") from None
    except OSError as exc:
        raise _fail(f"cannot read {csv_path}: {exc.strerror}") from None
    except csv.Error as exc:  # e.g. an unclosed quote running past the field size limit
        raise _fail(f"{csv_path} is not a gpu_metrics.csv: {exc}") from None
    if not header:
        raise NoSamples(f"{csv_path} is empty: expected a gpu_metrics.csv header and samples")
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise _fail(f"{csv_path} lacks required column(s) {', '.join(missing)}; expected the "
                    f"gpu_metrics.csv columns: {', '.join(CSV_COLUMNS[:4])}, ...")
    return header


UNKNOWN_CELLS = ["", "nan", "NaN", "N/A", "[N/A]", "[Not Supported]", "[Unknown Error]",
                 "[GPU requires reset]", "[GPU is lost]", "[Insufficient Permissions]"]
"""Cells that are no reading: nvidia-smi's bracketed notes among them, which the replay
backend reads as unknown too (a trace recorded with nvidia-smi was refused as malformed)."""


def _parse_times(stamps: pd.Series) -> pd.Series:
    """ISO 8601 (naive taken as UTC) or unix seconds -> float unix seconds; NaN if neither."""
    parsed = pd.to_datetime(stamps, format="ISO8601", utc=True, errors="coerce")
    # the epoch in the stamps' own unit: in nanoseconds (Timestamp(0)'s), a year before 1678
    # or after 2261 (another tool's zero time, a clock gone wrong) would overflow the whole file
    epoch = pd.Timestamp(0, tz="UTC").as_unit(parsed.dt.unit)
    seconds = (parsed - epoch).dt.total_seconds()
    missing = seconds.isna()
    if missing.any():  # parse as numbers only what ISO 8601 did not take
        seconds[missing] = pd.to_numeric(stamps[missing], errors="coerce")
    return seconds.where((seconds >= 0) & (seconds <= LATEST_TIME))


def load_metrics(csv_path: Path) -> pd.DataFrame:
    """The CSV's needed columns: ``time`` (unix s, float64), ``gpu_id``, float32 metrics and
    float64 counters (float32 holds no whole number past 2**24 one by one: 16777217 errors
    read as 16777216, and a rise of one went unseen). A torn last row (a live monitor's, or a
    killed one's) is left out, and said on stderr; so are rows without a valid timestamp or
    gpu_id."""
    header = _header(csv_path)
    numeric = [c for c in NUMERIC if c in header]
    dtypes = {"timestamp": str, "gpu_id": "float64",
              **{c: "float64" if c in COUNTERS else "float32" for c in numeric}}
    chunks, unplaced = [], 0
    handle, torn = runfiles.open_whole_lines(csv_path, encoding="utf-8-sig", newline="")
    try:
        with handle, np.errstate(over="ignore"):  # a cell past float32 (1e39) reads as inf
            reader = pd.read_csv(handle, usecols=[*REQUIRED, *numeric], dtype=dtypes,
                                 chunksize=CHUNK_ROWS, keep_default_na=False,
                                 na_values=UNKNOWN_CELLS)
            for chunk in reader:
                chunk.insert(0, "time", _parse_times(chunk.pop("timestamp")))
                # an infinite cell is no reading: unknown, as an empty one, not an extreme
                chunk[numeric] = chunk[numeric].where(np.isfinite(chunk[numeric]))
                placed = chunk.dropna(subset=["time", "gpu_id"])
                unplaced += len(chunk) - len(placed)
                chunks.append(placed)
    except (ValueError, pd.errors.ParserError) as exc:
        reason = str(exc).splitlines()[0]
        raise _fail(f"{csv_path} is malformed ({reason}); expected gpu_metrics.csv rows") from None
    if torn:
        click.echo(f"warning: {runfiles.torn_line_note(csv_path)}", err=True)
    frame = pd.concat(chunks, ignore_index=True) if chunks else pd.DataFrame()
    if frame.empty:
        raise NoSamples(f"{csv_path} has no samples with a valid timestamp (ISO 8601, or unix "
                        "seconds up to 2096) and gpu_id")
    if unplaced:  # the one line above says it when no row is left
        click.echo(f"warning: {csv_path}: {unplaced} row(s) without a valid timestamp or gpu_id "
                   "left out", err=True)
    fractional = frame["gpu_id"][frame["gpu_id"] % 1 != 0]
    if not fractional.empty:  # truncating would merge it into another GPU's samples
        raise _fail(f"{csv_path} has a gpu_id that is not a whole number ({fractional.iloc[0]:g}); "
                    "expected GPU indices 0, 1, ...")
    outside = frame["gpu_id"][(frame["gpu_id"] < 0) | (frame["gpu_id"] > np.iinfo(np.int32).max)]
    if not outside.empty:
        raise _fail(f"{csv_path} has a gpu_id out of range ({outside.iloc[0]:g}); expected GPU "
                    "indices 0, 1, ...")
    frame["gpu_id"] = frame["gpu_id"].astype("int32")
    for counter in COUNTERS:  # summed as whole numbers: a fraction or 1e30 is no count
        column = frame.get(counter)
        odd = None if column is None else column[column.notna() & (
            (column % 1 != 0) | (column.abs() >= 2 ** 53))]
        if odd is not None and not odd.empty:
            raise _fail(f"{csv_path} has {counter} {odd.iloc[0]:g}, not a whole count of "
                        "errors")
    return frame


def load_events(csv_path: Path) -> list[dict]:
    """events.jsonl beside the CSV, if any, keeping events with a numeric time. A torn last
    line (a live run's, or a killed writer's) is left out and said on stderr, as ftmaster
    report does; a damaged line before it is skipped (its markers and alerts only)."""
    path = runfiles.events_path(csv_path.parent)
    try:
        handle, torn = runfiles.open_whole_lines(path, errors="replace")
        with handle:
            events = runfiles.parse_events(handle.read().splitlines())
    except FileNotFoundError:
        return []
    except OSError as error:
        raise _fail(f"cannot read {path}: {error.strerror}") from None
    if torn:
        click.echo(f"warning: {runfiles.torn_line_note(path)}", err=True)
    return [e for e in events if _is_time(e.get("time"))]


def _is_time(value: object) -> bool:
    """Unix seconds a plot can draw (no bool, nan, or millisecond stamp)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 <= value <= LATEST_TIME)


def load_trace(target: Path, with_events: bool = True) -> Trace:
    """A CSV, a run directory, or a multi-node run directory's nodes merged. ``with_events``
    False leaves the events out (ftmaster report reads them itself, and says of a torn line
    once)."""
    events_of = load_events if with_events else lambda csv_path: []
    if not target.is_dir():
        return Trace(load_metrics(target), events_of(target), target)
    folders = node_folders(target, runfiles.metrics_csv_path(target).name)
    if None in folders:
        csv_path = runfiles.metrics_csv_path(target)
        return Trace(load_metrics(csv_path), events_of(csv_path), csv_path)
    frames, events, notes, damaged = [], [], [], False
    for node, folder in folders.items():
        csv_path = runfiles.metrics_csv_path(folder)
        events += [{**e, "node": node} for e in events_of(csv_path)]
        # a node whose file is empty, missing or damaged (its disk filled, say) is left out:
        # the other nodes' samples still tell the run's story
        try:
            frames.append(load_metrics(csv_path).assign(node=np.int32(node)))
        except click.ClickException as exc:
            notes.append(f"node {node} left out: {exc.message}")
            damaged |= not isinstance(exc, NoSamples)
    if not frames:
        why = f" ({'; '.join(notes)})" if damaged else ""
        raise NoSamples(f"{target} has node folders ({', '.join(f.name for f in folders.values())}) "
                        f"but none holds a GPU sample: nothing to analyse{why}")
    return Trace(pd.concat(frames, ignore_index=True), sorted(events, key=lambda e: e["time"]),
                 target, tuple(notes))


# ---- summary ---------------------------------------------------------------------------------

def _alerts(frame: pd.DataFrame, events: list[dict], threshold: float) -> tuple[pd.Series, str]:
    """Per-GPU alert counts and where they come from; per node in a multi-node run."""
    if "node" not in frame:
        return _node_alerts(frame, events, threshold)
    counts, nodes_by_source = {}, {}
    for node, rows in frame.groupby("node"):
        node_events = [e for e in events if e.get("node") == node]
        counts[node], source = _node_alerts(rows, node_events, threshold)
        nodes_by_source.setdefault(source, []).append(str(node))
    text = "; ".join(f"{source} (node {', '.join(nodes)})" for source, nodes in nodes_by_source.items())
    return pd.concat(counts, names=["node", "gpu_id"]), text


def _node_alerts(frame: pd.DataFrame, events: list[dict], threshold: float) -> tuple[pd.Series, str]:
    """One node's per-GPU alert counts: risk_alert events when it has any events, else
    samples over the threshold (the monitor's alert rule is not replayed here)."""
    if events:
        gpus = [e["gpu"] for e in events if e["event"] == "risk_alert"
                and is_int(e.get("gpu"))]  # a foreign or damaged event names none
        return pd.Series(gpus, dtype="float64").value_counts(), "risk_alert events"
    if RISK_COLUMN not in frame:
        return pd.Series(dtype="float64"), "none (no failure_risk column, no events.jsonl)"
    over = frame[frame[RISK_COLUMN] >= threshold]
    return over.groupby("gpu_id").size(), f"samples with failure_risk >= {threshold:g}"


def summarize(frame: pd.DataFrame, events: list[dict], threshold: float) -> tuple[pd.DataFrame,
                                                                                  str]:
    """One row per GPU; columns for missing optional metrics are left out."""
    keys = series_keys(frame)
    by_gpu = frame.groupby(keys)
    table = pd.DataFrame({"samples": by_gpu.size(),
                          "first": pd.to_datetime(by_gpu["time"].min(), unit="s", utc=True),
                          "last": pd.to_datetime(by_gpu["time"].max(), unit="s", utc=True)})
    table["span_h"] = (table["last"] - table["first"]).dt.total_seconds() / 3600
    for column in ("first", "last"):
        table[column] = table[column].dt.strftime("%Y-%m-%dT%H:%M:%SZ")
    for column in ("temperature", "power_draw", "gpu_utilization"):
        if column in frame:
            table[f"{column}_mean"] = by_gpu[column].mean()
            table[f"{column}_max"] = by_gpu[column].max()
    if {"memory_total", "memory_used"} <= set(frame):
        headroom = frame["memory_total"] - frame["memory_used"]
        table["memory_headroom_min_mib"] = headroom.groupby([frame[k] for k in keys]).min()
    for column in COUNTERS:
        if column in frame:
            table[f"{column}_new"] = _increase(frame, column)
    if "xid" in frame:
        table["xids"] = _xids(frame).reindex(table.index, fill_value="")
    if RISK_COLUMN in frame:
        table[f"{RISK_COLUMN}_max"] = by_gpu[RISK_COLUMN].max()
    counts, source = _alerts(frame, events, threshold)
    table["alerts"] = counts.reindex(table.index, fill_value=0).astype(int).to_numpy()
    table.index.names = [INDEX_NAMES[k] for k in keys]
    # float32 samples widened as they print (35.650002): rounded in float64 they read 35.65
    floats = table.select_dtypes("float32").columns
    return table.astype({c: "float64" for c in floats}).round(2), source


def _increase(frame: pd.DataFrame, counter: str) -> pd.Series:
    """Per GPU, how much a cumulative counter grew during the trace: its value at the first
    sample also counts errors from before the trace. Readings count in the order they were
    written, not by their stamps: a clock stepped back would interleave readings from either
    side of the step and count a rise twice. A fall is a reset (a driver reload), after which
    the whole value is new errors, as Prometheus' ``increase()`` reads it. NaN for a GPU that
    never reported it."""
    keys = series_keys(frame)
    known = frame.loc[frame[counter].notna(), [*keys, counter]]
    change = known.groupby(keys)[counter].diff()
    rises = change.mask(change < 0, known[counter])
    return rises.groupby([known[k] for k in keys]).sum().astype("Int64")


def _xids(frame: pd.DataFrame) -> pd.Series:
    """Per GPU, the XID codes it reported, in the order first seen ("79 48"): the first thing
    an operator looks up after a failure, and no plot shows a code."""
    keys = series_keys(frame)
    seen = frame.loc[frame["xid"].notna(), [*keys, "time", "xid"]].sort_values("time", kind="stable")
    return seen.groupby(keys)["xid"].agg(
        lambda codes: " ".join(str(int(code)) for code in dict.fromkeys(codes)))


def to_markdown(table: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table (no extra dependency)."""
    values = table.reset_index()
    cells = values.astype(str).mask(values.isna(), MISSING)
    rows = [list(cells.columns), ["---"] * cells.shape[1], *cells.to_numpy().tolist()]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"


# ---- plots -----------------------------------------------------------------------------------

def downsample(frame: pd.DataFrame, columns: list[str], bins: int = PLOT_BINS) -> pd.DataFrame:
    """Per GPU (its series keys) and time bin: mean, min and max of each column (MultiIndex
    columns)."""
    start, span = frame["time"].min(), max(frame["time"].max() - frame["time"].min(), 1e-9)
    bin_index = np.minimum((frame["time"] - start) / span * bins, bins - 1).astype("int32")
    grouped = frame[["time", *columns]].groupby([*(frame[k] for k in series_keys(frame)), bin_index])
    return grouped.agg({"time": ["mean"], **{c: ["mean", "min", "max"] for c in columns}})


def _mark_events(ax, events: list[dict]) -> None:
    for kind, (label, colour, style, width) in EVENT_STYLES.items():
        times = [e["time"] for e in events if e["event"] == kind]
        if times:
            when = mdates.date2num(pd.to_datetime(times, unit="s", utc=True))
            ax.vlines(when, 0, 1, transform=ax.get_xaxis_transform(), colors=colour,
                      linestyles=style, linewidth=width, label=label, zorder=3)


def plot_metric(binned: pd.DataFrame, metric: Metric, events: list[dict], path: Path,
                threshold: float | None = None) -> None:
    """Every GPU's mean line with its min-max band, event markers, threshold line."""
    fig, ax = plt.subplots(figsize=(12, 5), dpi=100)
    series = binned.groupby(level=list(range(binned.index.nlevels - 1)))  # all but the bin
    colours = plt.get_cmap("tab10" if series.ngroups <= 10 else "tab20")
    nodes = list(binned.index.unique(level="node")) if "node" in binned.index.names else []
    for n, (key, rows) in enumerate(series):
        when = mdates.date2num(pd.to_datetime(rows[("time", "mean")], unit="s", utc=True))
        colour = colours(n % colours.N)
        style = NODE_LINE_STYLES[nodes.index(key[0]) % len(NODE_LINE_STYLES)] if nodes else "-"
        label = f"node {key[0]} GPU {key[1]}" if nodes else f"GPU {key[0]}"
        ax.plot(when, rows[(metric.column, "mean")], color=colour, linewidth=1.0,
                linestyle=style, label=label)
        ax.fill_between(when, rows[(metric.column, "min")], rows[(metric.column, "max")],
                        color=colour, alpha=0.18, linewidth=0)
    if threshold is not None:
        ax.axhline(threshold, color="crimson", linestyle="--", linewidth=1.4,
                   label=f"alert threshold {threshold:g}")
    _mark_events(ax, events)
    ax.set_title(f"{metric.title} per GPU (line: mean per time bin; band: min to max)")
    ax.set_xlabel("time (UTC)")
    ax.set_ylabel(f"{metric.title} ({metric.unit})")
    locator = mdates.AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    fig.tight_layout()
    with runfiles.open_output(path, "wb") as handle:
        fig.savefig(handle, format="png")
    plt.close(fig)


def plot_all(frame: pd.DataFrame, events: list[dict], out: Path,
             threshold: float) -> list[Path]:
    metrics = [m for m in PLOTTED if m.column in frame and frame[m.column].notna().any()]
    binned = downsample(frame, [m.column for m in metrics])
    paths = []
    for metric in metrics:
        path = out / f"{metric.column}.png"
        line = threshold if metric.column == RISK_COLUMN else None
        plot_metric(binned, metric, events, path, line)
        paths.append(path)
    return paths


# ---- report ----------------------------------------------------------------------------------

def write_html(path: Path, source: Path, table: pd.DataFrame, alert_source: str,
               plots: list[Path], notes: tuple[str, ...] = ()) -> None:
    notes_html = "".join(f"<p>note: {html.escape(note)}</p>\n" for note in notes)
    images = "\n".join(
        f'<h2>{html.escape(p.stem)}</h2>\n<img alt="{html.escape(p.stem)}" '
        f'src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        for p in plots)
    body = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>ftmaster analyze: {html.escape(source.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}img{{max-width:100%}}</style>
</head><body>
<h1>GPU metrics: {html.escape(str(source))}</h1>
<h2>Per-GPU summary</h2>
{table.to_html(border=0, na_rep=MISSING)}
<p>alerts: {html.escape(alert_source)}</p>
{notes_html}{images}
</body></html>
"""
    write_for_people(path, body)


def _make_output_folder(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _fail(f"cannot create --out {out}: {error.strerror}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise _fail(f"cannot write to --out {out}: permission denied")


def _is_run_dir(folder: Path) -> bool:
    """Whether ``folder`` holds a run (its events, its samples or node folders); False for one
    that cannot be looked into."""
    try:
        return folder.is_dir() and (runfiles.events_path(folder).exists()
                                    or runfiles.metrics_csv_path(folder).exists()
                                    or bool(runfiles.node_ranks(folder)))
    except OSError:
        return False


def _out_problem(out: Path) -> str | None:
    """Why ``--out`` must not be written into, as the error message: a run directory, where
    ``ftmaster report`` writes its incident page (``report.html``), or a folder a run writes
    or reads (``flags/``, ``logs/``, ``ranks/``, also a node's), or one inside it, as
    ``report --json-out`` refuses them. None for any other folder."""
    if _is_run_dir(out):
        return (f"--out {out} is a run directory, where ftmaster report writes its incident "
                f"page, report.html: give a folder of its own, e.g. {out / 'analysis'}")
    for run_dir in out.resolve().parents:
        if _is_run_dir(run_dir) and (problem := run_path_problem(out, run_dir)) is not None:
            return f"--out {out} {problem}: give a folder of its own, e.g. {run_dir / 'analysis'}"
    return None


def analyze(trace: Trace, out: Path, threshold: float) -> dict[str, Path]:
    """Run the whole analysis of a :func:`load_trace`; returns what was written."""
    _make_output_folder(out)
    table, alert_source = summarize(trace.frame, trace.events, threshold)
    with runfiles.open_output(out / "summary.csv", newline="") as handle:
        table.to_csv(handle)
    notes = "".join(f"note: {note}\n" for note in trace.notes)
    write_for_people(out / "summary.md", to_markdown(table) + f"\nalerts: {alert_source}\n{notes}")
    plots = plot_all(trace.frame, trace.events, out, threshold)
    write_html(out / "report.html", trace.source, table, alert_source, plots, trace.notes)
    return {"summary.csv": out / "summary.csv", "summary.md": out / "summary.md",
            "report.html": out / "report.html", **{p.name: p for p in plots}}


@click.command("analyze")
@click.argument("target", metavar="CSV_OR_RUN_DIR",
                type=click.Path(exists=True, path_type=Path))
@click.option("--out", required=True, type=FolderPath(),
              help="Folder for summary.csv/.md, the PNGs and report.html.")
@click.option("--risk-threshold", type=FiniteFloatRange(0, 1), default=AlertConfig().threshold,
              show_default=True, help="Risk line on the plot; alerts counted without events.")
def analyze_command(target: Path, out: Path, risk_threshold: float) -> None:
    """Summarise and plot a gpu_metrics.csv (or a run directory holding one, or the
    node_<R> folders of a multi-node run, merged)."""
    if (problem := _out_problem(out)) is not None:
        raise _fail(problem)
    trace = load_trace(target)
    for note in trace.notes:
        click.echo(f"warning: {note}", err=True)
    try:
        written = analyze(trace, out, risk_threshold)
    except OSError as exc:
        raise _fail(f"cannot write {runfiles.failed_path(exc, out)}: {exc.strerror}") from None
    click.echo(f"wrote {len(written)} files to {out}: " + ", ".join(sorted(written)))
