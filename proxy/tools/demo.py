"""`streamwarden demo`: the fake upstream and the proxy side by side, seen through the official openai SDK.

Everything runs in this process on free loopback ports, so the tour can read the fake upstream's own
records (what the backend really sent, and when it saw its client leave) and the proxy's log lines. Each
case prints what the client got directly and through the proxy, as it happened: nothing is scripted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import signal
import sys
import textwrap
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import orjson
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import Config
from proxy.observe.logs import make_logger
from proxy.server.app import build_state
from proxy.server.serve import Server
from proxy.tools.fake import RATE_HEADER, RECORDER, FakeSettings, Recorder, RequestRecord, build_app

__all__ = ["run_demo"]

HOST = "127.0.0.1"
WIDTH = 80
TOKEN_RATE = 30.0  # the fake's pace: slow enough to watch by hand with --keep-running
STALL_TIMEOUT = 2.0  # --client-stall-timeout for the demo (default 60)
IDLE_TIMEOUT = 5.0  # --idle-timeout for the demo (default 120)
RAW_WAIT = 2.0  # how long a plain reader is given to see a stream end
LONG_TOKENS = 131072  # the fake's largest answer: ~25 MB at full speed, more than loopback buffers hold
RESUMES = 1  # --resume-on-cut of the demo's second proxy
MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]


class _LogSink(io.StringIO):
    """The proxy's JSON log lines: kept for the tour, echoed to stderr once the servers are left running."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[dict[str, Any]] = []
        self.echo: Callable[[str], object] | None = None

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                self.lines.append(orjson.loads(line))
                if self.echo is not None:
                    self.echo(line)
        return len(text)

    def verdict(self, request_id: str) -> str:
        """The proxy's last word on a request: outcome/reason, the status it sent, a cancelled upstream."""
        found = [x for x in self.lines if x.get("event") == "request" and x.get("request_id") == request_id]
        if not found:
            return "proxy: no log line"
        last = found[-1]
        text = f"proxy log: {last['outcome']}/{last['reason']}, status {last['status']}"
        if len(found) > 1:
            text += f" ({len(found)} attempts)"
        if last.get("resumes"):
            text += f", resumed {last['resumes']} time{'s' * (last['resumes'] != 1)}"
        return text + (", upstream cancelled" if last.get("upstream_cancelled") else "")


@dataclass
class _Stack:
    fake: web.AppRunner
    recorder: Recorder
    server: Server
    log: _LogSink
    fake_url: str = ""
    proxy_url: str = ""
    admin_url: str = ""
    resume_url: str = ""  # a second proxy, with --resume-on-cut
    ids: Counter[str] = field(default_factory=Counter)

    def request_id(self, case: str, side: str) -> str:
        self.ids[case] += 1
        return f"demo-{case}-{side}-{self.ids[case]}"

    def attempts(self, request_id: str) -> int:
        return sum(1 for r in self.recorder.all() if r.request_id == request_id)

    def client(self, side: str, *, max_retries: int = 1) -> openai.AsyncOpenAI:
        base = {"direct": self.fake_url, "resume": self.resume_url}.get(side, self.proxy_url)
        return openai.AsyncOpenAI(base_url=base + "/v1", api_key="demo", max_retries=max_retries, timeout=15)


@contextlib.asynccontextmanager
async def _servers() -> AsyncIterator[_Stack]:
    app = build_app(FakeSettings(token_rate=TOKEN_RATE))
    fake = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await fake.setup()
    log = _LogSink()
    servers: list[Server] = []
    try:
        await web.TCPSite(fake, HOST, 0).start()
        fake_url = f"http://{HOST}:{fake.addresses[0][1]}"
        config = Config(
            upstream=fake_url, host=HOST, port=0, admin_port=0, client_stall_timeout=STALL_TIMEOUT,
            idle_timeout=IDLE_TIMEOUT, drain_timeout=1.0,
        )  # fmt: skip
        for settings in (config, dataclasses.replace(config, resume_on_cut=RESUMES)):
            server = Server(settings, build_state(settings, logger=make_logger("json", "info", log)))
            servers.append(server)
            await server.start()
        (port, admin_port), (resume_port, _) = (s.ports() for s in servers)
        yield _Stack(fake, app[RECORDER], servers[0], log, fake_url, f"http://{HOST}:{port}",
                     f"http://{HOST}:{admin_port}", f"http://{HOST}:{resume_port}")  # fmt: skip
    finally:
        for server in servers:
            await server.shutdown()
        await fake.cleanup()


