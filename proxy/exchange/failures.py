"""What can go wrong, as the proxy's own small error tree, and the one place that maps aiohttp's and
the OS's exceptions of the upstream (the request and body reads alike) onto verdict reasons.

Everything past this boundary reasons about a `Reason` and a message, never about aiohttp exception
classes, and no exception text or class name ever reaches a client.
"""

from __future__ import annotations

import aiohttp

from proxy.core.lifecycle import Reason

__all__ = ["READ_ERRORS", "Refusal", "UpstreamFailure", "request_failure"]

# What reading an upstream body can raise once its headers are in (a cut, a reset, bad chunking).
READ_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError)


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


def request_failure(exc: BaseException, connect_timeout: float, first_byte_timeout: float) -> UpstreamFailure:
    """What went wrong before the upstream's headers arrived."""
    if isinstance(exc, (aiohttp.ConnectionTimeoutError, aiohttp.SocketTimeoutError)):
        return UpstreamFailure(Reason.FIRST_BYTE_TIMEOUT, f"the upstream did not connect within {connect_timeout:g} s")
    if isinstance(exc, TimeoutError):
        return UpstreamFailure(
            Reason.FIRST_BYTE_TIMEOUT, f"the upstream sent no response headers within {first_byte_timeout:g} s"
        )
    if isinstance(exc, aiohttp.ClientConnectorError):
        why = exc.strerror or "connection refused"
        return UpstreamFailure(Reason.CONNECT_FAILED, f"could not connect to the upstream: {why}")
    if isinstance(exc, aiohttp.ClientResponseError):  # aiohttp's parser rejected the response head
        return UpstreamFailure(Reason.BAD_UPSTREAM_RESPONSE, "the upstream sent an invalid HTTP response")
    return UpstreamFailure(Reason.CONNECT_FAILED, "the upstream closed the connection before answering")


def body_failure(exc: BaseException | None, idle: float) -> UpstreamFailure:
    """What went wrong while reading a body: a stall (nothing for `idle` seconds), else a cut."""
    if exc is None or isinstance(exc, TimeoutError):  # (TimeoutError is an OSError: test it first)
        return UpstreamFailure(Reason.STALL_TIMEOUT, f"the upstream sent nothing for {idle:g} s")
    return UpstreamFailure(Reason.STREAM_CUT, "the upstream connection broke before the response was complete")
