"""Header rules at the proxy boundary: hop-by-hop removal both ways, and the forwarding headers."""

from __future__ import annotations

from collections.abc import Sequence

from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["HOP_BY_HOP", "is_chunked", "request_headers", "response_headers"]

# RFC 9110 7.6.1 plus the classic extras; Proxy-Authorization is end-to-end here.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
)
# Written by the upstream connection for the bytes it sends; `Expect: 100-continue` was already answered to
# the client, and the proxy sends the upstream a body it holds whole (curl asks for it above 1 KiB).
_REQUEST_DROP = frozenset({"host", "content-length", "expect"})
# What each direction drops besides what `Connection` names, built once rather than per request.
_DROP_REQUEST = HOP_BY_HOP | _REQUEST_DROP
_DROP_REQUEST_IDENTITY = _DROP_REQUEST | {"accept-encoding"}
# The request headers the forwarding rules look at (their lower-cased names).
_NOTED = frozenset({"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-request-id", "authorization"})
# Up to this many request headers, a pass over them costs less than a copy thinned by name (both
# builds; `scripts/count_instructions.py`'s client sends 3, the openai SDK 15).
_FEW_HEADERS = 5
_DROP_RESPONSE = HOP_BY_HOP
_DROP_REWRITTEN = HOP_BY_HOP | {"content-length", "content-encoding", "content-type"}


def _named_by_connection(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> set[str]:
    named: set[str] = set()
    for value in headers.getall("Connection", ()):
        named.update(token.strip().lower() for token in value.split(",") if token.strip())
    return named


def _end_to_end(headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """The headers whose lower-cased names are not in `drop` nor named by `Connection` (`connection`
    is in every `drop`: without one of its names, the copy is the answer)."""
    if headers.keys().isdisjoint(drop):  # (compared case-insensitively, as multidict compares names)
        return CIMultiDict(headers)
    if "Connection" in headers:
        drop = drop | _named_by_connection(headers)
    return CIMultiDict([(name, value) for name, value in headers.items() if name.lower() not in drop])


def request_headers(
    headers: CIMultiDictProxy[str], *, client_ip: str | None, scheme: str, host: str | None, request_id: str,
    identity: bool = False, authorization: str | None = None,
) -> CIMultiDict[str]:
    """What goes upstream: the client's end-to-end headers plus X-Forwarded-* and X-Request-Id.

    Names with an underscore are dropped, as nginx does by default (`underscores_in_headers off`): a
    backend that reads headers CGI-style folds `X_Api_Key` and `X-Api-Key` into one name, so one could
    pass for the other past a check in front of the proxy. `identity`: no `Accept-Encoding` goes
    (the answer is asked for uncompressed); `authorization`: sent when the client sent none.

    Two ways to the same headers in the same order, by what costs less: a few headers (curl's) are
    kept in one pass, the result made at once; many (an SDK sends 15 or more) are copied whole and
    what is not forwarded is taken out by name, multidict's work rather than a Python step each.
    """
    drop = _DROP_REQUEST_IDENTITY if identity else _DROP_REQUEST
    if "Connection" in headers:
        drop = drop | _named_by_connection(headers)
    if len(headers) <= _FEW_HEADERS:
        return _kept_one_by_one(headers, drop, client_ip, scheme, host, request_id, authorization)
    out = CIMultiDict(headers)
    for name in out.keys() & drop:
        out.popall(name, None)  # (a name sent in two spellings is met twice)
    if "_" in "".join(headers):  # (rare: one look at all the names)
        for name in [name for name in out if "_" in name]:
            out.popall(name, None)
    if client_ip:
        prior = ", ".join(out.popall("X-Forwarded-For", ()))
        out["X-Forwarded-For"] = f"{prior}, {client_ip}" if prior else client_ip
    # A sidecar usually sits behind an ingress that already set these: keep the outermost view.
    out.setdefault("X-Forwarded-Proto", scheme)
    if host:
        out.setdefault("X-Forwarded-Host", host)
    out["X-Request-Id"] = request_id  # (in the place of the client's first one, the others gone)
    if authorization and "Authorization" not in out:
        out["Authorization"] = authorization
    return out


def _kept_one_by_one(
    headers: CIMultiDictProxy[str], drop: frozenset[str], client_ip: str | None, scheme: str, host: str | None,
    request_id: str, authorization: str | None,
) -> CIMultiDict[str]:
    """`request_headers` for a few headers: what the copy's operations above give, in one pass."""
    pairs: list[tuple[str, str]] = []
    prior: list[str] = []  # the X-Forwarded-For values the client sent (when its address is added)
    proto = forwarded_host = sent_authorization = sent_id = False
    for name, value in headers.items():
        low = name.lower()
        if low in drop or "_" in name:
            continue
        if low in _NOTED:
            if low == "x-forwarded-for":
                if client_ip:
                    prior.append(value)
                    continue
            elif low == "x-request-id":
                if not sent_id:
                    pairs.append(("X-Request-Id", request_id))
                    sent_id = True
                continue
            elif low == "x-forwarded-proto":
                proto = True
            elif low == "x-forwarded-host":
                forwarded_host = True
            else:  # authorization
                sent_authorization = True
        pairs.append((name, value))
    if client_ip:
        joined = ", ".join(prior)
        pairs.append(("X-Forwarded-For", f"{joined}, {client_ip}" if joined else client_ip))
    if not proto:
        pairs.append(("X-Forwarded-Proto", scheme))
    if host and not forwarded_host:
        pairs.append(("X-Forwarded-Host", host))
    if not sent_id:
        pairs.append(("X-Request-Id", request_id))
    if authorization and not sent_authorization:
        pairs.append(("Authorization", authorization))
    return CIMultiDict(pairs)


def response_headers(headers: CIMultiDictProxy[str] | CIMultiDict[str], *, body_rewritten: bool) -> CIMultiDict[str]:
    """What goes back to the client: the upstream's end-to-end headers.

    When the proxy sends a body other than the upstream's, the length and encoding headers that
    described the upstream's bytes are dropped (the client writer frames the body it sends).
    """
    return _end_to_end(headers, _DROP_REWRITTEN if body_rewritten else _DROP_RESPONSE)


def is_chunked(transfer_encodings: Sequence[str]) -> bool:
    """A message is chunked when `chunked` is the final coding of its `Transfer-Encoding` list, matched
    as a whole token (RFC 9112 6.3): `chunked, gzip` and `xchunked` are not (a response is then framed
    by the close), however the word is spelled inside."""
    if not transfer_encodings:  # (the common case: no such header)
        return False
    codings = [token.strip().lower() for value in transfer_encodings for token in value.split(",")]
    codings = [token for token in codings if token]
    return bool(codings) and codings[-1] == "chunked"
