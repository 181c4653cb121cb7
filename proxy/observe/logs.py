"""Structured logging without global configuration: one logger object, passed in where needed.

Every line goes through structlog's processor chain, except the one written per exchange: the
`request` line is rendered in one step (`Logger.line`), the same fields in the same order as the
chain would give them (bound context, the fields, `event`, `level`, `timestamp`), strings cleaned
the same way. The chain costs ~10 % of a small request's CPU (a timestamper, a level adder, the
exception formatter and the cleaner each walk the event); the one-step line costs a third of that.
With `--log-format console` the line takes the chain (a terminal's reader is not in a hurry).

While the server runs (`Logger.hold_lines`), the lines written on its event loop are held and written
together once per loop turn, one system call for all of them (nginx's `access_log ... buffer=`): the
turn that wrote them ends with the write, so no line waits longer than that; `release_lines`, at
shutdown's end, writes what is held and writes through from then on. Lines of other threads are
written at once.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import re
import sys
import time
from typing import Any, TextIO

import orjson
import structlog

from proxy.observe.log_lines import Lines

__all__ = ["MAX_LOGGED_STRING", "Logger", "clean_text", "make_logger"]

MAX_LOGGED_STRING = 256
# Control characters (ANSI escapes included) and lone surrogates, which a client can put in a header
# or path: escaped so that no log line can be forged, colour a terminal, or fail to encode. (A raw
# string, `re` reading the escapes: a compiled build cannot hold a lone surrogate in a literal.)
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_RAW_KEYS = frozenset({"exception"})  # a traceback is ours, multi-line and wanted whole


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean_text(text: str) -> str:
    """A client-controlled string made safe to log: cut at 256 characters, control characters escaped."""
    if len(text) <= MAX_LOGGED_STRING and text.isascii() and text.isprintable():
        return text  # the common case: nothing to cut or escape (printable ASCII has no \x00-\x1f, \x7f)
    if len(text) > MAX_LOGGED_STRING:
        text = text[:MAX_LOGGED_STRING]
    return _UNSAFE.sub(_escape, text)


def _clean_strings(_: Any, __: str, event_dict: structlog.typing.EventDict) -> structlog.typing.EventDict:
    for key, value in event_dict.items():
        if type(value) is str and key not in _RAW_KEYS:
            event_dict[key] = clean_text(value)
    return event_dict

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _json_renderer(_: Any, __: str, event_dict: structlog.typing.EventDict) -> str:
    return orjson.dumps(event_dict, default=str).decode()


class _Clock:
    """structlog's `TimeStamper(fmt="iso", utc=True)` text, its seconds part made once a second."""

    __slots__ = ("_second", "_text")

    def __init__(self) -> None:
        self._second = -1
        self._text = ""

    def now(self) -> str:
        stamp = time.time()
        second = int(stamp)
        micro = int((stamp - second) * 1_000_000)
        if second != self._second:
            moment = datetime.datetime.fromtimestamp(second, tz=datetime.UTC)
            self._second, self._text = second, moment.isoformat().removesuffix("+00:00")
        return f"{self._text}.{micro:06d}Z" if micro else f"{self._text}Z"  # (isoformat drops a zero fraction)


class Logger:
    """structlog's bound logger (every method, `bind` included), plus `line`: one event in one step."""

    __slots__ = ("_bound", "_clock", "_context", "_json", "_lines", "_lowest")

    def __init__(
        self, bound: Any, lines: Lines, *, json: bool, lowest: int, context: dict[str, Any], clock: _Clock,
    ) -> None:
        self._bound = bound
        self._lines = lines
        self._json = json
        self._lowest = lowest
        self._context = context
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bound, name)

    def bind(self, **values: Any) -> Logger:
        return Logger(self._bound.bind(**values), self._lines, json=self._json, lowest=self._lowest,
                      context={**self._context, **values}, clock=self._clock)  # fmt: skip

    def hold_lines(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on the lines written on `loop`'s thread are written once per turn of it."""
        self._lines.hold(loop)

    def write_held(self) -> None:
        """What is held is written now (lines keep being held)."""
        self._lines.write_held()

    def release_lines(self) -> None:
        """What is held is written now, and every line from here on at once (shutdown's end)."""
        self._lines.release()

    def line(self, level: str, event: str, fields: dict[str, Any], *, external: tuple[str, ...] | None = None) -> None:
        """`getattr(logger, level)(event, **fields)`, the JSON line rendered without the chain.

        `fields` becomes the line itself (not copied): the caller hands over a dict it made for it.
        `external`: the only keys whose values can come from outside (a client, the upstream), the
        only ones cleaned besides the bound context's; None: every string is."""
        if _LEVELS[level] < self._lowest:
            return
        if not self._json:
            getattr(self._bound, level)(event, **fields)
            return
        out = {**self._context, **fields} if self._context else fields
        for key in out if external is None or self._context else external:
            value = out.get(key)  # (clean_text's own fast test, inlined: most values pass it)
            if (type(value) is str and not (len(value) <= MAX_LOGGED_STRING and value.isascii() and value.isprintable())
                    and key not in _RAW_KEYS):
                out[key] = clean_text(value)
        out["event"] = event
        out["level"] = level
        out["timestamp"] = self._clock.now()
        self._lines.write(orjson.dumps(out, default=str).decode() + "\n")


def make_logger(fmt: str = "json", level: str = "info", stream: TextIO | None = None) -> Logger:
    """A structlog logger writing one line per event to `stream` (stderr by default)."""
    renderer: structlog.typing.Processor = (
        _json_renderer if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    lines = Lines(stream or sys.stderr)
    bound = structlog.wrap_logger(
        structlog.WriteLogger(lines),  # type: ignore[arg-type]  # (a file as far as it goes: write, flush)
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,  # a bug's traceback goes to the operator's log only
            _clean_strings,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        cache_logger_on_first_use=True,
    )
    return Logger(bound, lines, json=fmt == "json", lowest=_LEVELS[level], context={}, clock=_Clock())
