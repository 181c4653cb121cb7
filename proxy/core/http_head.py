"""Where a request's head (request line and headers) ends, and whether it stays within its bound.

Sans-IO: fed the connection's bytes as they arrive, at any split. llhttp (the main port's parser)
does the parsing; this only measures, so that the total size of a head is bounded (as nginx's
large_client_header_buffers bound it) and the header timeout knows when the head is complete.
"""

from __future__ import annotations

__all__ = [
    "MAX_HEADERS", "HeadScanner", "HeadTooLarge", "framing_error", "head_end", "head_refusal", "request_line_refusal",
]


# Header fields in one request (its trailers included): 10,000 one-byte fields fit in a head of
# --max-header-size and would all be forwarded. Apache (LimitRequestFields), HAProxy (tune.http.maxhdr)
# and Envoy (max_headers_count) all allow 100; more is a 431.
MAX_HEADERS = 100


def head_end(data: bytes, start: int = 0) -> int:
    """Where the first head in `data[start:]` ends: the index after its empty line (CRLF CRLF, or a
    bare LF LF, which llhttp accepts too), or -1. The bare form is looked for only before the CRLF one."""
    crlf = data.find(b"\r\n\r\n", start)
    lf = data.find(b"\n\n", start, crlf + 4) if crlf >= 0 else data.find(b"\n\n", start)
    if lf >= 0 and (crlf < 0 or lf + 2 < crlf + 4):
        return lf + 2
    return crlf + 4 if crlf >= 0 else -1


class HeadTooLarge(Exception):
    """The head grew past the bound before it ended."""


class HeadScanner:
    __slots__ = ("_limit", "_line", "_tail", "request_line", "size")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._tail = b""  # the last bytes seen, so that an end split across reads is found
        self._line = b""  # the request line so far, until its end is seen
        self.request_line: bytes | None = None  # once complete, without its line end
        self.size = 0  # head bytes seen so far (leading empty lines included)

    def feed(self, data: bytes) -> bool:
        """True when the head ended within `data`; raises HeadTooLarge past the bound."""
        if self.request_line is None:
            self._find_request_line(data)
        tail = self._tail
        if not tail:  # (the usual: the head's start, or all of it, in this read)
            end = head_end(data)
            if end >= 0:
                self.size += end
                if self.size > self._limit:
                    raise HeadTooLarge
                return True
            window = data
        else:
            window = tail + data
            end = head_end(window)
            if end >= 0:
                self.size += end - len(tail)
                self._tail = b""
                if self.size > self._limit:
                    raise HeadTooLarge
                return True
        self.size += len(data)
        if self.size > self._limit:
            raise HeadTooLarge
        self._tail = window[-3:]
        return False

    def _find_request_line(self, data: bytes) -> None:
        line = (self._line + data if self._line else data).lstrip(b"\r\n")  # empty lines before a request are
        end = line.find(b"\n")  # ignored (RFC 9112 2.2)
        if end < 0:
            self._line = line  # bounded with the head: the caller stops feeding past the limit
            return
        self.request_line = line[:end].rstrip(b"\r")
        self._line = b""


def framing_error(version: tuple[int, int], transfer_encoding: str | None) -> str | None:
    """Why a request's body framing is refused (for its 400), or None.

    `Transfer-Encoding` is HTTP/1.1's: an HTTP/1.0 message that carries it is framed differently by
    each hop that reads it (RFC 9112 section 6.1), which is how requests are smuggled; nginx refuses it.
    """
    if transfer_encoding is not None and version < (1, 1):
        return "Transfer-Encoding is not allowed in an HTTP/1.0 request"
    return None


_PHRASES = {405: "the TRACE method is not allowed", 505: "only HTTP/1.0 and HTTP/1.1 are served on this port"}


def request_line_refusal(line: bytes) -> tuple[int, str] | None:
    """The status and message of a request line nginx refuses though it parses, or None.

    A version other than HTTP/1.x gets 505 (the answer would be framed as HTTP/1 anyway), and TRACE
    gets 405: it would echo the request's headers, credentials included, back from the backend.
    Anything malformed is left to the HTTP parser, which answers 400.
    """
    parts = line.split(b" ")
    if len(parts) != 3:
        return None
    method, _target, version = parts
    if version.startswith(b"HTTP/") and not version.startswith(b"HTTP/1."):
        return 505, _PHRASES[505]
    if method == b"TRACE":
        return 405, _PHRASES[405]
    return None


_NOT_CHUNKED = "only the chunked transfer coding is implemented for request bodies"


def head_refusal(
    method: str, version: tuple[int, int], target: str, headers: list[tuple[str, str]]
) -> tuple[int, str] | None:
    """The status and message of a parsed request head nginx refuses, or None.

    Checked on every request, a pipelined one too (the request-line check above sees only a
    connection's first): TRACE 405, a version other than HTTP/1.x 505; HTTP/1.1 without exactly one
    `Host`, an absolute-form target with userinfo, `Expect` twice: 400 (each is a way for two hops
    to disagree on the target or the framing); a `Transfer-Encoding` other than exactly `chunked`:
    501, as nginx, at once (the body's length cannot be known, RFC 9112 6.3).
    """
    if version[0] != 1:
        return 505, _PHRASES[505]
    if method == "TRACE":
        return 405, _PHRASES[405]
    hosts = expects = 0
    codings: list[str] = []
    for name, value in headers:  # one pass, the names compared by length first (most are neither)
        size = len(name)
        if size == 4 and name.lower() == "host":
            hosts += 1
        elif size == 6 and name.lower() == "expect":
            expects += 1
        elif size == 17 and name.lower() == "transfer-encoding":
            codings.append(value)
    if hosts > 1:
        return 400, "the request has more than one Host header"
    if hosts == 0 and version >= (1, 1):
        return 400, "an HTTP/1.1 request must have a Host header"
    if expects > 1:
        return 400, "the request has more than one Expect header"
    if not target.startswith("/") and "@" in target.partition("://")[2].split("/", 1)[0].split("?", 1)[0]:
        return 400, "the request target must not carry userinfo"
    if codings and version >= (1, 1) and ", ".join(codings).strip().lower() != "chunked":
        return 501, _NOT_CHUNKED
    return None
