"""The peer file server and client on loopback: the secret, read-only paths, range reads,
verified copies (corrupted at rest or in transit), the rate limit and the timeouts."""

import http.client
import os
import shutil
import socket
import threading
import time

import pytest

from ftmaster.peer_files import (PeerClient, PeerError, PeerServeConfig, PeerServer,
                                 copy_checkpoint, fill_from_peer, manifest_files, new_secret)
from ftmaster.recovery.checkpoints import iteration_dir
from ftmaster.recovery.manifest import MANIFEST_NAME, digest_file, read_manifest, write_manifest
from ftmaster.runfiles import TEMP_SUFFIX
from helpers.ipv6 import needs_ipv6

SECRET = new_secret()


def checkpoint(tier, iteration=6, sizes=(3 << 20, 1000, 0)):
    """A memory tier with one checkpoint: random shard files and their manifest."""
    folder = iteration_dir(tier, iteration)
    folder.mkdir(parents=True)
    files = {}
    for index, size in enumerate(sizes):
        (folder / f"__{index}_0.distcp").write_bytes(os.urandom(size))
        files[f"__{index}_0.distcp"] = digest_file(folder / f"__{index}_0.distcp")
    write_manifest(folder, "periodic", iteration, files)
    return folder


@pytest.fixture
def served(tmp_path):
    tier = tmp_path / "peer"
    tier.mkdir()
    server = PeerServer(PeerServeConfig(tier, SECRET))
    yield tier, server
    server.close()


def raw_get(url, path, headers=None):
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    connection.request("GET", path, headers=headers or {})
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response.status, body


def test_a_request_without_the_jobs_secret_is_refused_and_gets_no_bytes(served):
    tier, server = served
    folder = checkpoint(tier)
    data = (folder / "__1_0.distcp").read_bytes()
    path = f"/{folder.name}/__1_0.distcp"
    assert raw_get(server.url, path) == (401, b"the job's secret is required\n")
    status, body = raw_get(server.url, path, {"Authorization": f"Bearer {new_secret()}"})
    assert status == 401 and data not in body
    with pytest.raises(PeerError, match="401"):
        PeerClient(server.url, new_secret()).read(path[1:])
    assert PeerClient(server.url, SECRET).read(path[1:]) == data


def test_only_files_under_the_folder_are_served_and_nothing_is_written(served, tmp_path):
    tier, server = served
    folder = checkpoint(tier)
    (tmp_path / "secret.txt").write_text("not the tier's")
    (tier / "out").symlink_to(tmp_path / "secret.txt")
    auth = {"Authorization": f"Bearer {SECRET}"}
    for path in ("/../secret.txt", "/%2E%2E/secret.txt", "/out", f"/{folder.name}", "/missing",
                 f"/{folder.name}/__1_0.distcp%00x"):  # a NUL broke the request off unanswered
        assert raw_get(server.url, path, auth)[0] == 404, path
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    connection.request("PUT", f"/{folder.name}/new", body=b"x", headers=auth)
    assert connection.getresponse().status == 501
    assert not (folder / "new").exists()


def test_a_range_read_returns_exactly_those_bytes(served):
    tier, server = served
    data = (checkpoint(tier) / "__0_0.distcp").read_bytes()
    client = PeerClient(server.url, SECRET)
    name = "iter_0000006/__0_0.distcp"
    assert client.read(name, 1_000_000, 4096) == data[1_000_000:1_004_096]
    assert client.read(name, len(data) - 10) == data[-10:]
    with pytest.raises(PeerError, match="416"):
        client.read(name, len(data) + 1, 5)


def test_a_peers_file_reads_as_a_file_does_at_its_end_and_for_nothing(served):
    """A zero-length item's read(0), and BufferedReader's read to the end, raised a 416."""
    import io

    from ftmaster.peer_files import PeerFile

    tier, server = served
    data = (checkpoint(tier, sizes=(100,)) / "__0_0.distcp").read_bytes()
    peer = PeerFile([PeerClient(server.url, SECRET)], "iter_0000006/__0_0.distcp")
    assert peer.read(0) == b""
    assert io.BufferedReader(peer).read() == data
    peer.seek(100)
    assert peer.read(5) == b""


