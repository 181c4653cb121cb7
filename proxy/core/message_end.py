"""Where the request being parsed ends in the bytes that came, so the shell can feed llhttp one at a time.

llhttp (httptools) parses everything it is given and cannot be stopped part-way, so a read full of
tiny pipelined requests would become that many parsed requests at once. The connection therefore
cuts what it feeds at each request's end: `cut` says how many bytes of `data` still belong to the
request in progress. The head's end is found by a scan; the body's framing is what llhttp parsed
from the head (`framed`), measured here by its length or walked chunk by chunk.

A wrong guess is harmless for correctness: llhttp parses at any split, and it alone judges the bytes.
A cut too early only costs one more feed; an unparsable chunk line stops the walk (llhttp rejects
that request anyway), so only a cut too late could let more requests be parsed ahead, never a
wrong parse.
"""

from __future__ import annotations

from proxy.core.http_head import head_end

__all__ = ["MessageEnd"]

_HEAD, _LENGTH, _CHUNK_LINE, _CHUNK_DATA, _TRAILERS, _UNKNOWN = range(6)
_MAX_LINE = 4096  # a chunk-size line or a trailer line longer than this: stop walking (llhttp judges)


class MessageEnd:
    """The framing of the request in progress, as far as the bytes seen so far."""

    __slots__ = ("_left", "_line", "_seen_head", "_state", "_tail")

    def __init__(self) -> None:
        self._state = _HEAD
        self._tail = b""  # the head's last bytes, or a partial chunk/trailer line
        self._seen_head = False  # a byte other than CR/LF of the head came (leading empty lines are not a head)
        self._left = 0
        self._line = b""

    # ---- what llhttp said ---------------------------------------------------------------------------

    def framed(self, length: int | None, chunked: bool) -> None:
        """The head was parsed: its body is `length` bytes, or chunked, or nothing."""
        self._tail = self._line = b""
        if chunked:
            self._state = _CHUNK_LINE
        elif length:
            self._state, self._left = _LENGTH, length
        else:
            self._state = _HEAD  # no body: the message ended with its head (`ended` follows)

    def ended(self) -> None:
        """The request is complete: what follows is the next one's head."""
        self._state, self._tail, self._line, self._seen_head = _HEAD, b"", b"", False

    # ---- where to cut -------------------------------------------------------------------------------

    def cut(self, data: bytes | memoryview) -> int:
        """How many bytes of `data` to feed so that the feed stops at the request's end (all of it
        when the end is not in `data`)."""
        state = self._state
        if state == _HEAD:
            return self._cut_head(data if type(data) is bytes else bytes(data))
        if state == _LENGTH:
            used = min(self._left, len(data))
            self._left -= used
            return used
        if state == _UNKNOWN:
            return len(data)
        return self._cut_chunks(bytes(data))

    def _cut_head(self, data: bytes) -> int:
        start = 0
        if not self._seen_head:
            start = len(data) - len(data.lstrip(b"\r\n"))
            if start == len(data):
                return len(data)
            self._seen_head = True
        window = self._tail + data[start:] if self._tail or start else data
        end = head_end(window)
        if end >= 0:
            behind, self._tail = len(self._tail), b""  # (the window starts that many bytes before `data`)
            return start + end - behind
        self._tail = window[-3:]
        return len(data)

    def _cut_chunks(self, data: bytes) -> int:
        at = 0
        while at < len(data):
            state = self._state
            if state == _CHUNK_DATA:
                used = min(self._left, len(data) - at)
                self._left -= used
                at += used
                if self._left == 0:
                    self._state = _CHUNK_LINE
                    self._line = b"\0"  # the CRLF after the data: a line of its own, skipped
                continue
            end = data.find(b"\n", at)
            line = self._line + data[at : len(data) if end < 0 else end]
            if len(line) > _MAX_LINE:
                self._state = _UNKNOWN
                return len(data)
            if end < 0:
                self._line = line
                return len(data)
            at, self._line = end + 1, b""
            line = line.rstrip(b"\r")
            if state == _TRAILERS:
                if not line:
                    self._state = _HEAD  # the end of the message (`ended` follows)
                    return at
                continue
            if line == b"\0":
                continue
            size = _chunk_size(line)
            if size is None:
                self._state = _UNKNOWN
                return len(data)
            if size == 0:
                self._state = _TRAILERS
            else:
                self._state, self._left = _CHUNK_DATA, size
        return len(data)


def _chunk_size(line: bytes) -> int | None:
    digits = line.split(b";", 1)[0].strip()
    try:
        return int(digits, 16) if digits else None
    except ValueError:
        return None
