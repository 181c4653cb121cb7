"""The stream guard: upstream SSE bytes in, the exact bytes to send the client (and a verdict) out.

Sans-IO, like h11: the I/O loop feeds it what the upstream sent and reports EOF, resets, timeouts
and the end of the hold window; each call returns one `Step` saying whether to commit the 200, what
to write now and whether the stream is over. Normal streams pass byte for byte; every way a stream
can go wrong ends on an event boundary with a frame the client's SDK raises, or, while nothing was
committed yet, with a real HTTP status the SDK can retry (docs/failures.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Final

import orjson

from proxy.core.dialects import Dialect, DialectStream, Kind, Usage
from proxy.core.dialects.errors import ErrorCode, describe_error, error_message
from proxy.core.lifecycle import Outcome, Reason, status_for
from proxy.core.sse import Event, EventTooLarge, SSEReader, StatusBlock
from proxy.core.verdicts import Rewrite

__all__ = ["MAX_HELD", "Failure", "GuardState", "MayResume", "Step", "StreamGuard"]

MAX_HELD = 1024 * 1024  # bytes held before the first content; the hold window ends early past it
_PIECES = 16  # events of one read fed to the reader one at a time (to reach repeats after them)

# Statuses and messages for failures the I/O layer detects (docs/failures.md).
# The failures the I/O layer reports, with their message; the status is the lifecycle's table's.
_FAILURES = {
    Reason.STREAM_CUT: "the upstream stream ended before the response was complete",
    Reason.STALL_TIMEOUT: "the upstream sent nothing for too long",
    Reason.SHUTDOWN: "the proxy is shutting down",
    Reason.PROXY_ERROR: "the proxy failed while relaying the stream",  # a bug of ours; not a rewrite reason
}
_REWRITES = {Reason.STREAM_CUT: Rewrite.STREAM_CUT, Reason.STALL_TIMEOUT: Rewrite.STALL_TIMEOUT,
             Reason.SHUTDOWN: Rewrite.SHUTDOWN}  # fmt: skip
_EARLY_DONE = "the upstream ended the stream while a choice had no finish_reason (generation cut short)"
# End-to-end headers of a stray status block worth keeping on a real status: the SDKs' retry hints.
_RETRY_HEADERS = {"retry-after": "Retry-After", "retry-after-ms": "retry-after-ms", "x-should-retry": "x-should-retry"}


class GuardState(IntEnum):
    """Where the guard stands; every move is made by `StreamGuard._to`.

    HOLDING: the first events are held with the status line (the hold window). PARSING: released,
    every read through the reader. REPEATING: released, the reader idle, no continuation stitched and
    the dialect able to tell its repeats without a parse: the quick path, one `repeats` per read.
    BROKEN (--resume-on-cut): the stream broke and a continuation is tried (`resume`, `give_up`).
    DONE (final): after a step with `done`, every call returns an empty Step.
    """

    HOLDING = 0
    PARSING = 1
    REPEATING = 2
    BROKEN = 3
    DONE = 4


HOLDING: Final = GuardState.HOLDING
PARSING: Final = GuardState.PARSING
REPEATING: Final = GuardState.REPEATING
BROKEN: Final = GuardState.BROKEN
DONE: Final = GuardState.DONE


@dataclass(frozen=True, slots=True)
class Failure:
    """A failure to send as a real HTTP response, because nothing was committed yet."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Step:
    """What the I/O layer must do now, in this order: commit, write `data`, stop if `done`.

    An ending with an error is worded both ways, `data` (the error frame) and `failure` (a status):
    which one the client gets is the lifecycle's to say (`Answer.reply`), not the guard's.
    """

    commit: bool = False  # send the 200 status line and headers now, before `data`
    data: bytes = b""  # bytes to write to the client now
    done: bool = False  # the stream is over: stop reading and close the upstream connection
    outcome: Outcome | None = None  # when done: ok or error
    reason: Reason | None = None  # when done: the verdict
    # when done with an error: the same ending as a whole HTTP response, for when the lifecycle answers
    # STATUS (the status line is not out); its FRAME is `data` (the events before it and the frame)
    failure: Failure | None = None
    first_content: bool = False  # carries the first content-bearing event (time to first token)
    content_events: int = 0  # content-bearing events in `data` (token latency)
    resume: Reason | None = None  # --resume-on-cut: the stream broke for this reason; continue it, or give_up()


