"""Addresses of IPv4 and IPv6 alike: where a server binds, and ``host:port`` text.

An IPv6 address has colons of its own, so in ``host:port`` it goes in brackets
(``[fd00::1]:29400``), as in a URL and as torch elastic reads a rendezvous endpoint.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket


def bind_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """The family and socket address a server for ``host`` binds: its IPv4 address when it
    has one (a dual-stack name binds as it did before IPv6 was supported), else its IPv6 one.
    socket.gaierror (an OSError) when ``host`` does not resolve."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
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
