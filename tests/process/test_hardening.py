"""Attacks on the shell, each reproduced on loopback against a real `streamwarden serve` process.

One test (or a few) per finding of the hardening issue: a pooled connection handing one client's
answer to the next, compressed and buffered bodies, slow and idle clients, absolute-form targets,
the hold window, hostile request ids, parser rejects, broken upstream responses, shutdown, model
labels and the admin bind. Resource findings assert numbers with margins that only a bug exceeds.
The module's main proxy serves most tests; the last test checks it still streams byte for byte.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from support.hostile import (
    CHAT,
    WAIT,
    Connection,
    FakeProcess,
    MiB,
    RawUpstream,
    ServeProcess,
    body_of,
    chat_json,
    exchange_raw,
    response,
    status_of,
    until,
)

SHORT = ("--client-header-timeout", "1", "--client-body-timeout", "1", "--client-keepalive-timeout", "2")


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as session:
        yield session


@pytest.fixture(scope="module")
def main_proxy(fake: FakeProcess) -> Iterator[ServeProcess]:
    """The module's proxy: short client timeouts, so that slow clients are dropped within seconds."""
    process = ServeProcess(fake.url, *SHORT, "--max-client-connections", "400")
    yield process
    process.stop()


# --- 1. a pooled upstream connection never hands one client's bytes to the next ---------------------


async def _serve_then_stray(
    connection: Connection, stray_now: asyncio.Event, stray_sent: asyncio.Event, *, at_once: bool
) -> None:
    """Answer each request with its own target; once asked, write an unrequested response."""
    while (request := await connection.next_request()) is not None:
        answer = response(200, request.target.rsplit(b"/", 1)[1], b"text/plain")
        if at_once:  # bytes beyond the declared end, in the same write
            await connection.send(answer + response(200, b"STRAY", b"text/plain"))
            continue
        await connection.send(answer)
        await stray_now.wait()
        stray_now.clear()
        await connection.send(response(200, b"STRAY", b"text/plain"))  # in the proxy's socket buffer now
        stray_sent.set()


@pytest.mark.parametrize("at_once", [False, True], ids=["later-on-idle", "beyond-declared-end"])
async def test_a_stray_upstream_response_never_reaches_the_next_client(
    http: aiohttp.ClientSession, at_once: bool
) -> None:
    stray_now, stray_sent = asyncio.Event(), asyncio.Event()
    upstream = RawUpstream(lambda c: _serve_then_stray(c, stray_now, stray_sent, at_once=at_once))
    proxy = ServeProcess(await upstream.start())
    try:
        answers = []
        for name in ("A", "B", "C", "D"):
            async with http.get(f"{proxy.url}/files/{name}") as resp:
                answers.append(await resp.read())
            if not at_once:
                stray_now.set()  # the connection now sits idle in the pool: an unrequested answer lands
                async with asyncio.timeout(WAIT):
                    await stray_sent.wait()
                stray_sent.clear()
        assert answers == [b"A", b"B", b"C", b"D"]  # before the fix: A, STRAY, B, C
        assert len(upstream.connections) == 4  # no connection that carried stray bytes was reused
        async with asyncio.timeout(WAIT):
            for connection in upstream.connections:
                await connection.closed.wait()
    finally:
        proxy.stop()
        await upstream.close()


# --- 2. compressed request bodies go upstream as they came ----------------------------------------------


async def _record_and_answer(connection: Connection) -> None:
    while await connection.next_request() is not None:
        await connection.send(response(200, chat_json()))


async def test_a_gzip_body_reaches_the_upstream_byte_for_byte(http: aiohttp.ClientSession) -> None:
    upstream = RawUpstream(_record_and_answer)
    proxy = ServeProcess(await upstream.start())
    try:
        wire = gzip.compress(orjson.dumps(CHAT))
        async with http.post(f"{proxy.url}/v1/chat/completions", data=wire, headers={
            "Content-Encoding": "gzip", "Content-Type": "application/json", "X-Request-Id": "gz-1",
        }) as resp:
            assert resp.status == 200
        (received,) = [r for c in upstream.connections for r in c.requests]
        assert received.body == wire
        assert received.header(b"content-encoding") == b"gzip"
        line = await proxy.line(lambda line: line["request_id"] == "gz-1")
        assert line["model"] == "fake-model"  # read from a bounded inflated copy
    finally:
        proxy.stop()
        await upstream.close()


