"""The client's side of an exchange before anything goes upstream: its body, its target, its headers.

The body is read as it came on the wire (a compressed one too), bounded by --max-body-size
(checked before reading when announced), by --client-body-timeout between reads, and by the bytes
all exchanges may hold at once (--max-buffered-body-bytes). Each bound that is hit is a `Refusal`.
"""

from __future__ import annotations

import asyncio

from multidict import CIMultiDict

from proxy.config import Config
from proxy.core.dialects import Dialect
from proxy.core.headers import request_headers
from proxy.core.http_head import framing_error
from proxy.core.lifecycle import Reason
from proxy.core.record import ExchangeRecord
from proxy.core.target import BadTarget, forwarded_target
from proxy.exchange.body_budget import BodyBudget
from proxy.exchange.client import ClientRequest
from proxy.exchange.errors import Refusal
from proxy.exchange.state import ProxyState

__all__ = ["INFLATE_LIMIT", "PARSE_LIMIT", "read_body", "upstream_headers", "upstream_target"]

# A compressed body is inflated (a copy, for its model and stream flags) up to this size: inflating
# blocks the event loop, and a small gzip can hold gigabytes. A larger one is forwarded unnoted.
INFLATE_LIMIT = 8 * 1024 * 1024
# A body (or an inflated copy) past this size is not parsed: its model and stream flag are found by
# a scan of its ends. A parse holds a second copy of the body and costs the event loop per byte
# (8 MB of one string: ~10-40 ms, while other clients wait); 1 MiB is nginx's client_max_body_size.
PARSE_LIMIT = 1024 * 1024
_OVERLOADED = "the proxy is holding too many request bodies; retry later"


async def read_body(
    request: ClientRequest, cfg: Config, budget: BodyBudget, ex: ExchangeRecord
) -> bytes | bytearray:
    """The whole body, as it came on the wire. One copy of it is held: a body of announced length is
    read into one buffer of that size, piece by piece, not joined from a list at the end."""
    if (framing := framing_error(request.version, request.headers.get("Transfer-Encoding"))) is not None:
        raise Refusal(Reason.BAD_REQUEST, framing)
    limit, announced = cfg.max_body_size, request.content_length
    if announced is not None and announced > limit:
        raise Refusal(Reason.BODY_TOO_LARGE, f"request body of {announced} bytes exceeds the limit of {limit} bytes")
    if announced and not budget.take_now(announced) and not await budget.take(announced):
        raise Refusal(Reason.PROXY_OVERLOADED, _OVERLOADED, headers={"Retry-After": "1"})
    ex.body_reserved = announced or 0
    if request.headers.get("Expect", "").lower() == "100-continue" and request.version >= (1, 1):
        # The proxy answers it (the upstream is sent the whole body): now, as the body is wanted.
        transport = request.channel.transport
        if transport is not None and not transport.is_closing():
            transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    buffer = bytearray(announced) if announced else None
    chunks: list[bytes] = []
    size = 0
    content = request.content
    while True:
        chunk = content.read_nowait()  # what has come already needs no timer
        if not chunk and not content.at_eof:
            try:
                async with asyncio.timeout(cfg.client_body_timeout):
                    chunk = await content.readany()
            except TimeoutError:
                message = f"the request body stopped arriving for {cfg.client_body_timeout:g} s"
                raise Refusal(Reason.CLIENT_TIMEOUT, message) from None
        if not chunk:
            break
        if buffer is not None and size + len(chunk) <= len(buffer):
            buffer[size : size + len(chunk)] = chunk
            size += len(chunk)
            continue
        size += len(chunk)
        if size > limit:
            raise Refusal(Reason.BODY_TOO_LARGE, f"request body exceeds the limit of {limit} bytes")
        if announced is None:  # chunked: reserve as it comes
            if not await budget.take(len(chunk)):
                raise Refusal(Reason.PROXY_OVERLOADED, _OVERLOADED, headers={"Retry-After": "1"})
            ex.body_reserved += len(chunk)
        chunks.append(chunk)
    if buffer is not None:
        return buffer if size == len(buffer) else bytes(buffer[:size])
    return b"".join(chunks)


def upstream_target(request: ClientRequest) -> str:
    """The client's path and query, to go after the upstream's base path; never another host."""
    try:
        return forwarded_target(request.raw_path)
    except BadTarget as exc:
        raise Refusal(Reason.BAD_REQUEST, str(exc)) from None


def upstream_headers(
    request: ClientRequest, state: ProxyState, dialect: Dialect, ex: ExchangeRecord
) -> CIMultiDict[str]:
    headers = request_headers(
        request.headers,
        client_ip=request.remote,
        scheme=request.scheme,
        host=request.headers.get("Host"),
        request_id=ex.request_id,
        # The guard must read what the upstream sends: ask for it uncompressed. The hop is the pod's
        # loopback, where compression saves nothing (and vLLM and llama.cpp do not compress anyway).
        identity=dialect.json_body,
        authorization=state.upstream_authorization,
    )
    state.books.propagate(ex, headers)  # the proxy's span context goes upstream
    return headers
