"""`mypyc_attr` for the modules a compiled build compiles (scripts/mypyc_build.py), without
mypy_extensions at run time: mypyc reads the decorator when it compiles (this module itself stays
interpreted), and wherever the code runs, compiled or not, the decorator changes nothing.
"""

from typing import TYPE_CHECKING

__all__ = ["mypyc_attr"]

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr
else:

    def mypyc_attr(*_names, **_values):
        return lambda cls: cls