class Unreachable(PeerClient):
    """A peer whose server cannot be reached: each ask is counted, and refused."""

    def __init__(self):
        super().__init__(f"http://127.0.0.1:{unserved_port()}", SECRET)
        self.asked = 0

    def read(self, relative, start=0, length=None):
        self.asked += 1
        return super().read(relative, start, length)


def unserved_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_file_is_read_from_another_peer_that_holds_it_when_the_first_cannot_be_reached(
        served):
    """Two peers hold the shards a load lacks; the first listed cannot be reached: the load
    failed with its connection error, the second peer never asked. The next files of the
    same load ask the peer that answered first, without waiting on the other again."""
    from ftmaster.peer_files import PeerFile

    tier, server = served
    folder = checkpoint(tier, sizes=(1000, 2000))
    down = Unreachable()
    peers = [down, PeerClient(server.url, SECRET)]
    for name in ("__0_0.distcp", "__1_0.distcp"):
        with PeerFile(peers, f"{folder.name}/{name}") as stream:
            assert stream.read() == (folder / name).read_bytes()
    assert down.asked == 1
    with pytest.raises(PeerError, match="Connection refused"):
        PeerFile([Unreachable()], f"{folder.name}/__0_0.distcp").read()


@pytest.fixture
def blackholed():
    """The address of a host that drops connections (no reset): a listener whose one-slot
    queue is full, so the kernel drops every further SYN."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname())
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    filler.close()
    listener.close()


def test_a_peer_that_drops_connections_costs_the_connect_timeout_not_the_read_timeout(
        served, blackholed):
    """A dead host that drops SYNs held each load for the whole read timeout (30 s) before
    the next peer was asked; a live peer accepts in milliseconds."""
    from ftmaster.peer_files import PeerFile

    tier, server = served
    folder = checkpoint(tier, sizes=(1000,))
    name = f"{folder.name}/__0_0.distcp"
    dead = PeerClient(blackholed, SECRET, timeout_s=3600, connect_timeout_s=0.3)
    with PeerFile([dead, PeerClient(server.url, SECRET)], name) as stream:
        assert stream.read() == (folder / "__0_0.distcp").read_bytes()
    with pytest.raises(PeerError, match="no connection within 0.3 s"):
        PeerFile([dead], name).read()


def test_a_connected_peer_keeps_the_read_timeout(served):
    """The connect timeout bounds the connection only: reads wait up to ``timeout_s``."""
    tier, server = served
    folder = checkpoint(tier, sizes=(1000,))
    client = PeerClient(server.url, SECRET, timeout_s=7.0, connect_timeout_s=0.3)
    with client._open(f"{folder.name}/__0_0.distcp") as response:
        assert response.connection.sock.gettimeout() == 7.0
        assert len(response.chunk(None)) == 1000


def test_a_checkpoint_is_copied_verified_with_its_manifest_last(served, tmp_path):
    tier, server = served
    source = checkpoint(tier)
    copied = copy_checkpoint(PeerClient(server.url, SECRET), 6, tmp_path / "mine")
    assert copied.path == iteration_dir(tmp_path / "mine", 6)
    assert copied.bytes == sum(f.stat().st_size for f in source.iterdir())
    for file in source.iterdir():
        assert (copied.path / file.name).read_bytes() == file.read_bytes()
    assert read_manifest(copied.path) == read_manifest(source)
    again = copy_checkpoint(PeerClient(server.url, SECRET), 6, tmp_path / "mine")
    assert (again.bytes, again.missing) == (0, ())  # what it holds is kept


@needs_ipv6
def test_a_checkpoint_is_copied_from_a_peer_at_an_ipv6_address(tmp_path):
    """The server bound IPv4 sockets only: "Address family for hostname not supported"."""
    folder = checkpoint(tmp_path / "peer")
    server = PeerServer(PeerServeConfig(tmp_path / "peer", SECRET, addr="::1"))
    try:
        assert server.url.startswith("http://[::1]:")
        copied = copy_checkpoint(PeerClient(server.url, SECRET), 6, tmp_path / "mine")
        assert read_manifest(copied.path) == read_manifest(folder)
    finally:
        server.close()


@needs_ipv6
@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="no dual-stack sockets here")
def test_a_server_on_every_ipv6_address_serves_ipv4_peers_too(tmp_path):
    folder = checkpoint(tmp_path / "peer")
    server = PeerServer(PeerServeConfig(tmp_path / "peer", SECRET, addr="::"))
    try:
        port = server.url.rpartition(":")[2]
        for host in ("[::1]", "127.0.0.1"):
            client = PeerClient(f"http://{host}:{port}", SECRET)
            assert client.read(f"{folder.name}/{MANIFEST_NAME}") == (folder / MANIFEST_NAME).read_bytes()
    finally:
        server.close()


def test_a_folder_is_filled_with_what_the_peer_holds_and_whole_only_when_nothing_is_missing(
        served, tmp_path):
    """Node-local tiers: this node wrote some shards and holds the manifest, the peer wrote
    the others; a file neither holds stays missing, and the copy gets no manifest."""
    tier, server = served
    source = checkpoint(tier, sizes=(5000, 6000, 7000))
    manifest = (source / MANIFEST_NAME).read_bytes()
    mine = iteration_dir(tmp_path / "mine", 6)
    mine.mkdir(parents=True)
    shutil.copy(source / "__0_0.distcp", mine)
    (source / "__0_0.distcp").unlink()
    (source / "__2_0.distcp").unlink()
    client = PeerClient(server.url, SECRET)
    partial = fill_from_peer(client, 6, tmp_path / "mine", manifest)
    assert (partial.bytes, partial.missing) == (6000, ("__2_0.distcp",))
    assert not (mine / MANIFEST_NAME).exists()
    shard = os.urandom(7000)
    (source / "__2_0.distcp").write_bytes(shard)  # other bytes than the manifest's
    with pytest.raises(PeerError, match="__2_0.distcp does not match"):
        fill_from_peer(client, 6, tmp_path / "mine", manifest)
    assert not (mine / "__2_0.distcp").exists()


def test_a_slot_the_trainer_refills_as_the_copy_ends_gets_no_manifest_of_the_old_iteration(
        served, tmp_path, monkeypatch):
    """The trainer's claim of a slot (under the tier's lock: manifest removed, folder renamed
    to the new iteration) came between the copy's check that the folder is whole and its
    write of the manifest, which made the old folder again, holding the manifest alone."""
    import ftmaster.peer_files as peer_files
    from megatron.training.memory_slots import MemorySlots

    tier, server = served
    source = checkpoint(tier, sizes=(5000, 6000))
    mine = tmp_path / "mine"
    iteration_dir(mine, 6).mkdir(parents=True)
    shutil.copy(source / "__0_0.distcp", iteration_dir(mine, 6))  # this node's own shard
    whole = peer_files._whole

    def whole_then_claimed(folder, files):
        found = whole(folder, files)
        claim = threading.Thread(target=MemorySlots(mine, {0}).claim, args=(6, iteration_dir(mine, 10)))
        claim.start()
        claim.join(0.5)  # as long as the lock lets it
        return found

    monkeypatch.setattr(peer_files, "_whole", whole_then_claimed)
    try:
        fill_from_peer(PeerClient(server.url, SECRET), 6, mine,
                       (source / MANIFEST_NAME).read_bytes())
    except OSError:
        pass  # a copy that lost its folder fails; it must not name it
    wait = time.monotonic() + 5
    while iteration_dir(mine, 6).exists() and not iteration_dir(mine, 10).exists() \
            and time.monotonic() < wait:
        time.sleep(0.01)
    assert not (iteration_dir(mine, 6) / MANIFEST_NAME).exists()
    assert not (iteration_dir(mine, 10) / MANIFEST_NAME).exists()


def test_a_copy_corrupted_at_rest_is_refused_and_leaves_no_manifest(served, tmp_path):
    tier, server = served
    shard = checkpoint(tier) / "__0_0.distcp"
    with open(shard, "r+b") as handle:
        handle.seek(4096)
        handle.write(b"\xff" * 16)
    with pytest.raises(PeerError, match="__0_0.distcp does not match its manifest"):
        copy_checkpoint(PeerClient(server.url, SECRET), 6, tmp_path / "mine")
    copy = iteration_dir(tmp_path / "mine", 6)
    assert not (copy / "__0_0.distcp").exists() and not (copy / MANIFEST_NAME).exists()
    assert not [p for p in copy.iterdir() if p.name.endswith(TEMP_SUFFIX)]


class FlippingRelay:
    """A TCP relay that flips one byte of what the server sends, past its headers."""

    def __init__(self, target_url, at=100_000):
        host, port = target_url.removeprefix("http://").rsplit(":", 1)
        self.target, self.at = (host, int(port)), at
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            client, _ = self.listener.accept()
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.at), daemon=True).start()

    @staticmethod
    def _pipe(source, sink, flip_at):
        sent = 0
        while data := source.recv(65536):
            if flip_at is not None and sent <= flip_at < sent + len(data):
                data = bytearray(data)
                data[flip_at - sent] ^= 0x01
            sink.sendall(bytes(data))
            sent += len(data)
        sink.close()


def test_a_copy_corrupted_in_transit_is_refused(served, tmp_path):
    tier, server = served
    checkpoint(tier, sizes=(3 << 20,))
    relay = FlippingRelay(server.url)
    with pytest.raises(PeerError, match="does not match its manifest"):
        copy_checkpoint(PeerClient(relay.url, SECRET), 6, tmp_path / "mine")
    assert not (iteration_dir(tmp_path / "mine", 6) / MANIFEST_NAME).exists()


def test_a_peer_without_that_checkpoint_or_without_an_answer_is_an_error(served, tmp_path):
    tier, server = served
    checkpoint(tier)
    with pytest.raises(PeerError, match="404"):
        copy_checkpoint(PeerClient(server.url, SECRET), 8, tmp_path / "mine")
    silent = socket.create_server(("127.0.0.1", 0))  # accepts the connection, never answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(PeerError, match="timed out"):
        PeerClient(url, SECRET, timeout_s=0.5).read("x")
    assert time.monotonic() - started < 5
    silent.close()
    with pytest.raises(PeerError, match="refused"):
        PeerClient(url, SECRET).read("x")


def test_the_rate_limit_paces_what_the_server_sends(tmp_path):
    tier = tmp_path / "peer"
    checkpoint(tier, sizes=(8 << 20,))
    server = PeerServer(PeerServeConfig(tier, SECRET, rate_bytes_s=16 << 20))
    try:
        started = time.monotonic()
        copy_checkpoint(PeerClient(server.url, SECRET), 6, tmp_path / "mine")
        # 8 MiB at 16 MiB/s, after a burst of a quarter second's worth: at least 0.25 s
        assert time.monotonic() - started >= 0.25
    finally:
        server.close()


def failed_reads_at_once(tmp_path, readers: int, file_bytes: int, rate_bytes_s: int) -> list[str]:
    """What ``readers`` clients reading one file at once, with 2 s to get their bytes going,
    heard fail from a server under that rate limit."""
    tier = tmp_path / "peer"
    checkpoint(tier, sizes=(file_bytes,))
    server = PeerServer(PeerServeConfig(tier, SECRET, rate_bytes_s=rate_bytes_s))
    failed = []

    def read():
        try:
            PeerClient(server.url, SECRET, timeout_s=2).read("iter_0000006/__0_0.distcp")
        except PeerError as error:
            failed.append(str(error))

    try:
        threads = [threading.Thread(target=read) for _ in range(readers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        server.close()
    return failed


def test_under_the_rate_limit_every_reader_gets_bytes_in_turn(tmp_path):
    """A sender slept holding the limit's lock, a whole MiB at a time, and the lock is not
    fair: of 16 readers of 1 MiB each at 4 MiB/s, some heard nothing in time."""
    assert failed_reads_at_once(tmp_path, 16, 1 << 20, 4 << 20) == []


def test_at_a_low_rate_readers_at_once_still_hear_from_the_server_within_the_timeout(tmp_path):
    """Each step was 64 KiB whatever the rate: at 64 KiB/s (twice the least the timeout
    allows) four readers each waited about 4 s between their bytes, past a 2 s timeout."""
    assert failed_reads_at_once(tmp_path, 4, 70 << 10, 64 << 10) == []


def test_the_peer_list_is_written_afresh_for_the_user_alone(tmp_path):
    """A leftover temporary file kept its mode, and the job's secret went into it."""
    from ftmaster.peer_files import PEERS_FILE, write_peer_list

    leftover = tmp_path / f".{PEERS_FILE}.{os.getpid()}"
    leftover.write_text("")
    leftover.chmod(0o644)
    write_peer_list(tmp_path, SECRET, ["http://127.0.0.1:1"])
    assert (tmp_path / PEERS_FILE).stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("kwargs, message", [
    ({"secret": "short"}, "at least 32"),
    ({"rate_bytes_s": 0}, "rate must send a 64 KiB chunk within the 30 s timeout"),
    ({"rate_bytes_s": 2000}, "at least 2185 bytes/s, got 2000"),
    ({"rate_bytes_s": 10_000, "timeout_s": 2}, "within the 2 s timeout"),
    ({"timeout_s": -1}, "timeout must be positive")])
