"""The request line rendered in one step is the line structlog's chain renders: same keys, same order,
same cleaning, same level filter; only the timestamp's instant differs."""

from __future__ import annotations

import asyncio
import contextlib
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


class _CountingFile(io.StringIO):
    """A file that counts its writes (each one a system call on a real file)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


async def test_held_lines_go_out_in_one_write_per_loop_turn_in_their_order() -> None:
    out = _CountingFile()
    logger = make_logger("json", "debug", out)
    logger.hold_lines(asyncio.get_running_loop())
    for n in range(5):
        logger.line("info", "request", {"n": n})
        logger.warning("chain", n=n)  # structlog's chain: the same file, the same order
    assert out.getvalue() == ""  # held until the turn ends
    await asyncio.sleep(0)  # one turn
    await asyncio.sleep(0)
    lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
    assert [(line["event"], line["n"]) for line in lines] == [(e, n) for n in range(5) for e in ("request", "chain")]
    assert out.writes == 1


async def test_releasing_writes_what_is_held_and_then_writes_through() -> None:
    out = _CountingFile()
    logger = make_logger("json", "debug", out)
    logger.hold_lines(asyncio.get_running_loop())
    logger.line("info", "request", {"n": 1})
    logger.release_lines()  # shutdown's end: nothing held is lost
    assert len(out.getvalue().splitlines()) == 1
    logger.warning("stopped")
    assert len(out.getvalue().splitlines()) == 2


async def test_a_line_of_another_thread_is_written_at_once() -> None:
    out = _CountingFile()
    logger = make_logger("json", "debug", out)
    logger.hold_lines(asyncio.get_running_loop())
    await asyncio.to_thread(logger.warning, "tracing_error")
    assert len(out.getvalue().splitlines()) == 1



def test_every_text_the_books_write_in_a_request_line_is_cleaned() -> None:
    """The books tell the line which of its fields can carry outside text (only those are cleaned):
    every text field of the record is made hostile here, so a field added to the line without being
    named there fails this test."""
    from proxy.core.lifecycle import Outcome, Reason
    from proxy.core.record import ExchangeRecord
    from proxy.observe.books import Books
    from proxy.observe.metrics import Metrics

    dirty = "x\x1b[31m\x7f\ud800" + "y" * 300
    ex = ExchangeRecord(dirty, dirty, dirty, "chat_completions", dirty)
    hints: dict[str, object] = getattr(ExchangeRecord, "__annotations__", {})
    for name in [name for name in dir(ex) if not name.startswith("_") and not callable(getattr(ex, name))]:
        if name == "api":  # (the api is the dialect's name: ours)
            continue
        hint = hints.get(name)
        if isinstance(hint, str):
            if hint in ("str", "str | None"):
                setattr(ex, name, dirty)
        else:  # compiled, the annotation is gone, and the attribute's own type check tells
            with contextlib.suppress(TypeError):
                setattr(ex, name, dirty)
    ex.client_request_id = None  # (with an extra field, the line cleans every string anyway)
    ex.outcome, ex.reason, ex.status = Outcome.ERROR, Reason.UPSTREAM_ERROR_FRAME, 502
    out = io.StringIO()
    Books(Metrics(), make_logger("json", "debug", out)).finish(ex)
    line = out.getvalue()
    assert line.count("\n") == 1
    assert line.isascii()
    assert "\x1b" not in line
    assert "\x7f" not in line
    texts = {key: value for key, value in orjson.loads(line).items() if isinstance(value, str) and "y" * 9 in value}
    assert {"request_id", "method", "path", "model", "client", "upstream_message", "cause"} <= set(texts)
    for key, value in texts.items():
        assert value.startswith("x\\x1b[31m\\x7f\\ud800"), key  # escaped
        assert len(value) < 300, key  # and cut at 256 characters
