"""Loopback ports for the tests' servers and processes: the one place a test finds a free one.

A free port is one nothing listens on once the call returns: a server a test starts binds it, or a
proxy pointed at it finds no upstream there (connection refused). `held_port` keeps one bound and
listening, for a start that must find its port taken.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

__all__ = ["free_port", "free_ports", "held_port"]


def free_port() -> int:
    """A loopback port that was free a moment ago and has no listener now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports: all held open at once, so the kernel cannot hand one out twice."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A loopback port another process listens on, for as long as the block runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])
