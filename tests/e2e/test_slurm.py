"""ftmaster under a real SLURM: a controller and two ``slurmd`` nodes (n1, n2), each node in
a network namespace of its own, on one machine.

Needs root and SLURM's and MUNGE's daemons (Debian: ``apt-get install slurm-wlm munge``);
skipped otherwise. The cluster follows ``../shared/research/multi-node-design.md`` section 4:
``nsenter --net=... unshare --uts --mount`` per node (``ip netns exec`` remounts /sys),
``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``, a hosts file bind-mounted
in each node. Each node also offers 2 GPUs (stand-in device files), so that jobs can ask for
``--gpus-per-node`` as on a GPU cluster. Everything the cluster needs lives under a
temporary folder; nothing in /etc is touched.

``SlurmCluster.srun`` runs a command on the nodes and gives each task's output;
``SlurmCluster.sbatch`` submits a batch job and waits for its end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers.trainer import REPO, wait_until

pytestmark = pytest.mark.slow

NODES = ("n1", "n2")
GPUS_PER_NODE = 2
TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo", "munged", "ip", "nsenter",
         "unshare", "mount")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
# A requeued job may start again once the job credential expires (slurm.conf(5) AuthInfo
# cred_expire, 120 s by default; 5 is its minimum); sched_interval=1 looks for it every second.
SLURM_CONF = """\
ClusterName=ftmtest
SlurmctldHost=ctl({ctl_addr})
SlurmctldPort={ctl_port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
GresTypes=gpu
ReturnToService=2
SlurmdTimeout=10
MailProg=/bin/true
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def why_no_slurm() -> str | None:
    """Why a SLURM cluster cannot be made here, or None."""
    if os.geteuid() != 0:
        return "a SLURM cluster in network namespaces needs root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (Debian: apt-get install slurm-wlm munge "
                "iproute2 util-linux)")
    return None


def slurm_free_env(**extra: str) -> dict[str, str]:
    """This process's environment without any SLURM job's variables (the tests may themselves
    run inside a SLURM job), plus ``extra``."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    return {**env, **extra}


def run(argv: list[str], timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)


def free_subnet() -> str:
    """``10.233.N``, a /24 that no route of this machine uses; the search starts at a place of
    this process's own, so that two test sessions at once are unlikely to pick the same."""
    routes = run(["ip", "-4", "route"]).stdout
    for step in range(254):
        third = (os.getpid() + step) % 254 + 1
        if f"10.233.{third}." not in routes:
            return f"10.233.{third}"
    raise RuntimeError("no free 10.233.N.0/24 subnet")


@dataclass
class SrunResult:
    returncode: int
    tasks: dict[int, str]
    """Each task's standard output (by task id), its lines joined."""
    stderr: str


