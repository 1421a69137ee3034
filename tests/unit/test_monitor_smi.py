"""The smi backend against fake ``nvidia-smi`` scripts put first on PATH."""

import contextlib
import os
import signal
import stat
import time

import pytest

from ftmaster.monitor.backends import BackendError
from ftmaster.monitor.backends.smi import SmiBackend

GOOD = """\
0, NVIDIA H100 80GB HBM3, 570.1, 61, 312.55, 97, 41, 60000, 81559, 0, 7, 0, 0x0000000000000004, 700.00, 1980, No
1, NVIDIA H100 80GB HBM3, 570.1, [N/A], [Unknown Error], 95, 40, 60000, 81559, [N/A], 0, 1, 0x0000000000000008, 700.00, 1755, Yes
"""
# The start-up look-up of each GPU's PCI bus id, as nvidia-smi answers it.
BUS_IDS = ("case \"$1\" in --query-gpu=index,pci.bus_id) "
           "printf '0, 00000000:3B:00.0\\n1, 00000000:86:00.0\\n'; exit 0;; esac\n")


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    def install(body: str) -> None:
        script = tmp_path / "nvidia-smi"
        script.write_text("#!/bin/sh\n" + body)
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return install


def test_parses_rows_and_treats_bracketed_cells_as_unknown(fake_smi):
    fake_smi(f"cat <<'EOF'\n{GOOD}EOF\n")
    first, second = SmiBackend().sample()
    assert (first.gpu_id, first.temperature, first.power_draw, first.ecc_sbe) == (0, 61, 312.55, 7)
    assert (first.throttle_reasons, first.retired_pages_pending, first.errors) == (0x4, 0, 0)
    assert second.temperature is None and second.power_draw is None and second.errors is None
    assert (second.ecc_dbe, second.throttle_reasons, second.retired_pages_pending) == (1, 0x8, 1)


def test_queries_with_an_argv_list(fake_smi, tmp_path):
    fake_smi(f'printf "%s\\n" "$@" > {tmp_path}/argv\n')
    with pytest.raises(BackendError, match="listed no GPU"):  # silence never means "all lost"
        SmiBackend().sample()
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[0].startswith("--query-gpu=index,name,driver_version,temperature.gpu")
    assert argv[1] == "--format=csv,noheader,nounits"


def test_garbage_output_is_an_error_not_a_healthy_gpu(fake_smi):
    fake_smi("echo 'Segmentation fault (core dumped) something, odd'\n")
    with pytest.raises(BackendError, match="unparseable nvidia-smi line"):
        SmiBackend().sample()


def test_a_failing_nvidia_smi_is_reported(fake_smi):
    fake_smi("echo 'NVIDIA-SMI has failed because it could not communicate with the driver' >&2\nexit 9\n")
    with pytest.raises(BackendError, match="exited with 9 and listed no GPU: NVIDIA-SMI has failed"):
        SmiBackend().sample()


@pytest.mark.parametrize("why", ["GPU is lost.", "Unknown Error"])
def test_a_gpu_without_a_handle_is_left_out_and_the_others_are_read(fake_smi, why):
    """Its line names no index: one that is not "lost" blinded the monitor to every GPU."""
    fake_smi(f"echo 'Unable to determine the device handle for GPU 0000:3B:00.0: {why}'\n"
             f"cat <<'EOF'\n{GOOD.splitlines()[1]}\nEOF\nexit 15\n")
    assert [s.gpu_id for s in SmiBackend().sample()] == [1]


def test_a_row_whose_cells_read_gpu_is_lost_is_that_gpu_lost(fake_smi):
    """nvidia-smi prints each field's NVML error in brackets: a row of "[GPU is lost]" cells
    went down the no-handle path, which looks for a bus id the row does not have, and the GPU
    was left out with no condition: never reported lost unless sampled before."""
    lost = "0, " + ", ".join(["[GPU is lost]"] * 15)
    fake_smi(f"cat <<'EOF'\n{lost}\n{GOOD.splitlines()[1]}\nEOF\n")
    backend = SmiBackend()
    assert [s.gpu_id for s in backend.sample()] == [1]
    assert backend.conditions == {0: ("gpu_is_lost",)}


