"""docs/vllm.md's command for a real vLLM on a CPU and the vLLM tier's start agree: every flag the
recipe gives the server is one the tier gives it, `--enable-force-include-usage` (the manifests' flag,
exact usage) included, so what the tier proves is what a reader who follows the recipe gets."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def recipe_flags() -> list[str]:
    text = (ROOT / "docs" / "vllm.md").read_text()
    start = text.index("-m vllm.entrypoints.openai.api_server")
    command = text[start : text.index("make run", start)]
    return [flag for flag in re.findall(r"(?<!\S)--[a-z][a-z-]+", command) if flag != "--model"]


def test_the_recipe_serves_with_the_tiers_flags() -> None:
    tier = (ROOT / "tests" / "real" / "vllm_tier.py").read_text()
    flags = recipe_flags()
    assert "--enable-force-include-usage" in flags
    assert "--max-model-len" in flags
    missing = [flag for flag in flags if f'"{flag}"' not in tier]
    assert missing == []


def test_the_manifests_force_usage_too() -> None:
    for manifest in ("deploy/kubernetes/vllm-sidecar.yaml", "deploy/kubernetes/examples/existing-deployment/vllm.yaml"):
        assert "--enable-force-include-usage" in (ROOT / manifest).read_text(), manifest
