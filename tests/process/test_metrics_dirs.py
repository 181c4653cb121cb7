"""Where the metrics live: stale multiprocess directories, inherited variables.

`serve --workers N` keeps its values in a directory it makes under the temporary directory: one left
by a SIGKILLed supervisor is removed at the next start (a `/tmp` emptyDir outlives container
restarts). A single `serve` never reads or writes a PROMETHEUS_MULTIPROC_DIR it inherited.
"""

from __future__ import annotations

import fcntl
import os
import signal
from pathlib import Path

import aiohttp
from support import FakeUpstream
from support.hostile import ServeProcess, until

from proxy.workers.metrics_dir import PREFIX


def is_dir(path: Path) -> bool:
    """(Sync: a stat is no wait worth a thread.)"""
    return os.path.isdir(path)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_killed_supervisor_s_directory_is_removed_at_the_next_start(
    fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    env = {"TMPDIR": str(tmp_path)}
    first = ServeProcess(fake_upstream.url, "--workers", "2", env=env)
    try:
        await until(lambda: len(first.lines("worker_ready")) == 2)
        left = Path(first.lines("started")[0]["metrics_dir"])
        first.signal(signal.SIGKILL)  # its workers see their stdin close and leave on their own
        first.proc.wait(timeout=20)
    finally:
        first.stop()
    assert is_dir(left)  # nothing could remove it

    held = tmp_path / f"{PREFIX}held"  # a live supervisor's: its lock is taken (here, by this test)
    os.mkdir(held)
    lock = os.open(held / ".owner.lock", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    second = ServeProcess(fake_upstream.url, "--workers", "2", env=env)
    try:
        await until(lambda: len(second.lines("worker_ready")) == 2)
        assert not is_dir(left)
        assert is_dir(held)
        assert [Path(d) for d in second.lines("metrics_dirs_removed")[0]["directories"]] == [left]
    finally:
        second.stop()
        os.close(lock)
    assert second.proc.returncode == 0
    assert sorted(os.listdir(tmp_path)) == [held.name]  # its own went at exit


async def test_one_process_ignores_an_inherited_multiprocess_directory(
    fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    """Before: prometheus_client switched to multiprocess mode at import; two instances shared counters."""
    shared = tmp_path / "shared"
    os.mkdir(shared)
    env = {"PROMETHEUS_MULTIPROC_DIR": str(shared)}
    procs = [ServeProcess(fake_upstream.url, env=env) for _ in range(2)]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            for i, proc in enumerate(procs):
                for _ in range(i + 1):  # one request to the first, two to the second
                    async with http.post(proc.url + "/v1/chat/completions", json=CHAT) as resp:
                        assert resp.status == 200
                        await resp.read()
            for i, proc in enumerate(procs):
                await until(lambda proc=proc, i=i: len(proc.lines()) == i + 1)  # type: ignore[misc]
                async with http.get(proc.admin_url + "/metrics") as resp:
                    text = await resp.text()
                total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                            if line.startswith("streamwarden_requests_total{"))
                assert total == i + 1
        assert [line["path"] for line in procs[0].lines("metrics_dir_ignored")] == [str(shared)]
    finally:
        for proc in procs:
            proc.stop()
    assert os.listdir(shared) == []  # not one file written there
