"""Memory checkpoints copied between nodes: a read-only file server each node's ftmaster runs
over its memory tier, the client its peers read it with, and the copy of one checkpoint.

The transport is the standard library's HTTP/1.1 (``http.server`` and ``http.client``): the
supervisor stays torch-free, and a copy is a few large sequential reads, which HTTP does at
the link's speed. What makes it safe to run beside training:

- **Read-only.** GET and HEAD only, on regular files under the served folder; a path that
  leaves it (``..``, a symlink out) is not found. Nothing lists the folder: a reader starts
  from the tracker and the manifest, whose names it knows.
- **The job's secret.** Every request carries ``Authorization: Bearer <secret>``; one without
  it, or with another, is refused (401) before the path is even looked at. The secret is
  drawn once per job and handed out through the rendezvous store (:mod:`membership`), which
  is the job's trust boundary already (torch's own store is unauthenticated).
- **Range reads** (``Range: bytes=A-B``, one range, 206), so a load can read only the byte
  ranges its new shards need.
- **Bounded.** Sockets time out on both sides (``timeout_s``), and everything the server
  sends passes one rate limit (``--replication-rate``), so copies never take the link from
  training's own traffic.

:func:`fill_from_peer` brings what a memory checkpoint's folder lacks from a peer: every
file its manifest lists, each streamed to a temp file (:func:`ftmaster.runfiles.atomic_file`),
checked against the manifest's size and xxh3 digest, and renamed into place; the manifest lands last, so a copy that has one is
whole and verified, as a checkpoint written in place is. :func:`copy_checkpoint` does the
same from the peer's own manifest.
"""

from __future__ import annotations

import hmac
import http.client
import http.server
import io
import json
import logging
import math
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence
from urllib.parse import quote, unquote, urlsplit

import xxhash

from ftmaster.addresses import allow_ipv4_too, bind_address, host_port
from ftmaster.recovery.checkpoints import iteration_dir, tracker_lock
from ftmaster.recovery.manifest import (CHECKSUM, MALFORMED_JSON, MANIFEST_NAME, FileDigest,
                                        Manifest, digest_bytes, digest_file, file_digests,
                                        is_plain_file_name, size_problem)
from ftmaster.runfiles import atomic_file, atomic_write_text

log = logging.getLogger("ftmaster")

_CHUNK = 1 << 20
_PACED_CHUNK = 64 << 10
_LEAST_PACED_STEP = 1 << 10
_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


def new_secret() -> str:
    return secrets.token_hex(32)


@dataclass(frozen=True)
class PeerServeConfig:
    """How a node serves its memory tier to its peers."""

    root: Path
    """The folder served: the files under it, read-only."""
    secret: str | None
    """The job's secret; a request without it is refused. None refuses every request until
    :meth:`PeerServer.authorize` (a node serves before the rendezvous hands out the secret,
    so that its address can be published in the round)."""
    addr: str = "127.0.0.1"
    """The address to bind: the one the node's peers reach it at (its rendezvous address)."""
    port: int = 0
    """0: a free port, read back from :attr:`PeerServer.url`."""
    rate_bytes_s: float | None = None
    """``--replication-rate``: bytes per second sent, over all requests; None: no limit."""
    timeout_s: float = 30.0
    """A connection that sends or takes nothing for this long is closed."""

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < 32:
            raise ValueError("the job's secret must have at least 32 characters")
        if self.timeout_s <= 0:
            raise ValueError(f"the timeout must be positive, got {self.timeout_s}")
        # Slower, every paced read timed out at its first chunk, and the pace's sleep
        # overflowed (a traceback per request) below 1e-288 bytes/s
        if self.rate_bytes_s is not None and not self.rate_bytes_s * self.timeout_s >= _PACED_CHUNK:
            raise ValueError(f"the replication rate must send a {_PACED_CHUNK >> 10} KiB chunk "
                             f"within the {self.timeout_s:g} s timeout: at least "
                             f"{math.ceil(_PACED_CHUNK / self.timeout_s)} bytes/s, got "
                             f"{self.rate_bytes_s:g}")


