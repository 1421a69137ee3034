"""host:port text for IPv4 and IPv6 alike, read as torch elastic reads a rendezvous endpoint."""

import pytest

from ftmaster.addresses import host_port, split_host_port


@pytest.mark.parametrize("endpoint", [
    "node-1", "node-1:29500", "10.0.0.1", "10.0.0.1:0", "[fd00::1]", "[fd00::1]:29500",
    "[::1]:1", "fd00::1:29500", " node-1:29500 "])
def test_an_endpoint_reads_as_torch_reads_it(endpoint):
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = split_host_port(endpoint)
    assert (host, 29400 if port is None else port) == parse_rendezvous_endpoint(endpoint, 29400)


@pytest.mark.parametrize("host, port", [("10.0.0.1", 29500), ("node-1", 1), ("fd00::1", 29500)])
def test_host_port_reads_back(host, port):
    assert split_host_port(host_port(host, port)) == (host, port)
    assert host_port("fd00::1", 80) == "[fd00::1]:80"


@pytest.mark.parametrize("first, second, same", [
    ("10.0.0.1", "10.0.0.1", True), ("fd00::1", "[FD00:0::1]", True),
    ("[fd00::1]", "fd00:0:0:0:0:0:0:1", True), ("::ffff:10.0.0.1", "10.0.0.1", True),
    ("Node-1.cluster", "node-1.cluster", True),  # names are case-blind, resolved or not
    ("10.0.0.1", "10.0.0.2", False), ("fd00::1", "fd00::2", False),
    ("127.0.0.1", "127.0.0.1", False), ("[::1]", "::1", False), ("localhost", "localhost", False)])
def test_two_addresses_are_compared_as_addresses(first, second, same):
    from ftmaster.addresses import same_host

    assert same_host(first, second) is same
