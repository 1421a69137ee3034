"""``nvidia-smi --query-gpu`` backend, the paper's collector, with a hard timeout.

``nvidia-smi`` can hang on a wedged driver. It runs in its own process group and the whole
group is killed when the timeout passes (killing only the direct child could leave a
grandchild holding the output pipe open), and the sample fails with a BackendError that says
so. The monitor records that and retries with backoff. A killed process stuck in the driver
(uninterruptible sleep) may not die at once; it is given a moment, then left to a daemon
thread to reap, so it never blocks the monitor.

Cells such as ``[N/A]``, ``[Not Supported]`` or ``[Unknown Error]`` (``retired_pages.pending``
on H100, say) are unknown (None). A GPU whose cells say ``[GPU requires reset]`` is kept with
the condition ``reset_required``, as the ``nvml`` backend keeps it. A line that reports a
lost GPU leaves that GPU out, so the monitor reports it lost. That line names the GPU by its
PCI bus id alone ("Unable to determine the device handle for GPU 0000:3B:00.0: GPU is
lost"), so the first sample first learns each GPU's bus id (``nvidia-smi
--query-gpu=index,pci.bus_id``). The GPU is then named by its index with the condition
``gpu_is_lost`` (NVML's "GPU is lost", as the ``nvml`` backend names it) or, for another
reason ("Unknown Error"), ``device_lost``, so it is reported lost even if it was never
sampled (a spare not yet watched, say). A look-up that fails is logged and tried again every
minute until it answers, and the samples go on meanwhile; one that hangs fails its sample,
as a hung query would. A GPU that has no handle already at the look-up is named by its place
in that list (nvidia-smi lists the GPUs in index order, those of ``--id`` ascending) when
every other GPU there is where its own index says; when the list contradicts that, it is
logged, and reported lost only if it was sampled before. A ``WARNING:`` line among the
rows (a corrupted infoROM, say) is logged once and costs no GPU its sample. A driver that
rejects an extra field by name loses that field only (for good); one that rejects a field
without naming it gets the paper's Table I fields.

With ``gpu_ids`` (or :meth:`SmiBackend.select_gpus`) only those GPUs are queried
(``nvidia-smi -i``): other jobs' GPUs on the node never reach the monitor. One process reads
every GPU, so a wedged driver still blinds all of them until the timeout: per-GPU bounds need
the ``nvml`` backend.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time

from typing import Iterable, Sequence

from ftmaster.monitor.backends import BackendError
from ftmaster.monitor.backends.nvml import GPU_IS_LOST, RESET_REQUIRED
from ftmaster.monitor.sample import GpuSample

log = logging.getLogger("ftmaster.monitor")

# (nvidia-smi field, GpuSample field); the first block is the paper's Table I.
BASE_FIELDS = (
    ("index", "gpu_id"),
    ("name", "gpu_name"),
    ("driver_version", "driver_version"),
    ("temperature.gpu", "temperature"),
    ("power.draw", "power_draw"),
    ("utilization.gpu", "gpu_utilization"),
    ("utilization.memory", "memory_utilization"),
    ("memory.used", "memory_used"),
    ("memory.total", "memory_total"),
    ("ecc.errors.uncorrected.aggregate.total", "errors"),
)
EXTRA_FIELDS = (
    ("ecc.errors.corrected.volatile.total", "ecc_sbe"),
    ("ecc.errors.uncorrected.volatile.total", "ecc_dbe"),
    ("clocks_throttle_reasons.active", "throttle_reasons"),
    ("enforced.power.limit", "power_limit"),
    ("clocks.sm", "sm_clock"),
    ("retired_pages.pending", "retired_pages_pending"),
)
_TEXT = {"gpu_name", "driver_version"}
# nvidia-smi's line for a GPU it has no handle for ("Unable to determine the device handle
# for GPU 0000:3B:00.0: Unknown Error", or "... GPU is lost"): that GPU is left out, as lost.
NO_HANDLE = ("lost", "unable to determine the device handle")
_INTEGER = {"errors", "ecc_sbe", "ecc_dbe", "throttle_reasons"}
_YES_NO = {"yes": 1, "no": 0}
# nvidia-smi's cell for NVML_ERROR_RESET_REQUIRED: unknown, and evidence the GPU needs a reset.
RESET_CELL = "[gpu requires reset]"
# nvidia-smi's notes among the rows ("WARNING: infoROM is corrupted at gpu 0000:3B:00.0"):
# about one GPU, not a row of any; the rows around them stand.
WARNING = "warning:"
KILL_GRACE_S = 1.0  # how long a killed nvidia-smi gets to exit before it is left behind
# nvidia-smi's words for a field the driver does not know: Field "x" is not a valid field to query.
_REJECTED_FIELD = re.compile(r'field "([^"]+)" is not a valid field', re.IGNORECASE)
# A PCI bus id, domain:bus:device.function in hex: "00000000:3B:00.0" in --query-gpu's
# pci.bus_id, "0000:3B:00.0" in the no-handle line.
_BUS_ID = re.compile(r"([0-9a-f]{1,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", re.IGNORECASE)
BUS_IDS_RETRY_S = 60.0  # how often a failed look-up of the GPUs' bus ids is tried again
GPU_IS_LOST_WORDS = "gpu is lost"  # nvmlErrorString(NVML_ERROR_GPU_IS_LOST), as nvidia-smi prints it
# The condition of a GPU left out for no handle other than "GPU is lost" (gpu_is_lost): the
# monitor's own reason for a sampled GPU that went missing.
DEVICE_LOST = "device_lost"


class SmiBackend:
    """Runs ``nvidia-smi`` once per sample, for ``gpu_ids`` (None: every GPU)."""

    name = "smi"

    def __init__(self, executable: str = "nvidia-smi", timeout_s: float = 5.0,
                 gpu_ids: Sequence[int] | None = None) -> None:
        if shutil.which(executable) is None:  # else every sample fails, and nothing is watched
            raise BackendError(f"{executable} is not installed (not on PATH)")
        self.executable = executable
        self.timeout_s = timeout_s
        self._fields = BASE_FIELDS + EXTRA_FIELDS
        self._gpu_ids = None if gpu_ids is None else frozenset(gpu_ids)
        self._selected = self._gpu_ids
        self._excluded: frozenset[int] = frozenset()
        self._stuck: subprocess.Popen | None = None
        """An nvidia-smi that outlived its SIGKILL (a wedged driver): none is started while it
        lives, or every sample would leave one more behind."""
        self._warnings: set[str] = set()  # logged once each, not every sample
        self._bus_ids: dict[tuple[int, int, int, int], int] = {}  # PCI bus id -> GPU index
        self._bus_ids_due: float | None = 0.0  # when to look the bus ids up; None once learnt
        self.conditions: dict[int, tuple[str, ...]] = {}
        """Per GPU, the driver conditions of the latest sample (see the backends' contract)."""

    def close(self) -> None:
        pass

    @property
    def reported_fields(self) -> frozenset[str]:
        """The sample fields this backend can fill at all (no XIDs, no recovery action)."""
        return frozenset(name for _, name in self._fields)

    def select_gpus(self, watched: Iterable[int] | None, excluded: Iterable[int]) -> None:
        """Query only ``watched`` (None: this backend's GPUs) minus ``excluded``."""
        self._selected = self._gpu_ids if watched is None else frozenset(watched)
        self._excluded = frozenset(excluded)

    def sample(self) -> list[GpuSample]:
        now = time.time()
        self.conditions = {}
        selected, excluded = self._selected, self._excluded
        ids = None if selected is None else sorted(selected - excluded)
        if ids == []:
            return []
        self._learn_bus_ids()
        code, out, err = self._query_known_fields(ids)
        listed, samples = 0, []
        for line in out.splitlines():
            if not line.strip():
                continue
            if line.lower().lstrip().startswith(WARNING):
                self._log_warning(line.strip())
                continue
            listed += 1
            gpu = _lost_row_index(line)
            if gpu is not None:  # a row of the query, each reading NVML's "GPU is lost"
                if gpu not in excluded and (ids is None or gpu in ids):
                    self.conditions[gpu] = (GPU_IS_LOST,)
                continue
            if _without_handle(line):
                # "Unable to determine the device handle ... GPU is lost": left out, named by
                # its index where its bus id is known.
                gpu = self._gpu_without_handle(line)
                if gpu is not None and gpu not in excluded and (ids is None or gpu in ids):
                    lost = GPU_IS_LOST_WORDS in line.lower()
                    self.conditions[gpu] = (GPU_IS_LOST if lost else DEVICE_LOST,)
                continue
            sample = self._parse(line, now)
            if sample.gpu_id not in excluded:  # without --id, every GPU answers
                samples.append(sample)
                if RESET_CELL in line.lower():
                    self.conditions[sample.gpu_id] = (RESET_REQUIRED,)
        if not listed:
            # Silence is not "every GPU is gone": only an explicit lost line says that.
            detail = (err or out).strip().splitlines()
            raise BackendError(f"nvidia-smi exited with {code} and listed no GPU: "
                               f"{detail[0] if detail else 'no output'}")
        return samples

    def _log_warning(self, line: str) -> None:
        if line not in self._warnings:
            self._warnings.add(line)
            log.warning("nvidia-smi: %s", line)

    def _gpu_without_handle(self, line: str) -> int | None:
        """The index of the GPU a no-handle line names by its bus id; None (logged once)
        when that bus id was never learnt."""
        bus = _bus_id(line)
        gpu = None if bus is None else self._bus_ids.get(bus)
        if gpu is None:
            self._log_warning(f"{line.strip()} (no GPU index is known for it: it is reported lost "
                              f"only if it was sampled before)")
        return gpu

    def _learn_bus_ids(self) -> None:
        """Learn each of this backend's GPUs' PCI bus id, once, so that a GPU nvidia-smi has
        no handle for can be named by its index. A look-up that fails is tried again every
        ``BUS_IDS_RETRY_S``; one that hangs fails the sample (Unanswered), as the query would."""
        if self._bus_ids_due is None or time.monotonic() < self._bus_ids_due:
            return
        self._bus_ids_due = time.monotonic() + BUS_IDS_RETRY_S
        argv = [self.executable, "--query-gpu=index,pci.bus_id", "--format=csv,noheader"]
        if self._gpu_ids is not None:
            argv.append("--id=" + ",".join(map(str, sorted(self._gpu_ids))))
        try:
            code, out, err = self._run(argv)
        except Unanswered:
            raise
        except BackendError as exc:
            code, out, err = None, "", str(exc)
        learnt = self._bus_ids_listed(out)
        if learnt:
            self._bus_ids.update(learnt)
            self._bus_ids_due = None
            return
        detail = (err or out).strip().splitlines()
        why = f"exit {code}: {detail[0] if detail else 'no output'}" if code is not None else err
        self._log_warning(f"could not list the GPUs' PCI bus ids ({why}); a GPU lost before its "
                          f"first sample cannot be named, tried again every {BUS_IDS_RETRY_S:g} s")

    def _bus_ids_listed(self, out: str) -> dict[tuple[int, int, int, int], int]:
        """Bus id -> index of each GPU the look-up lists. One without a handle is listed by
        its bus id alone, and named by its place in the list: else it would never be watched,
        nor reported lost. Only when the list is in the order its indices say, so that no
        place names the wrong GPU."""
        rows = [line.strip() for line in out.splitlines()
                if line.strip() and not line.lower().lstrip().startswith(WARNING)]
        order = list(range(len(rows))) if self._gpu_ids is None else sorted(self._gpu_ids)
        in_order = len(rows) == len(order)
        listed, unnamed = {}, []
        for place, row in enumerate(rows):
            if _without_handle(row):
                unnamed.append((place, row))
                continue
            cells = [c.strip() for c in row.split(",")]
            bus = _bus_id(cells[1]) if len(cells) == 2 and cells[0].isdigit() else None
            if bus is not None:
                listed[bus] = int(cells[0])
            in_order = in_order and bus is not None and int(cells[0]) == order[place]
        for place, row in unnamed:
            bus = _bus_id(row)
            if in_order and bus is not None:
                listed[bus] = order[place]
            else:
                self._log_warning(f"{row} (at start: its GPU index cannot be learnt)")
        return listed

    def _query_known_fields(self, ids: list[int] | None) -> tuple[int, str, str]:
        """Query, dropping each extra field the driver rejects (one at a time, remembered)."""
        while True:
            code, out, err = self._query(self._fields, ids)
            if code == 0 or "not a valid field" not in (out + err).lower() or self._fields == BASE_FIELDS:
                return code, out, err
            self._fields = _without_rejected(self._fields, out + err)

    def _query(self, fields: tuple[tuple[str, str], ...], ids: list[int] | None) -> tuple[int, str, str]:
        argv = [self.executable, "--query-gpu=" + ",".join(f for f, _ in fields),
                "--format=csv,noheader,nounits"]
        if ids is not None:
            argv.append("--id=" + ",".join(map(str, ids)))
        return self._run(argv)

    def _run(self, argv: list[str]) -> tuple[int, str, str]:
        """Run nvidia-smi, bounded; none while one that outlived its SIGKILL still lives."""
        if self._stuck is not None and self._stuck.poll() is None:
            raise BackendError(f"{self.executable} (pid {self._stuck.pid}) has not ended since "
                               f"it was killed; no other is started meanwhile")
        try:
            return run_killable(argv, self.timeout_s)
        except Unanswered as unanswered:
            self._stuck = unanswered.process if unanswered.process.poll() is None else None
            raise

    def _parse(self, line: str, now: float) -> GpuSample:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(self._fields):
            raise BackendError(f"unparseable nvidia-smi line (expected {len(self._fields)} fields): "
                               f"{line[:120]!r}")
        values = dict(zip((name for _, name in self._fields), cells))
        if not values["gpu_id"].isdigit():
            raise BackendError(f"unparseable nvidia-smi line (bad GPU index): {line[:120]!r}")
        parsed = {name: _cell(name, text) for name, text in values.items()}
        return GpuSample(timestamp=now, **parsed)


class Unanswered(BackendError):
    """A command that did not answer in time, killed (``process``: it may live on)."""

    def __init__(self, message: str, process: subprocess.Popen) -> None:
        super().__init__(message)
        self.process = process


def run_killable(argv: list[str], timeout_s: float) -> tuple[int, str, str]:
    """Run ``argv`` in a session of its own; its exit status and output. BackendError when it
    cannot start, Unanswered when it did not answer within ``timeout_s``: then its session is
    SIGKILLed and it is never waited for without a deadline (``subprocess.run`` would: in
    uninterruptible sleep, in a wedged driver, it outlives SIGKILL)."""
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    except OSError as exc:
        raise BackendError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it may have exited just now
            os.killpg(proc.pid, signal.SIGKILL)
        _reap_killed(proc)
        raise Unanswered(f"{argv[0]} did not answer within {timeout_s:g} s; killed it "
                         f"(pid {proc.pid})", proc) from None
    return proc.returncode, out, err


def _lost_row_index(line: str) -> int | None:
    """The index of a query row whose cells read ``[GPU is lost]`` (nvidia-smi prints each
    field's NVML error in brackets); None for any other line. Such a row names its GPU by
    its index, where the no-handle line names it by bus id alone."""
    cells = [cell.strip() for cell in line.split(",")]
    if len(cells) > 1 and cells[0].isdigit() and f"[{GPU_IS_LOST_WORDS}]" in map(str.lower, cells[1:]):
        return int(cells[0])
    return None


def _without_handle(line: str) -> bool:
    return any(words in line.lower() for words in NO_HANDLE)


def _bus_id(text: str) -> tuple[int, int, int, int] | None:
    """The PCI bus id in ``text`` as numbers (domain, bus, device, function), or None:
    ``00000000:3B:00.0`` and ``0000:3b:00.0`` are the same GPU."""
    match = _BUS_ID.search(text)
    return None if match is None else tuple(int(part, 16) for part in match.groups())


def _without_rejected(fields: tuple[tuple[str, str], ...], message: str) -> tuple[tuple[str, str], ...]:
    """``fields`` without the extra field ``message`` names; Table I alone when it names none."""
    named = {match.lower() for match in _REJECTED_FIELD.findall(message)}
    kept = tuple(f for f in fields if f in BASE_FIELDS or f[0].lower() not in named)
    return kept if len(kept) < len(fields) else BASE_FIELDS


def _reap_killed(proc: subprocess.Popen) -> None:
    """Collect a killed process, or leave one that will not die to a daemon thread."""
    try:
        proc.communicate(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.stdout.close()
        proc.stderr.close()
        threading.Thread(target=proc.wait, name="nvidia-smi-reaper", daemon=True).start()


def _cell(name: str, text: str) -> object:
    """One nvidia-smi cell; bracketed notes like ``[N/A]`` and malformed numbers are unknown."""
    if not text or text.startswith("["):
        return None
    if name in _TEXT:
        return text
    if name == "gpu_id":
        return int(text)
    if name == "retired_pages_pending":
        return _YES_NO.get(text.lower())
    try:
        if name in _INTEGER:  # throttle reasons come as hex, 0x...
            return int(text, 16) if text.lower().startswith("0x") else int(text)
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None  # "nan" would poison the GPU's baselines
