"""The container tier: the image, built once (`make test-container` builds it first: scripts/image.sh),
run as the rendered kustomize Deployment says, in a pod's shape (podrun.py).

Locally, without a Docker daemon (or without root, or without kubectl), the tier is skipped with one
line saying why. In CI (CI=true) it is never skipped: `.ci/run` installs docker.io, starts dockerd
(scripts/dockerd.sh) and builds the base and the image, and a missing piece fails the tier.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from podrun import DOCKER, IMAGE, ROOT, Pod, docker, required
from support.pod import Container, container

DEPLOYMENT = "llm-vllm"  # the sidecar as vllm-sidecar.yaml runs it
SIDECAR = "streamwarden"


def _unavailable(why: str) -> None:
    if required():
        pytest.fail(f"container tier (CI): {why}")
    pytest.skip(f"container tier: {why}")


@pytest.fixture(scope="session")
def image() -> str:
    """The image under test, after checking the daemon answers and the image is there."""
    if os.geteuid() != 0:
        _unavailable("needs root (dockerd, and entering the pod's network namespace)")
    if not (shutil.which("dockerd") or os.path.exists(DOCKER)):
        _unavailable("Docker is not installed (Debian: docker.io; `bash scripts/dockerd.sh` installs and starts it)")
    if docker("info", check=False, timeout=30).returncode != 0:
        _unavailable("no Docker daemon answers (`bash scripts/dockerd.sh` starts one)")
    if docker("image", "inspect", IMAGE, check=False).returncode != 0:
        _unavailable(f"no image {IMAGE} (`make test-container` builds it: `make image`)")
    return IMAGE


@pytest.fixture(scope="session")
def rendered() -> list[dict[str, Any]]:
    """`kubectl kustomize deploy/kubernetes`, what `kubectl apply -k` would apply."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        _unavailable("kubectl is not installed (Debian: kubernetes-client)")
    assert kubectl is not None
    done = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy" / "kubernetes")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="session")
def sidecar(rendered: list[dict[str, Any]]) -> Container:
    """The streamwarden container of the vLLM Deployment, as the kubelet would run it."""
    return container(rendered, DEPLOYMENT, SIDECAR)


@pytest.fixture
def pod(image: str) -> Iterator[Pod]:
    """A pod's network namespace for one test; every container and process in it removed after."""
    pod = Pod(image).start()
    try:
        yield pod
    finally:
        pod.close()
