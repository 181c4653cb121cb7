"""A rendered Deployment's container, as `docker run` options: the container tier runs the image as the
manifest says (tests/container/), and this is the one place that reads the manifest for it.

`container(docs, deployment, name)` takes `kubectl kustomize` output (the parsed documents) and returns
what the kubelet would apply to that container: its args and env, its ports and probes (named ports
resolved), its effective securityContext (the pod's merged under the container's), its volume mounts
with their volumes, its resource limits, its preStop command and the pod's grace period.
`docker_run_options(spec, network=...)` turns that into `docker run` options:

  runAsUser/runAsGroup  -> --user UID:GID        fsGroup -> --group-add GID
  readOnlyRootFilesystem -> --read-only          capabilities.drop/add -> --cap-drop/--cap-add
  allowPrivilegeEscalation: false -> --security-opt no-new-privileges
  seccompProfile RuntimeDefault -> Docker's default profile (nothing to add); Unconfined -> seccomp=unconfined
  emptyDir (either medium) -> a tmpfs at the mount path, sized by sizeLimit, mode 0777 as the kubelet makes it
  limits.memory -> --memory (swap the same: none);  limits.cpu -> --cpus
  requests.cpu -> --cpu-shares (1024 a CPU, as the kubelet sets cgroup v1's cpu.shares); requests.memory
  only schedules a pod, and has no option
  terminationGracePeriodSeconds -> --stop-timeout (docker stop's SIGKILL comes when the kubelet's would)

What Docker has no option for is kept for the test to do as the kubelet does: the probes (polled by the
test at their paths and ports), the preStop hook (run with `docker exec` before `docker stop`), and the
network namespace (given: the pod's is another container's, `container:NAME`). Anything the manifest
says that this does not know how to carry out raises `Unsupported` instead of being dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Container", "Probe", "Unsupported", "container", "docker_run_options", "quantity"]


class Unsupported(ValueError):
    """The manifest says something this translation cannot carry out faithfully."""


@dataclass(frozen=True)
class Probe:
    """An httpGet probe (path, port) or an exec probe (command: `docker exec` runs it)."""

    path: str | None
    port: int | None
    period: float
    timeout: float
    failure_threshold: int
    initial_delay: float = 0.0
    command: list[str] | None = None


@dataclass(frozen=True)
class Container:
    name: str
    image: str
    command: list[str] | None
    args: list[str]
    env: dict[str, str]
    ports: dict[str, int]
    readiness: Probe | None
    liveness: Probe | None
    user: int | None
    group: int | None
    supplementary_groups: list[int]
    run_as_non_root: bool
    read_only_root: bool
    cap_drop: list[str]
    cap_add: list[str]
    no_new_privileges: bool
    seccomp: str | None
    tmpfs: dict[str, int | None]  # mount path -> size in bytes (None: no sizeLimit)
    memory_limit: int | None
    cpu_limit: float | None
    cpu_request: float | None
    pre_stop: list[str] | None
    grace_seconds: int = 30  # Kubernetes' default terminationGracePeriodSeconds

    def argv(self) -> list[str]:
        """What goes after the image in `docker run`: the command's other words, then the args (a
        Kubernetes command replaces the image's ENTRYPOINT, its args the CMD)."""
        return [*(self.command or [])[1:], *self.args]


