"""Measure the proxy's memory per held stream: its RSS, and with --tracemalloc where Python's goes.

The fake upstream's fast mode answers slowly (`--model fast-200ms`: 200 ms per event), so that
`--streams` streams stay open at once. The proxy runs in a small wrapper (below): with
--tracemalloc it traces allocations from the start, and a thread of its own carries out what this
script asks by dropping a file in a control directory (no signal handler is added to the proxy):
a snapshot, a search for who holds the blocks made at a line (--who), or a count of what the cyclic
GC had to collect (--cycles: every object a refcount should have freed is a leak until the next
collection, and shows in the RSS). Figures: the proxy's VmRSS before (a fresh proxy, after a
warm-up of --warm streams run twice), while all streams are held (each has had its first content
event, and reads on) and after they ended; the tracemalloc difference per stream, by the line that
made each block and the line of the proxy's own code that led there. (Tracing costs memory of its
own: take the RSS figures from a run without --tracemalloc.)
Usage: .venv/bin/python scripts/measure_stream_memory.py [--streams 256] [--model fast-200ms] [--warm 8]
       [--tracemalloc FRAMES] [--top 40] [--who FILE:LINE] [--cycles] [--pythonpath DIR] [-- SERVE-FLAG ...]
(`--pythonpath` runs another checkout's `proxy` package, for a before figure.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from local_procs import free_port, running

ROOT = Path(__file__).resolve().parent.parent

# The proxy's process. Requests are files `<name>.<verb>` in the control directory; each is answered
# with `<name>.done` (and its result beside it).
_WRAPPER = r"""
import gc, os, sys, threading, time, tracemalloc
control = os.environ["SW_MEM_CONTROL"]
frames = int(os.environ.get("SW_MEM_FRAMES", "0"))
if frames:
    tracemalloc.start(frames)

def tally(counts, path):
    with open(path, "w") as out:
        for key, count in sorted(counts.items(), key=lambda kv: -kv[1]):
            out.write(f"{count} {key}\n")

def answer(base, verb):
    if verb == "snap":
        gc.collect()
        if frames:
            tracemalloc.take_snapshot().dump(base + ".snapshot")
    elif verb == "cycles":  # from now on the collector keeps what it finds
        gc.collect()
        gc.garbage.clear()
        gc.set_debug(gc.DEBUG_SAVEALL)
    elif verb == "tally":  # what the collector found since `cycles`, by type
        gc.collect()
        counts = {}
        for obj in gc.garbage:
            counts[type(obj).__qualname__] = counts.get(type(obj).__qualname__, 0) + 1
        gc.set_debug(0)
        gc.garbage.clear()
        tally(counts, base + ".types")
    elif verb == "who":  # which objects hold the blocks made at the lines listed in the file
        with open(base + ".sites") as f:
            sites = set(f.read().split())
        found = {}
        for holder in gc.get_objects():
            for obj in gc.get_referents(holder):
                tb = tracemalloc.get_object_traceback(obj)
                if tb is not None:
                    site = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}"
                    if site in sites:
                        key = (site, type(obj).__name__, type(holder).__qualname__)
                        found[key] = found.get(key, 0) + 1
        tally(found, base + ".holders")

def watch():
    while True:
        for name in os.listdir(control):
            base, _, verb = name.rpartition(".")
            if verb in ("snap", "cycles", "tally", "who"):
                answer(os.path.join(control, base), verb)
                os.unlink(os.path.join(control, name))
                open(os.path.join(control, base + ".done"), "w").close()
        time.sleep(0.05)

threading.Thread(target=watch, daemon=True).start()
from proxy.cli import main
sys.exit(main(sys.argv[1:]))
"""


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("no VmRSS")


def build(model: str, max_tokens: int) -> bytes:
    body = b'{"model":"%s","messages":[{"role":"user","content":"hi"}],"max_tokens":%d,"stream":true}' % (
        model.encode(),
        max_tokens,
    )
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


class Stream(asyncio.Protocol):
    """One client connection: writes the request, reads (and drops) the answer, notes its first
    content and its end (the chunked terminator)."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.started, self.ended = asyncio.Event(), asyncio.Event()
        self.tail = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        seen = self.tail + data
        if b'"content"' in seen:
            self.started.set()
        if b"\r\n0\r\n\r\n" in seen:
            self.ended.set()
        self.tail = seen[-64:]

    def connection_lost(self, exc: Exception | None) -> None:
        self.started.set()
        self.ended.set()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def open_streams(port: int, count: int, request: bytes) -> list[Stream]:
    loop = asyncio.get_running_loop()
    streams = []
    for _ in range(count):
        _, stream = await loop.create_connection(lambda: Stream(request), "127.0.0.1", port)
        streams.append(stream)
    return streams


class Control:
    """The proxy wrapper's control directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._n = 0

    async def ask(self, verb: str, text: str = "") -> Path:
        """Ask for `verb`; returns the answer's path stem (its result files are beside it)."""
        self._n += 1
        base = self.path / f"q{self._n}"
        if text:
            base.with_suffix(".sites").write_text(text)
        base.with_suffix(".tmp").write_text("")
        base.with_suffix(".tmp").rename(base.with_suffix(f".{verb}"))
        deadline = time.monotonic() + 300
        while not base.with_suffix(".done").exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"the proxy did not answer {verb}")
            await asyncio.sleep(0.05)
        return base

    async def snapshot(self) -> tracemalloc.Snapshot | None:
        path = (await self.ask("snap")).with_suffix(".snapshot")
        return tracemalloc.Snapshot.load(str(path)) if path.exists() else None


