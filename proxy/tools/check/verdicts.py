"""Sans-IO verdicts: from what a probe saw (statuses, bodies, SSE items, counter deltas) to a finding.

Kept apart from the I/O so that every rule is a plain function the unit tests can feed directly.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.core.sse import Event, StatusBlock
from proxy.tools.check.client import error_message
from proxy.tools.check.report import FAIL, OK, QUIRK, UNKNOWN, UNSUPPORTED
from proxy.tools.check.requests import is_terminal

__all__ = [
    "UNSUPPORTED_STATUSES",
    "judge_abort",
    "judge_context_overflow",
    "judge_dialect",
    "judge_malformed_json",
    "judge_prefill",
    "judge_stream",
    "judge_usage",
    "message_of",
    "prefill_mode",
]

UNSUPPORTED_STATUSES = frozenset({404, 405, 501})
RAN_TO_THE_END = 0.95  # of max_tokens generated: an abandoned stream that went on (one that stopped ends short)
_TERMINAL_NAME = {
    "chat_completions": "[DONE]",
    "completions": "[DONE]",
    "responses": "response.completed",
    "messages": "message_stop",
}


def message_of(body: bytes) -> str:
    """A short description of an error body: its message in any backend's shape, else its first line."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    message = error_message(parsed)
    if message is None:
        lines = body.decode("utf-8", "replace").strip().splitlines()
        message = lines[0] if lines else "(empty body)"
    return message[:160]


def judge_dialect(status: int, body: bytes) -> tuple[str, str]:
    if 200 <= status < 300:
        try:
            orjson.loads(body)
        except orjson.JSONDecodeError:
            return FAIL, f"{status} with a body that is not JSON"
        return OK, f"served ({status})"
    if status in UNSUPPORTED_STATUSES:
        return UNSUPPORTED, f"{status}: {message_of(body)}"
    return FAIL, f"{status}: {message_of(body)}"


def _data(event: Event) -> Any:
    try:
        return orjson.loads(event.data)
    except orjson.JSONDecodeError:
        return _NOT_JSON


_NOT_JSON = object()


def _error_shape(event: Event, data: Any) -> str | None:
    """How an error event looks (``None``: not an error)."""
    if event.event == "error":
        return "an `event: error` frame"
    if not isinstance(data, dict):
        return None
    if data.get("type") in ("error", "response.failed"):
        return f"a {data['type']} event"
    if isinstance(data.get("error"), dict):
        return 'an OpenAI-shaped {"error": {...}} frame'
    if isinstance(data.get("error"), str):
        return 'a {"error": "text"} frame'
    if data.get("object") == "error":
        return 'a flat {"object": "error"} frame'
    return None


def judge_stream(dialect: str, items: list[Event | StatusBlock], cut: str | None) -> tuple[str, str]:
    """A normal stream of ``dialect``: does it end as the dialect defines, and only that way?"""
    events = 0
    terminal = False
    finishes: list[str] = []
    malformed = 0
    for item in items:
        if isinstance(item, StatusBlock):
            block = f"HTTP {item.status} {item.reason}"
            return QUIRK, f"a stray HTTP block ({block}) inside the 200's body after {events} events"
        if not item.has_data:
            continue
        events += 1
        if dialect in ("chat_completions", "completions") and item.data.strip() == b"[DONE]":
            terminal = True
            continue
        data = _data(item)
        if data is _NOT_JSON:
            malformed += 1
            continue
        shape = _error_shape(item, data)
        if shape is not None:
            message = error_message(data) or repr(item.data[:120])
            return QUIRK, f"{shape} in a normal stream after {events - 1} events: {message}"
        if is_terminal(dialect, item.event, data, item.data):
            terminal = True
        for choice in (data.get("choices") or ()) if isinstance(data, dict) else ():
            if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                finishes.append(choice["finish_reason"])
    end = _TERMINAL_NAME[dialect]
    if "abort" in finishes:
        return QUIRK, (
            'a choice ended with finish_reason "abort": an engine abort dressed as a success (the proxy makes '
            "it an error, upstream_aborted)"
        )
    if cut is not None and not terminal:
        return QUIRK, f"cut after {events} events without {end}: {cut}"
    if malformed:
        return QUIRK, f"{malformed} of {events} events carry data that is not JSON (the proxy drops them)"
    if not terminal:
        finished = f" after finish_reason {finishes[-1]!r}" if finishes else ""
        return QUIRK, f"no {end}: the stream closed cleanly{finished} after {events} events (the proxy adds it)"
    reason = f", finish_reason {finishes[-1]!r}" if finishes else ""
    return OK, f"{events} events, ends with {end}{reason}"


