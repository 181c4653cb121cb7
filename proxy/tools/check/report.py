"""The check's findings and how they are shown: one ``Finding`` per probe, a ``Report``, its table.

Sans-IO: probes build findings from what they saw; this module only orders, merges and renders them,
so the terminal table and the JSON report can never disagree.
"""

from __future__ import annotations

import re
import shutil
import unicodedata
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FAIL",
    "NOT_REACHED",
    "OK",
    "PROBE_IDS",
    "QUIRK",
    "RESULTS",
    "UNKNOWN",
    "UNSUPPORTED",
    "Finding",
    "Report",
    "printable",
    "render_table",
]

OK, QUIRK, FAIL, UNSUPPORTED, UNKNOWN = "ok", "quirk", "fail", "unsupported", "unknown"
RESULTS = (OK, QUIRK, FAIL, UNSUPPORTED, UNKNOWN)

#: Every probe, in the order it runs and is reported.
PROBE_IDS = (
    "dialect.chat_completions",
    "dialect.completions",
    "dialect.responses",
    "dialect.messages",
    "stream.terminal",
    "stream.usage",
    "errors.malformed_json",
    "errors.context_overflow",
    "abort.stops_generation",
    "abort.conversation_replay",
    "resume.prefill",
    "health",
    "metrics",
)
_DETAIL_LIMIT = 400
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f]|[^\x00-\x7f]")  # candidates: the rest of Unicode is checked below


def printable(text: str) -> str:
    """``text`` with every control or format character escaped (``\\x1b``, ``\\u202e``), so that what a
    backend sent (a Server header, a model id, an error message) can never drive the terminal: an ESC
    sequence, a BEL, an OSC 52 that writes the clipboard, a bidi override that reorders the line."""

    def escape(match: re.Match[str]) -> str:
        char = match.group()
        if unicodedata.category(char) not in ("Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp"):
            return char
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (aiohttp decodes headers with surrogateescape)
            code -= 0xDC00
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"

    return _UNSAFE.sub(escape, text)
NOT_REACHED = (
    "check failed: no dialect answered a plain request, so nothing above tells what this backend does "
    "(a wrong URL or model, a missing --api-key, an engine that is down?)"
)


@dataclass(frozen=True, slots=True)
class Finding:
    """What one probe saw: its verdict, one line of evidence, and the serve flags it calls for."""

    id: str
    result: str
    detail: str
    flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.result not in RESULTS:
            raise ValueError(f"result must be one of {', '.join(RESULTS)}, got {self.result!r}")
        line = printable(" ".join(self.detail.split()))  # one safe line, whatever the backend put in its message
        if len(line) > _DETAIL_LIMIT:
            line = line[: _DETAIL_LIMIT - 3] + "..."
        object.__setattr__(self, "detail", line)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "result": self.result, "detail": self.detail, "flags": list(self.flags)}


@dataclass(slots=True)
class Report:
    upstream: str
    server: str | None = None
    model: str | None = None
    probes: list[Finding] = field(default_factory=list)

    def add(self, finding: Finding) -> Finding:
        self.probes.append(finding)
        return finding

    def get(self, probe_id: str) -> Finding | None:
        return next((f for f in self.probes if f.id == probe_id), None)

    @property
    def reached(self) -> bool:
        """Whether any dialect answered a plain request: a report where none did says nothing about the
        backend's failure modes (a wrong URL, a dead engine, a missing key), and must not read as clean."""
        dialects = [f for f in self.probes if f.id.startswith("dialect.")]
        return not dialects or any(f.result == OK for f in dialects)

    @property
    def recommended_flags(self) -> list[str]:
        """Every finding's flags, once each, in probe order; none from an ``unknown`` (a probe that could
        not tell recommends nothing)."""
        seen: dict[str, None] = {}
        for finding in self.probes:
            if finding.result == UNKNOWN:
                continue
            for flag in finding.flags:
                seen.setdefault(flag, None)
        return list(seen)

    def to_json(self) -> dict[str, Any]:
        return {
            "upstream": self.upstream,
            "server": self.server,
            "model": self.model,
            "probes": [f.to_json() for f in self.probes],
            "recommended_flags": self.recommended_flags,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Report:
        """A report read back (the README's section is rendered from the committed one)."""
        probes = [Finding(p["id"], p["result"], p["detail"], tuple(p.get("flags", ()))) for p in data["probes"]]
        return cls(data["upstream"], data.get("server"), data.get("model"), probes)


def render_table(report: Report, width: int | None = None) -> str:
    """The terminal view: a heading, one row per probe (details wrapped), the flags to add."""
    width = width or shutil.get_terminal_size((120, 24)).columns
    id_w = max(len(f.id) for f in report.probes) if report.probes else 10
    res_w = max(len(r) for r in RESULTS)
    detail_w = max(30, width - id_w - res_w - 4)
    lines = [
        f"streamwarden check: {printable(report.upstream)}",
        f"server: {printable(report.server or 'not identified')}    model: {printable(report.model or 'none')}",
        "",
        f"{'probe'.ljust(id_w)}  {'result'.ljust(res_w)}  detail",
    ]
    for finding in report.probes:
        chunks = _wrap(finding.detail, detail_w) or [""]
        lines.append(f"{finding.id.ljust(id_w)}  {finding.result.ljust(res_w)}  {chunks[0]}")
        lines += [" " * (id_w + res_w + 4) + chunk for chunk in chunks[1:]]
    lines.append("")
    flags = report.recommended_flags
    if not report.reached:
        lines.append(NOT_REACHED)
    else:
        shown = printable(" ".join(flags)) if flags else "none beyond the defaults"
        lines.append("recommended serve flags: " + shown)
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    out: list[str] = []
    line = ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        out.append(line)
    return out
