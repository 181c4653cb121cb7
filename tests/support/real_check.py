"""`streamwarden check` against a real backend (llama-server, vLLM), as the real tiers run it.

Each tier asserts its backend's own details; what every tier asserts alike is here: every probe ran,
in order, with the verdicts the tier expects, and the report committed under docs/check/ (what
docs/reference.md's Tested against table shows) is still what this backend gives.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from proxy.tools.check.options import CheckOptions
from proxy.tools.check.report import PROBE_IDS, Report
from proxy.tools.check.run import run_check

__all__ = ["assert_committed", "checked", "checked_beside_a_cpu_hog", "cpu_hog"]

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


HOG_CPUS = 2  # stress-ng workers: as many as a CI machine's cores, so the check and the backend fight for them
RUNS = 3


@contextlib.contextmanager
def cpu_hog(cpus: int = HOG_CPUS) -> Iterator[subprocess.Popen[bytes]]:
    """`stress-ng --cpu N` beside the test (issue 35: `check` gave load-dependent verdicts), stopped after."""
    binary = shutil.which("stress-ng")
    if binary is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("stress-ng is missing (.ci/run installs it)")
        pytest.skip("stress-ng is not installed (apt-get install stress-ng)")
    hog = subprocess.Popen([binary, "--cpu", str(cpus), "--timeout", "1800s", "--quiet"], start_new_session=True)
    try:
        yield hog
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(hog.pid, signal.SIGTERM)
        try:
            hog.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(hog.pid, signal.SIGKILL)
            hog.wait()


def _save(path: Path, report: Report) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2) + b"\n")


async def checked_beside_a_cpu_hog(url: str, expected: dict[str, str], committed: str, save: Path) -> None:
    """RUNS reports on `url` with every CPU busy, each with the verdicts `expected` (the same each time)
    and the flags docs/check/`committed` holds; each run's JSON report is written to `save` (run-1.json,
    ...; under $STREAMWARDEN_CHECK_REPORTS when set) for a reader to compare."""
    kept = os.environ.get("STREAMWARDEN_CHECK_REPORTS")
    save = Path(kept) / save.name if kept else save
    reports = []
    with cpu_hog():
        for run in range(1, RUNS + 1):
            report = await run_check(CheckOptions(url, timeout=60.0))
            print(f"\nrun {run} beside stress-ng --cpu {HOG_CPUS}:")
            print("\n".join(f"{f.id}: {f.result}: {f.detail}" for f in report.probes))
            _save(save / f"run-{run}.json", report)
            reports.append(report)
    for report in reports:
        assert [f.id for f in report.probes] == list(PROBE_IDS)
        assert {f.id: f.result for f in report.probes} == expected
        assert_committed(report, committed)
    assert len({tuple(r.recommended_flags) for r in reports}) == 1
