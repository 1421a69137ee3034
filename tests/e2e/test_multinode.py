"""Multi-node ftmaster on one machine: 2 real ftmaster processes (node ranks 0 and 1, 2 CPU
ranks each) joined through torch elastic's c10d rendezvous on loopback, sim GPUs, gloo."""

import os
import shutil
import signal
import subprocess
import socket
import time
import urllib.request

import pytest

from ftmaster import runfiles
from ftmaster.recovery.checkpoints import checkpoint_problem, is_complete, iteration_dir, read_tracker
from helpers.launch import processes_mentioning, train_args
from helpers.multinode import FAST_RENDEZVOUS, Nodes
from helpers.netns import can_make_hosts, make_two_hosts, remove_hosts
from helpers.trainer import free_port, wait_until

pytestmark = pytest.mark.slow


def plans(nodes, node_rank):
    return [(p["round"], p["nodes"], p["ranks_per_node"], p["tensor_model_parallel_size"],
             p["data_parallel_size"]) for p in nodes.events(node_rank, "plan")]


def test_uneven_nodes_after_a_gpu_loss_and_an_emergency_save_on_every_node(tmp_path):
    """Node 1 loses GPU 1: both replan to TP1 x PP1 x DP3, node 0 running 2 ranks, node 1 one.
    Before that, an alert on node 1's GPU 1 asks for an emergency save, which every node takes."""
    save = tmp_path / "ckpt"
    args = train_args(save, 40, 2, 1, 100, "--emergency-save-gap-frac", "0.02")
    # No node is lost: both must be there for every round, the first included.
    nodes = Nodes(tmp_path, 2, args, "--seed", "2", nnodes="2:2")
    try:
        # The failure waits for the save the alert asks for: the monitor's alert (a few
        # samples) and training's speed no longer race (issue 19).
        nodes.start_all(2, (), ("--inject", "degrade:gpu=1,at=iter:3",
                                "--inject", "fail:gpu=1,at=iter:12,after=emergency_save"))
        assert nodes.wait(0) == 0, nodes.output(0)[-4000:]
        assert nodes.wait(1) == 0, nodes.output(1)[-4000:]
    finally:
        nodes.kill_all()
    for node_rank in (0, 1):
        assert plans(nodes, node_rank)[-1] == (2, [0, 1], [2, 1], 1, 3)
        assert nodes.events(node_rank, "complete")[0]["iteration"] == 40
    alerts = [e for e in nodes.events(1, "risk_alert") if "device_lost" not in e["reasons"]]
    assert alerts and alerts[0]["gpu"] == 1 and not nodes.events(0, "risk_alert")
    saved = [e["iteration"] for e in nodes.events(1, "emergency_save")]
    assert saved and saved == [e["iteration"] for e in nodes.events(0, "emergency_save")]
    (lost,) = [f for f in nodes.events(1, "failure") if f["cause"] != "peer"]
    assert lost["gpus"] == [1] and lost["iteration"] >= max(12, saved[0])
    assert nodes.events(1, "checkpoint_loaded")[0]["iteration"] == saved[0]
    assert [r["gpu"] for r in nodes.events(1, "plan")[-1]["gpus_retired"]] == [1]
    assert read_tracker(save) == 40


