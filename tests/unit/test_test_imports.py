"""No test imports the `tests` package: a bare `pytest` against a non-editable install must collect.

`tests/` is not a package on `sys.path` there; shared helpers are `support` (tests/support/) and a
folder's own helper modules are imported as siblings (`from hostile import ...`).
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_imports_the_tests_package() -> None:
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{number}: {line.strip()}"
        for path in sorted(TESTS.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.match(r"\s*(from|import)\s+tests(\.|\s|$)", line)
    ]
    assert not offenders, "import `support` or a sibling module instead:\n" + "\n".join(offenders)
