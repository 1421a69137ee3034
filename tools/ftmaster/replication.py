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
with one replica, both do). A node whose folder holds only some files keeps the manifest as
``HELD_MANIFEST_NAME``. Everything copied is verified on arrival against the manifest.

A memory checkpoint is complete when every file has a verified copy on a live node. Each
node publishes what it holds (:func:`holdings_of`) in the rendezvous store; the node of
rank 0 decides from the records of a new round's nodes which checkpoint is the newest
complete one (:func:`newest_complete`) and tells the others. Every node then makes that one
whole from the nodes that hold each file (:meth:`Replication.catch_up`), and the disk tier
persists it the same way when no node's folder is whole (3 nodes or more, one replica).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ftmaster.membership import StoreLost
from ftmaster.monitor.backends.bounded import STOP_POLL_S, Abandoned, call_while
from ftmaster.peer_files import (PEERS_FILE, Copied, PeerClient, PeerError, PeerMissing,
                                 PeerServeConfig, PeerServer, fill_from_peer, holds,
                                 manifest_files, none_served, write_manifest, write_peer_list)
from ftmaster.recovery.checkpoints import (advance_tracker, advance_tracker_locked,
                                           iteration_dir, kept_memory_checkpoints,
                                           list_iterations, mark_replicated, mark_whole,
                                           replicated_here, set_tracker, tracker_lock,
                                           unmark_replicated, unmark_whole)
from ftmaster.recovery.manifest import (HELD_MANIFEST_NAME, MALFORMED_JSON, MANIFEST_NAME,
                                        FileDigest, digest_bytes, file_digests,
                                        is_plain_file_name, known_manifest_name)
from ftmaster.recovery.replicas import (NoCut, Report, choose_cut, rank_dump_dir,
                                       read_reports, report_path)

log = logging.getLogger("ftmaster")

_WRITER = re.compile(r"__(\d+)_")
AUTHORIZE_WAIT_S = 10.0
HOLDINGS_KEPT = 3  # as many checkpoints as a node's tier keeps (persist.MEMORY_COPIES)
AGREE_TIMEOUT_S = 30.0  # how long a new round's nodes wait for each other's holdings
CATCH_UP_TRIES = 3
CATCH_UP_PAUSE_S = 2.0
"""A catch-up that a peer failed (a stall past its timeout, a reset connection) is tried
this many times in all, this far apart: given up, the node fails the round (the supervisor's
``_catch_up_failed``), since a resume from an older checkpoint would set aside every node's
copy of the agreed one."""
AGREEMENT_POLL_S = 2.0  # how often a node reads the holdings while training
MIN_RATE_MB_S = 0.01
"""The slowest ``--replication-rate``: a paced 64 KiB chunk per 6.6 s, within a peer's 30 s
timeout (a pace slower than a chunk per timeout completes no copy: :class:`PeerServeConfig`)."""


def writer_rank(name: str) -> int | None:
    """The global rank that wrote a torch_dist shard file; None for the checkpoint's own
    files (rank 0's metadata and common state)."""
    match = _WRITER.match(name)
    return None if match is None else int(match[1])


def rank_ranges(ranks_per_node: Sequence[int]) -> list[range]:
    """The global ranks each node of a round runs (a node's ranks are contiguous)."""
    ends = list(itertools.accumulate(ranks_per_node))
    return [range(end - count, end) for end, count in zip(ends, ranks_per_node)]


def holdings_of(memory_dir: Path) -> dict[str, dict]:
    """What this node's tier holds of its newest checkpoints, by iteration: the digest of the
    manifest (two timelines' checkpoints of one iteration differ), how many files it lists,
    and those here at their size (verified as they arrived, or written by the node's ranks).
    A folder without a manifest of either kind (a save under way) holds nothing yet. One the
    tier keeps (:func:`kept_memory_checkpoints`: the newest replicated one, say) is held
    however many newer ones there are: a new round's agreement may need it."""
    held, kept = {}, kept_memory_checkpoints(memory_dir)
    for iteration in list_iterations(memory_dir):
        if len(held) >= HOLDINGS_KEPT and iteration not in kept:
            continue
        folder = iteration_dir(memory_dir, iteration)
        manifest = known_manifest(folder)
        if manifest is None:
            continue
        try:
            files = manifest_files(manifest, iteration, str(folder))
        except PeerError:
            continue
        held[str(iteration)] = {"manifest": digest_bytes(manifest).digest, "total": len(files),
                                "files": sorted(name for name, expected in files.items()
                                                if _has_size(folder / name, expected.bytes))}
    return held


