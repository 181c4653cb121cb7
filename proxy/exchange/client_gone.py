"""`ClientGone`, in a module of its own so that a compiled build leaves it interpreted: mypyc cannot
compile a subclass of `ConnectionResetError` (scripts/mypyc_build.py lists it among those left out).
"""

__all__ = ["ClientGone"]


class ClientGone(ConnectionResetError):
    """The client's connection is closed."""