def test_a_node_that_joins_after_the_first_round_trains_in_the_next_one(tmp_path):
    """The README's procedure with node 1 started 5 s after node 0, once node 0's first round
    has closed without it: node 1's first attempt is built from the round's plan like node 0's
    relaunch (its layout and --load), not from the raw command, whose missing --load made its
    ranks refuse the checkpoints already in --save (exit 2) and left the job on half its GPUs."""
    save = tmp_path / "ckpt"
    nodes = Nodes(tmp_path, 2, train_args(save, 30, 2, 1, 5))
    try:
        started = time.monotonic()
        nodes.start(0)
        wait_until(lambda: nodes.events(0, "round"), timeout=120, interval=0.1,
                   what="node 0's first round")
        time.sleep(max(0.0, 5 - (time.monotonic() - started)))
        nodes.start(1)
        assert nodes.wait(0) == 0, nodes.output(0)[-4000:]
        assert nodes.wait(1) == 0, nodes.output(1)[-4000:]
    finally:
        nodes.kill_all()
    assert plans(nodes, 0)[0][:3] == (1, [0], [2])  # node 0 alone first
    for node_rank in (0, 1):
        last_round = plans(nodes, node_rank)[-1]
        assert last_round[0] >= 2 and last_round[1:3] == ([0, 1], [2, 2]), plans(nodes, node_rank)
        assert nodes.events(node_rank, "complete")[0]["iteration"] == 30
        codes = [code for f in nodes.events(node_rank, "failure") for code in f["exit_codes"].values()]
        assert 2 not in codes and not nodes.events(node_rank, "gave_up")
    first = nodes.events(1, "launch")[0]["command"]
    assert first[first.index("--load") + 1] == str(save)
    assert read_tracker(save) == 30
    # Node 1's first launch is cold, so the whole round is: warm ranks and torchrun's in one
    # world never met (they waited out the gloo timeout, and the round was lost).
    assert [s["warm"] for s in nodes.events(0, "startup")][:2] == [False, False]
    assert not [f for n in (0, 1) for f in nodes.events(n, "failure") if f["cause"] == "exit"]


def test_every_node_shows_the_error_of_its_own_ranks_when_it_gives_up(tmp_path):
    """The trainer states an error every rank shares (here: a tracker that names a folder that
    is not there, never a fresh start) once per node, so node 1's give-up shows it too, not an
    empty root cause (it used to come from global rank 0 alone, on node 0). It is no
    requeue's to cure."""
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("5\n")
    nodes = Nodes(tmp_path, 2, train_args(save, 10, 2, 1, 5), nnodes="2:2")
    try:
        nodes.start_all(2)
        codes = [nodes.wait(0), nodes.wait(1)]
    finally:
        nodes.kill_all()
    for node_rank in (0, 1):
        output = nodes.output(node_rank)
        assert "root cause" in output, output[-3000:]
        assert (f"error: no checkpoint in {save} can be loaded (the tracker names iteration 5, "
                "whose folder is missing)") in output.split("root cause")[1], output[-3000:]
    assert codes == [93, 93]
    assert "do not requeue" in nodes.output(0) + nodes.output(1)


def test_losing_the_node_that_hosts_the_store_makes_every_other_node_exit_75(tmp_path):
    save = tmp_path / "ckpt"
    nodes = Nodes(tmp_path, 2, train_args(save, 500, 2, 1, 50))
    try:
        nodes.start_all(2)
        wait_until(lambda: nodes.iteration(1) >= 3, timeout=300, interval=0.1,
                   what="training on node 1")
        killed_at = time.monotonic()
        os.kill(nodes.processes[0].pid, signal.SIGKILL)  # node 0 started first: the store host
        assert nodes.wait(1, timeout=120) == 75, nodes.output(1)[-4000:]
        exited_after = time.monotonic() - killed_at
        print(f"node 1 exited {exited_after:.1f} s after the store host was killed")
    finally:
        nodes.kill_all()
    assert exited_after < 60, exited_after  # the default read_timeout; it notices far sooner
    assert "requeue the job (exit status 75)" in nodes.output(1)
    assert nodes.events(1, "store_lost")
    wait_until(lambda: not processes_mentioning(f"{nodes.root}/"), timeout=30,
               what="no process of the job left")