_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity as a number: "512Mi" -> 536870912, "2" -> 2, "500m" -> 0.5."""
    if isinstance(value, (int, float)):
        return float(value)
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", value.strip())
    if match is None:
        raise Unsupported(f"not a quantity: {value!r}")
    number, suffix = float(match[1]), match[2]
    if suffix == "":
        return number
    if suffix == "m":
        return number / 1000
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    raise Unsupported(f"unknown quantity suffix: {value!r}")


def _deployment(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [d for d in docs if d.get("kind") == "Deployment" and d["metadata"]["name"] == name]
    if len(found) != 1:
        raise LookupError(f"{len(found)} Deployments named {name!r}")
    return found[0]


def _probe(raw: dict[str, Any] | None, ports: dict[str, int]) -> Probe | None:
    if raw is None:
        return None
    # Kubernetes' defaults: periodSeconds 10, timeoutSeconds 1, failureThreshold 3, initialDelaySeconds 0.
    timing = (float(raw.get("periodSeconds", 10)), float(raw.get("timeoutSeconds", 1)),
              int(raw.get("failureThreshold", 3)), float(raw.get("initialDelaySeconds", 0)))
    if set(raw) & {"tcpSocket", "grpc"}:
        raise Unsupported(f"only httpGet and exec probes are carried out: {raw}")
    if "exec" in raw:
        return Probe(None, None, *timing, command=list(raw["exec"]["command"]))
    get = raw["httpGet"]
    if get.get("scheme", "HTTP") != "HTTP" or get.get("host") or get.get("httpHeaders"):
        raise Unsupported(f"httpGet with scheme/host/headers: {get}")
    port = get["port"]
    return Probe(get.get("path", "/"), ports[port] if isinstance(port, str) else int(port), *timing)


def container(docs: list[dict[str, Any]], deployment: str, name: str) -> Container:
    """The named container of the named Deployment in rendered manifests, as the kubelet would run it."""
    pod = _deployment(docs, deployment)["spec"]["template"]["spec"]
    found = [c for c in pod["containers"] if c["name"] == name]
    if len(found) != 1:
        raise LookupError(f"{len(found)} containers named {name!r} in {deployment}")
    spec = found[0]
    pod_security = pod.get("securityContext", {})
    security = {**{k: v for k, v in pod_security.items() if k in ("runAsUser", "runAsGroup", "runAsNonRoot",
                                                                   "seccompProfile")},
                **spec.get("securityContext", {})}
    if security.get("privileged") or security.get("procMount", "Default") != "Default":
        raise Unsupported(f"privileged or procMount: {security}")
    env: dict[str, str] = {}
    for item in spec.get("env", []):
        if "value" not in item:
            raise Unsupported(f"env from a source: {item}")
        env[item["name"]] = str(item["value"])
    if spec.get("envFrom"):
        raise Unsupported("envFrom")
    ports = {p["name"]: int(p["containerPort"]) for p in spec.get("ports", []) if "name" in p}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    tmpfs: dict[str, int | None] = {}
    for mount in spec.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "emptyDir" not in volume or mount.get("subPath") or mount.get("readOnly"):
            raise Unsupported(f"only whole, writable emptyDir volumes are carried out: {volume}, {mount}")
        size = (volume["emptyDir"] or {}).get("sizeLimit")
        tmpfs[mount["mountPath"]] = int(quantity(size)) if size is not None else None
    limits = spec.get("resources", {}).get("limits", {})
    requests = spec.get("resources", {}).get("requests", {})
    capabilities = security.get("capabilities", {})
    seccomp = security.get("seccompProfile", {}).get("type")
    if seccomp not in (None, "RuntimeDefault", "Unconfined"):
        raise Unsupported(f"seccompProfile {seccomp}")
    pre_stop = spec.get("lifecycle", {}).get("preStop")
    if pre_stop is not None and "exec" not in pre_stop:
        raise Unsupported(f"only exec preStop hooks are carried out: {pre_stop}")
    return Container(
        name=name,
        image=spec["image"],
        command=spec.get("command"),
        args=[str(a) for a in spec.get("args", [])],
        env=env,
        ports=ports,
        readiness=_probe(spec.get("readinessProbe"), ports),
        liveness=_probe(spec.get("livenessProbe"), ports),
        user=security.get("runAsUser"),
        group=security.get("runAsGroup"),
        supplementary_groups=[*pod_security.get("supplementalGroups", []),
                              *([pod_security["fsGroup"]] if "fsGroup" in pod_security else [])],
        run_as_non_root=bool(security.get("runAsNonRoot", False)),
        read_only_root=bool(security.get("readOnlyRootFilesystem", False)),
        cap_drop=list(capabilities.get("drop", [])),
        cap_add=list(capabilities.get("add", [])),
        no_new_privileges=security.get("allowPrivilegeEscalation") is False,
        seccomp=seccomp,
        tmpfs=tmpfs,
        memory_limit=int(quantity(limits["memory"])) if "memory" in limits else None,
        cpu_limit=quantity(limits["cpu"]) if "cpu" in limits else None,
        cpu_request=quantity(requests["cpu"]) if "cpu" in requests else None,
        pre_stop=pre_stop["exec"]["command"] if pre_stop else None,
        grace_seconds=int(pod.get("terminationGracePeriodSeconds", 30)),
    )


def docker_run_options(spec: Container, *, network: str) -> list[str]:
    """`docker run` options (before the image) for the container; `network`: `container:NAME` or `host`.
    The image and `spec.argv()` go after them; `--entrypoint` is set when the manifest gives a command."""
    if spec.run_as_non_root and not spec.user:
        raise Unsupported("runAsNonRoot without a numeric runAsUser: the image's USER would have to be checked")
    options = [f"--network={network}", f"--stop-timeout={spec.grace_seconds}"]
    if spec.user is not None:
        options.append(f"--user={spec.user}:{spec.group if spec.group is not None else 0}")
    options += [f"--group-add={gid}" for gid in spec.supplementary_groups]
    if spec.read_only_root:
        options.append("--read-only")
    options += [f"--cap-drop={cap}" for cap in spec.cap_drop]
    options += [f"--cap-add={cap}" for cap in spec.cap_add]
    if spec.no_new_privileges:
        options.append("--security-opt=no-new-privileges")
    if spec.seccomp == "Unconfined":
        options.append("--security-opt=seccomp=unconfined")
    for path, size in spec.tmpfs.items():
        options.append(f"--mount=type=tmpfs,destination={path},tmpfs-mode=0777"
                       + (f",tmpfs-size={size}" if size is not None else ""))
    if spec.memory_limit is not None:
        options += [f"--memory={spec.memory_limit}", f"--memory-swap={spec.memory_limit}"]
    if spec.cpu_limit is not None:
        options.append(f"--cpus={spec.cpu_limit:g}")
    if spec.cpu_request is not None:
        options.append(f"--cpu-shares={max(2, int(spec.cpu_request * 1024))}")
    options += [f"--env={key}={value}" for key, value in spec.env.items()]
    if spec.command:
        options.append(f"--entrypoint={spec.command[0]}")
    return options
