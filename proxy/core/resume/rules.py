"""Whether a cut stream may be continued, and the request that continues it.

A continuation is only offered where it can be faithful: one choice of plain text, sampled without
constraints the backend would have to replay (tools, grammars, schemas) and without per-token
output the continuation could not reproduce (logprobs). The continuation is the client's own
request, every field kept, plus the answer so far: for chat a trailing assistant message that the
backend continues (`continue_final_message`, which vLLM, SGLang and llama-server honour), for
completions the prompt followed by the text, or by the token ids when the backend returned them.
"""

from __future__ import annotations

from email.utils import parsedate_to_datetime
from typing import Any

import orjson

from proxy.core.resume.splice import splice
from proxy.core.resume.transcript import Transcript
from proxy.core.verdicts import Reason

__all__ = [
    "BUDGETS",
    "RESUMABLE_APIS",
    "RESUMABLE_REASONS",
    "RETRYABLE_STATUSES",
    "Refusal",
    "checked_request",
    "continuation_body",
    "cut_refusal",
    "parse_request",
    "request_refusal",
    "retry_delay",
]

RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
# Breaks worth a continuation: the connection or the backend failed, not the request.
RESUMABLE_REASONS = frozenset(
    {Reason.STREAM_CUT, Reason.STALL_TIMEOUT, Reason.STRAY_HTTP_BLOCK, Reason.UPSTREAM_ERROR_FRAME}
)

RESUMABLE_APIS = frozenset({"chat_completions", "completions"})
_TOOLS = ("tools", "tool_choice", "functions", "function_call")
# Constrained decoding (vLLM, SGLang, llama-server names): a continuation would restart the grammar.
_GUIDED = (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "grammar", "json_schema", "regex", "ebnf",
)
BUDGETS = ("max_tokens", "max_completion_tokens")


class Refusal(Exception):
    """This request cannot be continued faithfully; the message says why (logged, never sent)."""


def parse_request(api: str, body: bytes | bytearray) -> dict[str, Any]:
    """The request's JSON object, or Refusal: only a streamed chat or completions object qualifies."""
    if api not in RESUMABLE_APIS:
        raise Refusal(f"{api} streams are not resumed")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise Refusal("the request body is not JSON") from None
    return checked_request(api, obj)


def checked_request(api: str, obj: object) -> dict[str, Any]:
    """A request already parsed (None: its body was not, being compressed or costly to parse), or
    Refusal, as `parse_request`."""
    if api not in RESUMABLE_APIS:
        raise Refusal(f"{api} streams are not resumed")
    if obj is None:
        raise Refusal("the request body was not parsed (compressed, or past the parse's bounds)")
    if type(obj) is not dict:
        raise Refusal("the request body is not a JSON object")
    request_refusal(api, obj)
    return obj


def _set(obj: dict[str, Any], key: str) -> bool:
    value = obj.get(key)
    return value is not None and value is not False and value != []


def request_refusal(api: str, obj: dict[str, Any]) -> None:
    """Raise Refusal when the request's own fields rule a faithful continuation out."""
    if obj.get("stream") is not True:
        raise Refusal("not a streamed request")
    for key in _TOOLS:
        if _set(obj, key):
            raise Refusal(f"`{key}`: tool calls are not continued")
    for key in _GUIDED:
        if _set(obj, key):
            raise Refusal(f"`{key}`: constrained decoding is not continued")
    response_format = obj.get("response_format")
    if response_format is not None and not (type(response_format) is dict and response_format.get("type") == "text"):
        raise Refusal("`response_format`: constrained decoding is not continued")
    if _set(obj, "logprobs") or _set(obj, "top_logprobs") or _set(obj, "prompt_logprobs"):  # (0 is set too)
        raise Refusal("logprobs cannot be continued")
    for key in ("n", "best_of"):
        value = obj.get(key)
        if value is not None and value != 1:
            raise Refusal(f"`{key}`: only one choice is continued")
    if _set(obj, "echo"):
        raise Refusal("`echo`: the continuation's prompt is not the client's")
    for key in (*BUDGETS, "min_tokens"):
        value = obj.get(key)
        if value is not None and type(value) is not int:
            raise Refusal(f"`{key}` is not an integer")
    if api == "chat_completions":
        _check_messages(obj)
    else:
        _check_prompt(obj.get("prompt"))


def _check_messages(obj: dict[str, Any]) -> None:
    messages = obj.get("messages")
    if type(messages) is not list or not messages or not all(type(m) is dict for m in messages):
        raise Refusal("`messages` is not a list of messages")
    last = messages[-1]
    if obj.get("continue_final_message") is True:
        if last.get("role") != "assistant" or type(last.get("content")) is not str:
            raise Refusal("the message to continue is not an assistant's text")
    elif last.get("role") == "assistant":  # (llama-server would continue it, vLLM would answer it)
        raise Refusal("a trailing assistant message without `continue_final_message` is ambiguous")


