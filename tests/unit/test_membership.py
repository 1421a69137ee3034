"""Multi-node settings and the parts of a rendezvous round that are pure: torchrun's option
forms, node order by node rank, and one-line refusals."""

import json
import re
import threading
import time
from dataclasses import asdict, replace

import click
import pytest
from click.testing import CliRunner

from ftmaster.cli import main
from ftmaster.launch import rendezvous_config
from ftmaster.membership import (RECORD_TIMEOUT_S, JoinTimedOut, NodeMembership, NodeRecord,
                                 RendezvousConfig, Round, check_same_arguments, order_records,
                                 parse_conf, parse_nnodes, parse_record, unread_conf_keys)
from ftmaster.recovery.torchrun import StaticWorld, torchrun_argv
from helpers.ipv6 import needs_ipv6
from helpers.trainer import PRETRAIN
from test_launch_cli import MODEL


@pytest.mark.parametrize("text, parsed", [("1", (1, 1)), ("2", (2, 2)), ("1:4", (1, 4))])
def test_parse_nnodes(text, parsed):
    assert parse_nnodes(text) == parsed


@pytest.mark.parametrize("text", ["0", "3:2", "a:b", "1:", ""])
def test_parse_nnodes_refuses(text):
    with pytest.raises(ValueError, match="--nnodes"):
        parse_nnodes(text)


def test_a_setting_torch_never_reads_is_named():
    conf = parse_conf("join_timout=60,last_call_timeout=2,is_host=1,read_timeout=9")
    assert unread_conf_keys(conf) == ["join_timout"]


def test_parse_conf():
    assert parse_conf("last_call_timeout=2, keep_alive_interval=1") == {
        "last_call_timeout": "2", "keep_alive_interval": "1"}
    assert parse_conf(None) == {}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_conf("join_timeout")


def record(rank, addr="n"):
    return NodeRecord(rank, f"{addr}{rank}", (0, 1), 1000 + rank)


def test_nodes_are_ordered_by_node_rank_never_by_hostname():
    # torch's own rendezvous ranks sort descriptors as text: node10 before node2
    joined = [NodeRecord(10, "node10", (0,), 1), NodeRecord(2, "node2", (0, 1), 2),
              NodeRecord(0, "zeta", (0, 1), 3)]
    assert [r.node_rank for r in order_records(joined)] == [0, 2, 10]
    assert Round(1, order_records(joined), 0).node_gpus == (2, 2, 1)


def test_a_round_starts_warm_only_when_every_node_can_and_old_records_read_as_cold():
    warm, cold = NodeRecord(0, "a", (0,), 1, warm=True), NodeRecord(1, "b", (0,), 2)
    assert Round(2, (warm, replace(warm, node_rank=1)), 0).warm
    assert not Round(2, (warm, cold), 0).warm  # e.g. a node on its first, cold, launch
    assert parse_record(b'{"node_rank": 1, "addr": "b", "gpus": [0], "port": 2}') == cold
    assert parse_record(json.dumps(asdict(warm)).encode()) == warm
    serving = replace(warm, peer_url="http://a:7")
    assert parse_record(json.dumps(asdict(serving)).encode()) == serving
    launched = replace(serving, launch_gpus=2, args=("--lr", "1e-2"))
    assert parse_record(json.dumps(asdict(launched)).encode()) == launched


@pytest.mark.parametrize("consumed, planned", [
    ((176, 176), 176),
    ((176, 128), 128),  # a persist copy landed on one node's --save between their looks
    ((176, None), None),  # one node's look past its deadline: none is relied on
])
def test_a_round_plans_on_the_least_samples_any_nodes_checkpoint_consumed(consumed, planned):
    """Each node planned on what its own look at --save found: two looks apart, the step
    batches allowed the nodes different data-parallel sizes, and they started different
    numbers of ranks."""
    nodes = tuple(replace(record(rank), consumed_samples=samples)
                  for rank, samples in enumerate(consumed))
    assert Round(2, nodes, 0).consumed_samples == planned
    assert [parse_record(json.dumps(asdict(node)).encode()) for node in nodes] == list(nodes)
    for garbled in ('"176"', "true", "1.5", "[1]"):
        body = b'{"node_rank": 1, "addr": "b", "gpus": [0], "port": 2, "consumed_samples": '
        assert parse_record(body + garbled.encode() + b"}").consumed_samples is None


def test_every_node_of_a_round_plans_on_the_same_original_size():
    """Node 0 launched with 2 GPUs and node 1 with 1 planned on 4 and 2: different plans,
    and each node waited for ranks the other never started."""
    nodes = (replace(record(0), launch_gpus=2), replace(record(1), gpus=(0,), launch_gpus=1))
    assert Round(1, nodes, 0).original_world_size(2) == Round(1, nodes, 1).original_world_size(2) == 4
    assert Round(3, (replace(nodes[0], gpus=(1,)), nodes[1]), 0).original_world_size(2) == 4
    assert Round(1, (record(0), record(1)), 0).original_world_size(3) == 6  # older records


ARGS = ("--num-layers", "4", "--lr", "1e-2", "--train-iters", "30")


@pytest.mark.parametrize("theirs, message", [
    (("--num-layers", "4", "--lr", "5e-2", "--train-iters", "30"),
     "node 1 (n1) was given other training arguments (--lr 5e-2 there, --lr 1e-2 here)"),
    (ARGS[:-2], "(nothing more there, --train-iters 30 here)"),
    (("--num-layers", "4", "--bf16", "--lr", "1e-2", "--train-iters", "30"),
     "(--bf16 --lr there, --lr 1e-2 here)"),
])
def test_a_node_given_other_training_arguments_is_refused(theirs, message):
    me = replace(record(0), args=ARGS)
    check_same_arguments(me, [me, replace(record(1), args=ARGS)])
    with pytest.raises(ValueError) as refused:
        check_same_arguments(me, [me, replace(record(1), args=theirs)])
    assert message in str(refused.value)
    assert str(refused.value).endswith("give every node the same command")


