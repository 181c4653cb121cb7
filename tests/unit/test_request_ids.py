"""Request ids: the shape `uuid4().hex` had, never repeated, and not shared with a forked child."""

from __future__ import annotations

import os
import re

from proxy.observe.request_ids import new_request_id

HEX32 = re.compile(r"[0-9a-f]{32}")


def test_ids_are_32_hex_digits_and_distinct_across_many_batches() -> None:
    ids = [new_request_id() for _ in range(3000)]  # > 10 refills of the buffer
    assert all(HEX32.fullmatch(i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    new_request_id()  # the parent holds a partly used buffer
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    try:
        child = os.read(read, 64).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    parent = new_request_id()
    assert HEX32.fullmatch(child)
    assert child != parent