def test_a_reading_that_is_no_number_is_unknown(fake_smi):
    """A nan kept in a GPU's baselines made its risk nan for good: it never alerted again."""
    fake_smi("echo '0, GPU, 570.1, nan, inf, 97, 41, 60000, 81559, 0, 7, 0, 0x4, 700.00, 1980, No'\n")
    (sample,) = SmiBackend().sample()
    assert (sample.temperature, sample.power_draw, sample.gpu_utilization) == (None, None, 97)


def test_old_driver_falls_back_to_the_paper_fields(fake_smi):
    fake_smi('case "$1" in *clocks_throttle*) echo \'Field "x" is not a valid field to query.\'; exit 2;; esac\n'
             "echo '0, GPU, 470.1, 55, 200, 90, 30, 1000, 40000, 0'\n")
    (sample,) = SmiBackend().sample()
    assert (sample.temperature, sample.memory_total) == (55, 40000)
    assert sample.ecc_sbe is None and sample.throttle_reasons is None


def test_a_hung_nvidia_smi_is_killed_and_reported(fake_smi):
    # The sleep is a grandchild holding stdout: killing only the shell would still hang.
    fake_smi("sleep 60\n")
    with pytest.raises(BackendError, match="did not answer within 0.3 s; killed it"):
        SmiBackend(timeout_s=0.3).sample()


def test_a_killed_nvidia_smi_that_will_not_die_is_not_waited_on(fake_smi, monkeypatch):
    # A process in uninterruptible sleep ignores SIGKILL; a kill that does nothing stands in.
    kill = os.killpg
    survivors = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: survivors.append(pgid))
    fake_smi("sleep 20\n")
    began = time.monotonic()
    backend = SmiBackend(timeout_s=0.3)
    try:
        with pytest.raises(BackendError, match="did not answer within 0.3 s; killed it"):
            backend.sample()
        assert time.monotonic() - began < 5
        # Every sample started one more that would not die either, each with its reaper
        with pytest.raises(BackendError, match="has not ended since it was killed"):
            backend.sample()
        assert len(survivors) == 1
    finally:
        for pgid in survivors:
            kill(pgid, signal.SIGKILL)


def test_the_gpu_count_from_nvidia_smi_is_never_waited_for_without_a_deadline(fake_smi,
                                                                              monkeypatch):
    """NVML timed out (a wedged driver), and subprocess.run waits for nvidia-smi -L without
    a deadline once it killed it: the launch hung where it should have said one line."""
    from ftmaster import gpus

    def wedged(timeout_s):
        raise BackendError("nvmlInit did not return")

    kills = (os.killpg, os.kill)
    survivors = []
    for name in ("killpg", "kill"):  # in uninterruptible sleep: no kill takes
        monkeypatch.setattr(os, name, lambda pid, sig: survivors.append(pid))
    monkeypatch.setattr(gpus, "probe_gpus", wedged)
    monkeypatch.setattr(gpus, "NVIDIA_SMI_TIMEOUT_S", 0.3)
    fake_smi("sleep 20\n")
    began = time.monotonic()
    try:
        assert gpus.probe() is None
        assert time.monotonic() - began < 5
    finally:
        for pid in survivors:
            for kill in kills:
                with contextlib.suppress(OSError):
                    kill(pid, signal.SIGKILL)


def test_missing_nvidia_smi_is_refused_at_once_and_one_that_goes_is_reported(fake_smi,
                                                                             monkeypatch, tmp_path):
    """Refused at once: every sample failed, and with --duration the monitor exited 0 (a
    launch would have trained unwatched)."""
    fake_smi("exit 0\n")
    backend = SmiBackend()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(BackendError, match="cannot run nvidia-smi"):
        backend.sample()
    with pytest.raises(BackendError, match="nvidia-smi is not installed"):
        SmiBackend()


