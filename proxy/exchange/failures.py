"""What can go wrong, as the proxy's own small error tree.

The upstream connections (proxy/server/upstream_conn.py, upstream_pool.py) raise or deliver an
`UpstreamFailure` that already names its reason; the exchange adds the two failures only it can
see (its first-byte deadline, a body that stops arriving). Everything past this boundary reasons
about a `Reason` and a message, and no exception text or class name ever reaches a client.
"""

from __future__ import annotations

from proxy.core.lifecycle import Reason

__all__ = ["Refusal", "UpstreamFailure", "first_byte_timeout", "stalled"]


class Refusal(Exception):
    """The proxy will not forward this request: a bad target, a body too large or too slow, no room."""

    def __init__(self, reason: Reason, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.reason, self.message, self.headers = reason, message, headers or {}


class UpstreamFailure(Exception):
    """The upstream (or the way to it) failed: no connection, no answer in time, broken HTTP, a cut."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def first_byte_timeout(seconds: float) -> UpstreamFailure:
    return UpstreamFailure(Reason.FIRST_BYTE_TIMEOUT, f"the upstream sent no response headers within {seconds:g} s")


def stalled(seconds: float) -> UpstreamFailure:
    return UpstreamFailure(Reason.STALL_TIMEOUT, f"the upstream sent nothing for {seconds:g} s")
