"""The fake upstream's fast mode: a raw-asyncio chat backend that is never the limit of a benchmark.

The aiohttp fake (``proxy.tools.fake.app``) spends tens of µs per event in aiohttp's response machinery, so
at tens of thousands of events per second it, not the proxy in front of it, would set the figure. This
one parses just enough HTTP/1.1 (keep-alive, Content-Length request bodies) to serve
``POST /v1/chat/completions`` and ``GET /v1/models``, and writes each SSE event, a ~200-byte chat chunk
in its chunked-encoding frame, with one ``transport.write``: one socket write per event, like a GPU
backend that flushes every token.

The model name picks the pace: ``...-<N>ms`` sleeps N ms before each content chunk (``fast-20ms``:
20 ms per token); anything else streams without delay, yielding to the loop between events so that
concurrent streams interleave. ``max_tokens`` (default 100) is the number of content chunks; a stream
is the role chunk, the content chunks, the finish chunk, the usage chunk when
``stream_options.include_usage`` is set, and ``[DONE]``: 104 events for 100 tokens.

For the abandon test, a stream sent with ``x-fast-record: 1`` and an ``X-Request-Id`` is noted: when its
connection closed before the stream ended (CLOCK_MONOTONIC, shared by all processes on Linux), or that
it ended first. ``GET /_fast/closes`` answers ``{"closed": {request_id: time}, "ended": [request_id]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import socket
import time
from typing import cast

import orjson

__all__ = ["FastFake", "main", "serve", "start"]

MAX_HEAD = 64 * 1024
MAX_BODY = 16 * 1024 * 1024
_DELAY = re.compile(r"-(\d{1,5})ms$")
_WORD = "token "


def _delay(model: str) -> float:
    match = _DELAY.search(model)
    return int(match.group(1)) / 1000 if match else 0.0


def _chunk(payload: bytes) -> bytes:
    """One SSE event in one HTTP chunk."""
    event = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def _response(status: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status.encode(), len(body), extra, body)  # fmt: skip


class FastFake:
    """The server's shared state: the abandoned streams seen so far."""

    def __init__(self) -> None:
        self.closed: dict[str, float] = {}
        self.ended: list[str] = []


