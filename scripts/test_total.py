"""`make test`'s runs of pytest, one after the other, and one total line at the end.

Each argument is one pytest command line (a string, split on spaces). Their output goes through as it
comes; the last line printed is the sum of their summaries, "N passed, M skipped" (with the failed and
erroring tests named first when there are any), which is what CI and a reader look for. A run that
selects nothing (pytest's exit 5: the real tier without its binaries) counts as a pass. The exit status
is the first failing run's, else 0. Standard library only.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

NO_TESTS = 5  # pytest: no test was selected
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)\b")
_SUMMARY = re.compile(r"^=*\s*(?:\d+ \w+(?:, )?)+.* in [\d.]+s")
ORDER = ("failed", "errors", "passed", "skipped", "xfailed", "xpassed")

__all__ = ["summarise", "total_line"]


def summarise(lines: list[str]) -> dict[str, int]:
    """The counts of pytest's last summary line ("=== 3 passed, 1 skipped in 2.0s ===", or -q's)."""
    for line in reversed(lines):
        if _SUMMARY.match(line.strip()) or line.strip().startswith("no tests ran"):
            counts: dict[str, int] = {}
            for number, word in _COUNT.findall(line):
                key = "errors" if word.startswith("error") else word
                counts[key] = counts.get(key, 0) + int(number)
            return counts
    return {}


def total_line(runs: list[dict[str, int]]) -> str:
    total = {key: sum(run.get(key, 0) for run in runs) for key in ORDER}
    parts = [f"{total[k]} {k}" for k in ("failed", "errors") if total[k]]
    parts += [f"{total['passed']} passed", f"{total['skipped']} skipped"]
    parts += [f"{total[k]} {k}" for k in ("xfailed", "xpassed") if total[k]]
    return ", ".join(parts)


def main(commands: list[str]) -> int:
    runs, status = [], 0
    for command in commands:
        proc = subprocess.Popen(shlex.split(command), stdout=subprocess.PIPE, text=True, errors="replace")
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail = [*tail[-19:], line]
        code = proc.wait()
        runs.append(summarise(tail))
        if code not in (0, NO_TESTS) and status == 0:
            status = code
    print(total_line(runs), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
