"""--cancel-hook end to end: after a cancelled upstream request, the hook's call reaches the upstream.

The upstream here is hand-made: it streams one chunk and then waits (as llama-server does for a
conversation it keeps for replay), and records every hook call it gets. The real llama-server proof
(tokens generated after the close, with and without the hook) is in tests/real/test_llama_server.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest
from aiohttp import web
from support import WAIT, Proxy, ProxyFactory, ServeUpstream, until

from proxy.config import parse_hooks

CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
DONE_CHUNK = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'


@dataclass
class HookUpstream:
    url: str = ""
    calls: list[tuple[str, str, bytes, dict[str, str]]] = field(default_factory=list)
    called: asyncio.Event = field(default_factory=asyncio.Event)
    hook_status: int = 204
    hook_gate: asyncio.Event | None = None  # when set, hook calls wait on it (a hanging backend)


@pytest.fixture
async def upstream(serve_upstream: ServeUpstream) -> HookUpstream:
    state = HookUpstream()

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/chat/completions":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(CHUNK)
            if request.headers.get("x-finish"):
                await resp.write(DONE_CHUNK)
                return resp
            await asyncio.sleep(30)  # generating on; the proxy's close cancels this handler
            return resp
        if request.path == "/drop":  # a backend that hangs up without answering
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(5)
        headers = {name.lower(): value for name, value in request.headers.items()}
        state.calls.append((request.method, request.raw_path, await request.read(), headers))  # as sent
        state.called.set()
        if state.hook_gate is not None:
            await state.hook_gate.wait()
        return web.Response(status=state.hook_status)

    state.url = await serve_upstream(handler)
    return state


async def start(make_proxy: ProxyFactory, upstream: HookUpstream, *hooks: str, hook_timeout: float = 2.0) -> Proxy:
    proxy = await make_proxy(upstream=upstream.url, cancel_hook=parse_hooks(list(hooks)), hold_headers=0)
    proxy.state.cancel_hooks.timeout = hook_timeout
    return proxy


async def abandon(proxy: Proxy, headers: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as http:
        resp = await http.post(proxy.url + "/v1/chat/completions", json=CHAT, headers=headers)
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        resp.close()


def cancellations(proxy: Proxy, reason: str) -> float:
    return proxy.sample("streamwarden_upstream_cancellations_total", {"api": "chat_completions", "reason": reason})


def failures(proxy: Proxy, reason: str) -> float:
    return proxy.sample("streamwarden_cancel_hook_failures_total", {"api": "chat_completions", "reason": reason})


async def hook_lines(proxy: Proxy, count: int) -> list[dict[str, object]]:
    async with asyncio.timeout(WAIT):
        while len(proxy.log_lines("cancel_hook")) < count:  # noqa: ASYNC110 - the log is the only signal
            await asyncio.sleep(0.01)
    return proxy.log_lines("cancel_hook")


async def test_llama_conversation_hook_deletes_the_stream(make_proxy: ProxyFactory, upstream: HookUpstream) -> None:
    proxy = await start(make_proxy, upstream, "llama-conversation")
    await abandon(proxy, {"X-Request-Id": "r1", "X-Conversation-Id": "conv-1", "Authorization": "Bearer k"})
    await asyncio.wait_for(upstream.called.wait(), WAIT)
    method, path, body, headers = upstream.calls[0]
    assert (method, path, body) == ("DELETE", "/v1/stream?conv_id=conv-1", b"")
    assert headers["x-request-id"] == "r1"
    assert headers["authorization"] == "Bearer k"  # the client's key: backends guard these routes
    line = (await hook_lines(proxy, 1))[0]
    assert (line["hook"], line["status"], line["failure"]) == ("llama-conversation", 204, None)
    assert cancellations(proxy, "cancel_hook") == 1
    assert cancellations(proxy, "client_disconnect") == 1
    assert sum(failures(proxy, r) for r in ("timeout", "connect_failed", "http_status", "invalid_body")) == 0


async def test_generic_hook_sends_its_body(make_proxy: ProxyFactory, upstream: HookUpstream) -> None:
    proxy = await start(make_proxy, upstream, 'POST /abort_request {"rid": "{request_id}", "abort_all": false}')
    await abandon(proxy, {"X-Request-Id": "rid-42"})
    await asyncio.wait_for(upstream.called.wait(), WAIT)
    method, path, body, headers = upstream.calls[0]
    assert (method, path, body) == ("POST", "/abort_request", b'{"rid": "rid-42", "abort_all": false}')
    assert headers["content-type"] == "application/json"


async def test_no_hook_without_the_conversation_it_needs(make_proxy: ProxyFactory, upstream: HookUpstream) -> None:
    proxy = await start(make_proxy, upstream, "llama-conversation", "DELETE /v1/requests/{request_id}")
    await abandon(proxy, {"X-Request-Id": "r2"})
    await asyncio.wait_for(upstream.called.wait(), WAIT)
    await hook_lines(proxy, 1)
    assert [call[:2] for call in upstream.calls] == [("DELETE", "/v1/requests/r2")]  # only the one it could make
    assert cancellations(proxy, "cancel_hook") == 1


async def test_no_hook_for_a_stream_that_completed(make_proxy: ProxyFactory, upstream: HookUpstream) -> None:
    proxy = await start(make_proxy, upstream, "DELETE /v1/requests/{request_id}")
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/chat/completions", json=CHAT, headers={"x-finish": "1"}) as resp:
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["upstream_cancelled"]) == ("ok", False)
    assert upstream.calls == []
    assert cancellations(proxy, "cancel_hook") == 0


async def test_a_failing_hook_is_counted(make_proxy: ProxyFactory, upstream: HookUpstream) -> None:
    upstream.hook_status = 404
    proxy = await start(make_proxy, upstream, "llama-conversation")
    await abandon(proxy, {"X-Conversation-Id": "gone"})
    line = (await hook_lines(proxy, 1))[0]
    assert (line["status"], line["failure"]) == (404, "http_status")
    assert failures(proxy, "http_status") == 1


async def test_an_unquoted_body_placeholder_sends_a_json_string(
    make_proxy: ProxyFactory, upstream: HookUpstream
) -> None:
    proxy = await start(make_proxy, upstream, 'POST /abort_request {"session_id": {conversation_id}}')
    await abandon(proxy, {"X-Conversation-Id": "[1,2,3]"})
    await asyncio.wait_for(upstream.called.wait(), WAIT)
    assert upstream.calls[0][2] == b'{"session_id": "[1,2,3]"}'


async def test_a_hanging_hook_never_holds_the_exchange(make_proxy: ProxyFactory, upstream: HookUpstream) -> None:
    """The exchange is finished and logged while its hook call still waits; the call then times out."""
    upstream.hook_gate = asyncio.Event()
    proxy = await start(make_proxy, upstream, "llama-conversation", hook_timeout=0.5)
    try:
        await abandon(proxy, {"X-Conversation-Id": "c"})
        await asyncio.wait_for(upstream.called.wait(), WAIT)
        line = (await proxy.settled())[-1]
        assert (line["outcome"], line["reason"]) == ("aborted", "client_disconnect")
        hook = (await hook_lines(proxy, 1))[0]
        assert hook["failure"] == "timeout"
        assert failures(proxy, "timeout") == 1
        # The exchange was logged while the hook still waited: its line comes first (an order, not a time).
        events = [orjson.loads(text)["event"] for text in proxy.log.getvalue().splitlines() if text.strip()]
        assert events.index("request") < events.index("cancel_hook"), events
    finally:
        upstream.hook_gate.set()


async def test_a_hook_target_that_hangs_up_is_counted(make_proxy: ProxyFactory, upstream: HookUpstream) -> None:
    proxy = await start(make_proxy, upstream, "POST /drop")
    await abandon(proxy, {"X-Conversation-Id": "c"})
    line = (await hook_lines(proxy, 1))[0]
    assert (line["status"], line["failure"]) == (None, "connect_failed")
    assert failures(proxy, "connect_failed") == 1


# Hostile ids, the hooks' own bounded connections, and the drain's end.
async def abandon_raw(proxy: Proxy, extra_head: bytes) -> None:
    """A stream abandoned by a client whose head carries bytes aiohttp's client would not send."""
    body = orjson.dumps(CHAT)
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + extra_head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b"\n\n"), 5)  # the first event
    finally:
        writer.close()


