"""The image in front of a real vLLM, in one pod's network namespace: vLLM (the vLLM tier's CPU build,
scripts/setup-vllm.sh) runs as a host process entered into the pod's namespace, with the manifest's own
vLLM args (its model swapped for the tier's tiny one, plus the CPU build's flags), on the pod's
127.0.0.1:8000, where the sidecar's STREAMWARDEN_UPSTREAM points. The sidecar runs as the manifest says.

vLLM not set up: skipped locally (`make vllm` sets it up), set up or failed in CI (.ci/run sets it up first).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from podrun import Pod, docker, required, sse_lines
from real import vllm_tier
from support.pod import Container, container

pytestmark = pytest.mark.timeout(1500)  # vLLM's start: 20-50 s alone; 10 min seen here on a busy machine

BOUND = 60.0
LOAD = 1200.0  # vLLM starting on a busy 2-core machine (584 s seen with seven other helpers building)
LONG_TOKENS = 2000
CPU_FLAGS = ["--max-model-len", str(vllm_tier.MAX_MODEL_LEN), "--enforce-eager", "--dtype", "float32",
             "--seed", "42"]


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not vllm_tier.installed():
        if required():
            return vllm_tier.set_up()
        pytest.skip("container tier, vLLM: vLLM is not set up (`make vllm`, about 100 s)")
    return vllm_tier.python_path()


@pytest.fixture(scope="module")
def vllm_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vllm_tier.write_model(vllm_python, tmp_path_factory.mktemp("vllm") / "tiny-llama")


def vllm_argv(rendered: list[dict[str, Any]], python: Path, model: Path) -> tuple[list[str], str]:
    """The manifest's vLLM container as a command line here, and the model name it serves."""
    backend = container(rendered, "llm-vllm", "vllm")
    assert backend.command == ["vllm", "serve"]
    args = backend.argv()[1:]  # after `serve`: the model (swapped below), then the flags
    assert not args[0].startswith("-")
    served = next(a.split("=", 1)[1] for a in args if a.startswith("--served-model-name="))
    assert "--host=127.0.0.1" in args
    assert "--port=8000" in args
    return [str(python), "-c", vllm_tier.SHIM, "serve", str(model), *args[1:], *CPU_FLAGS], served


@pytest.fixture
def vllm_pod(pod: Pod, rendered: list[dict[str, Any]], sidecar: Container, vllm_python: Path, vllm_model: Path,
             tmp_path: Path) -> Iterator[tuple[Pod, str, str]]:
    """The sidecar first, then vLLM starting beside it; yields the pod, the sidecar's name, the model."""
    name = pod.run_sidecar(sidecar)
    argv, served = vllm_argv(rendered, vllm_python, vllm_model)
    log = tmp_path / "vllm.log"
    process = pod.spawn(argv, log, env={**os.environ, **vllm_tier.ENV})
    with contextlib.suppress(OSError):  # its own session: nice its autogroup (see vllm_tier)
        Path(f"/proc/{process.pid}/autogroup").write_text("10")
    try:
        yield pod, name, served
    finally:
        if process.poll() is not None:
            print(log.read_text(errors="replace")[-3000:])


def vllm_metrics(pod: Pod, sidecar: Container) -> str:
    """vLLM's own /metrics, read as the PodMonitor reads them: through the proxy's main port."""
    status, body = pod.get(sidecar.ports["http"], "/metrics")
    assert status == 200
    return body.decode()


def idle_tokens(pod: Pod, sidecar: Container) -> float:
    deadline = time.monotonic() + BOUND
    while True:
        page = vllm_metrics(pod, sidecar)
        if vllm_tier.metric(page, "vllm:num_requests_running") == 0:
            return vllm_tier.metric(page, "vllm:generation_tokens_total")
        assert time.monotonic() < deadline, "vLLM still runs a request"
        time.sleep(0.1)


def test_readiness_follows_vllm_and_an_abandoned_stream_stops_it(
    vllm_pod: tuple[Pod, str, str], sidecar: Container
) -> None:
    pod, name, served = vllm_pod
    assert sidecar.readiness is not None
    assert sidecar.liveness is not None
    # While vLLM loads: the proxy is alive, and not ready (the manifest's readiness probe answers 503).
    pod.wait_for(sidecar.liveness.port, sidecar.liveness.path, 200, BOUND)
    status, _ = pod.get(sidecar.readiness.port, sidecar.readiness.path)
    assert status == 503
    took = pod.wait_for(sidecar.readiness.port, sidecar.readiness.path, 200, LOAD)
    print(f"\nreadiness 200 after {took:.0f} s (vLLM loaded)")
    # A stream abandoned after a few events: vLLM stops generating for it.
    before = idle_tokens(pod, sidecar)
    body = {"model": served, "stream": True, "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story."}]}
    with contextlib.closing(pod.request(sidecar.ports["http"], "POST", "/v1/chat/completions", body,
                                        timeout=BOUND)) as resp:
        assert resp.status == 200
        events = 0
        for line in sse_lines(resp):
            events += line.startswith(b"data: {")
            if events == 5:
                break
    after = idle_tokens(pod, sidecar)
    later = idle_tokens(pod, sidecar)
    print(f"vLLM generated {after - before:.0f} of {LONG_TOKENS} tokens for the abandoned stream")
    assert after - before < LONG_TOKENS
    assert later == after
    # The books: one request, aborted by the client, its upstream cancelled.
    status, raw = pod.get(sidecar.ports["metrics"], "/metrics")
    books = raw.decode()
    assert "streamwarden_requests_total" in books
    aborted = [line for line in books.splitlines()
               if line.startswith("streamwarden_requests_total{") and 'outcome="aborted"' in line]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in aborted) == 1, aborted
    assert 'reason="client_disconnect"' in aborted[0]
    assert docker("diff", name).stdout.strip() == ""  # nothing written outside the declared volumes
