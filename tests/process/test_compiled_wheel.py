"""The mypyc-compiled wheel (`make wheel`'s second one) installed into a fresh venv, as pip installs it.

The wheel is built from the checkout with the hook switched on (HATCH_BUILD_HOOK_ENABLE_CUSTOM=1, in pip's
isolated build environment at the constraints' versions, as `make wheel` builds it); the venv gets it and
the runtime dependencies, no mypy. The installed modules must be the extensions of scripts/mypyc_build.py's
list (its interpreted exceptions left as sources), and the loopback smoke must pass on them.
Building compiles the proxy's modules (1-4 min on a busy 2-core machine), so the venv is made once.
"""

from __future__ import annotations

import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from support.installed import CONSTRAINTS, ROOT, clean_env, fresh_venv, serve_smoke

BUILD_TIMEOUT = 900

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(2 * BUILD_TIMEOUT + 60),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) to build the compiled wheel with"),
]


@pytest.fixture(scope="session")
def compiled_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin/ of a fresh venv holding the compiled wheel of the checkout and its runtime dependencies."""
    wheels = tmp_path_factory.mktemp("compiled-wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--build-constraint", str(CONSTRAINTS),
             "--wheel-dir", str(wheels), str(ROOT)]  # fmt: skip
    done = subprocess.run(build, capture_output=True, text=True, timeout=BUILD_TIMEOUT,
                          env=clean_env(HATCH_BUILD_HOOK_ENABLE_CUSTOM="1"), cwd=wheels)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = wheels.glob("streamwarden-*.whl")
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert wheel.name.split("-")[2:4] == [tag, tag], f"not a {tag} wheel: {wheel.name}"
    assert not wheel.name.endswith("-any.whl")
    home = tmp_path_factory.mktemp("compiled-venv")
    return fresh_venv(home, "-c", str(CONSTRAINTS), str(wheel), timeout=BUILD_TIMEOUT)


def test_installed_modules_are_the_compiled_list(compiled_bin: Path) -> None:
    """Every module of scripts/mypyc_build.py's list is imported from its extension; its interpreted
    exceptions, and the modules outside the list (the CLI), from their sources. No mypy at run time."""
    build = runpy.run_path(str(ROOT / "scripts" / "mypyc_build.py"))
    compiled = build["sources"](build["DEFAULT_PATHS"])
    interpreted = sorted(build["INTERPRETED"])
    assert compiled
    assert "proxy/exchange/handler.py" in compiled
    names = [path.removesuffix(".py").replace("/", ".") for path in [*compiled, *interpreted, "proxy/cli.py"]]
    script = ("import importlib, json, sys; "
              "print(json.dumps({n: importlib.import_module(n).__file__ for n in sys.argv[1:]}))")
    done = subprocess.run([str(compiled_bin / "python"), "-c", script, *names], capture_output=True, text=True,
                          timeout=60, env=clean_env(), cwd="/")  # fmt: skip
    assert done.returncode == 0, done.stderr
    files: dict[str, str] = orjson.loads(done.stdout)
    site = str(compiled_bin.parent)
    assert all(f.startswith(site) for f in files.values()), files  # the venv's copy, not the checkout's
    assert [n for n in names[: len(compiled)] if not files[n].endswith(".so")] == []
    assert [n for n in names[len(compiled) :] if not files[n].endswith(".py")] == []
    mypy = subprocess.run([str(compiled_bin / "python"), "-c", "import mypy"], capture_output=True, timeout=60)
    assert mypy.returncode != 0, "mypy is installed with the compiled wheel"


def test_serve_and_fake_upstream_work_compiled(compiled_bin: Path) -> None:
    serve_smoke(compiled_bin)
