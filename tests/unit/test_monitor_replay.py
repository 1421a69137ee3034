"""Replaying recorded CSVs: round trip, partial and malformed input, lost GPUs."""

import pytest

from ftmaster import runfiles
from ftmaster.monitor.backends import TraceEnded, make_backend
from ftmaster.monitor.backends.replay import ReplayBackend, ReplayError
from ftmaster.monitor.daemon import Monitor, MonitorConfig
from ftmaster.monitor.sample import GpuSample, iso_time, to_row
from ftmaster.monitor.schema import CSV_COLUMNS

T0 = 1_750_000_000.0


def write_csv(path, header, rows):
    path.write_text("\n".join([",".join(header)] + [",".join(r) for r in rows]) + "\n")
    return path


def full_sample(gpu, t, **values):
    base = dict(gpu_name="H100", driver_version="570", temperature=65.0, power_draw=500.0,
                gpu_utilization=95.0, memory_utilization=40.0, memory_used=60000.0, memory_total=81559.0,
                errors=0, ecc_sbe=1, ecc_dbe=0, xid=None, throttle_reasons=4, power_limit=700.0,
                sm_clock=1980.0, pcie_replay=0, retired_pages_pending=0, recovery_action=0)
    return GpuSample(timestamp=t, gpu_id=gpu, **{**base, **values})


def drain(backend):
    batches = []
    while True:
        try:
            batches.append(backend.sample())
        except TraceEnded:
            return batches


def test_round_trip_of_every_column(tmp_path):
    samples = [full_sample(g, T0 + 10 * k, xid=79 if (g, k) == (1, 1) else None) for k in range(2) for g in (0, 1)]
    path = write_csv(tmp_path / "m.csv", CSV_COLUMNS, [to_row(s) for s in samples])
    batches = drain(ReplayBackend(path))
    assert [[s.gpu_id for s in b] for b in batches] == [[0, 1], [0, 1]]
    assert batches[1][1] == samples[3]


def test_missing_optional_columns_and_unknown_columns(tmp_path):
    header = ["timestamp", "gpu_id", "temperature", "fan_speed"]
    path = write_csv(tmp_path / "m.csv", header, [[iso_time(T0), "0", "70", "55"]])
    (sample,) = ReplayBackend(path).sample()
    assert sample.temperature == 70
    assert sample.ecc_dbe is None and sample.xid is None and sample.retired_pages_pending is None


def test_malformed_cells_are_unknown_and_bad_rows_are_skipped_and_counted(tmp_path):
    rows = [[iso_time(T0), "0", "hot", "abc"],
            ["yesterday", "1", "60", "0"],
            [iso_time(T0), "x", "60", "0"],
            [str(T0 + 10), "0", "71", "nan"],
            [iso_time(T0 + 20), "0"]]  # torn last line: no sample of its own
    backend = ReplayBackend(write_csv(tmp_path / "m.csv", ["timestamp", "gpu_id", "temperature", "ecc_dbe"], rows))
    batches = drain(backend)
    assert [b[0].temperature for b in batches] == [None, 71]
    assert all(b[0].ecc_dbe is None for b in batches)
    assert backend.skipped == 3
    assert "neither ISO 8601" in backend.problems[0] and ":3:" in backend.problems[0]
    assert backend.problems[-1].endswith(":6: 2 cells where the header has 4")


def test_rows_are_grouped_by_time_when_a_gpu_comes_back_after_a_gap(tmp_path):
    """GPU 0 gone for two samples: each of its rows after the gap joined GPU 1's sample
    before it, and the last sample, GPU 1 alone, replayed GPU 0 as lost."""
    times = [T0 + 10 * i for i in range(6)]
    rows = [[iso_time(t), str(gpu), "60", "0"] for t in times for gpu in (0, 1)
            if gpu == 1 or t not in times[2:4]]
    backend = ReplayBackend(write_csv(tmp_path / "m.csv", ["timestamp", "gpu_id", "temperature", "ecc_dbe"], rows))
    batches = drain(backend)
    assert [[s.gpu_id for s in b if s.temperature is not None] for b in batches] == \
        [[0, 1], [0, 1], [1], [1], [0, 1], [0, 1]]
    assert {s.timestamp for b in batches for s in b if s.temperature is not None} == set(times)


