"""The metrics contract (the README's metrics table), checked on the admin port's real exposition.

Every exchange is counted once, when it finishes, by `Recorder.finish`; these tests drive a scripted
mix of healthy and failing exchanges (the fake upstream fails on demand) through the proxy and assert
the exact change of each series, read from a scrape of `/metrics` parsed with prometheus_client's
own parser: what Prometheus would see, not the registry's internals.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from support import FakeUpstream, Proxy, ProxyFactory
from support.contract import (
    APIS,
    METRICS,
)
from support.metrics import (
    PATHS,
    PROMPT_TOKENS,
    TOKENS,
    Exposition,
    Key,
    abandon,
    answered,
    body_for,
    call,
    check_label_values,
    closed_port,
    contract_family,
    delta,
    leave_when,
    scrape,
)

from proxy import __version__


async def test_exposition_has_the_designed_names_types_and_labels(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    # One streamed exchange with usage, one without, one abandoned before its first token: every
    # metric then has at least one series.
    await call(http, proxy, fake_upstream, "a-1", "chat_completions", stream=True, usage=True)
    await call(http, proxy, fake_upstream, "a-2", "chat_completions", stream=True)
    await leave_when(http, proxy, "a-3", PATHS["chat_completions"], body_for("chat_completions", stream=True),
                     answered, {"x-fault": "stall;after=1;hold=60"})
    exposition = await scrape(http, proxy)
    designed = {}
    for family in exposition.families.values():
        name = family.name + "_total" if family.type == "counter" else family.name
        if name in METRICS:
            designed[name] = family
    assert set(designed) == set(METRICS)
    for name, family in designed.items():
        kind, _ = METRICS[name]
        assert family.type == kind, name
        assert family.samples, f"{name} has no series"
        for sample in family.samples:
            assert contract_family(sample.name) == (name, frozenset(sample.labels)), sample


async def test_exposition_has_no_metric_beyond_the_design(proxy: Proxy, http: aiohttp.ClientSession) -> None:
    await call(http, proxy, None, "b-1", "chat_completions", stream=True)
    exposition = await scrape(http, proxy)
    names = {f.name + "_total" if f.type == "counter" else f.name for f in exposition.families.values()}
    assert names == set(METRICS)


# --- (b) the scripted mix ---------------------------------------------------------------------------------


async def test_scripted_mix_counts_every_exchange_exactly(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    fake = fake_upstream
    late = await make_proxy(idle_timeout=0.5)  # the default 10 s late-commit window
    early = await make_proxy(hold_headers=0, first_byte_timeout=0.3)  # commits at once
    dead = await make_proxy(upstream=f"http://127.0.0.1:{closed_port()}", connect_timeout=2)
    proxies = {"late": late, "early": early, "dead": dead}
    before = {name: await scrape(http, p) for name, p in proxies.items()}

    async def ok(rid: str, api: str, expected: int = 200, **kw: Any) -> bytes:
        status, body = await call(http, late, fake, rid, api, **kw)
        assert status == expected, body
        return body

    # Healthy exchanges in every dialect, streamed and whole, with and without usage.
    await ok("chat-stream-usage", "chat_completions", stream=True, usage=True)
    await ok("chat-stream", "chat_completions", stream=True)  # no usage asked: estimated from 16 events
    await ok("completions-stream-usage", "completions", stream=True, usage=True)
    await ok("responses-stream", "responses", stream=True)
    await ok("messages-stream", "messages", stream=True)
    await ok("chat-whole", "chat_completions")
    await ok("responses-whole", "responses")
    await ok("messages-whole", "messages")
    await ok("embeddings", "embeddings")
    await ok("models", "models")
    # Streams the proxy repairs and still completes.
    await ok("malformed", "chat_completions", stream=True, usage=True, fault="malformed_event")
    await ok("no-terminal", "messages", stream=True, fault="no_terminal")
    # Failures.
    stray_late = await ok("stray-late", "chat_completions", 503, stream=True, fault="stray_503")
    assert b"engine overloaded" in stray_late  # a real 503 before any content: the SDK retries it
    stray = await ok("stray-in-stream", "responses", stream=True, fault="stray_503;after=6")  # after 2 content
    assert b"event: response.failed" in stray
    error_frame = await ok("error-after-first", "chat_completions", stream=True, fault="error_after_first")
    assert error_frame.endswith(b"data: [DONE]\n\n")
    cut = await ok("cut", "chat_completions", stream=True, fault="cut")  # role chunk + 2 content events
    assert b'"code":"stream_cut"' in cut
    stall = await ok("stall", "completions", stream=True, fault="stall")  # 1 content event, then silence
    assert b'"code":"stall_timeout"' in stall
    await ok("null-200", "chat_completions", 502, fault="null_200")
    await ok("rate-limited", "completions", 429, fault="upstream_429")
    await abandon(http, late, fake, "abandoned", "chat_completions", content_events=2)

    status, in_stream = await call(http, early, fake, "early-stray", "chat_completions", stream=True,
                                   fault="stray_503")
    assert status == 200
    assert b"engine overloaded" in in_stream
    status, _ = await call(http, early, fake, "early-slow-headers", "chat_completions", fault="late_headers;delay=5")
    assert status == 504
    status, _ = await call(http, dead, None, "dead", "chat_completions", stream=True)
    assert status == 502

    after = {name: await scrape(http, p) for name, p in proxies.items()}

    def changes(proxy: str, name: str, *by: str, **where: str) -> dict[Key, float]:
        return delta(before[proxy], after[proxy], name, by, **where)

    chat, cmpl, resp, msgs = "chat_completions", "completions", "responses", "messages"
    assert changes("late", "streamwarden_requests_total", "api", "outcome", "reason") == {
        (chat, "ok", "complete"): 4,  # stream+usage, stream, whole, malformed
        (cmpl, "ok", "complete"): 1,
        (resp, "ok", "complete"): 2,
        (msgs, "ok", "complete"): 3,  # stream, whole, no_terminal
        ("embeddings", "ok", "complete"): 1,
        ("models", "ok", "complete"): 1,
        (chat, "error", "stray_http_block"): 1,
        (resp, "error", "stray_http_block"): 1,
        (chat, "error", "upstream_error_frame"): 1,
        (chat, "error", "stream_cut"): 1,
        (cmpl, "error", "stall_timeout"): 1,
        (chat, "error", "invalid_upstream_body"): 1,
        (cmpl, "error", "upstream_4xx"): 1,
        (chat, "aborted", "client_disconnect"): 1,
    }
    assert changes("late", "streamwarden_requests_total", "model") == {("m",): 19, ("unknown",): 1}
    assert changes("late", "streamwarden_upstream_cancellations_total", "api", "reason") == {
        (chat, "upstream_error"): 3,  # stray (late commit), error frame, cut
        (resp, "upstream_error"): 1,  # stray in stream
        (cmpl, "stall_timeout"): 1,
        (chat, "client_disconnect"): 1,
    }
    assert changes("late", "streamwarden_stream_rewrites_total", "api", "reason") == {
        (chat, "malformed_event"): 1,
        (msgs, "missing_terminal"): 1,
        (chat, "late_commit_status"): 1,  # the stray block before any content went out as a real 503
        (chat, "stray_http_block"): 1,  # ... and counts as a stray block too (the alert must see it)
        (resp, "stray_http_block"): 1,
        (chat, "stream_cut"): 1,
        (cmpl, "stall_timeout"): 1,
    }
    p, c = PROMPT_TOKENS, TOKENS
    assert changes("late", "streamwarden_tokens_total", "api", "kind", "source") == {
        (chat, "prompt", "usage"): 3 * p,  # stream+usage, whole, malformed
        (chat, "completion", "usage"): 3 * c,
        (chat, "completion", "estimated"): c + 1 + 2 + 2,  # stream w/o usage, error frame, cut, abandoned
        (cmpl, "prompt", "usage"): p,
        (cmpl, "completion", "usage"): c,
        (cmpl, "completion", "estimated"): 1,  # stall
        (resp, "prompt", "usage"): 2 * p,
        (resp, "completion", "usage"): 2 * c,
        (resp, "completion", "estimated"): 2,  # stray after 2 content events
        (msgs, "prompt", "usage"): 3 * p,
        (msgs, "completion", "usage"): 3 * c,
        ("embeddings", "prompt", "usage"): p,
    }
    assert changes("late", "streamwarden_upstream_responses_total", "api", "code") == {
        (chat, "200"): 9,  # a stray block, a null body, a cut: all came with a 200
        (cmpl, "200"): 2,
        (cmpl, "429"): 1,
        (resp, "200"): 3,
        (msgs, "200"): 3,
        ("embeddings", "200"): 1,
        ("models", "200"): 1,
    }
    assert changes("late", "streamwarden_time_to_first_token_seconds_count", "api", "model") == {
        (chat, "m"): 6,  # stream+usage, stream, malformed, error frame, cut, abandoned
        (cmpl, "m"): 2,  # stream, stall
        (resp, "m"): 2,  # stream, stray in stream
        (msgs, "m"): 2,  # stream, no_terminal
    }
    assert changes("late", "streamwarden_request_duration_seconds_count", "api", "outcome") == {
        (chat, "ok"): 4, (chat, "error"): 4, (chat, "aborted"): 1,
        (cmpl, "ok"): 1, (cmpl, "error"): 2,
        (resp, "ok"): 2, (resp, "error"): 1,
        (msgs, "ok"): 3,
        ("embeddings", "ok"): 1,
        ("models", "ok"): 1,
    }

    # hold_headers=0: the stray block arrives after the 200 went out, so it becomes an error frame.
    assert changes("early", "streamwarden_requests_total", "api", "outcome", "reason") == {
        (chat, "error", "stray_http_block"): 1,
        (chat, "error", "first_byte_timeout"): 1,
    }
    assert changes("early", "streamwarden_stream_rewrites_total", "api", "reason") == {(chat, "stray_http_block"): 1}
    assert changes("early", "streamwarden_upstream_cancellations_total", "api", "reason") == {
        (chat, "upstream_error"): 1,
        (chat, "first_byte_timeout"): 1,
    }
    assert changes("early", "streamwarden_upstream_responses_total", "api", "code") == {(chat, "200"): 1,
                                                                                    (chat, "none"): 1}
    assert changes("early", "streamwarden_tokens_total", "api", "kind", "source") == {}
    assert changes("early", "streamwarden_time_to_first_token_seconds_count", "api") == {}
    assert changes("early", "streamwarden_request_duration_seconds_count", "api", "outcome") == {(chat, "error"): 2}

    assert changes("dead", "streamwarden_requests_total", "api", "model", "outcome", "reason") == {
        (chat, "m", "error", "connect_failed"): 1,
    }
    assert changes("dead", "streamwarden_upstream_responses_total", "api", "code") == {(chat, "none"): 1}
    assert changes("dead", "streamwarden_upstream_cancellations_total", "api", "reason") == {}
    assert changes("dead", "streamwarden_stream_rewrites_total", "api", "reason") == {}
    assert changes("dead", "streamwarden_request_duration_seconds_count", "api", "outcome") == {(chat, "error"): 1}

    for name in proxies:
        assert after[name].total("streamwarden_inflight_requests", ("api",)) == {(api,): 0.0 for api in APIS}
        assert check_label_values(after[name]) > 0
    # Exactly one log line per exchange, each agreeing with the counted verdict.
    assert len(late.log_lines()) == 20
    assert len(early.log_lines()) == 2
    assert len(dead.log_lines()) == 1



async def test_abandoned_messages_stream_counts_what_it_delivered(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    before = await scrape(http, proxy)
    await abandon(http, proxy, fake_upstream, "messages-abandoned", "messages", content_events=3)
    after = await scrape(http, proxy)
    completion = delta(before, after, "streamwarden_tokens_total", ("source",), api="messages", kind="completion")
    assert completion == {("estimated",): 3}


# --- (c) label bounds --------------------------------------------------------------------------------------


async def test_model_label_is_bounded(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(model_label_limit=5)
    long_name = "x" * 300
    firsts = [long_name, "model-1", "model-2", "model-3", "model-4"]
    for i, model in enumerate(firsts):  # one at a time: these five take the five named labels
        await call(http, proxy, fake_upstream, f"first-{i}", "embeddings", model=model)
    await call(http, proxy, fake_upstream, "no-model", "embeddings", model=None)
    await call(http, proxy, fake_upstream, "models", "models")  # no body at all

    limit = asyncio.Semaphore(16)

    async def one(i: int) -> None:
        async with limit:
            await call(http, proxy, fake_upstream, f"later-{i}", "embeddings", model=f"later-model-{i}")

    await asyncio.gather(*(one(i) for i in range(195)))
    await call(http, proxy, fake_upstream, "again", "embeddings", model="model-2")  # a known name keeps its label

    exposition = await scrape(http, proxy)
    requests = exposition.total("streamwarden_requests_total", ("model",))
    assert requests == {
        ("x" * 100,): 1, ("model-1",): 1, ("model-2",): 2, ("model-3",): 1, ("model-4",): 1,
        ("unknown",): 2, ("other",): 195,
    }
    for name in ("streamwarden_tokens_total", "streamwarden_time_to_first_token_seconds_count"):
        models = {s.labels["model"] for s in exposition.series(name)}
        assert len(models - {"other", "unknown"}) <= 5, (name, models)
    assert check_label_values(exposition) > 0
    # The log keeps the request's own model name, cut at 256 characters; the label at 100.
    assert len([line for line in proxy.log_lines() if line["model"] == long_name[:256]]) == 1


async def test_fixed_label_values_after_every_kind_of_exchange(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Also the rarer verdicts: bodies in other backends' shapes, a batch with a choice missing, an
    oversized event, a reset, a path of no dialect; every label value stays in its fixed set."""
    proxy = await make_proxy(max_body_size=1024, max_event_size=64 * 1024)
    script: list[tuple[str, str, bool, str | None]] = [
        ("completions", "/v1/completions", False, "batch_missing_choice"),
        ("chat_completions", "/v1/chat/completions", False, "upstream_5xx_flat"),
        ("messages", "/v1/messages", False, "upstream_detail"),
        ("responses", "/v1/responses", False, "html_502"),
        ("chat_completions", "/v1/chat/completions", False, "error_in_200"),
        ("chat_completions", "/v1/chat/completions", True, "error_object_foreign"),
        ("completions", "/v1/completions", True, "done_without_finish"),
        ("messages", "/v1/messages", True, "oversized_event;size=100000;at=0"),
        ("responses", "/v1/responses", True, "reset"),
        ("embeddings", "/v1/embeddings", False, "empty_200"),
    ]
    for i, (api, _, stream, fault) in enumerate(script):
        status, _ = await call(http, proxy, fake_upstream, f"rare-{i}", api, stream=stream, fault=fault)
        assert status >= 200
    async with http.get(f"{proxy.url}/_fake/echo/x", headers={"X-Request-Id": "other"}) as resp:
        assert resp.status == 200
    await proxy.line_for("other")
    async with http.post(f"{proxy.url}/v1/chat/completions", data=b"x" * 2048,
                         headers={"X-Request-Id": "too-large"}) as resp:
        assert resp.status == 413
    await proxy.line_for("too-large")

    exposition = await scrape(http, proxy)
    reasons = exposition.total("streamwarden_requests_total", ("api", "outcome", "reason"))
    assert reasons == {
        ("completions", "error", "incomplete_batch"): 1,
        ("chat_completions", "error", "upstream_5xx"): 1,
        ("messages", "error", "upstream_4xx"): 1,
        ("responses", "error", "upstream_5xx"): 1,
        ("chat_completions", "error", "upstream_error_frame"): 2,
        ("completions", "error", "stream_cut"): 1,
        ("messages", "error", "stream_cut"): 1,
        ("responses", "error", "stream_cut"): 1,
        ("embeddings", "error", "invalid_upstream_body"): 1,
        ("other", "ok", "complete"): 1,
        ("chat_completions", "error", "body_too_large"): 1,
    }
    rewrites = delta(Exposition(""), exposition, "streamwarden_stream_rewrites_total", ("api", "reason"))
    assert rewrites == {
        ("chat_completions", "foreign_error_frame"): 1,
        ("completions", "stream_cut"): 1,
        ("messages", "oversized_event"): 1,  # the first content event: before the commit, so a real 502
        ("messages", "late_commit_status"): 1,
        ("responses", "stream_cut"): 1,
    }
    assert exposition.total("streamwarden_upstream_responses_total", ("code",)) == {
        ("200",): 8, ("500",): 1, ("400",): 1, ("502",): 1, ("none",): 1,  # none: the 413, never sent upstream
    }
    assert check_label_values(exposition) > 50


# --- (d) upstream_up and build_info -------------------------------------------------------------------------


async def test_upstream_up_follows_the_probe(
    make_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    live = await make_proxy()
    assert (await scrape(http, live)).value("streamwarden_upstream_up") == 1  # /metrics probes first
    other = await make_proxy()
    assert other.sample("streamwarden_upstream_up") == 0  # nothing probed yet: not known to be up
    async with http.get(f"{other.admin_url}/readyz") as resp:
        assert resp.status == 200
    assert other.sample("streamwarden_upstream_up") == 1

    dead = await make_proxy(upstream=f"http://127.0.0.1:{closed_port()}")
    async with http.get(f"{dead.admin_url}/readyz") as resp:
        assert resp.status == 503
    assert dead.sample("streamwarden_upstream_up") == 0
    exposition = await scrape(http, dead)
    assert exposition.value("streamwarden_upstream_up") == 0
    assert exposition.series("streamwarden_upstream_up")[0].labels == {}


async def test_build_info_carries_the_version(proxy: Proxy, http: aiohttp.ClientSession) -> None:
    exposition = await scrape(http, proxy)
    assert [(s.labels, s.value) for s in exposition.series("streamwarden_build_info")] == [
        ({"version": __version__}, 1.0)
    ]
