"""Dialect registry, request inspection, and the contract every dialect's frames must keep."""

from __future__ import annotations

import json
import zlib

import orjson
import pytest
from anthropic._streaming import SSEDecoder as AnthropicDecoder
from openai._streaming import SSEDecoder as OpenAIDecoder

from proxy.core.dialects import DIALECTS, Dialect, Kind, RequestInfo, for_request, inspect_request, read_request
from proxy.core.dialects.request import MAX_PARSED_VALUES
from proxy.core.sse import Event

ALL = sorted(DIALECTS)
OPENAI_STREAMING = ["chat_completions", "completions", "responses", "embeddings", "models"]


@pytest.mark.parametrize(
    ("method", "path", "name"),
    [
        ("POST", "/v1/chat/completions", "chat_completions"),
        ("POST", "/chat/completions", "chat_completions"),
        ("POST", "/v1/chat/completions/", "chat_completions"),
        ("post", "/v1/chat/completions", "chat_completions"),
        ("POST", "/v1/completions", "completions"),
        ("POST", "/completions", "completions"),
        ("POST", "/v1/responses", "responses"),
        ("POST", "/v1/messages", "messages"),
        ("POST", "/messages/", "messages"),
        ("POST", "/v1/embeddings", "embeddings"),
        ("GET", "/v1/models", "models"),
        ("GET", "/models", "models"),
        ("GET", "/v1/models/", "models"),
        ("GET", "/v1/models/meta-llama/Llama-3-8B", "models"),
        ("GET", "/v1/chat/completions", "other"),
        ("POST", "/v1/models", "other"),
        ("GET", "/v1/responses/resp_1", "other"),
        ("POST", "/v1/chat/completions/extra", "other"),
        ("POST", "/generate_stream", "other"),
        ("GET", "/metrics", "other"),
        ("GET", "/", "other"),
        ("GET", "/v1", "other"),
        ("POST", "/v2/chat/completions", "other"),
        ("GET", "/v1/modelsx", "other"),
    ],
)
def test_for_request_classifies_per_design_table(method: str, path: str, name: str) -> None:
    dialect = for_request(method, path)
    assert dialect.name == name
    assert dialect is DIALECTS[name]
    assert dialect.json_body is (name != "other")


@pytest.fixture(params=ALL)
def dialect(request: pytest.FixtureRequest) -> Dialect:
    return DIALECTS[request.param]


# ---- shared contract over every dialect ---------------------------------------------------------

STATUSES = [400, 401, 403, 404, 413, 422, 429, 500, 502, 503, 504, 529]


@pytest.mark.parametrize("status", STATUSES)
def test_error_body_is_the_dialect_shape(dialect: Dialect, status: int) -> None:
    body = orjson.loads(dialect.error_body(status, "boom", "stream_cut"))
    if dialect.anthropic:
        assert body["type"] == "error"
        assert set(body["error"]) == {"type", "message"}
        assert body["error"]["message"] == "boom"
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["message"] == "boom"
        assert body["error"]["code"] == "stream_cut"
        assert body["error"]["param"] is None
    assert dialect.own_error_shape(body)


def test_error_body_message_is_cut_to_500_chars(dialect: Dialect) -> None:
    body = orjson.loads(dialect.error_body(502, "é" * 2000))
    assert body["error"]["message"] == "é" * 500


def test_error_body_survives_lone_surrogates(dialect: Dialect) -> None:
    body = orjson.loads(dialect.error_body(502, "bad \ud800 text"))
    assert body["error"]["message"].startswith("bad ")


def test_new_stream_is_fresh_per_exchange(dialect: Dialect) -> None:
    first, second = dialect.new_stream(), dialect.new_stream()
    assert first is not second
    assert first.usage is None
    assert first.error is None


def test_comment_block_is_a_comment(dialect: Dialect) -> None:
    assert dialect.new_stream().classify(Event(raw=b": keep-alive\n\n")) is Kind.COMMENT


def test_bare_error_field_is_foreign(dialect: Dialect) -> None:
    stream = dialect.new_stream()
    raw = b'error: {"code":500,"message":"llama died","type":"server_error"}\n\n'
    assert stream.classify(Event(raw=raw)) is Kind.FOREIGN
    assert stream.error is not None
    assert (stream.error.status, stream.error.message) == (500, "llama died")


def _decode_openai(frame: bytes) -> list[tuple[str | None, str]]:
    return [(sse.event, sse.data) for sse in OpenAIDecoder().iter_bytes(iter([frame]))]


