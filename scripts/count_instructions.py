"""Count the proxy's instructions per request (or per streamed event) under callgrind.

A CPU-time figure moves with whatever else the machine runs; callgrind's instruction count does
not (the same code, inputs and environment give the same total, busy machine or not), so two
versions of the proxy can be compared while other work runs. What it counts is user-space work
only: system calls are one instruction each, so pair it with `strace -c` for the kernel's share.

The fake upstream's fast mode answers; the proxy runs under `valgrind --tool=callgrind`; one client
on one keep-alive connection sends `--warmup` requests, the counters are zeroed, `--requests` more
are sent, and the dump's total over them is divided out.
Usage: .venv/bin/python scripts/count_instructions.py [--stream] [--requests N] [--warmup N]
       [--model fast-20ms] [--pythonpath DIR] [-- SERVE-FLAG ...]
(`--pythonpath` runs another checkout's `proxy` package, for an A/B against this one.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson
from local_procs import free_port, running

ROOT = Path(__file__).resolve().parent.parent


def request(port: int, stream: bool, model: str = "fast-0ms") -> bytes:
    body = orjson.dumps({
        "model": model, "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 100, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {}),
    })
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def exchange(sock: socket.socket, data: bytes, buffer: bytearray) -> int:
    """Send one request, read its whole answer (Content-Length or chunked); the events it held."""
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
        if size == 0:
            return bytes(body).count(b"data:")


def _recv(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise SystemExit("the proxy closed the connection")
    return data


def total_instructions(out_dir: str) -> int:
    """The sum of the `totals:` (or `summary:`) lines of the dumps made after the zeroing."""
    total = 0
    for path in sorted(Path(out_dir).glob("cg.out*")):
        if path.name.endswith(".1") or re.search(r"\.\d+$", path.name):  # (callgrind_control dumps: cg.out.N)
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith(("totals:", "summary:")):
                    total += int(line.split()[1])
                    break
    return total


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream", action="store_true", help="streamed answers: count per event")
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


if __name__ == "__main__":
    main(sys.argv[1:])
