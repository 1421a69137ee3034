"""What one NVML sample costs the monitor, per GPU, on any machine: the real pynvml bindings
over the fake ``libnvidia-ml`` of the tests (``tests/fakes/fake_libnvidia_ml.c``).

    .venv/bin/python benchmarks/nvml_sample_cost.py [--samples 200] [--gpus 1 8 64]

For each GPU count, times ``NvmlBackend.sample()`` (every field of every GPU, each GPU on its
own bounded worker, then the XID events) and prints the median, the per-GPU figure and the
90th percentile. A last row times 8 GPUs of which one is wedged in the driver, once the
monitor has given up on it: the others must cost what they cost before.

The fake driver answers at once, so this is the monitor's own cost (ctypes, threads, Python);
a real driver adds its own time per call (tens of microseconds, see DESIGN.md). Needs a C
compiler; says so in one line and exits 2 without one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fakes.nvml_lib import FakeNvml, build  # noqa: E402

from ftmaster.monitor.backends.bounded import ReadBounds  # noqa: E402
from ftmaster.monitor.backends.nvml import NvmlBackend  # noqa: E402

WARMUP_SAMPLES = 5


def sample_times_ms(backend: NvmlBackend, samples: int) -> list[float]:
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        backend.sample()
        times.append((time.perf_counter() - start) * 1000)
    return times


def measure(built: Path, workdir: Path, gpus: int, samples: int, wedged: int | None = None) -> list[float]:
    fake = FakeNvml(built, workdir, gpus)
    bounds = ReadBounds(read_timeout_s=0.05, wedged_after=3)
    backend = NvmlBackend(nvml=fake.pynvml, bounds=bounds)
    try:
        sample_times_ms(backend, WARMUP_SAMPLES)  # opens handles, registers events
        if wedged is not None:
            fake.wedge(wedged)
            while "wedged" not in backend.conditions.get(wedged, ()):
                backend.sample()
        return sample_times_ms(backend, samples)
    finally:
        fake.release_all()
        backend.close()


def report(label: str, gpus: int, times: list[float]) -> None:
    median = statistics.median(times)
    p90 = statistics.quantiles(times, n=10)[-1]
    print(f"{label:>22s} | {median:9.3f} | {1000 * median / gpus:12.1f} | {p90:8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200, help="timed samples per row")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 8, 64])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nvml_sample_cost.") as tmp:
        built = build(Path(tmp))
        if built is None:
            print("nvml_sample_cost: no C compiler (gcc or cc) to build the fake libnvidia-ml",
                  file=sys.stderr)
            raise SystemExit(2)
        print(f"== NvmlBackend.sample() over the fake libnvidia-ml, median of {args.samples} samples ==")
        print(f"{'GPUs':>22s} | {'sample ms':>9s} | {'per GPU us':>12s} | {'p90 ms':>8s}")
        for gpus in args.gpus:
            report(str(gpus), gpus, measure(built, Path(tmp), gpus, args.samples))
        report("8, GPU 3 wedged", 7, measure(built, Path(tmp), 8, args.samples, wedged=3))


if __name__ == "__main__":
    main()