async def test_a_conversation_id_that_is_not_utf8_is_sent_as_its_bytes(
    make_proxy: ProxyFactory, upstream: HookUpstream
) -> None:
    """Before: `quote()` raised in the handler's `finally`: no hook, and a phantom `proxy_error` exchange."""
    proxy = await start(make_proxy, upstream, "llama-conversation", 'POST /abort {"conv": "{conversation_id}"}')
    await abandon_raw(proxy, b"X-Request-Id: raw-1\r\nX-Conversation-Id: \xff\xfe..\r\n")
    await asyncio.wait_for(upstream.called.wait(), WAIT)
    lines = await hook_lines(proxy, 2)
    assert [call[:2] for call in upstream.calls] == [("DELETE", "/v1/stream?conv_id=%FF%FE%2E%2E")]
    assert {line["failure"] for line in lines} == {None, "invalid_id"}  # no JSON string holds those bytes
    assert failures(proxy, "invalid_id") == 1
    booked = await proxy.settled()
    assert [(line["request_id"], line["reason"]) for line in booked] == [("raw-1", "client_disconnect")]
    assert proxy.log_lines("proxy_error") == []


async def test_dot_segments_cannot_climb_out_of_the_hook_path(make_proxy: ProxyFactory, upstream: HookUpstream) -> None:
    proxy = await start(make_proxy, upstream, "DELETE /v1/stream/{conversation_id}/cancel")
    await abandon(proxy, {"X-Conversation-Id": ".."})
    await asyncio.wait_for(upstream.called.wait(), WAIT)
    assert [call[:2] for call in upstream.calls] == [("DELETE", "/v1/stream/%2E%2E/cancel")]


