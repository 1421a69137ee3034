"""Which nodes train together, agreed through torch elastic's own rendezvous.

Each node's ftmaster is one participant of torch's ``DynamicRendezvousHandler`` (c10d by
default, etcd-v2 optional), created through torch's public registry. A **round** is:

1. join: ``handler.next_rendezvous()`` returns once the round is complete (MAX nodes, or at
   least MIN after ``last_call_timeout``), with the round's store;
2. every node publishes its record in that store: node rank (``--node-rank``, its stable
   identity), address, the GPUs it can schedule, and a free port it offers as master port;
3. every node reads every record and orders them by node rank, never by hostname (torch's
   own rendezvous ranks sort node descriptors as strings);
4. the round number is a job-wide counter in the store, so the restart budget is the job's,
   not one node's.

Every node then runs the same pure planner on the same list (see ``plan_nodes``).

A node that fails locally joins the next round; that puts it on the rendezvous wait list,
which its peers see at their next poll (:meth:`NodeMembership.peers_waiting`), so they stop
and join too. A node that died is dropped when its keep-alive expires (``keep_alive_interval``
x ``keep_alive_max_attempt``, 5 s x 3 by default). Only the end of the whole job shuts the
rendezvous down (:meth:`NodeMembership.end_job`): a node that exits otherwise never closes it
for the others, unlike torchrun's agent.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set: with torch 2.13's store sharing a joining
node can hang waiting for a master address, and rank 0 moving to another node leaves a stale
one (reproduced on torch 2.13; see ``torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py``
and ``torch/distributed/run.py``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Mapping, Sequence

from ftmaster.addresses import (ResolveTimeout, bind_address, ip_address, is_ipv6, same_host,
                                split_host_port, this_host_name)
from ftmaster.monitor.backends.bounded import (Abandoned, CallTimeout, call_once_bounded,
                                               call_while)
from ftmaster.peer_files import new_secret

log = logging.getLogger("ftmaster")

SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
BACKENDS = ("c10d", "etcd-v2")
DEFAULT_PORT = 29400
RECORD_TIMEOUT_S = 60.0
ACK_TIMEOUT_S = 30.0
KEEP_ALIVE_STOP_TIMEOUT_S = 10.0
STORE_POLL_S = 0.1  # how often a wait on the store looks for a stop


class StoreLost(Exception):
    """The rendezvous store cannot be reached: the job must be requeued."""


class JobEnded(Exception):
    """The rendezvous was closed: the job ended on another node, with ``outcome``."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class JoinTimedOut(Exception):
    """Too few nodes joined within ``join_timeout``."""


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` as torchrun takes them; ValueError (one line) otherwise."""
    low, sep, high = text.partition(":")
    try:
        min_nodes, max_nodes = int(low), int(high if sep else low)
    except ValueError:
        raise ValueError(f"--nnodes {text!r}: expected N or MIN:MAX, e.g. 1:4") from None
    if not 1 <= min_nodes <= max_nodes:
        raise ValueError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return min_nodes, max_nodes


# --rdzv-conf keys torch reads with get_as_int (dynamic_rendezvous.py, c10d_rendezvous_backend.py).
# None may be 0: torch refuses a zero timeout, and takes a zero keep-alive, whose window
# (interval x attempts) then counts every node as dead, so that no round ever forms.
WHOLE_SECONDS_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                      "keep_alive_interval", "keep_alive_max_attempt", "read_timeout")
MAX_CONF_SECONDS = 10**9
MIN_KEEP_ALIVE_ATTEMPTS = 3
"""Fewest keep-alive intervals a node may miss before it counts as dead: with 1 no round
formed, and with 2 a live node dropped itself from its round (checked on loopback)."""
"""As ftmaster's own durations; torch's ``timedelta(seconds=...)`` overflows past a C int."""


def parse_conf(text: str | None) -> dict[str, str]:
    """``--rdzv-conf K=V,K=V`` as a dict; ValueError (one line) for a malformed entry."""
    conf = {}
    for entry in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = entry.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--rdzv-conf entry {entry!r}: expected KEY=VALUE")
        conf[key.strip()] = value.strip()
    return conf


# What torch's rendezvous handlers read (torch/distributed/elastic/rendezvous: the dynamic
# handler's timeouts and keep-alive, the c10d store's, the etcd backends' connection).
CONF_KEYS = frozenset({
    "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
    "keep_alive_interval", "keep_alive_max_attempt", "read_timeout", "timeout", "is_host",
    "store_type", "protocol", "cacert", "cert", "key", "ca_cert", "ssl_cert", "ssl_cert_key",
    "etcd_prefix"})


def unread_conf_keys(conf: Mapping[str, str]) -> list[str]:
    """Keys of ``--rdzv-conf`` that torch never reads: a mistyped timeout is otherwise
    silently its default."""
    return sorted(set(conf) - CONF_KEYS)


@dataclass(frozen=True)
class RendezvousConfig:
    """Where and how nodes meet (torchrun's option names)."""

    endpoint: str
    """``HOST:PORT`` of the rendezvous store (``--rdzv-endpoint``)."""
    run_id: str
    """The job's id, the same on every node (``--rdzv-id``)."""
    min_nodes: int
    """Fewest nodes a round may train with (``--nnodes MIN:MAX``)."""
    max_nodes: int
    """Most nodes a round takes; a round closes at once when this many joined."""
    node_rank: int
    """This node's stable identity (``--node-rank``): plans order nodes by it."""
    backend: str = "c10d"
    """``c10d`` (a TCPStore in one node's ftmaster) or ``etcd-v2`` (an etcd server, v2 API)."""
    local_addr: str | None = None
    """The address other nodes reach this one at (``--local-addr``); default its FQDN."""
    conf: Mapping[str, str] = field(default_factory=dict)
    """``--rdzv-conf``: join_timeout, last_call_timeout, keep_alive_interval, read_timeout..."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--rdzv-backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"need 1 <= min nodes <= max nodes, got {self.min_nodes}:{self.max_nodes}")
        if self.node_rank < 0:
            raise ValueError(f"--node-rank must be >= 0, got {self.node_rank}")
        if not self.endpoint:
            raise ValueError("--rdzv-endpoint is needed with --nnodes")
        if not self.run_id:  # --run-dir / has no name to default to
            raise ValueError("--rdzv-id is needed with --nnodes: the run directory has no name "
                             "to take it from")
        try:
            host, port = split_host_port(self.endpoint)
        except ValueError as error:
            raise ValueError(f"--rdzv-endpoint {error}") from None
        if port == 0:  # the c10d store would bind a port of its own, known to no other node
            raise ValueError(f"--rdzv-endpoint {self.endpoint!r}: port 0 is no port the other "
                             f"nodes can reach: give the store's ({DEFAULT_PORT} by default)")
        if self.backend == "etcd-v2" and is_ipv6(host):
            raise ValueError("--rdzv-backend etcd-v2 cannot reach an IPv6 address (python-etcd "
                             "writes it into its URLs without brackets): give the etcd "
                             "server's host name in --rdzv-endpoint")
        if self.local_addr and self.local_addr.startswith("["):
            raise ValueError(f"--local-addr {self.local_addr!r}: an address alone goes without "
                             f"brackets ({self.local_addr.strip('[]')})")
        for key in WHOLE_SECONDS_KEYS:
            if key in self.conf:
                self.seconds(key, 0)

    def seconds(self, key: str, default: int) -> int:
        """A ``--rdzv-conf`` duration (torch's keys and defaults; torch reads whole seconds)."""
        value = self.conf.get(key, default)
        try:
            number = int(str(value))
        except ValueError:
            number = -1
        least = MIN_KEEP_ALIVE_ATTEMPTS if key == "keep_alive_max_attempt" else 1
        if not least <= number <= MAX_CONF_SECONDS:
            unit = "attempts" if key == "keep_alive_max_attempt" else "seconds"
            why = (" (torch sends a keep-alive only once the last is an interval old, so two "
                   "can lie nearly two intervals apart)" if least > 1 else " (torch reads an integer)")
            raise ValueError(f"--rdzv-conf {key}={value!r}: expected whole {unit} from {least} "
                             f"to {MAX_CONF_SECONDS}{why}")
        return number

    @property
    def endpoint_host(self) -> str:
        return split_host_port(self.endpoint)[0]

    @functools.cached_property
    def address(self) -> str:
        """``--local-addr``, else this host's FQDN, looked up once (the rounds wait on no
        resolver): ResolveTimeout when the lookup hangs."""
        return self.local_addr or this_host_name()

    @property
    def store_port(self) -> int:
        """The endpoint's port as torch reads it (:func:`split_host_port`), or its default."""
        port = split_host_port(self.endpoint)[1]
        return DEFAULT_PORT if port is None else port

    @property
    def store_timeout_s(self) -> float:
        """How long one store call may take before the store counts as lost: torch's
        ``read_timeout`` plus a margin for its own retry."""
        return self.seconds("read_timeout", 60) + 5

    @property
    def join_timeout_s(self) -> float:
        """The longest one try at a round may take: torch's join, then the wait for every
        node's record (:func:`records_in_time`), store trouble included. Without the records'
        wait, a round that formed late was cut short as a lost store when a node died before
        its record, under a ``read_timeout`` below that wait."""
        return self.seconds("join_timeout", 600) + RECORD_TIMEOUT_S + self.store_timeout_s


UNTOLD_END = "ended"
"""The job's outcome when the rendezvous closed before this node could read it (a node that
never completed a round holds no store to read it from)."""


@dataclass(frozen=True)
class NodeRecord:
    """What a node tells the others in a round."""

    node_rank: int
    addr: str
    gpus: tuple[int, ...]
    """The GPUs it can schedule (its own NVML indices)."""
    port: int
    """A free port on ``addr``, the master port if this node hosts plan rank 0."""
    warm: bool = False
    """Whether this node can start its ranks on warm workers in this round (see
    :attr:`Round.warm`)."""
    peer_url: str | None = None
    """Where it serves its node-local memory tier to its peers (:mod:`peer_files`)."""
    launch_gpus: int = 0
    """How many GPUs it was launched with (``gpus`` are those left)."""
    args: tuple[str, ...] = ()
    """The training arguments it was given: every node's must be the same."""
    consumed_samples: int | None = None
    """Under ``--step-batch-size-schedule``, the samples the newest checkpoint in its
    ``--save`` consumed; None without a schedule or when it could not tell."""


@dataclass(frozen=True)
class Round:
    """One agreed membership: the same on every node of the round."""

    number: int
    """Job-wide count of rounds so far (1 for the first)."""
    nodes: tuple[NodeRecord, ...]
    """Every node of the round, in node-rank order."""
    me: int
    """This node's index in ``nodes``."""
    secret: str | None = None
    """The job's secret for peer copies, drawn once per job (only when this node serves)."""

    @property
    def node_gpus(self) -> tuple[int, ...]:
        return tuple(len(node.gpus) for node in self.nodes)

    def original_world_size(self, max_nodes: int) -> int:
        """The job's GPUs as launched, alike on every node of the round (nodes launched with
        different GPU counts planned differently from their own counts, and waited for each
        other for good): ``--nnodes`` MAX nodes of the most GPUs any node was launched with."""
        return max(node.launch_gpus or len(node.gpus) for node in self.nodes) * max_nodes

    @property
    def warm(self) -> bool:
        """Whether the round starts on warm workers: only when every node can. Warm ranks meet
        through a store their rank 0 hosts, torchrun's through its agents' store: a round that
        mixed them would wait out its timeout (seen: a node's first, cold, launch beside a
        warm relaunch)."""
        return all(node.warm for node in self.nodes)

    @property
    def consumed_samples(self) -> int | None:
        """The planner's ``consumed_samples`` for the round, alike on every node: the least
        any node's ``--save`` showed, None when one could not tell. Each node's own look
        could differ (a persist copy landing between two nodes' looks, one look past its
        deadline), and so the data-parallel sizes the step batches allow, and with them the
        ranks each node starts: the launch then waited for ranks no node started."""
        found = [node.consumed_samples for node in self.nodes]
        return None if None in found else min(found)


def store_conf(config: RendezvousConfig) -> dict[str, str]:
    """``--rdzv-conf``, plus ``is_host`` for the node whose ``--local-addr`` is the endpoint's
    host, however either is written (:func:`same_host`). torch otherwise decides by comparing
    the endpoint with the machine's own names and addresses, which misses an address that
    only a container or network namespace has; left to torch on loopback, where every node
    matches and the first one to bind hosts."""
    conf = dict(config.conf)
    if ("is_host" not in conf and config.backend == "c10d" and config.local_addr
            and same_host(config.local_addr, config.endpoint_host)):
        conf["is_host"] = "1"
    return conf


def parse_record(data: bytes) -> NodeRecord:
    body = json.loads(data)
    return NodeRecord(int(body["node_rank"]), str(body["addr"]), tuple(body["gpus"]),
                      int(body["port"]), bool(body.get("warm", False)), body.get("peer_url"),
                      int(body.get("launch_gpus", 0)), tuple(body.get("args", ())),
                      _whole_or_none(body.get("consumed_samples")))


def _whole_or_none(value) -> int | None:
    """A record's whole number; None for anything else (an older ftmaster sends none)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def store_failure(error: BaseException) -> str:
    """``Type: message`` of what failed at the store. torch's rendezvous errors wrap it in
    one that says only "See inner exception for details", which a line never showed (an
    endpoint's port another program holds read as no reason at all)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {error}"


FOREIGN_ANSWERS = ("Ping failed, invalid value returned from server", "address already in use")
"""torch's words when the endpoint's port is another program's: it answered the store
client's ping with bytes of its own, or it holds the port this node was to serve the store
at (``is_host``). Neither is the store lost: a requeue meets that program again (exit 75
requeued the job for as long as it ran)."""
PROBE_TIMEOUT_S = 2.0


def foreign_listener(config: RendezvousConfig, seen: str) -> ValueError:
    return ValueError(f"--rdzv-endpoint {config.endpoint}: another program holds that port, "
                      f"not the job's rendezvous store ({seen}): give a port no other program "
                      "uses; a requeue would meet it again")


def silent_store(config: RendezvousConfig) -> Exception:
    """Why the store did not answer within ``store_timeout_s`` at launch: a program that
    accepts the connection and says nothing is another program (the job's store answers
    torch's ping at once, from a thread of its own), and a port nobody listens at is a store
    not there (lost: a requeue)."""
    waited = f"within {config.store_timeout_s:g} s"
    try:
        socket.create_connection((config.endpoint_host, config.store_port),
                                 timeout=PROBE_TIMEOUT_S).close()
    except OSError:
        return StoreLost(f"the rendezvous store at {config.endpoint} did not answer {waited}")
    return foreign_listener(config, f"it took the connection and said nothing {waited}")


def free_port(addr: str) -> int:
    family, address = bind_address(addr, 0)
    with socket.socket(family) as sock:
        sock.bind(address)
        return sock.getsockname()[1]


def check_address(config: RendezvousConfig) -> str:
    """The IP address this node offers its ports at, looked up once, at launch: a resolver
    that hangs then stops the launch, never a round. ValueError (one line) when a lookup
    hangs, or when this node cannot bind its address: every round offers a port there,
    which raised a traceback once the first round had formed."""
    try:
        host = bind_address(config.address, 0)[1][0]
        free_port(host)
    except ResolveTimeout as error:
        raise ValueError(f"{error}: give --local-addr as this node's IP address") from None
    except OSError as error:
        given = (f"--local-addr {config.address}" if config.local_addr else
                 f"this host's name {config.address} (the default --local-addr)")
        raise ValueError(f"{given} is not an address of this host ({error.strerror or error}): "
                         "give the address other nodes reach this one at") from None
    endpoint = _endpoint_address(config)
    if endpoint is not None:
        _warn_if_only_loopback(config, host, endpoint)
    return host


def _endpoint_address(config: RendezvousConfig) -> str | None:
    """The endpoint's address; None when its lookup fails for now (the rendezvous's own
    retries say so). ValueError for a name that does not exist: torch's client tried it until
    its timeout and ftmaster exited 75, to be requeued onto the same typo."""
    try:
        return bind_address(config.endpoint_host, 0)[1][0]
    except socket.gaierror as error:
        if error.errno == socket.EAI_NONAME:
            raise ValueError(f"--rdzv-endpoint {config.endpoint}: {config.endpoint_host} does "
                             f"not resolve ({error.strerror})") from None
        return None
    except OSError:
        return None


def _warn_if_only_loopback(config: RendezvousConfig, host: str, endpoint: str) -> None:
    """One line when this node's address is a loopback one and the endpoint's is not: other
    nodes reach it by its name, which their resolvers map right, but what it serves at that
    address (its peer files) listens on loopback only. Debian maps a host's own name to
    127.0.1.1 in /etc/hosts."""
    if ip_address(host).is_loopback and not ip_address(endpoint).is_loopback:
        given = (f"--local-addr {config.address}" if config.local_addr else
                 f"this host's name {config.address} (the default --local-addr)")
        log.warning("%s is %s here, a loopback address other nodes cannot reach: what this "
                    "node serves them (its memory checkpoints' files) listens there only; give "
                    "--local-addr as the address other nodes reach this one at", given, host)


def order_records(records: Sequence[NodeRecord]) -> tuple[NodeRecord, ...]:
    """The round's nodes by node rank; ValueError when two claim the same one."""
    ordered = tuple(sorted(records, key=lambda r: r.node_rank))
    for first, second in zip(ordered, ordered[1:]):
        if first.node_rank == second.node_rank:
            raise ValueError(f"two nodes ({first.addr} and {second.addr}) use --node-rank "
                             f"{first.node_rank}: give each node its own")
    return ordered


def check_same_arguments(me: NodeRecord, records: Sequence[NodeRecord]) -> None:
    """ValueError naming where another node's training arguments differ: data-parallel
    replicas trained with other settings diverge, and their checkpoint mixes them without any
    check failing."""
    other = next((record for record in records if record.args != me.args), None)
    if other is None:
        return
    start = _parting(me.args, other.args)
    raise ValueError(f"node {other.node_rank} ({other.addr}) was given other training arguments "
                     f"({_shown(other.args, start)} there, {_shown(me.args, start)} here): give "
                     "every node the same command")


def _parting(mine: Sequence[str], theirs: Sequence[str]) -> int:
    """Where two argument lists part; at the flag, when what differs is its value."""
    index = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b),
                 min(len(mine), len(theirs)))
    return index - 1 if index and mine[index - 1].startswith("-") else index


def _shown(args: Sequence[str], start: int) -> str:
    return " ".join(args[start:start + 2]) or "nothing more"


def load_torch_quietly() -> None:
    """torch's C++ log off in ftmaster's own process, unless the user set its level: each try
    at a store it cannot reach logged 40 lines of C++ stack, where ftmaster says what went
    wrong in one. torch reads the level once, as it loads (so before anything imports it);
    the ranks, whose C++ errors matter, never inherit it."""
    if "torch" in sys.modules or CPP_LOG_LEVEL_ENV in os.environ:
        return
    os.environ[CPP_LOG_LEVEL_ENV] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ[CPP_LOG_LEVEL_ENV]


def records_in_time(store, keys: list[str]) -> bool:
    """Whether every node of a round published its record in time. One that died between the
    round's completion and its record never will: the wait times out (the store is not lost),
    and the next round goes on without it."""
    from torch.distributed import DistStoreError

    try:
        store.wait(keys, timedelta(seconds=RECORD_TIMEOUT_S))
    except (DistStoreError, LookupError):  # the c10d stores' timeout; etcd's
        return False
    return True


def _quiet_store_clients() -> None:
    """python-etcd's and urllib3's own logs off the console: every retry and failure at the
    store they logged (as ``ftmaster: warning: Retrying (Retry(total=2, ...``) came before
    ftmaster's one line saying the same (:class:`StoreLost`)."""
    for name in ("etcd", "urllib3"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _etcd_errors() -> tuple[type[Exception], ...]:
    """What python-etcd raises for a server it cannot reach: torch's etcd backend wraps these
    for the handler (``etcd_rendezvous_backend.py``), but its ``EtcdStore`` lets them
    through every store call."""
    try:
        import etcd
        import urllib3.exceptions
    except ImportError:  # no etcd-v2 backend either
        return ()
    return etcd.EtcdException, urllib3.exceptions.TimeoutError


class NodeMembership:
    """This node's seat in the job's rendezvous."""

    def __init__(self, config: RendezvousConfig, poll_s: float = 1.0, launch_gpus: int = 0,
                 args: Sequence[str] = (), connect: bool = True) -> None:
        self.config = config
        self.poll_s = poll_s
        self.launch_gpus, self.args = launch_gpus, tuple(args)
        """This node's GPUs as launched and its training arguments (:class:`NodeRecord`)."""
        self._checked_at = float("-inf")
        self._waiting, self._peer_failure = False, None
        self._rendezvous_round, self._short_polls = None, 0
        self._round: Round | None = None
        self._round_store = None
        self.try_started_at = float("-inf")
        """When :meth:`join`'s current try began: a round one of whose nodes died before it
        said what it holds is tried again, with torch's whole join_timeout."""
        self.bind_host = check_address(config)
        """Where this node offers its ports, so that no round looks its address up again."""
        os.environ[SHARE_STORE_ENV] = "1"
        self.handler = None
        """torch's rendezvous handler, once :meth:`connect` reached the store."""
        if connect:
            self.connect()

    def connect(self) -> None:
        """Reach the rendezvous store (or serve it), which may wait up to ``read_timeout``
        and more inside torch; StoreLost when it cannot."""
        self.handler = self._create_handler()

    def _create_handler(self):
        from torch.distributed.elastic.rendezvous import (RendezvousConnectionError,
                                                          RendezvousParameters,
                                                          rendezvous_handler_registry)

        c = self.config
        _quiet_store_clients()
        params = RendezvousParameters(c.backend, c.endpoint, c.run_id, c.min_nodes, c.max_nodes,
                                      c.local_addr, **store_conf(c))
        try:
            return rendezvous_handler_registry.create_handler(params)
        except RendezvousConnectionError as error:
            failure = store_failure(error)
            if any(words in failure for words in FOREIGN_ANSWERS):
                raise foreign_listener(c, failure) from None
            raise StoreLost(f"cannot reach the rendezvous store at {c.endpoint} "
                            f"({failure})") from None
        except ImportError as error:  # etcd-v2 needs python-etcd
            raise ValueError(f"the {c.backend} rendezvous backend needs {error.name} "
                             f"(pip install python-etcd)") from None

    # -- rounds ---------------------------------------------------------------------------
    def join(self, gpus: Sequence[int], warm: bool = False, peer_url: str | None = None,
             consumed_samples: int | None = None) -> Round:
        """Join the next round with these schedulable GPUs, saying whether this node could
        start warm, where it serves its memory tier and what its newest checkpoint consumed
        (:attr:`NodeRecord.consumed_samples`); blocks until the round completes."""
        while True:
            self.try_started_at = time.monotonic()
            info = self._call(self.handler.next_rendezvous)
            store = info.store
            me = NodeRecord(self.config.node_rank, self.config.address, tuple(gpus),
                            free_port(self.bind_host), warm, peer_url, self.launch_gpus,
                            self.args, consumed_samples)
            keys = [f"ftmaster/node/{rank}" for rank in range(info.world_size)]
            self._call(store.set, keys[info.rank], json.dumps(asdict(me)))
            if self._call(records_in_time, store, keys):
                break
            log.warning("a node of the round never said what it holds within %g s (it died "
                        "after the round completed): joining the next round", RECORD_TIMEOUT_S)
        records = [parse_record(self._call(store.get, key)) for key in keys]
        check_same_arguments(me, records)
        if info.rank == 0:
            rounds = self._call(store.underlying_store.add, self._job_key("rounds"), 1)
            self._call(store.set, "ftmaster/round", str(rounds))
        number = int(self._call(store.get, "ftmaster/round"))
        nodes = order_records(records)
        secret = None if peer_url is None else self._job_secret(store)
        self._round, self._round_store = Round(number, nodes, nodes.index(me), secret), store
        self._checked_at, self._waiting, self._peer_failure = time.monotonic(), False, None
        self._rendezvous_round, self._short_polls = self._synced_round(), 0
        return self._round

    def _job_secret(self, store) -> str:
        """The first node to ask draws it; every ask, on any node, gets that one (``add``,
        ``set`` and a waiting ``get``: etcd's store has no compare-and-set)."""
        base, key = store.underlying_store, self._job_key("peer_secret")
        if self._call(base.add, f"{key}/drawn", 1) == 1:
            self._call(base.set, key, new_secret())
        return self._call(base.get, key).decode()

    def announce_failure(self, cause: str, stop: threading.Event | None = None) -> None:
        """Tell the other nodes that the current round failed here, and why: their ranks may
        be blocked on collectives with a dead peer until a timeout, or parked for a replica
        dump, and should be stopped (and dump) now. The first node to fail says it: a later
        node's failure (cause ``peer``, or a hang) is a consequence. Abandoned once ``stop``
        is set, as :meth:`announcement` is."""
        name = f"failed/{self._round.number}"
        first = self._bounded(self._round_store.underlying_store.add, self._job_key(f"{name}/n"),
                              1, stop=stop)
        if first == 1:
            self.announce(name, f"{self.config.node_rank} {cause}", stop)

    def peer_failure(self, stop: threading.Event | None = None) -> str | None:
        """The cause of the current round's failure another node announced, if one did
        (polled with :meth:`peers_waiting`, bounded and Abandoned on a stop as it is)."""
        self._poll(stop)
        return self._peer_failure

    def announce(self, name: str, value: str, stop: threading.Event | None = None) -> None:
        """Tell every node of the job ``value`` under ``name``; Abandoned once ``stop`` is set."""
        self._bounded(self._round_store.underlying_store.set, self._job_key(name), value,
                      stop=stop)

    def announcement(self, name: str, timeout_s: float,
                     stop: threading.Event | None = None) -> str | None:
        """What a node announced under ``name``, waiting up to ``timeout_s``; None if nothing
        came. Abandoned once ``stop`` is set (a signal to ftmaster): SLURM SIGKILLs ftmaster
        a grace period after its SIGTERM, sooner than some waits for a peer's word end."""
        base, key = self._round_store.underlying_store, self._job_key(name)
        if not self._all_said([key], timeout_s, stop):
            return None
        return self._bounded(base.get, key, stop=stop).decode()

    def _all_said(self, keys: list[str], timeout_s: float,
                  stop: threading.Event | None) -> bool:
        """Whether every one of ``keys`` is in the job's store within ``timeout_s``, polled
        (a store's own wait blocks in C++, deaf to a stop); Abandoned once ``stop`` is set."""
        base = self._round_store.underlying_store
        deadline = time.monotonic() + timeout_s
        stop = stop or threading.Event()  # none: only the timeout ends the wait
        while not self._bounded(base.check, keys, stop=stop):
            if time.monotonic() > deadline:
                return False
            if stop.wait(STORE_POLL_S):
                raise Abandoned(f"stopped waiting for {', '.join(keys)}")
        return True

    def _bounded(self, fn, *args, stop: threading.Event | None = None):
        """A store call from the training loop, bounded as :meth:`peers_waiting` explains;
        Abandoned once ``stop`` is set: a store no packet reaches holds the call that long."""
        deadline = time.monotonic() + self.config.store_timeout_s

        def wanted() -> bool:
            if time.monotonic() > deadline:
                raise CallTimeout(f"{getattr(fn, '__name__', 'a store call')} did not return "
                                  f"within {self.config.store_timeout_s:g} s")
            return stop is None or not stop.is_set()

        return self._call(call_while, "rendezvous-store", wanted, STORE_POLL_S, fn, *args)

    def peers_waiting(self, stop: threading.Event | None = None) -> bool:
        """Whether a node waits to form a new round (a peer failed, or one joined); polled at
        most every ``poll_s`` seconds, since every poll reads the rendezvous state.

        Bounded: the handler's keep-alive thread holds the same lock while it retries a store
        that no packet reaches (a cut link sends no reset), which would block the caller for
        good; past the store's timeout the store counts as lost. Abandoned once ``stop`` is
        set, as :meth:`announcement` is."""
        self._poll(stop)
        return self._waiting

    def node_dropped(self, stop: threading.Event | None = None) -> bool:
        """Whether the rendezvous dropped a node of the current round, its keep-alive expired
        (its ftmaster died). Before their first collective, the ranks of the nodes left wait
        for the dead node's ranks until a timeout (``--distributed-timeout-minutes``): no
        connection to them fails. Polled with :meth:`peers_waiting`, bounded as it is."""
        self._poll(stop)
        return self._short_polls >= 2

    def _synced_state(self):
        """torch elastic's rendezvous state as the handler last synced it: torch reads out
        neither its round number nor its participants publicly (None where it has none)."""
        return getattr(getattr(self.handler, "_state_holder", None), "state", None)

    def _synced_round(self) -> int | None:
        return getattr(self._synced_state(), "round", None)

    def _participants_left(self) -> int | None:
        """How many nodes of the round this node joined the rendezvous still counts: each
        sync drops those whose keep-alive expired. None once another round began, or unknown
        (a torch whose private state reads otherwise)."""
        state = self._synced_state()  # one read: the keep-alive thread's sync replaces it
        torch_round = getattr(state, "round", None)
        participants = getattr(state, "participants", None)
        if (torch_round is None or torch_round != self._rendezvous_round
                or not isinstance(participants, dict)):
            return None
        return len(participants)

    def _poll(self, stop: threading.Event | None = None) -> None:
        now = time.monotonic()
        if now - self._checked_at < self.poll_s:
            return
        self._checked_at = now
        self._waiting = self._bounded(self.handler.num_nodes_waiting, stop=stop) > 0
        left = self._participants_left()  # synced just now, by num_nodes_waiting
        # A node that joins the next round also leaves this one's participants, and waits
        # there a sync later: only a node gone without waiting, two polls apart, is dropped.
        short = (self._round is not None and left is not None and not self._waiting
                 and left < len(self._round.nodes))
        self._short_polls = self._short_polls + 1 if short else 0
        if self._round is not None and self._peer_failure is None:
            said = self.announcement(f"failed/{self._round.number}", 0.0, stop)
            if said is not None:
                parts = said.split(" ", 1)
                self._peer_failure = parts[1] if len(parts) == 2 else "unknown"

    # -- the end of the job ---------------------------------------------------------------
    def _job_key(self, name: str) -> str:
        return f"ftmaster.{self.config.run_id}.{name}"

    def outcome(self, stop: threading.Event | None = None) -> str | None:
        """How the job ended, once a node said so (see :meth:`end_job`); bounded, and
        Abandoned on a stop, as :meth:`announcement` is."""
        return self.announcement("outcome", 0.0, stop)

    def end_job(self, outcome: str, stop: threading.Event | None = None) -> None:
        """Say how the job ended, close the rendezvous, then acknowledge it as every node
        does (:meth:`acknowledge`). Any node that ends the job closes: a peer already waiting
        in the next round's join learns of the end only from the close. Each store call is
        bounded, and ``stop`` cuts them short, as :meth:`announcement` explains: a store no
        packet reaches held the node's exit."""
        if self._round_store is None:
            return
        base, key = self._round_store.underlying_store, self._job_key("outcome")
        try:
            if not self._bounded(base.check, [key], stop=stop):
                self._bounded(base.set, key, outcome, stop=stop)
            self._bounded(self.handler.shutdown, stop=stop)
        except Abandoned:
            log.info("stopped closing the rendezvous at the end of the job")
            return
        except Exception as error:  # the job is over; a store gone now changes nothing
            log.info("rendezvous at the end of the job: %s", error)
            return
        self.acknowledge(stop)

    def stop_keep_alive(self) -> None:
        """Stop the handler's keep-alive thread and wait for it, before the interpreter exits.
        The thread calls torch's C++ store with the GIL released; CPython (before 3.14) ends a
        daemon thread that comes back for the GIL during finalization with pthread_exit, which
        aborts the process from inside that C++ frame ("terminate called without an active
        exception", SIGABRT) after the job ended well. torch elastic's own ``shutdown`` stops
        it the same way, but also closes the rendezvous, which only the end of the job may.
        Bounded: a keep-alive blocked on a store no packet reaches is left to it."""
        if self.handler is None:  # never connected: no keep-alive either
            return
        try:
            call_once_bounded("rendezvous-keep-alive-stop", KEEP_ALIVE_STOP_TIMEOUT_S,
                              self.handler._stop_heartbeats)
        except CallTimeout:
            log.info("the rendezvous keep-alive did not stop within %g s", KEEP_ALIVE_STOP_TIMEOUT_S)

    def acknowledge(self, stop: threading.Event | None = None) -> None:
        """Say this node read the job's outcome, then wait (bounded) until every node of the
        round has: whichever node hosts the store takes it away as it exits, and a peer that
        had not read the outcome by then took the lost store for a requeue (exit 75 after a
        give-up that said not to). A node that never completed a round (the job ended while
        it waited for its first) is not waited for, so has nothing to say. A stop ends the
        wait at once: SLURM's SIGKILL would end it before it recorded the job's end, and a
        peer stopped by the same scancel or time limit needs no outcome to stop."""
        if self._round_store is None:
            return
        base = self._round_store.underlying_store
        try:
            self._bounded(base.set, self._job_key(f"ack/{self.config.node_rank}"), "1", stop=stop)
            acks = [self._job_key(f"ack/{node.node_rank}") for node in self._round.nodes]
            if not self._all_said(acks, ACK_TIMEOUT_S, stop):
                log.info("not every node read the end of the job within %g s", ACK_TIMEOUT_S)
        except Abandoned:
            log.info("stopped waiting for the other nodes to read the end of the job")
        except Exception as error:  # the store's host read the end first and left with it
            log.info("rendezvous at the end of the job: %s", error)

    def _call(self, fn, *args):
        from torch.distributed.elastic.rendezvous import (RendezvousClosedError,
                                                          RendezvousConnectionError,
                                                          RendezvousError,
                                                          RendezvousGracefulExitError,
                                                          RendezvousTimeoutError)

        try:
            return fn(*args)
        except (RendezvousClosedError, RendezvousGracefulExitError):
            # The second, to a spare past --nnodes' maximum (on torch's redundancy list): the
            # job ended as it waited, which read as a lost store, exit 75, a requeue.
            raise JobEnded(self.outcome_after_close()) from None
        except RendezvousTimeoutError as error:  # torch's says nothing (an empty message)
            # Also when enough nodes waited, but the round in force was not left by a node
            # that still counts in it (one waiting with --policy wait): no count is claimed
            raise JoinTimedOut(str(error) or f"no round of at least {self.config.min_nodes} "
                               f"node(s) formed within join_timeout "
                               f"{self.config.seconds('join_timeout', 600):g} s") from None
        except (RendezvousConnectionError, RendezvousError, RuntimeError, TimeoutError,
                ConnectionError, CallTimeout, *_etcd_errors()) as error:
            raise StoreLost(f"the rendezvous store at {self.config.endpoint} is unreachable "
                            f"({store_failure(error)})") from None

    def outcome_after_close(self) -> str:
        try:
            found = self.outcome() if self._round_store is not None else None
        except StoreLost:
            found = None
        return found or UNTOLD_END
