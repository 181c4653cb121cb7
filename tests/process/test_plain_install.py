"""A plain `pip install .` into a fresh venv, as a newcomer does it.

Every console subcommand either works or says in one line which extra to install and exits 2. The venv
has none of the extras, so this also shows that nothing outside `[project] dependencies` is imported by
`serve`, `fake-upstream` or `bench`. Installing takes a while (a wheel build and the dependencies from
the configured index or pip's cache), so the venv is made once per session.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support.installed import ROOT, clean_env, fresh_venv, serve_smoke

INSTALL_TIMEOUT = 600


@pytest.fixture(scope="session")
def plain_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin/ of a fresh venv holding `pip install .` and nothing else."""
    return fresh_venv(tmp_path_factory.mktemp("plain-venv"), str(ROOT), timeout=INSTALL_TIMEOUT)


def _run(bin_dir: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    argv = (str(bin_dir / "streamwarden"), *argv)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=clean_env(), cwd="/")


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT + 60)
def test_plain_install_has_no_extras(plain_bin: Path) -> None:
    """The premise of the tests below: the SDKs come only with extras; the data plane's parser and loop
    (httptools, and uvloop on Linux) are plain dependencies."""
    for module in ("openai", "anthropic", "pytest"):
        done = subprocess.run([str(plain_bin / "python"), "-c", f"import {module}"], capture_output=True, timeout=30)
        assert done.returncode != 0, f"{module} is installed by a plain `pip install .`"
    for module in ("httptools", "uvloop"):
        done = subprocess.run([str(plain_bin / "python"), "-c", f"import {module}"], capture_output=True, timeout=30)
        assert done.returncode == 0, f"{module} is not installed by a plain `pip install .`"


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT + 60)
def test_plain_install_is_the_pure_build(plain_bin: Path) -> None:
    """`pip install .` builds the py3-none-any wheel: the compiled wheel's hook is off by default, and the
    extensions `make compiled` may have left in the checkout (ignored by git) stay out of it."""
    script = "import proxy.exchange.handler as h; print(h.__file__)"
    done = subprocess.run([str(plain_bin / "python"), "-c", script], capture_output=True, text=True, timeout=30,
                          env=clean_env(), cwd="/")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("/site-packages/proxy/exchange/handler.py")
    site = Path(done.stdout.strip()).parents[2]
    assert list(site.glob("*.so")) == []
    assert list((site / "proxy").rglob("*.so")) == []


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT + 60)
def test_demo_names_its_extra_in_one_line_and_exits_2(plain_bin: Path) -> None:
    done = _run(plain_bin, "demo")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "streamwarden demo: needs the 'openai' package: pip install 'streamwarden[demo]'"
    ]
    assert done.stdout == ""


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT + 60)
def test_serve_and_fake_upstream_work(plain_bin: Path) -> None:
    serve_smoke(plain_bin)


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT + 120)
def test_bench_works(plain_bin: Path) -> None:
    done = _run(plain_bin, "bench", "--quick", "--scenarios", "b,c,abandon", timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "b: 16 concurrent streams" in done.stdout
    assert "requests/s" in done.stdout
    assert "client closes -> the upstream sees its connection close" in done.stdout

