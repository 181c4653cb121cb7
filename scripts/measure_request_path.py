"""Hostile requests on the main port's request path, each measured against any checkout of the proxy
and against nginx on the same bytes.

    python scripts/measure_request_path.py [TREE] [--only cutter-extension,parse,small] [--nginx] [--clients 200]

TREE is a directory holding a `proxy/` package (default: this checkout), run as `python -m proxy serve`
from TREE (`git archive main proxy | tar -x -C /tmp/base` measures main; `make compiled` in TREE
measures the compiled build). Prints one JSON line per case:

- cutter-extension, cutter-zeros, cutter-trailer: CLIENTS connections, each one write of a chunked
  streamed chat whose first chunk line carries a 5,000-byte extension (or 5,000 leading zeros, or
  whose trailer is 5 KB), then 250 KB of pipelined `GET /v1/models`: the proxy's peak RSS, and
  another client's GET latency meanwhile.
- parse: 30 clients at once, each an 8.1 MB chat body holding 2.7 M empty objects (with and without
  --resume-on-cut): peak RSS, another client's GET latency (median, max). parse-string: the same
  size as one string (what moving the bytes costs, without a costly parse).
- small: `Content-Length: N ` with Expect: 100-continue past the limit, the close after a broken
  chunk line, 10,000 one-byte headers: what the client gets, and how soon.

A measurement harness for the report, not a test: the tests live in tests/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from measure_hardening import CHAT, backend, serving

GET = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
CHAT_HEAD = (b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
STREAMED = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
MiB = 1024 * 1024


def chunked_chat(kind: str) -> bytes:
    body = STREAMED
    if kind == "extension":
        return CHAT_HEAD + b"%x;e=" % len(body) + b"a" * 5000 + b"\r\n" + body + b"\r\n0\r\n\r\n"
    if kind == "zeros":
        return CHAT_HEAD + b"0" * 5000 + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    return CHAT_HEAD + b"%x\r\n" % len(body) + body + b"\r\n0\r\nT: " + b"a" * 5000 + b"\r\n\r\n"


def rss_mib(pids: list[int], field: str = "VmHWM") -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
            for row in status:
                if row.startswith(field + ":"):
                    total += int(row.split()[1])
    return round(total / 1024, 1)


@contextlib.asynccontextmanager
async def nginx(upstream: str) -> AsyncIterator[tuple[int, list[int]]]:
    """nginx in front of `upstream` (the bench's configuration): its port and its processes' pids."""
    from local_procs import free_port, wait_port
    from yarl import URL

    from proxy.tools.bench.targets import nginx_config

    port, prefix = free_port(), Path(tempfile.mkdtemp(prefix="nginx-"))
    os.chmod(prefix, 0o777)  # (nginx's workers run as nobody when it is started as root: its body files)
    (prefix / "nginx.conf").write_text(nginx_config(prefix, port, URL(upstream)))
    argv = ["nginx", "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "error.log")]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: ASYNC220
    try:
        await asyncio.to_thread(wait_port, port, proc, 20)
        children = (await asyncio.to_thread(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text)).split()
        yield port, [proc.pid, *map(int, children)]
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)


async def get_latencies(port: int, stop: asyncio.Event) -> list[float]:
    """Another client, in a process of its own (not this script's loop, which also runs the backend):
    one GET /v1/models at a time on one connection until `stop`; the latencies in ms."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--latency-client", str(port),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    await stop.wait()
    out, _ = await child.communicate(b"")
    return [float(x) for x in out.split()]


async def _latency_client(port: int) -> None:
    took: list[float] = []
    stop = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while not stop.done():
        started = time.perf_counter()
        writer.write(GET)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        except TimeoutError:
            took.append((time.perf_counter() - started) * 1000)  # (no answer within a minute: the last)
            break
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        took.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(0.01)
    writer.close()
    print(" ".join(f"{t:.2f}" for t in took), flush=True)


def summary(took: list[float]) -> dict[str, float]:
    if not took:
        return {"gets": 0}
    p90 = sorted(took)[int(len(took) * 0.9)]
    return {"gets": len(took), "get_p50_ms": round(statistics.median(took), 1), "get_p90_ms": round(p90, 1),
            "get_max_ms": round(max(took), 1)}


async def cutter(port: int, pids: list[int], clients: int, kind: str) -> dict[str, Any]:
    stop = asyncio.Event()
    other = asyncio.create_task(get_latencies(port, stop))
    await asyncio.sleep(0.3)
    data = chunked_chat(kind) + GET * (250 * 1024 // len(GET))
    writers = []
    for _ in range(clients):
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(data)
            writers.append(writer)
    await asyncio.sleep(3)  # (what was sent is parsed, or held, by now)
    stop.set()
    took = await other
    result = {"peak_rss_mib": rss_mib(pids), "rss_mib": rss_mib(pids, "VmRSS"), **summary(took)}
    for writer in writers:
        writer.close()
    return result


def empty_objects_body(kind: str) -> bytes:
    extra = b"[" + b"{}," * 2_700_000 + b"{}]" if kind == "objects" else b'"' + b"x" * 8_100_000 + b'"'
    return b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"x":' + extra + b"}"


async def parse(port: int, pids: list[int], kind: str) -> dict[str, Any]:
    body = empty_objects_body(kind)
    request = (b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)) + body  # fmt: skip
    stop = asyncio.Event()
    other = asyncio.create_task(get_latencies(port, stop))
    await asyncio.sleep(0.3)

    async def one() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            await writer.drain()
            return await asyncio.wait_for(reader.readuntil(b"\r\n"), 60)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            return repr(exc).encode()
        finally:
            writer.close()

    started = time.perf_counter()
    statuses = await asyncio.gather(*(one() for _ in range(30)))
    took_s = time.perf_counter() - started
    stop.set()
    took = await other
    return {"body_mb": round(len(body) / 1e6, 1), "statuses": sorted({s.split(b" ")[1].decode() for s in statuses
                                                                       if s.startswith(b"HTTP")}),
            "heads_s": round(took_s, 2), "peak_rss_mib": rss_mib(pids), **summary(took)}


async def small(port: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Content-Length with a trailing space past the limit, Expect: 100-continue: the first answer.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                 b"Content-Length: 100000000 \r\n\r\n")
    started = time.perf_counter()
    try:
        first = await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)
        out["cl_trailing_space_first_answer"] = first.strip().decode()
    except (TimeoutError, asyncio.IncompleteReadError) as exc:
        out["cl_trailing_space_first_answer"] = repr(exc)
    out["cl_trailing_space_ms"] = round((time.perf_counter() - started) * 1000, 1)
    writer.close()
    # A broken chunk line: the 400, then how long until the close.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(CHAT_HEAD + b"zz\r\n")
    started = time.perf_counter()
    try:
        answer = await asyncio.wait_for(reader.read(-1), 15)
        out["bad_chunk_status"] = answer.split(b" ", 2)[1].decode() if answer else "closed"
    except TimeoutError:
        out["bad_chunk_status"] = "no close within 15 s"
    out["bad_chunk_close_ms"] = round((time.perf_counter() - started) * 1000, 1)
    writer.close()
    # 10,000 one-byte headers.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + b"a:b\r\n" * 10_000 + b"\r\n")
    answer = await asyncio.wait_for(reader.read(-1), 15)
    out["ten_thousand_headers_status"] = answer.split(b" ", 2)[1].decode() if answer else "closed"
    writer.close()
    return out


async def run_case(case: str, port: int, pids: list[int], clients: int) -> dict[str, Any]:
    if case.startswith("cutter-"):
        return await cutter(port, pids, clients, case.partition("-")[2])
    if case.startswith("parse"):
        return await parse(port, pids, "string" if case == "parse-string" else "objects")
    return await small(port)


async def main(tree: Path, cases: list[str], clients: int, with_nginx: bool, flags: list[str]) -> None:
    async with backend() as b:
        for case in cases:
            variants = [flags, [*flags, "--resume-on-cut", "1"]] if case.startswith("parse") else [flags]
            for extra in variants:
                async with serving(tree, b.url, "--max-client-connections", "10000", *extra) as p:
                    result = await run_case(case, p.port, [p.proc.pid], clients)
                print(f"streamwarden {case} {' '.join(extra)}: {result}", flush=True)
            if with_nginx:
                async with nginx(b.url) as (port, pids):
                    result = await run_case(case, port, pids[1:], clients)
                print(f"nginx {case}: {result}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("tree", nargs="?", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--only", default="cutter-extension,cutter-zeros,cutter-trailer,parse,small")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--nginx", action="store_true")
    parser.add_argument("--flag", action="append", default=[], help="a flag for serve (repeatable)")
    parser.add_argument("--latency-client", type=int, help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.latency_client:
        asyncio.run(_latency_client(cli.latency_client))
        sys.exit(0)
    sys.setrecursionlimit(10_000)
    asyncio.run(main(Path(cli.tree).resolve(), cli.only.split(","), cli.clients, cli.nginx, cli.flag))
