"""Backends' own ways of dressing a failure as a success, end to end through the proxy.

vLLM (issue vllm-project/vllm#57082): when its engine aborts a request (shutdown, an abort call, a
sleep or scale-down pause) the choice ends with `finish_reason: "abort"`, which is not an OpenAI value,
then `data: [DONE]` with HTTP 200, so every client takes the cut answer for a complete one. The fake's
`vllm_abort` scenario sends exactly that; the proxy must turn it into the dialect's failure.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from support import WAIT, FakeUpstream, Proxy
from support.guard_cases import ABORT_MESSAGE, CHAT_LIKE, REQUESTS, error_body


async def post(http: aiohttp.ClientSession, base: str, dialect: str, rid: str, fault: str, stream: bool,
               usage: bool = False) -> tuple[int, bytes]:  # fmt: skip
    path, body = REQUESTS[dialect]
    body = {**body, "stream": stream, **({"stream_options": {"include_usage": True}} if usage else {})}
    async with asyncio.timeout(WAIT):
        async with http.post(base + path, json=body, headers={"X-Request-Id": rid, "x-fault": fault}) as resp:
            return resp.status, await resp.read()


def events(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block[6:]
            out.append(data.decode() if data == b"[DONE]" else orjson.loads(data))
    return out


@pytest.mark.parametrize("dialect", CHAT_LIKE)
async def test_the_fake_sends_what_vllm_sends(
    fake_upstream: FakeUpstream, http: aiohttp.ClientSession, dialect: str
) -> None:
    status, raw = await post(http, fake_upstream.url, dialect, "direct", "vllm_abort", stream=True)
    got = events(raw)
    assert status == 200
    assert got[-1] == "[DONE]"
    assert [c["finish_reason"] for e in got[:-1] for c in e["choices"]][-1] == "abort"


@pytest.mark.parametrize("dialect", CHAT_LIKE)
async def test_abort_mid_stream_ends_with_the_error_frame(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, dialect: str
) -> None:
    rid = f"abort-mid-{dialect}"
    status, raw = await post(http, proxy.url, dialect, rid, "vllm_abort", stream=True, usage=True)
    _, direct = await post(http, fake_upstream.url, dialect, rid, "vllm_abort", stream=True, usage=True)
    assert status == 200
    got = events(raw)
    assert got[-2] == {"error": {"message": ABORT_MESSAGE, "type": "server_error", "param": None,
                                 "code": "upstream_aborted"}}  # fmt: skip
    assert got[-1] == "[DONE]"
    assert raw.startswith(direct[: direct.index(b'"abort"')].rsplit(b"\n\n", 1)[0])  # content before: as is
    assert b'"abort"' not in raw
    line = await proxy.line_for(rid)
    assert (line["outcome"], line["reason"], line["upstream_cancelled"]) == ("error", "upstream_aborted", True)
    assert line["completion_tokens"] == 2  # the two words delivered, estimated (usage came after the abort)
    assert proxy.sample("streamwarden_stream_rewrites_total", {"api": dialect, "reason": "upstream_aborted"}) == 1
    labels = {"api": dialect, "model": "m", "outcome": "error", "reason": "upstream_aborted"}
    assert proxy.sample("streamwarden_requests_total", labels) == 1


@pytest.mark.parametrize("dialect", CHAT_LIKE)
async def test_abort_before_content_is_a_real_502(proxy: Proxy, http: aiohttp.ClientSession, dialect: str) -> None:
    rid = f"abort-early-{dialect}"
    status, raw = await post(http, proxy.url, dialect, rid, "vllm_abort;at=0", stream=True)
    assert status == 502
    assert orjson.loads(raw) == error_body(dialect, 502, ABORT_MESSAGE, "upstream_aborted")
    line = await proxy.line_for(rid)
    assert (line["outcome"], line["reason"], line["status"]) == ("error", "upstream_aborted", 502)


@pytest.mark.parametrize("dialect", CHAT_LIKE)
async def test_aborted_whole_body_is_a_502_and_its_usage_is_booked(
    proxy: Proxy, http: aiohttp.ClientSession, dialect: str
) -> None:
    rid = f"abort-whole-{dialect}"
    status, raw = await post(http, proxy.url, dialect, rid, "vllm_abort", stream=False)
    assert status == 502
    assert orjson.loads(raw) == error_body(dialect, 502, ABORT_MESSAGE, "upstream_aborted")
    line = await proxy.line_for(rid)
    assert (line["outcome"], line["reason"], line["usage_source"]) == ("error", "upstream_aborted", "usage")
    assert line["completion_tokens"] == 2