def judge_usage(items: list[Event | StatusBlock], cut: str | None) -> tuple[str, str]:
    if cut is not None or any(isinstance(i, StatusBlock) for i in items):
        return UNKNOWN, "the stream broke before its end (see stream.terminal), so its usage cannot be judged"
    for item in reversed(items):
        if not isinstance(item, Event) or not item.has_data:
            continue
        data = _data(item)
        usage = data.get("usage") if isinstance(data, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            return OK, (
                f"usage chunk with {usage.get('prompt_tokens')} prompt and {usage['completion_tokens']} "
                "completion tokens"
            )
    return QUIRK, (
        "stream_options.include_usage was ignored: no usage in the stream, so the proxy books estimated "
        "tokens (source=estimated)"
    )


def judge_malformed_json(status: int, body: bytes) -> tuple[str, str]:
    if 400 <= status < 500:
        return OK, f"{status}: {message_of(body)}"
    if status >= 500:
        return QUIRK, f"{status}, which the SDKs retry (twice by default) in vain: {message_of(body)}"
    return FAIL, f"{status}: a body that is not JSON was accepted"


def judge_context_overflow(dialect: str, status: int, body: bytes, prompt_words: int) -> tuple[str, str]:
    asked = f"a prompt of about {prompt_words} tokens"
    if 200 <= status < 300:
        return QUIRK, f"{asked} was answered {status}: the backend truncated or shifted the context silently"
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    message = message_of(body)
    if status >= 500:
        return QUIRK, f"{asked} was answered {status} (the SDKs retry it): {message}"
    if dialect == "messages":
        native = isinstance(parsed, dict) and parsed.get("type") == "error" and isinstance(parsed.get("error"), dict)
    else:
        error = parsed.get("error") if isinstance(parsed, dict) else None
        native = isinstance(error, dict) and isinstance(error.get("message"), str)
    if not native:
        return QUIRK, f"{asked}: {status} in a foreign error shape (the proxy reshapes it): {message}"
    return OK, f"{status} in the dialect's error shape: {message}"


def judge_abort(
    received: int,
    generated: float,
    max_tokens: int,
    *,
    what: str = "the client's close",
    running_at_close: bool = True,
) -> tuple[str, str, bool]:
    """From the backend's own count of the tokens generated for one stream: did the close stop it?

    ``received`` content events had arrived when the client closed. Stopped means the generation ended
    before its end: fewer than 95 % of ``max_tokens`` generated (a backend that ignores a close runs
    to exactly ``max_tokens``, the answer asking for ``ignore_eos``). How soon it stopped is not judged:
    on a loaded machine vLLM noticed a close after 1,100-1,850 more tokens of its tiny model, and stopped.
    ``running_at_close``: the backend's gauge of running requests was above 0 just before the close; at
    0 the generation had ended before the close was seen, and its full count is no evidence of a run-on
    (``unknown``, never ``quirk``). Returns (result, detail, went_on).
    """
    left = max_tokens - received
    if generated < received or left <= 0:
        return UNKNOWN, f"the backend counted {generated:.0f} tokens for a stream that delivered {received}", False
    seen = f"{generated:.0f} of {max_tokens} tokens generated for a stream closed after {received} content events"
    if generated < max_tokens * RAN_TO_THE_END:
        return OK, f"stopped at {what}: {seen}", False
    if not running_at_close:
        return UNKNOWN, (
            f"not judged: the generation was over before {what} ({seen}; no request was running at the close: "
            "the backend generated faster than the check read)"
        ), False
    return QUIRK, f"went on after {what}: {seen}", True


ECHOED, RESTARTED, CONTINUED, OTHER = "echoed", "restarted", "continued", "other"


def prefill_cut(fresh: list[str], least: int = 3, span: int = 3) -> int | None:
    """Where to cut a greedy answer for the prefill probe: the first point from ``least`` on where what
    follows does not begin as the answer began (a tiny or random model's greedy answer repeats itself:
    cut "ab ab ab" after "ab", and the continuation " ab ab" reads as a restart, as vLLM's was taken for
    one), whose prefix holds no U+FFFD (broken UTF-8 cannot be sent back as the bytes that made it), and
    with ``span`` deltas after it to compare. None: no such point, the answer cannot tell the two apart."""
    for cut in range(least, len(fresh) - span + 1):
        if "\ufffd" in "".join(fresh[:cut]):
            return None
        rest, start = fresh[cut : cut + span], fresh[:span]
        if rest != start and not "".join(fresh[cut:]).lstrip().startswith("".join(start).lstrip()[:12]):
            return cut
    return None


def prefill_mode(fresh: list[str], continued: list[str], cut_at: int) -> str:
    """What one request with the first ``cut_at`` deltas of a greedy answer as a trailing assistant
    message did. Greedy decoding makes a restarted answer repeat the prefix too, but delta by delta as
    before; an echo comes whole in the first delta (llama-server: a prefilled "RUZ+K" came back as
    "RUZ+K proxy"). ``other``: new text, which is a continuation only if the prefix's text tokenizes back
    into the tokens that made it (true of real models; not of a random-weight test model)."""
    prefix, rest = "".join(fresh[:cut_at]), "".join(fresh[cut_at:])
    text = "".join(continued)
    if continued[:cut_at] == fresh[:cut_at]:
        return RESTARTED
    if prefix and continued and continued[0].startswith(prefix):
        return ECHOED
    if _same_start(text, rest):
        return CONTINUED
    return OTHER


def judge_prefill(
    fresh: list[str], answers: dict[str, list[str]], cut_at: int, *, unverifiable: str | None = None
) -> tuple[str, str]:
    """``answers``: per form of the request (with `continue_final_message`, plain), its content deltas.
    ``unverifiable``: why the greedy answer cannot tell a continuation from a restart (then only an
    echo, which shows whatever the answer, is judged)."""
    if len(fresh) < cut_at + 3 or not all(answers.values()):
        return UNKNOWN, "the answers were too short to compare"
    if unverifiable is None and prefill_cut(fresh, cut_at) != cut_at:
        unverifiable = "repeats itself: a continuation and a restart would look alike"
    modes = {form: prefill_mode(fresh, deltas, cut_at) for form, deltas in answers.items()}
    seen = "; ".join(f"{form}: {_MODE_TEXT[mode]}" for form, mode in modes.items())
    if ECHOED in modes.values():
        return QUIRK, f"the prefix is echoed in the first delta (--resume-on-cut must strip it): {seen}"
    if unverifiable is not None:
        return UNKNOWN, f"the greedy answer {unverifiable}"
    if CONTINUED in modes.values():
        return OK, f"a trailing assistant message is continued without an echo: {seen}"
    if set(modes.values()) == {RESTARTED}:
        return UNSUPPORTED, f"a trailing assistant message is not continued, --resume-on-cut cannot work here: {seen}"
    return UNKNOWN, f"no echo, no restart, but the continuation could not be verified against the greedy answer: {seen}"


_MODE_TEXT = {
    ECHOED: "the prefix comes back in the first delta",
    RESTARTED: "the answer starts over",
    CONTINUED: "continued, no echo",
    OTHER: "new text, no echo (not verifiable: the prefix does not tokenize back the same)",
}


def _same_start(a: str, b: str) -> bool:
    a, b = a.lstrip(), b.lstrip()
    n = min(len(a), len(b), 12)
    return n > 0 and a[:n] == b[:n]

