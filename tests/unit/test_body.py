"""Whole-body verdicts, one test per row of design section 6 (and per dialect where shapes differ)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.core.body import BodyVerdict, judge_body, usage_from_tail
from proxy.core.dialects import DIALECTS, RequestInfo, Usage
from proxy.core.verdicts import Outcome, Reason

JSON = "application/json"
JSON_DIALECTS = ["chat_completions", "completions", "responses", "messages", "embeddings", "models"]
OPENAI_DIALECTS = [name for name in JSON_DIALECTS if name != "messages"]


def judge(name: str, status: int, body: bytes | dict[str, Any], ctype: str | None = JSON, **req: Any) -> BodyVerdict:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return judge_body(DIALECTS[name], RequestInfo(**req), status, ctype, raw)


def replaced(verdict: BodyVerdict) -> tuple[int, dict[str, Any]]:
    assert verdict.replacement is not None
    status, body = verdict.replacement
    return status, orjson.loads(body)


def message_of(name: str, body: dict[str, Any]) -> str:
    """The message in the dialect's own shape (asserting that shape)."""
    assert DIALECTS[name].own_error_shape(body)
    return str(body["error"]["message"])


# ---- 2xx with a valid body ---------------------------------------------------------------------------

VALID: dict[str, tuple[dict[str, Any], Usage | None]] = {
    "chat_completions": (
        {
            "id": "c",
            "choices": [{"index": 0, "message": {"content": "hi"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        },
        Usage(3, 1),
    ),
    "completions": (
        {"choices": [{"index": 0, "text": "hi"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
        Usage(3, 1),
    ),
    "responses": (
        {
            "id": "r",
            "object": "response",
            "status": "completed",
            "error": None,
            "output": [],
            "usage": {"input_tokens": 4, "output_tokens": 2},
        },
        Usage(4, 2),
    ),
    "messages": (
        {"id": "m", "type": "message", "content": [], "usage": {"input_tokens": 5, "output_tokens": 6}},
        Usage(5, 6),
    ),
    "embeddings": (
        {"object": "list", "data": [{"embedding": [0.1]}], "usage": {"prompt_tokens": 7, "total_tokens": 7}},
        Usage(7, None),
    ),
    "models": ({"object": "list", "data": [{"id": "m"}]}, None),
}


@pytest.mark.parametrize("name", JSON_DIALECTS)
def test_valid_2xx_passes_with_usage(name: str) -> None:
    body, usage = VALID[name]
    assert judge(name, 200, body) == BodyVerdict(Outcome.OK, Reason.COMPLETE, None, usage)


def test_valid_2xx_without_usage() -> None:
    assert judge("chat_completions", 200, {"choices": []}).usage is None


# ---- 2xx with an empty, null or non-JSON body -------------------------------------------------------


@pytest.mark.parametrize("name", JSON_DIALECTS)
@pytest.mark.parametrize(
    ("body", "ctype", "words"),
    [
        (b"", None, "empty"),
        (b"  \n", JSON, "empty"),
        (b"null", JSON, "null"),
        (b"<html>ok</html>", "text/html", "not a JSON object"),
        (b"{truncated", JSON, "not a JSON object"),
        (b"[1, 2]", JSON, "not a JSON object"),
        (b'"text"', JSON, "not a JSON object"),
    ],
)
def test_invalid_2xx_body_is_a_502(name: str, body: bytes, ctype: str | None, words: str) -> None:
    verdict = judge(name, 200, body, ctype)
    assert (verdict.outcome, verdict.reason, verdict.usage) == ("error", "invalid_upstream_body", None)
    status, error = replaced(verdict)
    assert status == 502
    assert words in message_of(name, error)
    if name != "messages":
        assert error["error"]["code"] == "invalid_upstream_body"
        assert error["error"]["type"] == "server_error"
    else:
        assert error["error"]["type"] == "api_error"


# ---- 2xx whose JSON is an error object ------------------------------------------------------------


@pytest.mark.parametrize("name", JSON_DIALECTS)
@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"error": {"message": "boom", "type": "BadRequestError", "code": 400}}, 400, 400),  # the upstream's code
        ({"object": "error", "message": "boom", "type": "x", "param": None, "code": 503}, 503, 503),
        ({"error": "boom", "error_type": "generation"}, 502, "upstream_error_frame"),
        ({"detail": "boom"}, 502, "upstream_error_frame"),
        ({"message": "boom"}, 502, "upstream_error_frame"),
        ({"type": "error", "error": {"type": "rate_limit_error", "message": "boom"}}, 429, "upstream_error_frame"),
        ({"error": {"message": "boom", "code": "context_length_exceeded"}}, 502, "context_length_exceeded"),
        ({"error": {"message": "boom", "code": 200}}, 502, 200),
    ],
)
def test_error_object_in_a_2xx(name: str, body: dict[str, Any], status: int, code: str | int) -> None:
    verdict = judge(name, 200, body)
    assert (verdict.outcome, verdict.reason) == ("error", "upstream_error_frame")
    got_status, error = replaced(verdict)
    assert got_status == status
    assert message_of(name, error) == "boom"
    if name != "messages":
        assert error["error"]["code"] == code


def test_response_object_with_null_error_is_not_an_error() -> None:
    assert judge("responses", 200, VALID["responses"][0]).reason == "complete"


# ---- /v1/completions batches ---------------------------------------------------------------------


def choices(*indices: int) -> dict[str, Any]:
    return {"choices": [{"index": i, "text": "x"} for i in indices]}


@pytest.mark.parametrize(
    ("indices", "prompts", "n", "missing"),
    [
        ((0, 1, 2, 3, 4, 5), 3, 2, None),
        ((5, 4, 3, 2, 1, 0), 2, 3, None),
        ((0, 1, 3, 5), 3, 2, "4 of 6 choices; missing indices: 2, 4"),
        ((0,), 1, 4, "1 of 4 choices; missing indices: 1, 2, 3"),
        ((), 2, 1, "0 of 2 choices; missing indices: 0, 1"),
        ((0, 1, 2), 1, 1, None),  # more than asked for is not a missing choice
    ],
)
def test_completions_batch_coverage(indices: tuple[int, ...], prompts: int, n: int, missing: str | None) -> None:
    verdict = judge("completions", 200, choices(*indices), prompts=prompts, n=n)
    if missing is None:
        assert (verdict.reason, verdict.replacement) == ("complete", None)
        return
    assert (verdict.outcome, verdict.reason) == ("error", "incomplete_batch")
    status, error = replaced(verdict)
    assert status == 502
    assert missing in error["error"]["message"]
    assert error["error"]["code"] == "incomplete_batch"


def test_completions_batch_without_choices_list() -> None:
    assert judge("completions", 200, {"id": "x"}).reason == "incomplete_batch"


def test_long_missing_list_is_cut() -> None:
    verdict = judge("completions", 200, choices(), prompts=100, n=10)
    _, error = replaced(verdict)
    assert len(error["error"]["message"]) <= 500
    assert "..." in error["error"]["message"]


def test_chat_is_not_batch_checked() -> None:
    assert judge("chat_completions", 200, choices(0), n=3).reason == "complete"


ABORTED_BODIES = {
    "chat_completions": {
        "id": "c", "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "The fa"}, "finish_reason": "abort"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    },
    "completions": {
        "id": "c", "object": "text_completion",
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"},
                    {"index": 1, "text": "x", "finish_reason": "abort"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ABORTED_BODIES))
def test_aborted_choice_in_a_200_is_a_502_with_its_usage(name: str) -> None:
    verdict = judge(name, 200, ABORTED_BODIES[name], n=2 if name == "completions" else 1)
    assert (verdict.outcome, verdict.reason) == ("error", "upstream_aborted")
    assert verdict.usage == Usage(3, 2)  # the tokens were generated: still booked
    status, error = replaced(verdict)
    assert status == 502
    assert (error["error"]["code"], error["error"]["type"]) == ("upstream_aborted", "server_error")


@pytest.mark.parametrize("name", ["responses", "messages", "embeddings"])
def test_abort_rule_is_only_for_choice_dialects(name: str) -> None:
    assert judge(name, 200, {**VALID[name][0], "choices": [{"finish_reason": "abort"}]}).reason == "complete"


# ---- 4xx / 5xx ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPENAI_DIALECTS)
@pytest.mark.parametrize("status", [400, 401, 404, 429, 500, 503])
def test_error_in_own_openai_shape_passes(name: str, status: int) -> None:
    body = {"error": {"message": "nope", "type": "invalid_request_error", "param": None, "code": None}}
    reason = Reason.UPSTREAM_5XX if status >= 500 else Reason.UPSTREAM_4XX
    assert judge(name, status, body) == BodyVerdict(Outcome.ERROR, reason, None, None, "nope")


def test_llama_cpp_error_is_openai_shaped() -> None:
    body = {"error": {"code": 400, "message": "too long", "type": "exceed_context_size_error", "n_ctx": 4}}
    assert judge("chat_completions", 400, body).replacement is None


def test_error_in_own_anthropic_shape_passes() -> None:
    body = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}, "request_id": "r"}
    assert judge("messages", 529, body) == BodyVerdict(Outcome.ERROR, Reason.UPSTREAM_5XX, None, None, "Overloaded")


@pytest.mark.parametrize(
    ("content_type", "body", "message"),
    [
        ("application/json", {"object": "error", "message": "The model `x` does not exist.", "code": 404},
         "The model `x` does not exist."),
        ("application/json", {"detail": "Not Found"}, "Not Found"),
        ("application/json", {"error": "model not loaded"}, "model not loaded"),
        ("text/html", b"<html><head><title>502 Bad Gateway</title></head></html>", "502 Bad Gateway"),
        ("application/json", b"", None),
    ],
)
def test_an_error_carries_the_upstreams_own_message_for_the_log(
    content_type: str, body: bytes | dict[str, Any], message: str | None
) -> None:
    """The log line of an upstream_4xx/5xx says what the backend said, in whatever shape."""
    verdict = judge("chat_completions", 404, body, content_type)
    assert verdict.reason == "upstream_4xx"
    assert verdict.upstream_message == message


def test_an_error_object_in_a_200_carries_its_message() -> None:
    verdict = judge("chat_completions", 200, {"object": "error", "message": "CUDA out of memory", "code": 500})
    assert verdict.reason == "upstream_error_frame"
    assert verdict.upstream_message == "CUDA out of memory"


@pytest.mark.parametrize("name", JSON_DIALECTS)
@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"object": "error", "message": "bad input", "type": "BadRequestError", "param": None, "code": 400},
            "bad input",
        ),
        ({"detail": "bad input"}, "bad input"),
        ({"detail": [{"loc": ["body", "model"], "msg": "field required", "type": "missing"}]}, "field required"),
        ({"error": "bad input", "error_type": "validation"}, "bad input"),
        ({"foo": "bar"}, "the upstream answered with HTTP 422"),
    ],
)
def test_error_in_another_shape_is_reshaped(name: str, body: dict[str, Any], message: str) -> None:
    verdict = judge(name, 422, body)
    assert (verdict.outcome, verdict.reason) == ("error", "upstream_4xx")
    status, error = replaced(verdict)
    assert status == 422
    assert message_of(name, error) == message
    if name != "messages":
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["code"] == body.get("code", "upstream_4xx")  # the upstream's own code, if any