class RateLimit:
    """A token bucket shared by every request: at most ``rate`` bytes per second, with bursts
    of a quarter second's worth."""

    def __init__(self, rate_bytes_s: float | None) -> None:
        self.rate = rate_bytes_s
        self._lock = threading.Lock()
        self._tokens = 0.0
        self._at = time.monotonic()

    def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may go. Each sender books its bytes under the lock and waits
        outside it, so senders go in the order they asked, as on a link: one that slept
        holding the lock (which is not fair) held every other up, past a peer's timeout."""
        if self.rate is None:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate / 4, self._tokens + (now - self._at) * self.rate)
            self._at = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate
        if wait > 0:
            time.sleep(wait)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.timeout = self.server.config.timeout_s
        super().setup()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        pass  # one line per request would flood the supervisor's log

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        given, secret = self.headers.get("Authorization", ""), self.server.secret
        if secret is None or not hmac.compare_digest(given.encode(), f"Bearer {secret}".encode()):
            return self._refuse(401, "the job's secret is required")
        path = self.server.resolve(unquote(urlsplit(self.path).path))
        try:
            handle = open(path, "rb") if path is not None else None
        except OSError:  # renamed or removed since (a slot reused, a checkpoint pruned)
            handle = None
        if handle is None:
            return self._refuse(404, "no such file")
        with handle:
            size = os.fstat(handle.fileno()).st_size
            wanted = self._range(size)
            if wanted is None:
                return self._refuse(416, f"the file has {size} bytes")
            start, end = wanted
            self.send_response(206 if "Range" in self.headers else 200)
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            if "Range" in self.headers:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.end_headers()
            if body:
                self._send(handle, start, end)

    def _range(self, size: int) -> tuple[int, int] | None:
        """[start, end) of the one range asked for, the whole file without one; None if the
        range cannot be served."""
        asked = self.headers.get("Range")
        if asked is None:
            return 0, size
        match = _RANGE.match(asked.strip())
        if match is None:
            return None
        start = int(match[1])
        end = min(size, int(match[2]) + 1) if match[2] else size
        return (start, end) if start < end or (start == end == size == 0) else None

    def _send(self, handle, start: int, end: int) -> None:
        # Paced in small steps under a rate limit: each request's next bytes then wait for
        # the others' steps, not their whole chunks. A step is at most a tenth of a second's
        # worth: at a low rate N readers each waited N steps between their bytes (at 0.01
        # MB/s, five loads reading at once timed out at 30 s)
        rate = self.server.limit.rate
        step = _CHUNK if rate is None else max(_LEAST_PACED_STEP, min(_PACED_CHUNK, int(rate / 10)))
        handle.seek(start)
        while start < end:
            chunk = handle.read(min(step, end - start))
            if not chunk:
                raise OSError("the file shrank while it was sent")
            self.server.limit.take(len(chunk))
            self.wfile.write(chunk)
            start += len(chunk)

    def _refuse(self, status: int, reason: str) -> None:
        payload = (reason + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, config: PeerServeConfig) -> None:
        self.config, self.secret = config, config.secret
        self.root = config.root.resolve()
        self.limit = RateLimit(config.rate_bytes_s)
        self.address_family, address = bind_address(config.addr, config.port)
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        allow_ipv4_too(self.socket)
        super().server_bind()

    def handle_error(self, request, client_address) -> None:
        log.debug("peer files: a request from %s broke off", client_address, exc_info=True)

    def resolve(self, url_path: str) -> Path | None:
        """The regular file under the root that ``url_path`` names, or None."""
        try:
            path = (self.root / url_path.lstrip("/")).resolve(strict=True)
        except (OSError, RuntimeError, ValueError):  # ValueError: a NUL byte in the path
            return None
        inside = path == self.root or self.root in path.parents
        return path if inside and path.is_file() else None


