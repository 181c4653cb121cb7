"""charts/streamwarden rendered and linted with Helm's own Go library (helm-python-sdk, the `helm` extra).

Offline: no cluster, no `helm` binary. A test that needs it skips where the extra is not installed, except
in CI (CI=true), where `make install` installs it and a missing library is a failure.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

__all__ = ["CHART", "helm", "render_chart"]

CHART = Path(__file__).resolve().parents[2] / "charts" / "streamwarden"


def helm() -> ModuleType:
    """helm_python, or a skip (a failure in CI)."""
    try:
        return importlib.import_module("helm_python")
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("helm-python-sdk is not installed (the `helm` extra: make install)")


def render_chart(values: dict[str, Any] | None = None, namespace: str = "llm") -> list[dict[str, Any]]:
    """The chart's objects as `helm template llm charts/streamwarden -n NAMESPACE` prints them."""
    library = helm()
    with library.Chart.load(CHART) as chart:
        rendered = chart.render(values or {}, name="llm", namespace=namespace)
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]
