"""The container tier's reading of a Deployment (tests/support/pod.py): every field it carries out becomes
the `docker run` option that does the same, and what it cannot carry out is refused, not dropped."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from support.pod import Probe, Unsupported, container, docker_run_options, quantity

POD: dict[str, Any] = {
    "kind": "Deployment",
    "metadata": {"name": "llm"},
    "spec": {"template": {"spec": {
        "securityContext": {"fsGroup": 1000, "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": 60,
        "containers": [
            {"name": "backend", "image": "vllm", "command": ["vllm", "serve"], "args": ["m", "--port=8000"],
             "readinessProbe": {"exec": {"command": ["python3", "-c", "1"]}, "periodSeconds": 10}},
            {
                "name": "proxy",
                "image": "registry.example.com/streamwarden:0.1.0",
                "args": ["serve"],
                "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "x y"}],
                "ports": [{"name": "http", "containerPort": 8080}, {"name": "metrics", "containerPort": 9464}],
                "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}, "periodSeconds": 5,
                                   "timeoutSeconds": 3, "failureThreshold": 2},
                "livenessProbe": {"httpGet": {"path": "/healthz", "port": 9464}},
                "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
                "resources": {"limits": {"cpu": "1500m", "memory": "512Mi"},
                              "requests": {"cpu": "250m", "memory": "128Mi"}},
                "securityContext": {"runAsUser": 10001, "runAsGroup": 10001, "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            },
        ],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "16Mi"}},
                    {"name": "shm", "emptyDir": {"medium": "Memory"}}],
    }}},
}


def test_quantities() -> None:
    assert quantity("512Mi") == 512 * 2**20
    assert quantity("1500m") == 1.5
    assert quantity("2") == 2
    assert quantity("1G") == 10**9
    assert quantity(3) == 3
    with pytest.raises(Unsupported):
        quantity("12Q")


def test_every_field_becomes_its_docker_option() -> None:
    spec = container([POD], "llm", "proxy")
    assert spec.readiness == Probe("/readyz", 9464, 5.0, 3.0, 2)
    assert spec.liveness == Probe("/healthz", 9464, 10.0, 1.0, 3)  # Kubernetes' defaults filled in
    assert spec.ports == {"http": 8080, "metrics": 9464}
    assert spec.pre_stop == ["sleep", "5"]
    assert spec.argv() == ["serve"]
    assert docker_run_options(spec, network="container:pod") == [
        "--network=container:pod",
        "--stop-timeout=60",
        "--user=10001:10001",
        "--group-add=1000",
        "--read-only",
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
        f"--mount=type=tmpfs,destination=/tmp,tmpfs-mode=0777,tmpfs-size={16 * 2**20}",
        f"--memory={512 * 2**20}",
        f"--memory-swap={512 * 2**20}",
        "--cpus=1.5",
        "--cpu-shares=256",
        "--env=A=1",
        "--env=B=x y",
    ]


def test_a_command_replaces_the_entrypoint_and_its_other_words_lead_the_args() -> None:
    spec = container([POD], "llm", "backend")
    options = docker_run_options(dataclasses.replace(spec, user=1000), network="host")
    assert "--entrypoint=vllm" in options
    assert spec.argv() == ["serve", "m", "--port=8000"]
    assert spec.readiness == Probe(None, None, 10.0, 1.0, 3, command=["python3", "-c", "1"])  # docker exec runs it
    assert spec.grace_seconds == 60


def test_run_as_non_root_without_a_user_is_refused() -> None:
    # The pod says runAsNonRoot and the backend has no runAsUser: the image's USER would decide.
    with pytest.raises(Unsupported):
        docker_run_options(container([POD], "llm", "backend"), network="host")


def test_the_default_grace_period_is_kubernetes_30_s() -> None:
    pod = copy.deepcopy(POD)
    del pod["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert container([pod], "llm", "proxy").grace_seconds == 30


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("env",), [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]),
        (("readinessProbe",), {"tcpSocket": {"port": 8080}}),
        (("readinessProbe",), {"httpGet": {"path": "/", "port": 1, "scheme": "HTTPS"}}),
        (("volumeMounts",), [{"name": "tmp", "mountPath": "/tmp", "subPath": "x"}]),
        (("securityContext", "seccompProfile"), {"type": "Localhost", "localhostProfile": "p.json"}),
        (("securityContext", "privileged"), True),
        (("lifecycle",), {"preStop": {"httpGet": {"path": "/", "port": 1}}}),
    ],
)
def test_what_cannot_be_carried_out_is_refused(path: tuple[str, ...], value: Any) -> None:
    pod = copy.deepcopy(POD)
    target = pod["spec"]["template"]["spec"]["containers"][1]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(Unsupported):
        container([pod], "llm", "proxy")


def test_a_missing_deployment_or_container_is_an_error() -> None:
    with pytest.raises(LookupError):
        container([POD], "other", "proxy")
    with pytest.raises(LookupError):
        container([POD], "llm", "other")