def test_gpus_read_one_after_the_other_stay_one_sample(tmp_path):
    """4 GPUs dated 0.2 s apart, a sample a second: cut after the sample's first row, the
    trace came back as 9 samples, a quarter of the rows unknown and GPU 0 lost at the end."""
    rows = [[iso_time(T0 + k + 0.2 * gpu), str(gpu), "60", "0"] for k in range(6)
            for gpu in range(4)]
    backend = ReplayBackend(write_csv(tmp_path / "m.csv", ["timestamp", "gpu_id", "temperature",
                                                          "ecc_dbe"], rows))
    batches = drain(backend)
    assert [[s.gpu_id for s in b] for b in batches] == [[0, 1, 2, 3]] * 6
    assert all(s.temperature == 60 for b in batches for s in b)


@pytest.mark.parametrize("text, words", [
    ("", "empty"),
    ("time,gpu\n1,0\n", "lacks the column"),
    ("timestamp,gpu_id\nbad,0\n", "no usable rows"),
])
def test_unusable_files_are_clear_errors(tmp_path, text, words):
    path = tmp_path / "m.csv"
    path.write_text(text)
    with pytest.raises(ReplayError, match=words):
        ReplayBackend(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ReplayError, match="cannot read"):
        ReplayBackend(tmp_path / "nope.csv")


def test_gpu_gone_for_good_is_lost_and_a_gap_is_unknown(tmp_path):
    rows = []
    for k in range(6):
        for gpu in (0, 1, 2):
            if (gpu == 2 and k >= 3) or (gpu == 1 and k == 2):
                continue  # GPU 2 vanishes at k=3; GPU 1 skips one sample only
            rows.append(to_row(full_sample(gpu, T0 + 10 * k)))
    monitor = Monitor(ReplayBackend(write_csv(tmp_path / "m.csv", CSV_COLUMNS, rows)), tmp_path / "run",
                      config=MonitorConfig(interval_s=0))
    monitor.run_to_end()
    monitor.close()
    assert monitor.lost_gpus() == {2}
    lost_alerts = [a for a in monitor.alerts if a.reasons == ("device_lost",)]
    assert [(a.gpu, a.time) for a in lost_alerts] == [(2, T0 + 30)]
    recorded = (tmp_path / "run" / "gpu_metrics.csv").read_text().splitlines()
    gap_row = [r for r in recorded if r.startswith(iso_time(T0 + 20)) and r.split(",")[1] == "1"]
    assert gap_row and gap_row[0].endswith(",0.5")  # unknown: scored as not healthy, not lost


@pytest.mark.parametrize("stamp", ["1750000000000", "-1e15", "0001-01-01T00:00:00+05:00"])
def test_a_time_the_csv_cannot_write_is_a_skipped_row(tmp_path, stamp):
    rows = [[str(T0), "0", "60"], [stamp, "0", "61"], [str(T0 + 10), "0", "62"]]
    backend = ReplayBackend(write_csv(tmp_path / "m.csv", ["timestamp", "gpu_id", "temperature"], rows))
    monitor = Monitor(backend, tmp_path / "run", config=MonitorConfig(interval_s=0))
    monitor.run_to_end()  # writes every sample back as ISO 8601
    monitor.close()
    assert backend.skipped == 1 and "out of range" in backend.problems[0]
    assert len((tmp_path / "run" / "gpu_metrics.csv").read_text().splitlines()) == 3


def two_gpu_rows(samples):
    return [to_row(full_sample(gpu, T0 + 10 * k)) for k in range(samples) for gpu in (0, 1)]


def test_a_torn_last_row_is_unknown_not_a_lost_gpu(tmp_path):
    rows = two_gpu_rows(3)[:-1]  # the last sample's GPU 1 row was cut off
    path = write_csv(tmp_path / "m.csv", CSV_COLUMNS, rows)
    path.write_text(path.read_text() + f"{T0 + 20},")
    backend = ReplayBackend(path)
    monitor = Monitor(backend, None, config=MonitorConfig(interval_s=0))
    monitor.run_to_end()
    assert backend.skipped == 1
    assert monitor.lost_gpus() == set() and monitor.alerts == []
    last = drain(ReplayBackend(path))[-1]
    assert [(s.gpu_id, s.temperature) for s in last] == [(0, 65.0), (1, None)]


