"""Where a request's head (request line and headers) ends, and whether it stays within its bound.

Sans-IO: fed the connection's bytes as they arrive, at any split. The parser (aiohttp's) still does
the parsing; this only measures, so that the total size of a head is bounded (aiohttp bounds each
line, not their sum) and the header timeout knows when the head is complete.
"""

from __future__ import annotations

__all__ = ["HeadScanner", "HeadTooLarge", "framing_error"]

_ENDS = (b"\r\n\r\n", b"\n\n")


class HeadTooLarge(Exception):
    """The head grew past the bound before it ended."""


class HeadScanner:
    __slots__ = ("_limit", "_tail", "size")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._tail = b""  # the last bytes seen, so that an end split across reads is found
        self.size = 0  # head bytes seen so far (leading empty lines included)

    def feed(self, data: bytes) -> bool:
        """True when the head ended within `data`; raises HeadTooLarge past the bound."""
        window = self._tail + data
        ends = [i + len(end) for end in _ENDS if (i := window.find(end)) >= 0]
        if ends:
            used = min(ends) - len(self._tail)
            self.size += used
            self._tail = b""
            if self.size > self._limit:
                raise HeadTooLarge
            return True
        self.size += len(data)
        if self.size > self._limit:
            raise HeadTooLarge
        self._tail = window[-3:]
        return False


def framing_error(version: tuple[int, int], transfer_encoding: str | None) -> str | None:
    """Why a request's body framing is refused (for its 400), or None.

    `Transfer-Encoding` is HTTP/1.1's: an HTTP/1.0 message that carries it is framed differently by
    each hop that reads it (RFC 9112 section 6.1), which is how requests are smuggled; nginx refuses it.
    """
    if transfer_encoding is not None and version < (1, 1):
        return "Transfer-Encoding is not allowed in an HTTP/1.0 request"
    return None
