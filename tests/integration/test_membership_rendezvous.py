"""Two NodeMembership seats on torch elastic's real c10d rendezvous (loopback, one process)."""

import os
import threading

from ftmaster.membership import JobEnded, NodeMembership, RendezvousConfig
from helpers.ipv6 import needs_ipv6
from helpers.trainer import free_port

CONF = {"last_call_timeout": "1", "keep_alive_interval": "1", "join_timeout": "60",
        "read_timeout": "10"}


def seat(port: int, node_rank: int, nodes: int = 2) -> NodeMembership:
    conf = {**CONF, "is_host": str(int(node_rank == 0))}
    config = RendezvousConfig(f"127.0.0.1:{port}", "job", nodes, nodes, node_rank,
                              local_addr="127.0.0.1", conf=conf)
    return NodeMembership(config, poll_s=0.0)


def test_a_node_waiting_in_the_next_join_learns_the_outcome_of_a_peer_that_gave_up():
    """Node 1 gives up (it is not the round's first node) while node 0 already waits for the
    next round: node 0's join ends with node 1's outcome, not with the join timeout."""
    port = free_port()
    seats = [seat(port, 0), seat(port, 1)]
    first = [None, None]
    joins = [threading.Thread(target=lambda r=r: first.__setitem__(r, seats[r].join([0])))
             for r in (0, 1)]
    for thread in joins:
        thread.start()
    for thread in joins:
        thread.join(timeout=60)
    assert [r.number for r in first] == [1, 1] and first[1].me == 1

    second = {}

    def join_again():
        try:
            second["round"] = seats[0].join([0])
        except JobEnded as ended:
            second["ended"] = ended
            seats[0].acknowledge()  # as the supervisor does: the ending node waits for it
        except Exception as error:  # noqa: BLE001 - the assertion shows which
            second["error"] = error

    seats[1].announce_failure("usage")
    assert seats[0].peer_failure() == "usage"
    waiting = threading.Thread(target=join_again)
    waiting.start()
    seats[1].end_job("gave up on node 1: the arguments need fixing")
    waiting.join(timeout=90)
    assert "ended" in second, second
    assert second["ended"].outcome == "gave up on node 1: the arguments need fixing"
    for node in seats:
        node.stop_keep_alive()


# Node 0, hosting the store, in a process of its own: the store goes when it exits.
STORE_HOST = """
import sys
from ftmaster.membership import JobEnded, NodeMembership, RendezvousConfig
conf = {**CONF, "is_host": "1"}
node = NodeMembership(RendezvousConfig(f"127.0.0.1:{sys.argv[1]}", "job", 3, 3, 0,
                                       local_addr="127.0.0.1", conf=conf), poll_s=0.0)
print("serving", flush=True)
node.join([0])
try:
    node.join([0])
except JobEnded:
    print("ended", flush=True)
    node.acknowledge()  # as the supervisor's _job_ended does
node.stop_keep_alive()
"""


def test_the_store_host_that_learns_of_the_end_stays_until_every_node_has_read_it():
    """Three nodes; node 1 gives up saying a requeue would not help, while node 0, which
    hosts the store, waits in the next join. Node 0 acknowledged the end and exited at once,
    taking the store: node 2, a few seconds slower to look, found the store gone and exited
    75 (requeue) for a job that had said not to."""
    import subprocess
    import sys

    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", f"CONF = {CONF!r}\n{STORE_HOST}", str(port)],
                            stdout=subprocess.PIPE, text=True)
    seats = {}
    try:
        assert host.stdout.readline() == "serving\n"
        seats.update({rank: seat(port, rank, nodes=3) for rank in (1, 2)})
        joins = [threading.Thread(target=seats[rank].join, args=([0],)) for rank in (1, 2)]
        for thread in joins:
            thread.start()
        for thread in joins:
            thread.join(timeout=60)
        gave_up = "gave up on node 1: the arguments need fixing; do not requeue"
        ending = threading.Thread(target=seats[1].end_job, args=(gave_up,))
        ending.start()
        assert host.stdout.readline() == "ended\n"
        try:
            host.wait(timeout=3)  # node 2 looks 3 s later, or once the host has left
        except subprocess.TimeoutExpired:
            pass
        assert seats[2].outcome() == gave_up
        seats[2].acknowledge()
        assert host.wait(timeout=30) == 0
        ending.join(timeout=30)
        assert not ending.is_alive()
    finally:
        host.kill()
        host.wait()
        for node in seats.values():
            node.stop_keep_alive()


