"""Count the proxy's instructions per request (or per streamed event) under callgrind.

A CPU-time figure moves with whatever else the machine runs; callgrind's instruction count does
not (the same code, inputs and environment give the same total, busy machine or not), so two
versions of the proxy can be compared while other work runs. What it counts is user-space work
only: system calls are one instruction each, so pair it with `strace -c` for the kernel's share.

The fake upstream's fast mode answers; the proxy runs under `valgrind --tool=callgrind`; one client
on one keep-alive connection sends `--warmup` requests, the counters are zeroed, `--requests` more
are sent, and the dump's total over them is divided out.

`--start` counts what a burst of new streams queues behind: one stream's start, from its request in
to its first event out (the head's parse, the upstream request, the pool, the lifecycle, the books).
Each of `--requests` streams is paced by the fake (`fast-500ms`: the role chunk at once, the next event
500 ms later): the counters are zeroed before its request and dumped once its first event arrived,
while the proxy waits for the second; the median is kept. That count holds one event's relay, so the
cost of an event is counted too, apart from any start: the same number of 1-token and 100-token
streams (unpaced), the difference of their totals over the difference of their events. What a
zeroing and a dump count with no request between them is taken off. Printed: the start with its first
event, the event, the start alone (the first less the second), and the 1-token streams' cost apart
from their events (an unpaced stream's start and end; lower than a paced start, which waits for its
next event).
Usage: .venv/bin/python scripts/count_instructions.py [--stream | --start] [--requests N] [--warmup N]
       [--model fast-20ms] [--pythonpath DIR] [-- SERVE-FLAG ...]
(`--pythonpath` runs another checkout's `proxy` package, for an A/B against this one.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson
from local_procs import free_port, running

ROOT = Path(__file__).resolve().parent.parent
SETTLE = 0.3  # seconds for an answered stream's end to run before a zeroing (a few ms under callgrind)


def request(port: int, stream: bool, model: str = "fast-0ms", tokens: int = 100) -> bytes:
    body = orjson.dumps({
        "model": model, "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": tokens, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {}),
    })
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def exchange(sock: socket.socket, data: bytes, buffer: bytearray, at_first: Callable[[], None] | None = None) -> int:
    """Send one request, read its whole answer (Content-Length or chunked); the events it held.
    `at_first` is called once the first event of a chunked answer is in (before the rest is read)."""
    sock.sendall(data)
    while b"\r\n\r\n" not in buffer:
        buffer += _recv(sock)
    end = buffer.index(b"\r\n\r\n") + 4
    head = bytes(buffer[:end]).lower()
    del buffer[:end]
    if (match := re.search(rb"content-length: *(\d+)", head)) is not None:
        size = int(match.group(1))
        while len(buffer) < size:
            buffer += _recv(sock)
        events = buffer[:size].count(b"data:")
        del buffer[:size]
        return events
    body = bytearray()
    while True:  # chunked
        while b"\r\n" not in buffer:
            buffer += _recv(sock)
        line_end = buffer.index(b"\r\n")
        size = int(bytes(buffer[:line_end]).split(b";")[0], 16)
        while len(buffer) < line_end + 2 + size + 2:
            buffer += _recv(sock)
        body += buffer[line_end + 2 : line_end + 2 + size]
        del buffer[: line_end + 2 + size + 2]
        if at_first is not None and b"\n\n" in body:
            at_first()
            at_first = None
        if size == 0:
            return bytes(body).count(b"data:")


def _recv(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise SystemExit("the proxy closed the connection")
    return data


def total_instructions(out_dir: str, seen: set[str] | None = None) -> int:
    """The sum of the `totals:` (or `summary:`) lines of the dumps made after the zeroing (with `seen`:
    of those not in it, which are then added to it)."""
    total = 0
    for path in sorted(Path(out_dir).glob("cg.out*")):
        if seen is not None:
            if path.name in seen:
                continue
            seen.add(path.name)
        if path.name.endswith(".1") or re.search(r"\.\d+$", path.name):  # (callgrind_control dumps: cg.out.N)
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith(("totals:", "summary:")):
                    total += int(line.split()[1])
                    break
    return total


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--stream", action="store_true", help="streamed answers: count per event")
    mode.add_argument("--start", action="store_true", help="one stream's start: request in to first event out")
    parser.add_argument("--model", default="fast-0ms", help="fast-20ms: one event per 20 ms (b)")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--pythonpath", default=str(ROOT))
    parser.add_argument("serve_flags", nargs="*")
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": args.pythonpath, "PYTHONHASHSEED": "0"}
    fake_port, port, admin = free_port(), free_port(), free_port()
    fake = [sys.executable, "-m", "proxy", "fake-upstream", "--fast", "--port", str(fake_port)]
    keep = os.environ.get("KEEP_CALLGRIND")  # a directory to keep the dumps in (callgrind_annotate them)
    dumps = contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory()
    with dumps as out_dir, running(fake, fake_port, env):
        serve = [
            "valgrind", "--tool=callgrind", f"--callgrind-out-file={out_dir}/cg.out", "--dump-instr=no",
            sys.executable, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{fake_port}",
            "--host", "127.0.0.1", "--port", str(port), "--admin-port", str(admin), *args.serve_flags,
        ]
        with running(serve, port, env, within=300.0) as proxy, socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if args.start:
                count_start(sock, proxy.pid, out_dir, args.requests, args.warmup)
                return
            data, buffer = request(port, args.stream, args.model), bytearray()
            for _ in range(args.warmup):
                exchange(sock, data, buffer)
            subprocess.run(["callgrind_control", "-z", str(proxy.pid)], check=True, capture_output=True)
            events = sum(exchange(sock, data, buffer) for _ in range(args.requests))
            subprocess.run(["callgrind_control", "-d", str(proxy.pid)], check=True, capture_output=True)
            total = total_instructions(out_dir)
    per = "event" if args.stream else "request"
    count = events if args.stream else args.requests
    print(f"{total / count:,.0f} instructions per {per} ({args.requests} requests, {events} events, {total:,} in all)")


def count_start(sock: socket.socket, pid: int, out_dir: str, streams: int, warmup: int) -> None:
    """`--start`: each paced stream's request-in-to-first-event-out, and an event's cost, both per one."""
    port = sock.getpeername()[1]
    paced, one, hundred = (request(port, True, "fast-500ms", 1), request(port, True, "fast-0ms", 1),
                           request(port, True, "fast-0ms", 100))
    buffer, seen = bytearray(), set[str]()

    def control(flag: str) -> None:
        subprocess.run(["callgrind_control", flag, str(pid)], check=True, capture_output=True)

    for _ in range(warmup):
        for data in (paced, one, hundred):
            exchange(sock, data, buffer)
    total_instructions(out_dir, seen)  # (any dump so far is not counted)
    first: list[int] = []
    for _ in range(streams):
        time.sleep(SETTLE)  # the last stream's end (its books, its log line) done before the zeroing
        control("-z")
        exchange(sock, paced, buffer, lambda: control("-d"))
        first.append(total_instructions(out_dir, seen))
    idle: list[int] = []
    for _ in range(streams):  # the zeroing and the dump alone, no request between: what they count
        time.sleep(SETTLE)
        control("-z")
        control("-d")
        idle.append(total_instructions(out_dir, seen))
    counted: dict[bytes, tuple[int, int]] = {}
    for data in (one, hundred):
        time.sleep(SETTLE)
        control("-z")
        events = sum(exchange(sock, data, buffer) for _ in range(streams))
        control("-d")
        counted[data] = (total_instructions(out_dir, seen), events)
    (short, short_events), (long, long_events) = counted[one], counted[hundred]
    event = (long - short) / (long_events - short_events)
    start = statistics.median(first) - statistics.median(idle)
    print(f"{statistics.median(idle):,.0f} instructions between a zeroing and a dump with no request (taken off)")
    print(f"{start:,.0f} instructions from a stream's request in to its first event out (median of {streams}; "
          f"{min(first):,} to {max(first):,} before that)")
    print(f"{event:,.0f} instructions per event ({long_events - short_events} events apart from the starts)")
    print(f"{start - event:,.0f} instructions per start alone (the first less one event)")
    print(f"{short / streams - event * short_events / streams:,.0f} instructions per stream apart from its events "
          f"(start and end, from the 1-token streams)")


if __name__ == "__main__":
    main(sys.argv[1:])
