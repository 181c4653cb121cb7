"""`streamwarden check`: run the probes one after another against one backend, print the table, and
write the JSON report. Exit 0 when a report was made from a backend that answered; 1 when no dialect
answered a plain request (the report is written, and says so); 2 with one line for a bad argument or a
backend that cannot be reached at all.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import orjson

from proxy.tools.check.abandon import probe_conversation_replay, probe_prefill, probe_stops_generation
from proxy.tools.check.client import Unreachable, Upstream
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
from proxy.tools.check.report import NOT_REACHED, PROBE_IDS, Report, render_table
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


async def run_check(options: CheckOptions) -> Report:
    """Every probe, one request at a time. ``Unreachable`` when the first request gets no answer,
    ``NoModel`` when there is no model to ask for."""
    report = Report(options.upstream)
    async with Upstream(options.upstream, api_key=options.api_key, timeout=options.timeout) as upstream:
        models = await upstream.get("/v1/models")  # Unreachable here: nothing listens
        models_body = models.json() if models.status == 200 else None
        model = options.model or _first_model(models_body)
        if model is None:
            hint = " (and --api-key KEY)" if models.status in (401, 403) else ""
            raise NoModel(f"GET /v1/models answered {models.status} and names no model: give --model NAME{hint}")
        report.model = model
        ctx = Context(upstream, model, models_body)
        found = {}
        metrics = await probe_metrics(ctx)  # first: the abort probes count with its counters
        for dialect in DIALECTS:
            found[f"dialect.{dialect}"] = await probe_dialect(ctx, dialect)
        found["stream.terminal"] = await probe_stream_terminal(ctx)
        found["stream.usage"] = await probe_stream_usage(ctx)
        found["errors.malformed_json"] = await probe_malformed_json(ctx)
        found["errors.context_overflow"] = await probe_context_overflow(ctx)
        found["abort.stops_generation"] = plain = await probe_stops_generation(ctx)
        found["abort.conversation_replay"] = await probe_conversation_replay(ctx, plain)
        found["resume.prefill"] = await probe_prefill(ctx)
        found["health"] = await probe_health(ctx)
        found["metrics"] = metrics
        for probe_id in PROBE_IDS:
            report.add(found[probe_id])
        report.server = _server(upstream, ctx, await _version(upstream, ctx))
    return report


def main(options: CheckOptions) -> int:
    try:
        report = asyncio.run(run_check(options))
    except Unreachable as exc:
        print(f"streamwarden check: cannot reach {options.upstream}: {exc}", file=sys.stderr)
        return 2
    except NoModel as exc:
        print(f"streamwarden check: {options.upstream}: {exc}", file=sys.stderr)
        return 2
    print(render_table(report), flush=True)
    if options.json_path is not None:
        try:
            options.json_path.write_bytes(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
        except OSError as exc:
            print(f"streamwarden check: cannot write {options.json_path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    if not report.reached:
        print(f"streamwarden check: {options.upstream}: {NOT_REACHED}", file=sys.stderr)
        return 1
    return 0
