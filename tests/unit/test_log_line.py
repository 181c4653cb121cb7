"""The request line rendered in one step is the line structlog's chain renders: same keys, same order,
same cleaning, same level filter; only the timestamp's instant differs."""

from __future__ import annotations

import io
import re

import orjson
import pytest

from proxy.observe.logs import make_logger

FIELDS = {
    "request_id": "abc", "path": "/v1/chat\x1b[31m\ud800" + "x" * 300, "status": 200, "model": None,
    "stream": False, "duration_ms": 1.5, "client": "127.0.0.1", "upstream_message": "bad\nline",
}  # fmt: skip
ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?Z")


def _both(level: str, logger_level: str = "debug", **context: str) -> tuple[list[str], list[str]]:
    fast, chain = io.StringIO(), io.StringIO()
    one = make_logger("json", logger_level, fast)
    other = make_logger("json", logger_level, chain)
    if context:
        one, other = one.bind(**context), other.bind(**context)
    one.line(level, "request", dict(FIELDS))
    getattr(other, level)("request", **FIELDS)
    return fast.getvalue().splitlines(), chain.getvalue().splitlines()


@pytest.mark.parametrize("level", ["debug", "info", "warning", "error"])
def test_the_one_step_line_is_the_chains_line(level: str) -> None:
    fast, chain = _both(level, worker="1", pid="42")
    assert len(fast) == len(chain) == 1
    got, want = orjson.loads(fast[0]), orjson.loads(chain[0])
    assert ISO_UTC.fullmatch(got.pop("timestamp"))
    want.pop("timestamp")
    assert list(got.items()) == list(want.items())  # the order too
    assert got["path"].startswith("/v1/chat\\x1b[31m\\ud800")
    assert len(got["path"]) < 300
    assert list(got)[:2] == ["worker", "pid"]


def test_a_level_below_the_loggers_writes_nothing() -> None:
    fast, chain = _both("info", logger_level="warning")
    assert fast == chain == []


def test_console_format_takes_the_chain() -> None:
    out = io.StringIO()
    make_logger("console", "info", out).line("info", "request", {"request_id": "abc", "status": 200})
    text = out.getvalue()
    assert "request" in text
    assert "request_id=abc" in text
    assert not text.startswith("{")
