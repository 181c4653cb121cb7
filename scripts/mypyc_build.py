"""Build the optional mypyc-compiled copy of the proxy's modules (`make compiled`, `make wheel`, the image).

The one list of what is compiled (DEFAULT_PATHS less INTERPRETED), read by both ways of building it:
- in place (`make compiled`): the .so files land next to the sources and shadow them; `--clean` deletes
  them (and the C build tree) to return to the pure-Python build, which behaves the same (`make
  test-compiled` checks it);
- into a directory (`--out DIR`), the source tree untouched: what scripts/hatch_build.py, the
  hatchling build hook of the compiled wheel, puts into the wheel beside the modules they shadow.
Runs build_ext directly rather than `setup()`, so that setuptools does not read the
hatchling-configured pyproject.toml.
Usage: .venv/bin/python scripts/mypyc_build.py [--clean | --out DIR] [PATH ...]  (default: DEFAULT_PATHS)
"""

import os
import shutil
import sys
import tempfile
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


def build(files: list[str], out: Path | None = None) -> list[Path]:
    """One mypyc group (one shared library) for all the files: in place, or into `out` (the C tree and
    mypy's cache then in a temporary directory, so that nothing is written into the checkout).
    Returns the extensions built, relative to where they landed."""
    from mypyc.build import mypycify
    from setuptools import Distribution

    here = os.getcwd()
    os.chdir(ROOT)  # mypy reads pyproject.toml's [tool.mypy] from the working directory
    try:
        with tempfile.TemporaryDirectory(prefix="mypyc-") as scratch:
            # mypyc type-checks for the running Python, not pyproject's python_version (3.11, `make lint`'s):
            # an ignore only 3.11 needs (speedups.py) is unused on 3.12 and no error for the build.
            mypy_args = ["--no-warn-unused-ignores"]
            if out is None:
                extensions = mypycify([*mypy_args, *files], opt_level="3")
            else:
                mypy_args.append(f"--cache-dir={scratch}/mypy-cache")
                extensions = mypycify([*mypy_args, *files], opt_level="3", target_dir=f"{scratch}/c")
            dist = Distribution({"name": "streamwarden-mypyc", "ext_modules": extensions})
            cmd = dist.get_command_obj("build_ext")
            if out is None:
                cmd.inplace = True  # type: ignore[attr-defined]
            else:
                cmd.build_lib = str(out)  # type: ignore[attr-defined]
                cmd.build_temp = f"{scratch}/temp"  # type: ignore[attr-defined]
            dist.run_command("build_ext")
            built = [Path(cmd.get_ext_fullpath(ext.name)) for ext in extensions]  # type: ignore[attr-defined]
            return [p.resolve().relative_to((out or ROOT).resolve()) for p in built]
    finally:
        os.chdir(here)


def main(argv: list[str]) -> None:
    if "--clean" in argv:
        clean()
        return
    out = None
    if "--out" in argv:
        at = argv.index("--out")
        out = Path(argv[at + 1]).resolve()
        argv = argv[:at] + argv[at + 2 :]
    for so in build(sources(argv or DEFAULT_PATHS), out):
        print(so)


if __name__ == "__main__":
    main(sys.argv[1:])
