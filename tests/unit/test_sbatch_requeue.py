"""scripts/slurm/train.sbatch's per-node task, run by bash as srun runs it, with a stand-in
ftmaster and scontrol: whether the job is requeued follows ftmaster's exit status."""

import os
import re
import subprocess

import pytest

from helpers.trainer import REPO

SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"


def node_task() -> str:
    found = re.search(r"^node_task='(.*?)'$", SBATCH.read_text(), re.S | re.M)
    assert found, "train.sbatch no longer defines node_task='...'"
    return found.group(1)


@pytest.mark.parametrize("status, restarts, requeued, says", [
    (75, "0", True, "the rendezvous store is gone; requeueing job 42"),
    (93, "0", False, "not requeueing"),  # ftmaster: a requeue would fail the same way
    (1, "0", True, "may cure (exit 1); requeueing job 42"),
    (1, "3", False, ""),  # MAX_REQUEUES (3) reached
    (0, "0", False, ""),
])
def test_the_node_task_requeues_only_what_a_requeue_may_cure(tmp_path, status, restarts,
                                                             requeued, says):
    calls = tmp_path / "scontrol.calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    scontrol.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_NODEID": "1",
           "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": restarts}
    result = subprocess.run(["bash", "-c", node_task(), "ftmaster-node", "sh", "-c", f"exit {status}"],
                            env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == status
    assert calls.exists() == requeued and (not requeued or calls.read_text() == "requeue 42\n")
    assert says in result.stderr