def node_1_without_a_store(port: int, read_timeout: int, run_dir) -> list[str]:
    """``ftmaster launch`` of node 1 of 2, whose store (node 0's) nobody serves."""
    import sys

    from helpers.trainer import PRETRAIN, SMALL_GPT

    return [sys.executable, "-m", "ftmaster.cli", "launch", "--nnodes", "2", "--node-rank", "1",
            "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-conf", f"read_timeout={read_timeout},join_timeout=60,is_host=0",
            "--run-dir", str(run_dir), "--nproc-per-node", "1", "--monitor-backend", "sim",
            "--", PRETRAIN, *SMALL_GPT, "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "5", "--lr", "1e-3"]


def test_a_store_nobody_serves_is_one_line_and_a_requeue(tmp_path):
    """torch logged each try at the store with 40 lines of C++ stack on ftmaster's stderr."""
    import subprocess

    from ftmaster import exit_codes

    port = free_port()
    result = subprocess.run(node_1_without_a_store(port, 2, tmp_path / "run"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == exit_codes.REQUEUE
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"cannot reach the rendezvous store at 127.0.0.1:{port}" in result.stderr


def test_sigterm_while_connecting_to_the_store_stops_at_once(tmp_path):
    """scancel while node 1 waited for a store nobody serves: the signal waited for torch's
    connect (read_timeout, here 60 s, plus its retries), then ftmaster said "requeue the job"
    and exited 75, or was SIGKILLed at the end of the grace period with nothing recorded."""
    import json
    import signal
    import subprocess
    import time

    from ftmaster.lock import RunDirLock
    from helpers.trainer import wait_until

    node_dir = tmp_path / "run" / "node_1"
    node = subprocess.Popen(node_1_without_a_store(free_port(), 60, tmp_path / "run"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_until(lambda: (node_dir / "gpu_metrics.csv").exists(), timeout=60, interval=0.1,
                   what="node 1 at its store")
        time.sleep(1)
        node.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, stderr = node.communicate(timeout=20)
        took = time.monotonic() - sent
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
    assert node.returncode == 128 + signal.SIGTERM, stderr
    assert took < 5 and "Traceback" not in stderr, stderr
    events = [json.loads(line) for line in (node_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["signal"], e["state"]) for e in events if e["event"] == "stopped"] == \
        [(signal.SIGTERM, "planning")]
    with RunDirLock(node_dir):  # released
        pass


def test_a_join_tried_again_after_a_node_died_mid_round_is_not_a_lost_store(tmp_path,
                                                                           monkeypatch):
    """Three nodes formed a round late (two came 16 s after the first); one of them died
    before it said what it holds. The others waited for its record, then joined the next
    round, which formed once its keep-alive expired. The supervisor bounded both tries by
    one try's deadline (join_timeout + the records' wait + read_timeout + 5 s = 29 s here): a
    join about to succeed ended as a lost store, 'requeue the job (exit status 75)', on every
    node."""
    import time
    from types import SimpleNamespace

    from ftmaster import membership as membership_module
    from ftmaster.supervisor import Supervisor, SupervisorConfig

    monkeypatch.setattr(membership_module, "RECORD_TIMEOUT_S", 2.0)
    port, conf = free_port(), {**CONF, "join_timeout": "20", "read_timeout": "2",
                               "last_call_timeout": "3", "keep_alive_max_attempt": "15"}

    def slow_seat(node_rank):
        config = RendezvousConfig(f"127.0.0.1:{port}", "job", 2, 3, node_rank,
                                  local_addr="127.0.0.1",
                                  conf={**conf, "is_host": str(int(node_rank == 0))})
        return NodeMembership(config, poll_s=0.0)

    seats = [slow_seat(0)]
    supervisor = Supervisor(SupervisorConfig(run_dir=tmp_path, command=("t.py",), gpus=(0,),
                                             first_plan=None),
                            SimpleNamespace(on_alert=None), seats[0])
    joined = {}

    def dies_once_the_round_formed():
        seats[2].handler.next_rendezvous()
        seats[2].stop_keep_alive()

    def the_late_two():
        time.sleep(16)
        seats.extend([slow_seat(1), slow_seat(2)])
        dying = threading.Thread(target=dies_once_the_round_formed)
        dying.start()
        joined[1] = seats[1].join([0])
        dying.join()

    late = threading.Thread(target=the_late_two)
    late.start()
    try:
        started = time.monotonic()
        joined[0] = supervisor._join([0])
        assert time.monotonic() - started > seats[0].config.join_timeout_s
        assert [node.node_rank for node in joined[0].nodes] == [0, 1]
    finally:
        late.join(timeout=60)
        for node in seats:
            node.stop_keep_alive()
    assert joined[1].nodes == joined[0].nodes  # the first round that completed: number 1


@needs_ipv6
def test_nodes_at_ipv6_addresses_form_a_round(tmp_path):
    """Each node at ::1, the store at [::1]:PORT, each serving its memory tier to the other."""
    from ftmaster.membership import free_port as free_port_at
    from ftmaster.peer_files import PeerServeConfig, PeerServer

    port = free_port_at("::1")
    seats = [NodeMembership(RendezvousConfig(f"[::1]:{port}", "job", 2, 2, rank, local_addr="::1",
                                             conf={**CONF, "is_host": str(int(rank == 0))}),
                            poll_s=0.0) for rank in (0, 1)]
    servers = [PeerServer(PeerServeConfig(tmp_path, None, addr="::1")) for _ in seats]
    rounds = [None, None]
    joins = [threading.Thread(target=lambda r=r: rounds.__setitem__(
        r, seats[r].join([0], peer_url=servers[r].url))) for r in (0, 1)]
    try:
        for thread in joins:
            thread.start()
        for thread in joins:
            thread.join(timeout=60)
        assert rounds[0].nodes == rounds[1].nodes
        assert [(n.addr, n.peer_url) for n in rounds[0].nodes] == [
            ("::1", server.url) for server in servers]
    finally:
        for node in seats:
            node.stop_keep_alive()
        for server in servers:
            server.close()
