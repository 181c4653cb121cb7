"""`streamwarden` / `python -m proxy`: dispatch the subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from proxy.config import ConfigError, build_parser, config_from_args

__all__ = ["main"]


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise KeyError(name)


def _needs_extra(exc: ModuleNotFoundError, extra: str, modules: set[str]) -> int:
    """One line naming the extra that brings a missing optional dependency, exit 2; anything else is a bug."""
    if (exc.name or "").partition(".")[0] not in modules:
        raise exc
    print(f"streamwarden {extra}: needs the {exc.name!r} package: pip install 'streamwarden[{extra}]'", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            config = config_from_args(args)
        except ConfigError as exc:
            _subparser(parser, "serve").error(str(exc))  # usage line + one line, exit 2
        if config.workers > 1:
            from proxy.workers.supervisor import supervise

            return supervise(config)
        from proxy.server.serve import serve

        serve(config)
        return 0
    if args.command == "fake-upstream":
        if args.fast:
            from proxy.tools.fake.fast import main as run_fast

            run_fast(args.host, args.port)
            return 0
        from proxy.tools.fake import FakeSettings, run

        run(args.host, args.port, FakeSettings(token_rate=args.token_rate))
        return 0
    if args.command == "demo":
        try:
            from proxy.tools.demo import run_demo
        except ModuleNotFoundError as exc:
            return _needs_extra(exc, "demo", {"openai"})
        return run_demo(keep_running=args.keep_running)
    if args.command == "bench":
        from proxy.tools.bench.run import options_from_args, run_bench

        try:
            options = options_from_args(args)
        except ValueError as exc:
            _subparser(parser, "bench").error(str(exc))
        return run_bench(options)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