def _decode_anthropic(frame: bytes) -> list[tuple[str | None, str]]:
    return [(sse.event, sse.data) for sse in AnthropicDecoder().iter_bytes(iter([frame]))]


@pytest.mark.parametrize("status", [429, 502, 504])
def test_error_frame_is_well_formed_and_raises_in_the_sdk(dialect: Dialect, status: int) -> None:
    frame = dialect.new_stream().error_frame(status, "upstream broke", "stream_cut")
    assert frame.endswith(b"\n\n")
    assert not frame.startswith(b"\n")
    lines = frame.split(b"\n")
    if dialect.name in OPENAI_STREAMING:
        assert not any(line.startswith((b"id:", b"retry:")) for line in lines)
    if dialect.anthropic:
        events = _decode_anthropic(frame)
        assert [name for name, _ in events] == ["error"]
        body = json.loads(events[0][1])
        assert body["error"]["type"] in {"rate_limit_error", "api_error", "timeout_error"}
        return
    events = _decode_openai(frame)
    payloads = [json.loads(data) for _, data in events if not data.startswith("[DONE]")]
    # openai-python raises on the first JSON object with a truthy top-level `error` (a dict).
    raising = [p for p in payloads if isinstance(p, dict) and isinstance(p.get("error"), dict)]
    assert raising, payloads
    assert raising[0]["error"]["message"] == "upstream broke"
    for name, data in events:  # every event is one an SDK can parse: JSON or the [DONE] marker
        assert data == "[DONE]" or isinstance(json.loads(data), dict), (name, data)


def test_terminal_frame_is_well_formed(dialect: Dialect) -> None:
    frame = dialect.new_stream().terminal_frame()
    if frame is None:
        assert dialect.name in {"responses", "other"}
        return
    assert frame.endswith(b"\n\n")
    if dialect.anthropic:
        assert _decode_anthropic(frame) == [("message_stop", '{"type":"message_stop"}')]
    else:
        assert _decode_openai(frame) == [(None, "[DONE]")]


def test_malformed_data_is_dropped_in_json_dialects(dialect: Dialect) -> None:
    kind = dialect.new_stream().classify(Event(raw=b"data: {oops\n\n", data=b"{oops", has_data=True))
    assert kind is (Kind.CONTENT if dialect.name == "other" else Kind.MALFORMED)


def test_event_without_data_is_malformed_in_json_dialects(dialect: Dialect) -> None:
    kind = dialect.new_stream().classify(Event(raw=b"event: ping\n\n", event="ping"))
    assert kind is (Kind.PASS if dialect.name == "other" else Kind.MALFORMED)


def test_non_object_json_is_malformed_in_json_dialects(dialect: Dialect) -> None:
    kind = dialect.new_stream().classify(Event(raw=b"data: [1]\n\n", data=b"[1]", has_data=True))
    assert kind is (Kind.CONTENT if dialect.name == "other" else Kind.MALFORMED)


# ---- request inspection ------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"", b"null", b"[1,2]", b"{not json", b"\xff\xfe", b'"text"', b"{" * 5000, b"  "])
def test_inspect_request_defaults_on_anything_odd(dialect: Dialect, body: bytes) -> None:
    assert inspect_request(dialect, body) == RequestInfo()


def test_inspect_request_reads_the_fields() -> None:
    body = orjson.dumps(
        {"model": "m1", "stream": True, "n": 3, "stream_options": {"include_usage": True}, "messages": []}
    )
    info = inspect_request(DIALECTS["chat_completions"], body)
    assert info == RequestInfo(model="m1", stream=True, n=3, prompts=1, include_usage=True)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"model": 5, "stream": "yes", "n": True, "stream_options": {"include_usage": 1}}, RequestInfo()),
        ({"n": 0}, RequestInfo()),
        ({"n": -2}, RequestInfo()),
        ({"stream": False}, RequestInfo()),
        ({"stream_options": None}, RequestInfo()),
    ],
)
def test_inspect_request_ignores_wrong_types(fields: dict[str, object], expected: RequestInfo) -> None:
    assert inspect_request(DIALECTS["chat_completions"], orjson.dumps(fields)) == expected


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("one", 1),
        (["a", "b", "c"], 3),
        ([[1, 2], [3], [4, 5]], 3),
        ([1, 2, 3], 1),
        ([], 1),
        (None, 1),
    ],
)
def test_inspect_request_counts_completions_prompts(prompt: object, prompts: int) -> None:
    body = orjson.dumps({"model": "m", "prompt": prompt, "n": 2})
    info = inspect_request(DIALECTS["completions"], body)
    assert (info.prompts, info.n) == (prompts, 2)


