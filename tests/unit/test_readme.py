"""The README is the users' reference: every flag and metric is in it; the long tables live in docs/."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.config import SERVE_FLAGS
from proxy.observe.metrics import Metrics
from proxy.tools.fake import describe

README = (Path(__file__).parents[2] / "README.md").read_text()


@pytest.mark.parametrize("flag", list(SERVE_FLAGS))
def test_every_flag_is_documented(flag: str) -> None:
    assert f"| `--{flag}" in README


def test_every_metric_is_documented() -> None:
    names = {metric.name for metric in Metrics().registry.collect()}
    assert len(names) == 15  # design section 7, issue 13's four and issue 12's hook failures included
    for name in names:
        suffix = "_total" if f"{name}_total" in README else ""
        assert f"`{name}{suffix}`" in README, name


def test_both_commands_are_shown() -> None:
    assert "make run" in README
    assert "make test" in README


# --- what moved out of the README (issue 14) ----------------------------------------------------------

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
FAILURES = (DOCS / "failures.md").read_text()


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def _table_rows(text: str) -> list[list[str]]:
    """The body rows of the Markdown tables in `text`, split into cells."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows[1:] if rows else rows


def _documented_reasons() -> set[str]:
    """The `reason` label values the README's metrics section lists."""
    (bullet,) = re.findall(r"^- `reason`: (.*?)(?=^- )", README, re.M | re.S)
    return set(re.findall(r"`([a-z_0-9]+)`", bullet))


def test_the_scenario_table_is_generated_in_one_place() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    scenarios = (ROOT / "proxy" / "tools" / "fake" / "scenarios.py").read_text()
    for row in describe():
        assert f"| `{row.name}` |" not in README, f"the README repeats the scenario table ({row.name})"
        assert not re.search(rf"^{row.name}\s{{2,}}", scenarios, re.M), "scenarios.py's docstring repeats the table"


def test_the_readme_summarises_failures_in_ten_rows_and_links_the_matrix() -> None:
    section = _section(README, "## What the client sees when the backend fails")
    assert len(_table_rows(section)) == 10
    assert "(docs/failures.md)" in section


@pytest.mark.parametrize("row", _table_rows(_section(FAILURES, "| scenario | dialect |")), ids=lambda r: r[0])
def test_every_row_of_the_failure_matrix_names_a_real_scenario_and_verdict(row: list[str]) -> None:
    scenario, dialect, *_, verdict = row
    name = re.match(r"`([a-z0-9_]+)", scenario)
    assert name is None or name[1] in {r.name for r in describe()}, scenario
    assert name is not None or scenario.startswith("(no listener")
    assert dialect in {"chat_completions", "completions", "responses", "messages"}
    reasons = re.findall(r"\b(ok|error|aborted) / ([a-z_0-9]+)", verdict)
    assert reasons, verdict
    documented = _documented_reasons()
    for _, reason in reasons:
        assert reason in documented, f"{verdict}: {reason} is not a reason the README's metrics section lists"


def test_the_failure_matrix_left_the_readme() -> None:
    assert "| scenario | dialect | what the upstream does |" not in README
    assert "| scenario | dialect | what the upstream does |" in FAILURES


def test_the_readme_says_the_sdks_need_an_api_key() -> None:
    assert "OPENAI_API_KEY" in README


def test_the_readme_names_the_models_the_manifests_serve() -> None:
    for manifest, flag in (("vllm-sidecar.yaml", "--served-model-name"), ("llamacpp-sidecar.yaml", "--alias")):
        text = (ROOT / "deploy" / "kubernetes" / manifest).read_text()
        found = re.search(rf"{flag}=(\S+)", text)
        assert found, f"{manifest} sets no {flag}"
        assert f"`{found[1]}`" in README, f"the README does not name {found[1]} ({manifest})"
