"""A rank's imports with and without megatron-core's compile decorators deferred, and a short
run's end.

    .venv/bin/python benchmarks/rank_start_and_end.py [--repeats 5]

- **Imports**: a fresh interpreter importing the trainer (``megatron.training.training`` and
  ``checkpointing``, what ``pretrain_gpt.py`` imports), as it does
  (:mod:`megatron.training.deferred_compile`) and plainly, alternated; medians of the CPU
  time (user + system) and wall time.
- **End**: a 4-rank TP2 x PP2 run of 6 iterations on the small test model, under torchrun:
  the seconds from its last checkpoint's line to torchrun's exit (the ranks' exit, then
  torchrun's own), and the whole run; medians.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.trainer import REPO, SMALL_GPT, layout_args, torchrun_argv, trainer_env  # noqa: E402

TRAINER = "import megatron.training.training, megatron.training.checkpointing"
IMPORTS = {
    "deferred": ("from megatron.training.deferred_compile import compile_at_first_call\n"
                 f"with compile_at_first_call():\n    {TRAINER}"),
    "plain": TRAINER,
}
RUN = SMALL_GPT + ["--micro-batch-size", "2", "--global-batch-size", "12", "--train-iters", "6",
                   "--lr", "1e-2", "--seed", "7", "--save-interval", "2"] + layout_args(2, 2)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def import_seconds(code: str) -> tuple[float, float]:
    """CPU and wall seconds of a fresh interpreter running ``code``."""
    cpu, start = children_cpu(), time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    return children_cpu() - cpu, time.perf_counter() - start


def run_end(root: Path) -> tuple[float, float]:
    """Seconds from the last checkpoint line to torchrun's exit, and the whole run."""
    start = time.perf_counter()
    process = subprocess.Popen(torchrun_argv(4, RUN + ["--save", str(root)]), cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=trainer_env())
    last_save = None
    for line in process.stdout:
        if line.startswith("saved periodic checkpoint at iteration 6"):
            last_save = time.perf_counter()
    if process.wait() != 0 or last_save is None:
        raise SystemExit(f"the run failed (status {process.returncode})")
    end = time.perf_counter()
    return end - last_save, end - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    measured = {name: [] for name in IMPORTS}
    for _ in range(repeats):
        for name, code in IMPORTS.items():
            measured[name].append(import_seconds(code))
    for name, runs in measured.items():
        print(f"imports, {name:8}: {statistics.median(c for c, _ in runs):5.2f} s CPU, "
              f"{statistics.median(w for _, w in runs):5.2f} s wall (medians of {repeats})")
    with tempfile.TemporaryDirectory() as folder:
        ends = [run_end(Path(folder) / f"run{i}") for i in range(repeats)]
    print(f"4-rank run of 6 iterations: {statistics.median(e for e, _ in ends):5.2f} s from its "
          f"last checkpoint to torchrun's exit, {statistics.median(w for _, w in ends):5.2f} s "
          f"in all (medians of {repeats})")


if __name__ == "__main__":
    main()
