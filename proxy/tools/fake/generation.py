"""What one request asks the fake model to generate, read once from the request body.

Everything downstream (stream frames, whole bodies, fault scenarios) works from this frozen value, so
the same request always produces the same bytes: content is a fixed word list cycled, ids derive from
the request id and ``created`` is a constant. That lets tests compare a direct stream with one that went
through the proxy byte for byte.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = [
    "API_CHAT",
    "API_COMPLETIONS",
    "API_EMBEDDINGS",
    "API_MESSAGES",
    "API_MODELS",
    "API_OTHER",
    "API_RESPONSES",
    "CREATED",
    "DEFAULT_MODEL",
    "GENERATION_APIS",
    "MAX_TOKENS",
    "BadRequest",
    "GenSpec",
    "count_prompt_tokens",
    "count_text_tokens",
    "parse_spec",
    "token_text",
]

API_CHAT = "chat_completions"
API_COMPLETIONS = "completions"
API_RESPONSES = "responses"
API_MESSAGES = "messages"
API_EMBEDDINGS = "embeddings"
API_MODELS = "models"
API_OTHER = "other"
GENERATION_APIS = frozenset({API_CHAT, API_COMPLETIONS, API_RESPONSES, API_MESSAGES})

#: Fixed ``created`` timestamp: real servers send "now", but a constant keeps output reproducible.
CREATED = 1_700_000_000
DEFAULT_MODEL = "fake-model"
MAX_N = 128
#: The fake's context length (also announced as ``max_model_len`` by ``/v1/models``); longer asks get a 400.
MAX_TOKENS = 131072

_WORDS = (
    "The", "fake", "upstream", "streams", "these", "words", "one", "at", "a", "time", "so", "that",
    "every", "client", "and", "proxy", "can", "see", "exactly", "what", "arrived", "before", "it", "stopped.",
)  # fmt: skip

# Where each dialect keeps its output-length limit, in order of preference.
_MAX_KEYS: dict[str, tuple[str, ...]] = {
    API_CHAT: ("max_completion_tokens", "max_tokens"),
    API_COMPLETIONS: ("max_tokens",),
    API_RESPONSES: ("max_output_tokens",),
    API_MESSAGES: ("max_tokens",),
}


class BadRequest(Exception):
    """The request cannot be served; answered with ``status`` (400) in the dialect's error shape."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


def token_text(index: int) -> str:
    """The text of content event ``index``: one word, with a separating space after the first."""
    word = _WORDS[index % len(_WORDS)]
    return word if index == 0 else " " + word


@dataclass(frozen=True, slots=True)
class GenSpec:
    """One generation request, dialect-neutral.

    ``choices`` is ``prompts * n`` (completions batches); choice ``prompt_index * n + i``.
    ``tokens`` is the request's max-tokens field when it has one (``finish`` ``"length"``), else the
    default (``"stop"``). Anthropic makes ``max_tokens`` mandatory, so for ``messages`` it only caps the
    default length (``max_tokens`` ≥ default: the default and ``end_turn``). ``pad`` makes content event
    ``pad[0]`` longer by ``pad[1]`` bytes (``oversized_event``). ``start`` is the word the answer begins
    at (a continued assistant message), ``echo`` text put in front of the first content event. ``per``
    tokens go in each content event (a backend that batches them: speculative decoding, a stream
    interval); the usage still counts tokens.
    """

    api: str
    request_id: str
    model: str = DEFAULT_MODEL
    stream: bool = False
    n: int = 1
    prompts: int = 1
    tokens: int = 16
    finish: str = "stop"
    include_usage: bool = False
    prompt_tokens: int = 1
    pad: tuple[int, int] | None = None
    start: int = 0
    echo: str = ""
    per: int = 1

    @property
    def choices(self) -> int:
        return self.prompts * self.n

    @property
    def completion_tokens(self) -> int:
        return self.tokens * self.choices

    def texts(self) -> list[str]:
        """The content of each content event of one choice."""
        texts = [token_text(self.start + i) for i in range(self.tokens)]
        if self.echo and texts:
            texts[0] = self.echo + texts[0]
        if self.per > 1:
            texts = ["".join(texts[i : i + self.per]) for i in range(0, len(texts), self.per)]
        if self.pad is not None and 0 <= self.pad[0] < len(texts):
            texts[self.pad[0]] += "x" * max(0, self.pad[1])
        return texts

    def full_text(self) -> str:
        return "".join(self.texts())

    def replace(self, **changes: Any) -> GenSpec:
        return dataclasses.replace(self, **changes)


def parse_spec(api: str, body: object, request_id: str, default_tokens: int) -> GenSpec:
    """Read the fields the fake honours; anything else in the body is ignored, as a lenient server."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model", DEFAULT_MODEL)
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", "model")
    n = _int_field(body, "n", 1, minimum=1) if api in (API_CHAT, API_COMPLETIONS) else 1
    if n > MAX_N:
        raise BadRequest(f"'n' must be at most {MAX_N}", "n")
    tokens, finish = default_tokens, "stop"
    for key in _MAX_KEYS.get(api, ()):
        if body.get(key) is not None:
            limit = _int_field(body, key, 0, minimum=0)
            if limit > MAX_TOKENS:
                raise BadRequest(f"'{key}' must be at most {MAX_TOKENS} (the model's context length)", key)
            if api != API_MESSAGES or limit < default_tokens:
                tokens, finish = limit, "length"
            break
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return GenSpec(
        api=api,
        request_id=request_id,
        model=model,
        stream=body.get("stream") is True,
        n=n,
        prompts=_prompt_count(body) if api == API_COMPLETIONS else 1,
        tokens=tokens,
        finish=finish,
        include_usage=include_usage and api in (API_CHAT, API_COMPLETIONS),
        prompt_tokens=count_prompt_tokens(body),
    )


def count_text_tokens(text: str) -> int:
    """The fake's tokenizer: one token per word (each content event of ``per=1`` is one word)."""
    return len(text.split())


def count_prompt_tokens(body: dict[str, Any]) -> int:
    """A deterministic stand-in for a tokenizer: words in every prompt string, one per token id."""
    total = sum(_count(body.get(key)) for key in ("messages", "prompt", "input", "system", "instructions"))
    return max(1, total)


def _count(value: object) -> int:
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return 1
    if isinstance(value, list):
        return sum(_count(item) for item in value)
    if isinstance(value, dict):
        return sum(_count(value.get(key)) for key in ("content", "text", "input"))
    return 0


def _int_field(body: dict[str, Any], key: str, default: int, *, minimum: int) -> int:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"'{key}' must be an integer >= {minimum}", key)
    return value


def _prompt_count(body: dict[str, Any]) -> int:
    """How many prompts a completions request carries (string, strings, token ids, lists of ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return 1
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return len(prompt)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return 1
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return len(prompt)
    raise BadRequest(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        "prompt",
    )
