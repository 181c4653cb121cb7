"""Flags, environment variables and their validation (design section 8)."""

from __future__ import annotations

import pytest

from proxy.config import REPEATED_FLAGS, SERVE_FLAGS, Config, ConfigError, config_from_args, parse_size, serve_parser


def _config(argv: list[str], env: dict[str, str] | None = None) -> Config:
    return config_from_args(serve_parser().parse_args(["serve", *argv]), env or {})


def test_defaults_match_the_design() -> None:
    cfg = _config(["--upstream", "http://127.0.0.1:8000"])
    assert cfg == Config(upstream="http://127.0.0.1:8000")
    assert (cfg.port, cfg.admin_port, cfg.idle_timeout, cfg.hold_headers) == (8080, 9464, 120.0, 10.0)
    assert cfg.max_body_size == 64 * 1024 * 1024
    assert cfg.on_abandon == "cancel"


def test_every_flag_reads_its_environment_variable_and_the_flag_wins() -> None:
    env = {"STREAMWARDEN_UPSTREAM": "http://backend:8000/prefix/", "STREAMWARDEN_IDLE_TIMEOUT": "7.5",
           "STREAMWARDEN_MAX_BODY_SIZE": "1KiB", "STREAMWARDEN_PORT": "9000"}
    cfg = _config(["--port", "9100"], env)
    assert cfg.upstream == "http://backend:8000/prefix"
    assert cfg.idle_timeout == 7.5
    assert cfg.max_body_size == 1024
    assert cfg.port == 9100


def test_flag_table_and_config_fields_agree() -> None:
    fields = set(Config.__dataclass_fields__) - {"max_event_size"}
    assert {flag.replace("-", "_") for flag in [*SERVE_FLAGS, *REPEATED_FLAGS]} == fields


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        ([], "--upstream is required"),
        (["--upstream", "ftp://x"], "--upstream"),
        (["--upstream", "localhost:8000"], "--upstream"),
        (["--upstream", "http://x", "--idle-timeout", "-1"], "--idle-timeout"),
        (["--upstream", "http://x", "--idle-timeout", "0"], "--idle-timeout"),
        (["--upstream", "http://x", "--port", "70000"], "--port"),
        (["--upstream", "http://x", "--admin-port", "abc"], "--admin-port"),
        (["--upstream", "http://x", "--port", "9464"], "--admin-port"),
        (["--upstream", "http://x", "--max-body-size", "lots"], "--max-body-size"),
        (["--upstream", "http://x", "--on-abandon", "ignore"], "--on-abandon"),
        (["--upstream", "http://x", "--health-path", "v1/models"], "--health-path"),
        (["--upstream", "http://x", "--model-label-limit", "0"], "--model-label-limit"),
        (["--upstream", "http://x", "--hold-headers", "nan"], "--hold-headers"),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace("-", r"\-")):
        _config(argv)


@pytest.mark.parametrize("level", ["WARNING", "Info", "DEBUG", " error "])
def test_log_levels_are_read_in_any_case(level: str) -> None:
    """vLLM users type STREAMWARDEN_LOG_LEVEL=WARNING."""
    assert _config(["--upstream", "http://x"], {"STREAMWARDEN_LOG_LEVEL": level}).log_level == level.strip().lower()
    assert _config(["--upstream", "http://x", "--log-level", level]).log_level == level.strip().lower()
    with pytest.raises(ConfigError, match="--log-level"):
        _config(["--upstream", "http://x", "--log-level", "LOUD"])


@pytest.mark.parametrize("url", ["http://h:8000/v1", "http://h:8000/v1/", "https://gw/openai/v1"])
def test_an_upstream_ending_in_v1_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="without /v1"):
        _config(["--upstream", url])


def test_an_upstream_prefix_that_only_contains_v1_is_kept() -> None:
    assert _config(["--upstream", "http://h:8000/v1beta/x"]).upstream == "http://h:8000/v1beta/x"


def test_bad_environment_value_names_flag_and_variable() -> None:
    with pytest.raises(ConfigError, match="STREAMWARDEN_CONNECT_TIMEOUT") as info:
        _config(["--upstream", "http://x"], {"STREAMWARDEN_CONNECT_TIMEOUT": "soon"})
    assert "--connect-timeout" in str(info.value)
    assert "'soon'" in str(info.value)


