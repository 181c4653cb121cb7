"""The probe requests: the smallest valid request of each dialect, and how each dialect's stream ends.

Small and deterministic on purpose: a few tokens, temperature 0, so a probe costs the backend little and
asks the same thing every run.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DIALECTS", "PROMPT", "body_for", "chat_body", "content_of", "is_terminal"]

PROMPT = "Count from one to one hundred in words."
#: dialect -> path
DIALECTS = {
    "chat_completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
_RESPONSES_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def chat_body(model: str, max_tokens: int, *, stream: bool, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 42,
        "stream": stream,
        **extra,
    }


def body_for(dialect: str, model: str, max_tokens: int, *, stream: bool) -> dict[str, Any]:
    if dialect == "chat_completions":
        return chat_body(model, max_tokens, stream=stream)
    if dialect == "completions":
        return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if dialect == "responses":
        return {"model": model, "input": PROMPT, "max_output_tokens": max_tokens, "temperature": 0, "stream": stream}
    if dialect == "messages":
        return {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
    raise ValueError(f"unknown dialect {dialect!r}")


def is_terminal(dialect: str, event: str | None, data: Any, raw_data: bytes) -> bool:
    """Whether this event is the dialect's normal end of stream."""
    if dialect in ("chat_completions", "completions"):
        return raw_data.strip() == b"[DONE]"
    kind = event or (data.get("type") if isinstance(data, dict) else None)
    if dialect == "responses":
        return kind in _RESPONSES_TERMINAL
    return kind == "message_stop"


def content_of(dialect: str, data: Any) -> str | None:
    """The generated text an event carries (``None``: not a content event)."""
    if not isinstance(data, dict):
        return None
    if dialect in ("chat_completions", "completions"):
        for choice in data.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str) and text:
                return text
        return None
    if dialect == "responses" and data.get("type") == "response.output_text.delta":
        delta = data.get("delta")
        return delta if isinstance(delta, str) else None
    if dialect == "messages" and data.get("type") == "content_block_delta":
        delta = data.get("delta")
        text = delta.get("text") if isinstance(delta, dict) else None
        return text if isinstance(text, str) else None
    return None
