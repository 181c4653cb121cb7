"""The real tiers: llama-server (the binary found in the cache or built) and vLLM (the CPU build set up
in a cached venv), models made now, servers by PID.

`.ci/run` (CI=true) and `make test-real` must run this tier: with CI set, or STREAMWARDEN_BUILD_LLAMA=1,
a missing binary is built before the first test (7 to 10 minutes on 2 cores; the build is not counted
against any test's timeout), and a binary that cannot be had fails the tier. A local `make test`
without the binary skips it with one line saying how to get it. The vLLM tier alike: CI, or
STREAMWARDEN_SETUP_VLLM=1 (`make test-real`), sets up a missing vLLM (`scripts/setup-vllm.sh`, about
100 s cold) before the first test and fails when it cannot; a local `make test` without it skips.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import vllm_tier
from llama import CHARS, TINY, WIDE, LlamaServer, binary_path, build_binary, write_model
from support.backend import BackendProcess
from vllm_tier import VllmServer

Server = TypeVar("Server", bound=BackendProcess)


def _required() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes") or os.environ.get("STREAMWARDEN_BUILD_LLAMA") == "1"


def _vllm_required() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes") or os.environ.get("STREAMWARDEN_SETUP_VLLM") == "1"


_NOT_RUN = pytest.StashKey[list[str]]()
_LLAMA_FIXTURES = frozenset({"llama", "llama_wide", "llama_chars", "llama_binary"})
_VLLM_FIXTURES = frozenset({"vllm_python", "vllm_model", "vllm_server", "vllm_victim"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Build the binary once, before any llama test starts (so no per-test timeout covers the build);
    locally, without it, leave the tier out and say so in one line."""
    config.stash[_NOT_RUN] = []
    mine = [item for item in items if _LLAMA_FIXTURES & set(getattr(item, "fixturenames", ()))]
    if mine and not binary_path().exists():
        if _required():
            build_binary()
        else:
            _leave_out(
                config,
                items,
                mine,
                "llama-server tier: {} tests not run: llama-server is not built "
                "(`make test-real` builds it, 7-10 min on 2 cores, and runs them)",
            )
    mine = [item for item in items if _VLLM_FIXTURES & set(getattr(item, "fixturenames", ()))]
    if mine and not vllm_tier.installed():
        if _vllm_required():
            vllm_tier.set_up()
        else:
            _leave_out(
                config,
                items,
                mine,
                "vLLM tier: {} tests not run: vLLM is not set up "
                "(`make test-real` sets it up, about 100 s and 2.5 GB, and runs them)",
            )


def _leave_out(config: pytest.Config, items: list[pytest.Item], mine: list[pytest.Item], why: str) -> None:
    config.hook.pytest_deselected(items=mine)
    items[:] = [item for item in items if item not in mine]
    config.stash[_NOT_RUN].append(why.format(len(mine)))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    for line in config.stash.get(_NOT_RUN, []):
        terminalreporter.write_line("SKIPPED " + line, yellow=True)


@pytest.fixture(scope="session")
def llama_binary() -> Path:
    path = binary_path()
    if path.exists():
        return path
    if _required():
        pytest.fail(f"llama-server is not at {path} and could not be built (scripts/build-llama-server.sh)")
    pytest.skip("llama-server is not built: `make test-real` builds it (7-10 min) and runs this tier")


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    return {
        "tiny": write_model(folder / "tiny.gguf", TINY),
        "wide": write_model(folder / "wide.gguf", WIDE),
        "chars": write_model(folder / "chars.gguf", CHARS),
    }


def _serving(start: Callable[[], Server]) -> Iterator[Server]:
    """A fixture's server: a start that fails fails the test with the server's log; stopped after."""
    try:
        server = start()
    except (RuntimeError, subprocess.SubprocessError) as exc:
        pytest.fail(str(exc))
    try:
        yield server
    finally:
        server.stop()


def _serve(binary: Path, model: Path, log: Path) -> Iterator[LlamaServer]:
    # No prompt cache: the direct and the proxied request must be computed alike (usage included).
    yield from _serving(lambda: LlamaServer.start(binary, model, log, "--no-cache-prompt"))


@pytest.fixture(scope="session")
def llama(
    llama_binary: Path, models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """The tiny model (about 0.3 MB, thousands of tokens/s): equality and fault tests."""
    yield from _serve(llama_binary, models["tiny"], tmp_path_factory.mktemp("logs") / "llama-tiny.log")


@pytest.fixture(scope="session")
def llama_wide(
    llama_binary: Path, models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """The wider model (milliseconds per token): cancellation and busy-slot tests."""
    yield from _serve(llama_binary, models["wide"], tmp_path_factory.mktemp("logs") / "llama-wide.log")


@pytest.fixture(scope="session")
def llama_chars(
    llama_binary: Path, models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """A tiny model that only says single characters: any text it wrote tokenizes back into the same tokens."""
    yield from _serve(llama_binary, models["chars"], tmp_path_factory.mktemp("logs") / "llama-chars.log")


# ---- vLLM ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    path = vllm_tier.python_path()
    if vllm_tier.installed():
        return path
    if _vllm_required():
        pytest.fail(f"vLLM is not set up at {path} and could not be (scripts/setup-vllm.sh)")
    pytest.skip("vLLM is not set up: `make test-real` sets it up (about 100 s) and runs this tier")


@pytest.fixture(scope="session")
def vllm_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return vllm_tier.write_model(vllm_python, tmp_path_factory.mktemp("vllm") / "tiny-llama")
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"could not write the vLLM model: {exc.stderr!r}")


def _serve_vllm(python: Path, model: Path, log: Path) -> Iterator[VllmServer]:
    yield from _serving(lambda: VllmServer.start(python, model, log))


@pytest.fixture(scope="session")
def vllm_server(vllm_python: Path, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One vLLM for the tier (about 20 s to start, 3 GB): every test but the one that kills its engine."""
    yield from _serve_vllm(vllm_python, vllm_model, tmp_path_factory.mktemp("logs") / "vllm.log")


@pytest.fixture
def vllm_victim(vllm_python: Path, vllm_model: Path, tmp_path: Path) -> Iterator[VllmServer]:
    """A vLLM of its own, for the test that kills its engine (vLLM exits after that)."""
    yield from _serve_vllm(vllm_python, vllm_model, tmp_path / "vllm-victim.log")
