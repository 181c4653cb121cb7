"""The harness of the content-template tests: the guard's fast path for repeated delta events must give
exactly the verdicts of the full parse, for every dialect that has one.

Both the chat test and the named-event (Responses, Messages) test compare the same record of a fed
stream, against the same reference: the dialect with its fast path turned off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.core.guard import Step, StreamGuard

__all__ = ["NoFastPath", "Outcome", "outcome"]


@dataclass
class Outcome:
    """Everything a fed stream gives the proxy: the bytes out, the counts, the verdict, what was learnt."""

    data: bytes
    content_events: int
    first_content: int
    done: bool
    outcome: str | None
    reason: str | None
    failure: Any
    events: int
    rewrites: list[str]
    usage: Any
    finish_reasons: tuple[str, ...]
    resume: str | None = None


def outcome(guard: StreamGuard, steps: list[Step]) -> Outcome:
    """The outcome of `steps`, the guard's answers to one stream fed to `guard`."""
    last = next((s for s in steps if s.done), Step())
    return Outcome(
        b"".join(s.data for s in steps), sum(s.content_events for s in steps), sum(s.first_content for s in steps),
        any(s.done for s in steps), last.outcome, last.reason, last.failure, guard.events, guard.rewrites,
        guard.usage, guard.usage.finish_reasons if guard.usage else (),
        next((s.resume for s in steps if s.resume), None),
    )


class NoFastPath:
    """Put before a dialect's stream class: every event then goes through the reader and one parse."""

    def may_repeat(self) -> bool:
        return False

    def repeats(self, chunk: bytes, start: int, limit: int) -> tuple[int, int]:
        return 0, start
