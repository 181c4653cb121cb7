"""Recognise a content event that repeats the previous one but for its text, without parsing it.

A backend streams hundreds of content events that differ only in one string: the generated text
(`{"id":"x",...,"choices":[{"index":0,"delta":{"content":" word"},...}]}`). Parsing each one to find
that out is most of what the guard spends per event. A `ContentTemplate` keeps the bytes before and
after that string in an event the dialect already parsed and classified; an event made of the same
bytes around another valid, non-empty JSON string parses to the same object but for that one leaf,
so its verdict and its effect on the stream's state are known without a parse.

The head and tail come from re-encoding the parsed object with a marker as its text, so they are
valid JSON around one string slot whatever the upstream's own spelling was; a template is kept only
when the event itself is in that compact form (else no later event would match it: a backend that
writes spaces costs a few re-encodings per stream, then none). A string that is not plainly valid
(a `\\u` escape, a control character, bytes that are not UTF-8) is never judged here: the caller
parses it whole.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

__all__ = ["ContentTemplate"]

# A non-empty JSON string body, unquoted: no quote, backslash or control character except the
# two-character escapes. `\u` escapes (surrogates!) are left to the parser.
_ASCII_TEXT = re.compile(rb'(?:[\x20\x21\x23-\x5b\x5d-\x7f]|\\["\\/bfnrt])+')
_ANY_TEXT = re.compile(rb'(?:[\x20\x21\x23-\x5b\x5d-\xff]|\\["\\/bfnrt])+')
_MARK = "\x01\x02streamwarden-text\x03"  # stands in for the leaf while locating it
_MARK_JSON = orjson.dumps(_MARK)[1:-1]
_TRIES = 4  # events that may fail to become a template before a stream stops trying


class ContentTemplate:
    """The bytes around the text leaf of one content event; `run` counts repeats of it."""

    __slots__ = ("_event_head", "_event_tail", "_head", "_tail", "_tries")

    def __init__(self) -> None:
        self._head: bytes | None = None
        self._tail = b""
        self._event_head = b""  # `data: ` + head: a whole one-line SSE event's bytes before the text
        self._event_tail = b""  # tail + the blank line
        self._tries = _TRIES  # a backend whose events are never canonical costs a few re-encodings only

    @property
    def hopeful(self) -> bool:
        """A template is kept, or may still be learnt."""
        return self._head is not None or self._tries > 0

    def matches(self, data: bytes, start: int, end: int) -> bool:
        """`data[start:end]` is the template's bytes with another valid, non-empty JSON string as the text."""
        head = self._head
        if head is None:
            return False
        a = start + len(head)
        b = end - len(self._tail)
        if b <= a or not data.startswith(head, start, a) or not data.endswith(self._tail, b, end):
            return False
        return _text(data, a, b)

    def run(self, chunk: bytes, start: int, limit: int) -> tuple[int, int]:
        """How many whole one-line SSE events `data: <a match>\\n\\n`, each at most `limit` bytes, follow
        each other from `start` on, and the offset after the last."""
        head, tail = self._event_head, self._event_tail
        if not head:
            return 0, start
        n, pos, count = len(chunk), start, 0
        skip, keep = len(head), len(tail)
        while pos < n and chunk.startswith(head, pos):
            # No CR or LF in head, text or tail but the blank line that ends tail: the event ends at
            # the first one.
            end = chunk.find(b"\n\n", pos + skip) + 2
            if end < 2 or end - pos > limit or not chunk.endswith(tail, pos, end):
                break
            if not _text(chunk, pos + skip, end - keep):
                break
            pos = end
            count += 1
        return count, pos

    def learn(self, data: bytes, obj: dict[str, Any], holder: dict[str, Any], key: str) -> None:
        """`obj` (parsed from `data`) was content whose text is `holder[key]`, a non-empty string, and
        whose state effects are idempotent: make it the template, if `data` is in canonical form."""
        if self._tries <= 0 or self.matches(data, 0, len(data)):
            return
        self._head = None
        self._event_head = self._event_tail = b""
        text = holder[key]
        holder[key] = _MARK
        try:
            marked = orjson.dumps(obj)
        except TypeError:  # orjson's JSONEncodeError: nested deeper than it writes (it reads deeper)
            self._tries -= 1
            return
        finally:
            holder[key] = text
        i = marked.find(_MARK_JSON)
        if i < 0 or marked.find(_MARK_JSON, i + 1) >= 0:
            self._tries -= 1
            return
        head, tail = marked[:i], marked[i + len(_MARK_JSON) :]
        if data != head + orjson.dumps(text)[1:-1] + tail:
            self._tries -= 1
            return
        self._head, self._tail = head, tail
        self._event_head, self._event_tail = b"data: " + head, tail + b"\n\n"


def _text(data: bytes, a: int, b: int) -> bool:
    """`data[a:b]` is a non-empty JSON string body that orjson reads (as a non-empty string)."""
    if b <= a:
        return False
    if _ASCII_TEXT.fullmatch(data, a, b) is not None:
        return True
    if _ANY_TEXT.fullmatch(data, a, b) is None:
        return False
    try:
        data[a:b].decode("utf-8")  # orjson refuses what Python's strict decoder refuses
    except UnicodeDecodeError:
        return False
    return True
