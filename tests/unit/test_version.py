"""`streamwarden --version` says whether the compiled build runs: both builds run this (make test-compiled)."""

from __future__ import annotations

import importlib.machinery
import re

import proxy.exchange.handler as handler
from proxy import __version__
from proxy.cli import compiled, version_line


def test_compiled_is_true_exactly_when_the_running_module_is_an_extension() -> None:
    # What actually got imported, checked another way than cli's (the loaded module's file, not a spec).
    loaded_as_extension = handler.__file__ is not None and handler.__file__.endswith(
        tuple(importlib.machinery.EXTENSION_SUFFIXES)
    )
    assert compiled() is loaded_as_extension


def test_the_version_line_names_the_version_and_the_build() -> None:
    line = version_line()
    assert re.fullmatch(r"streamwarden \S+ \(compiled: (yes|no)\)", line)
    assert line == f"streamwarden {__version__} (compiled: {'yes' if compiled() else 'no'})"