async def test_an_id_longer_than_a_request_id_is_not_sent(make_proxy: ProxyFactory, upstream: HookUpstream) -> None:
    proxy = await start(make_proxy, upstream, "llama-conversation")
    await abandon(proxy, {"X-Conversation-Id": "c" * 8_000})
    line = (await hook_lines(proxy, 1))[0]
    assert line["failure"] == "invalid_id"
    assert upstream.calls == []
    assert failures(proxy, "invalid_id") == 1


async def test_hanging_hooks_do_not_take_the_proxy_s_upstream_connections(
    make_proxy: ProxyFactory, upstream: HookUpstream
) -> None:
    """Before: hooks used the upstream pool; with --upstream-max-connections 1 the next request waited them out."""
    upstream.hook_gate = asyncio.Event()
    proxy = await make_proxy(upstream=upstream.url, cancel_hook=parse_hooks(["llama-conversation"]), hold_headers=0,
                             upstream_max_connections=1)
    proxy.state.cancel_hooks.timeout = 60  # a hook endpoint that never answers, and a patient hook
    try:
        await abandon(proxy, {"X-Conversation-Id": "c"})
        await asyncio.wait_for(upstream.called.wait(), WAIT)
        async with aiohttp.ClientSession() as http:
            async with http.post(proxy.url + "/v1/chat/completions", json=CHAT, headers={"x-finish": "1"}) as resp:
                body = await asyncio.wait_for(resp.read(), 20)
        assert body.endswith(b"data: [DONE]\n\n")
    finally:
        upstream.hook_gate.set()


async def test_hook_calls_in_flight_are_bounded_and_the_rest_dropped(
    make_proxy: ProxyFactory, upstream: HookUpstream
) -> None:
    upstream.hook_gate = asyncio.Event()
    proxy = await start(make_proxy, upstream, "llama-conversation", hook_timeout=60)
    proxy.state.cancel_hooks.max_in_flight = 2
    try:
        for i in range(5):
            await abandon(proxy, {"X-Conversation-Id": f"c{i}"})
        await until(lambda: failures(proxy, "dropped") == 3)
        await until(lambda: len(upstream.calls) == 2)
        assert cancellations(proxy, "cancel_hook") == 2  # calls made
    finally:
        upstream.hook_gate.set()


async def test_hooks_in_flight_are_cut_at_the_drain_s_end(make_proxy: ProxyFactory, upstream: HookUpstream) -> None:
    """Before: shutdown waited for every hook call (its timeout + 1 s) past the drain bound."""
    upstream.hook_gate = asyncio.Event()
    proxy = await make_proxy(upstream=upstream.url, cancel_hook=parse_hooks(["llama-conversation"]), hold_headers=0,
                             drain_timeout=0.5)
    proxy.state.cancel_hooks.timeout = 60
    try:
        await abandon(proxy, {"X-Conversation-Id": "c"})
        await asyncio.wait_for(upstream.called.wait(), WAIT)
        proxy.server.request_stop()
        await asyncio.wait_for(proxy.server.shutdown(), 0.5 + 1.0 + 3.0)  # the bound, and slack for a busy machine
        assert failures(proxy, "cut") == 1
        assert (await hook_lines(proxy, 1))[0]["failure"] == "cut"
    finally:
        upstream.hook_gate.set()
