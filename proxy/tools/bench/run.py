"""`streamwarden bench`: what the proxy costs, measured the way an operator would, beside nginx.

Scenarios a (32 clients, streams of 100 chunks, no delay), b (N concurrent streams at 20 ms a chunk,
the real LLM shape), c (32 clients, whole bodies), c8 (the peers' figure: CPU per request at 8 clients
by OnTheBench's rule, whole answers and streams), one (one client alone, sequential requests: what the
proxy adds to a whole answer and to a stream's first token) and the abandon test run against the
targets: the upstream itself (direct), nginx (when it is on the PATH; `targets.nginx_config`), the
floor (`floor`, the cheapest Python relay on the proxy's stack), streamwarden at its default flags,
and each `--compare` checkout's streamwarden. The targets alternate inside each round and the figures
are the medians of the rounds. The upstream is the fake's fast mode (`proxy.tools.fake.fast`), a raw-asyncio server
that writes one event per socket write, and the load is a raw-asyncio client (`bench_client`): with
aiohttp on either end, the 2 cores would mostly measure aiohttp.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from yarl import URL

from proxy.tools.bench.cancel import AbandonResult, measure_abandons
from proxy.tools.bench.latency import format_latency_cost, measure_latency_cost
from proxy.tools.bench.load import Scenario, Window, measure
from proxy.tools.bench.report import format_abandons, format_scenario, percentile, summarize
from proxy.tools.bench.targets import Children, Target, source_env

__all__ = ["BenchOptions", "Compared", "add_arguments", "compared", "options_from_args", "run_bench"]

_ABANDON = (300, 20, 100)  # streams, ms per chunk, chunks
_ABANDON_QUICK = (30, 5, 20)
_ALL = ("a", "b", "c", "c8", "one", "abandon")
_LABEL = re.compile(r"^([\w.@+-]+)=(.+)$")


@dataclass(frozen=True)
class Compared:
    """Another checkout's streamwarden, a target beside this one's (`--compare`)."""

    name: str  # the column: streamwarden@<short sha> unless given
    source: Path  # the checkout: its `proxy` package goes first on the import path
    args: tuple[str, ...] = ()  # its own serve flags, after --proxy-arg's


@dataclass(frozen=True)
class BenchOptions:
    upstream: URL | None = None
    rounds: int = 3
    b_streams: tuple[int, ...] = (256,)
    scenarios: tuple[str, ...] = _ALL
    quick: bool = False
    json_path: Path | None = None
    seed: int = 1
    proxy_args: tuple[str, ...] = ()
    compare: tuple[Compared, ...] = ()


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """The `bench` subcommand's flags (called by `config.build_parser`)."""
    bench.add_argument("--upstream", default=None,
                       help="a running backend's root URL: direct vs proxied (default: the built-in fast fake)")
    bench.add_argument("--rounds", type=int, default=None, help="alternated rounds, medians reported (default 3)")
    bench.add_argument("--b-streams", default="256", metavar="N[,N...]",
                       help="concurrent streams of scenario b, e.g. 64,256,512 (default 256)")
    bench.add_argument("--scenarios", default=",".join(_ALL), metavar="LIST",
                       help="which to run, of a, b, c, c8 (the peers' figure), one (one client alone), abandon "
                            "(default: all)")
    bench.add_argument("--quick", action="store_true", help="tiny runs that only show it works (for tests)")
    bench.add_argument("--json", default=None, metavar="PATH", help="also write every figure as JSON to PATH")
    bench.add_argument("--seed", type=int, default=1, help="the abandon test's random plan")
    bench.add_argument("--proxy-arg", action="append", default=[], metavar="ARG",
                       help="an extra `streamwarden serve` flag, e.g. --proxy-arg=--log-level=warning")  # fmt: skip
    bench.add_argument("--compare", action="append", default=[], metavar="'[LABEL=]DIR [FLAG...]'",
                       help="also measure the streamwarden of checkout DIR (pure, or compiled in place), "
                            "with its own extra serve flags, e.g. --compare ../before or "
                            "--compare 'w2=. --workers=2'; repeatable")  # fmt: skip


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """Raises ValueError with a message for the user on any bad flag."""
    upstream = None
    if args.upstream is not None:
        upstream = URL(args.upstream)
        if upstream.scheme not in ("http", "https") or not upstream.host:
            raise ValueError(f"--upstream must be an http:// or https:// URL, got {args.upstream!r}")
        if upstream.path not in ("", "/") or upstream.query_string:
            raise ValueError(f"--upstream is the backend's root URL, without /v1 or any path, got {args.upstream!r}")
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if rounds < 1:
        raise ValueError("--rounds must be at least 1")
    try:
        b_streams = tuple(dict.fromkeys(int(part) for part in args.b_streams.split(",")))  # each once, in order
    except ValueError:
        raise ValueError(f"--b-streams must be numbers separated by commas, got {args.b_streams!r}") from None
    if not b_streams or min(b_streams) < 1 or max(b_streams) > 4096:
        raise ValueError("--b-streams must be from 1 to 4096")
    scenarios = tuple(part.strip() for part in args.scenarios.split(",") if part.strip())
    unknown = [name for name in scenarios if name not in _ALL]
    if unknown or not scenarios:
        raise ValueError(f"--scenarios must be a list of {', '.join(_ALL)}, got {args.scenarios!r}")
    return BenchOptions(upstream, rounds, b_streams, scenarios, args.quick,
                        Path(args.json) if args.json else None, args.seed, tuple(args.proxy_arg),
                        compared(args.compare))  # fmt: skip


