"""The monitor's backends on a real GPU: NVML under load, and one NVML sample against one
``nvidia-smi`` query.

    .venv/bin/python benchmarks/nvml_vs_smi.py [--seconds 60] [--repeats 30] [--no-load]

1. Starts a bf16 matmul loop on every visible GPU (unless ``--no-load``), then runs
   ``ftmaster monitor --backend nvml`` for ``--seconds`` at a 1 s interval and reads back its
   CSV: samples per GPU, how often each column was unknown, peak temperature, power and
   utilisation, maximum risk and alerts (expected: none on a healthy GPU).
2. Times ``NvmlBackend.sample()`` (every field, all GPUs) and ``SmiBackend.sample()`` (one
   ``nvidia-smi --query-gpu`` call) ``--repeats`` times each, in this process, and prints the
   medians and their ratio.

Needs a driver; it says so in one line and exits 2 where there is none.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOAD = """
import sys, torch
tensors = [(torch.randn(8192, 8192, device=f"cuda:{i}", dtype=torch.bfloat16),) * 2
           for i in range(torch.cuda.device_count())]
while True:
    for a, b in tensors:
        a @ b
    torch.cuda.synchronize()
"""


def start_load() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOAD])


def monitor_under_load(seconds: float, load: bool) -> None:
    import pandas as pd

    from ftmaster import runfiles

    loader = start_load() if load else None
    try:
        time.sleep(5 if load else 0)  # let clocks and power reach the loaded state
        with tempfile.TemporaryDirectory(prefix="nvml_check.") as tmp:
            subprocess.run([sys.executable, "-m", "ftmaster.cli", "monitor", "--backend", "nvml",
                            "--run-dir", tmp, "--interval", "1", "--duration", str(seconds)],
                           check=True)
            frame = pd.read_csv(runfiles.metrics_csv_path(Path(tmp)))
            alerts = [e for e in runfiles.read_events(Path(tmp)) if e["event"] == "risk_alert"]
    finally:
        if loader is not None:
            loader.kill()
            loader.wait()
    print(f"== nvml for {seconds:g} s{' under matmul load' if load else ''}: "
          f"{len(frame)} rows, GPUs {sorted(frame['gpu_id'].unique())} ==")
    unknown = [f"{column} {share:.0%}" for column, share in frame.isna().mean().items() if share > 0]
    print(f"unknown share per column: {', '.join(unknown) or 'none'}")
    for column in ("temperature", "power_draw", "gpu_utilization", "sm_clock", "failure_risk"):
        print(f"{column:16s} max {frame[column].max()}")
    print(f"risk alerts: {len(alerts)} {[a['reasons'] for a in alerts]}")


def median_ms(sample, repeats: int) -> float:
    sample()  # first call pays one-off set-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sample()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def time_backends(repeats: int) -> None:
    from ftmaster.monitor.backends.nvml import NvmlBackend
    from ftmaster.monitor.backends.smi import SmiBackend

    nvml, smi = NvmlBackend(), SmiBackend()
    try:
        nvml_ms, smi_ms = median_ms(nvml.sample, repeats), median_ms(smi.sample, repeats)
    finally:
        nvml.close()
        smi.close()
    print(f"== one sample of all GPUs, median of {repeats} ==")
    print(f"nvml {nvml_ms:.2f} ms, nvidia-smi {smi_ms:.2f} ms, ratio smi/nvml {smi_ms / nvml_ms:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--no-load", action="store_true", help="sample an idle GPU")
    args = parser.parse_args()
    if shutil.which("nvidia-smi") is None:
        print("nvml_vs_smi: no nvidia-smi on PATH: this needs a machine with an NVIDIA driver",
              file=sys.stderr)
        raise SystemExit(2)
    monitor_under_load(args.seconds, not args.no_load)
    time_backends(args.repeats)


if __name__ == "__main__":
    main()