def test_prompts_only_counted_for_completions() -> None:
    body = orjson.dumps({"prompt": ["a", "b"]})
    assert inspect_request(DIALECTS["chat_completions"], body).prompts == 1


# ---- a request body too large to parse: model and stream from a scan of its ends ----------------------


@pytest.mark.parametrize(
    ("body", "model", "stream"),
    [
        (b'{"model":"big-m","stream":true,"input":"' + b"x" * 200_000 + b'"}', "big-m", True),
        (b'{"input":"' + b"x" * 200_000 + b'","model":"tail-m","stream":false}', "tail-m", False),
        (b'{"model":"esc\\"aped","input":"' + b"x" * 200_000 + b'"}', 'esc"aped', False),
        (b'{"input":"' + b"x" * 200_000 + b'"}', None, False),
        (b"\x00\xff" * 100_000, None, False),  # not JSON at all: the defaults, no exception
    ],
)
def test_a_body_past_the_parse_limit_is_scanned(body: bytes, model: str | None, stream: bool) -> None:
    info = inspect_request(DIALECTS["embeddings"], body, parse_limit=100_000)
    assert (info.model, info.stream, info.n, info.prompts) == (model, stream, 1, 1)
    assert inspect_request(DIALECTS["embeddings"], bytearray(body), parse_limit=100_000) == info


# ---- a body costly to parse: scanned like a large one, whatever its size ------------------------------


def _many_values(count: int, fields: bytes = b'"model":"m","n":3,"stream":true') -> bytes:
    return b"{" + fields + b',"x":[' + b"{}," * count + b"{}]}"


def test_a_body_of_more_values_than_the_parse_bound_is_scanned_not_parsed() -> None:
    """2.7 M empty objects in 8.1 MB cost ~25x the body's size while parsed (30 at once: 512 MiB) and
    ~230 ms of the loop each; past MAX_PARSED_VALUES values a body is scanned at its ends instead."""
    body = _many_values(MAX_PARSED_VALUES)
    info, parsed = read_request(DIALECTS["chat_completions"], body)
    assert parsed is None
    assert (info.model, info.stream, info.n) == ("m", True, 1)  # (n is read only by a parse)
    assert read_request(DIALECTS["chat_completions"], bytearray(body))[1] is None


def test_a_body_within_the_parse_bound_is_parsed_once_and_handed_back() -> None:
    body = _many_values(MAX_PARSED_VALUES // 2)
    info, parsed = read_request(DIALECTS["chat_completions"], body)
    assert parsed is not None
    assert len(parsed["x"]) == MAX_PARSED_VALUES // 2 + 1
    assert (info.model, info.stream, info.n) == ("m", True, 3)


def test_a_large_body_of_few_values_is_parsed() -> None:
    """Text is cheap to parse, however long: 4 MB of one string is one value."""
    body = orjson.dumps({"model": "m", "n": 2, "messages": [{"role": "user", "content": "x" * 4_000_000}]})
    info, parsed = read_request(DIALECTS["chat_completions"], body)
    assert parsed is not None
    assert info.n == 2


def test_a_compressed_body_costly_to_parse_is_not_parsed() -> None:
    body = _many_values(MAX_PARSED_VALUES)
    info, parsed = read_request(DIALECTS["chat_completions"], zlib.compress(body), "deflate", 8 * 1024 * 1024)
    assert (info.model, info.stream, info.n, parsed) == ("m", True, 1, None)  # (its inflated copy scanned)
    info, parsed = read_request(DIALECTS["chat_completions"], zlib.compress(_many_values(10)), "deflate", 1 << 20)
    assert (info.n, parsed) == (3, None)  # (parsed, but only a plain body's object is handed back)


def test_an_inflated_copy_past_the_parse_limit_is_scanned() -> None:
    message = {"role": "user", "content": "x" * 300_000}
    body = orjson.dumps({"model": "m", "n": 2, "stream": True, "messages": [message]})
    info, parsed = read_request(DIALECTS["chat_completions"], zlib.compress(body), "deflate", 1 << 20,
                                parse_limit=100_000)
    assert (info.model, info.stream, info.n, parsed) == ("m", True, 1, None)
