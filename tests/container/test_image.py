"""The image, run as the rendered vLLM Deployment runs its sidecar (user 10001, read-only root, no
capabilities, no-new-privileges, Docker's default seccomp profile, /tmp the 16Mi emptyDir, 512Mi and
2 CPUs, the manifest's env and args), in a pod's network namespace with the image's own fake backend
on the pod's 127.0.0.1:8000. What the manifest promises, checked on the running container."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from podrun import Pod, docker, inspect, required, sse_lines
from support.pod import Container, container

pytestmark = pytest.mark.timeout(300)

CHAT = "/v1/chat/completions"
BOUND = 60.0  # seconds for one step in a container on a busy 2-core machine; only a hang exceeds it


def chat(max_tokens: int = 8, stream: bool = True) -> dict[str, object]:
    return {"model": "demo", "stream": stream, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hi"}]}


def sample(page: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when there is none)."""
    total = 0.0
    for line in page.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metrics(pod: Pod, spec: Container) -> str:
    status, body = pod.get(spec.ports["metrics"], "/metrics")
    assert status == 200
    return body.decode()


def wait_books(pod: Pod, spec: Container, name: str, at_least: float, **labels: str) -> str:
    deadline = time.monotonic() + BOUND
    while True:
        page = metrics(pod, spec)
        if sample(page, name, **labels) >= at_least:
            return page
        assert time.monotonic() < deadline, f"{name}{labels} never reached {at_least}: {page[-2000:]}"
        time.sleep(0.2)


def diff(name: str) -> list[str]:
    """`docker diff`: what the container wrote outside its volumes (tmpfs mounts are not in it)."""
    return [line for line in docker("diff", name).stdout.splitlines() if line]


def test_the_image_runs_the_compiled_build(image: str) -> None:
    said = docker("run", "--rm", "--network=none", image, "--version").stdout.strip()
    print(f"\n{image}: {said}")
    assert re.fullmatch(r"streamwarden \S+ \(compiled: (yes|no)\)", said), said
    if os.environ.get("COMPILED", "1") == "1":
        # The image is built with COMPILED=1 (make image's default): the compiled build must be what runs.
        if required() or "compiled: yes" in said:
            assert said.endswith("(compiled: yes)"), f"{image} should run the compiled build: {said}"
        else:
            pytest.skip(f"{image} runs the pure package (no compiler in its build?): {said}")