@dataclass
class SlurmCluster:
    root: Path
    tag: str
    subnet: str = field(default_factory=free_subnet)
    daemons: list[subprocess.Popen] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"ftmsb{self.tag}"

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def namespace(self, node: str) -> str:
        return f"ftmslurm-{self.tag}-{node}"

    def addr(self, node: str) -> str:
        return f"{self.subnet}.{11 + NODES.index(node)}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a SLURM client command of this cluster."""
        return slurm_free_env(SLURM_CONF=str(self.conf), **extra)

    def start(self) -> None:
        for folder in ("munge", "state", "log", *(f"spool/{node}" for node in NODES)):
            (self.root / folder).mkdir(parents=True, mode=0o700)
        self._network()
        self._config()
        self._daemon("munged", ["munged", "--foreground", "--force",
                                f"--socket={self.root}/munge/socket",
                                f"--key-file={self.root}/munge/key",
                                f"--log-file={self.root}/log/munged.log",
                                f"--pid-file={self.root}/munge/pid",
                                f"--seed-file={self.root}/munge/seed"])
        wait_until(lambda: (self.root / "munge/socket").exists(), timeout=10, interval=0.05,
                   what="munged's socket")
        # slurmctld only serves as the controller when its host name is SlurmctldHost's.
        self._daemon("slurmctld", ["unshare", "--uts", "sh", "-c",
                                   f'hostname ctl && exec slurmctld -D -c -f "{self.conf}"'])
        for node in NODES:
            self._daemon(f"slurmd.{node}", [
                "nsenter", f"--net=/run/netns/{self.namespace(node)}", "unshare", "--uts",
                "--mount", "sh", "-c",
                f'hostname {node} && mount --bind "{self.root}/hosts" /etc/hosts && '
                f'exec slurmd -D -N {node} -f "{self.conf}"'])
        wait_until(self._nodes_idle, timeout=30, interval=0.2, what="both nodes idle in sinfo")

    def _network(self) -> None:
        """A bridge on this machine (the controller's side, ``.1``) and one namespace per node
        (``.11``, ``.12``) on it, so that srun here and the nodes reach each other."""
        def ip(*argv: str) -> None:
            subprocess.run(["ip", *argv], check=True, capture_output=True)

        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for node in NODES:
            name, veth = self.namespace(node), f"ftms{self.tag}{node}"
            ip("netns", "add", name)
            self.namespaces.append(name)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", name, "addr", "add", f"{self.addr(node)}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            ip("-n", name, "link", "set", "lo", "up")
            ip("-n", name, "route", "add", "default", "via", f"{self.subnet}.1")

    def _config(self) -> None:
        key = self.root / "munge/key"
        key.write_bytes(os.urandom(1024))
        key.chmod(stat.S_IRUSR | stat.S_IWUSR)
        hosts = [f"{self.subnet}.1 ctl", *(f"{self.addr(node)} {node}" for node in NODES)]
        (self.root / "hosts").write_text("127.0.0.1 localhost\n" + "\n".join(hosts) + "\n")
        nodes = "\n".join(f"NodeName={node} NodeAddr={self.addr(node)} CPUs=1 "
                          f"Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN" for node in NODES)
        self.conf.write_text(SLURM_CONF.format(ctl_addr=f"{self.subnet}.1", ctl_port=free_port(),
                                               root=self.root, node_lines=nodes))
        # slurmd drops a GPU without a device file; these stand-ins are /dev/null's twins.
        (self.root / "dev").mkdir()
        for index in range(GPUS_PER_NODE):
            os.mknod(self.root / f"dev/gpu{index}", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        (self.root / "gres.conf").write_text(
            f"Name=gpu File={self.root}/dev/gpu[0-{GPUS_PER_NODE - 1}]\n")

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        # SLURM_CONF, not only -f: slurmd looks for gres.conf next to it.
        self.daemons.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=self.env(),
                                             start_new_session=True))
        log.close()

    def _nodes_idle(self) -> bool:
        states = run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env()).stdout.split()
        return states[1::2] == ["idle"] * len(NODES)

    def srun(self, *args: str, env: dict[str, str] | None = None,
             timeout: float = 60) -> SrunResult:
        """``srun --label ARGS`` (environment ``env``, default :meth:`env`): each task's output,
        by task id."""
        done = run(["srun", "--label", *args], timeout=timeout, env=env or self.env())
        tasks: dict[int, list[str]] = {}
        for line in done.stdout.splitlines():
            task, _, text = line.partition(": ")
            if task.strip().isdigit():
                tasks.setdefault(int(task), []).append(text)
        outputs = {task: "\n".join(lines) for task, lines in tasks.items()}
        return SrunResult(done.returncode, outputs, done.stderr)

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None,
               timeout: float = 60) -> dict[str, str]:
        """Submit ``sbatch ARGS`` and wait for the job's end: its ``scontrol show job`` fields."""
        submitted = run(["sbatch", "--parsable", *args], cwd=cwd, env=env or self.env())
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip().split(";")[0]
        try:
            return wait_until(lambda: self._finished(job_id), timeout=timeout, interval=0.2,
                              what=f"the end of job {job_id}")
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.log_tail()}") from None

    def _finished(self, job_id: str) -> dict[str, str] | None:
        shown = run(["scontrol", "show", "job", "--oneliner", job_id], env=self.env()).stdout
        fields = dict(item.partition("=")[::2] for item in shown.split())
        return fields if fields.get("JobState") in FINAL_STATES else None

    def log_tail(self) -> str:
        log = self.root / "log" / "slurmctld.log"
        return "slurmctld.log ends:\n" + "\n".join(log.read_text().splitlines()[-15:]) \
            if log.exists() else "no slurmctld.log"

    def stop(self) -> None:
        """Kill every process of the nodes and the daemons, then remove the network; each step
        runs even when an earlier one fails."""
        for name in self.namespaces:
            pids = run(["ip", "netns", "pids", name]).stdout.split()
            for pid in pids:  # slurmd, slurmstepd and every task the tests ran there
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for daemon in reversed(self.daemons):
            with contextlib.suppress(ProcessLookupError):
                if daemon.poll() is None:
                    os.killpg(daemon.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(timeout=10)
        for name in self.namespaces:
            run(["ip", "netns", "del", name])
        run(["ip", "link", "del", self.bridge])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = why_no_slurm()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 65536:x}"
    probe = run(["ip", "netns", "add", f"ftmslurm-{tag}-probe"])
    if probe.returncode != 0:
        pytest.skip(f"cannot make network namespaces here: {probe.stderr.strip()}")
    run(["ip", "netns", "del", f"ftmslurm-{tag}-probe"])
    slurm = SlurmCluster(tmp_path_factory.mktemp("slurm"), tag)
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.stop()


PRINT_DEFAULTS = textwrap.dedent("""\
    import dataclasses, json, os, socket
    from ftmaster.slurm import slurm_defaults
    print(json.dumps({"host": socket.gethostname(), "job_id": os.environ["SLURM_JOB_ID"],
                      **dataclasses.asdict(slurm_defaults(os.environ))}))
""")