async def test_gzip_bombs_are_not_inflated_in_memory(http: aiohttp.ClientSession) -> None:
    upstream = RawUpstream(_record_and_answer)
    proxy = ServeProcess(await upstream.start())
    try:
        bomb = gzip.compress(b"0" * (60 * 1000 * 1000), compresslevel=9)  # ~58 KB on the wire
        before = proxy.memory()

        async def send(i: int) -> int:
            async with http.post(f"{proxy.url}/v1/chat/completions", data=bomb,
                                 headers={"Content-Encoding": "gzip", "X-Request-Id": f"bomb-{i}"}) as resp:
                await resp.read()
                return resp.status

        assert await asyncio.gather(*(send(i) for i in range(8))) == [200] * 8
        received = [r.body for c in upstream.connections for r in c.requests]
        assert received == [bomb] * 8  # 8 x 58 KB reached the upstream, not 8 x 60 MB
        assert proxy.memory("VmHWM") - before < 64 * MiB  # it was 982 MB before the fix
    finally:
        proxy.stop()
        await upstream.close()


# --- 3. one bound on the request bytes buffered at once ------------------------------------------------


async def _send_partial(port: int, length: int, sent: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body_start = b'{"model":"m","input":"'
    writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % length + body_start + b"x" * (sent - len(body_start)))
    await writer.drain()
    return reader, writer


async def test_buffered_bodies_are_bounded_in_total(fake: FakeProcess) -> None:
    proxy = ServeProcess(fake.url, "--max-body-size", "8MiB", "--max-buffered-body-bytes", "20MiB")
    try:
        length = 8 * MiB
        # Two bodies fit under 20 MiB; they announce their length and stop halfway.
        held = [await _send_partial(proxy.port, length, MiB) for _ in range(2)]
        await until(lambda: proxy.memory() > 0)
        refused = await exchange_raw(proxy.port, (await _body_request(length)))
        assert status_of(refused) == 503
        assert b"Retry-After: 1" in refused
        assert body_of(refused)["error"]["code"] == "proxy_overloaded"
        line = await proxy.line(lambda line: line["reason"] == "proxy_overloaded")
        assert (line["outcome"], line["status"]) == ("error", 503)
        # The held ones finish sending and are forwarded; then there is room again.
        for reader, writer in held:
            writer.write(b"x" * (length - MiB - 2) + b'"}')
            await writer.drain()
            async with asyncio.timeout(WAIT):
                head = await reader.readuntil(b"\r\n\r\n")
            assert status_of(head) == 200
            writer.close()
        again = await exchange_raw(proxy.port, await _body_request(length, close=True))
        assert status_of(again) == 200
    finally:
        proxy.stop()


