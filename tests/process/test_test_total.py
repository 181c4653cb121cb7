"""`make test` ends with one total line, "N passed, M skipped", summing its two pytest runs (the
README's promise, and what CI reads): scripts/test_total.py on real pytest runs of small test files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "test_total.py"

FIRST = """
import pytest

def test_a(): pass
def test_b(): pass
@pytest.mark.skip(reason="x")
def test_c(): pass
"""
SECOND = """
import pytest

def test_d(): pass
@pytest.mark.skip(reason="y")
def test_e(): pass
@pytest.mark.skip(reason="z")
def test_f(): pass
"""
FAILING = "def test_g(): assert False\n"


def total(tmp_path: Path, *files: str) -> subprocess.CompletedProcess[str]:
    commands = []
    for i, text in enumerate(files):
        path = tmp_path / f"test_part{i}.py"
        path.write_text(text)
        # -p no:cacheprovider and an empty rootdir config: the runs know nothing of this project's setup
        commands.append(f"{sys.executable} -m pytest -q -p no:cacheprovider -c /dev/null --rootdir {tmp_path} {path}")
    return subprocess.run([sys.executable, str(SCRIPT), *commands], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)


def test_the_last_line_sums_both_runs(tmp_path: Path) -> None:
    done = total(tmp_path, FIRST, SECOND)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "3 passed, 3 skipped"
    assert sum("passed" in line for line in lines) == 3  # each run's own summary went through, then the sum


def test_a_run_that_selects_nothing_counts_as_a_pass(tmp_path: Path) -> None:
    done = total(tmp_path, FIRST, "")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "2 passed, 1 skipped"


def test_a_failure_is_named_first_and_fails_the_whole(tmp_path: Path) -> None:
    done = total(tmp_path, FAILING, SECOND)
    assert done.returncode == 1
    assert done.stdout.splitlines()[-1] == "1 failed, 1 passed, 2 skipped"
