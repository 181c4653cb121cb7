"""Command line and environment: the one place that reads either, producing a frozen `Config`.

Every `serve` flag also reads `STREAMWARDEN_<FLAG>`; a flag beats the variable. A bad value stops
start-up with argparse's usage line and one line naming the flag and what it expects (exit 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote

import orjson
from aiohttp import encode_basic_auth
from yarl import URL

__all__ = [
    "CONVERSATION_HEADER",
    "HOOK_ID_MAX",
    "OPTIONAL_DEFAULTS",
    "REPEATED_FLAGS",
    "SERVE_FLAGS",
    "CancelHook",
    "Config",
    "ConfigError",
    "HookCall",
    "HookError",
    "UnsendableId",
    "add_serve_parser",
    "config_from_args",
    "env_name",
    "metavar",
    "otel_installed",
    "parse_hook",
    "parse_hooks",
    "parse_size",
    "path_segment",
    "serve_parser",
]

# --- --cancel-hook values: parsed here, fired by proxy.exchange.hooks.
CONVERSATION_HEADER = "X-Conversation-Id"
HOOK_ID_MAX = 200  # the bound a client's X-Request-Id has: a longer id is not sent (60 KB URLs)
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_KNOWN = frozenset({"request_id", "conversation_id"})
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
_PRESETS = {"llama-conversation": "DELETE /v1/stream?conv_id={conversation_id}"}
_EXPECTED = "llama-conversation or 'METHOD /path [JSON body]', e.g. 'POST /abort_request {\"rid\": \"{request_id}\"}'"
_SAMPLE = "0"  # substituted for every placeholder to check that a body template is JSON


class HookError(ValueError):
    """A `--cancel-hook` value that cannot be used; the message says what is expected."""


class UnsendableId(ValueError):
    """An id a hook must not carry: longer than HOOK_ID_MAX, or (in a JSON body) bytes that are not UTF-8."""


@dataclass(frozen=True, slots=True)
class HookCall:
    method: str
    path: str  # percent-encoded: sent as it is, never re-quoted or normalised
    body: bytes | None


@dataclass(frozen=True, slots=True)
class CancelHook:
    """One parsed hook: a request template with `{request_id}` / `{conversation_id}` placeholders.

    `quoted` says, for each placeholder of the body in order, whether the template put it inside a
    JSON string: there its value is escaped; elsewhere it becomes a whole JSON string, so that no id
    can turn into a number, an array, an object or null.
    """

    name: str  # as the operator wrote it (a preset's name, or the template), for logs
    method: str
    path: str
    body: str | None
    quoted: tuple[bool, ...] = ()

    @property
    def needs_conversation(self) -> bool:
        return "{conversation_id}" in self.path or "{conversation_id}" in (self.body or "")

    def render(self, request_id: str, conversation_id: str | None) -> HookCall | None:
        """The call for one exchange; None when it needs a conversation id the request did not have.

        Raises UnsendableId for an id the call must not carry. Header values arrive as the main port decodes
        them (UTF-8, other bytes as surrogate escapes): in a path they go out as their original bytes.
        """
        if self.needs_conversation and not conversation_id:
            return None
        values = {"request_id": request_id, "conversation_id": conversation_id or ""}
        for value in values.values():
            if len(value) > HOOK_ID_MAX:
                raise UnsendableId(f"an id of {len(value)} characters (at most {HOOK_ID_MAX} are sent)")
        path = _PLACEHOLDER.sub(lambda m: path_segment(values[m.group(1)]), self.path)
        body = None
        if self.body is not None:
            places = iter(self.quoted)
            body = _PLACEHOLDER.sub(lambda m: _json_value(values[m.group(1)], next(places)), self.body).encode()
        return HookCall(self.method, path, body)


def path_segment(value: str) -> str:
    """Every byte outside RFC 3986's unreserved set percent-encoded, and dots too: `..` cannot climb."""
    return quote(value.encode("utf-8", "surrogateescape"), safe="").replace(".", "%2E")