def compared(specs: Sequence[str]) -> tuple[Compared, ...]:
    """`--compare` specs to targets: `[LABEL=]DIR [FLAG...]`, DIR a checkout with a `proxy` package."""
    found: list[Compared] = []
    for spec in specs:
        words = shlex.split(spec)
        if not words:
            raise ValueError("--compare needs a checkout's directory")
        label, place = None, words[0]
        match = _LABEL.match(place)
        if match and not Path(place).exists():
            label, place = match.groups()
        source = Path(place).expanduser().resolve()
        if not (source / "proxy" / "__main__.py").is_file():
            raise ValueError(f"--compare: {place} is not a streamwarden checkout (no proxy/__main__.py)")
        name = label or f"streamwarden@{_short_sha(source) or source.name}"
        taken = {"direct", "nginx", "floor", "streamwarden", *(c.name for c in found)}
        while name in taken:
            name += "'"
        found.append(Compared(name, source, tuple(words[1:])))
    return tuple(found)


def _short_sha(source: Path) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=False)  # fmt: skip
    except OSError:
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def build_of(source: Path | None) -> str:
    """What a streamwarden target runs: its `--version` line (which says compiled: yes|no) and where
    its package was imported from, so that a `--compare` checkout is seen to be the one measured."""
    probe = ("import sys, proxy; print(proxy.__path__[0], flush=True); sys.argv = ['streamwarden', '--version']; "
             "import proxy.__main__")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False,
                          env=source_env(source), cwd=source)  # fmt: skip
    lines = done.stdout.strip().splitlines()
    if len(lines) < 2:
        raise RuntimeError(f"streamwarden --version from {source or 'this checkout'} failed: "
                           f"{(done.stderr or done.stdout).strip()[-300:]}")  # fmt: skip
    where = Path(lines[0]).parent
    if source is not None and where.resolve() != source:
        raise RuntimeError(f"--compare {source}: its `proxy` package was imported from {where} instead")
    return f"{lines[-1]} from {where}"


