"""Structured logging without global configuration: one logger object, passed in where needed."""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import orjson
import structlog

__all__ = ["make_logger"]

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
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        cache_logger_on_first_use=True,
    )
