"""What the proxy notes about a client's request body: model, stream, and the batch shape.

The body is forwarded unchanged whatever it holds (the upstream judges validity), so reading it
must never fail: anything unexpected falls back to the defaults.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import orjson

from proxy.core.dialects.base import Dialect

__all__ = ["RequestInfo", "inspect_request"]


@dataclass(slots=True)
class RequestInfo:
    model: str | None = None
    stream: bool = False
    n: int = 1  # choices per prompt
    prompts: int = 1  # prompts in a /v1/completions batch
    include_usage: bool = False  # the client asked for the stream's usage chunk


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
    """One parse at most; never raises. A body in `encoding` is inflated (at most `limit` bytes) first;
    a plain one larger than `parse_limit` is scanned instead of parsed."""
    info = RequestInfo()
    if parse_limit is not None and len(body) > parse_limit and (encoding or "identity").strip().lower() == "identity":
        return _scanned(body)
    if encoding and encoding.strip().lower() != "identity":
        inflated = inflated_copy(body, encoding, limit)
        if inflated is None:
            return info
        body = inflated
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return info
    if not isinstance(obj, dict):
        return info
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
    info.include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return info