def _scenarios(options: BenchOptions) -> list[Scenario]:
    """The shapes: each target gets the same duration per round, except b: two waves of streams
    at full concurrency (with a duration, a slower target would run its last seconds at less)."""
    quick, found = options.quick, []
    if "a" in options.scenarios:
        clients = 8 if quick else 32
        found.append(Scenario("a", f"a: {clients} clients, streams of 100 chunks, no delay",
                              clients, 0.3 if quick else 2.0, True, 0))  # fmt: skip
    if "b" in options.scenarios:
        # --quick keeps each count apart (64, 256, 512 -> 4, 16, 32), so that each gets its own table.
        counts = dict.fromkeys(max(2, n // 16) if quick else n for n in options.b_streams)
        for streams in counts:
            delay = 2 if quick else 20
            found.append(Scenario(f"b{streams}", f"b: {streams} concurrent streams, {delay} ms per chunk",
                                  streams, 0, True, delay, 20 if quick else 100, requests=2 * streams))  # fmt: skip
    if "c" in options.scenarios:
        clients = 8 if quick else 32
        found.append(Scenario("c", f"c: {clients} clients, non-streaming", clients, 0.3 if quick else 2.0, False, 0))
    if "c8" in options.scenarios:  # the peers' figure: OnTheBench's gateway snapshots (docs/reference.md)
        seconds = 0.3 if quick else 2.0
        found.append(Scenario("c8", "c8: 8 clients, whole answers; CPU per request, void on any failure", 8,
                              seconds, False, 0, void_on_failure=True))  # fmt: skip
        found.append(Scenario("c8_stream", "c8: 8 clients, streams of 100 chunks; CPU per stream, void on any "
                              "failure", 8, seconds, True, 0, void_on_failure=True))  # fmt: skip
    if "one" in options.scenarios:  # sequential requests of one client: the latency a lone user sees added
        seconds = 0.3 if quick else 2.0
        found.append(Scenario("one_whole", "one client alone: whole answers, one after another", 1, seconds,
                              False, 0, one_client=True))  # fmt: skip
        found.append(Scenario("one_stream", "one client alone: streams of 100 chunks, one after another", 1,
                              seconds, True, 0, one_client=True))  # fmt: skip
    return found


@dataclass
class _Run:
    """Everything measured, for the table and the JSON."""

    windows: dict[str, dict[str, list[Window]]] = field(default_factory=dict)  # scenario -> target -> rounds
    abandons: dict[str, AbandonResult] = field(default_factory=dict)
    nginx: str = ""
    builds: dict[str, str] = field(default_factory=dict)  # streamwarden target -> its --version and place
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)


def _nginx_version() -> str | None:
    binary = shutil.which("nginx")
    if binary is None:
        return None
    done = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10, check=False)
    return (done.stderr or done.stdout).strip().removeprefix("nginx version: ").removeprefix("nginx/") or "?"


async def _targets(children: Children, upstream: URL, options: BenchOptions, with_nginx: bool) -> list[Target]:
    """Fresh proxies (stopped with `children`), so that each scenario's memory growth is its own."""
    targets = [Target("direct", upstream, None)]
    if with_nginx:
        try:
            started = await children.nginx(upstream)
        except RuntimeError as exc:  # the bench goes on without its reference, and says why
            print(f"nginx did not start, so no reference column: {exc}", flush=True)
            started = None
        if started is not None:
            targets.append(Target("nginx", started[1], started[0].proc.pid))
    floor = await children.floor(upstream)
    if floor is not None:
        targets.append(Target("floor", floor[1], floor[0].proc.pid))
    proxy, url = await children.streamwarden(upstream, options.proxy_args)
    targets.append(Target("streamwarden", url, proxy.proc.pid))
    for other in options.compare:
        proxy, url = await children.streamwarden(upstream, (*options.proxy_args, *other.args), other.source,
                                                 other.name)  # fmt: skip
        targets.append(Target(other.name, url, proxy.proc.pid))
    return targets


def _rotated(targets: list[Target], round_: int) -> list[Target]:
    """Each round starts with the next target, so none always runs first (or right after another)."""
    shift = round_ % len(targets)
    return targets[shift:] + targets[:shift]