def _json_value(value: str, quoted: bool) -> str:
    try:
        text = orjson.dumps(value).decode()
    except TypeError:  # lone surrogates: header bytes that are not UTF-8 have no JSON string
        raise UnsendableId("an id that is not UTF-8, in a JSON body") from None
    return text[1:-1] if quoted else text


def _quoted_placeholders(body: str) -> tuple[bool, ...]:
    """For each placeholder of a JSON body template, in order: is it inside a JSON string?"""
    found: list[bool] = []
    inside = escaped = False
    i = 0
    while i < len(body):
        char = body[i]
        match = _PLACEHOLDER.match(body, i) if char == "{" else None
        if match is not None and not escaped:
            found.append(inside)
            i = match.end()
            continue
        if inside and escaped:
            escaped = False
        elif inside and char == "\\":
            escaped = True
        elif char == '"':
            inside = not inside
        i += 1
    return tuple(found)


def parse_hook(text: str) -> CancelHook:
    """`llama-conversation` or `'METHOD /path [JSON body]'`; raises HookError naming what is wrong."""
    spec = text.strip()
    name = spec
    spec = _PRESETS.get(spec, spec)
    parts = spec.split(None, 2)
    expected = _EXPECTED
    if len(parts) < 2:
        raise HookError(expected)
    method, path = parts[0], parts[1]
    body = parts[2] if len(parts) == 3 else None
    if method not in _METHODS:
        raise HookError(f"{expected} (METHOD is one of {', '.join(sorted(_METHODS))})")
    if not path.startswith("/"):
        raise HookError(f"{expected} (the path starts with /)")
    for template in (path, body or ""):
        unknown = sorted({m.group(1) for m in _PLACEHOLDER.finditer(template)} - _KNOWN)
        if unknown:
            raise HookError(f"{expected} (placeholders are {{request_id}} and {{conversation_id}}, not {unknown[0]})")
    quoted: tuple[bool, ...] = ()
    if body is not None:
        quoted = _quoted_placeholders(body)
        places = iter(quoted)
        try:
            orjson.loads(_PLACEHOLDER.sub(lambda _: _SAMPLE if next(places) else f'"{_SAMPLE}"', body))
        except orjson.JSONDecodeError:
            raise HookError(f"{expected} (the body must be JSON)") from None
    return CancelHook(name, method, path, body, quoted)


def parse_hooks(values: list[str]) -> tuple[CancelHook, ...]:
    return tuple(parse_hook(value) for value in values if value.strip())


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A flag or environment value that cannot be used; the message names what is expected."""


def parse_size(text: str) -> int:
    """`64MiB`, `512k`, `1048576` -> bytes."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ConfigError("a size in bytes such as 1048576, 512KiB or 64MiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError("a number of seconds, 0 or more") from None
    if not value >= 0 or value == float("inf"):
        raise ConfigError("a number of seconds, 0 or more")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise ConfigError("a number of seconds greater than 0")
    return value


