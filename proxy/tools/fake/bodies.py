"""Whole JSON bodies the fake upstream answers with: results per dialect, and errors in each shape.

The error shapes are the ones real backends send (protocols.md section 5): OpenAI-nested, Anthropic,
the flat ``{"object":"error",...}`` of SGLang/LMDeploy, FastAPI's ``{"detail":...}`` and nginx's HTML
page, because the proxy has to recognise every one of them.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from typing import Any

from proxy.tools.fake.generation import (
    API_CHAT,
    API_COMPLETIONS,
    API_MESSAGES,
    API_RESPONSES,
    CREATED,
    DEFAULT_MODEL,
    MAX_TOKENS,
    BadRequest,
    GenSpec,
)

__all__ = [
    "anthropic_stop_reason",
    "embeddings_body",
    "error_body",
    "flat_error_body",
    "html_page",
    "message_item",
    "models_body",
    "openai_error_type",
    "openai_usage",
    "response_object",
    "whole_body",
]

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_MAX_DIMENSIONS = 4096


def openai_error_type(status: int) -> str:
    if status in _OPENAI_TYPES:
        return _OPENAI_TYPES[status]
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(api: str, status: int, message: str, *, code: str | int | None = None) -> dict[str, Any]:
    """The dialect's own error body: Anthropic's for ``messages``, OpenAI's for everything else."""
    if api == API_MESSAGES:
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": openai_error_type(status), "param": None, "code": code}}


def flat_error_body(message: str, status: int, kind: str) -> dict[str, Any]:
    """SGLang / LMDeploy / old vLLM: the error fields at the top level, tagged ``object: error``."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def html_page(status: int, reason: str) -> str:
    """A load balancer's error page, as nginx writes it."""
    title = f"{status} {reason}"
    return (
        f"<html>\r\n<head><title>{title}</title></head>\r\n<body>\r\n<center><h1>{title}</h1></center>\r\n"
        "<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
    )


def openai_usage(spec: GenSpec) -> dict[str, int]:
    completion = spec.completion_tokens
    return {
        "prompt_tokens": spec.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": spec.prompt_tokens + completion,
    }


def anthropic_stop_reason(spec: GenSpec) -> str:
    return "max_tokens" if spec.finish == "length" else "end_turn"


def message_item(spec: GenSpec, *, status: str, text: str | None) -> dict[str, Any]:
    """The Responses API output item holding the generated text (``None``: not started yet)."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {
        "id": f"msg_{spec.request_id}",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def response_object(spec: GenSpec, *, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    """The Responses API ``response`` object; usage only once it is complete."""
    usage = None
    if status == "completed":
        usage = {
            "input_tokens": spec.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": spec.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": spec.prompt_tokens + spec.completion_tokens,
        }
    return {
        "id": f"resp_{spec.request_id}",
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "model": spec.model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage,
    }


def whole_body(spec: GenSpec) -> dict[str, Any]:
    """The non-streamed answer for one of the four generation dialects."""
    text = spec.full_text()
    if spec.api == API_CHAT:
        return {
            "id": f"chatcmpl-{spec.request_id}",
            "object": "chat.completion",
            "created": CREATED,
            "model": spec.model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": spec.finish,
                }
                for i in range(spec.choices)
            ],
            "usage": openai_usage(spec),
        }
    if spec.api == API_COMPLETIONS:
        return {
            "id": f"cmpl-{spec.request_id}",
            "object": "text_completion",
            "created": CREATED,
            "model": spec.model,
            "choices": [
                {"index": i, "text": text, "logprobs": None, "finish_reason": spec.finish} for i in range(spec.choices)
            ],
            "usage": openai_usage(spec),
        }
    if spec.api == API_RESPONSES:
        item = message_item(spec, status="completed", text=text)
        return response_object(spec, status="completed", output=[item])
    if spec.api == API_MESSAGES:
        return {
            "id": f"msg_{spec.request_id}",
            "type": "message",
            "role": "assistant",
            "model": spec.model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": anthropic_stop_reason(spec),
            "stop_sequence": None,
            "usage": {"input_tokens": spec.prompt_tokens, "output_tokens": spec.completion_tokens},
        }
    raise ValueError(f"no generation body for api {spec.api!r}")


def models_body() -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": DEFAULT_MODEL,
                "object": "model",
                "created": CREATED,
                "owned_by": "streamwarden",
                "root": DEFAULT_MODEL,
                "max_model_len": MAX_TOKENS,
            }
        ],
    }


def embeddings_body(body: object) -> dict[str, Any]:
    """Deterministic vectors (from a hash of each input); honours ``dimensions`` and base64 encoding."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    inputs = _embedding_inputs(body.get("input"))
    dims = body.get("dimensions", 16)
    if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= _MAX_DIMENSIONS:
        raise BadRequest(f"'dimensions' must be an integer from 1 to {_MAX_DIMENSIONS}", "dimensions")
    as_base64 = body.get("encoding_format") == "base64"
    data = []
    for index, item in enumerate(inputs):
        vector = _vector(repr(item), dims)
        embedding: object = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode() if as_base64 else vector
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = sum(len(i.split()) if isinstance(i, str) else len(i) for i in inputs)
    model = body.get("model") if isinstance(body.get("model"), str) else DEFAULT_MODEL
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _embedding_inputs(value: object) -> list[str] | list[list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [list(value)]
        if all(isinstance(v, list) and all(isinstance(t, int) for t in v) for v in value):
            return [list(v) for v in value]
    raise BadRequest("'input' must be a string, a list of strings or token ids", "input")


def _vector(seed: str, dims: int) -> list[float]:
    out: list[float] = []
    counter = 0
    while len(out) < dims:
        digest = hashlib.sha256(f"{seed}/{counter}".encode()).digest()
        out.extend(round(b / 127.5 - 1.0, 6) for b in digest)
        counter += 1
    return out[:dims]
