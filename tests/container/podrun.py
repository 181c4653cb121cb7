"""A pod on Docker for the container tier: one network namespace that the pod's containers share, the
sidecar run with the `docker run` options the rendered manifest gives (support/pod.py), and a client
that reaches the pod's ports from inside that namespace.

The namespace belongs to a small holder container (`--network none`: only loopback, as a pod's own
localhost), and every container of the pod joins it with `--network container:HOLDER`. A backend that
runs as a host process (vLLM) is started in it with `nsenter --net`. The test's own connections are
made in it too: a short-lived thread enters the namespace (setns(2), root only) and opens the socket,
which the test then uses from anywhere. So the pod listens on the manifest's own ports (8080, 9464,
the backend on 8000) without taking a port of the machine, and nothing leaves loopback.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from support.pod import Container, docker_run_options

from proxy import __version__

ROOT = Path(__file__).resolve().parents[2]
# What `make test-container` builds (make image); STREAMWARDEN_IMAGE names another.
IMAGE = os.environ.get("STREAMWARDEN_IMAGE", f"streamwarden:{__version__}")
DOCKER = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else (shutil.which("docker") or "docker")
_CLONE_NEWNET = 0x40000000
_T = TypeVar("_T")


def required() -> bool:
    """CI (CI=true) runs the tier and never skips it."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])}... exited {done.returncode}: {done.stderr.strip()}")
    return done


def inspect(name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = json.loads(docker("inspect", name).stdout)
    return found[0]


def in_netns(netns: str, work: Callable[[], _T], timeout: float = 30) -> _T:
    """`work()` run by a thread that has entered the network namespace at path `netns`."""
    libc = ctypes.CDLL(None, use_errno=True)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            with open(netns) as handle:
                if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns({netns}): {os.strerror(errno)}")
            box["value"] = work()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"work in {netns} took more than {timeout} s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


@dataclass
class Pod:
    """One pod's namespace and the containers started in it (removed by `close`)."""

    image: str
    name: str = field(default_factory=lambda: f"sw-pod-{uuid.uuid4().hex[:8]}")
    containers: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    netns: str = ""

    def start(self) -> Pod:
        # The holder: the image's python waiting for a signal, as unprivileged as the sidecar.
        docker("run", "-d", "--name", self.name, "--network=none", "--read-only", "--cap-drop=ALL",
               "--user=10001:10001", "--entrypoint=python", self.image, "-c", "import signal; signal.pause()")
        self.containers.append(self.name)
        self.netns = f"/proc/{inspect(self.name)['State']['Pid']}/ns/net"
        return self

    def run(self, suffix: str, options: list[str], argv: list[str], image: str | None = None) -> str:
        """A container of the pod (in its namespace), detached; returns its name."""
        name = f"{self.name}-{suffix}"
        docker("run", "-d", "--name", name, *options, image or self.image, *argv)
        self.containers.append(name)
        return name

    def run_fake(self, *fake_args: str) -> str:
        """The image's own fake backend on the pod's 127.0.0.1:8000, where the manifest's upstream is."""
        return self.run("fake", [f"--network=container:{self.name}", "--read-only", "--cap-drop=ALL",
                                 "--user=10001:10001"],
                        ["fake-upstream", "--host", "127.0.0.1", "--port", "8000", *fake_args])

    def run_sidecar(self, spec: Container, *, suffix: str = "proxy", env: dict[str, str] | None = None) -> str:
        """The sidecar, with the options the manifest gives (plus `env`, for what a test sets itself)."""
        options = docker_run_options(spec, network=f"container:{self.name}")
        options += [f"--env={key}={value}" for key, value in (env or {}).items()]
        return self.run(suffix, options, spec.argv())

    def spawn(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A host process (a backend) in the pod's namespace, in a session of its own; killed by `close`."""
        with log.open("wb") as sink:
            process = subprocess.Popen(["nsenter", f"--net={self.netns}", "--", *argv], stdout=sink,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                       start_new_session=True)
        self.processes.append(process)
        return process

    def connect(self, port: int, timeout: float = 30) -> socket.socket:
        """A TCP connection to the pod's 127.0.0.1:port, made from inside its namespace."""
        return in_netns(self.netns, lambda: socket.create_connection(("127.0.0.1", port), timeout=timeout))

    def sockets(self, port: int, count: int) -> list[socket.socket]:
        return in_netns(self.netns, lambda: [socket.create_connection(("127.0.0.1", port), timeout=30)
                                             for _ in range(count)], timeout=120)

    def request(self, port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                timeout: float = 30) -> http.client.HTTPResponse:
        """One request on a new connection in the namespace; the response is left unread (stream it)."""
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.sock = self.connect(port, timeout)
        data = json.dumps(body).encode() if body is not None else None
        # Connection: close, so that the response owns the socket and closing it closes the connection.
        conn.request(method, path, body=data,
                     headers={"Content-Type": "application/json", "Connection": "close", **(headers or {})})
        return conn.getresponse()

    def get(self, port: int, path: str, timeout: float = 10) -> tuple[int, bytes]:
        """Status and body, or (0, b"") when nothing answers (a probe that fails to connect)."""
        try:
            with contextlib.closing(self.request(port, "GET", path, timeout=timeout)) as resp:
                return resp.status, resp.read()
        except OSError:
            return 0, b""

    def wait_for(self, port: int, path: str, status: int, within: float) -> float:
        """Poll a path until it answers `status`; returns the seconds it took (fails after `within`)."""
        start = time.monotonic()
        last: tuple[int, bytes] = (0, b"")
        while time.monotonic() - start < within:
            last = self.get(port, path)
            if last[0] == status:
                return time.monotonic() - start
            time.sleep(0.2)
        raise AssertionError(f"{path} on :{port} did not answer {status} within {within} s: last {last}")

    def logs(self, name: str) -> str:
        done = docker("logs", name, check=False)
        return done.stdout + done.stderr

    def close(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, 9)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
        for name in reversed(self.containers):
            docker("rm", "-f", "-v", name, check=False)


def sse_lines(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    """The response's lines as they arrive, until the body ends."""
    while True:
        line = resp.readline()
        if not line:
            return
        yield line.rstrip(b"\r\n")
