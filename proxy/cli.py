"""`streamwarden` / `python -m proxy`: dispatch the subcommands."""

from __future__ import annotations

import argparse
import difflib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from proxy import __version__
from proxy.config import ConfigError, add_serve_parser, config_from_args

__all__ = ["build_parser", "compiled", "main", "version_line"]

# A module an exchange runs through: the compiled build (scripts/mypyc_build.py, the image) shadows it
# with an extension module beside its source.
_COMPILED_PROBE = "proxy.exchange.handler"


def compiled() -> bool:
    """Whether the mypyc-compiled build runs: the module that Python would import is an extension."""
    spec = importlib.util.find_spec(_COMPILED_PROBE)
    origin = spec.origin if spec is not None else None
    return origin is not None and origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def version_line() -> str:
    """`streamwarden --version`: the version and whether the compiled build runs (as `black --version`)."""
    return f"streamwarden {__version__} (compiled: {'yes' if compiled() else 'no'})"


class _VersionAction(argparse.Action):
    """argparse's `version` action, with the line made only when asked for (it looks for the build)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: `serve`, `fake-upstream`, `demo`, `bench`, `check`."""
    parser = argparse.ArgumentParser(prog="streamwarden", description="LLM streaming sidecar proxy")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the version and whether the compiled build runs, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(sub)
    fake = sub.add_parser(
        "fake-upstream", help="the fault-injecting OpenAI-compatible fake backend",
        description="The fault-injecting OpenAI-compatible fake backend. Pick a fault per request with the header "
        "`x-fault: NAME` (parameters: `x-fault: cut;after=5`) or the model name `fault/NAME`.",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the scenario list keeps its lines
    )
    fake.add_argument("--host", metavar="HOST", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    fake.add_argument("--port", metavar="PORT", type=int, default=8000, help="port to listen on (default 8000)")
    fake.add_argument("--token-rate", metavar="N", type=float, default=20.0,
                      help="content events per second (default 20; 0: no delay)")
    fake.add_argument("--quirk", metavar="NAME", action="append",
                      help="a backend quirk shown on every request, one at a time (listed below)")
    fake.add_argument("--no-tokenize", action="store_true",
                      help="no POST /tokenize (a backend without a tokenizer: --resume-on-cut then refuses "
                           "where a stream does not count its tokens)")
    fake.add_argument("--fast", action="store_true",
                      help="the raw-asyncio chat backend of `bench` (pace from the model name: fast-20ms)")
    demo = sub.add_parser("demo", help="fake upstream + proxy + a guided tour, then exit")
    demo.add_argument("--keep-running", action="store_true", help="leave both servers up afterwards")
    bench = sub.add_parser("bench", help="cost and latency: direct vs nginx vs streamwarden")
    from proxy.tools.bench.run import add_arguments as add_bench_arguments  # a tool: loaded only here

    add_bench_arguments(bench)
    from proxy.tools.check.options import add_arguments as add_check_arguments  # the arguments only

    add_check_arguments(sub.add_parser("check", help="probe a backend: its failure modes and the flags it needs"))
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise KeyError(name)


def _fail(command: str, message: str) -> int:
    """A value error: one line naming the flag (no usage block: it would bury the line), exit 2."""
    print(f"streamwarden {command}: error: {message}", file=sys.stderr)
    return 2


def _unrecognized(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> int:
    """Arguments no flag takes: one line, naming the closest flag when the first unknown one is a typo."""
    where = _subparser(parser, command) if command else parser
    known = [option for action in where._actions for option in action.option_strings]
    flags = [arg.split("=", 1)[0] for arg in extra if arg.startswith("--")]
    close = difflib.get_close_matches(flags[0], known, n=1, cutoff=0.75) if flags else []
    hint = f"; did you mean {close[0]}?" if close else f" (streamwarden {command} --help lists the flags)"
    noun = "argument" if len(extra) == 1 else "arguments"
    return _fail(command or "", f"unrecognized {noun}: {' '.join(extra)}{hint}")


def _needs_extra(exc: ModuleNotFoundError, extra: str, modules: set[str]) -> int:
    """One line naming the extra that brings a missing optional dependency, exit 2; anything else is a bug."""
    if (exc.name or "").partition(".")[0] not in modules:
        raise exc
    print(f"streamwarden {extra}: needs the {exc.name!r} package: pip install 'streamwarden[{extra}]'", file=sys.stderr)
    return 2


def _list_scenarios(fake: argparse.ArgumentParser) -> None:
    """`fake-upstream --help` lists every scenario and quirk, from the registries the fake answers with."""
    from proxy.tools.fake import describe
    from proxy.tools.fake.quirks import QUIRKS

    rows = describe()
    width = max(len(row.name) for row in rows)
    lines = [f"  {row.name:<{width}}  {row.summary}" for row in rows]
    quirks = [f"  {name:<{width}}  {text}" for name, text in QUIRKS.items()]
    fake.epilog = ("scenarios (details: docs/fake-upstream.md):\n" + "\n".join(lines)
                   + "\n\nquirks (--quirk NAME, one at a time):\n" + "\n".join(quirks))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    if "fake-upstream" in (sys.argv[1:] if argv is None else argv):
        _list_scenarios(_subparser(parser, "fake-upstream"))
    args, extra = parser.parse_known_args(argv)
    if extra:
        return _unrecognized(parser, args.command, extra)
    if args.command == "serve":
        try:
            config = config_from_args(args)
        except ConfigError as exc:
            return _fail("serve", str(exc))
        from proxy.server.serve import StartupError, serve
        from proxy.workers.cpus import resolve_workers

        config = resolve_workers(config)
        try:
            if config.workers > 1:
                from proxy.workers.supervisor import supervise

                return supervise(config)
            serve(config)
        except StartupError as exc:
            print(f"streamwarden serve: {exc}", file=sys.stderr)  # one line, no traceback
            return 2
        return 0
    if args.command == "fake-upstream":
        if args.fast and args.quirk:
            _subparser(parser, "fake-upstream").error("--quirk does not apply to --fast")
        quirks = args.quirk or []
        if len(quirks) > 1:  # the last one silently won: each quirk is one backend's whole behaviour
            _subparser(parser, "fake-upstream").error(
                f"--quirk: one quirk at a time (each is a whole backend's behaviour), got {', '.join(quirks)}"
            )
        quirk = quirks[0] if quirks else None
        try:
            if args.fast:
                from proxy.tools.fake.fast import main as run_fast

                run_fast(args.host, args.port)
                return 0
            from proxy.tools.fake import FakeSettings, run

            try:
                settings = FakeSettings(token_rate=args.token_rate, quirk=quirk, tokenize=not args.no_tokenize)
            except ValueError as exc:
                _subparser(parser, "fake-upstream").error(str(exc))
            run(args.host, args.port, settings)
        except OSError as exc:  # the port is in use (or the host is not this machine's)
            print(f"streamwarden fake-upstream: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 2
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
            return _fail("bench", str(exc))
        return run_bench(options)
    if args.command == "check":
        from proxy.tools.check.options import options_from_args as check_options
        from proxy.tools.check.run import main as run_check

        try:
            return run_check(check_options(args))
        except ValueError as exc:
            return _fail("check", str(exc))
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