def test_queries_only_the_jobs_gpus(fake_smi, tmp_path):
    fake_smi(f'printf "%s\\n" "$@" > {tmp_path}/argv\ncat <<\'EOF\'\n{GOOD.splitlines()[1]}\nEOF\n')
    backend = SmiBackend(gpu_ids=[3, 1])
    backend.sample()
    assert (tmp_path / "argv").read_text().splitlines()[2] == "--id=1,3"
    backend.select_gpus({1, 3, 5}, excluded={3})
    backend.sample()
    assert (tmp_path / "argv").read_text().splitlines()[2] == "--id=1,5"
    backend.select_gpus(None, excluded={1, 3})
    (tmp_path / "argv").unlink()
    assert backend.sample() == [] and not (tmp_path / "argv").exists()  # nothing to ask: no call


def test_make_backend_honours_gpu_ids_for_smi(fake_smi, tmp_path):
    from ftmaster.monitor.backends import make_backend
    fake_smi(f'printf "%s\\n" "$@" > {tmp_path}/argv\ncat <<\'EOF\'\n{GOOD.splitlines()[0]}\nEOF\n')
    make_backend("smi", gpu_ids=[0, 2]).sample()
    assert "--id=0,2" in (tmp_path / "argv").read_text().splitlines()


def test_a_rejected_extra_field_is_dropped_alone(fake_smi, tmp_path):
    # Review point 14: one field the driver does not know must not cost every other extra.
    fake_smi(f'{BUS_IDS}echo x >> {tmp_path}/runs\n'
             'case "$1" in *clocks_throttle_reasons*) '
             'echo \'Field "clocks_throttle_reasons.active" is not a valid field to query.\'; exit 2;; esac\n'
             "echo '0, GPU, 570.1, 55, 200, 90, 30, 1000, 40000, 0, 7, 1, 700.00, 1980, [N/A]'\n")
    backend = SmiBackend()
    (sample,) = backend.sample()
    assert (sample.ecc_sbe, sample.ecc_dbe, sample.power_limit, sample.sm_clock) == (7, 1, 700.0, 1980)
    assert sample.throttle_reasons is None
    assert sample.retired_pages_pending is None  # [N/A], as on H100: unknown
    assert "throttle_reasons" not in backend.reported_fields
    backend.sample()
    assert len((tmp_path / "runs").read_text().split()) == 3  # rejected once, then never asked


def test_a_warning_line_costs_no_gpu_its_sample(fake_smi):
    """nvidia-smi prints "WARNING: infoROM is corrupted at gpu ..." among the CSV rows (and
    exits 14): that line failed every sample as unparseable, so one GPU's infoROM blinded
    the monitor to every GPU."""
    fake_smi(f"echo 'WARNING: infoROM is corrupted at gpu 0000:3B:00.0'\ncat <<'EOF'\n{GOOD}EOF\nexit 14\n")
    assert [s.gpu_id for s in SmiBackend().sample()] == [0, 1]


def test_warnings_alone_are_no_gpu_listed(fake_smi):
    fake_smi("echo 'WARNING: infoROM is corrupted at gpu 0000:3B:00.0'\nexit 14\n")
    with pytest.raises(BackendError, match="listed no GPU"):
        SmiBackend().sample()