async def _body_request(length: int, *, close: bool = False) -> bytes:
    body = b'{"model":"m","input":"' + b"x" * (length - 24) + b'"}'
    assert len(body) == length
    connection = b"Connection: close\r\n" if close else b""
    return (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\n\r\n" % (connection, length)) + body


async def test_memory_returns_after_a_burst_of_large_bodies(fake: FakeProcess, http: aiohttp.ClientSession) -> None:
    proxy = ServeProcess(fake.url, "--max-buffered-body-bytes", "48MiB")
    try:
        baseline = proxy.memory()
        body = orjson.dumps({"model": "m", "input": "x" * (20 * 1000 * 1000)})

        async def send() -> int:
            async with http.post(f"{proxy.url}/v1/embeddings", data=io.BytesIO(body),
                                 headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.gather(*(send() for _ in range(10)))
        assert set(statuses) <= {200, 503}
        assert 200 in statuses
        # Two bodies (2 x 20 MB) fit at a time: the peak stays near that, not 10 x 20 MB.
        assert proxy.memory("VmHWM") - baseline < 160 * MiB
        await until(lambda: proxy.memory() - baseline < 48 * MiB)
    finally:
        proxy.stop()


async def test_a_body_costly_to_parse_is_scanned_not_parsed(fake: FakeProcess, http: aiohttp.ClientSession) -> None:
    """1.4 M empty objects in 4.2 MB: parsed, ~25 times its size as Python objects (8.1 MB bodies, 30
    at once: 512 MiB), twice with --resume-on-cut. Scanned instead, the proxy holds the body's bytes
    and little more: the bound (twice the body, plus 32 MiB) is a third of one parse's cost."""
    proxy = ServeProcess(fake.url, "--resume-on-cut", "1")
    try:
        baseline = proxy.memory("VmHWM")
        body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"x":[' + b"{}," * 1_400_000
        body += b"{}]}"
        for _ in range(2):
            async with http.post(f"{proxy.url}/v1/chat/completions", data=io.BytesIO(body),
                                 headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200
                assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        assert proxy.memory("VmHWM") - baseline < 2 * len(body) + 32 * MiB
    finally:
        proxy.stop()


# --- 4. header, body and keep-alive timeouts; the connection bound; file descriptors --------------------


async def test_idle_slow_header_and_slow_body_connections_are_closed(main_proxy: ServeProcess) -> None:
    baseline = main_proxy.fds()
    idle = [await asyncio.open_connection("127.0.0.1", main_proxy.port) for _ in range(100)]
    slowloris = []
    for _ in range(20):
        reader, writer = await asyncio.open_connection("127.0.0.1", main_proxy.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        slowloris.append((reader, writer))
    slow_body = []
    for _ in range(20):
        reader, writer = await asyncio.open_connection("127.0.0.1", main_proxy.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mo")
        slow_body.append((reader, writer))
    async with asyncio.timeout(WAIT):
        for reader, _ in idle:
            assert await reader.read(-1) == b""  # closed quietly: nothing was asked
        for reader, _ in slowloris:
            raw = await reader.read(-1)
            assert status_of(raw) == 408
            assert body_of(raw)["error"]["code"] == "client_timeout"
        for reader, _ in slow_body:
            raw = await reader.read(-1)
            assert status_of(raw) == 408
            assert body_of(raw)["error"]["type"] == "invalid_request_error"  # the chat dialect's shape
    for _, writer in idle + slowloris + slow_body:
        writer.close()
    await until(lambda: main_proxy.fds() <= baseline)

    def body_timeouts() -> list[dict[str, Any]]:
        return [line for line in main_proxy.lines() if line["reason"] == "client_timeout"
                and line["api"] == "chat_completions"]

    await until(lambda: len(body_timeouts()) >= 20)  # (the log is read from the process's stderr as it comes)
    assert {line["status"] for line in body_timeouts()} == {408}


async def test_an_idle_keepalive_connection_is_closed(main_proxy: ServeProcess) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", main_proxy.port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    async with asyncio.timeout(WAIT):
        head = await reader.readuntil(b"\r\n\r\n")
        assert status_of(head) == 200
        rest = await reader.read(-1)  # the body, then EOF after --client-keepalive-timeout
    assert rest.endswith(b"}")
    writer.close()


async def test_request_headers_are_bounded_in_total(main_proxy: ServeProcess) -> None:
    headers = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"v" * 900) for i in range(110))  # ~100 KB, each line valid
    raw = await exchange_raw(main_proxy.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert status_of(raw) == 431
    assert body_of(raw)["error"]["code"] == "bad_request"
    await main_proxy.line(lambda line: line["status"] == 431 and line["reason"] == "bad_request")


async def test_many_large_unfinished_heads_do_not_hold_memory(main_proxy: ServeProcess) -> None:
    baseline = main_proxy.memory()
    writers = []
    for _ in range(100):
        _, writer = await asyncio.open_connection("127.0.0.1", main_proxy.port)
        writer.write(b"GET / HTTP/1.1\r\n" + b"X-A: " + b"a" * (200 * 1024))  # one header past the bound
        writers.append(writer)
    await until(lambda: main_proxy.fds() < 100)
    assert main_proxy.memory("VmRSS") - baseline < 64 * MiB
    for writer in writers:
        writer.close()


async def test_connections_beyond_the_limit_get_503_and_admin_still_answers(
    fake: FakeProcess, http: aiohttp.ClientSession
) -> None:
    proxy = ServeProcess(fake.url, "--max-client-connections", "20")
    try:
        held = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(20)]
        raw = await exchange_raw(proxy.port, b"")
        assert status_of(raw) == 503
        assert body_of(raw)["error"]["code"] == "proxy_overloaded"
        async with http.get(f"{proxy.admin_url}/healthz") as resp:
            assert resp.status == 200
        await proxy.line(lambda line: line["reason"] == "proxy_overloaded")
        for _, writer in held:
            writer.close()
        await until(lambda: proxy.lines("request") and _accepts(proxy))
    finally:
        proxy.stop()


def _accepts(proxy: ServeProcess) -> bool:
    import socket

    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return sock.recv(12).startswith(b"HTTP/1.1 200")


async def test_a_low_fd_limit_lowers_the_connection_limit_and_keeps_admin_alive(
    fake: FakeProcess, http: aiohttp.ClientSession
) -> None:
    proxy = ServeProcess(fake.url, nofile=1024)
    try:
        started = await proxy.line(lambda line: True, event="started")
        assert started["nofile"] == 1024
        assert started["max_client_connections"] < 512
        sockets = []
        for _ in range(1100):
            _reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            sockets.append(writer)
        async with http.get(f"{proxy.admin_url}/healthz") as resp:
            assert resp.status == 200
        async with http.get(f"{proxy.admin_url}/metrics") as resp:
            assert resp.status == 200
        expected = 1100 - started["max_client_connections"]
        await until(lambda: sum(1 for line in proxy.lines() if line["reason"] == "proxy_overloaded") >= expected)
        refused = sum(1 for line in proxy.lines() if line["reason"] == "proxy_overloaded")
        assert refused == expected
        for writer in sockets:
            writer.close()
    finally:
        proxy.stop()


# --- 5. absolute-form targets and dot segments -------------------------------------------------------


async def _echo_target(connection: Connection) -> None:
    while (request := await connection.next_request()) is not None:
        await connection.send(response(200, request.target, b"text/plain"))


async def test_targets_never_leave_the_configured_upstream() -> None:
    upstream = RawUpstream(_echo_target)
    base = await upstream.start()
    proxy = ServeProcess(base.replace("http://", "http://user:secret@") + "/api")
    try:
        def request(target: bytes) -> bytes:
            return b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % target

        refused = await exchange_raw(proxy.port, request(b"evil://x/v1/models"))
        assert status_of(refused) == 400
        assert body_of(refused)["error"]["code"] == "bad_request"
        escaping = await exchange_raw(proxy.port, request(b"/../../admin"))
        assert status_of(escaping) == 400
        encoded = await exchange_raw(proxy.port, request(b"/v1/%2e%2e/%2E%2E/admin"))
        assert status_of(encoded) == 400
        assert upstream.connections == []  # none of those reached any host
        absolute = await exchange_raw(proxy.port, request(b"http://elsewhere:1234/files/x?a=%2F"))
        assert status_of(absolute) == 200
        assert absolute.endswith(b"/api/files/x?a=%2F")
        inside = await exchange_raw(proxy.port, request(b"/files/../files/./x"))
        assert inside.endswith(b"/api/files/../files/./x")  # kept byte for byte: it stays under the prefix
        newline = await exchange_raw(proxy.port, request(b"/files/a%0Ab"))
        assert newline.endswith(b"/api/files/a%0Ab")  # forwarded like any other path
        assert "Traceback" not in proxy.stderr_text()
    finally:
        proxy.stop()
        await upstream.close()


# --- 6. the hold window's memory bound -----------------------------------------------------------


async def test_role_only_chunks_cannot_fill_the_hold_window(http: aiohttp.ClientSession) -> None:
    client_has_headers = asyncio.Event()
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],' \
           b'"pad":"' + b"p" * (1024 * 1024) + b'"}\n\n'

    async def stream(connection: Connection) -> None:
        await connection.next_request()
        await connection.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                              b"Transfer-Encoding: chunked\r\n\r\n")
        sent = 0
        while not client_has_headers.is_set() and sent < 200:
            await connection.send(b"%x\r\n%s\r\n" % (len(role), role))
            sent += 1
            await asyncio.sleep(0)
        final = (b'data: {"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]}\n\n'
                 b"data: [DONE]\n\n")
        await connection.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(final), final))

    upstream = RawUpstream(stream)
    proxy = ServeProcess(await upstream.start(), "--hold-headers", "60")
    try:
        baseline = proxy.memory()
        async with http.post(f"{proxy.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            client_has_headers.set()  # long before the 60 s hold: the bound committed early
            assert resp.status == 200
            body = await resp.read()
        assert body.endswith(b"data: [DONE]\n\n")
        assert proxy.memory("VmHWM") - baseline < 64 * MiB
    finally:
        proxy.stop()
        await upstream.close()


# --- 7. hostile request ids ------------------------------------------------------------------------


async def test_an_invalid_request_id_is_replaced_and_logged_escaped(main_proxy: ServeProcess) -> None:
    raw = await exchange_raw(main_proxy.port, b"GET /v1/models%1B[31m HTTP/1.1\r\nHost: x\r\nX-Request-Id: evil\xff\r\n"
                             b"Connection: close\r\n\r\n")
    sent_back = [line for line in raw.split(b"\r\n") if line.lower().startswith(b"x-request-id:")]
    fresh = sent_back[0].split(b":", 1)[1].strip().decode()
    assert len(fresh) == 32
    assert all(c in "0123456789abcdef" for c in fresh)
    line = await main_proxy.line(lambda line: line["request_id"] == fresh)
    assert line["client_request_id"] == "evil\\udcff"  # escaped, and still one valid JSON line
    assert line["path"] == "/v1/models\\x1b[31m"  # a control character cannot colour a terminal


async def test_an_invalid_request_id_does_not_break_error_replies(main_proxy: ServeProcess) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", main_proxy.port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"X-Request-Id: evil\xff\r\nContent-Length: 999999999\r\n\r\n")
        async with asyncio.timeout(WAIT):  # the reply, not the close: that waits out a lingering close
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))  # fmt: skip
            raw = head + await reader.readexactly(length)
    finally:
        writer.close()
    assert status_of(raw) == 413
    assert body_of(raw)["error"]["code"] == "body_too_large"
    await main_proxy.line(lambda line: line["reason"] == "body_too_large")


