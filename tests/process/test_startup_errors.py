"""A start that cannot happen says so in one line and exits 2; `--help` stands alone.

Each case runs the real command (`python -m proxy`) and reads everything it wrote: one line on stderr,
nothing on stdout, no traceback, no "Unclosed client session", exit code 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.ports import free_port, held_port

from proxy.cli import main
from proxy.config import SERVE_FLAGS
from proxy.tools.fake import describe

PY = sys.executable
WAIT = 30


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_")}
    return subprocess.run([PY, "-m", "proxy", *argv], capture_output=True, text=True, timeout=WAIT,
                          env={**clean, **(env or {})}, check=False)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def serve(*flags: str) -> list[str]:
    return ["serve", "--upstream", "http://127.0.0.1:9", "--host", "127.0.0.1", *flags]


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("busy", ["--port", "--admin-port"])
def test_a_busy_port_is_one_line_and_exit_2(busy: str, workers: str) -> None:
    with held_port() as port:
        other = "--admin-port" if busy == "--port" else "--port"
        line = one_line(run(*serve(busy, str(port), other, str(free_port()), "--workers", workers)))
    assert line == f"streamwarden serve: cannot listen on 127.0.0.1:{port} ({busy}): address already in use"


def test_an_upstream_host_that_does_not_resolve_is_one_line_and_exit_2() -> None:
    done = run("serve", "--upstream", "http://no-such-backend.invalid:8000", "--host", "127.0.0.1",
               "--port", str(free_port()), "--admin-port", str(free_port()))
    line = one_line(done)
    assert line.startswith("streamwarden serve: cannot resolve the --upstream host 'no-such-backend.invalid': ")


def test_a_malformed_upstream_names_the_flag() -> None:
    done = run("serve", "--upstream", "localhost:8000")
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == ["streamwarden serve: error: argument --upstream: expected an http:// or https:// URL such as "
                      "http://127.0.0.1:8000, got 'localhost:8000'"]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("given", "root"), [("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
                                           ("http://gw:8000/openai/v1/", "http://gw:8000/openai")])
def test_an_upstream_ending_in_v1_is_refused_saying_what_to_write(given: str, root: str) -> None:
    """`--upstream http://HOST:PORT/v1` (what OPENAI_BASE_URL looks like) went ready and 404'd
    every request; `check` already refused it. Refused from the variable too."""
    for done in (run("serve", "--upstream", given), run("serve", env={"STREAMWARDEN_UPSTREAM": given})):
        assert done.returncode == 2
        errors = [line for line in done.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1, done.stderr
        assert "--upstream" in errors[0]
        assert "without /v1" in errors[0]
        assert f"write {root})" in errors[0]
        assert "Traceback" not in done.stderr


def test_no_writable_directory_for_the_workers_metrics_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    """As root every directory is writable, so the unusable one is a file where a directory is due."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(not_a_dir))
    for name in list(os.environ):
        if name.startswith("STREAMWARDEN_"):
            monkeypatch.delenv(name)
    code = main(serve("--port", str(free_port()), "--admin-port", str(free_port()), "--workers", "2"))
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    (line,) = err.splitlines()
    assert line.startswith("streamwarden serve: --workers needs a writable directory for its metrics files: ")
    assert "TMPDIR" in line
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ, "nothing was switched before the failure"


def test_the_fake_upstream_on_a_busy_port_is_one_line_and_exit_2() -> None:
    with held_port() as port:
        line = one_line(run("fake-upstream", "--port", str(port)))
    assert line.startswith(f"streamwarden fake-upstream: cannot listen on 127.0.0.1:{port}: ")


# --- help that stands alone ---------------------------------------------------------------------------


def test_serve_help_names_each_kind_of_value_and_lists_the_choices() -> None:
    done = run("serve", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "VALUE" not in text
    for shown in ("--upstream URL", "--port PORT", "--idle-timeout SECONDS", "--max-body-size SIZE",
                  "--log-format {json,console}", "--log-level {debug,info,warning,error}",
                  "--on-abandon {cancel,drain}", "--workers N|auto", "--cancel-hook HOOK"):
        assert shown in text, shown
    for flag in SERVE_FLAGS:
        assert f"--{flag} " in text


def test_fake_upstream_help_lists_every_scenario() -> None:
    done = run("fake-upstream", "--help")
    assert done.returncode == 0
    scenarios = done.stdout.split("scenarios", 1)[1].split("\nquirks", 1)[0]  # the quirks follow
    listed = {line.split()[0] for line in scenarios.splitlines()[1:] if line.strip()}
    assert listed == {row.name for row in describe()}
    assert "x-fault: NAME" in done.stdout
