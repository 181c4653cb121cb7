"""SSE frames per dialect, shaped the way vLLM, OpenAI and Anthropic write them (see protocols.md).

Sans-IO: a request's ``GenSpec`` becomes a list of ``Frame`` (exact bytes plus a kind). The server
writes them; a fault scenario slices, filters or splices that list, which is why each frame says what it
is: ``head`` (role-only chunk, ``response.created``, ``message_start``...), ``content`` (one word),
``finish`` (what closes the generation: finish_reason chunk, ``*.done``, ``message_delta``), ``usage``
(the ``choices: []`` chunk) and ``terminal`` (``[DONE]``, ``response.completed``, ``message_stop``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.tools.fake.bodies import (
    anthropic_stop_reason,
    message_item,
    openai_usage,
    response_object,
)
from proxy.tools.fake.generation import API_CHAT, API_COMPLETIONS, API_MESSAGES, API_RESPONSES, CREATED, GenSpec

__all__ = [
    "CONTENT",
    "DONE",
    "FINISH",
    "HEAD",
    "TERMINAL",
    "USAGE",
    "Frame",
    "first_content_end",
    "malformed_frame",
    "native_error_frame",
    "sse",
    "stray_block",
    "stream_frames",
]

HEAD, CONTENT, FINISH, USAGE, TERMINAL = "head", "content", "finish", "usage", "terminal"
DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Frame:
    raw: bytes
    kind: str


def sse(data: object, event: str | None = None) -> bytes:
    """One SSE event: optional ``event:`` line, one ``data:`` line (JSON unless bytes), blank line."""
    payload = data if isinstance(data, bytes) else orjson.dumps(data)
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + payload + b"\n\n"


def stream_frames(spec: GenSpec) -> list[Frame]:
    """The complete, well-formed stream for ``spec``."""
    return _BUILDERS[spec.api](spec)


def first_content_end(frames: list[Frame]) -> int:
    """How many frames to send to get the preamble and exactly one content event out."""
    for index, frame in enumerate(frames):
        if frame.kind == CONTENT:
            return index + 1
    return len(frames)


def native_error_frame(spec: GenSpec, message: str, sequence_number: int) -> bytes:
    """The error event each dialect's own servers send mid-stream (vLLM, Anthropic, OpenAI Responses)."""
    if spec.api == API_MESSAGES:
        return sse({"type": "error", "error": {"type": "api_error", "message": message}}, "error")
    if spec.api == API_RESPONSES:
        error = {"type": "server_error", "code": "server_error", "message": message, "param": None}
        return sse({"type": "error", "sequence_number": sequence_number, "error": error}, "error")
    return sse({"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}})


def malformed_frame(api: str) -> bytes:
    """An event whose data is cut-off JSON, as a buggy serializer or a torn write produces."""
    if api == API_RESPONSES:
        return b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "delta": [\n\n'
    if api == API_MESSAGES:
        return b'event: content_block_delta\ndata: {"type": "content_block_delta", "delta": [\n\n'
    return b'data: {"choices": [\n\n'


def stray_block(status: int, reason: str, body: dict[str, Any], retry_after: str = "1") -> bytes:
    """A whole second HTTP response, as a broken server writes it into an already started body."""
    payload = orjson.dumps(body)
    head = (
        f"HTTP/1.0 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Retry-After: {retry_after}\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def _chat(spec: GenSpec) -> list[Frame]:
    base = {"id": f"chatcmpl-{spec.request_id}", "object": "chat.completion.chunk", "created": CREATED}

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {**base, "model": spec.model, "choices": choices}
        if spec.include_usage:  # OpenAI sends "usage": null on every other chunk only when asked
            obj["usage"] = usage
        return sse(obj)

    def choice(index: int, delta: dict[str, str], finish: str | None = None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    frames = [Frame(chunk([choice(c, {"role": "assistant", "content": ""})]), HEAD) for c in range(spec.choices)]
    for text in spec.texts():
        frames += [Frame(chunk([choice(c, {"content": text})]), CONTENT) for c in range(spec.choices)]
    frames += [Frame(chunk([choice(c, {}, spec.finish)]), FINISH) for c in range(spec.choices)]
    if spec.include_usage:
        frames.append(Frame(chunk([], openai_usage(spec)), USAGE))
    frames.append(Frame(DONE, TERMINAL))
    return frames


def _completions(spec: GenSpec) -> list[Frame]:
    base = {"id": f"cmpl-{spec.request_id}", "object": "text_completion", "created": CREATED}

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {**base, "model": spec.model, "choices": choices}
        if spec.include_usage:
            obj["usage"] = usage
        return sse(obj)

    def choice(index: int, text: str, finish: str | None = None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    frames = []
    for text in spec.texts():
        frames += [Frame(chunk([choice(c, text)]), CONTENT) for c in range(spec.choices)]
    frames += [Frame(chunk([choice(c, "", spec.finish)]), FINISH) for c in range(spec.choices)]
    if spec.include_usage:
        frames.append(Frame(chunk([], openai_usage(spec)), USAGE))
    frames.append(Frame(DONE, TERMINAL))
    return frames


def _responses(spec: GenSpec) -> list[Frame]:
    frames: list[Frame] = []
    item_id = f"msg_{spec.request_id}"
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}

    def add(kind: str, event: str, fields: dict[str, Any]) -> None:
        data = {"type": event, "sequence_number": len(frames), **fields}
        frames.append(Frame(sse(data, event), kind))

    add(HEAD, "response.created", {"response": response_object(spec, status="in_progress", output=[])})
    add(HEAD, "response.in_progress", {"response": response_object(spec, status="in_progress", output=[])})
    item = message_item(spec, status="in_progress", text=None)
    add(HEAD, "response.output_item.added", {"output_index": 0, "item": item})
    empty_part = {"type": "output_text", "text": "", "annotations": []}
    add(HEAD, "response.content_part.added", {**where, "part": empty_part})
    for text in spec.texts():
        add(CONTENT, "response.output_text.delta", {**where, "delta": text, "logprobs": []})
    full = spec.full_text()
    add(FINISH, "response.output_text.done", {**where, "text": full, "logprobs": []})
    part = {"type": "output_text", "text": full, "annotations": []}
    add(FINISH, "response.content_part.done", {**where, "part": part})
    done_item = message_item(spec, status="completed", text=full)
    add(FINISH, "response.output_item.done", {"output_index": 0, "item": done_item})
    completed = response_object(spec, status="completed", output=[done_item])
    add(TERMINAL, "response.completed", {"response": completed})
    return frames


def _messages(spec: GenSpec) -> list[Frame]:
    message: dict[str, Any] = {
        "id": f"msg_{spec.request_id}",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": spec.model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": spec.prompt_tokens, "output_tokens": 1},
    }

    def event(kind: str, name: str, fields: dict[str, Any]) -> Frame:
        return Frame(sse({"type": name, **fields}, name), kind)

    frames = [
        event(HEAD, "message_start", {"message": message}),
        event(HEAD, "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        event(HEAD, "ping", {}),
    ]
    frames += [
        event(CONTENT, "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
        for text in spec.texts()
    ]
    stop = {"stop_reason": anthropic_stop_reason(spec), "stop_sequence": None}
    frames += [
        event(FINISH, "content_block_stop", {"index": 0}),
        event(FINISH, "message_delta", {"delta": stop, "usage": {"output_tokens": spec.completion_tokens}}),
        event(TERMINAL, "message_stop", {}),
    ]
    return frames


_BUILDERS: dict[str, Callable[[GenSpec], list[Frame]]] = {
    API_CHAT: _chat,
    API_COMPLETIONS: _completions,
    API_RESPONSES: _responses,
    API_MESSAGES: _messages,
}