class PeerServer:
    """A node's memory tier, served to its peers from a background thread."""

    def __init__(self, config: PeerServeConfig) -> None:
        self._server = _Server(config)
        host, port = self._server.server_address[:2]
        self.url = f"http://{host_port(host, port)}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,),
                                        name="peer-files", daemon=True)
        self._thread.start()

    def authorize(self, secret: str) -> None:
        """Serve requests that carry ``secret`` from now on."""
        if len(secret) < 32:
            raise ValueError("the job's secret must have at least 32 characters")
        self._server.secret = secret

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class PeerError(Exception):
    """A peer could not give what was asked: unreachable, refused, or bytes that do not match."""


class PeerMissing(PeerError):
    """The peer does not hold that file (404)."""


class PeerUnauthorized(PeerError):
    """The peer refused the secret (401)."""


class PeerPastEnd(PeerError):
    """The range asked for starts at or past the file's end (416)."""


CONNECT_TIMEOUT_S = 5.0
"""How long a peer may take to accept a connection. A live one on the job's network does in
milliseconds (a lost SYN is resent after 1 s); a dead host that drops SYNs (no reset) held
each load for the whole read timeout before the next peer was asked."""


class PeerClient:
    """Reads files from one peer's server, with the job's secret and bounded timeouts."""

    def __init__(self, url: str, secret: str, timeout_s: float = 30.0,
                 unauthorized_wait_s: float = 0.0,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise ValueError(f"a peer's address is http://HOST:PORT, got {url!r}")
        self.url, self._host, self._port = url, parts.hostname, parts.port
        self._secret, self.timeout_s = secret, timeout_s
        self.connect_timeout_s = min(connect_timeout_s, timeout_s)
        self.unauthorized_wait_s = unauthorized_wait_s
        """How long a refusal (401) is retried: a peer of a round that just formed serves
        with the round's secret moments later than this node may ask."""

    def read(self, relative: str, start: int = 0, length: int | None = None) -> bytes:
        """The file's bytes, or ``length`` of them from ``start``."""
        with self._open(relative, start, length) as response:
            data = response.chunk(None)
        if len(data) != response.size:
            raise PeerError(f"{self.url}/{relative}: {len(data)} bytes came of {response.size}")
        return data

    def fetch(self, relative: str, dest: Path, expected: FileDigest) -> None:
        """Stream the file to ``dest`` (through a temp file beside it) and rename it into
        place only if its size and digest are ``expected``."""
        hasher, size = xxhash.xxh3_64(), 0
        with self._open(relative) as response, atomic_file(dest, durable=False) as out:
            while chunk := response.chunk(_CHUNK):
                hasher.update(chunk)
                size += out.write(chunk)
            found = FileDigest(size, hasher.hexdigest())
            if found != expected:
                raise PeerError(f"{self.url}/{relative} does not match its manifest: "
                                f"{found.bytes} bytes, {CHECKSUM} {found.digest}, expected "
                                f"{expected.bytes} bytes, {expected.digest}")

    def _open(self, relative: str, start: int = 0, length: int | None = None) -> "_Response":
        return _Response(self, relative, start, length)


class _Response:
    """One GET, as a context manager; the network's errors become PeerError, the local
    file's stay what they are."""

    def __init__(self, client: PeerClient, relative: str, start: int, length: int | None) -> None:
        self.where, self.client = f"{client.url}/{relative}", client
        self._headers = {"Authorization": f"Bearer {client._secret}"}
        if start or length is not None:
            end = "" if length is None else str(start + length - 1)
            self._headers["Range"] = f"bytes={start}-{end}"
        self._path = "/" + quote(relative)
        self.size = 0

    def __enter__(self) -> "_Response":
        deadline = time.monotonic() + self.client.unauthorized_wait_s
        while True:
            try:
                return self._get()
            except PeerUnauthorized:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def _get(self) -> "_Response":
        client = self.client
        self.connection = http.client.HTTPConnection(client._host, client._port,
                                                     timeout=client.connect_timeout_s)
        try:
            self._connect()
            self.connection.request("GET", self._path, headers=self._headers)
            self._response = self.connection.getresponse()
            status = self._response.status
            if status not in (200, 206):
                reason = self._response.read().decode(errors="replace").strip()
                kind = {404: PeerMissing, 401: PeerUnauthorized, 416: PeerPastEnd}.get(
                    status, PeerError)
                raise kind(f"{self.where}: {status} {reason}")
        except (OSError, http.client.HTTPException) as error:
            self.connection.close()
            raise PeerError(f"{self.where}: {error}") from None
        except PeerError:
            self.connection.close()
            raise
        self.size = int(self._response.getheader("Content-Length", "0"))
        return self

    def _connect(self) -> None:
        try:
            self.connection.connect()
        except TimeoutError:
            raise OSError(f"no connection within {self.client.connect_timeout_s:g} s") from None
        self.connection.sock.settimeout(self.client.timeout_s)

    def chunk(self, size: int | None) -> bytes:
        """Up to ``size`` more bytes of the body (None: all the rest)."""
        try:
            return self._response.read(size)
        except (OSError, http.client.HTTPException) as error:
            raise PeerError(f"{self.where}: {error}") from None

    def __exit__(self, *exc) -> None:
        self.connection.close()


def none_served(name: str, failures: Sequence[PeerError]) -> PeerError:
    """The error for a file no peer asked gave: PeerMissing when every one answered that it
    no longer holds it (pruned, not lost), else PeerError with each one's reason."""
    pruned = failures and all(isinstance(error, PeerMissing) for error in failures)
    return (PeerMissing if pruned else PeerError)(
        f"{name}: no live holder serves it ({'; '.join(map(str, failures)) or 'none left'})")


class PeerFile(io.RawIOBase):
    """A checkpoint file this node lacks, read from whichever peer holds it: each ``read``
    after a ``seek`` is one range request, so a load fetches only the items it reads (and
    checks each against the manifest as it does locally)."""

    def __init__(self, clients: list[PeerClient], relative: str,
                 on_read: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self._clients, self._relative = clients, relative
        """``clients`` are shared by the files of one load: a peer that cannot be reached
        is moved last, so the next files do not wait out its timeout before asking another."""
        self._holder: PeerClient | None = None
        self._position = 0
        self._on_read = on_read
        """Told the size of each range read (what a load took from its peers)."""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self._position
        elif whence != io.SEEK_SET:
            raise io.UnsupportedOperation("a peer's file seeks from its start or its position")
        self._position = offset
        return offset

    def tell(self) -> int:
        return self._position

    def read(self, size: int = -1) -> bytes:
        data = self._range(self._position, None if size is None or size < 0 else size)
        self._position += len(data)
        return data

    def _range(self, start: int, length: int | None) -> bytes:
        """As a file reads: ``b""`` for nothing asked, or from its end on."""
        if length == 0:
            return b""
        failures = []
        for client in sorted(self._clients, key=lambda peer: peer is not self._holder):
            try:
                data = client.read(self._relative, start, length)
            except PeerPastEnd:
                data = b""
            except PeerMissing as missing:
                failures.append(missing)
                continue
            except PeerError as unreachable:  # another peer may hold the file too
                failures.append(unreachable)
                self._clients.remove(client)
                self._clients.append(client)
                continue
            self._holder = client
            if self._on_read is not None:
                self._on_read(len(data))
            return data
        raise none_served(self._relative, failures)


PEERS_FILE = "peers.json"
"""In a node's run folder: where its trainer's ranks read, for a load, the job's secret and
the other nodes' servers (readable by the job's user only)."""


def write_peer_list(run_dir: Path, secret: str, urls: Sequence[str]) -> None:
    # A temp file made afresh (never a leftover, which kept its mode, nor a link placed
    # there), for the user alone: it gets the job's secret
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    with atomic_file(Path(run_dir) / PEERS_FILE, durable=False, mode=0o600) as handle:
        handle.write(json.dumps({"secret": secret, "peers": list(urls)}).encode())


def peer_clients(run_dir: Path | None, timeout_s: float = 30.0) -> list[PeerClient]:
    """The clients of the other nodes' servers ftmaster listed for this node ([] if none)."""
    try:
        body = json.loads((Path(run_dir) / PEERS_FILE).read_text())
        return [PeerClient(url, body["secret"], timeout_s) for url in body["peers"]]
    except (TypeError, OSError, ValueError, KeyError):
        return []


@dataclass(frozen=True)
class Copied:
    """What one pass over a checkpoint brought from a peer."""

    iteration: int
    path: Path
    bytes: int
    seconds: float
    missing: tuple[str, ...]
    """Files asked for that are neither here nor on the peer."""


def copy_checkpoint(client: PeerClient, iteration: int, into: Path) -> Copied:
    """Copy the peer's memory checkpoint of ``iteration`` into the tier folder ``into``
    (from the peer's own manifest: a peer that has one holds every file)."""
    name = iteration_dir(into, iteration).name
    return fill_from_peer(client, iteration, into, client.read(f"{name}/{MANIFEST_NAME}"))


def write_manifest(folder: Path, manifest: bytes, name: str = MANIFEST_NAME) -> None:
    """``manifest`` into ``folder`` under ``name``, never torn (a tmpfs: no fsync)."""
    atomic_write_text(folder / name, manifest.decode(), durable=False)


def fill_from_peer(client: PeerClient, iteration: int, into: Path, manifest: bytes,
                   names: Iterable[str] | None = None, make_folder: bool = True) -> Copied:
    """Fetch into ``into``'s folder of ``iteration`` every file ``manifest`` lists (or those of
    ``names`` it lists) that is not already there, verified on arrival; a file the peer lacks
    too is left missing. Once the folder holds every file of the manifest, the manifest is
    written, last, so a copy with one is whole and verified, as a checkpoint written in place
    is. A file already there with the manifest's size and digest is kept, so a copy resumes
    where one broke. Raises PeerError for an unusable manifest, a peer that cannot be read,
    or a file that does not match. Without ``make_folder``, a folder that is gone (taken by a
    newer save) is not made again: the next file's fetch raises FileNotFoundError."""
    started = time.perf_counter()
    folder = iteration_dir(into, iteration)
    files = manifest_files(manifest, iteration, client.url)
    wanted = files if names is None else {n: files[n] for n in names if n in files}
    if make_folder:
        folder.mkdir(parents=True, exist_ok=True)
    copied, missing = 0, []
    for file, expected in sorted(wanted.items()):
        if holds(folder / file, expected):
            continue
        try:
            client.fetch(f"{folder.name}/{file}", folder / file, expected)
        except PeerMissing:
            missing.append(file)
            continue
        copied += expected.bytes
    # Under the tier's lock, as the trainer claims a slot to refill it: between the check and
    # the write it could rename the folder, which the write would then make again, empty.
    with tracker_lock(into):
        if _whole(folder, files) and not holds(folder / MANIFEST_NAME, digest_bytes(manifest)):
            write_manifest(folder, manifest)
            copied += len(manifest)
    return Copied(iteration, folder, copied, time.perf_counter() - started, tuple(missing))


def _whole(folder: Path, files: dict[str, FileDigest]) -> bool:
    """Every file there at its size: each was verified as it arrived, or written here by this
    node's own ranks."""
    return size_problem(folder, Manifest(None, None, files)) is None


def manifest_files(manifest: bytes, iteration: int, url: str) -> dict[str, FileDigest]:
    try:
        body = json.loads(manifest)
        files = file_digests(body["files"])
    except MALFORMED_JSON:
        raise PeerError(f"{url}: the manifest of iteration {iteration} cannot be read") from None
    if body.get("iteration") != iteration or body.get("checksum") != CHECKSUM or not files:
        raise PeerError(f"{url}: the manifest of iteration {iteration} describes another "
                        f"checkpoint or has no checksums")
    if not all(map(is_plain_file_name, files)):
        raise PeerError(f"{url}: the manifest of iteration {iteration} names a file outside "
                        f"its folder")
    return files


def holds(path: Path, expected: FileDigest) -> bool:
    """Whether ``path`` is there with the size and the digest ``expected``."""
    try:
        return path.stat().st_size == expected.bytes and digest_file(path) == expected
    except OSError:
        return False
