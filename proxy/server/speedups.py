"""What the serving process changes in its interpreter for speed, and nothing else.

Python 3.11's `EnumType` defines `__getattr__`, so every attribute lookup on every enum class
(`State.OPEN`, `Reason.COMPLETE`: about fifty per request on the proxy's path) goes through
CPython's generic hook for classes with `__getattr__`, a Python-level call each, and cannot be
specialised: about 6 % of a whole request's instructions (`scripts/count_instructions.py`: 631,000
against 592,500). The method is a fallback that 3.11 itself never reaches for a member (each one is
set on its class, or a property stands in its name) and 3.12 removed it; removing it here gives 3.11
the same lookup as 3.12 and changes no answer: a missing name still raises AttributeError.
"""

from __future__ import annotations

import enum
import sys

__all__ = ["drop_enum_lookup_hook"]


def drop_enum_lookup_hook() -> bool:
    """Python 3.11 only: `EnumType.__getattr__` removed (True when it was there)."""
    if sys.version_info >= (3, 12) or "__getattr__" not in vars(enum.EnumType):
        return False
    del enum.EnumType.__getattr__  # type: ignore[attr-defined]
    return True
