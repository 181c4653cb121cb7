"""`make run`: streamwarden in front of UPSTREAM, or of the built-in fake upstream when none is given.

Standard library only, run by the project's virtualenv. It owns what it starts: the fake must be its
own (a port already in use stops the run with one line, instead of a proxy in front of a stranger),
the banner comes only once the proxy answers, and when `make` goes away (killed, its terminal closed)
or SIGTERM/SIGHUP arrives, the proxy drains and both children stop, so no port stays held.
Ctrl-C reaches the proxy itself (same process group): it drains, and a second Ctrl-C stops it at once.
The fake runs in its own session so that it serves the proxy's drain to the end.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import FrameType

WAIT_SECONDS = 30.0  # for a child to come up on a slow machine; only a broken start gets near it
STOP_SECONDS = 45.0  # the proxy's drain (30 s) and its exit
MODELS_SECONDS = 3.0  # for UPSTREAM's GET /v1/models, read once for the hints


def main() -> int:
    env = os.environ
    port, admin_port, fake_port = int(env["PORT"]), int(env["ADMIN_PORT"]), int(env["FAKE_PORT"])
    bin_dir, upstream = env["BIN"], env.get("UPSTREAM", "")
    parent = os.getppid()
    children: list[subprocess.Popen[bytes]] = []
    stopping: list[int] = []

    def on_signal(signum: int, _: FrameType | None) -> None:
        stopping.append(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    # Ctrl-C reaches the proxy too and is its to handle (it drains); a handler, unlike SIG_IGN, is not
    # inherited by the children. Before the proxy runs, it stops the start.
    signal.signal(signal.SIGINT, on_signal)
    try:
        ports = [("PORT", port), ("ADMIN_PORT", admin_port)] + ([] if upstream else [("FAKE_PORT", fake_port)])
        busy = [(name, number) for name, number in ports if not _free(number)]
        if busy:
            taken = {number for _, number in ports}
            shown = ", ".join(f"{name}={number}" for name, number in busy)
            hint = " ".join(f"{name}={_free_near(number, taken)}" for name, number in busy)
            print(f"make run: in use: {shown}; pick others, e.g. make run {hint}", file=sys.stderr)
            return 2
        own_upstream = bool(upstream)
        if not upstream:
            upstream = f"http://127.0.0.1:{fake_port}"
            fake = subprocess.Popen(
                [f"{bin_dir}/streamwarden", "fake-upstream", "--port", str(fake_port)],
                stdout=subprocess.PIPE, start_new_session=True,
            )
            children.append(fake)
            if not _announced(fake) or stopping:
                print(f"make run: the fake upstream did not start on port {fake_port}", file=sys.stderr)
                return 2
            print(f"fake upstream: {upstream}  (faults: add the header 'x-fault: NAME'; "
                  f"{bin_dir}/streamwarden fake-upstream --help lists them)")
        proxy = subprocess.Popen(
            [f"{bin_dir}/streamwarden", "serve", "--upstream", upstream, "--host", "127.0.0.1", "--port", str(port),
             "--admin-port", str(admin_port), "--log-format", "console"],
        )
        children.insert(0, proxy)
        if not _healthy(proxy, admin_port):
            return proxy.wait() or 2  # it said why in one line
        if stopping:
            return 128 + stopping[0]
        # From here on a Ctrl-C is the proxy's (it drains); the loop leaves only on another signal. Nothing
        # is cleared: a SIGTERM may come the moment the banner is read.
        print(_banner(port, admin_port, upstream, _upstream_model(upstream) if own_upstream else ("demo", "")),
              flush=True)
        while proxy.poll() is None and os.getppid() == parent:
            if any(signum != signal.SIGINT for signum in stopping):
                break
            time.sleep(0.2)
        return proxy.returncode if proxy.poll() is not None else 128 + signal.SIGTERM
    finally:
        _stop(children)


def _free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_near(port: int, taken: set[int]) -> int:
    """A free port just above ``port`` for the hint (one the other variables do not name)."""
    for candidate in range(port + 1, min(port + 200, 65536)):
        if candidate not in taken and _free(candidate):
            taken.add(candidate)
            return candidate
    return port + 1


def _announced(fake: subprocess.Popen[bytes]) -> bool:
    """The fake printed its listening line (so the port is its own), or it exited."""
    assert fake.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(fake.stdout, selectors.EVENT_READ)
        if not selector.select(WAIT_SECONDS):
            return False
        line = fake.stdout.readline()
    return b"listening on" in line


def _healthy(proxy: subprocess.Popen[bytes], admin_port: int) -> bool:
    deadline = time.monotonic() + WAIT_SECONDS
    while proxy.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/healthz", timeout=1) as answer:
                if answer.status == 200:
                    return True
        except OSError:
            time.sleep(0.1)
    return False


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    """The proxy first (it drains from the fake), then the fake; each TERM, then KILL if it lingers."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _upstream_model(upstream: str) -> tuple[str, str]:
    """(the first model id the upstream's GET /v1/models lists, "") for the hints, or ("MODEL", why not)."""
    try:
        with urllib.request.urlopen(upstream.rstrip("/") + "/v1/models", timeout=MODELS_SECONDS) as answer:
            data = json.loads(answer.read(1 << 20)).get("data")
    except urllib.error.HTTPError as exc:
        return "MODEL", f"GET /v1/models answered {exc.code}"
    except (OSError, ValueError, AttributeError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return "MODEL", f"GET /v1/models: {getattr(reason, 'strerror', None) or reason}"
    ids = [item["id"] for item in data if isinstance(item, dict) and isinstance(item.get("id"), str)] if isinstance(
        data, list
    ) else []
    return (ids[0], "") if ids else ("MODEL", "GET /v1/models lists no model")


def _banner(port: int, admin_port: int, upstream: str, model: tuple[str, str]) -> str:
    """The hints: for the fake, its model and a fault to try; for UPSTREAM, its own first model (or why
    none could be read: a dead upstream is said here and logged as upstream_down)."""
    name, why_not = model
    body = json.dumps({"model": name, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
                      separators=(",", ":"))
    chat = "'" + body.replace("'", "'\\''") + "'"  # a shell word, whatever the id holds (JSON escapes controls)
    fault = (
        f"  curl -N http://127.0.0.1:{port}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-H 'x-fault: stray_503' \\\n    -d {chat}\n"
        if name == "demo" and not why_not else ""
    )
    down = (
        f"upstream:     {why_not}: requests get an error until it answers (the log says upstream_down/upstream_up)\n"
        if why_not else ""
    )
    return f"""\
streamwarden: http://127.0.0.1:{port}  ->  {upstream}
admin:        http://127.0.0.1:{admin_port}/metrics  /healthz  /readyz
{down}
Try:
  curl -N http://127.0.0.1:{port}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d {chat}
{fault}  export OPENAI_BASE_URL=http://127.0.0.1:{port}/v1 OPENAI_API_KEY=unused
  export ANTHROPIC_BASE_URL=http://127.0.0.1:{port} ANTHROPIC_API_KEY=unused
Stop with Ctrl-C (it drains open streams; Ctrl-C again to stop now)."""


if __name__ == "__main__":
    sys.exit(main())