class _Connection(asyncio.Protocol):
    """One client connection: requests one after another, each answered by a task."""

    def __init__(self, fake: FastFake) -> None:
        self._fake = fake
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._busy = False
        self._closed = False
        self._writable = asyncio.Event()
        self._writable.set()
        self._stream_id: str | None = None  # the request whose stream is being written
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        with contextlib.suppress(OSError):
            self._transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self._busy:
            self._next()

    def eof_received(self) -> bool:
        self._gone()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone()
        self._writable.set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def _gone(self) -> None:
        if not self._closed:
            self._closed = True
            if self._stream_id is not None:
                self._fake.closed[self._stream_id] = time.monotonic()
            if self._task is not None:
                self._task.cancel()

    def _next(self) -> None:
        """Start answering the next complete request in the buffer, if there is one."""
        assert self._transport is not None
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD:
                self._fail("431 Request Header Fields Too Large", "request head too large")
            return
        lines = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if len(parts) != 3 or "transfer-encoding" in headers:
            self._fail("400 Bad Request", "only HTTP/1.1 requests with a Content-Length body are served")
            return
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self._fail("400 Bad Request", "bad Content-Length")
            return
        if len(self._buffer) < end + 4 + length:
            return
        body = bytes(self._buffer[end + 4 : end + 4 + length])
        del self._buffer[: end + 4 + length]
        self._busy = True
        self._task = asyncio.get_running_loop().create_task(self._answer(parts[0], parts[1], headers, body))

    def _fail(self, status: str, message: str) -> None:
        assert self._transport is not None
        body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error"}})
        self._transport.write(_response(status, body, b"Connection: close\r\n"))
        self._transport.close()
        self._closed = True

    async def _answer(self, method: str, target: str, headers: dict[str, str], body: bytes) -> None:
        assert self._transport is not None
        path = target.split("?", 1)[0].removeprefix("/v1")
        try:
            if method == "POST" and path == "/chat/completions":
                await self._chat(headers, body)
            elif method == "GET" and path == "/models":
                models = [{"id": "fast", "object": "model", "owned_by": "streamwarden"}]
                self._transport.write(_response("200 OK", orjson.dumps({"object": "list", "data": models})))
            elif method == "GET" and path == "/_fast/closes":
                closes = {"closed": self._fake.closed, "ended": self._fake.ended}
                self._transport.write(_response("200 OK", orjson.dumps(closes)))
            else:
                self._fail("404 Not Found", f"the fast fake serves POST /v1/chat/completions, not {method} {path}")
                return
        except asyncio.CancelledError:
            return  # the client left; `_gone` noted it
        except _BadRequest as exc:
            self._fail("400 Bad Request", str(exc))
            return
        self._stream_id = None
        self._busy = False
        self._task = None
        if headers.get("connection", "").lower() == "close":
            self._transport.close()
            self._closed = True
        elif not self._closed:
            self._next()

    async def _chat(self, headers: dict[str, str], body: bytes) -> None:
        assert self._transport is not None
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise _BadRequest("the request body is not valid JSON") from None
        if not isinstance(request, dict):
            raise _BadRequest("the request body must be a JSON object")
        model = str(request.get("model", "fast"))
        tokens = request.get("max_tokens", 100)
        if not isinstance(tokens, int) or not 1 <= tokens <= 100_000:
            raise _BadRequest("max_tokens must be an integer from 1 to 100000")
        request_id = headers.get("x-request-id", "")
        base = {"id": "chatcmpl-" + (request_id or "fast")[-24:], "created": int(time.time()), "model": model}
        if not request.get("stream"):
            message = {"role": "assistant", "content": _WORD * tokens}
            usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": tokens + 8}
            choice = {"index": 0, "message": message, "finish_reason": "length"}
            out = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
            self._transport.write(_response("200 OK", orjson.dumps(out)))
            return
        options = request.get("stream_options")
        usage_wanted = isinstance(options, dict) and options.get("include_usage") is True
        delay = _delay(model)
        recorded = headers.get("x-fast-record") == "1" and request_id
        self._stream_id = request_id if recorded else None
        self._transport.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
            + _chunk(_delta(base, {"role": "assistant", "content": ""}, None))
        )
        content = _chunk(_delta(base, {"content": _WORD}, None))  # the same bytes every time: no per-event work
        for _ in range(tokens):
            await (asyncio.sleep(delay) if delay else asyncio.sleep(0))
            if not self._writable.is_set():
                await self._writable.wait()
            if self._closed:
                return
            self._transport.write(content)
        self._transport.write(_chunk(_delta(base, {}, "length")))
        if usage_wanted:
            usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": tokens + 8}
            self._transport.write(_chunk(orjson.dumps({**base, "object": "chat.completion.chunk", "choices": [],
                                                       "usage": usage})))  # fmt: skip
        self._transport.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        if recorded:
            self._fake.ended.append(request_id)


class _BadRequest(Exception):
    pass


def _delta(base: dict[str, object], delta: dict[str, str], finish: str | None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return orjson.dumps({**base, "object": "chat.completion.chunk", "choices": [choice]})


async def start(host: str, port: int) -> tuple[asyncio.Server, int]:
    """A listening fast fake (port 0: any free one) and its port."""
    fake = FastFake()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(fake), host, port, backlog=4096, reuse_address=True)
    return server, int(server.sockets[0].getsockname()[1])


async def serve(host: str, port: int) -> None:
    """Serve until cancelled, printing one line with the URL."""
    server, bound = await start(host, port)
    print(f"streamwarden fake upstream (fast mode) listening on http://{host}:{bound}", flush=True)
    async with server:
        await server.serve_forever()


def main(host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run ``serve`` on uvloop when it is installed (as the proxy does), until SIGINT/SIGTERM."""
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            import uvloop
        except ImportError:  # pragma: no cover
            asyncio.run(serve(host, port))
        else:
            uvloop.run(serve(host, port))


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="python -m proxy.tools.fake.fast")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    main(args.host, args.port)