def _site(trace: tracemalloc.Trace) -> str:
    """Where a block was made: its line, and the innermost line of the proxy's own code that led there."""
    frames = list(reversed(trace.traceback))  # (the most recent first)
    here = f"{frames[0].filename.split('/')[-1]}:{frames[0].lineno}"
    for frame in frames:
        if "/proxy/" in frame.filename:
            mine = f"{frame.filename.split('/proxy/')[-1]}:{frame.lineno}"
            return mine if frame is frames[0] else f"{here} <- {mine}"
    return here


def report(title: str, before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, streams: int, top: int) -> None:
    sizes: dict[str, list[int]] = {}
    for snap, sign in ((after, 1), (before, -1)):
        for trace in snap.traces:
            entry = sizes.setdefault(_site(trace), [0, 0])
            entry[0] += sign * trace.size
            entry[1] += sign
    total = sum(size for size, _ in sizes.values())
    blocks = sum(count for _, count in sizes.values())
    print(f"tracemalloc, {title}: {total / streams:,.0f} B per stream in {blocks / streams:.1f} blocks")
    for site, (size, count) in sorted(sizes.items(), key=lambda kv: -kv[1][0])[:top]:
        if size <= 0:
            break
        print(f"{size / streams:8.0f} B {count / streams:6.2f} blk  {site}")


async def measure(args: argparse.Namespace, pid: int, port: int, control: Control) -> None:
    request, warm_request = build(args.model, args.max_tokens), build(args.warm_model, args.max_tokens)
    for _ in range(2):  # warm-up: lazy imports and caches in, the pools at their size
        warm = await open_streams(port, args.warm, warm_request)
        await asyncio.gather(*(s.ended.wait() for s in warm))
        for stream in warm:
            stream.close()
        await asyncio.sleep(1.0)
    before_snap = await control.snapshot()
    if args.cycles:
        await control.ask("cycles")
    before = rss(pid)
    streams = await open_streams(port, args.streams, request)
    await asyncio.gather(*(s.started.wait() for s in streams))
    await asyncio.sleep(0.5)
    held = rss(pid)
    early = any(s.ended.is_set() for s in streams)
    held_snap = await control.snapshot()
    if args.who:
        holders = (await control.ask("who", " ".join(args.who))).with_suffix(".holders")
        print("who holds them (site, type, holder):\n" + holders.read_text())
    await asyncio.gather(*(s.ended.wait() for s in streams))
    for stream in streams:
        stream.close()
    await asyncio.sleep(1.0)
    after = rss(pid)
    print(f"{args.streams} streams ({args.model}, {args.max_tokens} tokens)"
          + (" [some ended before the measure: use a slower model]" if early else ""))  # fmt: skip
    print(f"RSS before {before / 1024:,.0f} KiB, held {held / 1024:,.0f} KiB, after {after / 1024:,.0f} KiB")
    print(f"RSS: {(held - before) / args.streams / 1024:.1f} KiB per held stream")
    if args.cycles:
        types = (await control.ask("tally")).with_suffix(".types").read_text()
        print("cyclic garbage of the held streams (count, type):\n" + (types or "none\n"))
    after_snap = await control.snapshot()
    if before_snap is not None and held_snap is not None and after_snap is not None:
        report("held", before_snap, held_snap, args.streams, args.top)
        report("kept after the streams ended and their connections closed", before_snap, after_snap,
               args.streams, args.top)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--model", default="fast-200ms", help="the held streams' (its pace)")
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--warm-model", default="fast", help="the warm-up's (default: no delay)")
    parser.add_argument("--warm", type=int, default=8, help="streams of the warm-up, run twice")
    parser.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--who", action="append", default=[], metavar="FILE:LINE",
                        help="with --tracemalloc: which objects hold the blocks made there")  # fmt: skip
    parser.add_argument("--cycles", action="store_true", help="count what the cyclic GC collects of the streams")
    parser.add_argument("--pythonpath", default=str(ROOT))
    parser.add_argument("serve_args", nargs="*")
    args = parser.parse_args()
    upstream_port, port, admin = free_port(), free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=args.pythonpath)
    fake = [sys.executable, "-m", "proxy", "fake-upstream", "--fast", "--port", str(upstream_port)]
    with tempfile.TemporaryDirectory() as control_dir, running(fake, upstream_port, env):
        env.update(SW_MEM_CONTROL=control_dir, SW_MEM_FRAMES=str(args.tracemalloc))
        serve = [sys.executable, "-c", _WRAPPER, "serve", "--upstream", f"http://127.0.0.1:{upstream_port}",
                 "--host", "127.0.0.1", "--port", str(port), "--admin-port", str(admin), *args.serve_args]  # fmt: skip
        with running(serve, port, env) as proxy:
            asyncio.run(measure(args, proxy.pid, port, Control(Path(control_dir))))


if __name__ == "__main__":
    main()
