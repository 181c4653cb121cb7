"""What the stream-guard tests share: the requests per dialect, the fake's shape, design 10's tables.

Written out from the design and the fake upstream, not taken from the proxy's code, so the tests
check the one against the other.
"""

from __future__ import annotations

from typing import Any

from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
ANTHROPIC_MESSAGES: list[MessageParam] = [{"role": "user", "content": "hi"}]
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_completions": ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 4}),
    "completions": ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4}),
    "responses": ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 4}),
    "messages": ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": MESSAGES}),
}
ALL = tuple(REQUESTS)
CHAT_LIKE = ("chat_completions", "completions")
# Events the fake writes before the first content event (role chunk; created..part.added; start, block, ping).
PREAMBLE = {"chat_completions": 1, "completions": 0, "responses": 4, "messages": 3}

# Design section 10: error `type` by status, per dialect family; Responses' `error.code` by status.
OPENAI_TYPE = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 502: "server_error", 503: "server_error", 504: "timeout_error"}  # fmt: skip
ANTHROPIC_TYPE = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error", 500: "api_error",
                  502: "api_error", 503: "overloaded_error", 504: "timeout_error"}  # fmt: skip
RESPONSES_CODE = {400: "invalid_prompt", 429: "rate_limit_exceeded", 500: "server_error", 502: "server_error",
                  503: "server_error", 504: "server_error"}  # fmt: skip

# The messages the client must see.
STRAY_MESSAGE = "Service Unavailable: engine overloaded"  # from the fake's stray block
FAKE_MESSAGE = "fake upstream: generation failed"  # the fake's own error frames
CUT_MESSAGE = "the upstream stream ended before the response was complete"
STALL_MESSAGE = "the upstream sent nothing for too long"
EARLY_DONE_MESSAGE = "the upstream ended the stream while a choice had no finish_reason (generation cut short)"
ABORT_MESSAGE = 'the upstream aborted the generation (finish_reason "abort")'
EVENT_LIMIT = 16384  # the --max-event-size the oversized cases run with
OVERSIZED_MESSAGE = f"an upstream event exceeded the proxy's limit of {EVENT_LIMIT} bytes"


def error_body(dialect: str, status: int, message: str, code: str | int) -> dict[str, Any]:
    """The whole-body JSON error of the dialect (design section 4)."""
    if dialect == "messages":
        return {"type": "error", "error": {"type": ANTHROPIC_TYPE[status], "message": message}}
    return {"error": {"message": message, "type": OPENAI_TYPE[status], "param": None, "code": code}}
