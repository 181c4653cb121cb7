"""Where the request being parsed ends in the bytes that came, so the shell can feed llhttp one at a time.

llhttp (httptools) parses everything it is given and cannot be stopped part-way, so a read full of
tiny pipelined requests would become that many parsed requests at once. The connection therefore
cuts what it feeds at each request's end: `cut` says where in `data` the request in progress ends
(or the end of `data` when it does not end there). The head's end is found by a scan; the body's
framing is what llhttp parsed from the head (`framed`), measured here by its length or walked chunk
by chunk.

The walk keeps nothing of a line but what it needs: a chunk size's significant digits (at most the
16 llhttp accepts), and whether a trailer line is the empty one. A chunk extension, the leading
zeros of a size and a trailer line are skipped up to their LF however long they are (llhttp accepts
them all), so no line can make the walk give up. Where the bytes are not a chunked body llhttp would
accept (no size digit, a size past 64 bits, a CR not followed by LF) the walk is `Framing.UNKNOWN`:
llhttp rejects that request, and until it does the walk cuts at each LF, so that no read is fed
whole while its framing is unknown (one line cannot hold the end of more than one request).

A wrong guess is harmless for correctness: llhttp parses at any split, and it alone judges the bytes.
A cut too early only costs one more feed; a cut too late could let more requests be parsed ahead,
never a wrong parse.
"""

from __future__ import annotations

import re
from enum import IntEnum

from proxy.core.http_head import head_end

__all__ = ["Framing", "MessageEnd"]

_CR, _LF = 13, 10
_CR_LF = (_CR, _LF)
_MAX_DIGITS = 16  # significant hex digits of a chunk size: llhttp's is a uint64 (more: "Chunk size overflow")
_LEADING = re.compile(rb"[\r\n]*")  # empty lines before a request (RFC 9112 2.2)
_ZEROS = re.compile(rb"0*")
_HEX = re.compile(rb"[0-9A-Fa-f]*")


class Framing(IntEnum):
    """Where the walk stands in the request in progress; each state's next is set in `MessageEnd`.

    HEAD: scanning for the head's end. LENGTH: a body of announced length. SIZE: a chunk-size line's
    digits. EXTENSION: the rest of a chunk-size line (extensions, CR), skipped. DATA: a chunk's data.
    DATA_END: the CRLF after a chunk's data, skipped. TRAILER_START: the first byte of a trailer line,
    or of the empty line that ends the message. TRAILER_CR: that line began with CR. TRAILER: a trailer
    line, skipped. UNKNOWN: bytes llhttp rejects, cut at each LF until it does.
    """

    HEAD = 0
    LENGTH = 1
    SIZE = 2
    EXTENSION = 3
    DATA = 4
    DATA_END = 5
    TRAILER_START = 6
    TRAILER_CR = 7
    TRAILER = 8
    UNKNOWN = 9


