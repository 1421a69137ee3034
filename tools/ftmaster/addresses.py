"""Addresses of IPv4 and IPv6 alike: where a server binds, and ``host:port`` text.

An IPv6 address has colons of its own, so in ``host:port`` it goes in brackets
(``[fd00::1]:29400``), as in a URL.
"""

from __future__ import annotations

import socket


def bind_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """The family and socket address a server for ``host`` binds: its IPv4 address when it
    has one (a dual-stack name binds as it did before IPv6 was supported), else its IPv6 one.
    socket.gaierror (an OSError) when ``host`` does not resolve."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = next((info for info in found if info[0] == socket.AF_INET),
                                    found[0])
    return family, address

