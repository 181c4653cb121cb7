"""Counting the answer so far with the backend's tokenizer, when the stream itself did not say.

A stream that carried neither token ids nor per-chunk usage is counted by chunks, which undercounts a
backend that sends several tokens per chunk (speculative decoding, vLLM's `--stream-interval`), so a
continuation would ask for more than the client's budget left. Then, before a continuation is sent,
the backend is asked to tokenize the text so far: vLLM and SGLang read `prompt` and
`add_special_tokens` and answer `{"count", "max_model_len", "tokens"}`, llama-server reads `content`
and `add_special` and answers `{"tokens"}`; one body carries both spellings (vLLM accepts extra
fields, llama-server reads only its own).
An answer that is not such a count is no tokenizer, and the break is refused rather than guessed.

Each is also asked for the tokens' text (vLLM's `return_token_strs`, llama-server's `with_pieces`):
a SentencePiece tokenizer puts a space token in front of a text that starts without one (its dummy
prefix), which the answer never had: a first token that is only that space is not counted.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.core.resume.rules import Refusal

__all__ = ["TOKENIZE_PATH", "answer_limit", "read_count", "tokenize_body"]

TOKENIZE_PATH = "/tokenize"
# A token's id, text and punctuation take at most ~48 bytes, and no text has more tokens than bytes.
_BYTES_PER_TOKEN = 48
_SLACK = 4096


def tokenize_body(model: object, text: str) -> bytes:
    """The `/tokenize` request for `text`, without special tokens (BOS would count one too many)."""
    body: dict[str, Any] = {
        "prompt": text, "add_special_tokens": False, "return_token_strs": True,
        "content": text, "add_special": False, "with_pieces": True,
    }
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
    if tokens is not None and not (type(tokens) is list and all(type(t) is int or _piece(t) for t in tokens)):
        raise Refusal("no tokenizer to count the answer so far: /tokenize's `tokens` are not token ids")
    if count is None and tokens is not None:
        count = len(tokens)
    if type(count) is not int or count < 0 or (tokens is not None and count != len(tokens)):
        raise Refusal(f"no tokenizer to count the answer so far: /tokenize's count {count!r} is not a count")
    if count and text[:1] and not text[:1].isspace() and _space(_first_text(obj, tokens)):
        count -= 1  # (the dummy prefix)
    if count == 0 and text:
        raise Refusal("no tokenizer to count the answer so far: /tokenize counted no tokens in the text")
    if count > len(text.encode()) + 1:  # (a byte-level vocabulary has a token per byte at most)
        raise Refusal(f"no tokenizer to count the answer so far: /tokenize counted {count} tokens in "
                      f"{len(text.encode())} bytes")
    return count


def _piece(token: object) -> bool:
    """llama-server's `with_pieces` token: an id and its text (or its bytes, when not UTF-8)."""
    return type(token) is dict and type(token.get("id")) is int


def _first_text(obj: dict[str, Any], tokens: object) -> object:
    strs = obj.get("token_strs")  # (vLLM)
    if type(strs) is list and strs:
        return strs[0]
    if type(tokens) is list and tokens and type(tokens[0]) is dict:
        return tokens[0].get("piece")
    return None


def _space(piece: object) -> bool:
    """Only a space: SentencePiece's "▁" (as vLLM writes a token) or " " (as llama-server does)."""
    return type(piece) is str and piece != "" and piece.replace("\u2581", " ").strip(" ") == ""