def test_a_gpu_that_needs_a_reset_is_evidence_not_just_unknown(fake_smi, tmp_path):
    """nvidia-smi's cells read "[GPU requires reset]" (NVML's RESET_REQUIRED): the GPU was
    only unknown, so a relaunch planned on it again, where the nvml backend retires it."""
    from ftmaster.monitor.daemon import Monitor
    reset = "[GPU requires reset]"
    fake_smi(f"cat <<'EOF'\n{GOOD.splitlines()[0]}\n"
             f"1, NVIDIA H100 80GB HBM3, 570.1, {reset}, {reset}, {reset}, {reset}, 0, 81559, "
             f"{reset}, {reset}, {reset}, {reset}, 700.00, {reset}, {reset}\nEOF\n")
    backend = SmiBackend()
    monitor = Monitor(backend, tmp_path / "run")
    monitor.step()
    assert monitor.unschedulable_gpus() == {1: "reset_required"}
    assert backend.conditions == {1: ("reset_required",)}
    assert monitor.lost_gpus() == frozenset()  # kept, with its fields unknown


# -- a GPU lost before its first sample ------------------------------------------------------
def lost_line(why="GPU is lost.  Reboot the system to recover this GPU", bus="0000:3B:00.0"):
    return f"echo 'Unable to determine the device handle for GPU {bus}: {why}'\n"


def test_a_gpu_lost_before_its_first_sample_is_reported_lost_with_its_index(fake_smi, tmp_path):
    """nvidia-smi names a GPU it has no handle for by its PCI bus id alone: one never sampled
    was never reported lost, and a relaunch planned on it."""
    from ftmaster.monitor.daemon import Monitor
    fake_smi(BUS_IDS + lost_line() + f"cat <<'EOF'\n{GOOD.splitlines()[1]}\nEOF\nexit 15\n")
    backend = SmiBackend()
    monitor = Monitor(backend, tmp_path / "run")
    monitor.step()
    monitor.step()
    assert backend.conditions == {0: ("gpu_is_lost",)}
    assert monitor.lost_reasons() == {0: "gpu_is_lost"}
    assert [(a.gpu, a.reasons) for a in monitor.alerts] == [(0, ("device_lost", "gpu_is_lost"))]
    assert monitor.unschedulable_gpus() == {0: "gpu_is_lost"}  # as the nvml backend says it


@pytest.mark.parametrize("bus", ["0000:3B:00.0", "00000000:3b:00.0"])
def test_a_gpu_without_a_handle_for_another_reason_is_lost_not_unschedulable(fake_smi, tmp_path, bus):
    from ftmaster.monitor.daemon import Monitor
    fake_smi(BUS_IDS + lost_line("Unknown Error", bus=bus).replace("GPU ", "GPU") +
             f"cat <<'EOF'\n{GOOD.splitlines()[1]}\nEOF\nexit 15\n")
    monitor = Monitor(SmiBackend(), tmp_path / "run")
    monitor.step()
    assert monitor.lost_reasons() == {0: "device_lost"}  # as if it had been sampled and went
    assert monitor.unschedulable_gpus() == {}


def look_up_answers(*rows):
    """The bus-id look-up answering ``rows`` (nvidia-smi's lines, in its order)."""
    return ("case \"$1\" in --query-gpu=index,pci.bus_id) cat <<'EOF'\n" + "".join(
        f"{row}\n" for row in rows) + "EOF\nexit 0;; esac\n")


NO_HANDLE_AT_LOOK_UP = "Unable to determine the device handle for GPU 0000:3B:00.0: Unknown Error"


@pytest.mark.parametrize("gpu_ids", [None, [0, 1]])
def test_a_gpu_without_a_handle_at_the_look_up_is_named_by_its_place_and_reported_lost(
        fake_smi, tmp_path, gpu_ids):
    """nvidia-smi lists the GPUs in index order: one it had no handle for already at the
    look-up got no index, so it never reached the monitor at all, a GPU silently unwatched."""
    from ftmaster.monitor.daemon import Monitor
    fake_smi(look_up_answers("WARNING: infoROM is corrupted at gpu 0000:86:00.0",
                             NO_HANDLE_AT_LOOK_UP, "1, 00000000:86:00.0")
             + lost_line("Unknown Error") + f"cat <<'EOF'\n{GOOD.splitlines()[1]}\nEOF\nexit 15\n")
    monitor = Monitor(SmiBackend(gpu_ids=gpu_ids), tmp_path / "run")
    monitor.step()
    assert monitor.lost_reasons() == {0: "device_lost"}