# (reason, status) -> whether to try a continuation instead of ending (proxy/core/resume/resumer.py)
MayResume = Callable[[Reason, int], bool]


@dataclass(frozen=True, slots=True)
class _Pending:
    """The error a stream broke with while a continuation is tried: what give_up() ends with."""

    status: int
    message: str
    reason: Reason
    rewrite: Rewrite | None
    code: ErrorCode | None
    headers: dict[str, str]
    raw: bytes | None  # an upstream error frame in the dialect's own shape, forwarded as it came


def _retry_headers(headers: dict[str, str]) -> dict[str, str]:
    kept: dict[str, str] = {}
    for name, value in headers.items():
        lower = name.lower()
        if lower in _RETRY_HEADERS:
            kept[_RETRY_HEADERS[lower]] = value
        elif lower.startswith("x-ratelimit-"):
            kept[lower] = value
    return kept


def _merge(a: Step, b: Step) -> Step:
    """One Step for two consecutive pieces of one read (`a` neither ended the stream nor broke it)."""
    b.commit = a.commit or b.commit
    b.data = a.data + b.data if a.data else b.data
    b.first_content = a.first_content or b.first_content
    b.content_events += a.content_events
    return b


def _join(parts: list[bytes]) -> bytes:
    return parts[0] if len(parts) == 1 else b"".join(parts)


