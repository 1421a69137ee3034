"""``nvidia-smi --query-gpu`` backend, the paper's collector, with a hard timeout.

``nvidia-smi`` can hang on a wedged driver. It runs in its own process group and the whole
group is killed when the timeout passes (killing only the direct child could leave a
grandchild holding the output pipe open), and the sample fails with a BackendError that says
so. The monitor records that and retries with backoff. A killed process stuck in the driver
(uninterruptible sleep) may not die at once; it is given a moment, then left to a daemon
thread to reap, so it never blocks the monitor.

Cells such as ``[N/A]``, ``[Not Supported]`` or ``[Unknown Error]`` are unknown (None). A
line that reports a lost GPU leaves that GPU out, so the monitor reports it lost. Drivers that
reject one of the extra fields get the paper's Table I fields only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

from ftmaster.monitor.backends import BackendError
from ftmaster.monitor.sample import GpuSample

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
_INTEGER = {"errors", "ecc_sbe", "ecc_dbe", "throttle_reasons"}
_YES_NO = {"yes": 1, "no": 0}
KILL_GRACE_S = 1.0  # how long a killed nvidia-smi gets to exit before it is left behind


class SmiBackend:
    """Runs ``nvidia-smi`` once per sample."""

    name = "smi"

    def __init__(self, executable: str = "nvidia-smi", timeout_s: float = 5.0) -> None:
        self.executable = executable
        self.timeout_s = timeout_s
        self._fields = BASE_FIELDS + EXTRA_FIELDS

    def close(self) -> None:
        pass

    @property
    def reported_fields(self) -> frozenset[str]:
        """The sample fields this backend can fill at all (no XIDs, no recovery action)."""
        return frozenset(name for _, name in self._fields)

    def sample(self) -> list[GpuSample]:
        now = time.time()
        code, out, err = self._query(self._fields)
        if code != 0 and "not a valid field" in (out + err).lower() and self._fields != BASE_FIELDS:
            self._fields = BASE_FIELDS  # an older driver: fall back to the paper's fields for good
            code, out, err = self._query(self._fields)
        samples, lost = [], 0
        for line in out.splitlines():
            if not line.strip():
                continue
            if "lost" in line.lower():
                lost += 1  # "Unable to determine the device handle ... GPU is lost": left out
                continue
            samples.append(self._parse(line, now))
        if not samples and not lost:
            # Silence is not "every GPU is gone": only an explicit lost line says that.
            detail = (err or out).strip().splitlines()
            raise BackendError(f"nvidia-smi exited with {code} and listed no GPU: "
                               f"{detail[0] if detail else 'no output'}")
        return samples

    def _query(self, fields: tuple[tuple[str, str], ...]) -> tuple[int, str, str]:
        argv = [self.executable, "--query-gpu=" + ",".join(f for f, _ in fields),
                "--format=csv,noheader,nounits"]
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        except OSError as exc:
            raise BackendError(f"cannot run {self.executable}: {exc.strerror or exc}") from None
        try:
            out, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it may have exited just now
                os.killpg(proc.pid, signal.SIGKILL)
            _reap_killed(proc)
            raise BackendError(f"{self.executable} did not answer within {self.timeout_s:g} s; "
                               f"killed it (pid {proc.pid})") from None
        return proc.returncode, out, err

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
        return float(text)
    except ValueError:
        return None
