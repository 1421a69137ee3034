"""Addresses of IPv4 and IPv6 alike: where a server binds, ``host:port`` text, and whether
two hosts written differently are one.

An IPv6 address has colons of its own, so in ``host:port`` it goes in brackets
(``[fd00::1]:29400``), as in a URL and as torch elastic reads a rendezvous endpoint.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
from typing import Any, Callable

from ftmaster.monitor.backends.bounded import CallTimeout, call_once_bounded

RESOLVE_TIMEOUT_S = 5.0
"""The longest one name lookup of ftmaster's may take (:func:`lookup`): a resolver that hangs
must not hang the launch (glibc waits 5 s per server and try, some set-ups far longer)."""


class ResolveTimeout(OSError):
    """A name lookup did not finish within :data:`RESOLVE_TIMEOUT_S`."""


def lookup(name: str, resolve: Callable[..., Any], *args: Any) -> Any:
    """``resolve(*args)``, a lookup of ``name``, on a thread of its own; ResolveTimeout (one
    line naming ``name``) past :data:`RESOLVE_TIMEOUT_S`, the lookup left to its thread."""
    try:
        return call_once_bounded(f"resolve {name}", RESOLVE_TIMEOUT_S, resolve, *args)
    except CallTimeout:
        raise ResolveTimeout(f"looking up {name} did not finish within {RESOLVE_TIMEOUT_S:g} s "
                             "(is the DNS server reachable?)") from None


def this_host_name() -> str:
    """The machine's FQDN, a reverse lookup bounded as :func:`lookup` is."""
    return lookup("this host's name", socket.getfqdn)


def bind_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """The family and socket address a server for ``host`` binds: its IPv4 address when it
    has one (a dual-stack name binds as it did before IPv6 was supported), else its IPv6 one.
    An IP address needs no lookup; a name's is bounded (:func:`lookup`). OSError
    (socket.gaierror, ResolveTimeout) when ``host`` does not resolve."""
    ip = ip_address(host)
    if ip is not None:
        if ip.version == 4:
            return socket.AF_INET, (str(ip), port)
        return socket.AF_INET6, (str(ip), port, 0, 0)
    found = lookup(host, socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM, 0,
                   socket.AI_PASSIVE)
    family, _, _, _, address = next((info for info in found if info[0] == socket.AF_INET),
                                    found[0])
    return family, address


def allow_ipv4_too(sock: socket.socket) -> None:
    """An IPv6 socket bound to ``::`` takes IPv4 peers as well, where the OS allows it (Linux
    does by default; the BSDs do not), as ``0.0.0.0`` would: called before ``bind``."""
    if sock.family == socket.AF_INET6:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_HOST = re.compile(r"[\w.:-]+")  # torch's own check of an endpoint's host
_PORT = re.compile(r"[0-9]{1,5}")


def split_host_port(text: str) -> tuple[str, int | None]:
    """``HOST[:PORT]`` as torch elastic reads a rendezvous endpoint (``parse_rendezvous_endpoint``
    in torch/distributed/elastic/rendezvous/utils.py): the port after the last colon, unless
    the text ends in the bracket of an IPv6 address; None when no port is given. ValueError (one
    line, naming ``text``) for what torch refuses, and for an IPv6 address outside brackets
    that torch would misread (``fd00::1`` as host ``fd00:``, port 1)."""
    text = text.strip()
    if text.endswith("]") or ":" not in text:
        host, port = text, None
    else:
        host, _, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host and not is_ipv6(host):
        raise ValueError(f"{text!r}: an IPv6 address goes in brackets, as in [fd00::1]:29400")
    if not _HOST.fullmatch(host):
        raise ValueError(f"{text!r}: expected HOST[:PORT] (a name, an IPv4 address or an "
                         "IPv6 address in brackets)")
    if port is None:
        return host, None
    if not _PORT.fullmatch(port) or int(port) > 65535:
        raise ValueError(f"{text!r}: the port must be 0-65535")
    return host, int(port)


def is_ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def same_host(first: str, second: str) -> bool:
    """Whether two hosts as written (a name, an IPv4 address, an IPv6 address in any of its
    forms, in brackets or not) are one host to the other nodes: the same text or address, or
    a name resolving to an address of the other. Never on loopback, which every node has; a
    name that does not resolve within :data:`RESOLVE_TIMEOUT_S` only matches its own text."""
    if is_loopback(first) or is_loopback(second):
        return False
    if first.lower() == second.lower():
        return True
    return not _addresses(first).isdisjoint(_addresses(second))


def is_loopback(host: str) -> bool:
    address = ip_address(host)
    return host.lower() == "localhost" if address is None else address.is_loopback


def ip_address(host: str) -> IPAddress | None:
    """``host`` as an IP address (an IPv4-mapped IPv6 one as its IPv4 address), None for a
    name."""
    try:
        address = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None
    return getattr(address, "ipv4_mapped", None) or address


def _addresses(host: str) -> set[IPAddress]:
    """The non-loopback addresses ``host`` is or resolves to: none when it does not resolve
    in time (a loopback address, such as Debian's 127.0.1.1 for the machine's own name, is
    every node's)."""
    address = ip_address(host)
    if address is not None:
        return {address}
    try:
        found = lookup(host, socket.getaddrinfo, host, None, 0, socket.SOCK_STREAM)
    except (OSError, ValueError):  # ValueError: a name IDNA cannot encode
        return set()
    resolved = {ip_address(info[4][0]) for info in found}
    return {address for address in resolved if address is not None and not address.is_loopback}