class MessageEnd:
    """The framing of the request in progress, as far as the bytes seen so far."""

    __slots__ = ("_digits", "_left", "_seen_head", "_size", "_state", "_tail")

    def __init__(self) -> None:
        self._state = Framing.HEAD
        self._tail = b""  # the head's last bytes (at most 3), so that an end split across reads is found
        self._seen_head = False  # a byte other than CR/LF of the head came (leading empty lines are not a head)
        self._left = 0  # the body's or the chunk's bytes still to come
        self._size = 0  # the chunk size read so far
        self._digits = -1  # its significant digits so far (-1: no digit yet, not even a zero)

    @property
    def state(self) -> Framing:
        return self._state

    # ---- what llhttp said ---------------------------------------------------------------------------

    def framed(self, length: int | None, chunked: bool) -> None:
        """The head was parsed: its body is `length` bytes, or chunked, or nothing."""
        self._tail = b""
        if chunked:
            self._chunk_line()
        elif length:
            self._state, self._left = Framing.LENGTH, length
        else:
            self._state = Framing.HEAD  # no body: the message ended with its head (`ended` follows)

    def ended(self) -> None:
        """The request is complete: what follows is the next one's head."""
        self._state, self._tail, self._seen_head = Framing.HEAD, b"", False

    # ---- where to cut -------------------------------------------------------------------------------

    def cut(self, data: bytes, at: int = 0) -> int:
        """Where to stop feeding `data[at:]` so that the feed stops at the request's end: that end's
        offset in `data`, or `len(data)` when the end is not in it. Always past `at`."""
        state = self._state
        if state is Framing.HEAD:
            return self._cut_head(data, at)
        if state is Framing.LENGTH:
            used = min(self._left, len(data) - at)
            self._left -= used
            return at + used
        return self._cut_chunks(data, at)

    def _cut_head(self, data: bytes, at: int) -> int:
        size = len(data)
        if not self._seen_head:
            if at < size and data[at] in _CR_LF:  # (the usual: a request's first byte, no empty line before)
                match = _LEADING.match(data, at)
                at = match.end() if match is not None else at
            if at == size:
                return size
            self._seen_head = True
        tail = self._tail
        if tail:  # an end that straddles the reads: the tail and this read's first bytes
            end = head_end(tail + data[at : at + 3])
            if end >= 0:
                self._tail = b""
                return at + end - len(tail)
        end = head_end(data, at)
        if end >= 0:
            self._tail = b""
            return end
        self._tail = (tail + data[max(at, size - 3) :])[-3:]
        return size

    def _cut_chunks(self, data: bytes, at: int) -> int:
        size = len(data)
        while at < size:
            state = self._state
            if state is Framing.DATA:
                used = min(self._left, size - at)
                self._left -= used
                at += used
                if self._left == 0:
                    self._state = Framing.DATA_END
                continue
            if state is Framing.SIZE:
                at = self._read_size(data, at)
                continue
            if state is Framing.TRAILER_START or state is Framing.TRAILER_CR:
                byte = data[at]
                at += 1
                if byte == _LF:  # the empty line (CRLF, or a bare LF llhttp judges): the message's end
                    self._state = Framing.HEAD
                    return at
                if byte == _CR and state is Framing.TRAILER_START:
                    self._state = Framing.TRAILER_CR
                elif byte == _LF or state is Framing.TRAILER_CR:
                    self._state = Framing.UNKNOWN  # a CR without its LF: llhttp rejects it
                    at -= 1
                else:
                    self._state = Framing.TRAILER
                continue
            # A line skipped up to its LF: an extension, the CRLF after data, a trailer, or unknown bytes.
            end = data.find(b"\n", at)
            if end < 0:
                return size
            at = end + 1
            if state is Framing.EXTENSION:
                if self._size == 0:
                    self._state = Framing.TRAILER_START
                else:
                    self._state, self._left = Framing.DATA, self._size
            elif state is Framing.DATA_END:
                self._chunk_line()
            elif state is Framing.TRAILER:
                self._state = Framing.TRAILER_START
            else:
                return at  # UNKNOWN: one line at a time, until llhttp rejects the request
        return size

    def _chunk_line(self) -> None:
        self._state, self._size, self._digits = Framing.SIZE, 0, -1

    def _read_size(self, data: bytes, at: int) -> int:
        """A chunk size's digits from `at`: the leading zeros skipped, at most 16 significant digits
        kept. Where the digits end the line goes on as an extension (or unknown, without a digit)."""
        if self._digits <= 0:  # (no significant digit yet: zeros lead)
            zeros = _ZEROS.match(data, at)
            if zeros is not None and zeros.end() > at:
                at, self._digits = zeros.end(), 0
        match = _HEX.match(data, at, at + _MAX_DIGITS + 1 - max(self._digits, 0))
        end = match.end() if match is not None else at
        if end > at:
            self._size = (self._size << 4 * (end - at)) | int(data[at:end], 16)
            self._digits = max(self._digits, 0) + end - at
            if self._digits > _MAX_DIGITS:
                self._state = Framing.UNKNOWN  # llhttp: "Chunk size overflow"
                return end
        if end < len(data):  # the digits ended here
            self._state = Framing.EXTENSION if self._digits >= 0 else Framing.UNKNOWN
        return end