def test_a_lost_node_is_replanned_around_then_rejoins_after_an_agreed_save(tmp_path):
    """The issue's node loss: TP2 x PP1 x DP2 over 2 nodes, node 1's ftmaster SIGKILLed; node
    0 replans alone on the GPUs left. Then node 1 comes back and rejoins after a save agreed
    for it. Each node serves its own metrics, labelled with its node rank."""
    save = tmp_path / "ckpt"
    nodes = Nodes(tmp_path, 2, train_args(save, 40, 2, 1, 5), "--metrics-port", "0")
    try:
        nodes.start_all(2)
        # node 1 trains only in a round with node 0 (the first, unless it started late)
        wait_until(lambda: nodes.iteration(1) >= 10, timeout=300, interval=0.1,
                   what="iteration 10 on both nodes")
        for node_rank in (0, 1):
            (served,) = nodes.events(node_rank, "metrics")
            text = urllib.request.urlopen(served["url"], timeout=5).read().decode()
            assert f'ftmaster_iteration{{Hostname="{socket.gethostname()}",node_rank="{node_rank}"}}' in text
        rounds = len(nodes.events(0, "plan"))
        os.kill(nodes.processes[1].pid, signal.SIGKILL)  # its trainers die with it
        assert nodes.processes[1].wait() == -signal.SIGKILL
        wait_until(lambda: len(nodes.events(0, "plan")) == rounds + 1, timeout=120, interval=0.2,
                   what="node 0 planning alone")
        back_at = time.time()
        nodes.start(1)  # the node is back
        assert nodes.wait(0) == 0, nodes.output(0)[-4000:]
        assert nodes.wait(1) == 0, nodes.output(1)[-4000:]
    finally:
        nodes.kill_all()
    assert [p[1:] for p in plans(nodes, 0)[-3:]] == [
        ([0, 1], [2, 2], 2, 2), ([0], [2], 2, 1), ([0, 1], [2, 2], 2, 2)]
    lost = [f for f in nodes.events(0, "failure") if f["time"] < back_at][-1]
    assert (lost["cause"], lost["gpus"]) == ("peer", [])
    # The newest complete checkpoint: none newer was set aside as a discarded timeline. (The
    # save events cannot tell: the save at 10 can complete on every rank, and node 1 report
    # iteration 10, while node 0's rank 0 has yet to write that save's event.)
    loaded = next(e for e in nodes.events(0, "checkpoint_loaded") if e["time"] > lost["time"])
    assert loaded["iteration"] >= 5 and loaded["iteration"] % 5 == 0
    assert [folder.name for folder in save.glob("iter_*.discarded-*") if is_complete(folder)] == []

    rejoined = [f for f in nodes.events(0, "failure") if f["time"] > back_at]
    assert [f["cause"] for f in rejoined] == ["peer"]
    # at-save: a save is asked for once node 1 is back, and the new round starts from a save
    # made after node 1 came back. The one asked for is an emergency save, unless a periodic
    # save was durable at that very iteration just before the ask (gap-filtered, not repeated).
    # A periodic save durable just after the ask ends the wait at once: the listener can then
    # record the request after the stop, but always before the next round's launch.
    relaunched = nodes.events(0, "launch")[-1]
    assert [e for e in nodes.events(0, "checkpoint_request")
            if e["source"] == "rendezvous" and back_at < e["time"] < relaunched["time"]]
    saved = sorted((e for e in nodes.events(0, "emergency_save") + nodes.events(0, "periodic_save")
                    if back_at < e["time"] < rejoined[0]["time"]), key=lambda e: e["time"])
    assert saved
    back = nodes.events(1, "failure")
    assert back[0]["cause"] == "supervisor_lost"  # the killed node's own record, continued
    assert nodes.events(1, "checkpoint_loaded")[-1]["iteration"] == saved[-1]["iteration"]
    for node_rank in (0, 1):
        assert nodes.events(node_rank, "complete")[0]["iteration"] == 40
    assert read_tracker(save) == 40 and checkpoint_problem(iteration_dir(save, 40)) is None
    assert not processes_mentioning(f"{nodes.root}/")


def test_a_hang_on_one_node_makes_every_node_replan(tmp_path):
    save = tmp_path / "ckpt"
    nodes = Nodes(tmp_path, 2, train_args(save, 30, 2, 1, 5), "--hang-timeout", "8", nnodes="2:2")
    try:
        # Node 0's ranks block within a step of node 1's, so with equal timeouts either node
        # may call the hang first; node 0's longer one makes it node 1's, the node at fault
        nodes.start_all(2, ("--hang-timeout", "20"), ("--inject", "hang:gpu=0,at=iter:6"))
        assert nodes.wait(0) == 0, nodes.output(0)[-4000:]
        assert nodes.wait(1) == 0, nodes.output(1)[-4000:]
    finally:
        nodes.kill_all()
    hang = nodes.events(1, "failure")[0]
    assert (hang["cause"], hang["gpus"]) == ("hang", [0])
    # node 0's ranks wait on the stopped one: they lose it (peer) or stop too (hang), never on
    # a GPU of their own
    first = nodes.events(0, "failure")[0]
    assert first["cause"] in ("peer", "hang") and first["gpus"] == []
    for node_rank in (0, 1):  # a hang retires nothing: the same layout again
        assert [p[:3] for p in plans(nodes, node_rank)] == [(1, [0, 1], [2, 2]), (2, [0, 1], [2, 2])]
        assert nodes.events(node_rank, "complete")[0]["iteration"] == 30


