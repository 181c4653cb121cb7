"""How a request picks its misbehaviour: ``x-fault: cut;after=3`` or the model ``fault/cut;after=3``.

The model-name form exists so that SDK users, who cannot easily add headers per call, can pick a
scenario too. The header wins when both are given.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiohttp import web

from proxy.tools.fake.generation import BadRequest

__all__ = ["ATTEMPTS", "FAULT_HEADER", "FAULT_KEY_HEADER", "MODEL_PREFIX", "Attempts", "Fault", "select_fault"]

FAULT_HEADER = "x-fault"
FAULT_KEY_HEADER = "x-fault-key"
MODEL_PREFIX = "fault/"


@dataclass(frozen=True, slots=True)
class Fault:
    """A scenario name and its raw parameters, read with typed, validating getters."""

    name: str
    params: Mapping[str, str] = field(default_factory=dict)

    def integer(self, key: str, default: int, *, minimum: int = 0, maximum: int | None = None) -> int:
        raw = self.params.get(key)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise BadRequest(f"fault parameter '{key}' must be an integer, got {raw!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            raise BadRequest(f"fault parameter '{key}' must be {bounds}, got {value}")
        return value

    def number(self, key: str, default: float) -> float:
        raw = self.params.get(key)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise BadRequest(f"fault parameter '{key}' must be a number, got {raw!r}") from None
        if not math.isfinite(value) or value < 0:
            raise BadRequest(f"fault parameter '{key}' must be a finite number >= 0, got {raw!r}")
        return value

    def choice(self, key: str, options: tuple[str, ...]) -> str:
        """One of ``options`` (the first is the default)."""
        value = self.params.get(key, options[0])
        if value not in options:
            raise BadRequest(f"fault parameter '{key}' must be one of {', '.join(options)}, got {value!r}")
        return value

    def flag(self, key: str) -> bool:
        return self.choice(key, ("0", "1")) == "1"


def parse_fault(text: str) -> Fault:
    """``name;key=value;key=value`` (spaces around parts are ignored)."""
    name, *parts = (part.strip() for part in text.split(";"))
    if not name:
        raise BadRequest("empty fault name")
    params: dict[str, str] = {}
    for part in parts:
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise BadRequest(f"fault parameter {part!r} must look like key=value")
        params[key.strip()] = value.strip()
    return Fault(name, params)


def select_fault(headers: Mapping[str, str], body: object) -> Fault | None:
    """The fault this request asks for, from the header or else the magic model name."""
    header = headers.get(FAULT_HEADER)
    if header is not None and header.strip():
        return parse_fault(header)
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(model, str) and model.startswith(MODEL_PREFIX):
        return parse_fault(model[len(MODEL_PREFIX) :])
    return None


ONCE_KEYS = 10_000  # requests ``once=1`` remembers: the oldest are forgotten first


class Attempts:
    """Counts attempts per key, for ``fail_first`` and ``once=1`` (one per app, under ``app[ATTEMPTS]``)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._seen: dict[str, None] = {}  # insertion-ordered: a bounded memory of requests already broken

    def first(self, headers: Mapping[str, str]) -> bool:
        """Whether this is a request's first attempt, for ``once=1``: a retry or a continuation carries
        the same ``x-fault-key``, else the same ``X-Request-Id`` (the proxy sends its id on both). A
        request with neither is always a first attempt."""
        key = headers.get(FAULT_KEY_HEADER) or headers.get("X-Request-Id")
        if not key:
            return True
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > ONCE_KEYS:
            del self._seen[next(iter(self._seen))]
        return True

    def next(self, headers: Mapping[str, str], body: bytes) -> int:
        """The 1-based number of this attempt for its key (``x-fault-key``, else the body's hash)."""
        key = headers.get(FAULT_KEY_HEADER) or hashlib.sha256(body).hexdigest()
        self._counts[key] = count = self._counts.get(key, 0) + 1
        return count


ATTEMPTS: web.AppKey[Attempts] = web.AppKey("fake_attempts", Attempts)