# -- output --------------------------------------------------------------------------------------------


def _title(number: int, title: str, note: str) -> None:
    print()
    print(textwrap.fill(f"{number}. {title}", WIDTH, subsequent_indent="   "))
    print(textwrap.fill(note, WIDTH, initial_indent="   ", subsequent_indent="   "))


def _say(label: str, text: str) -> None:
    print(textwrap.fill(text, WIDTH, initial_indent=f"  {label:<8} ", subsequent_indent=" " * 11))


def _error(exc: BaseException) -> str:
    """How the SDK's exception looks to the caller: class, status, message, and the network cause."""
    name = type(exc).__name__
    status = f" {exc.status_code}" if isinstance(exc, openai.APIStatusError) else ""
    text = f"{name}{status}: {getattr(exc, 'message', str(exc))}"
    cause = exc.__cause__
    if isinstance(exc, openai.APIConnectionError) and cause is not None:
        text += f" (cause: {type(cause).__name__}: {cause})"
    return text


@dataclass
class _Turn:
    """What a streaming SDK call produced: chunks, text, and the exception if one was raised."""

    chunks: int = 0
    text: str = ""
    error: BaseException | None = None
    seconds: float = 0.0

    def describe(self) -> str:
        got = f"{self.chunks} chunk{'s' * (self.chunks != 1)}, text {self.text!r}"
        if self.error is None:
            return f"no exception; {got} ({self.seconds:.1f} s)"
        return f"{_error(self.error)} -- after {got} ({self.seconds:.1f} s)"


async def _stream_turn(stack: _Stack, side: str, request_id: str, headers: dict[str, str], **body: Any) -> _Turn:
    turn = _Turn()
    start = time.monotonic()
    async with stack.client(side) as client:
        try:
            stream = await client.chat.completions.create(
                model="demo-model", messages=MESSAGES, stream=True,
                extra_headers={"X-Request-Id": request_id, **headers}, **body,
            )  # fmt: skip
            async for chunk in stream:
                turn.chunks += 1
                if chunk.choices:
                    turn.text += chunk.choices[0].delta.content or ""
        except openai.OpenAIError as exc:
            turn.error = exc
    turn.seconds = time.monotonic() - start
    return turn


# -- the cases -----------------------------------------------------------------------------------------


async def _normal(stack: _Stack) -> None:
    _title(1, "A normal stream", f"max_tokens=10 at {TOKEN_RATE:.0f} tokens/s.")
    texts = []
    for side in ("direct", "through"):
        rid = stack.request_id("normal", side)
        turn = await _stream_turn(stack, side, rid, {}, max_tokens=10)
        texts.append(turn.text)
        _say(side, turn.describe())
    _say("", ("the same text; " if texts[0] == texts[1] else "DIFFERENT text; ") + stack.log.verdict(rid))


async def _stray_503(stack: _Stack) -> None:
    _title(2, "A stray 'HTTP/1.0 503' block inside a 200 stream (x-fault: stray_503)",
           "The backend sends 200, one role-only chunk, then a whole 503 response as body bytes, "
           "then closes.")  # fmt: skip
    for side in ("direct", "through"):
        rid = stack.request_id("stray", side)
        turn = await _stream_turn(stack, side, rid, {"x-fault": "stray_503"}, max_tokens=10)
        _say(side, f"{turn.describe()}; the backend got {stack.attempts(rid)} request(s)")
    _say("", stack.log.verdict(rid))


async def _raw_read(stack: _Stack, side: str, request_id: str, fault: str) -> str:
    """A plain SSE reader that waits for the end of the body, given RAW_WAIT seconds."""
    base = stack.fake_url if side == "direct" else stack.proxy_url
    body = {"model": "demo-model", "stream": True, "messages": MESSAGES, "max_tokens": 10}
    headers = {"x-fault": fault, "X-Request-Id": request_id}
    start = time.monotonic()
    received = b""
    url = base + "/v1/chat/completions"
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as resp:
        try:
            async with asyncio.timeout(RAW_WAIT):
                async for chunk in resp.content.iter_any():
                    received += chunk
        except TimeoutError:
            return f"still waiting after {RAW_WAIT:.0f} s (events so far: {_kinds(received)}); gave up"
        except aiohttp.ClientPayloadError as exc:
            return f"body broke off: {exc}"
    return f"body ended after {time.monotonic() - start:.2f} s; events: {_kinds(received)}"


