"""The llama-server tier: the binary (found in the cache or built), models made now, servers by PID.

`.ci/run` (CI=true) and `make test-real` must run this tier: with CI set, or STREAMWARDEN_BUILD_LLAMA=1,
a missing binary is built before the first test (7 to 10 minutes on 2 cores; the build is not counted
against any test's timeout), and a binary that cannot be had fails the tier. A local `make test`
without the binary skips it with one line saying how to get it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llama import CHARS, TINY, WIDE, LlamaServer, binary_path, build_binary, write_model


def _required() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes") or os.environ.get("STREAMWARDEN_BUILD_LLAMA") == "1"


_NOT_RUN = pytest.StashKey[str]()
_LLAMA_FIXTURES = frozenset({"llama", "llama_wide", "llama_chars", "llama_binary"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Build the binary once, before any llama test starts (so no per-test timeout covers the build);
    locally, without it, leave the tier out and say so in one line."""
    mine = [item for item in items if _LLAMA_FIXTURES & set(getattr(item, "fixturenames", ()))]
    if not mine or binary_path().exists():
        return
    if _required():
        build_binary()
        return
    config.hook.pytest_deselected(items=mine)
    items[:] = [item for item in items if item not in mine]
    config.stash[_NOT_RUN] = (
        f"llama-server tier: {len(mine)} tests not run: llama-server is not built "
        "(`make test-real` builds it, 7-10 min on 2 cores, and runs them)"
    )


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if _NOT_RUN in config.stash:
        terminalreporter.write_line("SKIPPED " + config.stash[_NOT_RUN], yellow=True)


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


def _serve(binary: Path, model: Path, log: Path) -> Iterator[LlamaServer]:
    # No prompt cache: the direct and the proxied request must be computed alike (usage included).
    try:
        server = LlamaServer.start(binary, model, log, "--no-cache-prompt")
    except (RuntimeError, subprocess.SubprocessError) as exc:
        pytest.fail(str(exc))
    try:
        yield server
    finally:
        server.stop()


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
