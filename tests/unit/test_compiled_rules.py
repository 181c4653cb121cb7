"""The compiled build's rules (docs/reference.md, "The compiled build"), checked on the source with `ast`
as well as written down: code that breaks one runs in the pure build and fails only compiled.

The modules checked are the ones `scripts/mypyc_build.py` compiles (its own lists, read here).
"""

from __future__ import annotations

import ast
import importlib.util
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _build_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("mypyc_build", ROOT / "scripts" / "mypyc_build.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_BUILD = _build_script()
COMPILED = [ROOT / path for path in _BUILD.sources(_BUILD.DEFAULT_PATHS)]


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_build_compiles_the_exchange_path_and_says_why_it_leaves_a_module_out() -> None:
    assert len(COMPILED) > 50
    script = (ROOT / "scripts" / "mypyc_build.py").read_text()
    for path in _BUILD.INTERPRETED:
        assert (ROOT / path).is_file(), path
        assert Path(path).stem in script.split("INTERPRETED =")[0], f"{path}: no reason given beside INTERPRETED"


def test_one_name_per_caught_exception_type_in_a_function() -> None:
    """Compiled, a name reused for another caught type keeps the first type (mypyc issue 620: a 502
    became a 500): `except A as a` ... `except B as b`."""
    offenders = []
    for path in COMPILED:
        for func in ast.walk(_tree(path)):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            types: dict[str, set[str]] = defaultdict(set)
            for node in ast.walk(func):
                if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                    types[node.name].add(ast.unparse(node.type))
            offenders += [f"{_module(path)}.{func.name}: {name} {sorted(t)}" for name, t in types.items() if len(t) > 1]
    assert not offenders, offenders


def _allows_interpreted_subclasses(node: ast.ClassDef) -> bool:
    return any(
        isinstance(d, ast.Call) and getattr(d.func, "id", None) == "mypyc_attr"
        and any(k.arg == "allow_interpreted_subclasses" and getattr(k.value, "value", False) for k in d.keywords)
        for d in node.decorator_list
    )  # fmt: skip


def test_a_class_subclassed_outside_the_compiled_modules_says_so() -> None:
    """A compiled class that interpreted code subclasses (the tests, the workers, the tools) carries
    `@mypyc_attr(allow_interpreted_subclasses=True)`; without it the subclass fails at import, compiled."""
    compiled = {_module(path): path for path in COMPILED}
    classes: dict[tuple[str, str], ast.ClassDef] = {}
    for module, path in compiled.items():
        for node in _tree(path).body:
            if isinstance(node, ast.ClassDef):
                classes[(module, node.name)] = node
    interpreted = [p for p in [*ROOT.joinpath("proxy").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py")]
                   if _module(p) not in compiled]  # fmt: skip
    offenders = []
    for path in interpreted:
        tree = _tree(path)
        imported = {
            alias.asname or alias.name: (node.module, alias.name)
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names
        }  # fmt: skip
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                origin = imported.get(base.id) if isinstance(base, ast.Name) else None
                target = classes.get(origin) if origin is not None else None
                if target is not None and not _allows_interpreted_subclasses(target):
                    offenders.append(f"{path.relative_to(ROOT)}: {node.name}({origin[0]}.{origin[1]})")
    assert not offenders, offenders
