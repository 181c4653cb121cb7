"""The container image's HEALTHCHECK: `GET /healthz` on the admin port the running proxy really uses.

Docker runs the check beside the proxy, so an environment variable alone cannot tell it the port: the
port may come from `--admin-port` in the container's command. The check therefore reads the proxy's own
command line and environment from `/proc/<pid>` (PID 1 in a container) and resolves them with the proxy's
own parser, so a flag beats the variable exactly as it does for `serve`.

The process is found by its command line, not assumed to be PID 1 (an init, `docker run --init`, or a
shell, `sh -c "streamwarden serve ..."`, may stand in front of it), and then proven: it must hold the
listening socket of the admin port its command line names. A command line alone can be anyone's (a
wrapper, an editor, a `grep streamwarden serve`).

The request goes straight to the port: Docker's client `proxies` setting puts HTTP_PROXY into every
container, and a proxy must neither fail a healthy streamwarden nor pass a stopped one.

Usage: `python -m proxy.healthcheck [PID]`; exit 0 healthy, 1 not (Docker's contract).
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from proxy.config import ConfigError, config_from_args, serve_parser

__all__ = ["admin_url", "find_serve", "is_serve", "main"]

_ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column
# No ProxyHandler entries: the environment's HTTP_PROXY / NO_PROXY are never consulted.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def is_serve(argv: Sequence[str]) -> bool:
    """`[python] .../streamwarden serve ...` or `python -m proxy serve ...`, whatever runs in front."""
    if "serve" not in argv:
        return False
    before = list(argv[: list(argv).index("serve")])
    return any(Path(arg).name == "streamwarden" for arg in before) or before[-2:] == ["-m", "proxy"]


def _is_streamwarden(argv: Sequence[str]) -> bool:
    return any(Path(arg).name == "streamwarden" for arg in argv) or "proxy" in argv


def admin_url(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The `/healthz` URL of a process started with `argv` and `environ`; None when it is not `serve`.

    `argv` is the whole command line (`python .../streamwarden serve ...`, `python -m proxy serve ...`).
    Raises ConfigError when `serve`'s flags are unusable (that proxy could not have started).
    """
    if not is_serve(argv):
        return None
    try:
        args, _ = serve_parser().parse_known_args(list(argv[list(argv).index("serve") :]))
    except SystemExit:  # argparse has printed why
        raise ConfigError("the proxy's command line does not parse") from None
    config = config_from_args(args, environ)
    host = _ANY_ADDRESS.get(config.admin_listen_host, config.admin_listen_host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.admin_port}/healthz"


def _read_proc(pid: int) -> tuple[list[str], dict[str, str]]:
    """A process's argv and environment; bytes that are not UTF-8 are kept as surrogate escapes."""
    proc = Path("/proc") / str(pid)
    argv = [os.fsdecode(part) for part in proc.joinpath("cmdline").read_bytes().split(b"\0") if part]
    environ: dict[str, str] = {}
    for entry in proc.joinpath("environ").read_bytes().split(b"\0"):
        name, sep, value = os.fsdecode(entry).partition("=")
        if sep:
            environ[name] = value
    return argv, environ


def _cmdline(pid: int) -> list[str]:
    try:
        return [os.fsdecode(part) for part in (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0") if part]
    except OSError:  # gone meanwhile, or not ours to read
        return []


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP `port` in this network namespace (IPv4 and IPv6)."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path("/proc/net", table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rpartition(":")[2], 16) == port:
                inodes.add(fields[9])
    return inodes


def holds_listener(pid: int, port: int) -> bool:
    """Whether process `pid` has a socket listening on `port` among its open files."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not wanted:
        return False
    fds = Path("/proc") / str(pid) / "fd"
    try:
        entries = list(fds.iterdir())
    except OSError:
        return False
    for entry in entries:
        try:
            if os.readlink(entry) in wanted:
                return True
        except OSError:  # closed meanwhile
            continue
    return False


def _proven_url(pid: int) -> str | None:
    """The `/healthz` URL of `pid` when it is `serve` and really holds that admin port; else None."""
    try:
        url = admin_url(*_read_proc(pid))
    except (OSError, ValueError, ConfigError):  # gone, unreadable, or flags it could not have started with
        return None
    port = urlsplit(url).port if url is not None else None
    return url if port is not None and holds_listener(pid, port) else None


def find_serve(pids: Iterable[int] | None = None) -> tuple[int, str] | None:
    """The first of `pids` (every process, lowest first, by default) that is `serve` holding its admin port."""
    if pids is None:
        pids = sorted(int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit())
    for pid in pids:
        if pid != os.getpid() and is_serve(_cmdline(pid)):
            url = _proven_url(pid)
            if url is not None:
                return pid, url
    return None


def check(url: str) -> bool:
    """`GET url` on a direct connection (no proxy from the environment); healthy on 200 only."""
    try:
        with _DIRECT.open(url, timeout=2) as resp:  # a non-2xx raises HTTPError (an OSError)
            return bool(resp.status == 200)
    except (OSError, ValueError) as exc:
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return False


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args:  # the operator named the process: its command line is trusted as it is
        try:
            url = admin_url(*_read_proc(int(args[0])))
        except (OSError, ValueError, ConfigError) as exc:
            print(f"healthcheck: {exc}", file=sys.stderr)
            return 1
        if url is None:
            print(f"healthcheck: process {args[0]} is not `streamwarden serve`: nothing to check")
            return 0
        return 0 if check(url) else 1
    found = find_serve()
    if found is None:
        if _is_streamwarden(_cmdline(1)) and not is_serve(_cmdline(1)):  # e.g. `docker run IMAGE fake-upstream`
            print("healthcheck: the container does not run `streamwarden serve`: nothing to check")
            return 0
        print("healthcheck: no `streamwarden serve` process holds its admin port", file=sys.stderr)
        return 1
    return 0 if check(found[1]) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