def test_the_serving_config_refuses_bad_values(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PeerServeConfig(**{"root": tmp_path, "secret": SECRET, **kwargs})


def test_a_client_needs_a_full_address():
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        PeerClient("127.0.0.1:80", SECRET)


def test_a_server_without_the_secret_yet_refuses_everything_until_authorized(tmp_path):
    folder = checkpoint(tmp_path / "peer")
    server = PeerServer(PeerServeConfig(tmp_path / "peer", None))
    try:
        path = f"{folder.name}/{MANIFEST_NAME}"
        with pytest.raises(PeerError, match="401"):
            PeerClient(server.url, SECRET).read(path)
        server.authorize(SECRET)
        assert PeerClient(server.url, SECRET).read(path) == (folder / MANIFEST_NAME).read_bytes()
    finally:
        server.close()


def test_a_client_may_wait_for_a_peer_to_take_up_the_secret(tmp_path):
    """Nodes take up a new round at their own pace: a peer's first answers may be refusals."""
    folder = checkpoint(tmp_path / "peer")
    server = PeerServer(PeerServeConfig(tmp_path / "peer", None))
    threading.Timer(0.3, server.authorize, (SECRET,)).start()
    try:
        data = PeerClient(server.url, SECRET, unauthorized_wait_s=10).read(
            f"{folder.name}/{MANIFEST_NAME}")
    finally:
        server.close()
    assert data == (folder / MANIFEST_NAME).read_bytes()


@pytest.mark.parametrize(("files", "problem"), [
    ('{"../escape": {"bytes": 1, "digest": "0"}}', "names a file outside its folder"),
    ('{"a\\u0000b": {"bytes": 1, "digest": "0"}}', "names a file outside its folder"),
    ('{"__0_0.distcp": {"bytes": 1e999, "digest": "0"}}', "cannot be read"),
    ("[" * 100_000, "cannot be read"),
])
def test_a_peers_damaged_manifest_is_refused_in_one_line(files, problem):
    manifest = f'{{"kind": "periodic", "iteration": 6, "checksum": "xxh3_64", "files": {files}}}'
    with pytest.raises(PeerError, match=f"peer: the manifest of iteration 6 {problem}"):
        manifest_files(manifest.encode(), 6, "peer")
