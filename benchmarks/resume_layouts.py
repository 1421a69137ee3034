"""Save/load seconds and bytes, and step time per layout, in the resume-across-layouts scenario.

    .venv/bin/python benchmarks/resume_layouts.py

Trains the test GPT at TP2xPP2 on 4 CPU ranks to iteration 6 (saving at 3 and 6), then
resumes it under each layout of ``RESUME_LAYOUTS`` and prints one row per layout.
"""

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.trainer import (  # noqa: E402
    LOAD_LINE,
    RESUME_LAYOUTS,
    RESUME_SCHEDULE,
    SAVE_LINE,
    SMALL_GPT,
    iterations,
    layout_args,
    run_trainer,
)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="ftmaster-resume-") as tmp:
        save = Path(tmp) / "save"
        first = run_trainer(4, SMALL_GPT + RESUME_SCHEDULE + layout_args(2, 2) + [
            "--save", str(save), "--save-interval", "3", "--exit-interval", "6"])
        assert first.returncode == 0, first.stdout[-2000:]
        for iteration, seconds, size in SAVE_LINE.findall(first.stdout):
            print(f"save at iteration {iteration} (TP2xPP2, 4 ranks): {float(seconds):.3f} s, "
                  f"{int(size)} bytes")
        print(f"{'layout':12s} {'load s':>8s} {'bytes':>9s} {'median step ms':>15s}")
        for name, (nproc, tp, pp) in RESUME_LAYOUTS.items():
            run = run_trainer(nproc, SMALL_GPT + RESUME_SCHEDULE + layout_args(tp, pp)
                              + ["--load", str(save)])
            assert run.returncode == 0, run.stdout[-2000:]
            _, seconds, size = LOAD_LINE.search(run.stdout).groups()
            step = statistics.median(e["elapsed_ms"] for e in iterations(run.stdout).values())
            print(f"{name:12s} {float(seconds):8.3f} {int(size):9d} {step:15.1f}")


if __name__ == "__main__":
    main()
