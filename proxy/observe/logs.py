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
from collections.abc import Callable
from typing import Any, TextIO

import orjson
import structlog
from orjson import OPT_APPEND_NEWLINE, dumps

from proxy.observe.log_lines import Lines

__all__ = ["MAX_LOGGED_STRING", "LineWriter", "Logger", "clean_text", "make_logger"]

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

_wall_clock = time.time  # (the request line's names bound once: a global, not a module's attribute, each line)
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
        stamp = _wall_clock()
        second = int(stamp)
        micro = int((stamp - second) * 1_000_000)
        if second != self._second:
            moment = datetime.datetime.fromtimestamp(second, tz=datetime.UTC)
            self._second, self._text = second, moment.isoformat().removesuffix("+00:00")
        if not micro:
            return f"{self._text}Z"  # (isoformat drops a zero fraction)
        # The six digits, zero-padded, as `{micro:06d}` gives them without a format spec's parse.
        return f"{self._text}.{str(micro + 1_000_000)[1:]}Z"


class LineWriter:
    """`Logger.line`'s one step, in an object of its own: a class with `__getattr__` (the Logger) has
    every attribute lookup go through the hook's slow path, this one's are plain slot reads."""

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

    def bind(self, bound: Any, values: dict[str, Any]) -> LineWriter:
        # The context's strings are cleaned here, once, rather than in every line that carries them.
        cleaned = {key: clean_text(value) if type(value) is str else value for key, value in values.items()}
        return LineWriter(bound, self._lines, json=self._json, lowest=self._lowest,
                          context={**self._context, **cleaned}, clock=self._clock)  # fmt: skip

    def drops(self, level: str) -> bool:
        """A line at `level` is not written (below the logger's level)."""
        return _LEVELS[level] < self._lowest

    def line(self, level: str, event: str, fields: dict[str, Any], *, external: tuple[str, ...] | None = None) -> None:
        """`getattr(logger, level)(event, **fields)`, the JSON line rendered without the chain.

        `fields` becomes the line itself (not copied): the caller hands over a dict it made for it.
        `external`: the only keys whose values can come from outside (a client, the upstream), the
        only ones cleaned (the bound context's were, when bound); None: every string is; `()`: the
        caller found every one of them clean already."""
        if _LEVELS[level] < self._lowest:
            return
        if not self._json:
            getattr(self._bound, level)(event, **fields)
            return
        if external is None:
            external = tuple(fields)
        for key in external:
            value = fields.get(key)  # (clean_text's own fast test, inlined: most values pass it)
            if (type(value) is str and not (len(value) <= MAX_LOGGED_STRING and value.isascii() and value.isprintable())
                    and key not in _RAW_KEYS):
                fields[key] = clean_text(value)
        out = {**self._context, **fields} if self._context else fields
        out["event"] = event
        out["level"] = level
        out["timestamp"] = self._clock.now()
        self._lines.write(dumps(out, default=str, option=OPT_APPEND_NEWLINE).decode())


class Logger:
    """structlog's bound logger (every method, `bind` included), plus `line`: one event in one step
    (its `writer`'s, which also says whether a level's line would be written at all)."""

    __slots__ = ("_bound", "_lines", "line", "writer")

    def __init__(self, bound: Any, lines: Lines, writer: LineWriter) -> None:
        self._bound = bound
        self._lines = lines
        self.writer = writer  # (its methods called directly, compiled: no call through an attribute)
        self.line: Callable[..., None] = writer.line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bound, name)

    def bind(self, **values: Any) -> Logger:
        bound = self._bound.bind(**values)
        return Logger(bound, self._lines, self.writer.bind(bound, values))

    def hold_lines(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on the lines written on `loop`'s thread are written once per turn of it."""
        self._lines.hold(loop)

    def write_held(self) -> None:
        """What is held is written now (lines keep being held)."""
        self._lines.write_held()

    def release_lines(self) -> None:
        """What is held is written now, and every line from here on at once (shutdown's end)."""
        self._lines.release()


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
    writer = LineWriter(bound, lines, json=fmt == "json", lowest=_LEVELS[level], context={}, clock=_Clock())
    return Logger(bound, lines, writer)
