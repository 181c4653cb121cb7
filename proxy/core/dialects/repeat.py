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

A second leaf may vary too: an integer (the Responses API's `sequence_number`, one more each event).
It is read from the bytes only when it is a plain non-negative integer of at most 18 digits (what
orjson reads as that same int); the largest one a run saw is `number`, for the dialect's state.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

__all__ = ["ContentTemplate"]

# A non-empty JSON string body, unquoted: no quote, backslash or control character except the
# two-character escapes. `\u` escapes (surrogates!) are left to the parser.
_PLAIN_TEXT = re.compile(rb"[\x20\x21\x23-\x5b\x5d-\x7f]+")  # no escape: the common text, the quickest check
_ASCII_TEXT = re.compile(rb'(?:[\x20\x21\x23-\x5b\x5d-\x7f]|\\["\\/bfnrt])+')
_ANY_TEXT = re.compile(rb'(?:[\x20\x21\x23-\x5b\x5d-\xff]|\\["\\/bfnrt])+')
_MARK = "\x01\x02streamwarden-text\x03"  # stands in for the leaf while locating it
_MARK_JSON = orjson.dumps(_MARK)[1:-1]
_NUM_MARK = "\x01\x02streamwarden-number\x03"  # stands in for the integer leaf
_NUM_MARK_JSON = orjson.dumps(_NUM_MARK)  # (with its quotes: a number has none)
_TRIES = 4  # events that may fail to become a template before a stream stops trying


class ContentTemplate:
    """The bytes around the text leaf of one content event; `run` counts repeats of it."""

    __slots__ = ("_event_head", "_event_tail", "_head", "_mid", "_num_first", "_tail", "_tries", "number")

    def __init__(self) -> None:
        self._head: bytes | None = None
        self._tail = b""
        self._mid: bytes | None = None  # with an integer leaf: the bytes between the two leaves
        self._num_first = False  # the integer comes before the text
        self.number = -1  # the largest integer leaf the last `run` or `matches` saw (-1: none)
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
        if self._mid is None:
            return _text(data, a, b)
        number = self._slots(data, a, b)
        if number < 0:
            return False
        self.number = number
        return True

    def _slots(self, data: bytes, a: int, b: int) -> int:
        """`data[a:b]` is a text leaf, the middle bytes and an integer leaf (in the template's order):
        the integer, else -1. (Digits hold no byte of the middle, which starts with `,`/`}` or a
        quote and ends with `:`, so the middle is found next to the digits whenever they are valid.)"""
        mid = self._mid
        assert mid is not None
        if self._num_first:
            i = data.find(mid, a, min(b, a + 18 + len(mid)))
            c = i + len(mid)
            if i < 0 or not _number(data, a, i) or not _text(data, c, b):
                return -1
            return int(data[a:i])
        i = data.rfind(mid, a, b)
        c = i + len(mid)
        if i < 0 or not _number(data, c, b) or not _text(data, a, i):
            return -1
        return int(data[c:b])

    def run(self, chunk: bytes, start: int, limit: int) -> tuple[int, int]:
        """How many whole one-line SSE events `data: <a match>\\n\\n`, each at most `limit` bytes, follow
        each other from `start` on, and the offset after the last."""
        head, tail = self._event_head, self._event_tail
        if not head:
            return 0, start
        if self._mid is not None:
            return self._run_numbered(chunk, start, limit)
        n = len(chunk)
        if (n - start <= limit and chunk.startswith(head, start) and chunk.endswith(tail)
                and _PLAIN_TEXT.fullmatch(chunk, start + len(head), n - len(tail)) is not None):  # fmt: skip
            return 1, n  # the rest is one event (the usual read): its text holds no LF, it ends with the tail
        pos, count = start, 0
        skip, keep = len(head), len(tail)
        while pos < n and chunk.startswith(head, pos):
            # No CR or LF in head, text or tail but the blank line that ends tail: the event ends at
            # the first one.
            end = chunk.find(b"\n\n", pos + skip) + 2
            if end < 2 or end - pos > limit or not chunk.endswith(tail, pos, end):
                break
            a, b = pos + skip, end - keep
            if _PLAIN_TEXT.fullmatch(chunk, a, b) is None and not _text(chunk, a, b):  # (the usual text first)
                break
            pos = end
            count += 1
        return count, pos

    def _run_numbered(self, chunk: bytes, start: int, limit: int) -> tuple[int, int]:
        """`run` for a template with an integer leaf; `number` is the largest one the run saw."""
        head, tail = self._event_head, self._event_tail
        n, pos, count, top = len(chunk), start, 0, -1
        skip, keep = len(head), len(tail)
        while pos < n and chunk.startswith(head, pos):
            end = chunk.find(b"\n\n", pos + skip) + 2
            if end < 2 or end - pos > limit or not chunk.endswith(tail, pos, end):
                break
            number = self._slots(chunk, pos + skip, end - keep)
            if number < 0:
                break
            if number > top:
                top = number
            pos = end
            count += 1
        self.number = top
        return count, pos

    def learn(
        self,
        data: bytes,
        obj: dict[str, Any],
        holder: dict[str, Any],
        key: str,
        *,
        number: tuple[dict[str, Any], str] | None = None,
        prefix: bytes = b"data: ",
        raw: bytes | None = None,
    ) -> None:
        """`obj` (parsed from `data`) was content whose text is `holder[key]`, a non-empty string, and
        whose state effects are idempotent: make it the template, if `data` is in canonical form.

        `number` names an integer leaf that may vary too (its effect must be idempotent given the
        largest value). `prefix` is the event's bytes before its data (`event: <name>\n` lines too);
        with `raw`, the event's whole bytes, it must be exactly `prefix`, `data` and a blank line."""
        if self._tries <= 0 or self.matches(data, 0, len(data)):
            return
        self._head = self._mid = None
        self._event_head = self._event_tail = b""
        if raw is not None and (len(raw) != len(prefix) + len(data) + 2 or not raw.startswith(prefix)
                                or not raw.endswith(b"\n\n")):  # fmt: skip
            self._tries -= 1
            return
        text = holder[key]
        value: Any = None
        holder[key] = _MARK
        if number is not None:
            value = number[0][number[1]]
            number[0][number[1]] = _NUM_MARK
        try:
            marked = orjson.dumps(obj)
        except TypeError:  # orjson's JSONEncodeError: nested deeper than it writes (it reads deeper)
            self._tries -= 1
            return
        finally:
            holder[key] = text
            if number is not None:
                number[0][number[1]] = value
        i = marked.find(_MARK_JSON)
        if i < 0 or marked.find(_MARK_JSON, i + 1) >= 0:
            self._tries -= 1
            return
        head, tail = marked[:i], marked[i + len(_MARK_JSON) :]
        body = orjson.dumps(text)[1:-1]
        if number is None:
            if data != head + body + tail:
                self._tries -= 1
                return
        else:
            if not (type(value) is int and 0 <= value < 10**18):
                self._tries -= 1
                return
            digits = b"%d" % value
            j = tail.find(_NUM_MARK_JSON)
            k = head.find(_NUM_MARK_JSON)
            if j >= 0 and k < 0 and tail.find(_NUM_MARK_JSON, j + 1) < 0:  # the text first
                mid, tail = tail[:j], tail[j + len(_NUM_MARK_JSON) :]
                whole = head + body + mid + digits + tail
                first = False
            elif k >= 0 and j < 0 and head.find(_NUM_MARK_JSON, k + 1) < 0:  # the integer first
                head, mid = head[:k], head[k + len(_NUM_MARK_JSON) :]
                whole = head + digits + mid + body + tail
                first = True
            else:
                self._tries -= 1
                return
            if data != whole or not mid:
                self._tries -= 1
                return
            self._mid, self._num_first = mid, first
        self._head, self._tail = head, tail
        self._event_head, self._event_tail = prefix + head, tail + b"\n\n"


def _number(data: bytes, a: int, b: int) -> bool:
    """`data[a:b]` is a JSON integer that orjson reads as a non-negative int below 10**18."""
    return 0 < b - a <= 18 and data[a:b].isdigit() and (data[a] != 0x30 or b - a == 1)


def _text(data: bytes, a: int, b: int) -> bool:
    """`data[a:b]` is a non-empty JSON string body that orjson reads (as a non-empty string)."""
    if _PLAIN_TEXT.fullmatch(data, a, b) is not None:
        return True
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