def known_manifest(folder: Path) -> bytes | None:
    """The manifest of a whole folder, else the one kept beside some of its files."""
    name = known_manifest_name(folder)
    try:
        return None if name is None else (folder / name).read_bytes()
    except OSError:  # pruned meanwhile
        return None


def _drop_unverified(folder: Path, files: dict[str, FileDigest]) -> None:
    """A folder without a manifest is a save under way, or one a kill tore: a slot claimed
    for a refill keeps the older checkpoint's bytes at the same names and sizes, which the
    agreed manifest's loads would take as its own (their checks fail, and the resume falls
    back, setting the agreed checkpoint aside on every node). Its files whose digest is not
    the manifest's are removed; a load reads those from the peers that hold them."""
    for name, expected in files.items():
        path = folder / name
        if path.exists() and not holds(path, expected):
            path.unlink()


def _taken(folder: Path) -> OSError:
    return FileNotFoundError(f"{folder} was taken by this node's trainer (a newer save's slot "
                             f"refill, pruning, or a resume setting it aside) before its copy "
                             f"ended")


def _reported_files(body: bytes, rank: int) -> dict[str, FileDigest]:
    """The files a peer's dump report lists, with their sizes and digests; ValueError when
    the report is not one (a peer of another version, or damaged in its memory)."""
    try:
        return file_digests(json.loads(body).get("files") or {})
    except MALFORMED_JSON:
        raise ValueError(f"rank {rank}'s report is not a dump report") from None


def _cut_ranks(folder: Path, bodies: list[bytes]) -> set[int] | None:
    """The ranks whose dumps the merge takes, by this node's reports in ``folder`` and the
    peers' ``bodies``: those of the newest complete cut (every report is copied, so the
    merge finds the same); None when there is none, and every file is copied for the
    merge to say why."""
    reports = read_reports(folder)
    for body in bodies:
        try:
            reports.append(Report.from_json(json.loads(body)))
        except MALFORMED_JSON:
            continue
    try:
        return set(choose_cut(reports).ranks)
    except NoCut:
        return None


def _let_go_if_stopped(stop: threading.Event, folder: Path) -> None:
    """Abandoned once ``stop`` is set, removing the gather's ``folder`` again: its caller
    removed it on letting go, maybe before the write this follows, which would outlive it."""
    if stop.is_set():
        shutil.rmtree(folder, ignore_errors=True)
        raise Abandoned("stopped gathering the dumps")


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


@dataclass(frozen=True)
class Agreed:
    """The newest memory checkpoint every file of which a live node holds."""

    iteration: int
    manifest: str
    """The digest of its manifest."""
    holders: dict[str, tuple[int, ...]]
    """Each file's holders (node ranks)."""

    def to_json(self) -> str:
        return json.dumps({"iteration": self.iteration, "manifest": self.manifest,
                           "holders": self.holders})

    @classmethod
    def from_json(cls, text: str | None) -> "Agreed | None":
        """None for none agreed, or a record that cannot be read."""
        try:
            body = json.loads(text) if text else None
            if body is None:
                return None
            return cls(int(body["iteration"]), str(body["manifest"]),
                       {str(name): tuple(int(n) for n in nodes)
                        for name, nodes in body["holders"].items()})
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