def test_the_container_runs_as_the_manifest_says(pod: Pod, sidecar: Container) -> None:
    pod.run_fake()
    name = pod.run_sidecar(sidecar)
    pod.wait_for(sidecar.ports["metrics"], "/readyz", 200, BOUND)
    config = inspect(name)
    host = config["HostConfig"]
    assert config["Config"]["User"] == f"{sidecar.user}:{sidecar.group}" == "10001:10001"
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["Memory"] == sidecar.memory_limit == 512 * 2**20
    assert host["NanoCpus"] == 2 * 10**9
    assert host["CpuShares"] == 1024  # requests.cpu 1
    # What the process itself has: uid/gid, no capabilities, no_new_privs, seccomp filtering (mode 2).
    status = docker("exec", name, "cat", "/proc/1/status").stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["Uid"].split()[0] == "10001"
    assert fields["Gid"].split()[0] == "10001"
    assert int(fields["CapEff"], 16) == 0
    assert int(fields["CapPrm"], 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"
    # The manifest's env reached the proxy: its upstream, and JSON log lines.
    started = json.loads(pod.logs(name).splitlines()[0])
    assert started["upstream"] == sidecar.env["STREAMWARDEN_UPSTREAM"]
    assert started["listen"] == f"0.0.0.0:{sidecar.ports['http']}"


def test_healthcheck_and_the_manifests_probes(pod: Pod, sidecar: Container) -> None:
    """The sidecar before its backend: alive but not ready; the backend up: ready; Docker's HEALTHCHECK
    (the image's) turns healthy."""
    assert sidecar.readiness is not None
    assert sidecar.liveness is not None
    started = time.monotonic()
    name = pod.run_sidecar(sidecar)
    pod.wait_for(sidecar.liveness.port, sidecar.liveness.path, 200, BOUND)
    status, _ = pod.get(sidecar.readiness.port, sidecar.readiness.path)
    assert status == 503  # no backend yet: the manifest's readiness probe keeps the pod out of the Service
    pod.run_fake()
    took = pod.wait_for(sidecar.readiness.port, sidecar.readiness.path, 200, BOUND)
    # Ready within a few of the probe's periods once the backend answers (the proxy asks its health path).
    assert took < BOUND
    deadline = time.monotonic() + 120  # the image's HEALTHCHECK: first run after its 15 s interval
    while (health := inspect(name)["State"]["Health"]["Status"]) != "healthy":
        assert health in ("starting", "healthy"), inspect(name)["State"]["Health"]
        assert time.monotonic() < deadline, inspect(name)["State"]["Health"]
        time.sleep(0.5)
    print(f"\nready {took:.1f} s after the backend started; Docker's HEALTHCHECK healthy "
          f"{time.monotonic() - started:.0f} s after the container started")


def test_failures_are_the_dialects_and_the_books_count_them_and_nothing_is_written(
    pod: Pod, sidecar: Container
) -> None:
    pod.run_fake()
    name = pod.run_sidecar(sidecar)
    port = sidecar.ports["http"]
    pod.wait_for(sidecar.ports["metrics"], "/readyz", 200, BOUND)
    # A normal stream, whole.
    with contextlib.closing(pod.request(port, "POST", CHAT, chat())) as resp:
        assert resp.status == 200
        assert b"data: [DONE]" in list(sse_lines(resp))
    # A stray 503 written into the backend's 200 stream: a real 503 with the OpenAI error JSON.
    with contextlib.closing(pod.request(port, "POST", CHAT, chat(), {"x-fault": "stray_503"})) as resp:
        body = resp.read()
        assert resp.status == 503, body
        assert json.loads(body)["error"]["message"]
    # A stream the backend cuts mid-answer: the client's last event is the dialect's error frame.
    with contextlib.closing(pod.request(port, "POST", CHAT, chat(), {"x-fault": "cut"})) as resp:
        assert resp.status == 200
        events = [line for line in sse_lines(resp) if line.startswith(b"data: ")]
    # The OpenAI dialect's error frame, then the stream's end as the SDKs expect it.
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2][len(b"data: "):])["error"]["code"] == "stream_cut", events[-2:]
    # A stream the client abandons: booked aborted, and the proxy cancelled the upstream.
    with contextlib.closing(pod.request(port, "POST", CHAT, chat(max_tokens=2000))) as resp:
        assert resp.status == 200
        lines = sse_lines(resp)
        while not next(lines).startswith(b"data: {"):
            pass
    page = wait_books(pod, sidecar, "streamwarden_requests_total", 1, outcome="aborted")
    assert sample(page, "streamwarden_requests_total", outcome="ok") == 1
    assert sample(page, "streamwarden_requests_total", outcome="error") == 2
    assert sample(page, "streamwarden_requests_total", outcome="aborted", reason="client_disconnect") == 1
    assert sample(page, "streamwarden_upstream_cancellations_total", reason="client_disconnect") == 1
    # All that on the read-only root: nothing written outside the declared volumes.
    assert diff(name) == []


def _read_to_end(resp: object, into: list[bytes]) -> None:
    with contextlib.suppress(OSError):
        into.extend(sse_lines(resp))  # type: ignore[arg-type]


def test_docker_stop_with_a_stream_in_flight_drains_within_the_grace_period(pod: Pod, sidecar: Container) -> None:
    """As the kubelet stops the pod: the preStop hook, then SIGTERM, SIGKILL at the grace period's end."""
    assert sidecar.pre_stop is not None
    pod.run_fake()
    name = pod.run_sidecar(sidecar)
    pod.wait_for(sidecar.ports["metrics"], "/readyz", 200, BOUND)
    # About 15 s of stream at the fake's 20 tokens/s: still running when the drain starts.
    resp = pod.request(sidecar.ports["http"], "POST", CHAT, chat(max_tokens=300), timeout=BOUND)
    assert resp.status == 200
    lines: list[bytes] = []
    reader = threading.Thread(target=_read_to_end, args=(resp, lines), daemon=True)
    reader.start()
    start = time.monotonic()
    docker("exec", name, *sidecar.pre_stop, timeout=sidecar.grace_seconds)
    left = sidecar.grace_seconds - (time.monotonic() - start)
    docker("stop", f"--time={max(int(left), 1)}", name, timeout=sidecar.grace_seconds + 30)
    took = time.monotonic() - start
    reader.join(BOUND)
    resp.close()
    state = inspect(name)["State"]
    print(f"\ndocker stop with a stream in flight: {took:.1f} s (grace {sidecar.grace_seconds} s), "
          f"exit {state['ExitCode']}, {len(lines)} lines")
    assert took < sidecar.grace_seconds
    assert state["ExitCode"] == 0
    assert not state["OOMKilled"]
    events = [line for line in lines if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]" or b'"error"' in events[-1], events[-3:]