async def _scenario(scenario: Scenario, targets: list[Target], model: str, upstream_pid: int | None,
                    rounds: int) -> dict[str, list[Window]]:  # fmt: skip
    per_target: dict[str, list[Window]] = {t.name: [] for t in targets}
    fresh: dict[str, int | None] = {}
    for target in targets:  # warm-up: every client once; the RSS before it is the fresh one
        warm = await measure(target, scenario, model, upstream_pid, requests=scenario.clients)
        fresh[target.name] = warm.rss_idle
    for round_ in range(rounds):
        for target in _rotated(targets, round_):
            window = await measure(target, scenario, model, upstream_pid)
            window.rss_idle = fresh[target.name]
            per_target[target.name].append(window)
    return per_target


async def _abandons(targets: list[Target], fake: URL, options: BenchOptions) -> dict[str, AbandonResult]:
    streams, delay, tokens = _ABANDON_QUICK if options.quick else _ABANDON
    pooled = {t.name: AbandonResult() for t in targets}
    for round_ in range(options.rounds):
        for target in _rotated(targets, round_):
            got = await measure_abandons(target, fake, streams=streams, delay_ms=delay, tokens=tokens,
                                         seed=options.seed + round_, label=f"{target.name}-{round_}")  # fmt: skip
            pool = pooled[target.name]
            pool.latencies = sorted(pool.latencies + got.latencies)
            pool.missed += got.missed
            pool.ended_first += got.ended_first
            pool.failed += got.failed
    return pooled


async def _bench(options: BenchOptions, run: _Run) -> None:
    run.load_before = os.getloadavg()
    version = _nginx_version()
    run.nginx = version or ""
    run.builds = {"streamwarden": build_of(None), **{c.name: build_of(c.source) for c in options.compare}}
    print(_header(options, version, run.builds), flush=True)
    async with Children() as children:
        upstream, upstream_pid, model = options.upstream, None, "fast"
        if upstream is None:
            fake, upstream = await children.fast_fake()
            upstream_pid = fake.proc.pid
        else:
            model = await _model(upstream)
        for scenario in _scenarios(options):
            async with Children() as proxies:
                targets = await _targets(proxies, upstream, options, version is not None)
                per_target = await _scenario(scenario, targets, model, upstream_pid, options.rounds)
            run.windows[scenario.key] = per_target
            print(format_scenario(scenario, summarize(scenario, per_target)), flush=True)
        if "abandon" in options.scenarios and options.upstream is None:
            async with Children() as proxies:
                run.abandons = await _abandons(await _targets(proxies, upstream, options, version is not None),
                                               upstream, options)  # fmt: skip
            streams, delay, _ = _ABANDON_QUICK if options.quick else _ABANDON
            print(format_abandons(streams, delay, options.rounds, run.abandons), flush=True)
        elif "abandon" in options.scenarios:
            print("abandon test: skipped (it reads the upstream's own view of the close: built-in fake only)")
    run.load_after = os.getloadavg()


