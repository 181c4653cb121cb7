"""File descriptors: raise the soft limit to the hard one, and keep room for the admin port.

Each proxied exchange holds two sockets (client and upstream). When the limit is lower than
`--max-client-connections` needs, the connection limit is lowered instead, so a full main port
still leaves descriptors for upstream connections, the admin port and the probe (nginx's
`worker_connections` is checked against `worker_rlimit_nofile` in the same spirit).
"""

from __future__ import annotations

import resource

__all__ = ["RESERVED_FDS", "connection_limit", "raise_fd_limit"]

RESERVED_FDS = 64  # listeners, the admin port and its scrapes, the probe, logs
_CEILING = 1 << 20  # a hard limit of "unlimited" is taken as this


def raise_fd_limit() -> tuple[int, int]:
    """(soft limit before, soft limit now); the soft limit is raised to the hard one where allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft


def connection_limit(configured: int, fd_limit: int) -> int:
    """The client connections that fit: two descriptors each, after the reserved ones."""
    fitting = max(1, (fd_limit - RESERVED_FDS) // 2)
    return min(configured, fitting)
