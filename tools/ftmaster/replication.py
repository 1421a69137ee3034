"""Peer copies of a node-local memory tier: what makes a memory checkpoint outlive its node.

Across nodes without a memory folder given, each node's ranks save into the node's own
``/dev/shm`` folder (``ftmaster-<run>-node<R>-<id>``), and the trainer's rank 0 adds the
checkpoint's metadata, manifest and tracker to its own node's folder. Each node's ftmaster
serves its folder (:mod:`peer_files`) and, after each memory save of its ranks, pulls into
it, in the background:

- the shards the next ``replicas`` nodes' ranks wrote (in node-rank order, round the ring;
  a shard file names its writer's global rank, ``__<rank>_<n>.distcp``);
- the checkpoint's own files (metadata, common state, manifest) from the node of rank 0.

A node whose folder then holds every file of the manifest gets the manifest, last, and moves
its own tracker to the iteration: that copy loads on its own, under any layout (on 2 nodes
with one replica, both do). A node that is lost takes its own folder with it; a survivor
relaunched alone loads its copy. Everything copied is verified on arrival against the
manifest.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ftmaster.peer_files import (Copied, PeerClient, PeerError, PeerMissing, PeerServeConfig,
                                 PeerServer, fill_from_peer, manifest_files, write_peer_list)
from ftmaster.recovery.checkpoints import TRACKER_NAME, advance_tracker, iteration_dir, read_tracker
from ftmaster.recovery.manifest import MANIFEST_NAME, FileDigest, is_whole
from ftmaster.recovery.replicas import rank_dump_dir, report_path

log = logging.getLogger("ftmaster")

_WRITER = re.compile(r"__(\d+)_")
AUTHORIZE_WAIT_S = 10.0


def writer_rank(name: str) -> int | None:
    """The global rank that wrote a torch_dist shard file; None for the checkpoint's own
    files (rank 0's metadata and common state)."""
    match = _WRITER.match(name)
    return None if match is None else int(match[1])


def rank_ranges(ranks_per_node: Sequence[int]) -> list[range]:
    """The global ranks each node of a round runs (a node's ranks are contiguous)."""
    ends = list(itertools.accumulate(ranks_per_node))
    return [range(end - count, end) for end, count in zip(ends, ranks_per_node)]


@dataclass(frozen=True)
class ReplicationConfig:
    """How a node's memory tier is copied to and from its peers."""

    memory_dir: Path
    """This node's own memory folder, served to the peers and filled with their copies."""
    run_dir: Path
    """This node's run folder, where its ranks find the peers to read what they lack."""
    node_rank: int
    """This node's ``--node-rank``."""
    replicas: int = 1
    """``--memory-replicas``: how many peers' shards each node holds a copy of."""
    rate_bytes_s: float | None = None
    """``--replication-rate``: bytes per second this node serves, over all peers."""
    addr: str = "127.0.0.1"
    """The address this node serves at (its rendezvous address)."""
    timeout_s: float = 30.0
    """A copy whose peer sends nothing for this long fails (and the next save tries again)."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--memory-replicas must be at least 1, got {self.replicas}")


@dataclass(frozen=True)
class Peers:
    """Who this node copies from in the current round."""

    secret: str
    sources: tuple[tuple[int, str, range], ...]
    """(node rank, URL, the global ranks its trainers run) of each node whose shards this
    node holds copies of."""
    rank0: tuple[int, str] | None
    """The node of the trainer's rank 0 (node rank, URL): where the manifest is written;
    None when it is this node."""
    others: tuple[tuple[int, str], ...]
    """Every other node of the round that serves (node rank, URL)."""


@dataclass(frozen=True)
class Gathered:
    """One node's replica dumps, copied for the merge."""

    node_rank: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class ReplicationFailed:
    iteration: int
    reason: str


class Replication:
    """Serves this node's memory tier at once (refusing every request until the first round
    hands out the job's secret) and copies from its peers on a background thread."""

    def __init__(self, config: ReplicationConfig) -> None:
        self.config = config
        config.memory_dir.mkdir(parents=True, exist_ok=True)
        self.server = PeerServer(PeerServeConfig(config.memory_dir, None, config.addr,
                                                 rate_bytes_s=config.rate_bytes_s,
                                                 timeout_s=config.timeout_s))
        self._peers: Peers | None = None
        self._wanted: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve_saves, name="ftmaster-replication",
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return self.server.url

    def new_round(self, secret: str, nodes: Sequence, me: int, ranks_per_node: Sequence[int]) -> None:
        """The round's nodes (node records in node-rank order, this one at ``me``) and how
        many ranks each runs: the next ``replicas`` nodes with ranks are this node's sources."""
        self.server.authorize(secret)
        ranks = rank_ranges(ranks_per_node)
        active = [i for i, count in enumerate(ranks_per_node) if count]
        ring = [i for i in active if i > me] + [i for i in active if i < me]
        sources = tuple((nodes[i].node_rank, nodes[i].peer_url, ranks[i])
                        for i in ring[:self.config.replicas] if nodes[i].peer_url)
        first = active[0] if active else me
        rank0 = None if first == me else (nodes[first].node_rank, nodes[first].peer_url)
        others = tuple((node.node_rank, node.peer_url) for i, node in enumerate(nodes)
                       if i != me and node.peer_url)
        self._peers = Peers(secret, sources, rank0, others)
        write_peer_list(self.config.run_dir, secret, [url for _, url in others])

    def catch_up(self) -> list[tuple[int, Copied] | ReplicationFailed]:
        """Before a launch: the newest memory checkpoint any node of the round tracks, made
        whole here too, from the nodes that track it first, then the others. Every node's
        ranks can then load it, rank 0's included: a node that rejoins after missing saves
        needs it, and so does a rank-0 node whose folder lacks what a peer holds (copies
        still on their way when a GPU failed, or a node 0 replaced after a requeue). A node
        that holds it whole already copies nothing."""
        peers = self._peers
        if peers is None or not peers.others:
            return []
        trackers, done = self._peer_trackers(peers)
        own = read_tracker(self.config.memory_dir)
        target = max([*trackers.values(), *([] if own is None else [own])], default=None)
        if target is None or is_whole(iteration_dir(self.config.memory_dir, target)):
            return done
        holders = [peer for peer, iteration in trackers.items() if iteration == target]
        order = holders + [peer for peer in peers.others if peer not in holders]
        folder = iteration_dir(self.config.memory_dir, target)
        try:
            manifest = (self._client(holders[0][1], peers).read(f"{folder.name}/{MANIFEST_NAME}")
                        if holders else (folder / MANIFEST_NAME).read_bytes())
            for node_rank, url in order:
                copied = fill_from_peer(self._client(url, peers), target, self.config.memory_dir,
                                        manifest)
                if copied.bytes:
                    done.append((node_rank, copied))
                if not copied.missing:
                    advance_tracker(self.config.memory_dir, target)
                    break
        except (PeerError, OSError) as error:
            done.append(ReplicationFailed(target, str(error)))
        return done

    def gather_dumps(self, folder: Path, nodes: Sequence, ranks_per_node: Sequence[int]
                     ) -> list[Gathered | ReplicationFailed]:
        """Replica recovery across nodes: into ``folder`` (this node's dump folder of the
        failed round, whose ``nodes`` ran ``ranks_per_node``), the dumps of the same name of
        every other node still in the round: each rank's report, and then the files it
        lists, each verified against the report (a rank without a report died before it
        dumped). Returns what was copied, or why not."""
        peers, done = self._peers, []
        live = dict(peers.others)
        relative = folder.relative_to(self.config.memory_dir)
        for node, ranks in zip(nodes, rank_ranges(ranks_per_node)):
            node_rank, url = node.node_rank, live.get(node.node_rank)
            if url is None:
                continue  # this node, or one lost since
            client, started, fetched = self._client(url, peers), time.perf_counter(), 0
            try:
                for rank in ranks:
                    fetched += self._fetch_dump(client, relative, folder, rank)
            except (PeerError, OSError, ValueError) as error:
                done.append(ReplicationFailed(-1, f"node {node_rank}'s dumps: {error}"))
                continue
            done.append(Gathered(node_rank, fetched, time.perf_counter() - started))
        return done

    @staticmethod
    def _fetch_dump(client: PeerClient, relative: Path, folder: Path, rank: int) -> int:
        try:
            body = client.read(f"{relative}/{report_path(Path(), rank)}")
        except PeerMissing:
            return 0
        files = json.loads(body).get("files") or {}
        target = rank_dump_dir(folder, rank)
        target.mkdir(parents=True, exist_ok=True)
        for name, entry in files.items():
            if Path(name).name != name:
                raise ValueError(f"rank {rank}'s report names a file outside its dump: {name!r}")
            client.fetch(f"{relative}/{target.name}/{name}", target / name,
                         FileDigest(int(entry["bytes"]), str(entry["digest"])))
        report_path(folder, rank).write_bytes(body)  # last: the merge reads complete reports
        return len(body) + sum(int(entry["bytes"]) for entry in files.values())

    def _peer_trackers(self, peers: Peers) -> tuple[dict[tuple[int, str], int], list]:
        """Each serving peer's memory tracker (a peer without one is left out)."""
        trackers, failed = {}, []
        for peer in peers.others:
            try:
                trackers[peer] = int(self._client(peer[1], peers).read(TRACKER_NAME).strip())
            except PeerMissing:
                continue
            except (PeerError, ValueError) as error:
                failed.append(ReplicationFailed(-1, f"reading node {peer[0]}'s tracker: {error}"))
        return trackers, failed

    def used_bytes(self) -> int:
        """What this node's memory tier holds: its own checkpoints and its peers' copies."""
        total = 0
        for path in self.config.memory_dir.rglob("*"):
            try:
                total += path.stat().st_size if path.is_file() else 0
            except OSError:
                pass  # pruned meanwhile
        return total

    def saved(self, iteration: int) -> None:
        """This node's ranks completed a memory save of ``iteration``."""
        self._wanted.put(iteration)

    def take_results(self) -> list[tuple[int, Copied] | ReplicationFailed]:
        results = []
        while not self._results.empty():
            results.append(self._results.get_nowait())
        return results

    def close(self) -> None:
        self._wanted.put(None)
        self._thread.join(timeout=self.config.timeout_s)
        self.server.close()

    def _serve_saves(self) -> None:
        while (iteration := self._wanted.get()) is not None:
            while not self._wanted.empty():  # only the newest save is worth a copy
                newer = self._wanted.get_nowait()
                if newer is None:
                    return
                iteration = max(iteration, newer)
            peers = self._peers
            if peers is None or not peers.sources:
                continue
            try:
                self._copy(iteration, peers)
            except (PeerError, OSError) as error:
                self._results.put(ReplicationFailed(iteration, str(error)))
            except Exception as error:  # a copier that dies must still say why
                self._results.put(ReplicationFailed(iteration, f"{type(error).__name__}: {error}"))

    def _copy(self, iteration: int, peers: Peers) -> None:
        folder = iteration_dir(self.config.memory_dir, iteration)
        if peers.rank0 is None:
            manifest = (folder / MANIFEST_NAME).read_bytes()
        else:
            manifest = self._client(peers.rank0[1], peers).read(f"{folder.name}/{MANIFEST_NAME}")
        files = sorted(manifest_files(manifest, iteration, "the manifest"))
        if peers.rank0 is not None:
            own_files = [name for name in files if writer_rank(name) is None]
            self._results.put((peers.rank0[0], fill_from_peer(
                self._client(peers.rank0[1], peers), iteration, self.config.memory_dir,
                manifest, own_files)))
        for node_rank, url, ranks in peers.sources:
            shards = [name for name in files if writer_rank(name) in ranks]
            copied = fill_from_peer(self._client(url, peers), iteration, self.config.memory_dir,
                                    manifest, shards)
            self._results.put((node_rank, copied))
        if peers.rank0 is not None and (folder / MANIFEST_NAME).is_file():
            advance_tracker(self.config.memory_dir, iteration)  # this node's copy is whole

    def _client(self, url: str, peers: Peers) -> PeerClient:
        # Every node of the round has the secret; one may start serving with it a moment
        # after this one asks (rounds are taken up on each node at its own pace).
        return PeerClient(url, peers.secret, self.config.timeout_s,
                          unauthorized_wait_s=AUTHORIZE_WAIT_S)