class StreamGuard:
    """One streamed exchange's decisions. After a step with `done`, every call returns an empty Step."""

    __slots__ = (
        "_dialect",
        "_held",
        "_held_bytes",
        "_held_events",
        "_hold",
        "_max",
        "_max_held",
        "_may_resume",
        "_pending",
        "_reader",
        "_state",
        "_stitch",
        "_stream",
        "content_events",
        "events",
        "released",
        "rewrites",
        "saw_id",
        "upstream_message",
    )

    def __init__(
        self,
        dialect: Dialect,
        *,
        hold: bool,
        max_event_size: int = 8 * 1024 * 1024,
        max_held: int = MAX_HELD,
        may_resume: MayResume | None = None,
    ) -> None:
        self._dialect = dialect
        self._stream = dialect.new_stream()
        self._reader = SSEReader(max_event_size)
        self._state = HOLDING  # (released at once when not holding: `_begin` commits at the first call)
        # The guard asked for the status line (a step's `commit`), as the exchange's record keeps it once
        # the stream is over. Not whether the client has the status line: that is `Lifecycle.committed`.
        self.released = False
        self._max = max_event_size
        self._hold = hold  # False: commit at the first call (the I/O layer may commit() right away)
        self._held: list[bytes] = []  # events before the commit, sent together with it
        self._held_bytes = 0
        self._max_held = max_held  # past it the hold ends early: committing is always safe
        self._held_events = 0
        self.events = 0  # upstream events forwarded, comments and dropped events not included
        self.content_events = 0
        self.rewrites: list[Rewrite] = []
        self.saw_id = False  # an upstream `id:` line was forwarded (see `keepalive_safe`)
        self.upstream_message: str | None = None  # the upstream's own error message, for the log line
        self._may_resume = may_resume  # asked before a committed stream ends with an error
        self._pending: _Pending | None = None
        self._stitch: Callable[[Event], Event | None] | None = None

    @property
    def usage(self) -> Usage | None:
        """The upstream's usage, with the model that answered and the finish reasons."""
        return self._stream.report()

    @property
    def dialect(self) -> Dialect:
        return self._dialect

    @property
    def state(self) -> GuardState:
        return self._state

    @property
    def done(self) -> bool:
        return self._state is DONE

    @property
    def stream(self) -> DialectStream:
        return self._stream

    @property
    def retry_after(self) -> str | None:
        """The Retry-After of the stray block the stream broke with, while a continuation is tried."""
        pending = self._pending
        return None if pending is None else pending.headers.get("Retry-After")

    @property
    def broke_with(self) -> Reason | None:
        """Why the stream broke, while a continuation is tried (after a step with `resume`)."""
        pending = self._pending
        return None if pending is None else pending.reason

    @property
    def keepalive_safe(self) -> bool:
        """Whether a `: keep-alive` comment can be sent now.

        After an `id:` line the Python SDKs turn every later blank line into an empty event, which
        openai-python fails to parse; the Anthropic SDK skips empty events.
        """
        return not self.saw_id or self._dialect.anthropic

    # ---- the four inputs ------------------------------------------------------------------------

    def feed(self, chunk: bytes) -> Step:
        """Upstream bytes arrived."""
        state = self._state
        if state is REPEATING and chunk:
            # The common read once the stream flows: repeats of the content template, often nothing
            # else (one step, at once: what `_pieces` would find for it).
            count, start = self._stream.repeats(chunk, 0, self._max)
            if count and start == len(chunk):
                return self._repeated(chunk, count)
            step = self._pieces(chunk, self._repeated(chunk[:start], count) if count else None, start)
        elif state is DONE:
            return Step()
        elif self._whole(chunk):
            step = self._feed(chunk)
        else:
            step = self._pieces(chunk, None, 0)
        self._settle()
        return step

    def end_of_stream(self) -> Step:
        """The upstream closed cleanly (EOF); a partial last event is dropped."""
        if self._state is DONE:
            return Step()
        step, out = self._begin()
        return self._consume(step, out, self._reader.close()) or self._end(step, out)

    def fail(self, reason: Reason) -> Step:
        """The I/O layer detected a failure: `stream_cut`, `stall_timeout`, `shutdown` or `proxy_error`."""
        if self._state is DONE:
            return Step()
        step, out = self._begin()
        known = reason if reason in _FAILURES else Reason.STREAM_CUT
        message = _FAILURES[known]
        return self._error(step, out, status_for(known), message, reason, _REWRITES.get(known))

    def commit(self) -> Step:
        """The hold window expired: commit now and flush what was held."""
        if self._state is not HOLDING:
            return Step()
        step = Step()
        out: list[bytes] = []
        self._commit(step, out)
        if out:
            step.data = _join(out)
        return step

    # ---- after a step with `resume` ----------------------------------------------------------------

    def resume(self, stitch: Callable[[Event], Event | None]) -> None:
        """A continuation answered: its bytes come next, each event rewritten by `stitch` first."""
        if self._pending is None:
            raise RuntimeError("resume() without a step that asked for it")
        self._pending = None
        self._reader = SSEReader(self._max)  # the broken stream's partial event is dropped
        self._stitch = stitch
        self._to(PARSING)

    def give_up(self) -> Step:
        """No continuation: end with the error the stream broke with, as without --resume-on-cut."""
        pending = self._pending
        if pending is None or self._state is DONE:
            return Step()
        self._pending = None
        if pending.reason in (Reason.STRAY_HTTP_BLOCK, Reason.UPSTREAM_ERROR_FRAME):
            self.upstream_message = pending.message  # what the upstream said, as without the flag
        step, out = Step(), list[bytes]()
        if pending.raw is not None:  # (the upstream's own error frame and the dialect's ending)
            step.data = pending.raw
            step.failure = self._status(pending.status, pending.message, pending.code or pending.reason)
            self.events += 1
            return self._finish(step, Outcome.ERROR, pending.reason)
        return self._error(
            step, out, pending.status, pending.message, pending.reason, pending.rewrite, pending.code,
            pending.headers, resumable=False,
        )

    def status_instead(self) -> None:
        """The ending goes out as a real status, not a frame: nothing this guard released is sent
        (the lifecycle's STATUS; counted as `late_commit_status`)."""
        if Rewrite.LATE_COMMIT_STATUS not in self.rewrites:
            self.rewrites.append(Rewrite.LATE_COMMIT_STATUS)
        self._held = []
        self._held_bytes = 0
        self._held_events = 0

    # ---- internals --------------------------------------------------------------------------------

    def _status(self, status: int, message: str, code: ErrorCode) -> Failure:
        return Failure(status, self._dialect.error_body(status, message, code))

    def _resumes(self, step: Step, out: list[bytes], pending: _Pending) -> Step | None:
        """The one place a committed stream's failure may become a continuation instead of an end."""
        if self._may_resume is None or not self.content_events or pending.rewrite is Rewrite.OVERSIZED_EVENT:
            return None  # (content commits: a stream with content is always committed)
        if self._pending is not None:  # asked already: a second failure meanwhile ends the stream
            return None
        if not self._may_resume(pending.reason, pending.status):
            return None
        self._pending = pending
        self._to(BROKEN)
        self.upstream_message = None  # (a mended break is not what the exchange ended with)
        if out:
            step.data = _join(out)
        step.resume = pending.reason
        return step

    def _whole(self, chunk: bytes) -> bool:
        """Whether a read goes through the reader in one piece, as it always did: no repeat in it is
        worth looking for (the dialect cannot tell them, a continuation rewrites every event, one is
        tried), or the hold may end early in it."""
        state = self._state
        return (
            not chunk or state is BROKEN or self._stitch is not None or not self._stream.may_repeat()
            or (state is HOLDING and (not self._hold or self._held_bytes + len(chunk) > self._max_held))
        )

    def _pieces(self, chunk: bytes, acc: Step | None, start: int) -> Step:
        """A read from `start` on (`acc`: the Step of what came before): runs of content events the
        dialect knows without a parse skip the reader; other events go through it one at a time (it
        gives the same items however reads are split, and holding cannot end early within this read),
        and their Steps are merged into one."""
        pieces, n = _PIECES, len(chunk)
        if acc is None and self._state is not HOLDING and not self._reader.idle:
            acc, start = self._complete_pending(chunk)
        while start < n:
            if self._state is not HOLDING and self._reader.idle:
                count, end = self._stream.repeats(chunk, start, self._max)
                if count:
                    step = self._repeated(chunk if end - start == n else chunk[start:end], count)
                    acc = step if acc is None else _merge(acc, step)
                    start = end
                    continue
            end = chunk.find(b"\n\n", start) + 2
            if end < 2 or pieces == 0:
                end = n
            pieces -= 1
            step = self._feed(chunk if end - start == n else chunk[start:end])
            acc = step if acc is None else _merge(acc, step)
            if step.done or step.resume:  # (a break ends what the upstream said: the rest of the read is not read)
                break
            start = end
        assert acc is not None
        return acc

    def _settle(self) -> None:
        """After a read through the reader: the quick path is open while nothing closes it (the hold
        is over, no continuation is tried or stitched, the reader is idle, the dialect may repeat;
        only the reader, through `_feed`, can make it stop repeating)."""
        state = self._state
        if state is PARSING or state is REPEATING:
            quick = self._stitch is None and self._reader.idle and self._stream.may_repeat()
            self._to(REPEATING if quick else PARSING)

    def _to(self, state: GuardState) -> None:
        """The one place the state moves; DONE is final."""
        if self._state is not DONE:
            self._state = state

    def _complete_pending(self, chunk: bytes) -> tuple[Step | None, int]:
        """The event a read cut in two, when its bytes are repeats: their Step and where the read
        goes on; else (None, 0). (A read rarely ends on an event boundary.)"""
        pending = self._reader.pending_event()
        end = chunk.find(b"\n\n") + 2
        if pending is None or end < 2:
            return None, 0
        event = pending + chunk[:end]
        count, stop = self._stream.repeats(event, 0, self._max)
        if not count or stop != len(event):
            return None, 0
        self._reader.discard_pending()
        return self._repeated(event, count), end

    def _repeated(self, data: bytes, count: int) -> Step:
        """The step for `count` content events the dialect knew without a parse (`repeats`)."""
        self.events += count
        self.content_events += count
        step = Step()  # (fields set one by one: cheaper than a call with keywords, once per read)
        step.data, step.content_events, step.first_content = data, count, self.content_events == count
        return step

    def _feed(self, chunk: bytes) -> Step:
        """Through the reader and the dialect's classification: every event parsed."""
        step, out = self._begin()
        try:
            items = self._reader.feed(chunk)
        except EventTooLarge as exc:
            # Deliver what was complete before the oversized event, then end on a clean boundary.
            ended = self._consume(step, out, exc.complete)
            if ended is not None:
                return ended
            message = f"an upstream event exceeded the proxy's limit of {self._max} bytes"
            return self._error(step, out, 502, message, Reason.STREAM_CUT, Rewrite.OVERSIZED_EVENT)
        return self._consume(step, out, items) or self._flush(step, out)

    def _begin(self) -> tuple[Step, list[bytes]]:
        step = Step()
        out: list[bytes] = []
        if self._state is HOLDING and not self._hold:
            self._commit(step, out)
        return step, out

    def _commit(self, step: Step, out: list[bytes]) -> None:
        step.commit = True
        self.released = True
        self._to(PARSING)
        if self._held:
            out[:0] = self._held
            self._held = []
            self._held_bytes = 0
        self.events += self._held_events
        self._held_events = 0

    def _count(self) -> None:
        if self._state is not HOLDING:
            self.events += 1
        else:
            self._held_events += 1

    def _consume(self, step: Step, out: list[bytes], items: list[Event | StatusBlock]) -> Step | None:
        """Act on complete items; returns the final Step if one of them ended the stream."""
        stream = self._stream
        stitch = self._stitch
        for item in items:
            if isinstance(item, StatusBlock):
                return self._stray(step, out, item)
            if stitch is not None:
                stitched = stitch(item)
                if stitched is None:
                    continue
                item = stitched
            if item.id is not None:
                self.saw_id = True
            kind = stream.classify(item)
            if kind is Kind.CONTENT:
                out.append(item.raw)
                self.content_events += 1
                step.content_events += 1
                if self.content_events == 1:
                    step.first_content = True
                if self._state is HOLDING:
                    self._commit(step, out)
                self.events += 1
            elif kind is Kind.PASS:
                out.append(item.raw)
                self._count()
            elif kind is Kind.COMMENT:
                out.append(item.raw)
            elif kind is Kind.TERMINAL:
                # The reader ends an event at a CR; its LF (the rest of a CRLF) may be in the next
                # read, which never happens once the stream is over, so complete the line end here.
                raw = item.raw
                out.append(raw + b"\n" if raw[-1:] == b"\r" else raw)
                self._count()
                return self._finish_ok(step, out)
            elif kind is Kind.MALFORMED:
                self.rewrites.append(Rewrite.MALFORMED_EVENT)
            elif kind is Kind.END:
                return self._end(step, out)
            elif kind is Kind.ERROR:
                return self._upstream_error(step, out, item.raw)
            elif kind is Kind.FOREIGN:
                info = stream.error
                assert info is not None
                reason = Reason.UPSTREAM_ERROR_FRAME
                self.upstream_message = info.message
                return self._error(step, out, info.status, info.message, reason, Rewrite.FOREIGN_ERROR_FRAME, info.code)
            elif kind is Kind.ABORTED:
                # The abort chunk itself is dropped (its finish_reason is not one the SDKs know).
                info = stream.error
                assert info is not None
                aborted = Reason.UPSTREAM_ABORTED
                return self._error(step, out, info.status, info.message, aborted, Rewrite.UPSTREAM_ABORTED)
            else:  # Kind.EARLY_DONE
                return self._error(step, out, 502, _EARLY_DONE, Reason.STREAM_CUT, Rewrite.STREAM_CUT)
        return None

    def _flush(self, step: Step, out: list[bytes]) -> Step:
        if self._state is HOLDING and out:
            self._held_bytes += sum(map(len, out))
            if self._held_bytes <= self._max_held:
                self._held.extend(out)
                return step
            self._commit(step, out)  # role chunks or comments without end: stop holding them
        if out:
            step.data = _join(out)
        return step

    def _finish(self, step: Step, outcome: Outcome, reason: Reason) -> Step:
        self._to(DONE)
        step.done = True
        step.outcome = outcome
        step.reason = reason
        return step

    def _finish_ok(self, step: Step, out: list[bytes]) -> Step:
        if self._state is HOLDING:
            self._commit(step, out)
        if out:
            step.data = _join(out)
        return self._finish(step, Outcome.OK, Reason.COMPLETE)

    def _end(self, step: Step, out: list[bytes]) -> Step:
        """The upstream is finished (EOF, or a `[DONE]` where another terminal was due)."""
        stream = self._stream
        if not stream.finished:
            message = _FAILURES[Reason.STREAM_CUT]
            return self._error(step, out, status_for(Reason.STREAM_CUT), message, Reason.STREAM_CUT, Rewrite.STREAM_CUT)
        terminal = stream.terminal_frame()
        if terminal is not None:
            out.append(terminal)
            self.rewrites.append(Rewrite.MISSING_TERMINAL)
        return self._finish_ok(step, out)

    def _error(
        self,
        step: Step,
        out: list[bytes],
        status: int,
        message: str,
        reason: Reason,
        rewrite: Rewrite | None,
        code: ErrorCode | None = None,
        headers: dict[str, str] | None = None,
        *,
        resumable: bool = True,
    ) -> Step:
        """End with the dialect's error: a frame after the commit, a real status before it."""
        if resumable:
            resumed = self._resumes(step, out, _Pending(status, message, reason, rewrite, code, headers or {}, None))
            if resumed is not None:
                return resumed
        body = self._dialect.error_body(status, message, code or reason)
        step.failure = Failure(status, body, headers or {})
        if self._state is not HOLDING:
            out.append(self._stream.error_frame(status, message, code or reason))
            step.data = _join(out)
            if rewrite is not None:
                self.rewrites.append(rewrite)
        else:
            if rewrite is not None:  # the cause counts too: alerts on stray blocks must see them
                self.rewrites.append(rewrite)
            self.status_instead()
        return self._finish(step, Outcome.ERROR, reason)

    def _upstream_error(self, step: Step, out: list[bytes], raw: bytes) -> Step:
        """An error in the dialect's own shape: forward it and the rest of its ending, stop at once."""
        info = self._stream.error
        assert info is not None
        self.upstream_message = info.message
        if self._state is HOLDING:
            return self._error(step, out, info.status, info.message, Reason.UPSTREAM_ERROR_FRAME, None, info.code)
        tail = self._stream.error_tail()
        pending = _Pending(info.status, info.message, Reason.UPSTREAM_ERROR_FRAME, None, info.code, {}, raw + tail)
        resumed = self._resumes(step, out, pending)
        if resumed is not None:
            return resumed
        out.append(raw)
        self.events += 1
        if tail:
            out.append(tail)
        step.data = _join(out)
        step.failure = self._status(info.status, info.message, info.code or Reason.UPSTREAM_ERROR_FRAME)
        return self._finish(step, Outcome.ERROR, Reason.UPSTREAM_ERROR_FRAME)

    def _stray(self, step: Step, out: list[bytes], block: StatusBlock) -> Step:
        """An HTTP response written into the SSE body: dropped, reported with its status and message."""
        status = block.status if 400 <= block.status <= 599 else 502
        message: str | None = None
        code: ErrorCode | None = None
        try:
            obj = orjson.loads(block.body)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            message = error_message(obj)
            code = describe_error(obj).code
        if not message:
            message = block.reason or f"the upstream wrote an HTTP {block.status} response into the stream"
        headers = _retry_headers(block.headers)
        self.upstream_message = message
        return self._error(step, out, status, message, Reason.STRAY_HTTP_BLOCK, Rewrite.STRAY_HTTP_BLOCK, code, headers)
