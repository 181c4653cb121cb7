"""What the proxy notes about a client's request body: model, stream, and the batch shape.

The body is forwarded unchanged whatever it holds (the upstream judges validity), so reading it
must never fail: anything unexpected falls back to the defaults.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.dialects.base import Dialect

__all__ = ["MAX_PARSED_VALUES", "RequestInfo", "inspect_request", "read_request"]


@dataclass(slots=True, init=False)
class RequestInfo:
    model: str | None = None
    stream: bool = False
    n: int = 1  # choices per prompt
    prompts: int = 1  # prompts in a /v1/completions batch
    include_usage: bool = False  # the client asked for the stream's usage chunk

    # (`__init__` written out, not the dataclass's: compiled, the dataclass's generated one is an
    # interpreted call with an argument tuple, three times the work of a native one.)
    def __init__(self, model: str | None = None, stream: bool = False, n: int = 1, prompts: int = 1,
                 include_usage: bool = False) -> None:  # fmt: skip
        self.model = model
        self.stream = stream
        self.n = n
        self.prompts = prompts
        self.include_usage = include_usage


def _prompt_count(prompt: object) -> int:
    """A list of strings or of token lists is a batch; a single token list is one prompt."""
    if isinstance(prompt, list) and prompt and not all(type(item) is int for item in prompt):
        return len(prompt)
    return 1


# zlib's window bits: gzip or zlib header detected automatically (47); raw deflate as a fallback (-15).
_WBITS = {"gzip": 47, "x-gzip": 47, "deflate": 47}


def inflated_copy(body: bytes | bytearray, encoding: str, limit: int) -> bytes | None:
    """A compressed body's JSON for inspection only, never more than `limit` bytes; None if unreadable.

    The body itself goes upstream as it came; a decompression bomb costs at most `limit` here.
    """
    wbits = _WBITS.get(encoding.strip().lower())
    if wbits is None:
        return None
    for bits in (wbits, -15):
        inflater = zlib.decompressobj(bits)
        try:
            out = inflater.decompress(body, limit)
        except zlib.error:
            continue
        return out if not inflater.unconsumed_tail else None
    return None


# A body too large to parse (a parse holds a second copy of every string in it) is scanned for its
# `model` and `stream` at its two ends, where clients put them; its batch shape stays the default.
SCAN_BYTES = 64 * 1024
_MODEL = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.){0,1024})"')
_STREAM = re.compile(rb'"stream"\s*:\s*(true|false)')

# A parse costs per value, not per byte: 2.7 M empty objects in an 8 MB body are ~25 times its size as
# Python objects and ~230 ms of the event loop's CPU. A body is parsed only when it holds at most
# MAX_PARSED_VALUES values (counted from above by its `,`, `{` and `[`, those in strings too): at most
# ~16 MiB and ~20 ms for the most costly values (objects with distinct keys), a few ms for text. Past
# it the body is scanned like a large one. A body of SMALL_BODY bytes or fewer holds fewer values
# than that, so it is not counted.
MAX_PARSED_VALUES = 65_536
SMALL_BODY = 3 * MAX_PARSED_VALUES
_COUNT_BLOCK = 256 * 1024  # counted a block at a time: a costly body is known after its first blocks


def _cheap_to_parse(body: bytes | bytearray) -> bool:
    """At most MAX_PARSED_VALUES JSON values in `body` (an upper bound: one per separator or opener)."""
    if len(body) <= SMALL_BODY:
        return True
    values = 0
    for start in range(0, len(body), _COUNT_BLOCK):
        end = start + _COUNT_BLOCK
        values += body.count(b",", start, end) + body.count(b"{", start, end) + body.count(b"[", start, end)
        if values > MAX_PARSED_VALUES:
            return False
    return True


def _scanned(body: bytes | bytearray) -> RequestInfo:
    info = RequestInfo()
    for end in (body[:SCAN_BYTES], body[-SCAN_BYTES:]):
        if info.model is None and (found := _MODEL.search(end)) is not None:
            try:
                model = orjson.loads(b'"' + found.group(1) + b'"')
            except orjson.JSONDecodeError:
                model = None
            info.model = model if isinstance(model, str) else None
        if (stream := _STREAM.search(end)) is not None:
            info.stream = stream.group(1) == b"true"
    return info


def inspect_request(
    dialect: Dialect, body: bytes | bytearray, encoding: str | None = None, limit: int = 0,
    *, parse_limit: int | None = None,
) -> RequestInfo:
    """`read_request`'s facts, without the object."""
    return read_request(dialect, body, encoding, limit, parse_limit=parse_limit)[0]


def read_request(
    dialect: Dialect, body: bytes | bytearray, encoding: str | None = None, limit: int = 0,
    *, parse_limit: int | None = None,
) -> tuple[RequestInfo, dict[str, Any] | None]:
    """The request's facts, and its JSON object when a plain body was parsed (for --resume-on-cut's
    rules: one parse per request); never raises. A body in `encoding` is inflated (at most `limit`
    bytes) first; a plain one larger than `parse_limit`, or one costly to parse, is scanned instead."""
    info = RequestInfo()
    plain = not encoding or encoding.strip().lower() == "identity"
    if plain and parse_limit is not None and len(body) > parse_limit:
        return _scanned(body), None
    if not plain:
        assert encoding is not None
        inflated = inflated_copy(body, encoding, limit)
        if inflated is None:
            return info, None
        body = inflated
        if parse_limit is not None and len(body) > parse_limit:
            return _scanned(body), None
    if len(body) > SMALL_BODY and not _cheap_to_parse(body):
        return _scanned(body), None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return info, None
    if not isinstance(obj, dict):
        return info, None
    model = obj.get("model")
    if isinstance(model, str):
        info.model = model
    info.stream = obj.get("stream") is True
    n = obj.get("n")
    if type(n) is int and n >= 1:
        info.n = n
    if dialect.name == "completions":
        info.prompts = _prompt_count(obj.get("prompt"))
    options = obj.get("stream_options")
    if options is not None:
        info.include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return info, (obj if plain else None)
