"""Build an optional mypyc-compiled copy of the proxy's modules in place, for measurement.

The .so files land next to the sources and shadow them; `--clean` deletes them (and the C build
tree) to return to the pure-Python build. Runs build_ext directly rather than `setup()`, so that
setuptools does not read the hatchling-configured pyproject.toml.
Usage: .venv/bin/python scripts/mypyc_build.py [--clean] [PATH ...]  (default: proxy/core)
"""

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sources(paths: list[str]) -> list[str]:
    """Every module under the given paths, package __init__ files left interpreted."""
    found: list[str] = []
    for p in paths:
        path = ROOT / p
        files = [path] if path.is_file() else sorted(path.rglob("*.py"))
        found += [str(f.relative_to(ROOT)) for f in files if f.name != "__init__.py"]
    return found


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
    build(sources(argv or ["proxy/core"]))


if __name__ == "__main__":
    main(sys.argv[1:])
