"""The README is the users' reference: every flag, metric and fault scenario must be in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config import SERVE_FLAGS
from proxy.fake import describe
from proxy.metrics import Metrics

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


@pytest.mark.parametrize("scenario", describe(), ids=lambda row: row.name)
def test_every_fault_scenario_is_documented(scenario: object) -> None:
    name, dialects, summary = scenario  # type: ignore[misc]
    assert f"| `{name}` | {dialects} | {summary} |" in README


def test_both_commands_are_shown() -> None:
    assert "make run" in README
    assert "make test" in README
