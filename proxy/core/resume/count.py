"""Counting the answer so far with the backend's tokenizer, when the stream itself did not say.

A stream that carried neither token ids nor per-chunk usage is counted by chunks, which undercounts a
backend that sends several tokens per chunk (speculative decoding, vLLM's `--stream-interval`), so a
continuation would ask for more than the client's budget left. Then, before a continuation is sent,
the backend is asked to tokenize the text so far: vLLM and SGLang read `prompt` and
`add_special_tokens` and answer `{"count", "max_model_len", "tokens"}`, llama-server reads `content`
and `add_special` and answers `{"tokens"}`; one body carries both spellings (vLLM accepts extra
fields, llama-server reads only its own).
An answer that is not such a count is no tokenizer, and the break is refused rather than guessed.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.core.resume.rules import Refusal

__all__ = ["TOKENIZE_PATH", "answer_limit", "read_count", "tokenize_body"]

TOKENIZE_PATH = "/tokenize"
# A token id and its separator take at most ~12 bytes, and no text has more tokens than bytes.
_BYTES_PER_TOKEN = 12
_SLACK = 4096


def tokenize_body(model: object, text: str) -> bytes:
    """The `/tokenize` request for `text`, without special tokens (BOS would count one too many)."""
    body: dict[str, Any] = {"prompt": text, "add_special_tokens": False, "content": text, "add_special": False}
    if type(model) is str:
        body = {"model": model, **body}
    return orjson.dumps(body)


def answer_limit(text: str) -> int:
    """The most bytes a true answer for `text` can take: anything longer is not read."""
    return _SLACK + _BYTES_PER_TOKEN * len(text.encode())


def read_count(status: int, body: bytes, text: str) -> int:
    """The number of tokens `/tokenize` says `text` has, or Refusal saying why it said none."""
    if status != 200:
        raise Refusal(f"no tokenizer to count the answer so far: /tokenize answered status {status}")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise Refusal("no tokenizer to count the answer so far: /tokenize answered no JSON") from None
    if type(obj) is not dict:
        raise Refusal("no tokenizer to count the answer so far: /tokenize answered no JSON object")
    count, tokens = obj.get("count"), obj.get("tokens")
    if tokens is not None and not (type(tokens) is list and all(type(t) is int for t in tokens)):
        raise Refusal("no tokenizer to count the answer so far: /tokenize's `tokens` are not token ids")
    if count is None and tokens is not None:
        count = len(tokens)
    if type(count) is not int or count < 0 or (tokens is not None and count != len(tokens)):
        raise Refusal(f"no tokenizer to count the answer so far: /tokenize's count {count!r} is not a count")
    if count == 0 and text:
        raise Refusal("no tokenizer to count the answer so far: /tokenize counted no tokens in the text")
    if count > len(text.encode()) + 1:  # (a byte-level vocabulary has a token per byte at most)
        raise Refusal(f"no tokenizer to count the answer so far: /tokenize counted {count} tokens in "
                      f"{len(text.encode())} bytes")
    return count
