"""A real, small tmpfs: a full disk or a full memory tier without a mock."""

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(folder: Path, size: str):
    """Mount a tmpfs of ``size`` (mount's syntax: ``7m``) on a new ``folder``; skips the test
    unless root may mount here (a container's root often lacks CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
