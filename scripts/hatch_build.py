"""The compiled wheel's build hook (hatchling's `custom` hook; pyproject.toml, `make wheel`).

Off by default, so `pip install .`, `pip wheel .` and an sdist build the pure `py3-none-any` wheel;
HATCH_BUILD_HOOK_ENABLE_CUSTOM=1 switches it on. It then compiles scripts/mypyc_build.py's module
list with mypyc (the same list and exceptions as `make compiled`) into a scratch directory and adds the
extensions to the wheel beside the modules they shadow, the shared library at the top of it, and the
wheel is tagged for the running interpreter and platform (e.g. cp311-cp311-linux_x86_64). The sources
stay in the wheel too: the compiled-out modules are shadowed, the interpreted ones are imported as usual.
"""

from __future__ import annotations

import runpy
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class MypycBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        mypyc_build = runpy.run_path(str(Path(self.root) / "scripts" / "mypyc_build.py"))
        self._out = Path(tempfile.mkdtemp(prefix="streamwarden-mypyc-"))
        built = mypyc_build["build"](mypyc_build["sources"](mypyc_build["DEFAULT_PATHS"]), self._out)
        self.app.display_info(f"streamwarden: compiled {len(built)} extensions with mypyc")
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        build_data["force_include"].update({str(self._out / so): str(so) for so in built})

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        out = getattr(self, "_out", None)
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)