def test_two_nodes_with_one_node_rank_are_refused():
    with pytest.raises(ValueError, match="two nodes .* use --node-rank 1"):
        order_records([record(1, "a"), record(1, "b")])


def test_rendezvous_config_validates():
    with pytest.raises(ValueError, match="--rdzv-backend"):
        RendezvousConfig("h:1", "job", 1, 2, 0, backend="etcd")
    with pytest.raises(ValueError, match="--node-rank"):
        RendezvousConfig("h:1", "job", 1, 2, -1)


@pytest.mark.parametrize("endpoint, message", [
    ("fd00::1", "an IPv6 address goes in brackets"),  # torch reads host 'fd00:', port 1
    ("::1", "an IPv6 address goes in brackets"),
    ("h:99999", "the port must be 0-65535"),
    ("h:", "the port must be 0-65535"),
    ("[fd00::1]:x", "the port must be 0-65535"),
    ("a b:1", "expected HOST[:PORT]"),
])
def test_an_endpoint_torch_would_misread_is_refused(endpoint, message):
    with pytest.raises(ValueError, match=rf"^--rdzv-endpoint '{re.escape(endpoint)}': {re.escape(message)}"):
        RendezvousConfig(endpoint, "job", 1, 2, 0)


@pytest.mark.parametrize("endpoint", ["[fd00::1]:2379", "fd00::1:2379", "[::1]"])
def test_an_etcd_server_at_an_ipv6_address_is_refused_up_front(endpoint):
    """python-etcd writes the address into its URLs without brackets, which urllib3 cannot
    parse: the rendezvous failed as a lost store (exit 75, requeued to fail again)."""
    with pytest.raises(ValueError, match="^--rdzv-backend etcd-v2 cannot reach an IPv6 address"):
        RendezvousConfig(endpoint, "job", 1, 2, 0, backend="etcd-v2")
    RendezvousConfig("etcd.example:2379", "job", 1, 2, 0, backend="etcd-v2")


@pytest.mark.parametrize("key, value, expected", [
    ("keep_alive_interval", "0", "seconds from 1"), ("keep_alive_max_attempt", "0", "attempts from 3"),
    ("keep_alive_max_attempt", "2", "attempts from 3")])
def test_a_keep_alive_window_too_short_is_refused(key, value, expected):
    """torch takes 0, and its keep-alive window, interval x attempts, is then 0: every node
    counts as dead at once, and the round never formed (a join timeout). torch sends
    a keep-alive only once the last is an interval old: with 2 attempts a live node dropped
    itself from its round, with 1 no round formed."""
    with pytest.raises(ValueError, match=f"--rdzv-conf {key}='{value}': expected whole {expected}"):
        RendezvousConfig("h:1", "job", 1, 2, 0, conf={key: value})
    RendezvousConfig("h:1", "job", 1, 2, 0, conf={key: "3"})


def test_a_try_at_a_round_may_take_the_join_and_the_wait_for_every_record():
    config = RendezvousConfig("h:1", "job", 1, 2, 0, conf={"join_timeout": "30",
                                                            "read_timeout": "5"})
    assert config.join_timeout_s == 30 + RECORD_TIMEOUT_S + 5 + 5  # the store's margin


def test_each_node_runs_a_static_torchrun_for_its_generation():
    world = StaticWorld(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29555)
    assert torchrun_argv(["train.py"], 1, python="py", world=world) == [
        "py", "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1",
        "--rdzv-backend", "static", "--rdzv-endpoint", "10.0.0.1:29555",
        "--master-addr", "10.0.0.1", "--master-port", "29555", "--rdzv-conf", "",
        "--nproc-per-node", "1", "--max-restarts", "0", "train.py"]
    with pytest.raises(ValueError, match="node rank 2 is outside 2 nodes"):
        StaticWorld(2, 2, "a", 1)


@pytest.mark.parametrize("world", [None, StaticWorld(2, 1, "10.0.0.1", 29555)])
def test_torchrun_reads_no_rendezvous_from_the_environment(world, monkeypatch):
    """torchrun takes an option left out from PET_<OPTION>; a Kubeflow PyTorchJob sets these,
    and they turned each node's static torchrun into a c10d rendezvous elsewhere."""
    from torch.distributed.run import config_from_args, parse_args

    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "elsewhere:29400")
    monkeypatch.setenv("PET_RDZV_CONF", "is_host=0,timeout=5")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config, _, _ = config_from_args(parse_args(torchrun_argv(["train.py"], 1, world=world)[3:]))
    if world is None:  # --standalone: its own store on a free local port, whatever the backend
        assert config.rdzv_configs == {"timeout": 900}
    else:
        assert (config.rdzv_backend, config.rdzv_endpoint, config.rdzv_configs) == (
            "static", "10.0.0.1:29555", {"rank": 1, "timeout": 900})