@pytest.fixture
def two_hosts():
    problem = can_make_hosts()
    if problem is not None:
        pytest.skip(problem)
    hosts = make_two_hosts(str(os.getpid() % 100000))
    yield hosts
    remove_hosts(*hosts)


def test_a_silent_partition_is_caught_by_the_hang_timeout_then_the_keep_alive(tmp_path, two_hosts):
    """Node 1's link goes down: no TCP reset, so node 0's collectives just block until its
    hang timeout; the rendezvous drops node 1 once its keep-alive expires; node 1, cut off
    from the store, exits 75 once its read times out."""
    save = tmp_path / "ckpt"
    nodes = Nodes(tmp_path, 2, train_args(save, 40, 2, 1, 5), "--hang-timeout", "8",
                  hosts=two_hosts, conf=FAST_RENDEZVOUS + ",read_timeout=10")
    try:
        nodes.start_all(2)
        wait_until(lambda: nodes.iteration(1) >= 8, timeout=300, interval=0.1,
                   what="training on both nodes")
        two_hosts[1].link("down")
        last_progress = progress_until_the_failure(nodes, 0)
        assert nodes.wait(0) == 0, nodes.output(0)[-4000:]
        assert nodes.wait(1, timeout=120) == 75, nodes.output(1)[-4000:]
    finally:
        nodes.kill_all()
    failure = nodes.events(0, "failure")[0]
    assert (failure["cause"], failure["gpus"]) == ("hang", [])
    # No reset: only the hang timeout can tell, counted from the last progress (which may
    # come just before the cut, or just after it when the iteration had no collective left).
    assert failure["time"] - last_progress >= 8
    assert plans(nodes, 0)[-1][1:3] == ([0], [2])
    assert nodes.events(0, "complete")[0]["iteration"] == 40


def progress_until_the_failure(nodes, node_rank: int) -> float:
    """The time of the node's last heartbeat before its first failure event."""
    last = 0.0

    def failed() -> bool:
        nonlocal last
        heartbeat = runfiles.read_heartbeat(nodes.node_dir(node_rank)) or {}
        failure = nodes.events(node_rank, "failure")
        if not failure:
            last = heartbeat.get("time", last)
        return bool(failure)
    wait_until(failed, timeout=120, interval=0.05, what=f"a failure on node {node_rank}")
    return last


@pytest.fixture
def etcd_server(tmp_path):
    """A real etcd with the v2 API on loopback (Debian's etcd-server), or a skip."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (Debian: etcd-server)")
    pytest.importorskip("etcd", reason="python-etcd is not installed")
    client, peer = free_port(), free_port()
    server = subprocess.Popen(
        ["etcd", "--enable-v2", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        import etcd

        wait_until(lambda: _answers(etcd.Client(host="127.0.0.1", port=client)), timeout=30,
                   interval=0.2, what="etcd to answer")
        yield f"127.0.0.1:{client}"
    finally:
        server.kill()
        server.wait()


def _answers(client) -> bool:
    try:
        client.read("/")
        return True
    except Exception:
        return False


def test_with_the_store_in_etcd_losing_any_node_leaves_the_job_running(tmp_path, etcd_server):
    """With c10d the store dies with its host (node 0); with etcd-v2 it lives elsewhere."""
    save = tmp_path / "ckpt"
    nodes = Nodes(tmp_path, 2, train_args(save, 30, 2, 1, 5), "--rdzv-backend", "etcd-v2",
                  endpoint=etcd_server)
    try:
        nodes.start_all(2)
        wait_until(lambda: nodes.iteration(1) >= 8, timeout=300, interval=0.1, what="training")
        os.kill(nodes.processes[0].pid, signal.SIGKILL)
        assert nodes.wait(1) == 0, nodes.output(1)[-4000:]
    finally:
        nodes.kill_all()
    assert plans(nodes, 1)[-1][1:3] == ([1], [2])
    assert nodes.events(1, "complete")[0]["iteration"] == 30
