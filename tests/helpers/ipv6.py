"""Tests that bind the IPv6 loopback, skipped on a machine without one."""

import socket

import pytest


def _binds_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _binds_ipv6_loopback(), reason="no IPv6 loopback (::1)")
