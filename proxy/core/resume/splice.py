"""The continuation's body written into the client's own bytes: every field it does not change is
sent as the client wrote it (a 30-digit integer stays an integer, duplicate keys stay, spacing stays).

Re-serializing the parsed request turned big integers into floats, collapsed duplicate keys and
changed the body's size. Here the body, already known to be one JSON object, is
scanned for its top-level members, and only the values the continuation changes are replaced; new
members go before the closing brace. A changed key that occurs twice is replaced everywhere except
`messages`, whose last occurrence is the one a backend reads (last wins, as in Python's json).
"""

from __future__ import annotations

import re

import orjson

__all__ = ["Member", "elements", "members", "splice"]

_WS = re.compile(rb"[ \t\r\n]*")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_SCALAR = re.compile(rb"[^,\]}\s]+")

Member = tuple[str, int, int]  # key, value start, value end


def _ws(buf: bytes, i: int) -> int:
    match = _WS.match(buf, i)
    return match.end() if match else i


def _value_end(buf: bytes, i: int) -> int:
    head = buf[i : i + 1]
    if head == b'"':
        match = _STRING.match(buf, i)
        assert match is not None
        return match.end()
    if head in (b"{", b"["):
        depth = 0
        for token in _TOKEN.finditer(buf, i):
            text = token.group()
            if text in (b"{", b"["):
                depth += 1
            elif text in (b"}", b"]"):
                depth -= 1
                if depth == 0:
                    return token.end()
        raise ValueError("unterminated JSON value")
    match = _SCALAR.match(buf, i)
    assert match is not None
    return match.end()


def members(buf: bytes, start: int) -> tuple[list[Member], int]:
    """The members of the object at `start` (its `{`), and the index of its `}`."""
    out: list[Member] = []
    i = _ws(buf, start + 1)
    if buf[i : i + 1] == b"}":
        return out, i
    while True:
        key_end = _value_end(buf, i)
        key = orjson.loads(buf[i:key_end])
        i = _ws(buf, _ws(buf, key_end) + 1)  # past the colon
        end = _value_end(buf, i)
        out.append((key, i, end))
        i = _ws(buf, end)
        if buf[i : i + 1] == b"}":
            return out, i
        i = _ws(buf, i + 1)  # past the comma


def elements(buf: bytes, start: int) -> tuple[list[tuple[int, int]], int]:
    """The elements of the array at `start` (its `[`), and the index of its `]`."""
    out: list[tuple[int, int]] = []
    i = _ws(buf, start + 1)
    if buf[i : i + 1] == b"]":
        return out, i
    while True:
        end = _value_end(buf, i)
        out.append((i, end))
        i = _ws(buf, end)
        if buf[i : i + 1] == b"]":
            return out, i
        i = _ws(buf, i + 1)


def splice(
    body: bytes, replace: dict[str, bytes], *, append_message: bytes | None = None, last_content: bytes | None = None
) -> bytes:
    """`body` with every top-level `replace` key's value replaced (added before `}` when absent), and
    in the last `messages` either `append_message` added at the end or the last message's last
    `content` replaced by `last_content`."""
    top = _ws(body, 0)
    found, close = members(body, top)
    edits: list[tuple[int, int, bytes]] = []  # (start, end, new bytes), non-overlapping
    for key, start, end in found:
        if key in replace:
            edits.append((start, end, replace[key]))
    messages = [(start, end) for key, start, end in found if key == "messages"]
    if messages and (append_message is not None or last_content is not None):
        start, _ = messages[-1]
        items, array_close = elements(body, start)
        if append_message is not None:
            edits.append((array_close, array_close, (b"," if items else b"") + append_message))
        elif items:
            last_start, _ = items[-1]
            contents = [(s, e) for key, s, e in members(body, last_start)[0] if key == "content"]
            s, e = contents[-1]
            assert last_content is not None
            edits.append((s, e, last_content))
    present = {key for key, _, _ in found}
    added = b"".join(b"," + orjson.dumps(key) + b":" + value for key, value in replace.items() if key not in present)
    if added:
        edits.append((close, close, added if found else added[1:]))
    out, at = [], 0
    for start, end, new in sorted(edits, key=lambda edit: edit[0]):
        out.append(body[at:start])
        out.append(new)
        at = end
    out.append(body[at:])
    return b"".join(out)
