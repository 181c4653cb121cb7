"""Structured logging without global configuration: one logger object, passed in where needed."""

from __future__ import annotations

import logging
import re
import sys
from typing import Any, TextIO

import orjson
import structlog

__all__ = ["MAX_LOGGED_STRING", "clean_text", "make_logger"]

MAX_LOGGED_STRING = 256
# Control characters (ANSI escapes included) and lone surrogates, which a client can put in a header
# or path: escaped so that no log line can be forged, colour a terminal, or fail to encode.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_RAW_KEYS = frozenset({"exception"})  # a traceback is ours, multi-line and wanted whole


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean_text(text: str) -> str:
    """A client-controlled string made safe to log: cut at 256 characters, control characters escaped."""
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


def make_logger(fmt: str = "json", level: str = "info", stream: TextIO | None = None) -> Any:
    """A structlog logger writing one line per event to `stream` (stderr by default)."""
    renderer: structlog.typing.Processor = (
        _json_renderer if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    return structlog.wrap_logger(
        structlog.WriteLogger(stream or sys.stderr),
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