def _port(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 65535:
        raise ConfigError("a TCP port from 1 to 65535")
    return int(text)


def _count(text: str) -> int:
    if not text.strip().isdigit():
        raise ConfigError("a whole number, 0 or more")
    return int(text)


def _positive_count(text: str) -> int:
    value = _count(text)
    if value == 0:
        raise ConfigError("a whole number greater than 0")
    return value


def _upstream(text: str) -> str:
    """The backend's base URL. One that ends in `/v1` (what OPENAI_BASE_URL looks like) is refused, as
    `check` refuses it: clients' paths already carry `/v1`, so the proxy would ask for `/v1/v1/...`, go
    ready (the health path answers elsewhere) and forward every request to a 404. Stripping it instead
    would guess: a gateway prefix may really end in `/v1`, and then the operator writes it out."""
    url = URL(text.strip())
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError("an http:// or https:// URL such as http://127.0.0.1:8000")
    if url.query_string or url.fragment:
        raise ConfigError("a base URL without query or fragment")
    if url.path.rstrip("/").endswith("/v1"):
        root = str(url.with_path(url.path.rstrip("/")[: -len("/v1")] or "/")).rstrip("/")
        raise ConfigError(f"the backend's root URL, without /v1 (the clients' paths carry it: write {root})")
    return str(url).rstrip("/")


def _path(text: str) -> str:
    if not text.startswith("/"):
        raise ConfigError("a path starting with /")
    return text


class _Choice:
    """A parser of one of fixed words; `--help` shows them as `{a,b}`, as argparse's own choices do."""

    def __init__(self, *options: str, fold_case: bool = False) -> None:
        self.options = options
        self.fold_case = fold_case

    def __call__(self, text: str) -> str:
        value = text.strip().lower() if self.fold_case else text
        if value not in self.options:
            raise ConfigError("one of " + ", ".join(self.options))
        return value


def _choice(*options: str, fold_case: bool = False) -> Callable[[str], str]:
    return _Choice(*options, fold_case=fold_case)


def _optional_url(text: str) -> str | None:
    """An http(s) URL, or empty for off."""
    if not text.strip():
        return None
    url = URL(text.strip())
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError("an http:// or https:// URL such as http://otel-collector:4318, or empty for off")
    return str(url).rstrip("/")


MAX_WORKERS = 256
AUTO_WORKERS = 0  # `--workers auto`: resolved by `proxy.workers.cpus.resolve_workers` before serving


def _workers(text: str) -> int:
    """A count of worker processes, or `auto`: the CPUs this process may use (affinity, cgroup quota)."""
    if text.strip() == "auto":
        return AUTO_WORKERS
    if not text.strip().isdigit() or not 1 <= int(text) <= MAX_WORKERS:
        raise ConfigError(f"a number of worker processes from 1 to {MAX_WORKERS}, or auto")
    return int(text)


def _host(text: str) -> str:
    if not text.strip():
        raise ConfigError("a host name or address to listen on")
    return text.strip()


# flag -> (parser, default, help). The single source of truth for `serve`'s flags.
SERVE_FLAGS: dict[str, tuple[Callable[[str], Any], str | None, str]] = {
    "upstream": (
        _upstream, None, "root URL of the OpenAI-compatible backend, without /v1 (http://h:8000), may carry a "
        "path prefix (http://h:8000/prefix); its host must resolve at start",
    ),
    "host": (_host, "0.0.0.0", "address to listen on (both ports)"),
    "port": (_port, "8080", "main port: every request on it is forwarded to the upstream"),
    "admin-port": (_port, "9464", "admin port: /metrics, /healthz, /readyz"),
    "connect-timeout": (_positive_seconds, "10", "seconds to open an upstream connection"),
    "first-byte-timeout": (
        _positive_seconds, "600", "seconds to wait for the upstream's response headers (covers prefill and queueing)",
    ),
    "idle-timeout": (
        _positive_seconds, "120", "seconds of upstream silence inside a stream (or a body) before it is ended",
    ),
    "hold-headers": (_seconds, "10", "seconds to hold a stream's 200 until the first content (0: commit at once)"),
    "keepalive-interval": (_seconds, "15", "seconds of upstream silence between ': keep-alive' comments (0: off)"),
    "drain-timeout": (_seconds, "30", "seconds streams may run on after SIGTERM"),
    "max-body-size": (parse_size, "64MiB", "largest request body; bigger gets 413 and nothing is sent upstream"),
    "upstream-max-connections": (
        _count, "0", "upstream connection pool size, for the whole sidecar (split across workers); 0 is unlimited "
        "(a proxy must not add a queue the backend has not)",
    ),
    "client-stall-timeout": (_positive_seconds, "60", "seconds a client may stop reading before it counts as gone"),
    "health-path": (_path, "/v1/models", "upstream path that /readyz probes"),
    "health-interval": (
        _seconds, "10", "probe the upstream at start and after N seconds without a probe, logging upstream_down "
        "and upstream_up (0: only /readyz and /metrics probe)",
    ),
    "on-abandon": (
        _choice("cancel", "drain"), "cancel", "when the client leaves: cancel the upstream, or drain it for usage",
    ),
    "model-label-limit": (_positive_count, "50", "distinct model label values before the rest become 'other'"),
    "log-format": (_choice("json", "console"), "json", "json (one line per request) or console (for humans)"),
    "log-level": (
        _choice("debug", "info", "warning", "error", fold_case=True), "info",  # vLLM's habit: WARNING
        "lowest level logged; request lines are info when ok or aborted, warning on error, error on a proxy bug",
    ),
    "admin-host": (_host, None, "address the admin port listens on (default: --host's)"),
    "client-header-timeout": (
        _positive_seconds, "60", "seconds a client may take to send a request's line and headers (then 408)",
    ),
    "client-body-timeout": (_positive_seconds, "60", "longest gap in seconds between reads of a body (then 408)"),
    "client-keepalive-timeout": (_positive_seconds, "75", "seconds an idle keep-alive client connection stays open"),
    "max-header-size": (parse_size, "64KiB", "largest request line plus headers accepted (bigger: 431)"),
    "max-client-connections": (
        _positive_count, "4096",
        "open client connections on the main port, for the whole sidecar (split across workers; more: 503 and closed)",
    ),
    "max-buffered-body-bytes": (
        parse_size, "256MiB",
        "request body bytes held at once across all requests, for the whole sidecar (split across workers; more: 503)",
    ),
    "workers": (
        _workers, "1", "worker processes sharing the main port (SO_REUSEPORT); auto: the CPUs this process may use",
    ),
    "resume-on-cut": (
        _count, "0", "continue a chat or completions stream cut mid-answer on the same upstream, at most N "
        "times per request (0: off)",
    ),
    # Traces. Also read from OTEL_EXPORTER_OTLP_ENDPOINT (see config_from_args).
    "otlp-endpoint": (_optional_url, "", "OTLP/HTTP collector base URL for traces; needs streamwarden[otel]"),
}
_OPTIONAL = frozenset({"admin-host"})  # flags whose default is derived from another flag
OPTIONAL_DEFAULTS = {"admin-host": "`--host`'s"}  # what those defaults are, for the README's table


# Repeatable flags: flag -> (parser of one value, help). The variable holds one value per line.
REPEATED_FLAGS: dict[str, tuple[Callable[[str], Any], str]] = {
    "cancel-hook": (parse_hook, "on abandon, also call the upstream: llama-conversation or 'METHOD /path [JSON]' "
                    "with {request_id} and {conversation_id} (repeatable; default none)"),
}


def _default(flag: str) -> Any:
    """A flag's default as `Config` holds it: its default text, parsed like any value given."""
    parse, default, _ = SERVE_FLAGS[flag]
    assert default is not None, flag
    return parse(default)


@dataclass(frozen=True, slots=True)
class Config:
    """Everything `serve` was told, validated once at start-up. Defaults come from SERVE_FLAGS alone."""

    upstream: str
    host: str = _default("host")
    port: int = _default("port")
    admin_port: int = _default("admin-port")
    connect_timeout: float = _default("connect-timeout")
    first_byte_timeout: float = _default("first-byte-timeout")
    idle_timeout: float = _default("idle-timeout")
    hold_headers: float = _default("hold-headers")
    keepalive_interval: float = _default("keepalive-interval")
    drain_timeout: float = _default("drain-timeout")
    max_body_size: int = _default("max-body-size")
    upstream_max_connections: int = _default("upstream-max-connections")
    client_stall_timeout: float = _default("client-stall-timeout")
    health_path: str = _default("health-path")
    health_interval: float = _default("health-interval")
    on_abandon: str = _default("on-abandon")
    model_label_limit: int = _default("model-label-limit")
    log_format: str = _default("log-format")
    log_level: str = _default("log-level")
    admin_host: str = ""  # "" = the same as `host`
    client_header_timeout: float = _default("client-header-timeout")
    client_body_timeout: float = _default("client-body-timeout")
    client_keepalive_timeout: float = _default("client-keepalive-timeout")
    max_header_size: int = _default("max-header-size")
    max_client_connections: int = _default("max-client-connections")
    max_buffered_body_bytes: int = _default("max-buffered-body-bytes")
    max_event_size: int = 8 * 1024 * 1024
    cancel_hook: tuple[CancelHook, ...] = ()
    workers: int = _default("workers")  # more than 1: a supervisor and N workers (proxy.workers); 0: auto
    otlp_endpoint: str | None = _default("otlp-endpoint")  # OpenTelemetry traces over OTLP/HTTP; None: off
    resume_on_cut: int = _default("resume-on-cut")  # continuations per streamed request (proxy.core.resume); 0: off

    @property
    def admin_listen_host(self) -> str:
        return self.admin_host or self.host

    def upstream_target(self) -> tuple[str, str | None]:
        """(the upstream base URL without credentials, a Basic `Authorization` value from them or None).

        Credentials in the URL are not a request target; clients usually send an Authorization header
        of their own (an API key), so the URL's become a header the proxy adds only when the client
        sent none.
        """
        url = URL(self.upstream)
        if url.user is None and url.password is None:
            return self.upstream, None
        auth = encode_basic_auth(url.user or "", url.password or "")
        return str(url.with_user(None)).rstrip("/"), auth

    def redacted_upstream(self) -> str:
        """The upstream URL without a password, for logs."""
        url = URL(self.upstream)
        return str(url.with_password("***")) if url.password else str(url)

    def worker_share(self, index: int) -> Config:
        """What worker `index` of `--workers N` may hold: each bound that is promised for the whole
        sidecar (body bytes held, client connections, upstream connections), split across the
        workers, the remainder to the first ones, so that their sum is the configured bound.

        A worker gets at least one connection of each kind (a bound below N workers is then N); an
        unlimited upstream pool (0) stays unlimited. A body larger than a worker's share of the body
        budget is refused by that worker (503) though the sidecar's whole budget is free: the price
        of workers that do not share memory.
        """
        workers = max(1, self.workers)
        if workers == 1:
            return self

        def share(total: int, least: int) -> int:
            return max(least, total // workers + (1 if index < total % workers else 0))

        pool = self.upstream_max_connections
        return replace(
            self,
            max_buffered_body_bytes=share(self.max_buffered_body_bytes, 1),
            max_client_connections=share(self.max_client_connections, 1),
            upstream_max_connections=share(pool, 1) if pool else 0,
        )


def env_name(flag: str) -> str:
    return "STREAMWARDEN_" + flag.upper().replace("-", "_")


_METAVARS: dict[Callable[[str], Any], str] = {
    _upstream: "URL", _optional_url: "URL", _host: "HOST", _port: "PORT", _path: "PATH", parse_size: "SIZE",
    _seconds: "SECONDS", _positive_seconds: "SECONDS", _count: "N", _positive_count: "N", _workers: "N|auto",
    parse_hook: "HOOK",
}


def metavar(parse: Callable[[str], Any]) -> str:
    """What `--help` (and the README's flag table) shows after a flag: its kind of value, or its choices."""
    if isinstance(parse, _Choice):
        return "{" + ",".join(parse.options) + "}"
    return _METAVARS.get(parse, "VALUE")


def add_serve_parser(subparsers: Any) -> None:
    """The `serve` sub-command with every flag of SERVE_FLAGS and REPEATED_FLAGS (called by `proxy.cli`)."""
    serve = subparsers.add_parser(
        "serve",
        help="run the proxy",
        description="Run the proxy. Every flag also reads STREAMWARDEN_<FLAG>; a flag beats the variable.",
    )
    for flag, (parse, default, text) in SERVE_FLAGS.items():
        shown = f" (default {default})" if default else " (default: off)" if default == "" else ""
        shown = shown if default is not None or flag in _OPTIONAL else " (required)"
        serve.add_argument(
            f"--{flag}", metavar=metavar(parse), default=None, help=f"{text}{shown}; env {env_name(flag)}",
        )
    for flag, (parse, text) in REPEATED_FLAGS.items():
        serve.add_argument(f"--{flag}", metavar=metavar(parse), action="append", default=None,
                           help=f"{text}; env {env_name(flag)}, one per line")


def serve_parser() -> argparse.ArgumentParser:
    """A parser of `serve`'s command line alone (the healthcheck reads a running proxy's with it)."""
    parser = argparse.ArgumentParser(prog="streamwarden")
    add_serve_parser(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return parser


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Config:
    """Flags beat `STREAMWARDEN_*` variables beat defaults. Raises ConfigError naming the flag."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for flag, (parse, default, _) in SERVE_FLAGS.items():
        raw = getattr(args, flag.replace("-", "_"), None)
        source = f"--{flag}"
        if raw is None and env.get(env_name(flag)):
            raw, source = env[env_name(flag)], f"--{flag} (from {env_name(flag)})"
        if raw is None:
            raw = default
        if raw is None and flag in _OPTIONAL:
            continue
        if raw is None:
            raise ConfigError(f"argument {source} is required: expected {_describe(parse)}")
        try:
            values[flag.replace("-", "_")] = parse(raw)
        except ConfigError as exc:
            raise ConfigError(f"argument {source}: expected {exc}, got {raw!r}") from None
    for flag, (parse, _) in REPEATED_FLAGS.items():
        raws: list[str] = getattr(args, flag.replace("-", "_"), None) or []
        source = f"--{flag}"
        if not raws and env.get(env_name(flag), "").strip():
            raws, source = env[env_name(flag)].splitlines(), f"--{flag} (from {env_name(flag)})"
        parsed = []
        for raw in raws:
            if not raw.strip():
                continue
            try:
                parsed.append(parse(raw))
            except (ConfigError, HookError) as exc:
                raise ConfigError(f"argument {source}: expected {exc}, got {raw!r}") from None
        values[flag.replace("-", "_")] = tuple(parsed)
    if values["port"] == values["admin_port"]:
        raise ConfigError("argument --admin-port: expected a port other than --port's")
    values["otlp_endpoint"] = _otlp_endpoint(values["otlp_endpoint"], env)
    return Config(**values)


def otel_installed() -> bool:
    """Whether the `otel` extra (the SDK and its OTLP/HTTP exporter) is importable."""
    try:
        return importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None and (
            importlib.util.find_spec("opentelemetry.sdk.trace") is not None
        )
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _otlp_endpoint(explicit: str | None, env: Mapping[str, str]) -> str | None:
    """--otlp-endpoint needs the otel extra; the standard OTEL_EXPORTER_OTLP_ENDPOINT is used
    when the extra is there (an OpenTelemetry Operator may set it in every pod, with or without it)."""
    if explicit is not None:
        if not otel_installed():
            raise ConfigError("argument --otlp-endpoint: needs the otel extra: pip install 'streamwarden[otel]'")
        return explicit
    standard = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if not standard.strip() or not otel_installed():
        return None
    try:
        return _optional_url(standard)
    except ConfigError as exc:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_ENDPOINT: expected {exc}, got {standard!r}") from None


def _describe(parse: Callable[[str], Any]) -> str:
    try:
        parse("")
    except ConfigError as exc:
        return str(exc)
    return "a value"