@pytest.mark.parametrize("options, message", [
    (["--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29400"],
     "--nnodes 1:2 needs --run-dir"),
    (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29400", "--run-dir", "R"],
     "--nnodes 1:2 needs --node-rank"),
    (["--nnodes", "2", "--node-rank", "0", "--run-dir", "R"], "--nnodes 2 needs --rdzv-endpoint"),
    (["--nnodes", "2:1", "--node-rank", "0", "--run-dir", "R"], "--nnodes '2:1': need 1 <= MIN <= MAX"),
    (["--nnodes", "1:2", "--node-rank", "0", "--run-dir", "R", "--rdzv-endpoint", "h:1",
      "--rdzv-conf", "oops"], "--rdzv-conf entry 'oops': expected KEY=VALUE"),
    (["--nnodes", "1:2", "--node-rank", "0", "--run-dir", "R", "--rdzv-endpoint", "h:1",
      "--rdzv-conf", "keep_alive_interval=0.5"],
     "--rdzv-conf keep_alive_interval='0.5': expected whole seconds"),
    (["--nnodes", "1:2", "--node-rank", "0", "--run-dir", "R", "--rdzv-endpoint", "fd00::1"],
     "--rdzv-endpoint 'fd00::1': an IPv6 address goes in brackets, as in [fd00::1]:29400"),
    # torch's timedelta overflowed: a traceback from the first round
    (["--nnodes", "1:2", "--node-rank", "0", "--run-dir", "R", "--rdzv-endpoint", "h:1",
      "--rdzv-conf", "join_timeout=99999999999999999999"],
     "--rdzv-conf join_timeout='99999999999999999999': expected whole seconds from 1 to 1000000000"),
    # The store bound a port of its own, which no other node knew: each lost the store
    (["--nnodes", "1:2", "--node-rank", "0", "--run-dir", "R", "--rdzv-endpoint", "h:0"],
     "--rdzv-endpoint 'h:0': port 0 is no port the other nodes can reach"),
    (["--nnodes", "1:2", "--node-rank", "0", "--run-dir", "R", "--rdzv-endpoint", "h:65536"],
     "--rdzv-endpoint 'h:65536': the port must be"),
    # Was "not an address of this host": it is, written as in an endpoint
    (["--nnodes", "1:2", "--node-rank", "0", "--run-dir", "R", "--rdzv-endpoint",
      "[::1]:29400", "--local-addr", "[::1]"],
     "--local-addr '[::1]': an address alone goes without brackets (::1)"),
    # An address of no interface here (TEST-NET-1): the first round's bind raised a traceback
    (["--nnodes", "1:2", "--node-rank", "0", "--run-dir", "R", "--rdzv-endpoint",
      "127.0.0.1:29400", "--local-addr", "192.0.2.1"],
     "--local-addr 192.0.2.1 is not an address of this host"),
])
def test_multi_node_bad_input_is_one_line(tmp_path, options, message):
    options = [str(tmp_path / o) if o == "R" else o for o in options]
    result = CliRunner().invoke(main, ["launch", "--nproc-per-node", "2", "--monitor-backend", "sim",
                                       *options, "--", PRETRAIN, *MODEL])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_a_slurm_node_list_that_cannot_be_read_is_named_in_the_refusal(tmp_path, monkeypatch):
    """It read as if the user had forgotten --rdzv-endpoint under srun, which gives one."""
    for name, value in {"SLURM_JOB_ID": "6", "SLURM_STEP_ID": "0", "SLURM_NODEID": "0",
                        "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
                        "SLURM_STEP_NODELIST": "n[1-2", "PATH": "/nonexistent"}.items():
        monkeypatch.setenv(name, value)  # no scontrol on PATH: ftmaster's own expansion
    result = CliRunner().invoke(main, ["launch", "--nproc-per-node", "2", "--monitor-backend", "sim",
                                       "--run-dir", str(tmp_path / "R"), "--", PRETRAIN, *MODEL])
    assert result.exit_code == 2
    assert result.stderr == ("Error: --nnodes 1:2 needs --rdzv-endpoint (SLURM's gives none: "
                             "node list 'n[1-2': unbalanced brackets)\n"), result.stderr


def test_a_refused_launch_leaves_no_tensorboard_folder(tmp_path):
    """ftmaster's board was made before the rendezvous looked up --local-addr: the refusal
    left an event file in TENSORBOARD_DIR/ftmaster_node0, a run of its own in TensorBoard."""
    result = CliRunner().invoke(main, [
        "launch", "--nproc-per-node", "2", "--monitor-backend", "sim", "--nnodes", "1:2",
        "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29400", "--local-addr", "192.0.2.1",
        "--run-dir", str(tmp_path / "run"), "--", PRETRAIN, *MODEL[:11], "16", *MODEL[12:],
        "--tensorboard-dir", str(tmp_path / "tb")])
    assert result.exit_code == 2 and "is not an address of this host" in result.stderr
    assert list(tmp_path.iterdir()) == []


def rendezvous_options(tmp_path, **given):
    options = dict(nnodes="1:2", node_rank=0, run_dir=tmp_path, rdzv_id=None,
                   rdzv_backend="c10d", local_addr=None, rdzv_conf=None, metrics_port=None)
    return {**options, **given}


@pytest.mark.parametrize("endpoint", ["n1:29400", "n1", "[fd00::1]:29400"])
def test_metrics_on_the_store_port_are_refused(tmp_path, endpoint):
    """On the node at the endpoint the metrics took the port first, torch's store client
    connected to them, and both waited for the other for good, deaf to SIGTERM."""
    options = rendezvous_options(tmp_path, rdzv_endpoint=endpoint, metrics_port=29400)
    with pytest.raises(click.ClickException, match=(
            f"--metrics-port 29400 is the rendezvous store's port \\(--rdzv-endpoint "
            f"{re.escape(endpoint)}\\): give another")):
        rendezvous_config(options)


@pytest.mark.parametrize("endpoint, backend, port", [
    ("n1:29400", "c10d", 9100), ("n1:29400", "c10d", 0), ("n1:2379", "etcd-v2", 2379)])
def test_metrics_on_another_port_or_beside_etcd_are_taken(tmp_path, endpoint, backend, port):
    options = rendezvous_options(tmp_path, rdzv_endpoint=endpoint, rdzv_backend=backend,
                                 metrics_port=port)
    assert rendezvous_config(options).endpoint == endpoint


