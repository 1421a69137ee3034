"""scripts/slurm/train.sbatch's per-node task, run by bash as srun runs it, with a stand-in
ftmaster and scontrol: whether the job is requeued follows ftmaster's exit status. And the
job's warning before its time limit, which alone leaves ftmaster time for its exit save."""

import os
import re
import subprocess

import pytest

from ftmaster.launch import launch_command
from helpers.trainer import REPO

SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"


def node_task() -> str:
    found = re.search(r"^node_task='(.*?)'$", SBATCH.read_text(), re.S | re.M)
    assert found, "train.sbatch no longer defines node_task='...'"
    return found.group(1)


@pytest.mark.parametrize("status, restarts, requeued, says", [
    (75, "0", True, "the rendezvous store is gone; requeueing job 42"),
    # a store that never comes up (node 0 refused to start on its host) requeued for good
    (75, "20", False, "requeued 20 times (MAX_STORE_REQUEUES); not requeueing"),
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


@pytest.mark.parametrize("restarts_now, says", [
    ("1", "job 42 was requeued already"),  # another node's requeue came first
    ("0", "scontrol requeue failed; resubmit the job"),
])
def test_a_requeue_refused_because_another_node_requeued_first_is_not_a_failure(
        tmp_path, restarts_now, says):
    # Every node whose ftmaster lost the store requeues: after the first, SLURM answers
    # "Job is pending execution", and "resubmit the job" would have a second copy train.
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"""#!/bin/sh
if [ "$1" = requeue ]; then echo "Requeue of job 42 failed: Job is pending execution" >&2; exit 1; fi
echo "JobId=42 JobName=x Requeue=1 Restarts={restarts_now} BatchFlag=1 Reboot=0 ExitCode=0:0"
""")
    scontrol.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_NODEID": "2",
           "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "0"}
    result = subprocess.run(["bash", "-c", node_task(), "ftmaster-node", "sh", "-c", "exit 75"],
                            env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 75
    assert says in result.stderr
    assert result.stderr.count("resubmit") == (restarts_now == "0")


def sbatch_option(name: str) -> str | None:
    """The value of the script's last ``#SBATCH --NAME=VALUE`` line (``##SBATCH`` is off)."""
    values = re.findall(rf"^#SBATCH --{name}=(\S+)", SBATCH.read_text(), re.M)
    return values[-1] if values else None


def test_the_steps_alone_are_warned_in_time_for_ftmasters_exit_save():
    # At the time limit SLURM SIGTERMs the batch step too, and its srun answers a SIGTERM by
    # SIGKILLing every task at once (srun_job.c): KillWait gives ftmaster nothing. Only a
    # warning to the steps (no "B:", which would go to the batch shell, srun) comes in time.
    warning = sbatch_option("signal")
    assert warning is not None, "train.sbatch sends no warning before its time limit"
    signal_name, _, lead = warning.partition("@")
    assert signal_name == "TERM"
    stop_timeout = next(p.default for p in launch_command.params if p.name == "stop_timeout")
    assert int(lead) > stop_timeout  # the script leaves --stop-timeout at its default
