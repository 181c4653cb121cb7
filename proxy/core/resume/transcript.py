"""What the client has received of a streamed chat or completions answer: the text a continuation
must carry, the tokens it must subtract, and the first chunk's identity every later chunk repeats.

The chat dialect hands every chunk object it parsed to `note` (one call per event, no second parse),
so the transcript grows with the first stream and with every stitched continuation alike, up to
`limit` (--max-body-size): an answer no continuation's body could carry is not kept (`overflowed`),
where a 100 MB answer was held whole for nothing (issue 36: HWM 415-463 MiB, 45 without the flag).
"""

from __future__ import annotations

from typing import Any

__all__ = ["IDENTITY_KEYS", "Transcript"]

# The chunk fields that name the answer; a continuation's chunks carry the first stream's values.
IDENTITY_KEYS = ("id", "created", "model", "system_fingerprint")
# Delta keys that are not output: anything else with a value is output the proxy cannot continue
# (reasoning, tool calls, refusals, audio), except `content`, which it can.
_NOT_OUTPUT = frozenset({"role", "content"})
_JOIN_EVERY = 1024  # text parts kept before they are joined into one string


def _token_ids(value: object) -> list[int] | None:
    if type(value) is list and all(type(item) is int for item in value):
        return value
    return None


class Transcript:
    """The answer so far of one streamed exchange (choice 0: continued requests have one choice)."""

    __slots__ = (
        "_ids_complete",
        "_limit",
        "_parts",
        "_size",
        "_tail",
        "_usage_bad",
        "chunks",
        "content_events",
        "identity",
        "other_output",
        "overflowed",
        "prompt_token_ids",
        "prompt_tokens",
        "reported_completion",
        "token_ids",
        "tokenized",
    )

    def __init__(self, limit: int | None = None) -> None:
        self._limit = limit  # the largest continuation body (--max-body-size), None: no bound
        self._size = 0  # characters of text, each at least one byte of a continuation's body
        self.overflowed = False  # the answer passed `limit`: nothing is kept any more, no continuation
        self._parts: list[str] = []
        self._tail = 0  # parts appended since the last join (`text` joins them all)
        self.identity: dict[str, Any] | None = None  # the first chunk's id, created, model, fingerprint
        self.content_events = 0  # chunks that carried text
        self.chunks = 0  # chunks that carried a token, text or not (vLLM's "" while it holds back bytes)
        self.token_ids: list[int] = []  # the generated tokens, where the backend returns them
        self._ids_complete = True  # every text chunk came with its token ids
        self.prompt_token_ids: list[int] | None = None  # the prompt as the backend tokenized it
        self.reported_completion: int | None = None  # per-chunk usage (vLLM continuous_usage_stats)
        self.prompt_tokens: int | None = None  # the original prompt's tokens, where a chunk said
        self._usage_bad = False  # a per-chunk usage was not a count: none is trusted any more
        self.other_output = False  # output that is not text was received
        self.tokenized: tuple[int, int] | None = None  # (characters of text, their tokens) by /tokenize

    @property
    def counted(self) -> bool:
        """The stream itself said how many tokens it carried (token ids, per-chunk usage), or the
        backend's tokenizer counted the text as it stands: else `produced` is only a lower bound."""
        return (
            self.exact_tokens is not None
            or (self.reported_completion is not None and not self._usage_bad)
            or self._tokenized() is not None
        )

    def _tokenized(self) -> int | None:
        if self.tokenized is None or self.tokenized[0] != len(self.text):
            return None
        return self.tokenized[1]

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
            self._tail = 0
        return self._parts[0] if self._parts else ""

    @property
    def exact_tokens(self) -> list[int] | None:
        """The generated token ids when the backend gave them for every chunk, else None."""
        return self.token_ids if self._ids_complete and self.token_ids else None

    @property
    def produced(self) -> int:
        """Completion tokens received: exact from token ids, else the larger of per-chunk usage
        (validated), or of the backend tokenizer's count of the text, and the chunks that carried a
        token.

        A chunk is counted whether its text is empty or not: vLLM sends `"content": ""` for each
        token that ends inside a multi-byte character (22 tokens, 17 of them such chunks, had counted
        5). Without ids, usage or a tokenizer's count this is a lower bound only (`counted` is False):
        a backend may send several tokens per chunk.
        """
        exact = self.exact_tokens
        if exact is not None:
            return len(exact)
        if self.reported_completion is not None and not self._usage_bad:
            return max(self.reported_completion, self.chunks)
        tokenized = self._tokenized()
        if tokenized is not None:
            return max(tokenized, self.chunks)
        return max(self.chunks, self.content_events)

    @property
    def in_prompt(self) -> int:
        """The tokens the answer so far takes in a continuation's prompt: its ids where the prompt is
        ids, the tokenizer's count where the backend tokenizes the text again (a model's own tokens
        need not tokenize back to as many), else `produced`."""
        exact = self.exact_tokens
        if exact is not None:
            return len(exact)
        tokenized = self._tokenized()
        return tokenized if tokenized is not None else self.produced

    def _note_usage(self, usage: dict[str, Any]) -> None:
        """Per-chunk usage is cumulative and never negative: anything else distrusts it for good."""
        completion, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
        if type(completion) is not int or completion < 0 or completion < (self.reported_completion or 0):
            self._usage_bad = True
            return
        self.reported_completion = completion
        if type(prompt) is int and prompt >= 0 and self.prompt_tokens is None:
            self.prompt_tokens = prompt

    def note(self, obj: dict[str, Any]) -> None:
        """One chunk object of the stream as the client receives it."""
        if self.overflowed:
            return
        if self.identity is None:
            self.identity = {key: obj[key] for key in IDENTITY_KEYS if key in obj}
        choices = obj.get("choices")
        if type(choices) is not list:
            return
        first = not self.content_events  # (vLLM sends the prompt's ids with its first chunk only)
        if first and self.prompt_token_ids is None:
            self.prompt_token_ids = _token_ids(obj.get("prompt_token_ids"))
        usage = obj.get("usage")
        if usage and choices and type(usage) is dict:
            self._note_usage(usage)
        for choice in choices:
            if type(choice) is not dict or choice.get("index", 0) != 0:
                continue
            if first and self.prompt_token_ids is None:  # (vLLM's completions put it on the choice)
                self.prompt_token_ids = _token_ids(choice.get("prompt_token_ids"))
            delta = choice.get("delta")
            if self._carries_token(choice, delta):
                self.chunks += 1
            if type(delta) is dict:
                text = delta.get("content")
                if (len(delta) > 1 or text is None) and any(
                    value for key, value in delta.items() if key not in _NOT_OUTPUT
                ):
                    self.other_output = True
            else:
                text = choice.get("text")
            ids = _token_ids(choice.get("token_ids"))
            if ids is not None and self._ids_complete:  # (a token may end inside a character: ids without text)
                self.token_ids.extend(ids)
            if type(text) is not str or not text:
                continue
            parts = self._parts
            parts.append(text)
            self._tail += 1
            if self._tail >= _JOIN_EVERY:  # (a small string takes 49 bytes more than its text)
                parts[-_JOIN_EVERY:] = ["".join(parts[-_JOIN_EVERY:])]
                self._tail = 0
            self._size += len(text)
            self.content_events += 1
            if ids is None:
                self._ids_complete = False
                if self.token_ids:  # (not exact any more: never read)
                    self.token_ids = []
        limit = self._limit
        if limit is not None:
            self._bound(limit)

    def _bound(self, limit: int) -> None:
        """Keep no more than a continuation's body could carry. Its text passed `limit` (a character is
        a byte of the body at least): no continuation; a chat one carries the text, and a completions
        one that carries token ids instead needs as many bytes or more (an id from 1,000 on and its
        comma take 5: a token has 4 characters or so). Token ids past `limit` / 2 (a digit and a comma
        each) are not kept: the text is continued instead, counted as if they never came."""
        if 2 * len(self.token_ids) > limit:
            self.token_ids, self._ids_complete = [], False
        if self._size > limit:
            self.overflowed = True
            self._parts, self._tail = [], 0
            self.token_ids, self.prompt_token_ids = [], None

    @staticmethod
    def _carries_token(choice: dict[str, Any], delta: object) -> bool:
        """A chunk of generated text, empty or not: not a role chunk, not an empty finish chunk."""
        if type(delta) is dict:
            if "role" in delta:
                return False
            text = delta.get("content")
        else:
            text = choice.get("text")
        return type(text) is str and (bool(text) or not choice.get("finish_reason"))
