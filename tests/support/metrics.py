"""Scraping and exercising the proxy's metrics: shared by the metrics contract, token-latency,
tracing, workers and live-dashboard tests (tests in one tier never import another tier's tests).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from support import WAIT, FakeUpstream, Proxy, until
from support.contract import (
    ABORT_PHASES,
    APIS,
    CANCEL_HOOK_FAILURE_REASONS,
    CANCELLATION_REASONS,
    KINDS,
    METRICS,
    OUTCOMES,
    REASONS,
    REQUEST_REASONS,
    RESUME_REASONS,
    RESUME_RESULTS,
    REWRITE_REASONS,
    SOURCES,
)

# --- the contract: design section 7 (names, types, labels), 3 and 10 (label values) ------------------

FIXED: dict[str, frozenset[str]] = {
    "api": APIS,
    "outcome": OUTCOMES,
    "kind": KINDS,
    "phase": ABORT_PHASES,
    "source": SOURCES,
    "result": RESUME_RESULTS,
}
REASON_SETS = {
    "streamwarden_requests_total": REQUEST_REASONS,
    "streamwarden_upstream_cancellations_total": CANCELLATION_REASONS,
    "streamwarden_stream_rewrites_total": REWRITE_REASONS,
    "streamwarden_cancel_hook_failures_total": CANCEL_HOOK_FAILURE_REASONS,
    "streamwarden_stream_resumes_total": RESUME_REASONS,
}

PROMPT = "say hi please"  # the fake counts whitespace-separated words: 3 prompt tokens
PROMPT_TOKENS = 3
TOKENS = 16  # the fake's default answer length: 16 content events per choice


# --- reading the exposition ----------------------------------------------------------------------------

Key = tuple[str, ...]


@dataclass
class Exposition:
    """One scrape of the admin `/metrics`, parsed."""

    text: str
    families: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for family in text_string_to_metric_families(self.text):
            self.families[family.name] = family

    def samples(self) -> Iterable[Sample]:
        for family in self.families.values():
            yield from family.samples

    def series(self, name: str) -> list[Sample]:
        return [s for s in self.samples() if s.name == name]

    def value(self, name: str, **labels: str) -> float:
        found = [s.value for s in self.series(name) if s.labels == labels]
        assert len(found) <= 1
        return found[0] if found else 0.0

    def total(self, name: str, by: tuple[str, ...], **where: str) -> dict[Key, float]:
        out: dict[Key, float] = {}
        for s in self.series(name):
            if all(s.labels.get(k) == v for k, v in where.items()):
                key = tuple(s.labels[label] for label in by)
                out[key] = out.get(key, 0.0) + s.value
        return out


def delta(before: Exposition, after: Exposition, name: str, by: tuple[str, ...], **where: str) -> dict[Key, float]:
    """How much each `by` group of series `name` grew between two scrapes (groups that did not change left out)."""
    old, new = before.total(name, by, **where), after.total(name, by, **where)
    changes = {key: new.get(key, 0.0) - old.get(key, 0.0) for key in old.keys() | new.keys()}
    return {key: change for key, change in changes.items() if change}


async def scrape(http: aiohttp.ClientSession, proxy: Proxy) -> Exposition:
    async with http.get(f"{proxy.admin_url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=")
        return Exposition(await resp.text())


def contract_family(sample_name: str) -> tuple[str, frozenset[str]]:
    """The design metric a sample belongs to and the label names it must carry."""
    if sample_name in METRICS:
        return sample_name, METRICS[sample_name][1]
    for suffix, extra in (("_bucket", {"le"}), ("_sum", set()), ("_count", set())):
        base = sample_name.removesuffix(suffix)
        if base != sample_name and METRICS.get(base, ("", frozenset()))[0] == "histogram":
            return base, METRICS[base][1] | extra
    raise AssertionError(f"{sample_name!r} is not a metric of design section 7")


def check_label_values(exposition: Exposition) -> int:
    """Every fixed-set label of every designed series holds a value of its set; returns how many were checked."""
    checked = 0
    for sample in exposition.samples():
        if sample.name.endswith("_created"):
            continue
        name, _ = contract_family(sample.name)
        for label, value in sample.labels.items():
            if label in FIXED:
                assert value in FIXED[label], f"{sample.name}{{{label}={value!r}}}"
            elif label == "reason":
                assert value in REASON_SETS[name], f"{sample.name}{{reason={value!r}}}"
                if name == "streamwarden_requests_total":
                    assert value in REASONS[sample.labels["outcome"]], f"{sample.labels}"
            elif label == "code":
                assert value == "none" or (value.isdigit() and 100 <= int(value) <= 599), value
            elif label == "model":
                assert 0 < len(value) <= 100, value
            else:
                continue
            checked += 1
    return checked


# --- driving exchanges ---------------------------------------------------------------------------------

PATHS = {
    "chat_completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "embeddings": "/v1/embeddings",
}


def body_for(api: str, *, stream: bool, usage: bool = False, model: str | None = "m") -> dict[str, Any]:
    body: dict[str, Any] = {} if model is None else {"model": model}
    if api == "chat_completions":
        body["messages"] = [{"role": "user", "content": PROMPT}]
    elif api == "completions":
        body["prompt"] = PROMPT
    elif api in ("responses", "embeddings"):
        body["input"] = PROMPT
    elif api == "messages":
        body["messages"] = [{"role": "user", "content": PROMPT}]
        body["max_tokens"] = 1024  # at least the fake's default length: the default answer
    if api != "embeddings":
        body["stream"] = stream
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def call(
    http: aiohttp.ClientSession,
    proxy: Proxy,
    fake: FakeUpstream | None,
    rid: str,
    api: str,
    *,
    stream: bool = False,
    fault: str | None = None,
    usage: bool = False,
    model: str | None = "m",
) -> tuple[int, bytes]:
    """One exchange to its end; waits for its log line (and for the upstream's handler, when it got one)."""
    headers = {"X-Request-Id": rid}
    if fault:
        headers["x-fault"] = fault
    if api == "models":
        request = http.get(f"{proxy.url}/v1/models", headers=headers)
    else:
        body = body_for(api, stream=stream, usage=usage, model=model)
        request = http.post(f"{proxy.url}{PATHS[api]}", json=body, headers=headers)
    async with request as resp:
        status, data = resp.status, await resp.read()
    await proxy.line_for(rid)
    if fake is not None:
        await fake.recorder.wait_finished(rid)
    return status, data


async def abandon(
    http: aiohttp.ClientSession, proxy: Proxy, fake: FakeUpstream, rid: str, api: str, content_events: int
) -> None:
    """A client that reads `content_events` content events of a slow stream, then closes the connection."""
    marker = {"chat_completions": b'"content":"', "messages": b'"text_delta"'}[api]
    resp = await http.post(
        f"{proxy.url}{PATHS[api]}",
        json=body_for(api, stream=True),
        headers={"X-Request-Id": rid, "x-fault": "slow;rate=4;tokens=1000"},
    )
    try:
        assert resp.status == 200
        seen = 0
        async with asyncio.timeout(WAIT):
            while seen < content_events:
                event = await resp.content.readuntil(b"\n\n")
                seen += marker in event and b'"content":""' not in event
    finally:
        resp.close()
    record = await fake.recorder.wait_finished(rid)
    assert record.client_closed_at is not None  # the proxy cancelled the upstream
    await proxy.line_for(rid)


async def leave_when(
    http: aiohttp.ClientSession, proxy: Proxy, rid: str, path: str, body: dict[str, Any] | bytes,
    ready: Callable[[Any], bool], headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Send a request and close the connection once the proxy's record of it satisfies `ready`."""
    hdrs = {"X-Request-Id": rid, **(headers or {})}

    async def send() -> None:
        kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with http.post(f"{proxy.url}{path}", headers=hdrs, **kwargs) as resp:
            await resp.read()

    task = asyncio.ensure_future(send())
    try:
        await until(lambda: any(ex.request_id == rid and ready(ex) for ex in proxy.state.live.values()),
                    within=10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return await proxy.line_for(rid)


def answered(ex: Any) -> bool:
    """The proxy's record of an exchange shows the upstream's response headers."""
    return ex.upstream_status is not None


# --- (a) names, types, labels ----------------------------------------------------------------------------