async def _model(upstream: URL) -> str:
    """The backend's first model id (a real server rejects unknown names)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(upstream / "v1" / "models") as resp:
        data = orjson.loads(await resp.read()) if resp.status == 200 else None
    models = data.get("data") if isinstance(data, dict) else None
    if models and isinstance(models[0], dict) and isinstance(models[0].get("id"), str):
        return str(models[0]["id"])
    raise RuntimeError(f"{upstream} answered GET /v1/models without a model id (status {resp.status})")


def _header(options: BenchOptions, nginx: str | None, builds: dict[str, str]) -> str:
    upstream = (f"{options.upstream} (direct vs proxied; its own pace)" if options.upstream
                else "the built-in fake, fast mode (raw asyncio, one socket write per event)")  # fmt: skip
    reference = (f"nginx {nginx}: proxy_buffering off, 1 worker, keep-alive upstream, no access log" if nginx else
                 "nginx: not on the PATH, so no reference column (apt-get install nginx)")  # fmt: skip
    floor = ("floor: uvloop protocols, httptools, keep-alive pool, bytes relayed as they come" if
             options.upstream is None or options.upstream.scheme == "http" else "floor: none (http upstreams only)")
    flags = f"default flags{' + ' + ' '.join(options.proxy_args) if options.proxy_args else ''}"
    lines = [f"streamwarden: {flags}", *_build_lines(builds["streamwarden"])]
    for other in options.compare:
        lines += [f"{other.name}: {flags}{' + ' + ' '.join(other.args) if other.args else ''}",
                  *_build_lines(builds[other.name])]  # fmt: skip
    one, five, fifteen = os.getloadavg()
    return (
        f"streamwarden bench: {options.rounds} alternated round(s), medians{' (--quick)' if options.quick else ''}\n"
        f"upstream: {upstream}\n{reference}\n{floor}\n" + "\n".join(lines) + "\n"
        f"{os.cpu_count()} CPUs shared by upstream, proxies and client; "
        f"load average {one:.2f} {five:.2f} {fifteen:.2f}"
    )


def _build_lines(build: str) -> list[str]:
    version, _, where = build.partition(" from ")
    return [f"  {version}", f"  from {where}"]


def _json(options: BenchOptions, run: _Run, scenarios: Sequence[Scenario]) -> bytes:
    out: dict[str, object] = {
        "upstream": str(options.upstream) if options.upstream else "fast fake",
        "rounds": options.rounds,
        "quick": options.quick,
        "cpus": os.cpu_count(),
        "load_average_before": list(run.load_before),
        "load_average_after": list(run.load_after),
        "nginx": run.nginx or None,
        "builds": run.builds,
        "scenarios": {},
        "abandon": {},
    }
    by_key = {s.key: s for s in scenarios}
    for key, per_target in run.windows.items():
        scenario = by_key[key]
        out["scenarios"][key] = {  # type: ignore[index]
            "title": scenario.title, "clients": scenario.clients,
            "duration_s": None if scenario.requests else scenario.duration, "requests": scenario.requests,
            "stream": scenario.stream, "delay_ms": scenario.delay_ms, "one_client": scenario.one_client,
            "void_on_failure": scenario.void_on_failure,
            "targets": summarize(scenario, per_target),
            "rounds": {name: [{"wall_s": w.wall, "ok": w.ok, "failed": w.failed, "events": w.events,
                               "cpu_s": w.cpu, "upstream_cpu_s": w.upstream_cpu, "client_cpu_s": w.client_cpu,
                               "rss_peak": w.rss_peak} for w in windows]
                       for name, windows in per_target.items()},
        }  # fmt: skip
    for name, result in run.abandons.items():
        out["abandon"][name] = {  # type: ignore[index]
            "closes": len(result.latencies), "ended_first": result.ended_first, "missed": result.missed,
            "failed": result.failed,
            "p50_ms": _ms(percentile(result.latencies, 50)), "p95_ms": _ms(percentile(result.latencies, 95)),
            "max_ms": _ms(result.latencies[-1] if result.latencies else None),
        }  # fmt: skip
    return orjson.dumps(out, option=orjson.OPT_INDENT_2)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def run_bench(options: BenchOptions) -> int:
    """Run everything and print the tables; 1 when a request failed, 130 on Ctrl-C."""
    run = _Run()
    try:
        try:
            import uvloop
        except ImportError:  # pragma: no cover
            asyncio.run(_bench(options, run))
        else:
            uvloop.run(_bench(options, run))
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, OSError) as exc:
        print(f"bench: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    one, five, fifteen = run.load_after
    print(f"load average after: {one:.2f} {five:.2f} {fifteen:.2f}")
    print(format_latency_cost(measure_latency_cost()))
    if options.json_path is not None:
        options.json_path.write_bytes(_json(options, run, _scenarios(options)))
        print(f"figures written to {options.json_path}")
    failed = sum(w.failed for targets in run.windows.values() for ws in targets.values() for w in ws)
    failed += sum(r.failed for r in run.abandons.values())
    if failed:
        print(f"bench: {failed} request(s) failed", file=sys.stderr)
        errors = [e for targets in run.windows.values() for ws in targets.values() for w in ws for e in w.errors]
        if errors:
            print(f"e.g. {errors[0][:70]}", file=sys.stderr)
    return 1 if failed else 0
