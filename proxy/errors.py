"""The proxy's own error tree, and the one boundary that translates aiohttp client errors into it.

Everything past this boundary reasons about a few verdicts (reason + HTTP status), never about
aiohttp exception classes, and no exception text or class name ever reaches a client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp

__all__ = [
    "BadRequest",
    "BadUpstreamResponse",
    "BodyTooLarge",
    "ClientTimeout",
    "ConnectFailed",
    "FirstByteTimeout",
    "ProxyError",
    "ProxyOverloaded",
    "StreamBroken",
    "upstream_request_errors",
]


class ProxyError(Exception):
    """A failure with a verdict: the design's `reason` and the HTTP status it maps to."""

    reason = "proxy_error"
    status = 500
    message = "the proxy failed to handle the request"
    close = False  # the client connection cannot be reused (its request body is unread)
    headers: dict[str, str] = {}  # noqa: RUF012 - read-only class-level defaults

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.message)
        if message:
            self.message = message


class BodyTooLarge(ProxyError):
    reason, status, close = "body_too_large", 413, True
    message = "request body is larger than the proxy's --max-body-size"


class BadRequest(ProxyError):
    """A request target the proxy will not forward (not http, or escaping the upstream's root)."""

    reason, status, close = "bad_request", 400, True
    message = "the request target is not valid"


class ClientTimeout(ProxyError):
    reason, status, close = "client_timeout", 408, True
    message = "the request body stopped arriving"


class ProxyOverloaded(ProxyError):
    reason, status, close = "proxy_overloaded", 503, True
    message = "the proxy is holding too many request bodies; retry later"
    headers = {"Retry-After": "1"}  # noqa: RUF012


class BadUpstreamResponse(ProxyError):
    """The upstream broke HTTP: garbage, CL+TE, a status outside 100-599, an unrequested 101."""

    reason, status = "bad_upstream_response", 502
    message = "the upstream sent an invalid HTTP response"


class ConnectFailed(ProxyError):
    reason, status = "connect_failed", 502
    message = "could not connect to the upstream"


class FirstByteTimeout(ProxyError):
    reason, status = "first_byte_timeout", 504
    message = "the upstream did not answer in time"


class StreamBroken(ProxyError):
    """The upstream body broke off (reset, bad chunking, early close) while being read."""

    reason, status = "stream_cut", 502
    message = "the upstream connection broke before the response was complete"


@contextmanager
def upstream_request_errors(connect_timeout: float, first_byte_timeout: float) -> Iterator[None]:
    """Map what can go wrong before the upstream's headers arrive onto the proxy's verdicts."""
    try:
        yield
    except (aiohttp.ConnectionTimeoutError, aiohttp.SocketTimeoutError) as exc:
        raise FirstByteTimeout(f"the upstream did not connect within {connect_timeout:g} s") from exc
    except TimeoutError as exc:
        raise FirstByteTimeout(f"the upstream sent no response headers within {first_byte_timeout:g} s") from exc
    except aiohttp.ClientConnectorError as exc:
        raise ConnectFailed(f"could not connect to the upstream: {exc.strerror or 'connection refused'}") from exc
    except aiohttp.ClientResponseError as exc:  # aiohttp's parser rejected the response head
        raise BadUpstreamResponse() from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise ConnectFailed("the upstream closed the connection before answering") from exc
    except asyncio.CancelledError:
        raise