def newest_complete(records: dict[int, str | None], copies: int = 1) -> Agreed | None:
    """From each live node's published holdings (JSON of :func:`holdings_of`, by node rank;
    None or unreadable for a node that published none), the newest checkpoint whose every
    file ``copies`` nodes hold; None when there is none. Two timelines' checkpoints of one
    iteration are told apart by their manifests."""
    found: dict[tuple[int, str], tuple[int, dict[str, list[int]]]] = {}
    for node_rank, text in sorted(records.items()):
        try:
            held = json.loads(text) if text else {}
            entries = [(int(it), str(e["manifest"]), int(e["total"]), list(e["files"]))
                       for it, e in held.items()]
        except (ValueError, TypeError, KeyError, AttributeError):
            log.warning("node %d's memory holdings cannot be read; counting none", node_rank)
            continue
        for iteration, manifest, total, names in entries:
            _, files = found.setdefault((iteration, manifest), (total, {}))
            for name in names:
                files.setdefault(str(name), []).append(node_rank)
    def rank(key: tuple[int, str]) -> tuple:
        # Two timelines' checkpoints of one iteration, both complete: the one more nodes
        # hold (a node left standing by through a rollback keeps the discarded one)
        nodes = {node for holders in found[key][1].values() for node in holders}
        return key[0], len(nodes), key[1]

    complete = [key for key, (total, files) in found.items() if len(files) == total
                and all(len(holders) >= copies for holders in files.values())]
    if not complete:
        return None
    iteration, manifest = max(complete, key=rank)
    holders = found[(iteration, manifest)][1]
    return Agreed(iteration, manifest, {name: tuple(nodes) for name, nodes in holders.items()})


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
        self._folder_lock = threading.Lock()  # a copy and a catch-up fill one folder in turn
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
        while not self._wanted.empty():  # the last round's saves: the new round agrees anew
            if self._wanted.get_nowait() is None:
                self._wanted.put(None)
                break
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
        try:
            write_peer_list(self.config.run_dir, secret, [url for _, url in others])
        except OSError as error:  # a full run folder: the copies go on, loads read what is here
            log.warning("cannot write %s (%s): this node's ranks may not read from its peers",
                        Path(self.config.run_dir) / PEERS_FILE, error.strerror or error)

    def catch_up(self, agreed: Agreed | None, chooses: bool,
                 stop: threading.Event | None = None) -> list[tuple[int, Copied] | ReplicationFailed]:
        """Before a launch: the checkpoint the round agreed on made loadable here, so every
        node's ranks load it, rank 0's included, and its tracker set to it. What every rank's
        load opens on its own node comes from the live nodes that hold it (those holding the
        most first), verified: the checkpoint's own files (metadata, common state), then its
        manifest. The shards this node lacks are left to the load, which reads from the peers
        only the items its layout needs, each checked against the manifest; without item
        checksums (a checkpoint merged from replicas) every file is copied. A node that
        rejoins after missing saves needs this, and so does a rank-0 node whose folder lacks
        what its peers hold. The tracker is set where the load ``chooses`` (the node of rank
        0); elsewhere it moves only to a whole copy, since it keeps that copy from pruning. A
        peer's failure is tried again (:data:`CATCH_UP_TRIES`), unless ``stop`` is set.
        Abandoned once ``stop`` is set, a failed try too (the stop ended the tries, not the
        peer: no round should fail for it), within :data:`STOP_POLL_S` even while a peer
        stalls a fetch (which only its timeout ends): that try is left to its daemon thread,
        which, holding the folder's lock until it ends, tries no more."""
        peers, stop = self._peers, stop or threading.Event()
        if agreed is None or peers is None:
            return []
        return call_while("ftmaster-catch-up", lambda: not stop.is_set(), STOP_POLL_S,
                          self._catch_up_tries, agreed, peers, chooses, stop)

    def _catch_up_tries(self, agreed: Agreed, peers: Peers, chooses: bool,
                        stop: threading.Event) -> list[tuple[int, Copied] | ReplicationFailed]:
        done: list[tuple[int, Copied] | ReplicationFailed] = []
        with self._folder_lock:
            for tries_left in reversed(range(CATCH_UP_TRIES)):
                try:
                    self._catch_up(agreed, peers, chooses, done)
                    break
                except PeerError as error:  # what was copied is kept: the next try resumes
                    if tries_left and not stop.is_set():
                        log.warning("catching up on memory checkpoint %d: %s; trying again",
                                    agreed.iteration, error)
                        if not stop.wait(CATCH_UP_PAUSE_S):
                            continue
                    if stop.is_set():
                        raise Abandoned(f"stopped catching up on memory checkpoint "
                                        f"{agreed.iteration}") from None
                    done.append(ReplicationFailed(agreed.iteration, str(error)))
                    break
        return done

    def _catch_up(self, agreed: Agreed, peers: Peers, chooses: bool,
                  done: list[tuple[int, Copied] | ReplicationFailed]) -> None:
        """One try of :meth:`catch_up`, adding to ``done``; PeerError from a peer that failed."""
        memory, folder = self.config.memory_dir, iteration_dir(self.config.memory_dir,
                                                                agreed.iteration)
        live = dict(peers.others)
        try:
            manifest = self._agreed_manifest(agreed, folder, live, peers)
            # No tracker_lock around the check and the rename: no other writer can act on
            # the tier now. Every way into a round kills this node's attempt and waits for
            # its ranks (their session's forked writers SIGKILLed too); the peers only read
            # the folder; this node's copies wait on _folder_lock; the replica merge ended
            # before the round was planned. A persist copy may still run, but it only reads:
            # it checks each file's digest, and its manifest before it lands.
            files = manifest_files(manifest, agreed.iteration, "the agreed manifest")
            own = known_manifest(folder)
            if own not in (None, manifest):
                folder.rename(folder.with_name(f"{folder.name}.discarded-{time.time_ns()}"))
            elif own is None:
                _drop_unverified(folder, files)
            whole_files = not json.loads(manifest).get("items")  # loads check files whole
            needed = [name for name in agreed.holders
                      if whole_files or writer_rank(name) is None]
            unread = []
            for node_rank in self._holders_by_count(agreed, live):
                names = [name for name in needed if node_rank in agreed.holders[name]]
                try:
                    copied = fill_from_peer(self._client(live[node_rank], peers),
                                            agreed.iteration, memory, manifest, names)
                except PeerError as error:  # the next holder may serve what this one did not
                    unread.append(f"node {node_rank}: {error}")
                    continue
                if copied.bytes:
                    done.append((node_rank, copied))
            complete = all(_has_size(folder / name, files[name].bytes) for name in needed)
            if not complete and unread:
                raise PeerError("; ".join(unread))
            if complete:
                write_manifest(folder, manifest)
                if chooses:
                    set_tracker(memory, agreed.iteration)
                elif all(_has_size(folder / name, e.bytes) for name, e in files.items()):
                    advance_tracker(memory, agreed.iteration)
            else:
                done.append(ReplicationFailed(agreed.iteration, "the live nodes no longer hold "
                                              "every file of the agreed checkpoint"))
        except OSError as error:  # this node's own folder: trying again would not help
            done.append(ReplicationFailed(agreed.iteration, str(error)))

    @staticmethod
    def _holders_by_count(agreed: Agreed, live: dict[int, str]) -> list[int]:
        counts: dict[int, int] = {}
        for nodes in agreed.holders.values():
            for node_rank in nodes:
                counts[node_rank] = counts.get(node_rank, 0) + 1
        return sorted((n for n in counts if n in live), key=lambda n: (-counts[n], n))

    def _agreed_manifest(self, agreed: Agreed, folder: Path, live: dict[int, str],
                         peers: Peers) -> bytes:
        """The agreed manifest: this node's own copy, else a holder's (either kind)."""
        own = known_manifest(folder)
        if own is not None and digest_bytes(own).digest == agreed.manifest:
            return own
        unread = []
        for node_rank in self._holders_by_count(agreed, live):
            client = self._client(live[node_rank], peers)
            for name in (MANIFEST_NAME, HELD_MANIFEST_NAME):
                try:
                    body = client.read(f"{folder.name}/{name}")
                except PeerMissing:
                    continue
                except PeerError as error:  # unreachable: another holder may serve it
                    unread.append(f"node {node_rank}: {error}")
                    break
                if digest_bytes(body).digest == agreed.manifest:
                    return body
        raise PeerError(f"no live node serves the manifest of iteration {agreed.iteration}"
                        + (f" ({'; '.join(unread)})" if unread else ""))

    def fetcher(self, agreed: Agreed):
        """For persisting ``agreed`` from the nodes that hold each file: a function that
        fetches one file, verified, into a path (PeerError when no live holder has it)."""
        peers = self._peers
        live = dict(peers.others) if peers is not None else {}
        relative = iteration_dir(Path(), agreed.iteration).name

        def fetch(name: str, dest: Path, expected: FileDigest) -> None:
            failures = []
            for node_rank in (n for n in agreed.holders.get(name, ()) if n in live):
                try:
                    self._client(live[node_rank], peers).fetch(f"{relative}/{name}", dest, expected)
                    return
                except PeerError as error:
                    failures.append(error)
            raise none_served(name, failures)
        return fetch

    def gather_dumps(self, folder: Path, nodes: Sequence, ranks_per_node: Sequence[int],
                     stop: threading.Event | None = None) -> list[Gathered | ReplicationFailed]:
        """Replica recovery across nodes: into ``folder`` (this node's dump folder of the
        failed round, whose ``nodes`` ran ``ranks_per_node``), the dumps of the same name of
        every other node still in the round: each rank's report, and then the files it
        lists, each verified against the report (a rank without a report died before it
        dumped). Returns what was copied, or why not. Abandoned once ``stop`` is set (dumps
        sent at ``--replication-rate``, or by a peer no packet reaches, outlast SLURM's grace
        period), and ``folder`` removed: the dumps are of use to no other. The fetch under
        way is left to its daemon thread, which starts no other and removes the folder again
        after any write it still makes."""
        stop = stop or threading.Event()  # none: the peers' timeouts alone bound the gather
        try:
            return call_while("ftmaster-replica-gather", lambda: not stop.is_set(), STOP_POLL_S,
                              self._gather_dumps, folder, nodes, ranks_per_node, stop)
        except Abandoned:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def _gather_dumps(self, folder: Path, nodes: Sequence, ranks_per_node: Sequence[int],
                      stop: threading.Event) -> list[Gathered | ReplicationFailed]:
        """Every rank's report first, then the files of the ranks the merge takes: the cut is
        chosen from the reports alone, and every replica's files (every DP rank's model and
        optimizer state) came over to rank 0's ``/dev/shm`` before, for one of each shard."""
        peers, done = self._peers, []
        live = dict(peers.others)
        relative = folder.relative_to(self.config.memory_dir)
        reached = []
        for node, ranks in zip(nodes, rank_ranges(ranks_per_node)):
            url = live.get(node.node_rank)
            if url is None:
                continue  # this node, or one lost since
            client, started = self._client(url, peers), time.perf_counter()
            try:
                reports = {rank: body for rank in ranks
                           if (body := self._read_report(client, relative, rank, stop, folder))}
            except (PeerError, OSError, ValueError) as error:
                done.append(ReplicationFailed(-1, f"node {node.node_rank}'s dumps: {error}"))
                continue
            reached.append((node.node_rank, client, reports, time.perf_counter() - started))
        taken = _cut_ranks(folder, [body for *_, reports, _ in reached for body in reports.values()])
        for node_rank, client, reports, seconds in reached:
            started = time.perf_counter()
            try:
                fetched = sum(self._fetch_dump(client, relative, folder, rank, body, stop,
                                               taken is None or rank in taken)
                              for rank, body in reports.items())
            except (PeerError, OSError, ValueError) as error:
                done.append(ReplicationFailed(-1, f"node {node_rank}'s dumps: {error}"))
                continue
            done.append(Gathered(node_rank, fetched, seconds + time.perf_counter() - started))
        return done

    @staticmethod
    def _read_report(client: PeerClient, relative: Path, rank: int, stop: threading.Event,
                     folder: Path) -> bytes | None:
        """A peer rank's dump report; None when it has none (it died before it dumped)."""
        _let_go_if_stopped(stop, folder)
        try:
            body = client.read(f"{relative}/{report_path(Path(), rank)}")
        except PeerMissing:
            return None
        _reported_files(body, rank)  # ValueError: not a dump report
        return body

    @staticmethod
    def _fetch_dump(client: PeerClient, relative: Path, folder: Path, rank: int, body: bytes,
                    stop: threading.Event, with_files: bool) -> int:
        """The rank's files, when the merge takes them, then its report."""
        files = _reported_files(body, rank) if with_files else {}
        target = rank_dump_dir(folder, rank)
        target.mkdir(exist_ok=True)  # never the folder itself, which a stop removed
        _let_go_if_stopped(stop, folder)
        for name, entry in files.items():
            if not is_plain_file_name(name):
                raise ValueError(f"rank {rank}'s report names a file outside its dump: {name!r}")
            client.fetch(f"{relative}/{target.name}/{name}", target / name, entry)
            _let_go_if_stopped(stop, folder)
        report_path(folder, rank).write_bytes(body)  # last: the merge reads complete reports
        _let_go_if_stopped(stop, folder)
        return len(body) + sum(entry.bytes for entry in files.values())

    def used_bytes(self) -> int:
        """What this node's memory tier holds: its own checkpoints and its peers' copies.

        The ranks prune and rename folders while this walks them: ``os.walk`` skips a folder
        gone before it is listed (``Path.rglob`` raised, and took the supervisor down)."""
        total = 0
        for folder, _, names in os.walk(self.config.memory_dir):
            for name in names:
                try:
                    total += os.stat(os.path.join(folder, name)).st_size
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
            if peers is not None and not peers.sources:
                # Nothing to copy (a round of one node): no newer copy is in flight, and an
                # older mark would keep its checkpoint from the refills and pruning for good.
                unmark_whole(self.config.memory_dir)
            if peers is None or not peers.sources:
                continue
            try:
                with self._folder_lock:
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
        listed = manifest_files(manifest, iteration, "the manifest")
        self._hold_manifest(folder, manifest)
        try:
            self._fill(iteration, peers, manifest, sorted(listed))
        except FileNotFoundError:
            if folder.is_dir():
                raise
            raise _taken(folder) from None
        if peers.rank0 is not None:
            self._track_whole_copy(folder, iteration)
        if all(_has_size(folder / name, expected.bytes) for name, expected in listed.items()):
            # Kept from the trainer's next slot refill: on the node of rank 0 the tracker
            # names the newest save, whole here or not.
            mark_whole(self.config.memory_dir, iteration)

    def _hold_manifest(self, folder: Path, manifest: bytes) -> None:
        """The manifest beside this node's part, for the peers to read what to copy or
        persist. Under the tier's lock, as the trainer takes a slot to refill it or prunes:
        a copy that outlasted two memory saves finds its folder taken, and must not make it
        again (around the held manifest, then filled with peer copies nothing loads)."""
        with tracker_lock(self.config.memory_dir):
            if not folder.is_dir():
                raise _taken(folder)
            if not (folder / MANIFEST_NAME).is_file():
                write_manifest(folder, manifest, HELD_MANIFEST_NAME)

    def _fill(self, iteration: int, peers: Peers, manifest: bytes, files: list[str]) -> None:
        """Rank 0's files from its node, then the shards of this node's sources; into the
        folder this node's ranks saved, never made again once the trainer took it."""
        if peers.rank0 is not None:
            own_files = [name for name in files if writer_rank(name) is None]
            self._report(peers.rank0[0], fill_from_peer(
                self._client(peers.rank0[1], peers), iteration, self.config.memory_dir,
                manifest, own_files, make_folder=False))
        for node_rank, url, ranks in peers.sources:
            shards = [name for name in files if writer_rank(name) in ranks]
            self._report(node_rank, fill_from_peer(self._client(url, peers), iteration,
                                                   self.config.memory_dir, manifest, shards,
                                                   make_folder=False))

    def _track_whole_copy(self, folder: Path, iteration: int) -> None:
        """This node's copy is whole: its tracker names it (and so keeps it). The check and
        the move under the tier's lock, as the trainer takes a slot to refill it: taken in
        between, the tracker named a folder gone."""
        with tracker_lock(self.config.memory_dir):
            if (folder / MANIFEST_NAME).is_file():
                advance_tracker_locked(self.config.memory_dir, iteration)
                (folder / HELD_MANIFEST_NAME).unlink(missing_ok=True)

    def _report(self, node_rank: int, copied: Copied) -> None:
        """A copy that got nothing because the peer holds none of what it lacked any more (a
        slot refilled, a checkpoint pruned) is a failed copy, not a ``replicated`` event."""
        if copied.missing and not copied.bytes:
            self._results.put(ReplicationFailed(copied.iteration, (
                f"node {node_rank} no longer holds {', '.join(copied.missing)}")))
        else:
            self._results.put((node_rank, copied))

    def _client(self, url: str, peers: Peers) -> PeerClient:
        # Every node of the round has the secret; one may start serving with it a moment
        # after this one asks (rounds are taken up on each node at its own pace).
        return PeerClient(url, peers.secret, self.config.timeout_s,
                          unauthorized_wait_s=AUTHORIZE_WAIT_S)


