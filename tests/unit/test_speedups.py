"""The serving process's interpreter change: enum lookups without 3.11's `__getattr__` hook, and
every enum answer the same. Run in a child interpreter, so this test process keeps its own enum."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import asyncio, enum, sys
    from proxy.core.lifecycle import Reason
    from proxy.server.connections import State
    from proxy.server.serve import run_loop

    class Odd(enum.Enum):  # members named like the properties of every member: 3.11 puts a property there
        name = 1
        value = 2
        plain = 3

    async def main():
        await asyncio.sleep(0)

    assert ("__getattr__" in vars(enum.EnumType)) is (sys.version_info < (3, 12))  # (what there is to drop)
    run_loop(main())  # the serving processes' entry: it drops the hook first
    assert "__getattr__" not in vars(enum.EnumType), "the hook is still there"
    assert State.OPEN is State(0) is State["OPEN"] and State.OPEN.name == "OPEN"
    assert Reason.COMPLETE is Reason(Reason.COMPLETE.value) is Reason["COMPLETE"]
    assert Odd.name.value == 1 and Odd.value.value == 2 and Odd.plain.name == "plain"
    assert Odd["name"] is Odd.name and Odd(2) is Odd.value and list(Odd) == [Odd.name, Odd.value, Odd.plain]
    for missing in ("nope", "__nope__"):
        try:
            getattr(State, missing)
        except AttributeError:
            pass
        else:
            raise AssertionError(missing)
    assert not hasattr(Reason, "NOT_A_REASON")
    print("ok")
    """
)


def test_serving_drops_the_enum_lookup_hook_and_every_answer_stays() -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
