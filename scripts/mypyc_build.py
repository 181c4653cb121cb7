"""Build the optional mypyc-compiled copy of the proxy's modules in place (`make compiled`, the image).

The .so files land next to the sources and shadow them; `--clean` deletes them (and the C build
tree) to return to the pure-Python build, which behaves the same (`make test-compiled` checks it).
Runs build_ext directly rather than `setup()`, so that setuptools does not read the
hatchling-configured pyproject.toml.
Usage: .venv/bin/python scripts/mypyc_build.py [--clean] [PATH ...]  (default: DEFAULT_PATHS)
"""

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# What `make compiled` builds: the modules an exchange runs through.
DEFAULT_PATHS = ["proxy/core", "proxy/exchange", "proxy/server", "proxy/observe"]
# Left interpreted: mypyc cannot compile a subclass of ConnectionResetError (client_gone), nor a
# class that can be weakly referenced (log_lines: structlog keys its write lock by the file); and
# compile_attrs, whose run-time stand-in for `mypyc_attr` compiled code would take for unreachable.
INTERPRETED = {"proxy/exchange/client_gone.py", "proxy/observe/log_lines.py", "proxy/core/compile_attrs.py"}


def sources(paths: list[str]) -> list[str]:
    """Every module under the given paths, package __init__ files and INTERPRETED left interpreted."""
    found: list[str] = []
    for p in paths:
        path = ROOT / p
        files = [path] if path.is_file() else sorted(path.rglob("*.py"))
        found += [str(f.relative_to(ROOT)) for f in files if f.name != "__init__.py"]
    return [f for f in found if f not in INTERPRETED]


def clean() -> None:
    """Back to the pure build: the modules' .so files, the shared one at the root, the C tree."""
    for so in [*ROOT.glob("*__mypyc*.so"), *(ROOT / "proxy").rglob("*.so")]:
        so.unlink()
    shutil.rmtree(ROOT / "build", ignore_errors=True)


def build(files: list[str]) -> None:
    """One mypyc group (one shared library) for all the files, built in place."""
    from mypyc.build import mypycify
    from setuptools import Distribution

    dist = Distribution({"name": "streamwarden-mypyc", "ext_modules": mypycify(files, opt_level="3")})
    cmd = dist.get_command_obj("build_ext")
    cmd.inplace = True  # type: ignore[attr-defined]
    dist.run_command("build_ext")


def main(argv: list[str]) -> None:
    os.chdir(ROOT)
    if "--clean" in argv:
        clean()
        return
    build(sources(argv or DEFAULT_PATHS))


if __name__ == "__main__":
    main(sys.argv[1:])
