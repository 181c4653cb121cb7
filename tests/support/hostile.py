"""Test parts for attacks on the shell: `streamwarden serve` as a real process, a raw-socket upstream
that misbehaves where aiohttp would refuse to, and raw-socket clients.

The proxy process is started with `subprocess.Popen` (not asyncio's) so that one process can serve a
whole module; a thread collects its JSON log lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from support.ports import free_port

PY = sys.executable
WAIT = 20.0  # the bound of every wait below: only a bug (or a dead machine) gets near it
_PORT_RACES = 3  # starts of `serve` tried, each on new free ports


def _wait_listening(port: int, proc: subprocess.Popen[bytes], host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + WAIT
    while True:
        assert proc.poll() is None, "the process exited early"
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class ServeProcess:
    """`streamwarden serve` on free loopback ports, its log lines collected as they are written.

    `serve` takes no port 0, so the ports are picked free beforehand; another program on the machine may
    take one in between. Such a start ends with "address already in use" and is made again on new ports.
    """

    def __init__(
        self, upstream: str, *flags: str, nofile: int | None = None, admin_host: str | None = None,
        env: dict[str, str] | None = None,
    ):
        self.admin_host = admin_host or "127.0.0.1"
        self._upstream, self._flags, self._nofile = upstream, flags, nofile
        self._env = {**{k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_")}, **(env or {})}
        for attempt in range(_PORT_RACES):
            self._spawn()
            if self._came_up() or attempt == _PORT_RACES - 1 or "address already in use" not in self.stderr_text():
                break
            self.stop()
        _wait_listening(self.port, self.proc)
        _wait_listening(self.admin_port, self.proc, self.admin_host)

    def _spawn(self) -> None:
        self.port, self.admin_port = free_port(), free_port()
        # --health-interval 0 unless a test gives it (a later flag wins): no probe at start or while idle,
        # so a raw upstream sees only the connections the test's requests make
        argv = [PY, "-m", "proxy", "serve", "--upstream", self._upstream, "--host", "127.0.0.1",
                "--port", str(self.port), "--admin-port", str(self.admin_port), "--health-interval", "0",
                *self._flags]
        nofile = self._nofile

        def limit_fds() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(argv, env=self._env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     preexec_fn=limit_fds)
        self.raw_stderr: list[bytes] = []
        self._lines: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _came_up(self) -> bool:
        """Wait for the `started` line (written once both ports are bound: by this process, not another),
        or for the process to end."""
        deadline = time.monotonic() + WAIT
        while not self.lines("started"):
            if self.proc.poll() is not None:
                self._reader.join(timeout=WAIT)  # all it wrote, for the caller to read
                return bool(self.lines("started"))
            assert time.monotonic() < deadline, "no `started` line"
            time.sleep(0.02)
        return True

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            with self._lock:
                self.raw_stderr.append(raw)
                with contextlib.suppress(orjson.JSONDecodeError):
                    self._lines.append(orjson.loads(raw))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin_host}:{self.admin_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def lines(self, event: str = "request") -> list[dict[str, Any]]:
        with self._lock:
            return [line for line in self._lines if line.get("event") == event]

    def stderr_text(self) -> str:
        with self._lock:
            return b"".join(self.raw_stderr).decode("utf-8", "replace")

    async def line(self, predicate: Callable[[dict[str, Any]], bool], event: str = "request") -> dict[str, Any]:
        """The first log line that matches, waited for (bounded)."""
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [line for line in self.lines(event) if predicate(line)]
            return bool(found)

        await until(seen)
        return found[0]

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def memory(self, field_name: str = "VmRSS") -> int:
        """Bytes of resident memory (VmRSS) or its peak (VmHWM)."""
        with open(f"/proc/{self.pid}/status") as status:
            for row in status:
                if row.startswith(field_name + ":"):
                    return int(row.split()[1]) * 1024
        raise AssertionError(field_name)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=WAIT)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


class FakeProcess:
    """The built-in fake upstream as its own process (so the proxy's memory is measured alone)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [PY, "-m", "proxy", "fake-upstream", "--port", str(self.port), "--token-rate", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_listening(self.port, self.proc)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


async def until(predicate: Callable[[], bool], within: float = WAIT) -> None:
    """Poll state that no event announces (another process, the kernel's fd table), bounded."""
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - nothing to wait on but the state itself
            await asyncio.sleep(0.02)


# ---- a raw-socket upstream ---------------------------------------------------------------------


@dataclass
class Request:
    head: bytes
    body: bytes

    @property
    def target(self) -> bytes:
        return self.head.split(b" ", 2)[1]

    def header(self, name: bytes) -> bytes | None:
        for line in self.head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """One request (a Content-Length body only: the proxy sends whole bodies); None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    request = Request(head, b"")
    length = request.header(b"content-length")
    if length:
        request.body = await reader.readexactly(int(length))
    return request


Script = Callable[["Connection"], Awaitable[None]]


@dataclass
class Connection:
    """One upstream connection as the raw upstream sees it."""

    number: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    requests: list[Request] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def next_request(self) -> Request | None:
        request = await read_request(self.reader)
        if request is not None:
            self.requests.append(request)
        return request

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def wait_closed_by_peer(self) -> None:
        """Until the proxy closes this connection (reads return EOF)."""
        while await self.reader.read(65536):
            pass


class RawUpstream:
    """An upstream on a raw socket, running `script` for every connection it accepts."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections: list[Connection] = []
        self.accepted = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = Connection(len(self.connections) + 1, reader, writer)
        self.connections.append(connection)
        self.accepted.set()
        try:
            await self.script(connection)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            connection.closed.set()
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for connection in self.connections:
                connection.writer.close()
            await self._server.wait_closed()


def response(status: int, body: bytes, content_type: bytes = b"application/json", extra: bytes = b"") -> bytes:
    reason = {200: b"OK", 101: b"Switching Protocols"}.get(status, b"Whatever")
    return (b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n"
            % (status, reason, content_type, len(body), extra)) + body


MiB = 1024 * 1024
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def chat_json(content: str = "hi") -> bytes:
    """A whole chat completion, as a raw upstream answers it."""
    return orjson.dumps({"id": "x", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]})


# ---- raw-socket clients ----------------------------------------------------------------------


async def exchange_raw(port: int, data: bytes, *, within: float = WAIT) -> bytes:
    """Send `data`, read until the proxy closes the connection; returns everything it sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(within):
            return await reader.read(-1)
    finally:
        writer.close()


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def body_of(raw: bytes) -> Any:
    return orjson.loads(raw.split(b"\r\n\r\n", 1)[1])
