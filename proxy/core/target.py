"""The part of a client's request target that is pasted after the upstream's base URL.

The proxy only ever talks to its configured upstream, so only a path and query may come from the
client. An absolute-form target (`POST http://x/v1/chat/completions`, RFC 9112 section 3.2.2)
is forwarded as its path and query; any other scheme, the authority and asterisk forms, and a path
whose dot segments climb above the root (which would escape a path prefix in `--upstream`) are
refused. Everything else goes on byte for byte as the client sent it.
"""

from __future__ import annotations

import re

__all__ = ["BadTarget", "forwarded_target"]

_ABSOLUTE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://[^/?#]*")
_DOT = re.compile(r"%2e", re.IGNORECASE)


class BadTarget(ValueError):
    """The message says why, for the client's 400."""


def forwarded_target(raw: str) -> str:
    """`raw` is the request line's target; returns the origin-form to forward, or raises BadTarget."""
    if not raw.startswith("/"):
        match = _ABSOLUTE.match(raw)
        if match is None:
            raise BadTarget("the request target must be a path such as /v1/chat/completions")
        if match.group(1).lower() not in ("http", "https"):
            raise BadTarget(f"the request target's scheme {match.group(1)[:20]!r} is not http or https")
        raw = raw[match.end() :]
        if not raw.startswith("/"):
            raw = "/" + raw
    if _climbs_above_root(raw):
        raise BadTarget("the request path climbs above the root with '..' segments")
    return raw


def _climbs_above_root(target: str) -> bool:
    path = target.split("?", 1)[0]
    if "." not in path and "%" not in path:
        return False  # the common case, without splitting
    depth = 0
    for segment in path.split("/")[1:]:
        name = _DOT.sub(".", segment)
        if name == "..":
            if depth == 0:
                return True
            depth -= 1
        elif name != ".":
            depth += 1
    return False
