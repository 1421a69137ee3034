"""Addresses of IPv4 and IPv6 alike: where a server binds, and ``host:port`` text.

An IPv6 address has colons of its own, so in ``host:port`` it goes in brackets
(``[fd00::1]:29400``), as in a URL.
"""

from __future__ import annotations

import contextlib
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