def test_openai_shape_in_messages_is_reshaped() -> None:
    verdict = judge("messages", 429, {"error": {"message": "slow down", "type": "rate_limit_error"}})
    status, error = replaced(verdict)
    assert status == 429
    assert error == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}


def test_anthropic_shape_in_chat_passes() -> None:
    body = {"type": "error", "error": {"type": "api_error", "message": "x"}}
    assert judge("chat_completions", 500, body).replacement is None


def test_upstream_string_code_is_kept() -> None:
    verdict = judge("chat_completions", 400, {"object": "error", "message": "m", "code": "model_not_found"})
    assert replaced(verdict)[1]["error"]["code"] == "model_not_found"


HTML = b"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>502 Bad Gateway &amp; friends</title></head>
<body><h1>502 Bad Gateway</h1><hr><center>nginx</center></body></html>"""


@pytest.mark.parametrize("name", JSON_DIALECTS)
@pytest.mark.parametrize(
    ("body", "ctype", "message"),
    [
        (HTML, "text/html", "502 Bad Gateway & friends"),
        (HTML, None, "502 Bad Gateway & friends"),
        (b"<html>\n<body>\n<h1>Service down</h1>\n</body></html>", "text/html", "Service down"),
        (
            b"\n\n  upstream connect error or disconnect/reset before headers\nmore",
            "text/plain",
            "upstream connect error or disconnect/reset before headers",
        ),
        (b"", "text/plain", "the upstream answered with HTTP 502"),
        (b'"plain json string"', JSON, "plain json string"),
        (b"x" * 2000, "text/plain", "x" * 500),
    ],
)
def test_html_or_text_error_carries_its_first_line(name: str, body: bytes, ctype: str | None, message: str) -> None:
    verdict = judge(name, 502, body, ctype)
    assert (verdict.outcome, verdict.reason) == ("error", "upstream_5xx")
    status, error = replaced(verdict)
    assert status == 502
    assert message_of(name, error) == message


# ---- other, and statuses below 400 ----------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"", b"null", b"<html>x</html>", b'{"error": "x"}', b"\x00\xff"])
def test_other_passes_everything_untouched(body: bytes) -> None:
    assert judge("other", 200, body) == BodyVerdict(Outcome.OK, Reason.COMPLETE, None, None)
    assert judge("other", 404, body) == BodyVerdict(Outcome.ERROR, Reason.UPSTREAM_4XX, None, None)
    assert judge("other", 500, body) == BodyVerdict(Outcome.ERROR, Reason.UPSTREAM_5XX, None, None)


@pytest.mark.parametrize("status", [101, 204, 301, 304])
def test_non_2xx_success_statuses_pass(status: int) -> None:
    assert judge("chat_completions", status, b"") == BodyVerdict(Outcome.OK, Reason.COMPLETE, None, None)


# ---- the usage of a body relayed without being read whole ------------------------------------------


@pytest.mark.parametrize(
    ("api", "tail", "expected"),
    [
        ("embeddings", b'0.2]}],"model":"m","usage": {"prompt_tokens":12,"total_tokens":12}}', (12, None)),
        ("chat_completions", b'"usage":{"prompt_tokens":3,"completion_tokens":4,'
                             b'"prompt_tokens_details":{"cached_tokens":1}}}', (3, 4)),
        ("messages", b'"usage":{"input_tokens":5,"output_tokens":6}}', (5, 6)),
        ("embeddings", b'0.1,0.2]}],"model":"m"}', None),  # no usage at all
        ("embeddings", b'"usage":{"prompt_tokens":12,"total', None),  # cut inside it
        ("other", b'"usage":{"prompt_tokens":1}}', None),  # a dialect without usage
    ],
)
def test_usage_from_tail(api: str, tail: bytes, expected: tuple[int | None, int | None] | None) -> None:
    usage = usage_from_tail(DIALECTS[api], tail)
    got = (usage.prompt_tokens, usage.completion_tokens) if usage is not None else None
    assert got == expected