class MemoryAgreement:
    """Which memory checkpoint is complete on the live nodes, agreed through the rendezvous
    store: each node publishes its holdings per round (``memory/<round>/<node rank>``); the
    deciding node (that of rank 0) reads those of the round's nodes and announces the newest
    complete checkpoint (``memory_agreed/<round>``), which every node then loads.

    Every store call it makes is Abandoned once ``stop`` is set (a signal to ftmaster): a
    store no packet reaches holds one for the store's timeout, past SLURM's grace period."""

    def __init__(self, membership, replication: Replication,
                 stop: threading.Event | None = None) -> None:
        self.membership, self.replication, self.stop = membership, replication, stop
        self._read_at, self._read = (None, float("-inf")), {}  # (round, time), the records
        self._decided_on = self._read_at  # the read the deciding node last named one from
        self._told: tuple | None = None  # (round, iteration, manifest) it last announced
        self._polled_at = self._read_at  # when another node last read the announcement

    def publish(self, round_number: int) -> None:
        """Say what this node's tier holds now (after a copy, a catch-up, a merge)."""
        held = holdings_of(self.replication.config.memory_dir)
        self.membership.announce(f"memory/{round_number}/{self.replication.config.node_rank}",
                                 json.dumps(held), self.stop)

    def decide(self, round_number: int, node_ranks: Sequence[int], decides: bool,
               decider_busy_s: float = 0.0) -> Agreed | None:
        """At the start of a round, after :meth:`publish`: the agreed checkpoint, or None (no
        memory checkpoint is complete: the relaunch loads from disk). A node that does not
        decide also waits ``decider_busy_s``, what the deciding node may spend before it
        decides (a replica merge): given up sooner, the wait read as "none agreed", and the
        node launched without the checkpoint every other node loads."""
        word = f"memory_agreed/{round_number}"
        if not decides:
            return Agreed.from_json(self.membership.announcement(
                word, 2 * AGREE_TIMEOUT_S + decider_busy_s, self.stop))
        agreed = newest_complete(self._records(round_number, node_ranks, AGREE_TIMEOUT_S))
        self.membership.announce(word, agreed.to_json() if agreed is not None else "none",
                                 self.stop)
        return agreed

    def current(self, round_number: int, node_ranks: Sequence[int]) -> Agreed | None:
        """While training: the newest complete checkpoint from the holdings published so far
        (read at most every ``AGREEMENT_POLL_S``)."""
        return newest_complete(self._recent(round_number, node_ranks))

    def keep_replicated(self, round_number: int, node_ranks: Sequence[int], decides: bool) -> None:
        """While training, on every node of a round of more than ``replicas`` + 1 nodes: mark
        the newest checkpoint that outlives the loss of any ``replicas`` of them (every file
        on ``replicas`` + 1 nodes, :func:`mark_replicated`) where this node holds a part of it,
        or let go of the mark where it holds none. Until one is, the mark stays where it is:
        it keeps the checkpoint a loss would resume from. (With fewer nodes a replicated
        checkpoint is whole on every node, and its ``.ftmaster_whole`` mark keeps it.)

        The deciding node (that of rank 0, which reads every node's holdings anyway)
        announces which one it is (``memory_replicated/<round>``) when it changes; the others
        read that one key, at most every ``AGREEMENT_POLL_S``: every node reading every
        node's holdings would cost the store N x N reads a poll. A store or a tier that
        fails here leaves the mark as it is (said as a warning)."""
        try:
            if len(node_ranks) <= self.replication.config.replicas + 1:
                if self._polled_at[0] != round_number:  # once a round: a round that shrank
                    unmark_replicated(self.replication.config.memory_dir)
                    self._polled_at = (round_number, time.monotonic())
                return
            newest = (self._decide_replicated(round_number, node_ranks) if decides
                      else self._announced_replicated(round_number))
            if newest is not None:
                self._keep(*newest)
        except (StoreLost, OSError) as error:
            log.warning("keeping the replicated memory checkpoint: %s", error)

    def _decide_replicated(self, round_number: int, node_ranks: Sequence[int]
                           ) -> tuple[int, str] | None:
        records = self._recent(round_number, node_ranks)
        if self._decided_on == self._read_at:
            return None
        self._decided_on = self._read_at
        newest = newest_complete(records, self.replication.config.replicas + 1)
        if newest is None:
            return None
        told = (round_number, newest.iteration, newest.manifest)
        if told != self._told:
            self.membership.announce(f"memory_replicated/{round_number}", json.dumps(
                {"iteration": newest.iteration, "manifest": newest.manifest}), self.stop)
            self._told = told
        return newest.iteration, newest.manifest

    def _announced_replicated(self, round_number: int) -> tuple[int, str] | None:
        now = time.monotonic()
        if self._polled_at[0] == round_number and now - self._polled_at[1] < AGREEMENT_POLL_S:
            return None
        self._polled_at = (round_number, now)
        text = self.membership.announcement(f"memory_replicated/{round_number}", 0.0, self.stop)
        try:
            announced = json.loads(text or "null")
            return int(announced["iteration"]), str(announced["manifest"])
        except (ValueError, TypeError, KeyError):
            return None  # none announced yet (or unreadable): the mark stays

    def _keep(self, iteration: int, manifest: str) -> None:
        memory_dir = self.replication.config.memory_dir
        if replicated_here(memory_dir) == iteration:
            return
        held = known_manifest(iteration_dir(memory_dir, iteration))
        if held is None or digest_bytes(held).digest != manifest \
                or not mark_replicated(memory_dir, iteration):
            unmark_replicated(memory_dir)

    def _recent(self, round_number: int, node_ranks: Sequence[int]) -> dict[int, str | None]:
        now = time.monotonic()
        if self._read_at[0] != round_number or now - self._read_at[1] >= AGREEMENT_POLL_S:
            self._read_at = (round_number, now)
            try:
                self._read = self._records(round_number, node_ranks, 0.0)
            except (StoreLost, Abandoned) as lost:
                # the end of a run, a stopped one too, persists what it can without it
                log.warning("reading the memory holdings: %s", lost)
                self._read = {}
        return self._read

    def outdated(self) -> None:
        """The last holdings read named a checkpoint the peers have pruned since: the next
        :meth:`current` reads them again."""
        self._read_at = (None, float("-inf"))

    def _records(self, round_number: int, node_ranks: Sequence[int],
                 timeout_s: float) -> dict[int, str | None]:
        deadline = time.monotonic() + timeout_s
        return {node_rank: self.membership.announcement(
                    f"memory/{round_number}/{node_rank}", max(0.0, deadline - time.monotonic()),
                    self.stop)
                for node_rank in node_ranks}
