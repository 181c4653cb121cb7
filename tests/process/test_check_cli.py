"""`streamwarden check` as a user runs it: against a port where nothing listens, with bad arguments,
and end to end against a `streamwarden fake-upstream --quirk` process, with its JSON report."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from proxy.tools.check.report import PROBE_IDS
from proxy.tools.fake.quirks import QUIRKS

PY = sys.executable
ENV = {k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_")}


def streamwarden(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "proxy", *argv], capture_output=True, text=True, timeout=120, env=env or ENV)


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A port bound but never listening: connecting is refused, and nobody else can take it meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def test_nothing_listening_is_one_line_and_exit_2(dead_port: int, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    done = streamwarden("check", "--upstream", f"http://127.0.0.1:{dead_port}", "--json", str(report))
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"streamwarden check: cannot reach http://127.0.0.1:{dead_port}: connection refused (nothing listens there)"
    ]
    assert not report.exists()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], "--upstream"),
        (["--upstream", "localhost:8000"], "--upstream must be an http"),
        (["--upstream", "http://127.0.0.1:9/?x=1"], "root URL"),
        (["--upstream", "http://127.0.0.1:9/v1"], "without /v1"),
        (["--upstream", "http://127.0.0.1:9", "--timeout", "0"], "--timeout"),
        (["--upstream", "http://127.0.0.1:9", "--json", "/no/such/dir/r.json"], "--json"),
        (["--upstream", "http://127.0.0.1:9", "--model", " "], "--model"),
    ],
)
def test_bad_arguments_exit_2_with_one_clear_line(argv: list[str], words: str) -> None:
    done = streamwarden("check", *argv)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, done.stderr
    assert words in errors[0]
    assert "Traceback" not in done.stderr


def test_an_unknown_quirk_is_refused_by_name() -> None:
    done = streamwarden("fake-upstream", "--quirk", "flaky")
    assert done.returncode == 2
    assert "unknown quirk 'flaky'; known quirks: no_done" in done.stderr
    assert "Traceback" not in done.stderr
    done = streamwarden("fake-upstream", "--fast", "--quirk", "no_done")
    assert done.returncode == 2
    assert "--quirk does not apply to --fast" in done.stderr


@contextlib.contextmanager
def fake_process(*argv: str, env: dict[str, str] | None = None) -> Iterator[str]:
    proc = subprocess.Popen(
        [PY, "-m", "proxy", "fake-upstream", "--port", "0", "--token-rate", "200", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or ENV,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the fake prints its URL once it listens
        found = re.search(r"listening on (http://\S+)", line)
        assert found, line
        yield found.group(1)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # reads and closes its stdout


def test_the_report_as_a_user_gets_it(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    with fake_process("--quirk", "conversation_replay") as url:
        done = streamwarden("check", "--upstream", url, "--json", str(report))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    data = orjson.loads(report.read_bytes())
    assert data["upstream"] == url
    assert data["model"] == "fake-model"
    assert [p["id"] for p in data["probes"]] == list(PROBE_IDS)
    results = {p["id"]: p["result"] for p in data["probes"]}
    assert results["abort.conversation_replay"] == "quirk"
    assert [r for r in results.values() if r != "ok"] == ["quirk"]
    assert data["recommended_flags"] == ["--cancel-hook llama-conversation", "--health-path /health"]
    rows = done.stdout.splitlines()
    assert rows[0] == f"streamwarden check: {url}"
    for probe, result in results.items():
        assert any(row.startswith(probe) and f" {result} " in row for row in rows), probe
    assert rows[-1] == "recommended serve flags: --cancel-hook llama-conversation --health-path /health"


def test_a_report_where_no_dialect_answered_is_a_failure(tmp_path: Path) -> None:
    """Every dialect failed, yet `check` said "none beyond the defaults" and exited 0."""
    report = tmp_path / "report.json"
    with fake_process("--quirk", "health_lies") as url:  # every generation request gets 503
        done = streamwarden("check", "--upstream", url, "--json", str(report))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "none beyond the defaults" not in done.stdout
    assert done.stdout.splitlines()[-1].startswith("check failed: no dialect answered a plain request")
    assert done.stderr.splitlines() == [f"streamwarden check: {url}: " + done.stdout.splitlines()[-1]]
    results = {p["id"]: p["result"] for p in orjson.loads(report.read_bytes())["probes"]}
    assert all(results[f"dialect.{d}"] == "fail" for d in ("chat_completions", "completions", "responses", "messages"))


def test_two_quirks_are_refused_and_help_lists_every_quirk() -> None:
    done = streamwarden("fake-upstream", "--quirk", "cut", "--quirk", "no_done")
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == ["streamwarden fake-upstream: error: --quirk: one quirk at a time (each is a whole backend's "
                      "behaviour), got cut, no_done"]
    shown = streamwarden("fake-upstream", "--help").stdout
    listed = shown[shown.index("quirks (--quirk NAME"):]
    for name in QUIRKS:
        assert re.search(rf"^  {name} +\S", listed, re.MULTILINE), name