def test_a_last_row_cut_within_its_last_cell_is_skipped_not_read_short(tmp_path):
    """A row torn inside its last cell has the header's length: its cut value ("8" of "85")
    passed for a whole one."""
    header = ["timestamp", "gpu_id", "temperature"]
    rows = [[iso_time(T0 + 10 * k), str(gpu), "85"] for k in range(2) for gpu in (0, 1)]
    path = write_csv(tmp_path / "m.csv", header, rows)
    path.write_text(path.read_text()[:-2])  # "85\n" -> "8"
    backend = ReplayBackend(path)
    last = drain(backend)[-1]
    assert [(s.gpu_id, s.temperature) for s in last] == [(0, 85.0), (1, None)]
    assert backend.skipped == 1
    assert backend.problems == [f"{path}:5: incomplete last line (no newline)"]


def test_a_gpu_missing_from_a_clean_files_last_sample_is_lost(tmp_path):
    backend = ReplayBackend(write_csv(tmp_path / "m.csv", CSV_COLUMNS, two_gpu_rows(3)[:-1]))
    monitor = Monitor(backend, None, config=MonitorConfig(interval_s=0))
    monitor.run_to_end()
    assert monitor.lost_gpus() == {1}


def test_rows_sorted_by_gpu_play_in_time_order(tmp_path):
    rows = sorted(two_gpu_rows(3), key=lambda row: row[1])  # all GPU 0 rows, then all GPU 1 rows
    batches = drain(ReplayBackend(write_csv(tmp_path / "m.csv", CSV_COLUMNS, rows)))
    assert [[(s.gpu_id, s.timestamp) for s in b] for b in batches] == \
        [[(0, T0 + 10 * k), (1, T0 + 10 * k)] for k in range(3)]


def test_a_byte_order_mark_is_ignored(tmp_path):
    path = tmp_path / "m.csv"
    path.write_bytes("\ufefftimestamp,gpu_id,temperature\n1750000000,0,60\n".encode())
    (sample,) = ReplayBackend(path).sample()
    assert sample.temperature == 60


def coverage_events(run_dir):
    return [e["unavailable"] for e in runfiles.read_events(run_dir) if e["event"] == "monitor_coverage"]


def test_a_trace_without_hard_signal_columns_says_so(tmp_path):
    soft = ["timestamp", "gpu_id", "temperature", "power_draw", "gpu_utilization", "errors"]
    rows = [[str(T0 + 10 * k), str(gpu), "65", "500", "95", ""] for k in range(3) for gpu in (0, 1)]
    monitor = Monitor(ReplayBackend(write_csv(tmp_path / "m.csv", soft, rows)), tmp_path / "run",
                      config=MonitorConfig(interval_s=0))
    monitor.run_to_end()
    monitor.close()
    assert coverage_events(tmp_path / "run") == \
        [["ecc_dbe/errors", "xid", "retired_pages_pending", "recovery_action"]]


def test_a_full_trace_has_every_hard_signal_even_without_xids(tmp_path):
    monitor = Monitor(ReplayBackend(write_csv(tmp_path / "m.csv", CSV_COLUMNS, two_gpu_rows(3))),
                      tmp_path / "run", config=MonitorConfig(interval_s=0))
    monitor.run_to_end()
    monitor.close()
    assert coverage_events(tmp_path / "run") == []


def test_a_fractional_gpu_id_is_a_skipped_row_not_another_gpus(tmp_path):
    """gpu_id 1.5 was truncated to GPU 1: its readings joined GPU 1's series (the analyzer
    refuses such a file for that reason) (found in review)."""
    rows = [[iso_time(T0), "0", "60"], [iso_time(T0), "1", "61"], [iso_time(T0), "1.5", "99"]]
    backend = ReplayBackend(write_csv(tmp_path / "m.csv", ["timestamp", "gpu_id", "temperature"], rows))
    assert [(s.gpu_id, s.temperature) for s in backend.sample()] == [(0, 60), (1, 61)]
    assert backend.skipped == 1 and "not a GPU index" in backend.problems[0]


