"""Regenerate the README's plot: ``ftmaster analyze`` on a generated 8-GPU, 3-hour run.

    .venv/bin/python scripts/readme_images.py

The run is the one ``benchmarks/analyze_speed.py`` times (tracegen telemetry, a monitor
replay's risk and alerts, and a launcher's events around the failure of GPU 3).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.synth_run import failing_spec, write_run_dir  # noqa: E402

IMAGES = ROOT / "docs" / "images"
PLOTS = ("failure_risk.png",)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="readme_images.") as tmp:
        run_dir, out = Path(tmp) / "run", Path(tmp) / "analysis"
        write_run_dir(run_dir, failing_spec(gpus=8, hours=3.0))
        subprocess.run([sys.executable, "-m", "ftmaster.cli", "analyze", str(run_dir),
                        "--out", str(out)], check=True)
        IMAGES.mkdir(parents=True, exist_ok=True)
        for name in PLOTS:
            shutil.copyfile(out / name, IMAGES / name)
            print(f"wrote {IMAGES / name}")


if __name__ == "__main__":
    main()
