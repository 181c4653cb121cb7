"""`streamwarden bench`'s figures and tables: medians over rounds, what each proxy adds, 80 columns.

Per target: the rate (events/s, or requests/s without streaming) and its ratio to direct; TTFT (first
content event), TTFE (first event of any kind), TTFB (first byte) and the whole answer (last byte)
p50/p99 and what the proxy adds over direct; the proxy's own CPU-µs per event (or per request) and
its ratios to nginx's and the floor's (`void` where the scenario follows OnTheBench's rule and the
target failed a request: no CPU figure then); its share of a core; its memory per concurrent stream
(peak RSS during the rounds over its RSS when fresh, divided by the concurrency); and the upstream's
and this client's share of a core, to show neither was the limit. One client alone shows the latency
it waits for, in hundredths of a millisecond: a stream's first token, a whole answer's last byte.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence

from proxy.tools.bench.cancel import AbandonResult
from proxy.tools.bench.load import Scenario, Window

__all__ = ["format_abandons", "format_scenario", "percentile", "summarize"]

Figures = dict[str, float | int | None]
_LATENCIES = ("ttft", "ttfe", "ttfb", "total")
_LABEL_WIDTH = 22
_WIDTH = 80  # a table wider than this goes on in another block of columns below
SATURATED = 0.85  # a share of a core above which the upstream or the client may be the limit


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(pct / 100 * len(ordered))))
    return ordered[rank - 1]


def _median(windows: Sequence[Window], figure: Callable[[Window], float | None]) -> float | None:
    values = [v for v in (figure(w) for w in windows) if v is not None]
    return statistics.median(values) if values else None


def _per_target(scenario: Scenario, windows: Sequence[Window]) -> Figures:
    out: Figures = {
        "rate": _median(windows, lambda w: (w.events if scenario.stream else w.ok) / w.wall if w.wall else None),
        "ok": sum(w.ok for w in windows),
        "failed": sum(w.failed for w in windows),
        "void": scenario.void_on_failure and any(w.failed for w in windows),
    }
    for name in _LATENCIES:
        for pct in (50, 99):
            value = _median(windows, lambda w, n=name, p=pct: percentile(getattr(w, n), p))  # type: ignore[misc]
            out[f"{name}_p{pct}_ms"] = None if value is None else value * 1000
    if scenario.stream:
        out["cpu_us_per_event"] = _median(windows, lambda w: w.cpu / w.events * 1e6
                                          if w.cpu is not None and w.events else None)  # fmt: skip
    out["cpu_us_per_request"] = _median(windows, lambda w: w.cpu / w.ok * 1e6 if w.cpu is not None and w.ok else None)
    if out["void"]:  # no figure from a window with a failure (and a median of the others would hide it)
        out["cpu_us_per_request"] = out["cpu_us_per_event"] = None
    out["cpu_core_share"] = _median(windows, lambda w: w.cpu / w.wall if w.cpu is not None and w.wall else None)
    peaks = [w.rss_peak for w in windows if w.rss_peak is not None]
    idle = windows[0].rss_idle if windows else None
    out["kb_per_stream"] = (max(peaks) - idle) / 1024 / scenario.clients if peaks and idle is not None else None
    out["upstream_core_share"] = _median(windows, lambda w: w.upstream_cpu / w.wall
                                         if w.upstream_cpu is not None and w.wall else None)  # fmt: skip
    out["client_core_share"] = _median(windows, lambda w: w.client_cpu / w.wall if w.wall else None)
    return out


def summarize(scenario: Scenario, per_target: Mapping[str, Sequence[Window]]) -> dict[str, Figures]:
    """Target name -> its figures, with the ratios to direct and to nginx and the added latencies."""
    found = {name: _per_target(scenario, windows) for name, windows in per_target.items()}
    direct, nginx, floor = found.get("direct", {}), found.get("nginx", {}), found.get("floor", {})
    unit = "event" if scenario.stream else "request"
    for figures in found.values():
        rate, base = figures["rate"], direct.get("rate")
        figures["vs_direct"] = rate / base if rate is not None and base else None
        for name in _LATENCIES:
            for pct in (50, 99):
                key = f"{name}_p{pct}_ms"
                mine, theirs = figures[key], direct.get(key)
                figures[f"added_{key}"] = mine - theirs if mine is not None and theirs is not None else None
        cpu, ref, low = figures[f"cpu_us_per_{unit}"], nginx.get(f"cpu_us_per_{unit}"), floor.get(f"cpu_us_per_{unit}")
        figures["cpu_vs_nginx"] = cpu / ref if cpu is not None and ref else None
        figures["cpu_vs_floor"] = cpu / low if cpu is not None and low else None
    return found


def _num(value: float | int | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _shown_latencies(scenario: Scenario) -> tuple[str, ...]:
    """The latency rows of a table: one client alone shows what it waits for (the first token of a
    stream, the last byte of a whole answer); a load shows every first-something."""
    if scenario.one_client:
        return ("ttft",) if scenario.stream else ("total",)
    return ("ttft", "ttfe", "ttfb") if scenario.stream else ("ttfb",)


def format_scenario(scenario: Scenario, figures: Mapping[str, Figures]) -> str:
    """One table: a row per figure, a column per target."""
    names = list(figures)
    unit = "event" if scenario.stream else "request"
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, cell: Callable[[str, Figures], str]) -> None:
        rows.append((label, [cell(name, figures[name]) for name in names]))

    row("events/s" if scenario.stream else "requests/s", lambda n, f: _num(f["rate"], ",.0f"))
    row("  vs direct", lambda n, f: _num(f["vs_direct"], ".2f", "x"))
    digits = 2 if scenario.one_client else 1  # one client alone: the goals are fractions of a millisecond
    for name in _shown_latencies(scenario):
        for pct in (50, 99):
            key = f"{name}_p{pct}_ms"

            def latency(n: str, f: Figures, key: str = key) -> str:
                text = _num(f[key], f".{digits}f")
                added = f[f"added_{key}"]
                return text if n == "direct" or added is None else f"{text} ({added:+.{digits}f})"

            label = "answer" if name == "total" else name.upper()
            row(f"{label} p{pct} ms (added)", latency)
    def cpu(key: str, spec: str, suffix: str = "") -> Callable[[str, Figures], str]:
        return lambda n, f: "void" if f["void"] else _num(f[key], spec, suffix)

    row(f"CPU-us per {unit}", cpu(f"cpu_us_per_{unit}", ".1f"))
    row("  vs nginx", cpu("cpu_vs_nginx", ".2f", "x"))
    if "floor" in names:
        row("  vs floor", cpu("cpu_vs_floor", ".2f", "x"))
    if scenario.stream:
        row("CPU-us per stream", cpu("cpu_us_per_request", ",.0f"))
    row("  share of a core", lambda n, f: _num(None if f["cpu_core_share"] is None else f["cpu_core_share"] * 100,
                                               ".0f", "%"))  # fmt: skip
    if scenario.stream and not scenario.one_client:  # one stream's RSS is noise
        row("KB per stream (RSS)", lambda n, f: _num(f["kb_per_stream"], ".1f"))
    row("upstream, core share", lambda n, f: _num(None if f["upstream_core_share"] is None
                                                   else f["upstream_core_share"] * 100, ".0f", "%"))  # fmt: skip
    row("client, core share", lambda n, f: _num(None if f["client_core_share"] is None
                                                 else f["client_core_share"] * 100, ".0f", "%"))  # fmt: skip
    row("ok / failed", lambda n, f: f"{f['ok']} / {f['failed']}")
    roles = (("the upstream", "upstream_core_share"), ("this client", "client_core_share"))
    notes = [f"note: {who} used {share * 100:.0f}% of a core against {n}: it may be the limit"
             for n in names for who, key in roles
             if isinstance(share := figures[n][key], float) and share > SATURATED]  # fmt: skip
    widths = [max(len(name), *(len(cells[i]) for _, cells in rows)) + 2 for i, name in enumerate(names)]
    lines = ["", scenario.title]
    first = 0
    while first < len(names):  # blocks of the columns that fit in 80, each with its header
        last = first + 1
        while last < len(names) and _LABEL_WIDTH + sum(widths[first : last + 1]) <= _WIDTH:
            last += 1
        shown = range(first, last)
        lines += [" " * _LABEL_WIDTH + "".join(f"{names[i]:>{widths[i]}}" for i in shown),
                  "-" * (_LABEL_WIDTH + sum(widths[i] for i in shown))]  # fmt: skip
        lines += [f"{label:<{_LABEL_WIDTH}}" + "".join(f"{cells[i]:>{widths[i]}}" for i in shown)
                  for label, cells in rows]  # fmt: skip
        first = last
    return "\n".join(lines + [note[:80] for note in notes])


def format_abandons(streams: int, delay_ms: int, rounds: int, results: Mapping[str, AbandonResult]) -> str:
    """Client close -> upstream close, as the upstream saw it, per target."""
    lines = ["", f"abandon: {streams} streams at {delay_ms} ms per chunk, a third abandoned at random points",
             "(ended first: the upstream had sent all before the client left; never: no close)",
             f"client closes -> the upstream sees its connection close, ms ({rounds} round(s) pooled)",
             f"{'':<14}{'closes':>8}{'p50':>9}{'p95':>9}{'max':>9}{'ended first':>12}{'never':>8}{'failed':>8}",
             "-" * 77]  # fmt: skip
    for name, result in results.items():
        values = result.latencies
        cells = [_num(None if percentile(values, p) is None else percentile(values, p) * 1000, ".1f")  # type: ignore[operator]
                 for p in (50, 95)]  # fmt: skip
        top = _num(values[-1] * 1000 if values else None, ".1f")
        lines.append(f"{name:<14}{len(values):>8}{cells[0]:>9}{cells[1]:>9}{top:>9}{result.ended_first:>12}"
                     f"{result.missed:>8}{result.failed:>8}")  # fmt: skip
    return "\n".join(lines)
