"""On the admin port: inter-token latency and time per output token (ok streams only), and
where clients abandon their requests (`streamwarden_aborts_total{phase}`, the `abort_phase` log field,
`streamwarden_abort_wait_seconds`), with real clients leaving at each phase."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from support import FakeUpstream, Proxy, ProxyFactory, ServeUpstream, until
from support.metrics import PATHS, abandon, answered, body_for, call, delta, leave_when, scrape

ITL = "streamwarden_inter_token_latency_seconds"
TPOT = "streamwarden_time_per_output_token_seconds"
ABORTS = "streamwarden_aborts_total"
WAIT = "streamwarden_abort_wait_seconds"


async def test_an_ok_stream_feeds_both_latency_histograms(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    before = await scrape(http, proxy)
    status, _ = await call(http, proxy, fake_upstream, "itl-1", "chat_completions", stream=True,
                           fault="slow;rate=50;tokens=5")
    assert status == 200
    after = await scrape(http, proxy)
    # 5 content events: 4 gaps in one series; one TPOT per stream; nothing for other apis.
    assert delta(before, after, f"{ITL}_count", ("api",)) == {("chat_completions",): 4}
    assert delta(before, after, f"{TPOT}_count", ("api",)) == {("chat_completions",): 1}
    itl_sum = delta(before, after, f"{ITL}_sum", ("api",))[("chat_completions",)]
    tpot_sum = delta(before, after, f"{TPOT}_sum", ("api",))[("chat_completions",)]
    assert 0 < itl_sum < 30
    assert tpot_sum == pytest.approx(itl_sum / 4)  # the same quantity, two ways
    buckets = after.total(f"{ITL}_bucket", ("le",), api="chat_completions")
    assert buckets[("+Inf",)] == 4
    assert [buckets[(le,)] for le in ("0.005", "0.1", "2.5", "+Inf")] == sorted(
        buckets[(le,)] for le in ("0.005", "0.1", "2.5", "+Inf")
    )


@pytest.mark.parametrize("api", ["responses", "messages", "completions"])
async def test_every_streaming_dialect_feeds_the_histograms(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, api: str
) -> None:
    before = await scrape(http, proxy)
    await call(http, proxy, fake_upstream, f"itl-{api}", api, stream=True)
    after = await scrape(http, proxy)
    assert delta(before, after, f"{ITL}_count", ("api",)) == {(api,): 15}  # the fake's 16 content events
    assert delta(before, after, f"{TPOT}_count", ("api",)) == {(api,): 1}


async def test_failed_and_aborted_streams_do_not_feed_the_latency_histograms(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    before = await scrape(http, proxy)
    await call(http, proxy, fake_upstream, "itl-cut", "chat_completions", stream=True, fault="cut;after=6")
    await abandon(http, proxy, fake_upstream, "itl-abandoned", "chat_completions", content_events=3)
    await call(http, proxy, fake_upstream, "itl-whole", "chat_completions")  # ok, but not a stream
    after = await scrape(http, proxy)
    assert (await proxy.line_for("itl-cut"))["outcome"] == "error"
    assert delta(before, after, f"{ITL}_count", ("api",)) == {}
    assert delta(before, after, f"{TPOT}_count", ("api",)) == {}


# --- where clients leave ---------------------------------------------------------------------------------


async def test_each_abort_phase_is_counted_logged_and_timed(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession,
    serve_upstream: ServeUpstream,
) -> None:
    proxy = await make_proxy()
    chat = PATHS["chat_completions"]
    before = await scrape(http, proxy)

    # before_headers: the upstream has the request and has not answered.
    line = await leave_when(http, proxy, "ph-headers", chat, body_for("chat_completions", stream=True),
                            lambda ex: fake_upstream.recorder.get("ph-headers") is not None,
                            {"x-fault": "late_headers;delay=60"})
    assert (line["outcome"], line["abort_phase"]) == ("aborted", "before_headers")

    # before_first_token: the 200 is held (the role chunk came, no content yet).
    line = await leave_when(http, proxy, "ph-held", chat, body_for("chat_completions", stream=True), answered,
                            {"x-fault": "stall;after=1;hold=60"})
    assert (line["outcome"], line["abort_phase"], line["status"]) == ("aborted", "before_first_token", None)

    # mid_stream: content was delivered.
    await abandon(http, proxy, fake_upstream, "ph-mid", "chat_completions", content_events=2)
    assert (await proxy.line_for("ph-mid"))["abort_phase"] == "mid_stream"

    # An ok exchange and an error have no abort phase.
    await call(http, proxy, fake_upstream, "ph-ok", "chat_completions", stream=True)
    await call(http, proxy, fake_upstream, "ph-err", "chat_completions", stream=True, fault="cut;after=3")
    assert (await proxy.line_for("ph-ok"))["abort_phase"] is None
    assert (await proxy.line_for("ph-err"))["abort_phase"] is None

    after = await scrape(http, proxy)
    assert delta(before, after, ABORTS, ("api", "phase")) == {
        ("chat_completions", "before_headers"): 1,
        ("chat_completions", "before_first_token"): 1,
        ("chat_completions", "mid_stream"): 1,
    }
    # The wait is observed for the two aborts before any content, not for the one mid-stream.
    assert delta(before, after, f"{WAIT}_count", ("api",)) == {("chat_completions",): 2}
    waited = delta(before, after, f"{WAIT}_sum", ("api",))[("chat_completions",)]
    assert 0 < waited < 60


async def test_a_committed_stream_without_content_is_before_first_token(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(hold_headers=0)
    line = await leave_when(http, proxy, "ph-committed", PATHS["chat_completions"],
                            body_for("chat_completions", stream=True), lambda ex: ex.status is not None,
                            {"x-fault": "stall;after=1;hold=60"})
    assert (line["abort_phase"], line["status"]) == ("before_first_token", 200)


async def test_a_client_leaving_during_its_own_body_is_before_headers(
    proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()

    async def body() -> Any:
        yield b'{"model": "m", "stream": true, "messages": ['
        await release.wait()  # never set: the client leaves first
        yield b"]}"

    hdrs = {"X-Request-Id": "ph-body-2"}
    task = asyncio.ensure_future(http.post(f"{proxy.url}/v1/chat/completions", data=body(), headers=hdrs))
    try:
        await until(lambda: any(ex.request_id == "ph-body-2" for ex in proxy.state.live.values()))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    line = await proxy.line_for("ph-body-2")
    assert (line["outcome"], line["abort_phase"]) == ("aborted", "before_headers")


async def test_a_whole_body_being_read_is_whole_body(
    make_proxy: ProxyFactory, http: aiohttp.ClientSession, serve_upstream: ServeUpstream
) -> None:
    never = asyncio.Event()

    async def half_a_body(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"id": "x", "choices": [')
        await never.wait()
        return resp

    upstream: Callable[[], Awaitable[str]] = lambda: serve_upstream(half_a_body)  # noqa: E731
    proxy = await make_proxy(upstream=await upstream())
    before = await scrape(http, proxy)
    line = await leave_when(http, proxy, "ph-whole", PATHS["chat_completions"],
                            body_for("chat_completions", stream=False), answered)
    assert (line["outcome"], line["abort_phase"]) == ("aborted", "whole_body")
    after = await scrape(http, proxy)
    assert delta(before, after, ABORTS, ("api", "phase")) == {("chat_completions", "whole_body"): 1}
    assert delta(before, after, f"{WAIT}_count", ("api",)) == {}


async def test_with_drain_the_phase_and_wait_are_those_of_the_moment_the_client_left(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """--on-abandon drain reads on after the client left; the books still say where and when it left."""
    proxy = await make_proxy(on_abandon="drain")
    before = await scrape(http, proxy)
    rid = "ph-drain"
    line = await leave_when(http, proxy, rid, PATHS["chat_completions"], body_for("chat_completions", stream=True),
                            lambda ex: fake_upstream.recorder.get(rid) is not None,
                            {"x-fault": "late_headers;delay=2"})
    record = await fake_upstream.recorder.wait_finished(rid)
    assert record.client_closed_at is None  # drained: the upstream answered in full, content and all
    assert (line["outcome"], line["abort_phase"]) == ("aborted", "before_headers")
    assert line["duration_ms"] >= 2000
    after = await scrape(http, proxy)
    assert delta(before, after, ABORTS, ("api", "phase")) == {("chat_completions", "before_headers"): 1}
    waited = delta(before, after, f"{WAIT}_sum", ("api",))[("chat_completions",)]
    assert waited + 0.5 < line["duration_ms"] / 1000  # the moment it left (soon), not the end of the 2 s drain


async def test_with_drain_content_read_after_the_client_left_is_not_its_first_token(
    make_proxy: ProxyFactory, http: aiohttp.ClientSession, serve_upstream: ServeUpstream
) -> None:
    proxies: list[Proxy] = []

    def drained() -> bool:
        return any(ex.drained for ex in proxies[0].state.live.values())

    async def slow_to_start(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n')
        await until(drained, within=10)  # content only once the client has gone and the drain began
        for text in "abc":
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % text.encode())
        await resp.write(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
        return resp

    proxies.append(await make_proxy(upstream=await serve_upstream(slow_to_start), on_abandon="drain"))
    line = await leave_when(http, proxies[0], "ph-drain-held", PATHS["chat_completions"],
                            body_for("chat_completions", stream=True), answered)
    assert line["completion_tokens"] == 3  # the drain read the content...
    assert (line["abort_phase"], line["ttft_ms"]) == ("before_first_token", None)  # ...the client saw none


async def test_a_client_that_closes_right_after_the_terminal_frame_is_ok(
    proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    """Other gateways count this as a failure; the terminal frame was delivered, so it is not an abort."""
    before = await scrape(http, proxy)
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = orjson.dumps(body_for("chat_completions", stream=True))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Request-Id: done-then-gone\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    await asyncio.wait_for(reader.readuntil(b"data: [DONE]\n\n"), 10)
    writer.transport.abort()  # gone at once, not even the chunked body's last chunk read
    line = await proxy.line_for("done-then-gone")
    assert (line["outcome"], line["abort_phase"]) == ("ok", None)
    after = await scrape(http, proxy)
    assert delta(before, after, ABORTS, ("api", "phase")) == {}
    assert delta(before, after, f"{TPOT}_count", ("api",)) == {("chat_completions",): 1}
