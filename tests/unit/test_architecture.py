"""The package's layout holds: imports point one way, into the sans-IO core, and never into the tools.

Read from the source with `ast`, so a violation fails here before it shows up as a cycle at import
time or as a runtime that loads the benchmark. The layers (docs/architecture.md): core <- observe <-
exchange <- server <- workers <- cli; `config` and the package root are leaves every layer may use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "proxy"
NO_IO = {"asyncio", "aiohttp", "uvloop", "socket", "selectors", "prometheus_client"}  # (the core: no I/O, no metrics)
# What each sub-package may import of the package besides itself (the top-level leaves are always allowed).
LEAVES = {"proxy", "proxy.config"}
ALLOWED = {
    "proxy.core": set(),
    "proxy.observe": {"proxy.core"},
    "proxy.exchange": {"proxy.core", "proxy.observe"},
    "proxy.server": {"proxy.core", "proxy.observe", "proxy.exchange"},
    "proxy.workers": {"proxy.core", "proxy.observe", "proxy.exchange", "proxy.server"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute or relative, at the top or inside a function)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)  # `from proxy import x` may name a module
    return found


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or f"{module}" in ALLOWED else module


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("proxy.core")))
def test_the_core_does_no_io_and_imports_only_the_core(module: str) -> None:
    imported = _imports(MODULES[module])
    assert not {m.split(".")[0] for m in imported} & NO_IO, f"{module} imports I/O: {sorted(imported)}"
    outside = {m for m in GRAPH[module] if not m.startswith("proxy.core")}
    assert not outside, f"{module} imports outside the core: {sorted(outside)}"


def test_imports_point_one_way() -> None:
    wrong = []
    for module, targets in GRAPH.items():
        layer = _layer(module)
        if layer not in ALLOWED:
            continue
        for target in targets:
            target_layer = _layer(target)
            if target_layer != layer and target not in LEAVES and target_layer not in ALLOWED[layer]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_nothing_outside_the_tools_and_the_cli_imports_the_tools() -> None:
    wrong = [
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if not module.startswith("proxy.tools") and module != "proxy.cli"
        for target in targets
        if target.startswith("proxy.tools")
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_config_is_a_leaf() -> None:
    assert GRAPH["proxy.config"] <= {"proxy"}, sorted(GRAPH["proxy.config"])


def test_there_is_no_import_cycle() -> None:
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        seen[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if seen.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in seen and (cycle := visit(target)):
                return cycle
        path.pop()
        seen[module] = 2
        return None

    for module in sorted(GRAPH):
        if module not in seen and (cycle := visit(module)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_proxys_own_error_is_written_in_one_place() -> None:
    """`reply.write_error` writes every error the proxy words; the only other whole response is an
    upstream body passed on as it came (exchange/whole.py)."""
    callers = {
        _module_name(path)
        for path in PACKAGE.rglob("*.py")
        if "tools" not in path.parts and ".whole_now(" in path.read_text(encoding="utf-8")
    }
    assert callers == {"proxy.exchange.reply", "proxy.exchange.whole"}
    whole = (PACKAGE / "exchange" / "whole.py").read_text(encoding="utf-8")
    assert whole.count(".whole_now(") == 1
    assert "error_body(" not in whole
