"""Count the instructions of each fixed per-request step alone, under callgrind (issue 38's steps).

`scripts/count_instructions.py` counts a whole request; this one calls each step the proxy takes once
per request on count_instructions' request (a 113-byte chat completion, curl's three headers) and the
fast fake's 853-byte answer, a few thousand times, with callgrind's counters zeroed before and dumped
after each step: the books (start and finish, the JSON line held as on the event loop), the body
judge, the upstream request's and the response's headers, the request body's read, the head scans.
Each figure is per call, less an empty step's; the same on a busy machine. The `--pythonpath` of
another checkout (one built with `make compiled` too) counts its steps, for an A/B against this one.
Usage: .venv/bin/python scripts/count_steps.py [--calls N] [--pythonpath DIR] [STEP ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("books", "judge", "request_headers", "sdk_request_headers", "response_headers", "read_request",
         "head_scans")  # fmt: skip

_CHILD = r'''
import asyncio, inspect, os, subprocess, sys
from multidict import CIMultiDict, CIMultiDictProxy
from proxy.core.body import judge_body
from proxy.core.dialects import RequestInfo, for_request, read_request
from proxy.core.headers import request_headers, response_headers
from proxy.core.http_head import HeadScanner, request_line_refusal
from proxy.core.lifecycle import Outcome, Phase, Reason
from proxy.core.message_end import MessageEnd
from proxy.core.record import ExchangeRecord
from proxy.observe.books import Books
from proxy.observe.logs import make_logger
from proxy.observe.metrics import Metrics
from proxy.server.speedups import drop_enum_lookup_hook

drop_enum_lookup_hook()  # (as the serving process does)
CALLS, ONLY = int(sys.argv[1]), sys.argv[2].split(",")
BODY_IN = (b'{"model":"fast-0ms","messages":[{"role":"user","content":"Write a long story."}],'
           b'"max_tokens":100,"stream":false}')
BODY_OUT = (b'{"id":"chatcmpl-fast","created":1796533993,"model":"fast-0ms","object":"chat.completion",'
            b'"choices":[{"index":0,"message":{"role":"assistant","content":"' + b"token " * 100 + b'"},'
            b'"finish_reason":"length"}],"usage":{"prompt_tokens":8,"completion_tokens":100,"total_tokens":108}}')
HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
        b"Content-Length: 113\r\n\r\n")
CURL = CIMultiDictProxy(CIMultiDict([("Host", "127.0.0.1:8080"), ("Content-Type", "application/json"),
                                     ("Content-Length", "113")]))
SDK = CIMultiDictProxy(CIMultiDict([("Host", "127.0.0.1:8080"), ("Accept-Encoding", "gzip, deflate"),
    ("Connection", "keep-alive"), ("Accept", "application/json"), ("Content-Type", "application/json"),
    ("User-Agent", "OpenAI/Python 1.50.0"), ("X-Stainless-Lang", "python"), ("X-Stainless-Package-Version", "1.50.0"),
    ("X-Stainless-OS", "Linux"), ("X-Stainless-Arch", "x64"), ("X-Stainless-Runtime", "CPython"),
    ("X-Stainless-Runtime-Version", "3.11.7"), ("Authorization", "Bearer none"), ("X-Stainless-Async", "false"),
    ("x-stainless-retry-count", "0"), ("Content-Length", "113")]))
UPSTREAM = CIMultiDictProxy(CIMultiDict([("Content-Type", "application/json"), ("Content-Length", "853")]))
dialect = for_request("POST", "/v1/chat/completions")
info = RequestInfo(model="fast-0ms")
loop = asyncio.new_event_loop()
logger = make_logger("json", "info", open(os.devnull, "w"))
logger.hold_lines(loop)  # (as the server holds them: written once per loop turn)
books = Books(Metrics(), logger)
IDENTITY = "identity" in inspect.signature(request_headers).parameters  # (before issue 38: popped after)


def record():
    ex = ExchangeRecord("0123456789abcdef0123456789abcdef", "POST", "/v1/chat/completions", "chat_completions",
                        "127.0.0.1")
    ex.model, ex.status, ex.upstream_status, ex.bytes_out = "fast-0ms", 200, 200, 853
    ex.outcome, ex.reason, ex.phase = Outcome.OK, Reason.COMPLETE, Phase.RESPONDING_WHOLE
    ex.record_usage(judge_body(dialect, info, 200, "application/json", BODY_OUT).usage)
    return ex


def forwarded(headers):
    if IDENTITY:
        return request_headers(headers, client_ip="127.0.0.1", scheme="http", host=headers.get("Host"),
                               request_id="0123456789abcdef0123456789abcdef", identity=True)
    out = request_headers(headers, client_ip="127.0.0.1", scheme="http", host=headers.get("Host"),
                          request_id="0123456789abcdef0123456789abcdef")
    out.popall("Accept-Encoding", None)
    return out


def books_step():
    ex = RECORDS.pop()
    books.start(ex, CURL)
    books.finish(ex)
    DONE.append(ex)  # (freed outside the count: a record's end is not the books')


def head_scans():
    head = HeadScanner(8192)  # (made per request, as the connection makes it)
    head.feed(HEAD + BODY_IN)
    request_line_refusal(head.request_line)
    end = CUTTER.cut(HEAD + BODY_IN, 0)
    CUTTER.framed(113, False)
    CUTTER.cut(HEAD + BODY_IN, end)
    CUTTER.ended()


CUTTER = MessageEnd()
STEPS = {
    "empty": lambda: None,
    "books": books_step,
    "judge": lambda: judge_body(dialect, info, 200, "application/json", BODY_OUT),
    "request_headers": lambda: forwarded(CURL),
    "sdk_request_headers": lambda: forwarded(SDK),
    "response_headers": lambda: response_headers(UPSTREAM, body_rewritten=False),
    "read_request": lambda: read_request(dialect, BODY_IN, None, 8 * 1024 * 1024, parse_limit=1024 * 1024),
    "head_scans": head_scans,
}
pid = str(os.getpid())
for name in ["empty", *ONLY]:
    step, DONE = STEPS[name], []
    RECORDS = [record() for _ in range(CALLS + 100)]
    for _ in range(100):
        step()
    subprocess.run(["callgrind_control", "-z", pid], check=True, capture_output=True)
    for _ in range(CALLS):
        step()
    subprocess.run(["callgrind_control", f"--dump={name}", pid], check=True, capture_output=True)
    loop.run_until_complete(asyncio.sleep(0))  # (the held lines written)
'''


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--pythonpath", default=str(ROOT))
    parser.add_argument("steps", nargs="*", help=f"some of: {' '.join(STEPS)} (default: all)")
    args = parser.parse_args(argv)
    steps = args.steps or list(STEPS)
    if unknown := set(steps) - set(STEPS):
        parser.error(f"no such step: {' '.join(sorted(unknown))}")
    env = {**os.environ, "PYTHONPATH": args.pythonpath, "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.out", "--dump-instr=no",
             sys.executable, "-c", _CHILD, str(args.calls), ",".join(steps)],
            env=env, check=True, capture_output=True, cwd=out,
        )  # fmt: skip
        counts: dict[str, int] = {}
        for path in Path(out).glob("cg.out.*"):
            text = path.read_text(errors="replace")
            name = re.search(r"^desc: Trigger: dump (\S+)", text, re.M)
            total = re.search(r"^(?:totals|summary): (\d+)", text, re.M)
            if name is not None and total is not None:
                counts[name.group(1)] = int(total.group(1))
    empty = counts["empty"]
    for name in steps:
        print(f"{name:22} {(counts[name] - empty) / args.calls:10,.0f} instructions per call")


if __name__ == "__main__":
    main(sys.argv[1:])
