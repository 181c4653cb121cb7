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
    "BodyTooLarge",
    "ConnectFailed",
    "FirstByteTimeout",
    "ProxyError",
    "StreamBroken",
    "upstream_request_errors",
]


class ProxyError(Exception):
    """A failure with a verdict: the design's `reason` and the HTTP status it maps to."""

    reason = "proxy_error"
    status = 500
    message = "the proxy failed to handle the request"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.message)
        if message:
            self.message = message


class BodyTooLarge(ProxyError):
    reason, status = "body_too_large", 413
    message = "request body is larger than the proxy's --max-body-size"


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
    except (aiohttp.ClientError, OSError) as exc:
        raise ConnectFailed("the upstream closed the connection before answering") from exc
    except asyncio.CancelledError:
        raise