def _kinds(body: bytes) -> str:
    """The events of a chat stream, one word each, for a compact picture of what arrived."""
    kinds = []
    for event in body.split(b"\n\n"):
        if event.strip():
            kinds.append("[DONE]" if b"[DONE]" in event else "error" if b'"error"' in event else "chunk")
    return ", ".join(kinds) or "none"


async def _error_after_first(stack: _Stack) -> None:
    _title(3, "An error frame after the first chunk (x-fault: error_after_first)",
           "vLLM's error event arrives after one content chunk; then the backend stays open and silent "
           "(600 s).")  # fmt: skip
    for side in ("direct", "through"):
        rid = stack.request_id("error", side)
        turn = await _stream_turn(stack, side, rid, {"x-fault": "error_after_first"}, max_tokens=10)
        _say(side, turn.describe())
    _say("", stack.log.verdict(rid))
    print("   A plain SSE reader (curl, a hand-written client) waiting for the end:")
    for side in ("direct", "through"):
        _say(side, await _raw_read(stack, side, stack.request_id("error-raw", side), "error_after_first"))


def _backend_story(record: RequestRecord | None, sent_before: int, stopped: float, now: float) -> str:
    """What the fake upstream's record says about a request whose client stopped reading at `stopped`."""
    if record is None:
        return "the backend has no record of this request"
    if record.finished_at is None:
        moving = "still sending" if record.events_sent > sent_before else "blocked on full buffers"
        return (f"{now - stopped:.1f} s after the client stopped reading, the backend is still busy with the "
                f"request: {record.events_sent:,} events sent, {moving}, no close seen; it stays so for as long "
                "as the client holds the stream.")  # fmt: skip
    if record.completed:
        return (f"the backend finished the whole answer ({record.events_sent:,} events) before anything noticed: "
                "the socket buffers held it all.")  # fmt: skip
    closed = record.client_closed_at or record.finished_at
    return (f"the backend saw its connection close {closed - stopped:.1f} s after the client stopped reading, "
            f"after {record.events_sent:,} events, and stopped generating.")  # fmt: skip


async def _abandon(stack: _Stack) -> None:
    _title(4, "A client that stops reading but keeps its connection open",
           f"A hung worker, or an SDK stream never closed: it reads one chunk of a {LONG_TOKENS:,}-token "
           f"answer at full speed, then nothing. The proxy runs with --client-stall-timeout {STALL_TIMEOUT:.0f}."
           " What the backend saw comes from the fake's own records.")  # fmt: skip
    ids = {side: stack.request_id("abandon", side) for side in ("direct", "through")}
    clients = {side: stack.client(side, max_retries=0) for side in ids}
    streams: list[Any] = []
    direct_open = False
    try:
        for side, rid in ids.items():
            stream = await clients[side].chat.completions.create(
                model="demo-model", messages=MESSAGES, stream=True, max_tokens=LONG_TOKENS,
                extra_headers={"X-Request-Id": rid, RATE_HEADER: "0"},
            )  # fmt: skip
            streams.append(stream)
            await stream.__anext__()  # one chunk, then the client stops reading
        stopped = time.monotonic()
        with contextlib.suppress(TimeoutError):  # the proxy's stall timer, plus time to cancel
            await stack.recorder.wait_finished(ids["through"], timeout=STALL_TIMEOUT + 8)
        records = {side: stack.recorder.get(rid) for side, rid in ids.items()}
        before = {side: r.events_sent if r else 0 for side, r in records.items()}
        await asyncio.sleep(0.5)  # long enough to see whether the backend is still sending
        for side, record in records.items():
            _say(side, _backend_story(record, before[side], stopped, time.monotonic()))
        _say("", stack.log.verdict(ids["through"]))
        direct_open = records["direct"] is not None and records["direct"].finished_at is None
    finally:
        for stream in streams:
            await stream.close()
        for client in clients.values():
            await client.close()
    if direct_open:
        with contextlib.suppress(TimeoutError):
            record = await stack.recorder.wait_finished(ids["direct"], timeout=5)
            if record.client_closed_at is not None:
                print("   (The direct request ended only when the demo closed its stream.)")


async def _null_200(stack: _Stack) -> None:
    _title(5, "A 200 whose JSON body is null (x-fault: null_200, non-stream)",
           "vLLM #42794: the server answers 200 application/json with the body null.")  # fmt: skip
    for side in ("direct", "through"):
        rid = stack.request_id("null", side)
        async with stack.client(side) as client:
            try:
                result = await client.chat.completions.create(
                    model="demo-model", messages=MESSAGES, extra_headers={"x-fault": "null_200", "X-Request-Id": rid}
                )
            except openai.OpenAIError as exc:
                text = _error(exc)
            else:
                text = f"no exception; create() returned {result!r} ({type(result).__name__})"
        _say(side, f"{text}; the backend got {stack.attempts(rid)} request(s)")
    _say("", stack.log.verdict(rid))


