"""Parsing and rendering of --cancel-hook templates (the calls themselves: tests/loopback)."""

from __future__ import annotations

import orjson
import pytest

from proxy.config import CancelHook, HookError, parse_hook


def test_llama_conversation_preset() -> None:
    hook = parse_hook("llama-conversation")
    assert hook == CancelHook("llama-conversation", "DELETE", "/v1/stream?conv_id={conversation_id}", None)
    assert hook.needs_conversation
    call = hook.render("rid-1", "conv 7/ä")
    assert call is not None
    assert (call.method, call.path, call.body) == ("DELETE", "/v1/stream?conv_id=conv%207%2F%C3%A4", None)


def test_a_hook_that_needs_a_conversation_is_skipped_without_one() -> None:
    assert parse_hook("llama-conversation").render("rid-1", None) is None
    assert parse_hook("llama-conversation").render("rid-1", "") is None


def test_generic_hook_with_a_json_body_escapes_the_values() -> None:
    hook = parse_hook('  POST /abort_request {"rid": "{request_id}", "abort_all": false}  ')
    assert not hook.needs_conversation
    call = hook.render('a"b\\c', None)
    assert call is not None
    assert (call.method, call.path) == ("POST", "/abort_request")
    assert call.body is not None
    assert orjson.loads(call.body) == {"rid": 'a"b\\c', "abort_all": False}


@pytest.mark.parametrize("value", ["42", "[1,2,3]", "{}", "null", "true", 'x", "y": "z', "abc"])
def test_an_unquoted_placeholder_is_always_a_json_string(value: str) -> None:
    """No id turns into a number, an array, an object, null, or a second field."""
    hook = parse_hook('POST /abort_request {"session_id": {conversation_id}, "rid": "{request_id}"}')
    call = hook.render("r", value)
    assert call is not None
    assert call.body is not None
    assert orjson.loads(call.body) == {"session_id": value, "rid": "r"}


@pytest.mark.parametrize(
    ("value", "segment"),
    [("..", "%2E%2E"), (".", "%2E"), ("a/../b", "a%2F%2E%2E%2Fb"), ("c 7?x#y", "c%207%3Fx%23y"), ("~_-", "~_-"),
     ("\udcff\udcfe", "%FF%FE")],  # header bytes that are not UTF-8 (aiohttp's surrogate escapes): as they came
)
def test_path_values_are_percent_encoded_dot_segments_included(value: str, segment: str) -> None:
    """`..` cannot climb out of the hook's path; any header bytes are safe."""
    call = parse_hook("DELETE /v1/stream/{conversation_id}/cancel").render("r", value)
    assert call is not None
    assert call.path == f"/v1/stream/{segment}/cancel"


def test_an_id_longer_than_a_request_id_is_not_sent() -> None:
    hook = parse_hook("llama-conversation")
    assert hook.render("r", "c" * 200) is not None
    with pytest.raises(ValueError, match="at most 200"):
        hook.render("r", "c" * 201)
    with pytest.raises(ValueError, match="at most 200"):
        hook.render("r", "c" * 60_000)


def test_non_utf8_bytes_have_no_json_string() -> None:
    hook = parse_hook('POST /abort {"conv": "{conversation_id}"}')
    with pytest.raises(ValueError, match="not UTF-8"):
        hook.render("r", "\udcff")


def test_placeholders_in_the_path_and_a_body_with_spaces() -> None:
    hook = parse_hook('PUT /v1/requests/{request_id}/cancel {"reason": "client gone", "id": "{conversation_id}"}')
    call = hook.render("r/1", "c1")
    assert call is not None
    assert call.body is not None
    assert call.path == "/v1/requests/r%2F1/cancel"
    assert orjson.loads(call.body) == {"reason": "client gone", "id": "c1"}


@pytest.mark.parametrize("value", ["", "DELETE", "delete /x", "POST x", "POST /x/{model}", "POST /x {bad json"])
def test_invalid_hooks(value: str) -> None:
    with pytest.raises(HookError):
        parse_hook(value)
