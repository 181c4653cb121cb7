"""docs/reference.md's "Tested against" table is the committed `streamwarden check` report on llama-server."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import orjson

from proxy.tools.check.report import PROBE_IDS, Report

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tested_against.py"


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tested_against", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_section_matches_the_committed_report() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_committed_report_is_a_whole_report() -> None:
    data = orjson.loads((ROOT / "docs" / "check" / "llama-server.json").read_bytes())
    report = Report.from_json(data)  # every result is one of the five
    assert [f.id for f in report.probes] == list(PROBE_IDS)
    assert data["recommended_flags"] == report.recommended_flags
    assert report.server is not None
    assert report.server.startswith("llama.cpp llama-server")


def test_a_changed_report_makes_the_section_stale() -> None:
    module = script()
    readme = module.README.read_text()  # the page that holds the section (docs/reference.md)
    data = orjson.loads(module.REPORT.read_bytes())
    assert module.render(readme, data) == readme
    data["probes"][0]["result"] = "fail"
    changed = module.render(readme, data)
    assert changed != readme
    assert f"| `{PROBE_IDS[0]}` | fail |" in changed
