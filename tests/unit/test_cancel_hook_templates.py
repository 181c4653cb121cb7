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


def test_a_numeric_placeholder_renders_bare() -> None:
    hook = parse_hook('POST /abort_request {"session_id": {conversation_id}}')  # LMDeploy's integer session
    call = hook.render("r", "42")
    assert call is not None
    assert call.body is not None
    assert orjson.loads(call.body) == {"session_id": 42}
    bad = hook.render("r", "abc")  # renders, but is not JSON: the runner counts it as invalid_body
    assert bad is not None
    assert bad.body == b'{"session_id": abc}'


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
