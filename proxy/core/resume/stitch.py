"""The continuation's events rewritten so that the client sees one stream.

Every chunk takes the first stream's identity (`id`, `created`, `model`, `system_fingerprint`); the
continuation's role chunk is dropped (the client had one); text a backend echoes back at the start
(llama-server prefills a trailing assistant message and, in builds that ignore
`continue_final_message`, sends the prefix again in its first delta) is cut off; every `usage`
moves the answer so far from the prompt, where the continuation counts it (as its text tokenizes),
back to the completion (as the tokens that wrote it), so the totals are those of an uncut answer.
Comments, `[DONE]`, errors and whatever is not a chunk pass untouched: the stream guard judges them
as it judges any stream.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.core.resume.transcript import IDENTITY_KEYS, Transcript
from proxy.core.sse import Event

__all__ = ["Stitcher"]


class Stitcher:
    """One continuation's rewriter: feed it each event, forward what it returns (None: drop it)."""

    __slots__ = ("_echo", "_identity", "_in_prompt", "_prompt", "_prompt_ids", "_shift")

    def __init__(self, transcript: Transcript) -> None:
        self._identity = dict(transcript.identity or {})
        # An echo is recognised only where no single token could look like one (see `_strip_echo`).
        self._echo: str | None = transcript.text if transcript.content_events >= 2 else None
        self._shift = transcript.produced  # tokens generated before the continuation
        self._in_prompt = transcript.in_prompt  # the same text as the continuation's prompt counts it
        self._prompt_ids = transcript.prompt_token_ids
        ids = transcript.prompt_token_ids
        # The original prompt's tokens where the first stream said (token ids, per-chunk usage).
        self._prompt = len(ids) if ids is not None else transcript.prompt_tokens

    def rewrite(self, event: Event) -> Event | None:
        data = event.data
        if not data or data.startswith(b"[DONE]") or event.event is not None:
            return event
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return event
        if type(obj) is not dict or type(obj.get("choices")) is not list or obj.get("error"):
            return event
        if not self._chunk(obj):
            return None
        payload = orjson.dumps(obj)
        return Event(raw=b"data: " + payload + b"\n\n", data=payload, has_data=True)

    def _chunk(self, obj: dict[str, Any]) -> bool:
        """Rewrite one chunk in place; False when nothing of it is left for the client."""
        for key in IDENTITY_KEYS:
            if key in self._identity:
                obj[key] = self._identity[key]
            else:
                obj.pop(key, None)
        if "prompt_token_ids" in obj:
            obj["prompt_token_ids"] = self._prompt_ids
        usage = obj.get("usage")
        if type(usage) is dict:
            self._move_tokens(usage)
        choices = obj["choices"]
        kept = [choice for choice in choices if type(choice) is not dict or self._choice(choice)]
        if choices and not kept and not usage:
            return False
        obj["choices"] = kept
        return True

    def _choice(self, choice: dict[str, Any]) -> bool:
        """Rewrite one choice; False when it says nothing any more (a role-only or emptied delta)."""
        if "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = self._prompt_ids
        delta = choice.get("delta")
        if type(delta) is dict:
            delta.pop("role", None)
            text = delta.get("content")
            if type(text) is str and text:
                text = self._strip_echo(text)
                if text:
                    delta["content"] = text
                else:
                    del delta["content"]
            said = any(value for value in delta.values())
        else:
            said = bool(choice.get("text"))
        return said or bool(choice.get("finish_reason")) or bool(choice.get("token_ids"))

    def _strip_echo(self, text: str) -> str:
        """The first text of a chat continuation: without the answer so far, if it repeats it.

        vLLM, SGLang and llama-server builds that know `continue_final_message` send only new text;
        older llama-server builds send the prefix and the first new token as one delta. A first delta
        that starts with the whole answer so far, when that answer took two chunks or more, is such an
        echo: one new token that repeats two or more earlier ones whole is not what a model writes
        (a test model of single characters cannot). An answer cut after its first chunk is never
        stripped, so an old llama-server build repeats that one token.
        """
        echo, self._echo = self._echo, None
        if echo is not None and text.startswith(echo):
            return text[len(echo):]
        return text

    def _move_tokens(self, usage: dict[str, Any]) -> None:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if type(prompt) is int and type(completion) is int and prompt >= 0 and completion >= 0:
            usage["prompt_tokens"] = self._prompt if self._prompt is not None else max(0, prompt - self._in_prompt)
            usage["completion_tokens"] = completion + self._shift
            if "total_tokens" in usage:
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
