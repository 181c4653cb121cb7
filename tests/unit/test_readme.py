"""The README is the users' reference: every flag and metric is in it; the long tables live in docs/."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config import SERVE_FLAGS
from proxy.observe.metrics import Metrics
from proxy.tools.fake import describe

README = (Path(__file__).parents[2] / "README.md").read_text()


@pytest.mark.parametrize("flag", list(SERVE_FLAGS))
def test_every_flag_is_documented(flag: str) -> None:
    assert f"| `--{flag}" in README


def test_every_metric_is_documented() -> None:
    names = {metric.name for metric in Metrics().registry.collect()}
    assert len(names) == 16  # design section 7, the latency and abort four, hook failures, resumes
    for name in names:
        suffix = "_total" if f"{name}_total" in README else ""
        assert f"`{name}{suffix}`" in README, name


def test_both_commands_are_shown() -> None:
    assert "make run" in README
    assert "make test" in README


def test_the_first_screen_says_what_it_is_then_the_two_commands_then_the_demo() -> None:
    """The first screen was the image build; `make run` was at line 119, `make test` at 367.
    What it is, then `make run` and `make test` with what you see, then `make demo`; nothing of the
    operator's install in the first 40 lines."""
    lines = README.splitlines()[:40]
    screen = "\n".join(lines)
    assert lines[0] == "# streamwarden"
    assert "sidecar" in "\n".join(lines[:6])
    assert "OpenAI-compatible" in "\n".join(lines[:6])

    def first(text: str) -> int:
        found = [i for i, line in enumerate(lines) if line.startswith(text)]
        assert found, f"{text!r} is not on the first screen"
        return found[0]

    run, test, demo = first("make run "), first("make test "), first("make demo ")
    assert run < test < demo
    assert "```" not in "\n".join(lines[: run - 1])  # make run's block is the first one
    after_run = "\n".join(lines[run:test])
    for seen in ("streamwarden: http://127.0.0.1:8080", "Stop", "data: [DONE]", "x-fault: stray_503", "503",
                 "reason=stray_http_block", "x-fault: cut;once=1", "resumes=1"):
        assert seen in after_run, seen
    assert "passed" in lines[test]  # what make test ends with
    assert "tour" in lines[demo]
    for operator in ("make image", "docker", "kubectl", "kustomization"):
        assert operator not in screen, operator
    assert README.index("## Install") > len(screen)


# --- what moved out of the README ----------------------------------------------------------

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


# --- the README in an operator's order, its links, the runbooks -------------------------------

SECTIONS = [
    "## Run it and send a first request", "## Install", "## The sidecar", "## Flags", "## Metrics and logs",
    "## What the client sees when the backend fails", "## Performance and sizing", "## Development",
]


def test_the_readme_is_short_and_in_an_operators_order() -> None:
    assert len(README.encode()) < 30_000
    headings = [line for line in README.splitlines() if line.startswith("## ")]
    assert headings == SECTIONS


def _sidecar_snippet() -> list[dict[str, Any]]:
    marker = README.index("<!-- sidecar:")
    block = README[README.index("```yaml\n", marker) + len("```yaml\n") : README.index("```\n", marker + 20)]
    assert len(block.splitlines()) <= 17, "the snippet stays short"
    return list(yaml.safe_load(block)["containers"])


def test_the_sidecar_snippet_is_the_manifests_pod() -> None:
    """The README's 15 lines say what vllm-sidecar.yaml does: loopback backend, ports, probes, the flags."""
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "vllm-sidecar.yaml").read_text()) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    manifest = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    snippet = {str(c["name"]): c for c in _sidecar_snippet()}
    assert set(snippet) == set(manifest)
    backend, proxy = snippet["vllm"], snippet["streamwarden"]
    assert backend["image"] == manifest["vllm"]["image"]
    assert backend["command"] == manifest["vllm"]["command"]
    assert backend["args"] == manifest["vllm"]["args"], "the same vLLM, --served-model-name included"
    assert "--enable-force-include-usage" in backend["args"]
    env = {e["name"]: e["value"] for e in manifest["streamwarden"]["env"]}
    assert all(env[e["name"]] == e["value"] for e in proxy["env"])
    ports = {(p["name"], p["containerPort"]) for p in manifest["streamwarden"]["ports"]}
    assert {(p["name"], p["containerPort"]) for p in proxy["ports"]} == ports
    for probe in ("readinessProbe", "livenessProbe"):
        assert proxy[probe]["httpGet"] == manifest["streamwarden"][probe]["httpGet"]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


LINKED = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", LINKED, ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file_and_a_heading(page: Path) -> None:
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target} does not exist"
        if anchor and linked.suffix == ".md":
            headings = {_slug(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), re.M)}
            assert anchor in headings, f"{page.name}: #{anchor} is no heading of {linked.name}"


def test_every_alert_has_a_runbook_and_points_at_it() -> None:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
    runbooks = (DOCS / "runbooks.md").read_text()
    headings = {_slug(h) for h in re.findall(r"^## (.*)$", runbooks, re.M)}
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert len(alerts) == len(headings)
    for rule in alerts:
        anchor = rule["alert"].lower()
        assert anchor in headings, f"docs/runbooks.md has no section {rule['alert']}"
        assert rule["annotations"]["runbook_url"].endswith(f"/docs/runbooks.md#{anchor}")