def test_each_node_gets_its_rank_the_job_id_and_the_first_node_as_endpoint(cluster):
    result = cluster.srun("-N2", "--ntasks-per-node=1", sys.executable, "-c", PRINT_DEFAULTS)
    assert result.returncode == 0, result.stderr
    nodes = sorted((json.loads(out) for out in result.tasks.values()), key=lambda d: d["node_rank"])
    assert [(d["node_rank"], d["host"]) for d in nodes] == [(0, "n1"), (1, "n2")]
    job_id = nodes[0]["job_id"]
    assert {d["rdzv_id"] for d in nodes} == {job_id}
    assert {d["rdzv_endpoint"] for d in nodes} == {"n1:29400"}  # node rank 0's host
    assert {d["nnodes"] for d in nodes} == {"1:2"}


def test_a_step_on_part_of_the_job_takes_its_own_first_node(cluster, tmp_path):
    """``srun -N1 -w n2`` in an n[1-2] job: node rank 0 runs on n2, so the endpoint is n2."""
    script = tmp_path / "defaults.py"
    script.write_text(PRINT_DEFAULTS)
    job = cluster.sbatch("-N2", f"--output={tmp_path}/job.out", "--wrap",
                         f"srun -N1 -n1 -w n2 {sys.executable} {script}", cwd=tmp_path)
    assert job["JobState"] == "COMPLETED", (tmp_path / "job.out").read_text()
    output = (tmp_path / "job.out").read_text()
    defaults = json.loads(next(line for line in output.splitlines() if line.startswith("{")))
    assert (defaults["host"], defaults["node_rank"]) == ("n2", 0)
    assert defaults["rdzv_endpoint"] == "n2:29400"
    assert defaults["nnodes"] is None  # one node: ftmaster as without SLURM


FAKE_FTMASTER = """\
#!{python}
# Stands in for ftmaster: records its arguments, then, in the job's first run, dies as node
# rank 0's ftmaster would with the store it serves (node 0) or exits 75 (the others).
import json, os, signal, sys, time
from pathlib import Path

records = Path({records!r})
run, node = os.environ.get("SLURM_RESTART_COUNT", "0"), os.environ["SLURM_NODEID"]
(records / f"run{{run}}-node{{node}}.json").write_text(json.dumps(sys.argv[1:]))
if run == "0" and node == "0":
    os.kill(os.getpid(), signal.SIGKILL)
if run == "0":
    while not (records / "run0-node0.json").exists():
        time.sleep(0.05)
    sys.exit(75)
"""


def test_the_sbatch_script_requeues_the_job_when_ftmaster_loses_the_store(cluster, tmp_path):
    """scripts/slurm/train.sbatch as shipped, with a stand-in ftmaster: node 0's ftmaster is
    SIGKILLed (srun's status is then 137) and node 1's exits 75, so node 1 requeues the job,
    which runs again (SLURM_RESTART_COUNT=1) and completes."""
    records, bin_dir = tmp_path / "records", tmp_path / "bin"
    records.mkdir()
    bin_dir.mkdir()
    fake = bin_dir / "ftmaster"
    fake.write_text(FAKE_FTMASTER.format(python=sys.executable, records=str(records)))
    fake.chmod(0o755)
    env = cluster.env(PATH=f"{bin_dir}:{os.environ['PATH']}", RUN_DIR=str(tmp_path / "run"),
                      SAVE_DIR=str(tmp_path / "ckpt"), MEGATRON_LM="/opt/Megatron-LM")
    # The script's 10-minute warning would come as a 5-minute job starts: a shorter one.
    job = cluster.sbatch("--nodes=2", f"--gpus-per-node={GPUS_PER_NODE}", "--cpus-per-task=1",
                         "--time=5", "--signal=TERM@60", str(REPO / "scripts/slurm/train.sbatch"),
                         cwd=tmp_path, env=env)
    log = (tmp_path / f"ftmaster-gpt-{job['JobId']}.out").read_text()
    assert (job["JobState"], job["Restarts"]) == ("COMPLETED", "1"), log
    assert sorted(path.name for path in records.iterdir()) == [
        "run0-node0.json", "run0-node1.json", "run1-node0.json", "run1-node1.json"]
    assert f"node 1: the rendezvous store is gone; requeueing job {job['JobId']}" in log
    assert "requeued 0 times" in log and "requeued 1 times" in log  # --open-mode=append
    argv = json.loads((records / "run1-node1.json").read_text())
    assert argv[:3] == ["launch", "--nnodes", "1:2"]
    assert "--nproc-per-node" not in argv  # each node trains on its usable GPUs
    assert argv[argv.index("--run-dir") + 1] == str(tmp_path / "run")
    script = argv[argv.index("--") + 1:]
    assert script[0] == "/opt/Megatron-LM/pretrain_gpt.py"
    assert script[script.index("--save") + 1] == str(tmp_path / "ckpt")
    assert not any(arg.startswith("--rdzv") or arg == "--node-rank" for arg in argv)