@pytest.mark.parametrize("rows", [
    (NO_HANDLE_AT_LOOK_UP, "0, 00000000:86:00.0"),   # the others' places do not match their index
    (NO_HANDLE_AT_LOOK_UP, "1, 00000000:86:00.0", "2, 00000000:AF:00.0"),  # more than --id asked
])
def test_a_gpu_without_a_handle_is_never_named_by_a_place_the_listing_contradicts(
        fake_smi, caplog, rows):
    fake_smi(look_up_answers(*rows) + lost_line("Unknown Error")
             + f"cat <<'EOF'\n{GOOD.splitlines()[1]}\nEOF\nexit 15\n")
    backend = SmiBackend(gpu_ids=[0, 1])
    backend.sample()
    assert backend.conditions == {}
    assert any("its GPU index cannot be learnt" in r.getMessage() for r in caplog.records)


def test_the_bus_ids_are_learnt_once_for_the_backends_gpus(fake_smi, tmp_path):
    fake_smi(f'echo "$*" >> {tmp_path}/runs\n' + BUS_IDS + lost_line(bus="0000:86:00.0") +
             f"cat <<'EOF'\n{GOOD.splitlines()[0]}\nEOF\n")
    backend = SmiBackend(gpu_ids=[0, 1])
    backend.select_gpus({0, 1}, excluded=set())
    backend.sample()
    assert backend.conditions == {1: ("gpu_is_lost",)}
    backend.select_gpus({0}, excluded={1})  # the monitor retired it: no longer named
    backend.sample()
    assert backend.conditions == {}
    runs = (tmp_path / "runs").read_text().splitlines()
    assert runs[0] == "--query-gpu=index,pci.bus_id --format=csv,noheader --id=0,1"
    assert sum("pci.bus_id" in run for run in runs) == 1 and len(runs) == 3


def test_a_failed_bus_id_look_up_costs_only_the_naming_and_is_tried_again(fake_smi, tmp_path,
                                                                        monkeypatch, caplog):
    from ftmaster.monitor.backends import smi
    fake_smi(f'if [ ! -e {tmp_path}/ready ]; then case "$1" in *pci.bus_id) '
             "echo 'NVIDIA-SMI has failed' >&2; exit 9;; esac; fi\n" + BUS_IDS + lost_line() +
             f"cat <<'EOF'\n{GOOD.splitlines()[1]}\nEOF\nexit 15\n")
    monkeypatch.setattr(smi, "BUS_IDS_RETRY_S", 0.0)
    backend = SmiBackend()
    assert [s.gpu_id for s in backend.sample()] == [1]  # sampled all the same
    assert backend.conditions == {}  # the lost GPU cannot be named yet, and is logged
    assert any("could not list the GPUs' PCI bus ids (exit 9: NVIDIA-SMI has failed)" in r.getMessage()
               for r in caplog.records)
    assert any("no GPU index is known for it" in r.getMessage() for r in caplog.records)
    (tmp_path / "ready").touch()
    backend.sample()
    assert backend.conditions == {0: ("gpu_is_lost",)}


def test_a_bus_id_look_up_that_hangs_fails_the_sample_as_the_query_would(fake_smi):
    fake_smi('case "$1" in *pci.bus_id) sleep 60;; esac\n' + f"cat <<'EOF'\n{GOOD}EOF\n")
    backend = SmiBackend(timeout_s=0.3)
    with pytest.raises(BackendError, match="did not answer within 0.3 s; killed it"):
        backend.sample()
    assert [s.gpu_id for s in backend.sample()] == [0, 1]  # not asked again at once
