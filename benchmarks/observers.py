"""What the operators' view costs: the Prometheus metrics' updates and a scrape, and the
TensorBoard scalars a training iteration writes.

    .venv/bin/python benchmarks/observers.py [--gpus 8] [--repeats 2000]

Medians over the repeats, in microseconds: one monitor sample of every GPU into the metrics
(risk and 12 DCGM-named gauges each), one event, one heartbeat, one scrape of the registry
(``generate_latest``, what ``/metrics`` serves), and one iteration's six TensorBoard scalars
through ``torch.utils.tensorboard`` (queued; the writer thread flushes them).
"""

import argparse
import statistics
import tempfile
import time

from prometheus_client import generate_latest
from torch.utils.tensorboard import SummaryWriter

from ftmaster.metrics import Metrics
from ftmaster.monitor.daemon import Alert
from ftmaster.monitor.sample import GpuSample


def median_us(action, repeats: int) -> float:
    times = []
    for index in range(repeats):
        started = time.perf_counter()
        action(index)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2000)
    options = parser.parse_args()
    metrics = Metrics()

    def samples(index):
        metrics.observe_samples([GpuSample(float(index), gpu, "H100", temperature=60.0 + gpu,
                                           power_draw=500.0, gpu_utilization=90.0,
                                           memory_utilization=40.0, memory_used=60000.0,
                                           sm_clock=1900.0, power_limit=700.0, ecc_sbe=0,
                                           ecc_dbe=0, pcie_replay=0, throttle_reasons=0,
                                           failure_risk=0.1) for gpu in range(options.gpus)],
                                [Alert(0, 0.97, ("xid",), float(index))] if index % 100 == 0 else [])

    def event(index):
        metrics.observe_event({"event": "periodic_save", "tier": "memory", "iteration": index,
                               "time": float(index)})

    def heartbeat(index):
        metrics.observe_heartbeat({"iteration": index, "consumed_samples": 8 * index,
                                   "time": float(index)})

    rows = [("monitor sample, all GPUs", median_us(samples, options.repeats)),
            ("event", median_us(event, options.repeats)),
            ("heartbeat", median_us(heartbeat, options.repeats)),
            ("scrape (generate_latest)", median_us(lambda _: generate_latest(metrics.registry),
                                                    max(50, options.repeats // 20)))]
    with tempfile.TemporaryDirectory() as folder:
        writer = SummaryWriter(log_dir=folder)

        def iteration(index):
            for name in ("learning-rate", "batch-size", "lm loss", "grad-norm", "loss-scale",
                         "iteration-time"):
                writer.add_scalar(name, 1.0 / (index + 1), index)

        rows.append(("TensorBoard, one iteration", median_us(iteration, options.repeats)))
        writer.close()
    print(f"{options.gpus} GPUs, medians over {options.repeats} repeats:")
    for name, us in rows:
        print(f"  {name:30s} {us:9.1f} us")
    print(f"scrape size: {len(generate_latest(metrics.registry)) / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
