"""The `check` sub-command's arguments: kept apart from the probes so that registering the command
(every `streamwarden` start builds the parser) loads nothing of the tool itself."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from yarl import URL

__all__ = ["CheckOptions", "add_arguments", "options_from_args"]


@dataclass(frozen=True, slots=True)
class CheckOptions:
    upstream: str
    model: str | None = None
    api_key: str | None = None
    json_path: Path | None = None
    timeout: float = 30.0
    max_body: int = 16 * 1024 * 1024  # bytes of one answer or stream (client.MAX_BODY)
    probe_deadline: float = 300.0  # seconds one probe may take in all (an abandonment probe waits for idle twice)
    stream_deadline: float | None = None  # seconds one stream may take in all; None: 2 x timeout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", required=True, metavar="URL", help="the backend's root URL (http://host:port)")
    parser.add_argument("--model", metavar="NAME", help="the model to ask (default: the first /v1/models lists)")
    parser.add_argument("--api-key", metavar="KEY", help="sent as Authorization: Bearer and x-api-key")
    parser.add_argument("--json", metavar="PATH", dest="json_path", help="also write the report as JSON here")
    parser.add_argument(
        "--timeout", type=float, default=30.0, metavar="SECONDS", help="bound for each probe request (30)"
    )


def options_from_args(args: argparse.Namespace) -> CheckOptions:
    """``ValueError`` with one line for a bad value."""
    url = URL(args.upstream)
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"--upstream must be an http:// or https:// URL, got {args.upstream!r}")
    if url.query_string or url.fragment:
        raise ValueError("--upstream must be a root URL without a query or fragment")
    if url.path.rstrip("/").endswith("/v1"):
        raise ValueError(f"--upstream is the backend's root URL, without /v1 (the probes add it): {args.upstream!r}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    json_path = Path(args.json_path) if args.json_path else None
    if json_path is not None and not json_path.parent.is_dir():
        raise ValueError(f"--json: the directory {str(json_path.parent)!r} does not exist")
    model = args.model or None
    if args.model is not None and not args.model.strip():
        raise ValueError("--model must not be empty")
    return CheckOptions(str(url), model, args.api_key or None, json_path, float(args.timeout))