def test_two_workers_on_the_read_only_root(pod: Pod, sidecar: Container) -> None:
    """`--workers 2`: the metrics directory goes on the declared volume (/tmp), nothing else is written."""
    pod.run_fake()
    name = pod.run_sidecar(sidecar, env={"STREAMWARDEN_WORKERS": "2"})
    pod.wait_for(sidecar.ports["metrics"], "/readyz", 200, BOUND)
    for _ in range(4):
        with contextlib.closing(pod.request(sidecar.ports["http"], "POST", CHAT, chat())) as resp:
            assert resp.status == 200
            assert b"data: [DONE]" in list(sse_lines(resp))
    page = wait_books(pod, sidecar, "streamwarden_requests_total", 4, outcome="ok")
    assert sample(page, "streamwarden_requests_total", outcome="ok") == 4  # both workers' counts, summed
    processes = docker("exec", name, "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
    assert processes.count("proxy.workers.worker") + processes.count("workers.worker") >= 2, processes
    assert docker("exec", name, "ls", "/tmp").stdout.strip(), "no metrics directory on the /tmp volume"
    assert diff(name) == []
    docker("stop", name, timeout=sidecar.grace_seconds + 30)
    assert inspect(name)["State"]["ExitCode"] == 0


STREAMS = 256


async def _one_stream(pod_socket: object, body: bytes) -> bool:
    reader, writer = await asyncio.open_connection(sock=pod_socket)  # type: ignore[arg-type]
    try:
        writer.write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: pod\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        await writer.drain()
        data = await reader.read()  # to the end: Connection: close
        return data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in data
    finally:
        writer.close()


def _memory_peak(name: str) -> int | None:
    """The container's peak memory use (cgroup v1's max_usage_in_bytes; v2's memory.peak)."""
    cid = inspect(name)["Id"]
    for path in (f"/sys/fs/cgroup/memory/docker/{cid}/memory.max_usage_in_bytes",
                 f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/memory.peak"):
        with contextlib.suppress(OSError):
            return int(Path(path).read_text())
    return None


def test_memory_stays_under_the_limit_at_256_streams(pod: Pod, sidecar: Container) -> None:
    assert sidecar.memory_limit is not None
    pod.run_fake()
    name = pod.run_sidecar(sidecar)
    pod.wait_for(sidecar.ports["metrics"], "/readyz", 200, BOUND)
    body = json.dumps(chat(max_tokens=60)).encode()  # 3 s each at the fake's 20 tokens/s, all at once

    async def load() -> list[bool]:
        socks = pod.sockets(sidecar.ports["http"], STREAMS)
        for s in socks:
            s.setblocking(False)
        async with asyncio.timeout(BOUND * 2):
            return await asyncio.gather(*(_one_stream(s, body) for s in socks))

    done = asyncio.run(load())
    peak = _memory_peak(name)
    state = inspect(name)["State"]
    print(f"\n{STREAMS} streams: {sum(done)} whole; memory peak {peak and peak / 2**20:.0f} MiB "
          f"(limit {sidecar.memory_limit / 2**20:.0f} MiB)")
    assert all(done)
    assert state["Running"]
    assert not state["OOMKilled"]
    assert peak is not None
    assert peak < sidecar.memory_limit
    page = metrics(pod, sidecar)
    assert sample(page, "streamwarden_requests_total", outcome="ok") == STREAMS



@pytest.mark.parametrize("deployment", ["llm-vllm", "llm-llamacpp"])
def test_each_deployments_sidecar_serves_as_its_manifest_says(
    pod: Pod, rendered: list[dict[str, Any]], deployment: str
) -> None:
    """Both backends' manifests: their own limits and settings, the same image, a whole stream, no writes."""
    spec = container(rendered, deployment, "streamwarden")
    pod.run_fake()
    name = pod.run_sidecar(spec)
    assert spec.readiness is not None
    pod.wait_for(spec.readiness.port, spec.readiness.path, 200, BOUND)
    with contextlib.closing(pod.request(spec.ports["http"], "POST", CHAT, chat())) as resp:
        assert resp.status == 200
        assert b"data: [DONE]" in list(sse_lines(resp))
    host = inspect(name)["HostConfig"]
    assert host["Memory"] == spec.memory_limit
    assert spec.cpu_limit is not None
    assert host["NanoCpus"] == int(spec.cpu_limit * 10**9)
    assert host["ReadonlyRootfs"] is True
    assert diff(name) == []