def _check_prompt(prompt: object) -> None:
    if type(prompt) is str:
        return
    if type(prompt) is list and prompt and all(type(item) is int for item in prompt):
        return
    if type(prompt) is list and len(prompt) == 1 and (type(prompt[0]) is str or _ids(prompt[0])):
        return
    raise Refusal("`prompt` is a batch or not a prompt: only one choice is continued")


def _ids(value: object) -> bool:
    return type(value) is list and bool(value) and all(type(item) is int for item in value)


def cut_refusal(obj: dict[str, Any], transcript: Transcript) -> None:
    """Raise Refusal when what the client received rules the continuation out."""
    if transcript.overflowed:
        raise Refusal("the answer so far passed --max-body-size: no continuation could carry it, so it was not kept")
    if transcript.other_output:
        raise Refusal("the answer so far holds output other than text (reasoning, tool calls)")
    if not transcript.text and transcript.exact_tokens is None:
        raise Refusal("nothing was received to continue")
    produced = transcript.produced
    for key in BUDGETS:
        budget = obj.get(key)
        if type(budget) is int and budget - produced < 1:
            raise Refusal(f"the answer had used its `{key}` already")
    prompt = obj.get("prompt")
    if "prompt" in obj and type(prompt) is list and transcript.exact_tokens is None:
        flat = prompt[0] if len(prompt) == 1 and type(prompt[0]) is list else prompt
        if _ids(flat):
            raise Refusal("a token-id prompt is continued only with the backend's token ids")


def continuation_body(
    api: str, obj: dict[str, Any], transcript: Transcript, raw: bytes | bytearray | None = None,
    max_size: int | None = None,
) -> bytes:
    """The client's request carrying the answer so far, with its token budgets lowered by it.

    With `raw` (the client's bytes, of which `obj` is the parse) every field the continuation does
    not change keeps the client's bytes (`splice`); a body past `max_size` is a Refusal."""
    cut_refusal(obj, transcript)
    changed: dict[str, Any] = {}
    produced = transcript.produced
    for key in BUDGETS:
        if type(obj.get(key)) is int:
            changed[key] = min(obj[key], obj[key] - produced)
    if type(obj.get("min_tokens")) is int:
        changed["min_tokens"] = max(0, obj["min_tokens"] - produced)
    text = transcript.text
    appended: dict[str, str] | None = None
    content: str | None = None
    if api == "chat_completions":
        messages = list(obj["messages"])
        if obj.get("continue_final_message") is True:
            last = messages[-1]
            content = last["content"] + text
            messages[-1] = {**last, "content": content}
        else:
            appended = {"role": "assistant", "content": text}
            messages.append(appended)
        changed["continue_final_message"] = True
        changed["add_generation_prompt"] = False
        if raw is None:
            changed["messages"] = messages
    else:
        changed["prompt"] = _continued_prompt(obj["prompt"], transcript)
    if raw is None:
        body = orjson.dumps({**obj, **changed})
    else:
        body = splice(
            raw if type(raw) is bytes else bytes(raw), {key: orjson.dumps(value) for key, value in changed.items()},
            append_message=None if appended is None else orjson.dumps(appended),
            last_content=None if content is None else orjson.dumps(content),
        )
    if max_size is not None and len(body) > max_size:
        raise Refusal(f"the continuation's body ({len(body)} bytes) would pass --max-body-size ({max_size})")
    return body


def _continued_prompt(prompt: Any, transcript: Transcript) -> str | list[int]:
    exact = transcript.exact_tokens
    if exact is not None and transcript.prompt_token_ids is not None:
        return transcript.prompt_token_ids + exact  # token for token: no re-tokenization
    if type(prompt) is list and len(prompt) == 1:
        prompt = prompt[0]
    if type(prompt) is list:
        assert exact is not None  # (cut_refusal)
        return [*prompt, *exact]
    return str(prompt) + transcript.text


def retry_delay(value: str | None, cap: float, now: float) -> float | None:
    """Seconds a `Retry-After` (seconds or an HTTP date; `now` is the Unix time) asks to wait before the
    continuation: 0 without one, None when it asks for longer than `cap` (then none is tried)."""
    if value is None or not value.strip():
        return 0.0
    text = value.strip()
    try:
        delay = float(text)
    except ValueError:
        try:
            delay = parsedate_to_datetime(text).timestamp() - now
        except (TypeError, ValueError):
            return 0.0  # unreadable: as if absent
    if delay != delay:  # NaN
        return 0.0
    delay = max(0.0, delay)
    return delay if delay <= cap else None
