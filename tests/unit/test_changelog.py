"""CHANGELOG.md keeps the Keep a Changelog shape an operator's tools and eyes expect: Unreleased first,
then each version with a date, newest first, only the six kinds of change; the package's version has
its section; and the links to the stability promise and the upgrade steps land on real headings."""

from __future__ import annotations

import re
from pathlib import Path

from proxy import __version__

ROOT = Path(__file__).resolve().parents[2]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
KINDS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings (lower case, punctuation dropped, spaces to hyphens)."""
    heads = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", head.strip().lower()).replace(" ", "-") for head in heads}


def test_unreleased_first_then_dated_versions_newest_first() -> None:
    versions = re.findall(r"^## \[([^\]]+)\](.*)$", CHANGELOG, flags=re.MULTILINE)
    assert versions[0] == ("Unreleased", "")
    released = versions[1:]
    assert released, "at least the current version"
    assert released[0][0] == __version__
    for _, rest in released:
        assert re.fullmatch(r" - \d{4}-\d{2}-\d{2}", rest), rest
    numbers = [tuple(int(part) for part in name.split(".")) for name, _ in released]
    assert numbers == sorted(numbers, reverse=True)


def test_only_the_six_kinds_of_change() -> None:
    kinds = set(re.findall(r"^### (.+)$", CHANGELOG, flags=re.MULTILINE))
    assert kinds <= KINDS, kinds - KINDS


def test_the_links_to_stability_and_upgrading_land() -> None:
    operations = anchors((ROOT / "docs" / "operations.md").read_text())
    for text in (CHANGELOG, (ROOT / "README.md").read_text()):
        for anchor in re.findall(r"docs/operations\.md#([\w-]+)", text):
            assert anchor in operations, anchor
    assert "what-is-stable" in operations
    assert "7-upgrading" in operations
