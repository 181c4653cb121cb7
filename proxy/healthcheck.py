"""The container image's HEALTHCHECK: `GET /healthz` on the admin port the running proxy really uses.

Docker runs the check beside the proxy, so an environment variable alone cannot tell it the port: the
port may come from `--admin-port` in the container's command. The check therefore reads the proxy's own
command line and environment from `/proc/<pid>` (PID 1 in a container) and resolves them with the proxy's
own parser, so a flag beats the variable exactly as it does for `serve`.

Usage: `python -m proxy.healthcheck [PID]`; exit 0 healthy, 1 not (Docker's contract).
"""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from .config import ConfigError, build_parser, config_from_args

__all__ = ["admin_url", "main"]

_ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def admin_url(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The `/healthz` URL of a process started with `argv` and `environ`; None when it is not `serve`.

    `argv` is the whole command line (`python .../streamwarden serve ...`, `python -m proxy serve ...`).
    Raises ConfigError when `serve`'s flags are unusable (that proxy could not have started).
    """
    if "serve" not in argv:
        return None
    try:
        args, _ = build_parser().parse_known_args(list(argv[list(argv).index("serve") :]))
    except SystemExit:  # argparse has printed why
        raise ConfigError("the proxy's command line does not parse") from None
    config = config_from_args(args, environ)
    host = _ANY_ADDRESS.get(config.host, config.host)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    pid = int(args[0]) if args else 1
    try:
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