@pytest.mark.parametrize("local_addr, endpoint, conf, is_host", [
    ("10.0.0.1", "10.0.0.1:29400", {}, "1"),  # this node's own address: it serves the store
    ("10.0.0.2", "10.0.0.1:29400", {}, None),  # another node's: torch decides (a client)
    ("127.0.0.1", "127.0.0.1:29400", {}, None),  # loopback: the first to bind hosts
    ("10.0.0.1", "10.0.0.1:29400", {"is_host": "0"}, "0"),  # the user's word stands
    ("10.0.0.1", "10.0.0.1", {}, "1"),  # torch's default port
    ("fd00::1", "[fd00::1]:29400", {}, "1"),  # IPv6, in brackets as torch reads it
    ("fd00::1", "[fd00::1]", {}, "1"),
    ("fd00::1", "fd00::1:29400", {}, "1"),  # torch takes the last colon for the port's
    ("fd00::2", "[fd00::1]:29400", {}, None),
])
def test_the_node_at_the_endpoint_hosts_the_store(local_addr, endpoint, conf, is_host):
    from ftmaster.membership import store_conf

    config = RendezvousConfig(endpoint, "job", 1, 2, 0, local_addr=local_addr, conf=conf)
    assert store_conf(config).get("is_host") == is_host


@needs_ipv6
@pytest.mark.parametrize("addr", ["::1", "::"])
def test_a_node_at_an_ipv6_address_offers_a_port_there(addr):
    """An IPv6 --local-addr was refused as no address of this host (a bind with an IPv4
    socket: "Address family for hostname not supported")."""
    from ftmaster.membership import check_address, free_port

    check_address(RendezvousConfig("[::1]:29400", "job", 1, 2, 0, local_addr=addr))
    assert 0 < free_port(addr) < 65536


def test_a_name_with_an_ipv4_address_binds_it_as_before():
    from ftmaster.membership import free_port

    assert free_port("localhost") > 0


def test_a_round_that_never_formed_says_how_long_it_waited_for_how_many():
    """torch's RendezvousTimeoutError has no message: the give-up read "too few nodes joined
    the rendezvous: " and nothing more."""
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    membership = NodeMembership.__new__(NodeMembership)
    membership.config = RendezvousConfig("h:1", "job", 2, 2, 0, conf={"join_timeout": "45"})

    def never_formed():
        raise RendezvousTimeoutError()

    with pytest.raises(JoinTimedOut, match="^no round of at least 2 node\\(s\\) formed within join_timeout 45 s$"):
        membership._call(never_formed)


def test_a_spare_past_the_maximum_whose_job_ended_reads_the_end_not_a_lost_store():
    """A node on torch's redundancy list (more nodes than --nnodes' maximum) gets
    RendezvousGracefulExitError when the job ends: read as a lost store, it exited 75 and
    asked SLURM to requeue a job that had completed."""
    from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

    from ftmaster.membership import JobEnded

    membership = NodeMembership.__new__(NodeMembership)
    membership.config = RendezvousConfig("h:1", "job", 2, 2, 0)
    membership._round_store = None  # the outcome is read from the round's store, if any

    def closed_while_waiting():
        raise RendezvousGracefulExitError("The rendezvous 'job' is closed")

    with pytest.raises(JobEnded) as ended:
        membership._call(closed_while_waiting)
    assert ended.value.outcome == "ended"


