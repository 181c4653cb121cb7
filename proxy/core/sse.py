"""Sans-IO Server-Sent Events reader: bytes in, whole events (with their exact bytes) out.

No asyncio here. The reader is fed whatever the socket produced and hands back complete events, so
that the proxy can forward each one byte for byte and only ever cut a stream at an event boundary.

Parsing follows WHATWG HTML "parsing an event stream": lines end with LF, CRLF or CR (mixed), an empty
line ends a block, one leading BOM is dropped. Every block is returned, comment-only and empty ones too,
so keep-alives pass through; the ``raw`` of all items, concatenated, is the input minus the BOM, minus
the partial event still buffered (see ``pending``).

Two choices the spec leaves to us:

* **A CR at the end of the data fed so far.** A block whose blank line ends in CR is dispatched at once
  rather than waiting to see whether an LF follows (that could stall an event until the next one
  arrives). If the next byte is that LF, it belongs to the CRLF: it is not a line end of its own and
  becomes the first byte of the next item's ``raw``, so the client still gets the same bytes in the
  same order. Where a chunk boundary splits a CRLF therefore decides which of two items holds the LF;
  the fields parsed never change. If the stream ends right after such an LF, ``close()`` returns it as
  a field-less ``Event(raw=b"\\n")`` rather than dropping it.
* **A stray HTTP response in the body** (a backend that wrote a second status line after an error) is
  returned as a ``StatusBlock``; a partial event before it is discarded (if that partial began with a
  CRLF's LF as above, the LF is returned first as ``Event(raw=b"\\n")``). Its body is bounded by
  ``Content-Length`` when given; otherwise it ends at the first empty line after some body content (a
  backend that keeps the socket open must not hang us) or, failing that, at the end of the stream.
  SSE parsing then resumes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Event", "EventTooLarge", "SSEReader", "StatusBlock"]


@dataclass(slots=True)
class Event:
    """One SSE event (or comment-only block) exactly as the upstream sent it.

    ``raw`` holds every byte of the block including its terminating blank line (a leading BOM is not
    part of it). ``data`` is the spec's data buffer: the ``data:`` values joined by LF, without the
    final LF. ``has_data`` tells a block with an empty ``data:`` line from one with none at all.
    """

    raw: bytes
    event: str | None = None
    data: bytes = b""
    has_data: bool = False
    id: str | None = None
    retry: str | None = None


@dataclass(slots=True)
class StatusBlock:
    """An ``HTTP/1.x NNN reason`` response that a broken backend wrote into the SSE body."""

    raw: bytes
    status: int
    reason: str
    headers: dict[str, str]
    body: bytes


class EventTooLarge(Exception):
    """A single event (or status block) grew beyond the reader's bound.

    `complete` holds the items that the same feed completed before the oversized one, so that a
    caller can still deliver them: what the client gets must not depend on how reads were split.
    """

    def __init__(self, message: str, complete: list[Event | StatusBlock] | None = None) -> None:
        super().__init__(message)
        self.complete: list[Event | StatusBlock] = complete or []


_BOM = b"\xef\xbb\xbf"
_CONTENT = re.compile(rb"[^\r\n]")
_STATUS = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: ([^\r\n]*))?(?=[\r\n]|\Z)")
_LF, _CR = 10, 13


@dataclass(slots=True)
class _Status:
    """A status line and headers already parsed, waiting for the body (offsets from the block start)."""

    status: int
    reason: str
    headers: dict[str, str]
    length: int | None
    head: int  # size of status line + headers + blank line: where the body starts
    content: int = -1  # first non-blank body byte, once seen (bodies without Content-Length)


class SSEReader:
    """Feed it upstream bytes; it returns every complete block as an ``Event`` or ``StatusBlock``.

    After ``EventTooLarge`` the reader is in an unspecified state and must not be fed again.
    """

    __slots__ = ("_at_start", "_buf", "_cr", "_lead", "_max", "_scan", "_skip_lf", "_status")

    def __init__(self, max_event_size: int = 8 * 1024 * 1024) -> None:
        if max_event_size < 1:
            raise ValueError("max_event_size must be positive")
        self._max = max_event_size
        self._buf = bytearray()  # bytes of the current, incomplete item (block start at offset 0)
        self._scan = 0  # offset in the item from which the search for its end resumes
        self._lead = 0  # 1 when the item starts with the LF of a CRLF whose CR ended the previous one
        self._skip_lf = False  # the last item ended with a CR at the very end of the data fed
        self._cr = False  # a CR was seen: use the general line-end search (LF-only streams use find)
        self._at_start = True  # the leading-BOM question is not settled yet
        self._status: _Status | None = None

    @property
    def pending(self) -> int:
        """Bytes buffered that ``close()`` would drop: the partial event, if any."""
        n = len(self._buf)
        if self._status is not None or (self._lead and n == 1):
            return 0
        if n and not self._at_start:
            h = _find_status(self._buf, self._lead, n)
            if h >= 0:
                return h - self._lead
        return n

    @property
    def idle(self) -> bool:
        """Nothing buffered or pending and only LF line ends so far: a chunk of whole one-line
        ``data: `` events (with no CR) is then read as exactly those events, leaving this state as is."""
        return not self._buf and not self._lead and not self._skip_lf and not self._cr and not self._at_start \
            and self._status is None

    def pending_event(self) -> bytes | None:
        """The start of an event left from earlier reads, when that is all the state there is (an
        LF-only stream, no status block, no CRLF half); None otherwise."""
        if not self._buf or self._lead or self._skip_lf or self._cr or self._at_start or self._status is not None:
            return None
        return bytes(self._buf)

    def discard_pending(self) -> None:
        """The caller completed the pending event itself (with bytes it then does not feed)."""
        self._buf.clear()
        self._scan = 0

    def feed(self, chunk: bytes) -> list[Event | StatusBlock]:
        """Take the next bytes of the stream; return the items they complete, in order."""
        n = len(chunk)
        if (n <= self._max and chunk.startswith(b"data: ") and chunk.find(b"\n") == n - 2 and chunk.endswith(b"\n\n")
                and self.idle and b"\r" not in chunk):  # fmt: skip
            # The usual read: one whole one-line `data:` event, nothing buffered, no CR ever (what
            # `_run` and `_parse_event` make of it, and the state stays idle).
            return [Event(chunk, None, chunk[6:-2], True)]
        if self._at_start:
            chunk = self._strip_bom(chunk)
        if not chunk:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if chunk[0] == _LF:
                self._lead = 1
        if not self._cr and b"\r" in chunk:
            self._cr = True
        buf = self._buf
        data: bytes | bytearray
        if buf:
            buf += chunk
            data = buf
        else:
            data = chunk  # common case: work on the chunk itself, copy only a leftover tail
        items: list[Event | StatusBlock] = []
        try:
            pos = self._run(data, items)
        except EventTooLarge as exc:
            exc.complete = items
            raise
        if data is buf:
            del buf[:pos]
        elif pos < len(data):
            self._buf = bytearray(memoryview(data)[pos:])
        if len(self._buf) > self._max:
            raise EventTooLarge(f"more than {self._max} bytes buffered for one event", items)
        return items

    def close(self) -> list[Event | StatusBlock]:
        """End of stream: flush a status block (its body runs to here); drop a partial event."""
        data, lead, st = self._buf, self._lead, self._status
        self._buf, self._scan, self._lead, self._skip_lf, self._status = bytearray(), 0, 0, False, None
        n = len(data)
        if st is not None:
            return [StatusBlock(bytes(data), st.status, st.reason, st.headers, bytes(data[st.head :]))]
        if lead and n == 1:
            return [Event(b"\n")]
        h = _find_status(data, lead, n) if n and not self._at_start else -1
        if h < 0:
            return []
        i = _find_blank(data, h)
        head_end = _blank_end(data, i) if i >= 0 else n
        status, reason, headers = _parse_head(data, h, head_end)
        block = StatusBlock(bytes(data[h:]), status, reason, headers, bytes(data[head_end:]))
        return [Event(b"\n"), block] if lead else [block]

    def _strip_bom(self, chunk: bytes) -> bytes:
        """Drop one BOM at the very start of the stream, even if it arrives a byte at a time."""
        if self._buf:
            chunk = bytes(self._buf) + chunk
            self._buf.clear()
        if len(chunk) < len(_BOM) and _BOM.startswith(chunk):
            self._buf += chunk
            return b""
        self._at_start = False
        return chunk[len(_BOM) :] if chunk.startswith(_BOM) else chunk

    def _run(self, data: bytes | bytearray, items: list[Event | StatusBlock]) -> int:
        """Append the items complete in ``data``; return the offset where the incomplete rest starts."""
        n = len(data)
        pos = 0
        while pos < n:
            status = self._status  # (a local: compiled, a narrowed attribute would stay narrowed past the call)
            if status is not None:
                pos = self._status_body(data, pos, items)
                if self._status is status:  # still incomplete
                    break
                continue
            c = pos + self._lead
            if c >= n:
                break
            b = data[c]
            if b == _LF:  # a lone blank line
                end = c + 1
            elif b == _CR:
                end = c + 2 if c + 1 < n and data[c + 1] == _LF else c + 1
            else:
                start = pos + self._scan
                if start < c:
                    start = c
                if self._cr:
                    start = _find_blank(data, start)
                    if start < 0:
                        self._scan = max(c, n - 1) - pos
                        break
                    end = _blank_end(data, start)
                else:
                    start = data.find(b"\n\n", start)
                    if start < 0:
                        self._scan = max(c, n - 1) - pos
                        break
                    end = start + 2
                if end - pos > self._max:
                    raise EventTooLarge(f"event larger than {self._max} bytes")
                if data.find(b"HTTP/1.", c, end) >= 0 and (h := _find_status(data, c, end)) >= 0:
                    if end == n and data[end - 1] == _CR:
                        # The headers' blank line may be a CRLF cut in two: wait for the next byte so
                        # that the body (which Content-Length counts exactly) starts in the right place.
                        self._scan = start - pos
                        break
                    if self._lead:  # a CRLF's LF (see the module docstring) is not part of what is dropped
                        items.append(Event(b"\n"))
                    self._begin_status(data, h, end)
                    pos = h  # the partial event before the status line is discarded
                    continue
            items.append(_parse_event(bytes(data[pos:end]), self._lead, self._cr))
            self._lead = 0
            self._scan = 0
            pos = end
            if end == n and data[end - 1] == _CR:
                self._skip_lf = True
        return pos

    def _begin_status(self, data: bytes | bytearray, h: int, end: int) -> None:
        """Parse the status line and headers in ``data[h:end]``; the body comes next."""
        status, reason, headers = _parse_head(data, h, end)
        cl = headers.get("content-length", "")
        length = int(cl) if cl.isdigit() and cl.isascii() else None
        self._status = _Status(status, reason, headers, length, end - h)
        self._lead = 0
        self._scan = 0

    def _status_body(self, data: bytes | bytearray, pos: int, items: list[Event | StatusBlock]) -> int:
        """Complete the pending status block at ``pos`` if its body is all here; return the new offset."""
        st = self._status
        assert st is not None
        n = len(data)
        body_at = pos + st.head
        if st.length is not None:
            body_end = end = body_at + st.length
            if end > n:
                return pos
        else:
            if st.content < 0:
                m = _CONTENT.search(data, max(body_at, pos + self._scan))
                if m is None:
                    self._scan = n - pos
                    return pos
                st.content = m.start() - pos
                self._scan = st.content
            i = _find_blank(data, pos + self._scan)
            if i < 0:
                self._scan = n - 1 - pos
                return pos
            end = _blank_end(data, i)
            body_end = i - 1 if data[i] == _LF and data[i - 1] == _CR else i
            if end == n and data[end - 1] == _CR:
                self._skip_lf = True
        if end - pos > self._max:
            raise EventTooLarge(f"status block larger than {self._max} bytes")
        items.append(StatusBlock(bytes(data[pos:end]), st.status, st.reason, st.headers, bytes(data[body_at:body_end])))
        self._status = None
        self._scan = 0
        return end


def _find_blank(data: bytes | bytearray, start: int) -> int:
    """Offset of the first line end from ``start`` on that is followed by an empty line, or -1.

    An LF always ends a line and a CR does unless an LF follows, so such a pair starts at an LF followed
    by CR or LF, or at a CR followed by a CR (a CRLF is one line end and never matches). Searching for LF
    with ``find`` and checking the next byte is several times quicker than a regex on CRLF streams.
    """
    n = len(data)
    i = data.find(b"\n", start)
    while 0 <= i < n - 1 and data[i + 1] != _CR and data[i + 1] != _LF:
        i = data.find(b"\n", i + 2)
    if i == n - 1:
        i = -1  # the byte after this LF is not here yet
    j = data.find(b"\r\r", start, i + 1 if i >= 0 else n)
    return j if j >= 0 else i


def _blank_end(data: bytes | bytearray, i: int) -> int:
    """End of the empty line after the line end that ``_find_blank`` found at ``i``."""
    if data[i + 1] == _LF:
        return i + 2
    return i + 3 if i + 2 < len(data) and data[i + 2] == _LF else i + 2


def _find_status(data: bytes | bytearray, start: int, end: int) -> int:
    """Offset of the first status line that starts a line in ``data[start:end]``, or -1."""
    i = data.find(b"HTTP/1.", start, end)
    while i >= 0:
        if (i == start or data[i - 1] in (_LF, _CR)) and _STATUS.match(data, i, end):
            return i
        i = data.find(b"HTTP/1.", i + 1, end)
    return -1


def _parse_head(data: bytes | bytearray, h: int, end: int) -> tuple[int, str, dict[str, str]]:
    """Status, reason and headers (names lower-cased, repeats joined by ", ") of ``data[h:end]``."""
    lines = bytes(data[h:end]).splitlines()
    m = _STATUS.match(lines[0])
    assert m is not None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            continue
        key = name.strip().decode("latin-1").lower()
        text = value.strip().decode("utf-8", "replace")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return int(m[1]), (m[2] or b"").decode("utf-8", "replace"), headers


def _parse_event(raw: bytes, lead: int, cr: bool) -> Event:
    """Interpret the fields of one complete block (``lead``: a continuation LF to skip).

    ``cr`` is False when the stream has had no CR so far, which makes the one-line check cheaper.
    """
    if raw.startswith(b"data: "):  # the usual one-line "data: ...", checked without a split
        n = len(raw)
        if cr:
            if raw.find(b"\r") == n - 4 and raw.find(b"\n") == n - 3 and raw.endswith(b"\r\n\r\n"):
                return Event(raw, None, raw[6:-4], True)
        elif raw.find(b"\n") == n - 2:
            return Event(raw, None, raw[6:-2], True)
    event = ident = retry = None
    lines: list[bytes] | None = None
    for line in (raw[lead:] if lead else raw).splitlines():
        if not line or line[0] == 58:  # blank line or ":" comment
            continue
        name, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            if lines is None:
                lines = [value]
            else:
                lines.append(value)
        elif name == b"event":
            event = value.decode("utf-8", "replace")
        elif name == b"id":
            if b"\0" not in value:
                ident = value.decode("utf-8", "replace")
        elif name == b"retry" and value.isdigit():
            retry = value.decode("ascii")
    if lines is None:
        return Event(raw, event, b"", False, ident, retry)
    return Event(raw, event, lines[0] if len(lines) == 1 else b"\n".join(lines), True, ident, retry)