@pytest.mark.parametrize(
    ("text", "size"),
    [("1048576", 1048576), ("64MiB", 64 * 2**20), ("512k", 512_000), ("2 GiB", 2 * 2**30), ("1.5KiB", 1536)],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_redacted_upstream_hides_the_password() -> None:
    cfg = Config(upstream="http://user:secret@backend:8000")
    assert "secret" not in cfg.redacted_upstream()
    assert "user" in cfg.redacted_upstream()


# --- --otlp-endpoint -------------------------------------------------------------------------


def test_otlp_endpoint_is_off_by_default_and_read_from_flag_or_variables() -> None:
    assert _config(["--upstream", "http://u"]).otlp_endpoint is None
    assert _config(["--upstream", "http://u", "--otlp-endpoint", "http://collector:4318/"]).otlp_endpoint == (
        "http://collector:4318"
    )
    assert _config(["--upstream", "http://u"], {"STREAMWARDEN_OTLP_ENDPOINT": "https://c:4318"}).otlp_endpoint == (
        "https://c:4318"
    )
    # The standard OpenTelemetry variable, when nothing of ours says otherwise.
    standard = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"}
    assert _config(["--upstream", "http://u"], standard).otlp_endpoint == "http://otel:4318"
    assert _config(["--upstream", "http://u", "--otlp-endpoint", "http://mine:4318"], standard).otlp_endpoint == (
        "http://mine:4318"
    )


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["--otlp-endpoint", "collector:4318"], {}, "argument --otlp-endpoint: expected an http:// or https:// URL"),
        ([], {"OTEL_EXPORTER_OTLP_ENDPOINT": "grpc://x"}, "OTEL_EXPORTER_OTLP_ENDPOINT: expected an http://"),
    ],
)
def test_bad_otlp_endpoints_name_where_they_came_from(argv: list[str], env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        _config(["--upstream", "http://u", *argv], env)


def test_otlp_endpoint_without_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for by flag: a clear start-up error. Only the standard variable (set pod-wide by an
    OpenTelemetry Operator, say): tracing stays off rather than the sidecar refusing to start."""
    import proxy.config

    monkeypatch.setattr(proxy.config, "otel_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"--otlp-endpoint: needs the otel extra: pip install 'streamwarden\[otel\]'"):
        _config(["--upstream", "http://u", "--otlp-endpoint", "http://c:4318"])
    assert _config(["--upstream", "http://u"], {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}).otlp_endpoint is None


# ---- --cancel-hook (repeatable) ----------------------------------------------------------------------------


def test_cancel_hooks_repeat_and_keep_their_order() -> None:
    cfg = _config(["--upstream", "http://u:1", "--cancel-hook", "llama-conversation",
                   "--cancel-hook", 'POST /abort_request {"rid": "{request_id}"}'])  # fmt: skip
    names = [hook.name for hook in cfg.cancel_hook]
    assert names == ["llama-conversation", 'POST /abort_request {"rid": "{request_id}"}']
    assert (cfg.cancel_hook[0].method, cfg.cancel_hook[0].path) == ("DELETE", "/v1/stream?conv_id={conversation_id}")


def test_cancel_hooks_from_the_environment_one_per_line_and_the_flag_wins() -> None:
    hooks = "llama-conversation\n\nDELETE /x/{request_id}\n"
    env = {"STREAMWARDEN_UPSTREAM": "http://u:1", "STREAMWARDEN_CANCEL_HOOK": hooks}
    assert [h.method for h in _config([], env).cancel_hook] == ["DELETE", "DELETE"]
    assert [h.path for h in _config(["--cancel-hook", "POST /abort"], env).cancel_hook] == ["/abort"]
    assert _config(["--upstream", "http://u:1"]).cancel_hook == ()


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("llama", "llama-conversation or 'METHOD /path [JSON body]'"),
        ("FETCH /x", "METHOD is one of"),
        ("POST abort", "the path starts with /"),
        ("POST /abort {rid}", "not rid"),
        ("POST /abort/{session}", "not session"),
        ('POST /abort {"rid": {request_id}', "the body must be JSON"),
    ],
)
def test_bad_cancel_hook_names_the_flag(value: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config(["--upstream", "http://u:1", "--cancel-hook", value])
    assert str(info.value).startswith("argument --cancel-hook: expected llama-conversation or")
    assert words in str(info.value)
    assert repr(value) in str(info.value)


def test_bad_cancel_hook_from_the_environment_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"--cancel-hook \(from STREAMWARDEN_CANCEL_HOOK\)"):
        _config(["--upstream", "http://u:1"], {"STREAMWARDEN_CANCEL_HOOK": "nope"})


def test_the_sidecar_s_bounds_are_split_across_workers() -> None:
    """--max-buffered-body-bytes, --max-client-connections and --upstream-max-connections promise a bound
    for the whole sidecar: with --workers N each worker holds its share, and the shares sum to it."""
    import dataclasses

    from proxy.config import Config

    config = dataclasses.replace(Config(upstream="http://127.0.0.1:1"), workers=3, max_buffered_body_bytes=256 * 2**20,
                                 max_client_connections=4096, upstream_max_connections=10)  # fmt: skip
    shares = [config.worker_share(i) for i in range(3)]
    assert sum(s.max_buffered_body_bytes for s in shares) == 256 * 2**20
    assert sum(s.max_client_connections for s in shares) == 4096
    assert [s.upstream_max_connections for s in shares] == [4, 3, 3]
    unlimited = dataclasses.replace(config, upstream_max_connections=0)
    assert {unlimited.worker_share(i).upstream_max_connections for i in range(3)} == {0}
    few = dataclasses.replace(config, upstream_max_connections=2)
    assert [few.worker_share(i).upstream_max_connections for i in range(3)] == [1, 1, 1]  # at least one each
    single = dataclasses.replace(config, workers=1)
    assert single.worker_share(0) == single