def test_a_counter_beyond_64_bits_is_unknown_not_a_crash(tmp_path):
    """No NVML counter or bitmask exceeds 64 bits, yet a cell of 1e308 was taken as that
    count: two such rises overflowed the corrected-error rate and the replay ended in a
    traceback (found in review)."""
    rows = [[str(T0 + 10 * k), "0", "60", "1e308" if k % 2 else "0"] for k in range(6)]
    path = write_csv(tmp_path / "m.csv", ["timestamp", "gpu_id", "temperature", "ecc_sbe"], rows)
    assert [b[0].ecc_sbe for b in drain(ReplayBackend(path))] == [0, None] * 3
    Monitor(ReplayBackend(path), None, config=MonitorConfig(interval_s=0.0)).run_to_end()


def test_a_row_written_twice_is_skipped_not_a_sample_that_loses_the_other_gpus(tmp_path):
    """GPU 1's last row written twice began a sample of its own, GPU 1 alone: GPU 0, missing
    from that last sample of a clean file, was replayed as lost (found in review)."""
    rows = two_gpu_rows(3)
    rows.append(rows[-1])
    backend = ReplayBackend(write_csv(tmp_path / "m.csv", CSV_COLUMNS, rows))
    monitor = Monitor(backend, None, config=MonitorConfig(interval_s=0))
    monitor.run_to_end()
    assert monitor.lost_gpus() == set() and monitor.alerts == []
    assert backend.skipped == 1 and "line 7" in backend.problems[0]
    batches = drain(ReplayBackend(tmp_path / "m.csv"))
    assert [[s.gpu_id for s in b] for b in batches] == [[0, 1]] * 3


def test_blank_lines_before_the_header_are_skipped(tmp_path):
    """The first line was taken as the header even when blank: the file "lacked the columns
    timestamp, gpu_id", and one of blank lines only was not "empty" (found in review)."""
    path = tmp_path / "m.csv"
    path.write_text("\n\ntimestamp,gpu_id,temperature\n1750000000,0,60\n")
    (sample,) = ReplayBackend(path).sample()
    assert sample.temperature == 60
    path.write_text("\n\n")
    with pytest.raises(ReplayError, match="empty"):
        ReplayBackend(path)


def trace_of(tmp_path, gpus, samples=3, **values_of_gpu):
    rows = [to_row(full_sample(g, T0 + 10 * k, **values_of_gpu.get(f"gpu{g}", {})))
            for k in range(samples) for g in gpus]
    return write_csv(tmp_path / "trace.csv", CSV_COLUMNS, rows)


def test_a_job_replays_only_its_own_gpus(tmp_path):
    """GPU 9 is not the job's: its XID alerted at the first sample, before the supervisor
    said which GPUs to watch, asked the job for a save and marked GPU 9 unschedulable."""
    trace = trace_of(tmp_path, (0, 1, 9), gpu9={"xid": 79})
    backend = make_backend(f"replay:{trace}", gpu_ids=(0, 1, 2, 3))
    assert backend.recorded_gpus == {0, 1, 9}
    monitor = Monitor(backend, tmp_path / "run")
    assert monitor.step() == []
    assert monitor.unschedulable_gpus() == {}
    assert [[s.gpu_id for s in batch] for batch in drain(backend)] == [[0, 1], [0, 1]]
    assert not runfiles.trigger_flag_path(tmp_path / "run").exists()


def test_a_trace_with_none_of_the_jobs_gpus_is_refused(tmp_path):
    trace = trace_of(tmp_path, (4, 5))
    with pytest.raises(ReplayError, match=rf"^{trace} records GPUs 4, 5, none of the job's "
                                          r"GPUs 0, 1: replay a trace of the job's GPUs, or "
                                          r"run the job on the trace's with "
                                          r"CUDA_VISIBLE_DEVICES=4,5$"):
        make_backend(f"replay:{trace}", gpu_ids=(0, 1))
