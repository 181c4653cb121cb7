"""`streamwarden check` against a real backend (llama-server, vLLM), as the real tiers run it.

Each tier asserts its backend's own details; what every tier asserts alike is here: every probe ran,
in order, with the verdicts the tier expects, and the report committed under docs/check/ (what
docs/reference.md's Tested against table shows) is still what this backend gives.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from proxy.tools.check.options import CheckOptions
from proxy.tools.check.report import PROBE_IDS, Report
from proxy.tools.check.run import run_check

__all__ = ["assert_committed", "checked"]

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "check"


async def checked(url: str, expected: dict[str, str]) -> Report:
    """The report on `url`, printed for the log, with every probe's verdict the one `expected`."""
    report = await run_check(CheckOptions(url, timeout=60.0))
    print("\n" + "\n".join(f"{f.id}: {f.result}: {f.detail}" for f in report.probes))
    assert [f.id for f in report.probes] == list(PROBE_IDS)
    assert {f.id: f.result for f in report.probes} == expected
    assert report.server is not None
    return report


def assert_committed(report: Report, name: str) -> None:
    """docs/check/`name` has this report's verdicts, flags and recommended flags."""
    committed = orjson.loads((COMMITTED / name).read_bytes())
    assert {p["id"]: (p["result"], p["flags"]) for p in committed["probes"]} == {
        f.id: (f.result, list(f.flags)) for f in report.probes
    }
    assert committed["recommended_flags"] == report.recommended_flags