async def test_a_huge_model_name_gives_a_short_log_line(main_proxy: ServeProcess, http: aiohttp.ClientSession) -> None:
    body = io.BytesIO(orjson.dumps({"model": "m" * MiB, "input": "a"}))
    async with http.post(f"{main_proxy.url}/v1/embeddings", data=body,
                         headers={"X-Request-Id": "huge-model", "Content-Type": "application/json"}) as resp:
        await resp.read()
    await main_proxy.line(lambda line: line["request_id"] == "huge-model")
    (raw,) = [raw for raw in main_proxy.raw_stderr if b'"huge-model"' in raw]
    assert len(raw) < 4096


# --- 8. parser rejects, broken upstreams, shutdown -----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "data", "status"),
    [
        ("bare-lf", b"GET /v1/models HTTP/1.1\nHost: x\n\n", 400),
        ("nul", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400),
        ("obs-fold", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n", 400),
        ("not-http", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n", 400),
    ],
)
async def test_parser_rejects_get_json_a_log_line_and_no_traceback(
    main_proxy: ServeProcess, name: str, data: bytes, status: int
) -> None:
    before = len([line for line in main_proxy.lines() if line["reason"] == "bad_request"])
    raw = await exchange_raw(main_proxy.port, data)
    assert status_of(raw) == status, raw
    assert body_of(raw)["error"]["code"] == "bad_request"
    await until(lambda: len([line for line in main_proxy.lines() if line["reason"] == "bad_request"]) > before)
    assert "Traceback" not in main_proxy.stderr_text()


BROKEN = {
    "unrequested-101": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
    "status-99": b"HTTP/1.1 99 Odd\r\nContent-Length: 0\r\n\r\n",
    "status-700": b"HTTP/1.1 700 Odd\r\nContent-Length: 0\r\n\r\n",
    "garbage": b"hello, this is not http\r\n\r\n",
    "cl-and-te": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "bad-chunk-size": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
}


@pytest.mark.parametrize("name", list(BROKEN))
async def test_broken_upstream_responses_are_502_bad_upstream_response(
    http: aiohttp.ClientSession, name: str
) -> None:
    async def broken(connection: Connection) -> None:
        await connection.next_request()
        await connection.send(BROKEN[name])
        await connection.wait_closed_by_peer()

    upstream = RawUpstream(broken)
    proxy = ServeProcess(await upstream.start())
    try:
        async with http.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": name}) as resp:
            assert resp.status == 502
            body = await resp.json()
        assert body["error"]["code"] == "bad_upstream_response"
        line = await proxy.line(lambda line: line["request_id"] == name)
        assert (line["outcome"], line["reason"]) == ("error", "bad_upstream_response")
    finally:
        proxy.stop()
        await upstream.close()


async def test_shutdown_does_not_overrun_the_drain_timeout(fake: FakeProcess) -> None:
    proxy = ServeProcess(fake.url, "--drain-timeout", "2")
    try:
        # A request whose body stops arriving: its exchange is in flight when the signal comes.
        _, slow = await _send_partial(proxy.port, 1000, 100)
        async with aiohttp.ClientSession() as http, asyncio.timeout(WAIT):
            while True:
                async with http.get(f"{proxy.admin_url}/metrics") as resp:
                    if 'streamwarden_inflight_requests{api="embeddings"} 1.0' in await resp.text():
                        break
                await asyncio.sleep(0.02)
        signalled = time.monotonic()
        proxy.signal(signal.SIGTERM)
        await asyncio.to_thread(proxy.proc.wait, WAIT)
        elapsed = time.monotonic() - signalled
        # drain 2 s + at most 1 s; aiohttp's 10 s lingering close made it 13 s before the fix: the slack
        # is for a busy machine, and stays below what the bug takes.
        assert elapsed < 2 + 8, elapsed
        assert proxy.proc.returncode == 0
        slow.close()
    finally:
        proxy.stop()


# --- 9. model labels belong to the backend's models ----------------------------------------------------


async def test_junk_model_names_cannot_take_the_labels_of_served_models(
    fake: FakeProcess, http: aiohttp.ClientSession
) -> None:
    proxy = ServeProcess(fake.url, "--model-label-limit", "5")
    try:
        for i in range(20):
            async with http.post(f"{proxy.url}/v1/embeddings", json={"model": f"junk-{i}", "input": "a"}) as resp:
                await resp.read()
        async with http.get(f"{proxy.admin_url}/readyz") as resp:  # the probe learns /v1/models
            assert resp.status == 200
        async with http.post(f"{proxy.url}/v1/embeddings", json={"model": "fake-model", "input": "a"}) as resp:
            await resp.read()
        async with http.get(f"{proxy.admin_url}/metrics") as resp:
            text = await resp.text()
        assert 'model="fake-model"' in text
        junk = set(re.findall(r'model="(junk-\d+)"', text))
        assert len(junk) == 5  # the other names share the five slots, then `other`
        assert 'model="other"' in text
    finally:
        proxy.stop()


# --- 10. the admin port's own address ------------------------------------------------------------------


async def test_admin_host_binds_the_admin_port_apart(fake: FakeProcess, http: aiohttp.ClientSession) -> None:
    proxy = ServeProcess(fake.url, "--admin-host", "127.0.0.2", admin_host="127.0.0.2")
    try:
        async with http.get(f"http://127.0.0.2:{proxy.admin_port}/healthz") as resp:
            assert resp.status == 200
        with pytest.raises(aiohttp.ClientConnectorError):
            await http.get(f"http://127.0.0.1:{proxy.admin_port}/healthz")
    finally:
        proxy.stop()


# --- after all of the above ------------------------------------------------------------------------------


async def test_the_attacked_proxy_still_streams_byte_for_byte(
    main_proxy: ServeProcess, fake: FakeProcess, http: aiohttp.ClientSession
) -> None:
    body = {**CHAT, "stream": True}
    async with http.post(f"{fake.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "same"}) as resp:
        direct = await resp.read()
    async with http.post(f"{main_proxy.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "same"}) as resp:
        assert resp.status == 200
        through = await resp.read()
    assert through == direct
    assert main_proxy.proc.poll() is None
