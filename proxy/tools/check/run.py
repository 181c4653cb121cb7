"""`streamwarden check`: run the probes one after another against one backend, print the table, and
write the JSON report. Exit 0 when a report was made from a backend that answered; 1 when no dialect
answered a plain request (the report is written, and says so); 2 with one line for a bad argument or a
backend that cannot be reached at all.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import Any

import orjson

from proxy.tools.check.abandon import probe_conversation_replay, probe_prefill, probe_stops_generation
from proxy.tools.check.client import Overflow, Reply, Unreachable, Upstream
from proxy.tools.check.options import CheckOptions
from proxy.tools.check.probes import (
    Context,
    probe_context_overflow,
    probe_dialect,
    probe_health,
    probe_malformed_json,
    probe_metrics,
    probe_stream_terminal,
    probe_stream_usage,
)
from proxy.tools.check.report import FAIL, NOT_REACHED, PROBE_IDS, Finding, Report, printable, render_table
from proxy.tools.check.requests import DIALECTS

__all__ = ["NoModel", "main", "run_check"]


class NoModel(Exception):
    """No --model and the backend's /v1/models names none: nothing to probe with."""


def _first_model(body: Any) -> str | None:
    data = body.get("data") if isinstance(body, dict) else None
    for entry in data if isinstance(data, list) else ():
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and entry["id"]:
            return str(entry["id"])
    return None


async def _version(upstream: Upstream, ctx: Context) -> str | None:
    """The backend's own version where it says it: llama-server's /props `build_info`, vLLM's /version."""
    if ctx.backend is None or ctx.backend.version_path is None:
        return None
    try:
        reply = await upstream.get(ctx.backend.version_path)
    except Unreachable:
        return None
    body = reply.json() if reply.status == 200 else None
    value = body.get(ctx.backend.version_key) if isinstance(body, dict) else None
    return str(value)[:80] if isinstance(value, str | int | float) and value != "" else None


def _server(upstream: Upstream, ctx: Context, version: str | None) -> str | None:
    """What identifies the backend: its metrics' known prefix, its Server header, /v1/models' owned_by."""
    parts = []
    if ctx.backend is not None:
        parts.append(f"{ctx.backend.name} {version}" if version else ctx.backend.name)
    if upstream.server_header:
        parts.append(f"Server: {upstream.server_header}")
    data = ctx.models_body.get("data") if isinstance(ctx.models_body, dict) else None
    owner = data[0].get("owned_by") if isinstance(data, list) and data and isinstance(data[0], dict) else None
    if isinstance(owner, str) and owner and not parts:
        parts.append(f"models owned_by {owner}")
    return "; ".join(parts) or None


async def _bounded(probe_id: str, probe: Awaitable[Finding], deadline: float) -> Finding:
    """A probe with a total deadline: past it, a finding that says so (the next probe runs)."""
    try:
        async with asyncio.timeout(deadline):
            return await probe
    except TimeoutError:
        return Finding(probe_id, FAIL, f"did not finish within {deadline:g} s (the check's deadline per probe)")


async def run_check(options: CheckOptions) -> Report:
    """Every probe, one request at a time, each within ``options.probe_deadline``. ``Unreachable`` when
    the first request gets no answer, ``NoModel`` when there is no model to ask for."""
    report = Report(options.upstream)
    upstream_at = Upstream(
        options.upstream, api_key=options.api_key, timeout=options.timeout, max_body=options.max_body,
        stream_deadline=options.stream_deadline,
    )  # fmt: skip
    deadline = options.probe_deadline
    async with upstream_at as upstream:
        try:
            models = await upstream.get("/v1/models")  # Unreachable here: nothing listens
        except Overflow as exc:
            if options.model is None:
                raise NoModel(f"{exc}: give --model NAME") from None
            models = Reply(200, {}, b"")
        models_body = models.json() if models.status == 200 else None
        model = options.model or _first_model(models_body)
        if model is None:
            hint = " (and --api-key KEY)" if models.status in (401, 403) else ""
            raise NoModel(f"GET /v1/models answered {models.status} and names no model: give --model NAME{hint}")
        report.model = model
        ctx = Context(upstream, model, models_body)
        found = {}
        # first: the abort probes count with its counters
        metrics = await _bounded("metrics", probe_metrics(ctx), deadline)
        for dialect in DIALECTS:
            found[f"dialect.{dialect}"] = await _bounded(f"dialect.{dialect}", probe_dialect(ctx, dialect), deadline)
        found["stream.terminal"] = await _bounded("stream.terminal", probe_stream_terminal(ctx), deadline)
        found["stream.usage"] = await _bounded("stream.usage", probe_stream_usage(ctx), deadline)
        found["errors.malformed_json"] = await _bounded("errors.malformed_json", probe_malformed_json(ctx), deadline)
        found["errors.context_overflow"] = await _bounded(
            "errors.context_overflow", probe_context_overflow(ctx), deadline
        )
        plain = await _bounded("abort.stops_generation", probe_stops_generation(ctx), deadline)
        found["abort.stops_generation"] = plain
        found["abort.conversation_replay"] = await _bounded(
            "abort.conversation_replay", probe_conversation_replay(ctx, plain), deadline
        )
        found["resume.prefill"] = await _bounded("resume.prefill", probe_prefill(ctx), deadline)
        found["health"] = await _bounded("health", probe_health(ctx), deadline)
        found["metrics"] = metrics
        for probe_id in PROBE_IDS:
            report.add(found[probe_id])
        try:
            async with asyncio.timeout(deadline):
                version = await _version(upstream, ctx)
        except TimeoutError:
            version = None
        report.server = _server(upstream, ctx, version)
    return report


def main(options: CheckOptions) -> int:
    try:
        report = asyncio.run(run_check(options))
    except Unreachable as exc:
        print(printable(f"streamwarden check: cannot reach {options.upstream}: {exc}"), file=sys.stderr)
        return 2
    except NoModel as exc:
        print(printable(f"streamwarden check: {options.upstream}: {exc}"), file=sys.stderr)
        return 2
    print(render_table(report), flush=True)
    if options.json_path is not None:
        try:
            options.json_path.write_bytes(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
        except OSError as exc:
            print(f"streamwarden check: cannot write {options.json_path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    if not report.reached:
        print(printable(f"streamwarden check: {options.upstream}: {NOT_REACHED}"), file=sys.stderr)
        return 1
    return 0
