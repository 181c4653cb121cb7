"""The container image's HEALTHCHECK: `GET /healthz` on the admin port the running proxy really uses.

Docker runs the check beside the proxy, so an environment variable alone cannot tell it the port: the
port may come from `--admin-port` in the container's command. The check therefore reads the proxy's own
command line and environment from `/proc/<pid>` (PID 1 in a container) and resolves them with the proxy's
own parser, so a flag beats the variable exactly as it does for `serve`.

The process is found by its command line, not assumed to be PID 1: an init (`docker run --init`) or a
shell (`sh -c "streamwarden serve ..."`) may stand in front of it.

Usage: `python -m proxy.healthcheck [PID]`; exit 0 healthy, 1 not (Docker's contract).
"""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from proxy.config import ConfigError, config_from_args, serve_parser

__all__ = ["admin_url", "is_serve", "main"]

_ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


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
    proc = Path("/proc") / str(pid)
    argv = [part.decode() for part in proc.joinpath("cmdline").read_bytes().split(b"\0") if part]
    environ: dict[str, str] = {}
    for entry in proc.joinpath("environ").read_bytes().split(b"\0"):
        name, sep, value = entry.decode(errors="replace").partition("=")
        if sep:
            environ[name] = value
    return argv, environ


def _cmdline(pid: int) -> list[str]:
    try:
        return _read_proc(pid)[0]
    except OSError:  # gone meanwhile, or not ours to read
        return []


def _serve_pid() -> int | None:
    """The lowest PID in this PID namespace (a container's) that runs `streamwarden serve`."""
    pids = sorted(int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit())
    return next((pid for pid in pids if is_serve(_cmdline(pid))), None)


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    pid = int(args[0]) if args else _serve_pid()
    try:
        if pid is None:
            if _is_streamwarden(_cmdline(1)):  # e.g. `docker run IMAGE fake-upstream`: no admin port
                print("healthcheck: the container does not run `streamwarden serve`: nothing to check")
                return 0
            print("healthcheck: no `streamwarden serve` process is running", file=sys.stderr)
            return 1
        url = admin_url(*_read_proc(pid))
        if url is None:
            print(f"healthcheck: process {pid} is not `streamwarden serve`: nothing to check")
            return 0
        with urllib.request.urlopen(url, timeout=2) as resp:  # a non-2xx raises HTTPError
            return 0 if resp.status == 200 else 1
    except (OSError, ValueError, ConfigError) as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