def test_a_node_that_died_before_its_record_is_left_to_the_next_round(monkeypatch):
    """The round completed with 2 nodes, then one died before it published its record: the
    wait for it timed out, which read as a lost store (every node exited 75 for a requeue).
    The live node joins the next round, which forms without it. A store that is really gone
    is still lost."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    from ftmaster import membership as membership_module
    from ftmaster.membership import StoreLost

    monkeypatch.setattr(membership_module, "RECORD_TIMEOUT_S", 0.3)
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5),
                           wait_for_workers=False)
    rounds = iter([("r1/", 2), ("r2/", 1)])

    def next_rendezvous():
        prefix, world_size = next(rounds)
        return SimpleNamespace(store=dist.PrefixStore(prefix, server), rank=0,
                               world_size=world_size,
                               bootstrap_store_info=RendezvousStoreInfo("127.0.0.1", 0))

    membership = NodeMembership.__new__(NodeMembership)
    membership.config = RendezvousConfig("127.0.0.1:1", "job", 1, 2, 0, local_addr="127.0.0.1")
    membership.launch_gpus, membership.args, membership.bind_host = 2, (), "127.0.0.1"
    membership.handler = SimpleNamespace(next_rendezvous=next_rendezvous)
    joined = membership.join([0, 1])
    assert [node.node_rank for node in joined.nodes] == [0]

    class Gone:  # what a TCPStore client raises once its server is gone
        def wait(self, keys, timeout):
            raise dist.DistNetworkError("Failed to recv, got 0 bytes")

    with pytest.raises(StoreLost):
        membership._call(membership_module.records_in_time, Gone(), ["ftmaster/node/0"])


def cut_off_seat(cut):
    """Node 1, whose every store read hangs until ``cut`` is set (read_timeout 1 s)."""
    from types import SimpleNamespace

    import torch.distributed.elastic.rendezvous  # noqa: F401 (loaded, as in a running ftmaster:
    # its first load, in the first store call, takes a second the stop's timing would count)

    membership = NodeMembership(RendezvousConfig("127.0.0.1:1", "job", 1, 2, 1,
                                                 local_addr="127.0.0.1",
                                                 conf={"read_timeout": "1"}), connect=False)
    membership._round_store = SimpleNamespace(underlying_store=SimpleNamespace(
        check=lambda keys: cut.wait()))
    return membership


def test_a_stop_while_a_store_call_hangs_ends_the_wait_for_a_word_at_once():
    """A store no packet reaches (its node's link cut) answers no poll: each read hung up to
    read_timeout + 5 s (65 s by default) before the stop was looked at, and then counted as
    a lost store (exit 75), past SLURM's grace period after a scancel."""
    import threading
    import time

    from ftmaster.monitor.backends.bounded import Abandoned

    cut = threading.Event()  # never set: the reply that never comes
    membership = cut_off_seat(cut)
    stop, stopped_at = threading.Event(), []
    threading.Timer(0.3, lambda: (stopped_at.append(time.monotonic()), stop.set())).start()
    try:
        with pytest.raises(Abandoned):
            membership.announcement("memory_agreed/2", 30.0, stop)
        assert time.monotonic() - stopped_at[0] < 1.0
    finally:
        cut.set()  # lets the abandoned call's thread end


@pytest.mark.parametrize("poll", ["peer_failure", "peers_waiting"])
def test_a_stop_while_the_poll_of_the_peers_hangs_ends_it_at_once(poll):
    """Training polls its peers (a failure announced, a node waiting) every tick: a store no
    packet reaches held the poll until the store's timeout (65 s by default), and the stop
    of the ranks a SIGTERM asks for waited as long, past SLURM's SIGKILL."""
    from types import SimpleNamespace

    from ftmaster.monitor.backends.bounded import Abandoned

    cut = threading.Event()  # never set: the reply that never comes
    membership = cut_off_seat(cut)
    membership.handler = SimpleNamespace(num_nodes_waiting=lambda: cut.wait())
    stop, stopped_at = threading.Event(), []
    threading.Timer(0.3, lambda: (stopped_at.append(time.monotonic()), stop.set())).start()
    try:
        with pytest.raises(Abandoned):
            getattr(membership, poll)(stop)
        assert time.monotonic() - stopped_at[0] < 1.0
    finally:
        cut.set()


def test_without_a_stop_a_store_call_that_hangs_is_a_lost_store(monkeypatch):
    import threading

    from ftmaster.membership import StoreLost

    monkeypatch.setattr(RendezvousConfig, "store_timeout_s", property(lambda config: 0.3))
    cut = threading.Event()
    try:
        with pytest.raises(StoreLost, match="unreachable .*did not return within 0.3 s"):
            cut_off_seat(cut).announcement("memory_agreed/2", 30.0)
    finally:
        cut.set()


def test_a_spares_read_of_the_jobs_outcome_from_a_store_that_hangs_is_a_lost_store(monkeypatch):
    """The outcome read a spare polls had no deadline of ftmaster's: a store no packet
    reaches held it as long as torch's own timeout, if it has one."""
    import threading

    from ftmaster.membership import StoreLost

    monkeypatch.setattr(RendezvousConfig, "store_timeout_s", property(lambda config: 0.3))
    cut = threading.Event()
    threading.Timer(5.0, cut.set).start()  # the old, unbounded, read ends here
    try:
        with pytest.raises(StoreLost, match="did not return within 0.3 s"):
            cut_off_seat(cut).outcome()
    finally:
        cut.set()


def blackholed_end(cut, hanging):
    """A seat at the end of the job whose ``hanging`` call (``check`` of the outcome, or the
    handler's ``shutdown``) waits for ``cut``, as on a store no packet reaches."""
    from types import SimpleNamespace

    membership = cut_off_seat(cut)
    calls = {"check": lambda keys: False, "set": lambda key, value: None,
             "shutdown": lambda: True}
    calls[hanging] = lambda *args: cut.wait()
    membership._round_store = SimpleNamespace(underlying_store=SimpleNamespace(
        check=calls["check"], set=calls["set"]))
    membership.handler = SimpleNamespace(shutdown=calls["shutdown"])
    membership.acknowledge = lambda stop=None: None  # bounded already; not what is tested here
    return membership


@pytest.mark.parametrize("hanging", ["check", "shutdown"])
def test_the_end_of_the_job_on_a_store_that_hangs_is_bounded(monkeypatch, hanging):
    """A store host blackholed at the end of the job: end_job's outcome check and set and the
    rendezvous' shutdown had no deadline of ftmaster's, and the node's exit hung with them."""
    import threading
    import time

    monkeypatch.setattr(RendezvousConfig, "store_timeout_s", property(lambda config: 0.3))
    cut = threading.Event()
    threading.Timer(5.0, cut.set).start()  # the old, unbounded, call ends here
    started = time.monotonic()
    try:
        blackholed_end(cut, hanging).end_job("complete")
        assert time.monotonic() - started < 2.0
    finally:
        cut.set()


@pytest.mark.parametrize("hanging", ["check", "shutdown"])
def test_a_stop_cuts_the_end_of_the_job_on_a_store_that_hangs_short(hanging):
    """SLURM SIGKILLs ftmaster a grace period after its SIGTERM, sooner than the store's
    timeout (65 s by default)."""
    import threading
    import time

    cut, stop = threading.Event(), threading.Event()
    threading.Timer(0.3, stop.set).start()
    threading.Timer(5.0, cut.set).start()
    started = time.monotonic()
    try:
        blackholed_end(cut, hanging).end_job("complete", stop)
        assert time.monotonic() - started < 1.5
    finally:
        cut.set()


def test_an_etcd_store_that_cannot_be_reached_is_lost_not_a_traceback():
    """torch's EtcdStore lets python-etcd's own errors through (torch's etcd backend wraps
    them for the handler, not for the store): a standby node reading the job's outcome from
    an etcd server that went down ended in a traceback, not exit 75 for a requeue."""
    from types import SimpleNamespace

    etcd = pytest.importorskip("etcd", reason="python-etcd is not installed")
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    from ftmaster.membership import StoreLost, free_port

    port = free_port("127.0.0.1")  # nobody serves there
    membership = NodeMembership.__new__(NodeMembership)
    membership.config = RendezvousConfig(f"127.0.0.1:{port}", "job", 1, 2, 0, backend="etcd-v2")
    store = EtcdStore(etcd.Client(host="127.0.0.1", port=port), "/torch/elastic/store")
    membership._round_store = SimpleNamespace(underlying_store=store)
    with pytest.raises(StoreLost, match="unreachable \\(EtcdConnectionFailed"):
        membership.outcome()


def test_a_node_that_learns_of_the_end_once_the_store_is_gone_acknowledges_quietly():
    """The rendezvous closed (another node ended the job); the node hosting the store read it
    first and exited, taking the store: this node's acknowledgement raised DistNetworkError,
    a traceback at the end of a job that had ended."""
    import subprocess
    import sys
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    host = subprocess.Popen([sys.executable, "-c", (
        "import time; from datetime import timedelta; import torch.distributed as dist; "
        "store = dist.TCPStore('127.0.0.1', 0, 2, True, timeout=timedelta(seconds=5), "
        "wait_for_workers=False); print(store.port, flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=5))
        membership = NodeMembership.__new__(NodeMembership)
        membership.config = RendezvousConfig(f"127.0.0.1:{port}", "job", 1, 2, 1)
        membership._round_store = SimpleNamespace(underlying_store=client)
    finally:
        host.kill()
        host.wait()
    assert membership.outcome_after_close() == "ended"
    membership.acknowledge()


HOSTS = {"node1": ["10.0.0.1"], "node1.cluster": ["10.0.0.1", "fd00::1"],
         "node2": ["10.0.0.2"], "localhost": ["127.0.0.1", "::1"], "loop-name": ["127.0.1.1"]}


@pytest.mark.parametrize("local_addr, endpoint, is_host", [
    ("10.0.0.1", "node1:29400", "1"),  # the endpoint a name of this node's address
    ("node1.cluster", "10.0.0.1:29400", "1"),  # --local-addr a name, the endpoint its address
    ("fd00::1", "node1.cluster:29400", "1"),
    ("node1", "node1.cluster", "1"),  # two names of one address
    ("fd00::1", "[fd00:0:0::1]:29400", "1"),  # one IPv6 address written two ways
    ("fd00::1", "[FD00::1]:29400", "1"),
    ("10.0.0.2", "node1:29400", None),  # another node's: torch decides
    ("10.0.0.1", "unknown:29400", None),  # no such name: torch decides, as before
    ("127.0.0.1", "localhost:29400", None),  # loopback: the first to bind hosts
    ("loop-name", "127.0.1.1:29400", None),
])
def test_the_node_at_the_endpoint_hosts_it_however_either_is_written(
        fake_resolver, local_addr, endpoint, is_host):
    from ftmaster.membership import store_conf

    config = RendezvousConfig(endpoint, "job", 1, 2, 0, local_addr=local_addr)
    assert store_conf(config).get("is_host") == is_host


def test_a_resolver_that_hangs_leaves_the_decision_to_torch(monkeypatch):
    import socket
    import threading
    import time

    import ftmaster.addresses
    from ftmaster.membership import store_conf

    never = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: never.wait())
    monkeypatch.setattr(ftmaster.addresses, "RESOLVE_TIMEOUT_S", 0.2)
    started = time.monotonic()
    config = RendezvousConfig("node1:29400", "job", 1, 2, 0, local_addr="10.0.0.1")
    assert store_conf(config).get("is_host") is None
    assert time.monotonic() - started < 2
    never.set()


@pytest.fixture
def fake_resolver(monkeypatch):
    """getaddrinfo from :data:`HOSTS`: no test asks a real resolver."""
    import socket

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in HOSTS:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (ip, port or 0)) for ip in HOSTS[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def slow_resolver(monkeypatch, name: str) -> threading.Event:
    """``socket.<name>`` blocks as behind an unreachable DNS server (until the returned event
    is set, 3 s at most), and every lookup is bounded at 0.2 s."""
    import socket

    import ftmaster.addresses

    answer = threading.Event()
    real = getattr(socket, name)

    def hangs(*args, **kwargs):
        answer.wait(3)
        return real(*args, **kwargs)

    monkeypatch.setattr(socket, name, hangs)
    monkeypatch.setattr(ftmaster.addresses, "RESOLVE_TIMEOUT_S", 0.2)
    return answer


@pytest.mark.parametrize("local_addr, named", [
    ("localhost", "looking up localhost did not finish within 0.2 s"),
    (None, "looking up this host's name did not finish within 0.2 s"),  # getfqdn's reverse lookup
])
def test_a_resolver_that_hangs_at_launch_is_one_line_naming_the_lookup(
        monkeypatch, local_addr, named):
    """The lookups of --local-addr (or of the host's own name) had no time limit: an
    unreachable DNS server stalled the launch with no word."""
    from ftmaster.membership import check_address

    answer = slow_resolver(monkeypatch, "getaddrinfo" if local_addr else "getfqdn")
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"^{named} "):
        check_address(RendezvousConfig("node1:29400", "job", 1, 2, 0, local_addr=local_addr))
    assert time.monotonic() - started < 2
    answer.set()


def test_the_rounds_offer_ports_at_the_address_resolved_at_launch(monkeypatch):
    """Every round looked --local-addr (or the host's name, in reverse) up again: a resolver
    that hung later held the round with no word. Resolved once, a round waits on none."""
    import socket

    from ftmaster.membership import free_port

    config = RendezvousConfig("127.0.0.1:29400", "job", 1, 2, 0)
    monkeypatch.setattr(socket, "getfqdn", lambda *args: "localhost")
    membership = NodeMembership(config, connect=False)
    answer = slow_resolver(monkeypatch, "getaddrinfo")
    assert config.address == "localhost"
    assert 0 < free_port(membership.bind_host) < 65536
    answer.set()


def test_a_refusal_after_the_peer_server_started_leaves_no_memory_folder(tmp_path):
    """The peer server made the node's memory folder in /dev/shm; warm workers that could not
    start then refused the launch in a traceback, leaving the folder taking tmpfs room."""
    import socket
    from pathlib import Path

    from ftmaster.persist import DIR_FLAG, flag_value, with_memory_dir

    run_dir = tmp_path / f"refused-{tmp_path.name}"
    (run_dir / "node_0" / "logs" / "warm_workers.log").mkdir(parents=True)
    model = [*MODEL[:11], "16", *MODEL[12:], "--save", str(tmp_path / "ckpt"),
             "--non-persistent-ckpt-type", "global"]
    args, _ = with_memory_dir(model, run_dir, node_rank=0)
    memory = Path(flag_value(args, DIR_FLAG) or tmp_path / "no room in /dev/shm")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    result = CliRunner().invoke(main, [
        "launch", "--nproc-per-node", "2", "--monitor-backend", "sim", "--nnodes", "1:2",
        "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1",
        "--run-dir", str(run_dir), "--", PRETRAIN, *model])
    assert result.exit_code == 2, result.stderr  # refused: no requeue
    assert result.stderr.count("\n") == 1 and "cannot start the warm workers" in result.stderr
    assert not memory.exists() and not (tmp_path / "ckpt").exists()


def test_a_rendezvous_endpoint_that_never_answers_refuses_the_launch(tmp_path):
    """Another program listening at the endpoint's port takes torch's connection and never
    answers it: torch's client waited for good, read_timeout or not, saying nothing. Past
    read_timeout and a margin the launch is refused in one line, not ended with exit 75:
    SLURM's wrapper requeued the job onto the same program for as long as it ran."""
    import socket
    import subprocess
    import sys

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        endpoint = "127.0.0.1:%d" % silent.getsockname()[1]
        launch = subprocess.Popen(
            [sys.executable, "-m", "ftmaster.cli", "launch", "--nproc-per-node", "2",
             "--monitor-backend", "sim", "--nnodes", "1:2", "--node-rank", "0",
             "--rdzv-endpoint", endpoint, "--local-addr",
             "127.0.0.1", "--rdzv-conf", "read_timeout=1", "--run-dir", str(tmp_path / "run"),
             "--", PRETRAIN, *MODEL[:11], "16", *MODEL[12:]],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = launch.communicate(timeout=40)
        finally:
            launch.kill()
    assert launch.returncode == 2, stderr
    assert stderr.count("\n") == 1 and (
        f"--rdzv-endpoint {endpoint}: another program holds that port, not the job's rendezvous "
        "store (it took the connection and said nothing within 6 s)") in stderr


def test_a_store_port_in_use_on_the_stores_host_is_named(tmp_path):
    """The node at the endpoint could not serve the store on a port another program holds:
    the line read "(The connection to the C10d store has failed. See inner exception for
    details.)", and no inner exception was shown; and it ended with exit 75, a requeue onto
    the same program."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = CliRunner().invoke(main, [
            "launch", "--nproc-per-node", "2", "--monitor-backend", "sim", "--nnodes", "1:2",
            "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:%d" % taken.getsockname()[1],
            "--local-addr", "127.0.0.1", "--rdzv-conf", "is_host=1,read_timeout=2",
            "--run-dir", str(tmp_path / "run"), "--", PRETRAIN, *MODEL[:11], "16", *MODEL[12:]])
    assert result.exit_code == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "See inner exception" not in result.stderr
    assert "another program holds that port" in result.stderr
    assert "(DistNetworkError: The server socket has failed to listen" in result.stderr
    assert "address already in use" in result.stderr


def test_a_program_that_answers_at_the_store_port_refuses_the_launch(tmp_path):
    """A program at the endpoint's port that answers (a web server's error, a banner) fails
    torch's ping: that ended with exit 75 as a lost store, and SLURM's wrapper requeued the
    job onto the same program for as long as it ran."""
    import contextlib
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        endpoint = "127.0.0.1:%d" % server.getsockname()[1]

        def answer_every_connection() -> None:
            while True:
                try:
                    connection, _ = server.accept()
                except OSError:  # closed: the test is over
                    return
                with connection:  # a web server's answer to what it read, then its wait
                    connection.settimeout(30)
                    with contextlib.suppress(OSError):
                        connection.recv(4096)
                        connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                        while connection.recv(4096):
                            pass

        threading.Thread(target=answer_every_connection, daemon=True).start()
        result = CliRunner().invoke(main, [
            "launch", "--nproc-per-node", "2", "--monitor-backend", "sim", "--nnodes", "1:2",
            "--node-rank", "1", "--rdzv-endpoint", endpoint, "--local-addr", "127.0.0.1",
            "--rdzv-conf", "read_timeout=2", "--run-dir", str(tmp_path / "run"), "--",
            PRETRAIN, *MODEL[:11], "16", *MODEL[12:]])
    assert result.exit_code == 2, result.stderr
    assert result.stderr.count("\n") == 1
    assert f"--rdzv-endpoint {endpoint}: another program holds that port" in result.stderr
    assert "Ping failed" in result.stderr


def test_an_etcd_store_nobody_serves_is_one_line(tmp_path):
    """python-etcd and urllib3 logged their own retries and failures on ftmaster's console
    ("ftmaster: warning: Retrying (Retry(total=0, ..." and an error of their own) before
    ftmaster's line said the same."""
    import socket
    import subprocess
    import sys

    pytest.importorskip("etcd")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        endpoint = "127.0.0.1:%d" % free.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-m", "ftmaster.cli", "launch", "--nproc-per-node", "2",
         "--monitor-backend", "sim", "--nnodes", "1:2", "--node-rank", "0", "--rdzv-backend",
         "etcd-v2", "--rdzv-endpoint", endpoint, "--local-addr", "127.0.0.1",
         "--run-dir", str(tmp_path / "run"), "--", PRETRAIN, *MODEL[:11], "16", *MODEL[12:]],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 75, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"cannot reach the rendezvous store at {endpoint}" in result.stderr


@pytest.mark.parametrize("participants, synced_round, waiting, dropped", [
    (1, 7, 0, True),  # node 1's keep-alive expired: torch dropped it from the round
    (2, 7, 0, False),  # both alive
    (1, 8, 0, False),  # another round began: the peers say so by waiting or failing
    (1, 7, 1, False),  # node 1 left the round to join the next one: it waits there
])
def test_a_node_the_rendezvous_dropped_from_the_round_is_seen(participants, synced_round,
                                                              waiting, dropped):
    """Node 1's ftmaster was killed between the round's plan and its ranks' start: node 0's
    ranks waited in their process group's set-up for ranks that would never come, until
    --distributed-timeout-minutes (10 by default), since no connection to them failed."""
    from types import SimpleNamespace

    membership = NodeMembership(RendezvousConfig("127.0.0.1:1", "job", 1, 2, 0,
                                                 local_addr="127.0.0.1"), poll_s=0.0,
                                connect=False)
    state = SimpleNamespace(round=7, participants={"node0": 0, "node1": 1})
    membership.handler = SimpleNamespace(_state_holder=SimpleNamespace(state=state),
                                         num_nodes_waiting=lambda: waiting)
    membership._round = Round(3, (record(0), record(1)), 0)
    membership._rendezvous_round = membership._synced_round()
    membership._round_store = SimpleNamespace(underlying_store=SimpleNamespace(
        check=lambda keys: False))
    assert not membership.node_dropped()
    state.participants = dict(list(state.participants.items())[:participants])
    state.round = synced_round
    # two polls apart: a node joining the next round waits there a sync after it left
    assert [membership.node_dropped(), membership.node_dropped()] == [False, dropped]


@pytest.mark.parametrize("state", [
    {"round": 7, "members": {"node0": 0}},  # participants renamed
    {"epoch": 7, "participants": {"node0": 0}},  # round renamed
])
def test_a_torch_whose_rendezvous_state_reads_otherwise_leaves_a_dropped_node_unknown(state):
    """The round and participants are torch elastic's private state: a torch that renamed
    either ended every poll of the running round in an AttributeError."""
    from types import SimpleNamespace

    membership = NodeMembership(RendezvousConfig("127.0.0.1:1", "job", 1, 2, 0,
                                                 local_addr="127.0.0.1"), poll_s=0.0,
                                connect=False)
    membership.handler = SimpleNamespace(
        _state_holder=SimpleNamespace(state=SimpleNamespace(**state)),
        num_nodes_waiting=lambda: 0)
    membership._round = Round(3, (record(0), record(1)), 0)
    membership._rendezvous_round = membership._synced_round()
    membership._round_store = SimpleNamespace(underlying_store=SimpleNamespace(
        check=lambda keys: False))
    assert [membership.node_dropped(), membership.node_dropped()] == [False, False]


def test_torch_keeps_the_rendezvous_state_a_dropped_node_is_read_from():
    """What node_dropped reads is torch elastic's private state: a torch that moved it would
    silently leave a node killed before the first iteration to the ranks' set-up timeout."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler, _BackendRendezvousStateHolder, _RendezvousState)

    assert "_state_holder" in DynamicRendezvousHandler.__annotations__
    assert isinstance(_BackendRendezvousStateHolder.state, property)
    state = _RendezvousState()
    assert state.round == 0 and state.participants == {}


@pytest.mark.parametrize("on_disk, status, recorded", [
    (10, 0, {"event": "complete", "iteration": 10, "on_other_nodes": True}),
    (None, 75, {"event": "store_lost", "reason": "cannot reach the rendezvous store at x"})])
def test_a_launch_that_finds_no_store_records_how_it_ended(tmp_path, monkeypatch, on_disk,
                                                          status, recorded):
    """A node started again once the other nodes had completed the job and left with the
    store exited 0 as complete (or 75) recording nothing: its run directory still read as
    the killed ftmaster's, with no end event, though the README says it records `complete`.
    It exited from inside the set-up too, its claim on --save still held: in a process that
    lives on (this runner), a later job's launch on that folder was refused."""
    from ftmaster import runfiles
    from ftmaster.lock import HOLDERS_DIR
    from ftmaster.membership import StoreLost
    from ftmaster.recovery.checkpoints import tracker_path
    from test_checkpoint_discovery import write_checkpoint

    def store_gone(self):
        raise StoreLost("cannot reach the rendezvous store at x")

    monkeypatch.setattr(NodeMembership, "connect", store_gone)
    save = tmp_path / "ckpt"
    if on_disk is not None:
        write_checkpoint(save, on_disk)
        tracker_path(save).write_text(str(on_disk))
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(main, [
        "launch", "--nproc-per-node", "2", "--monitor-backend", "sim", "--nnodes", "2",
        "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:1", "--local-addr", "127.0.0.1",
        "--cold-restart", "--run-dir", str(run_dir), "--", PRETRAIN, *MODEL[:11], "16",
        *MODEL[12:], "--save", str(save)])
    assert result.exit_code == status, result.stderr
    ended = runfiles.read_events(run_dir / "node_1")[-1]
    assert {key: ended.get(key) for key in recorded} == recorded
    assert list((save / HOLDERS_DIR).iterdir()) == []


@pytest.mark.parametrize("endpoint, warned", [("10.1.2.3:29400", True), ("127.0.0.1:29400", False)])
def test_a_loopback_address_toward_another_hosts_endpoint_is_warned_of(endpoint, warned, caplog):
    """With no --local-addr a node offered its ports at its host name's address, which Debian
    maps to 127.0.1.1 (here: localhost): other nodes reach it by name, but its peer files
    listened on loopback, and every peer copy failed, with no word."""
    from ftmaster.membership import check_address

    with caplog.at_level("WARNING", logger="ftmaster"):
        assert check_address(RendezvousConfig(endpoint, "job", 1, 2, 0,
                                              local_addr="127.0.0.1")) == "127.0.0.1"
    assert ("a loopback address other nodes cannot reach" in caplog.text) == warned


def test_an_endpoint_name_that_does_not_exist_is_refused_at_launch():
    """torch's client tried it until its timeout, and ftmaster exited 75 'store unreachable':
    a requeue met the same typo."""
    from ftmaster.membership import check_address

    with pytest.raises(ValueError, match="^--rdzv-endpoint no-such-host.invalid:29400: "
                                         "no-such-host.invalid does not resolve"):
        check_address(RendezvousConfig("no-such-host.invalid:29400", "job", 1, 2, 0,
                                       local_addr="127.0.0.1"))