async def _resume(stack: _Stack) -> None:
    fault = "cut;once=1"
    _title(6, f"A stream cut mid-answer, resumed (x-fault: {fault}, --resume-on-cut {RESUMES})",
           "The backend closes the stream after two content chunks, on a request's first attempt only "
           "(once=1). A second proxy runs with --resume-on-cut: it asks the backend to continue the "
           "answer so far and relays the rest as the same stream.")  # fmt: skip
    for side in ("direct", "through", "resume"):
        rid = stack.request_id("resume", side)
        turn = await _stream_turn(stack, side, rid, {"x-fault": fault}, max_tokens=10)
        _say(side, f"{turn.describe()}; the backend got {stack.attempts(rid)} request(s)")
        if side != "direct":
            _say("", stack.log.verdict(rid))


async def _metrics(stack: _Stack) -> None:
    """The proxy's counters that moved, as its admin port's /metrics shows them."""
    async with aiohttp.ClientSession() as session, session.get(stack.admin_url + "/metrics") as resp:
        text = await resp.text()
    wanted = {
        "streamwarden_requests_total": ("outcome", "reason"),
        "streamwarden_upstream_cancellations_total": ("reason",),
        "streamwarden_stream_rewrites_total": ("reason",),
    }
    totals: dict[str, Counter[tuple[str, ...]]] = {name: Counter() for name in wanted}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and sample.value:
                totals[sample.name][tuple(sample.labels[k] for k in wanted[sample.name])] += int(sample.value)
    print()
    print(f"The proxy's metrics that moved ({stack.admin_url}/metrics):")
    for name, counts in totals.items():
        print(f"  {name}")
        if not counts:
            print("    (none)")
        for labels, value in sorted(counts.items()):
            shown = ", ".join(f'{k}="{v}"' for k, v in zip(wanted[name], labels, strict=True))
            print(f"    {{{shown}}} {value}")


CASES: tuple[Callable[[_Stack], Awaitable[None]], ...] = (
    _normal, _stray_503, _error_after_first, _abandon, _null_200, _resume,
)


def _intro(stack: _Stack) -> None:
    print(f"streamwarden demo\n  fake upstream  {stack.fake_url}  (breaks on demand: x-fault header)")
    print(f"  streamwarden   {stack.proxy_url}  (admin: {stack.admin_url})")
    print(f"  streamwarden   {stack.resume_url}  (--resume-on-cut {RESUMES}, for case 6)")
    print(textwrap.fill(
        f"Each case calls both with the official openai SDK (AsyncOpenAI, max_retries=1). Demo settings: "
        f"--client-stall-timeout {STALL_TIMEOUT:.0f} --idle-timeout {IDLE_TIMEOUT:.0f} (defaults 60 and 120); "
        "everything else is the default.", WIDTH))  # fmt: skip


def _try_by_hand(stack: _Stack) -> None:
    print()
    print("Both servers stay up until Ctrl-C. Try:")
    print(f"  curl -N {stack.proxy_url}/v1/chat/completions \\")
    print("    -H 'Content-Type: application/json' -H 'x-fault: stray_503' \\")
    print('    -d \'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}\'')
    print("  resume: the same with -H 'x-fault: cut;once=1', against the proxy with")
    print(f"    --resume-on-cut: {stack.resume_url}")
    print(f"  export OPENAI_BASE_URL={stack.proxy_url}/v1 OPENAI_API_KEY=unused")
    print(f"  (direct: {stack.fake_url}/v1; metrics: {stack.admin_url}/metrics;")
    print("   the proxy's log lines follow on stderr)")


async def _demo(keep_running: bool) -> int:
    async with _servers() as stack:
        _intro(stack)
        for case in CASES:
            await case(stack)
        await _metrics(stack)
        if keep_running:
            _try_by_hand(stack)
            await _wait_for_stop(stack)
    return 0


async def _wait_for_stop(stack: _Stack) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stack.log.echo = lambda line: print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    await stop.wait()
    print("\nstopping")


def run_demo(*, keep_running: bool = False) -> int:
    """Run the tour (and, with keep_running, leave both servers up until Ctrl-C); returns the exit code."""
    try:
        return asyncio.run(_demo(keep_running))
    except KeyboardInterrupt:
        return 130
