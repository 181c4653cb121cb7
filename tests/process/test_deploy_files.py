"""The deploy files agree with the code and with design sections 8 and 9.

The Kubernetes manifests, the compose file and the Dockerfile name things the proxy defines: flags,
ports, endpoints, the drain timeout. These tests read the files and check each such name against its
source (the real argument parser, Config's defaults), so a renamed flag breaks a test instead of a
deployment. The metrics side (dashboard, alert rules, promtool) is in test_prometheus_rules.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from kubernetes_validate.utils import latest_version  # type: ignore[import-untyped]
from support.contract import METRICS
from support.ports import free_port
from support.promql_exprs import DASHBOARD, RULES

from proxy import __version__
from proxy.cli import build_parser
from proxy.config import Config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
MANIFESTS = sorted(KUBERNETES.glob("*-sidecar.yaml"))
KUSTOMIZATION = KUBERNETES / "kustomization.yaml"
KUBECTL = shutil.which("kubectl")
COMPOSE = DEPLOY / "compose.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
PROMETHEUS_CONFIGS = sorted((DEPLOY / "prometheus").glob("prometheus*.yml"))
SIDECAR = "streamwarden"

# --- shared readers --------------------------------------------------------------------------------


def serve_flags() -> set[str]:
    """The long options of the real `streamwarden serve` parser."""
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            serve = action.choices["serve"]
            return {opt for a in serve._actions for opt in a.option_strings if opt.startswith("--")} - {"--help"}
    raise AssertionError("build_parser() has no subcommands")


def flag_of_env(name: str) -> str:
    return "--" + name.removeprefix("STREAMWARDEN_").lower().replace("_", "-")


DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Config)}


def effective(env: dict[str, str], flag: str) -> str:
    """A flag's value as the container would see it: its env var, else Config's default."""
    name = "STREAMWARDEN_" + flag.upper().replace("-", "_")
    return env.get(name, str(DEFAULTS[flag.replace("-", "_")]))


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def one(path: Path, kind: str) -> dict[str, Any]:
    found = [doc for doc in documents(path) if doc["kind"] == kind]
    assert len(found) == 1, f"{path.name}: expected one {kind}, found {len(found)}"
    return found[0]


def containers(path: Path) -> dict[str, dict[str, Any]]:
    spec = one(path, "Deployment")["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"]}


def sidecar(path: Path) -> dict[str, Any]:
    return containers(path)[SIDECAR]


def backend(path: Path) -> dict[str, Any]:
    others = [c for name, c in containers(path).items() if name != SIDECAR]
    assert len(others) == 1, f"{path.name}: expected one backend container beside {SIDECAR}"
    return others[0]


def container_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def port_number(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in named, f"port name {port!r} is not one of {SIDECAR}'s ports {sorted(named)}"
    return int(named[port])


def cli_option(args: list[str], name: str) -> str | None:
    """The value of `--name=v` or `--name v` in an argument list."""
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(args):
            return args[i + 1]
    return None


def prestop_sleep(container: dict[str, Any]) -> float:
    handler = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in handler:
        return float(handler["sleep"]["seconds"])
    command = handler.get("exec", {}).get("command", [])
    if len(command) == 2 and command[0] == "sleep":
        return float(command[1])
    return 0.0


def check_flags(names: list[str], args: list[str], where: str) -> None:
    """Env var names and `serve` arguments name only real flags."""
    flags = serve_flags()
    assert "--upstream" in flags, "serve_flags() read the wrong parser"
    for name in names:
        if name.startswith("STREAMWARDEN_"):
            assert flag_of_env(name) in flags, f"{where}: {name} matches no `streamwarden serve` flag"
    if args:
        assert args[0] == "serve", f"{where}: arguments must start with the serve subcommand: {args}"
        for arg in args[1:]:
            if arg.startswith("--"):
                assert arg.split("=", 1)[0] in flags, f"{where}: {arg} is not a `streamwarden serve` flag"


# --- Kubernetes ----------------------------------------------------------------------------------------


def test_there_are_manifests_for_both_backends() -> None:
    assert {p.name for p in MANIFESTS} >= {"vllm-sidecar.yaml", "llamacpp-sidecar.yaml"}


@pytest.mark.parametrize("version", ["1.30.0", latest_version()])
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_core_kinds_validate(path: Path, version: str) -> None:
    core = [doc for doc in documents(path) if not doc["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {doc["kind"] for doc in core} == {"Deployment", "Service", "PodDisruptionBudget"}
    for doc in core:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_podmonitor_scrapes_the_sidecars_admin_port(path: Path) -> None:
    monitor = one(path, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    pod_labels = one(path, "Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = monitor["spec"]["selector"]
    assert set(selector) == {"matchLabels"}, "only matchLabels is checked here"
    assert selector["matchLabels"].items() <= pod_labels.items()
    endpoints = {job_relabeling(e): e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert set(endpoints) == {"streamwarden", "llm-backend"}
    env = container_env(sidecar(path))
    assert port_number(sidecar(path), endpoints["streamwarden"]["port"]) == int(effective(env, "admin-port"))
    # The backend's own metrics, through the proxy's main port (the backend is on loopback).
    assert port_number(sidecar(path), endpoints["llm-backend"]["port"]) == int(effective(env, "port"))
    for endpoint in endpoints.values():
        assert endpoint.get("path", "/metrics") == "/metrics"
        assert all(p.get("name") != endpoint["port"] for p in backend(path).get("ports", []))


def job_relabeling(endpoint: dict[str, Any]) -> str:
    """The `job` label a PodMonitor endpoint sets: StreamwardenTargetDown watches job="streamwarden"."""
    (job,) = [r["replacement"] for r in endpoint.get("relabelings", []) if r.get("targetLabel") == "job"]
    return str(job)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_sidecar_sets_only_real_flags_and_points_at_the_backend(path: Path) -> None:
    proxy = sidecar(path)
    assert "command" not in proxy, "the image's ENTRYPOINT is streamwarden"
    check_flags([e["name"] for e in proxy.get("env", [])], proxy.get("args", []), path.name)
    upstream = re.fullmatch(r"http://127\.0\.0\.1:(\d+)", container_env(proxy)["STREAMWARDEN_UPSTREAM"])
    assert upstream, "the sidecar reaches its backend over the pod's loopback"
    # The backend listens on loopback only, on the port the sidecar forwards to, and declares no port:
    # nothing but the proxy can reach it.
    args = [str(a) for a in backend(path).get("args", [])]
    assert cli_option(args, "host") == "127.0.0.1"
    assert cli_option(args, "port") == upstream[1]
    assert not backend(path).get("ports")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_sidecar_probes_hit_the_admin_endpoints(path: Path) -> None:
    proxy = sidecar(path)
    admin_port = int(effective(container_env(proxy), "admin-port"))
    for probe, endpoint in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = proxy[probe]["httpGet"]
        assert get["path"] == endpoint
        assert port_number(proxy, get["port"]) == admin_port


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_backend_outlives_the_proxys_drain(path: Path) -> None:
    """preStop + drain fit in the grace period, and the backend gets SIGTERM only after the drain."""
    pod = one(path, "Deployment")["spec"]["template"]["spec"]
    drain = float(effective(container_env(sidecar(path)), "drain-timeout"))
    proxy_done = prestop_sleep(sidecar(path)) + drain
    assert prestop_sleep(sidecar(path)) > 0, "the proxy must leave the endpoints before it stops accepting"
    assert pod["terminationGracePeriodSeconds"] > proxy_done
    assert prestop_sleep(backend(path)) > proxy_done, "the backend would stop before the proxy's drain ends"
    assert pod["terminationGracePeriodSeconds"] > prestop_sleep(backend(path))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_service_exposes_only_the_proxy_port(path: Path) -> None:
    service = one(path, "Service")
    pod_labels = one(path, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["name"] == "http"
    main_port = int(effective(container_env(sidecar(path)), "port"))
    assert port_number(sidecar(path), port.get("targetPort", port["port"])) == main_port


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_sidecar_runs_locked_down(path: Path) -> None:
    proxy = sidecar(path)
    context = proxy["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] == dockerfile_uid()
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= proxy["resources"]["requests"].keys()
    assert "memory" in proxy["resources"]["limits"]
    # A Service named `streamwarden` in the namespace would otherwise inject STREAMWARDEN_PORT=tcp://...
    assert one(path, "Deployment")["spec"]["template"]["spec"]["enableServiceLinks"] is False


def cpu_cores(quantity: str | int | float) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_sidecar_cpu_is_never_throttled_below_one_core(path: Path) -> None:
    """One proxy process uses up to a core; a lower limit turns load into latency."""
    resources = sidecar(path)["resources"]
    request, limit = cpu_cores(resources["requests"]["cpu"]), cpu_cores(resources["limits"]["cpu"])
    assert limit >= max(1.0, request)


# --- kustomize ----------------------------------------------------------------------------------------


def kustomization() -> dict[str, Any]:
    return dict(yaml.safe_load(KUSTOMIZATION.read_text()))


def image_entry() -> dict[str, str]:
    (entry,) = kustomization()["images"]
    return {k: str(v) for k, v in entry.items()}


def test_kustomization_covers_every_manifest_and_names_a_real_image() -> None:
    config = kustomization()
    assert set(config["resources"]) == {"namespace.yaml", *(p.name for p in MANIFESTS)}
    (namespace,) = documents(KUBERNETES / "namespace.yaml")
    assert namespace["kind"] == "Namespace"
    assert namespace["metadata"]["name"] == config["namespace"]
    entry = image_entry()
    for path in MANIFESTS:
        assert sidecar(path)["image"] == entry["name"], f"{path.name}: kustomize's images: would not match"
    # A registry path and the version being built, never `latest` (an image published nowhere).
    assert "/" in entry["newName"]
    assert entry["newTag"] == __version__


def vllm_version() -> str:
    return next(line for line in (DEPLOY / "vllm-version").read_text().splitlines() if line[:1].isdigit())


def test_one_vllm_version_for_the_manifests_the_readme_and_the_tier() -> None:
    """deploy/vllm-version is what the vLLM tier installs (scripts/setup-vllm.sh reads it; the tier's check
    asserts the running server's version) and what every vLLM image of the manifests pins; the docs name it."""
    version = vllm_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_VERSION"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup-vllm.sh"), "--path"], capture_output=True, text=True,
                          timeout=60, env=env, check=True)
    assert done.stdout.strip().endswith(f"/vllm-{version}/bin/python"), done.stdout
    images = [c["image"] for path in DEPLOY.rglob("*.yaml") for doc in documents(path)
              for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
              if "vllm" in c.get("image", "")]
    assert len(images) >= 2, images
    assert set(images) == {f"vllm/vllm-openai:v{version}"}
    chart = yaml.safe_load((ROOT / "charts" / "streamwarden" / "values.yaml").read_text())
    assert chart["backends"]["vllm"]["container"]["image"] == f"vllm/vllm-openai:v{version}"
    texts = {p: p.read_text() for p in [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md"))]}
    named = {(p.name, v) for p, text in texts.items() for v in re.findall(r"vLLM (\d+\.\d+\.\d+)", text)}
    assert named, "the docs say which vLLM the tier proves"
    assert {v for _, v in named} == {version}, sorted(named)
    assert f"vllm/vllm-openai:v{version}" in texts[ROOT / "README.md"]


def kustomize(root: Path) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "kustomize", str(root)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def kustomize_supports_components() -> bool:
    """Components came with kustomize v3.7 (kubectl 1.21); Debian bookworm's kubectl 1.20 has v2."""
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    found = re.match(r"v(\d+)\.(\d+)", json.loads(done.stdout or "{}").get("kustomizeVersion", "v0.0"))
    return found is not None and (int(found[1]), int(found[2])) >= (3, 7)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (Debian: kubernetes-client)")
def test_kubectl_kustomize_renders_the_manifests() -> None:
    rendered = kustomize(KUBERNETES)
    namespace = kustomization()["namespace"]
    kinds = sorted(doc["kind"] for doc in rendered)
    # The alerts component's PrometheusRule and the dashboard component's ConfigMap come with it.
    expected = ["Namespace", "PrometheusRule", "ConfigMap"] + [
        doc["kind"] for path in MANIFESTS for doc in documents(path)]
    assert kinds == sorted(expected), "the alerts and the dashboard are part of `kubectl apply -k`"
    for doc in rendered:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace, doc["metadata"]["name"]
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(doc, latest_version(), strict=True)
    entry = image_entry()
    images = [
        c["image"] for doc in rendered if doc["kind"] == "Deployment"
        for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == SIDECAR
    ]
    assert images == [f"{entry['newName']}:{entry['newTag']}"] * len(MANIFESTS)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (Debian: kubernetes-client)")
def test_the_component_for_clusters_without_the_operator_leaves_only_the_podmonitors_out(tmp_path: Path) -> None:
    if not kustomize_supports_components():
        pytest.skip("this kubectl's kustomize predates components (v3.7)")
    text = KUSTOMIZATION.read_text()
    commented = "  # - components/without-prometheus-operator\n"
    assert commented in text, "the README's recipe: uncomment this line"
    copy = tmp_path / "deploy" / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    shutil.copytree(ROOT / "grafana", tmp_path / "grafana")  # the base's dashboard component
    (copy / "kustomization.yaml").write_text(text.replace(commented, commented.replace("# ", "")))
    without = kustomize(copy)
    operator_kinds = {"PodMonitor", "PrometheusRule"}
    assert sorted(d["kind"] for d in kustomize(KUBERNETES) if d["kind"] not in operator_kinds) == sorted(
        d["kind"] for d in without
    )
    assert not {d["apiVersion"].split("/")[0] for d in without} & {"monitoring.coreos.com"}


# --- the in-cluster Prometheus scrape job, applied to the manifests' pods ----------------------------


def relabel(labels: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' relabelling (keep, drop, replace) of one target; None when it is dropped."""
    labels = dict(labels)
    for config in configs:
        source = config.get("separator", ";").join(labels.get(n, "") for n in config.get("source_labels", []))
        match = re.fullmatch(config.get("regex", "(.*)"), source)
        action = config.get("action", "replace")
        if action == "keep" and not match:
            return None
        if action == "drop" and match:
            return None
        if action == "replace" and match:
            template = re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", config.get("replacement", "$1"))
            labels[config["target_label"]] = match.expand(template)
        assert action in ("keep", "drop", "replace"), f"relabel action {action!r} is not simulated here"
    return {k: v for k, v in labels.items() if not k.startswith("__") and v}


def discovered_targets(path: Path) -> Iterator[dict[str, str]]:
    """What Kubernetes pod discovery yields for the Deployment's pod: one target per container port."""
    template = one(path, "Deployment")["spec"]["template"]
    for container in template["spec"]["containers"]:
        for port in container.get("ports") or [{}]:
            meta = {
                "__address__": f"10.0.0.7:{port.get('containerPort', '')}",
                "__meta_kubernetes_namespace": "inference",
                "__meta_kubernetes_pod_name": "pod-1",
                "__meta_kubernetes_pod_phase": "Running",
                "__meta_kubernetes_pod_container_name": container["name"],
                "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                "__meta_kubernetes_pod_container_port_number": str(port.get("containerPort", "")),
            }
            for key, value in template["metadata"]["labels"].items():
                meta["__meta_kubernetes_pod_label_" + re.sub(r"\W", "_", key)] = value
            yield meta


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_scrape_job_keeps_one_target_per_pod(path: Path) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-kubernetes.yml").read_text())
    job = scrape_job(config, "streamwarden")
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    kept = [
        (meta, labels) for meta in discovered_targets(path)
        if (labels := relabel(meta, job["relabel_configs"])) is not None
    ]
    assert len(kept) == 1
    meta, labels = kept[0]
    env = container_env(sidecar(path))
    assert meta["__meta_kubernetes_pod_container_name"] == SIDECAR
    assert meta["__meta_kubernetes_pod_container_port_number"] == effective(env, "admin-port")
    assert labels["pod"] == "pod-1"
    assert labels["namespace"] == "inference"
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_kubernetes_scrape_job_drops_pods_that_are_not_running() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-kubernetes.yml").read_text())
    for job in config["scrape_configs"]:
        port = "metrics" if job["job_name"] == "streamwarden" else "http"
        meta = next(
            m for m in discovered_targets(MANIFESTS[0]) if m["__meta_kubernetes_pod_container_name"] == SIDECAR
            and m["__meta_kubernetes_pod_container_port_name"] == port
        )
        assert relabel(meta, job["relabel_configs"]) is not None
        for phase in ("Pending", "Succeeded", "Failed"):
            pending = {**meta, "__meta_kubernetes_pod_phase": phase}
            assert relabel(pending, job["relabel_configs"]) is None


def scrape_job(config: dict[str, Any], name: str) -> dict[str, Any]:
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == name]
    return dict(job)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_backend_job_scrapes_the_backend_through_the_proxys_main_port(path: Path) -> None:
    """The backend's own metrics (it listens on loopback) come through the proxy's main port."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-kubernetes.yml").read_text())
    job = scrape_job(config, "llm-backend")
    kept = [meta for meta in discovered_targets(path) if relabel(meta, job["relabel_configs"]) is not None]
    assert len(kept) == 1
    assert kept[0]["__meta_kubernetes_pod_container_name"] == SIDECAR
    assert kept[0]["__meta_kubernetes_pod_container_port_number"] == effective(container_env(sidecar(path)), "port")
    assert job.get("metrics_path", "/metrics") == "/metrics"


# --- compose -------------------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def interpolate(text: str) -> str:
    """Compose's `${VAR:-default}` with the variables unset; a bare `${VAR}` has no value here."""
    def replace(match: re.Match[str]) -> str:
        assert match[2] is not None, f"{match[0]} has no default in {text!r}"
        return match[2]

    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", replace, text)


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def mounts(service: dict[str, Any]) -> dict[str, Path | str]:
    """container path -> host path (resolved against the compose file's folder) or volume name."""
    found: dict[str, Path | str] = {}
    for volume in service.get("volumes", []):
        source, target = interpolate(volume).split(":")[:2]
        found[target] = (DEPLOY / source).resolve() if source.startswith((".", "/")) else source
    return found


def published(service: dict[str, Any]) -> dict[int, int]:
    """container port -> host port, from the short `[ip:]host:container[/proto]` syntax."""
    ports = {}
    for entry in service.get("ports", []):
        *_, host, container = str(entry).split("/")[0].split(":")
        ports[int(container)] = int(host)
    return ports


def test_compose_builds_and_configures_streamwarden() -> None:
    services = compose()["services"]
    proxy = services[SIDECAR]
    assert (DEPLOY / proxy["build"]["context"]).resolve() == ROOT
    assert (ROOT / proxy["build"]["dockerfile"]).resolve() == DOCKERFILE
    env = compose_env(proxy)
    command = proxy.get("command", [])
    check_flags(list(env), shlex.split(command) if isinstance(command, str) else command, "compose")
    assert published(proxy) == {
        int(effective(env, "port")): int(effective(env, "port")),
        int(effective(env, "admin-port")): int(effective(env, "admin-port")),
    }
    assert {8080, 9464} == set(published(proxy))
    # The upstream is the llama.cpp service, on the port it listens on.
    upstream = re.fullmatch(r"http://([\w-]+):(\d+)", env["STREAMWARDEN_UPSTREAM"])
    assert upstream
    assert upstream[1] in services
    assert cli_option([interpolate(str(a)) for a in services[upstream[1]]["command"]], "port") == upstream[2]
    grace = re.fullmatch(r"(\d+)s", proxy["stop_grace_period"])
    assert grace
    assert int(grace[1]) > float(effective(env, "drain-timeout"))


def test_compose_publishes_every_port_on_loopback_only() -> None:
    """Grafana (admin/admin, anonymous viewer), Prometheus and the unauthenticated API stay on this machine."""
    for name, service in compose()["services"].items():
        for entry in service.get("ports", []):
            assert str(entry).startswith("127.0.0.1:"), f"{name} publishes {entry} on every interface"


def test_compose_has_nothing_compose_1_29_rejects() -> None:
    """Debian 12's docker-compose 1.29 refuses a top-level `name:` ('does not match any of the
    regexes'); the project name comes from `-p`, as the file's header says."""
    assert set(compose()) <= {"services", "volumes", "networks"}
    assert "-p streamwarden" in COMPOSE.read_text().split("services:")[0]


COMPOSE_TOOLS = {
    "docker compose": [shutil.which("docker"), "compose"],
    "docker-compose": [shutil.which("docker-compose")],
}


@pytest.mark.parametrize("tool", list(COMPOSE_TOOLS))
def test_compose_config_accepts_the_file(tool: str) -> None:
    """Both Compose v2 and Debian's docker-compose 1.29 read the file (each when installed)."""
    command = COMPOSE_TOOLS[tool]
    if command[0] is None:
        pytest.skip(f"{tool} is not installed (Debian: apt-get install docker-compose)")
    if tool == "docker compose":
        probe = subprocess.run([*command, "version"], capture_output=True, text=True, timeout=60, check=False)
        if probe.returncode != 0:
            pytest.skip("this docker has no compose plugin")
    done = subprocess.run(
        [*command, "-p", "streamwarden", "-f", str(COMPOSE), "config"],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert set(yaml.safe_load(done.stdout)["services"]) == set(compose()["services"])


def test_compose_prometheus_sets_the_labels_the_alerts_and_dashboard_group_by() -> None:
    """In Kubernetes discovery adds `pod` and `namespace`; the static compose target must set both."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (static,) = config["scrape_configs"][0]["static_configs"]
    grouped = set()
    for text in (RULES.read_text(), DASHBOARD.read_text()):
        for labels in re.findall(r"\bby \(([^)]*)\)", text):
            grouped |= {label.strip() for label in labels.split(",") if label.strip()}
    exported = frozenset({"le"}).union(*(labels for _, labels in METRICS.values()))
    target_labels = grouped - exported
    assert target_labels, "found no grouping labels: the regex no longer matches the rules"
    assert target_labels <= set(static["labels"]), target_labels - set(static["labels"])
    assert all(static["labels"].values())


def test_compose_model_is_downloaded_like_the_kubernetes_one() -> None:
    """llama.cpp's `-hf` download into a volume, as llamacpp-sidecar.yaml does; no GGUF by hand."""
    llama = compose()["services"]["llamacpp"]
    args = [interpolate(str(a)) for a in llama["command"]]
    kubernetes = [str(a) for a in backend(KUBERNETES / "llamacpp-sidecar.yaml")["args"]]
    assert cli_option(args, "hf") == cli_option(kubernetes, "hf")
    assert cli_option(args, "alias") == cli_option(kubernetes, "alias")
    assert "--metrics" in args, "Prometheus scrapes llama.cpp's own metrics too"
    assert mounts(llama)[compose_env(llama)["LLAMA_CACHE"]] == "llama-cache"
    for variable in re.findall(r"\$\{(\w+):-", " ".join(llama["command"])):
        assert variable in COMPOSE.read_text().split("services:")[0], f"{variable} is not documented"


def test_compose_prometheus_loads_the_tested_config_and_rules() -> None:
    services = compose()["services"]
    volumes = mounts(services["prometheus"])
    config_path = "/etc/prometheus/prometheus.yml"
    assert volumes[config_path] == DEPLOY / "prometheus" / "prometheus.yml"
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"], "the compose Prometheus evaluates the alert rules"
    for rule_file in config["rule_files"]:
        in_container = str(Path(config_path).parent / rule_file)
        assert volumes.get(in_container) == RULES, f"{in_container} is not the tested rules file"
    # The static job scrapes the streamwarden service's admin port; llm-backend, llama.cpp's own metrics.
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"streamwarden", "llm-backend"}
    (static,) = jobs["streamwarden"]["static_configs"]
    env = compose_env(services[SIDECAR])
    assert static["targets"] == [f"{SIDECAR}:{effective(env, 'admin-port')}"]
    (backend_target,) = jobs["llm-backend"]["static_configs"]
    upstream = env["STREAMWARDEN_UPSTREAM"].removeprefix("http://")
    assert backend_target["targets"] == [upstream]
    assert backend_target["labels"] == static["labels"]


def test_compose_grafana_provisions_the_datasource_and_the_dashboard() -> None:
    services = compose()["services"]
    volumes = mounts(services["grafana"])
    provisioning = volumes["/etc/grafana/provisioning"]
    assert isinstance(provisioning, Path)
    assert provisioning == DEPLOY / "grafana" / "provisioning"
    (datasources,) = [yaml.safe_load(p.read_text()) for p in (provisioning / "datasources").glob("*.y*ml")]
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert published(services["prometheus"]) == {9090: 9090}
    (dashboards,) = [yaml.safe_load(p.read_text()) for p in (provisioning / "dashboards").glob("*.y*ml")]
    (provider,) = dashboards["providers"]
    folder = provider["options"]["path"]
    files = {Path(c).relative_to(folder): h for c, h in volumes.items() if c.startswith(folder + "/")}
    assert files == {Path("streamwarden.json"): DASHBOARD}
    assert DASHBOARD.is_file()


# --- Dockerfile ----------------------------------------------------------------------------------------


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """Instructions (KEYWORD, arguments) per stage; continuation lines joined, comments dropped."""
    lines: list[str] = []
    current = ""
    for raw in DOCKERFILE.read_text().splitlines():
        if raw.lstrip().startswith("#"):
            continue
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            lines.append(current.strip())
        current = ""
    stages: list[list[tuple[str, str]]] = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        if keyword.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword.upper(), rest.strip()))
    return stages


def final(keyword: str) -> list[str]:
    return [rest for kw, rest in dockerfile_stages()[-1] if kw == keyword]


def dockerfile_uid() -> int:
    (user,) = final("USER")
    uid = user.split(":")[0]
    assert uid.isdigit(), "USER must be numeric, so that Kubernetes' runAsNonRoot can verify it"
    return int(uid)


def test_dockerfile_is_multi_stage_with_a_clean_final_stage() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2
    assert all("python:3.12-slim" in stage[0][1] or "${PYTHON_IMAGE}" in stage[0][1] for stage in stages)
    assert "python:3.12-slim" in DOCKERFILE.read_text()
    builder = " ".join(rest for _, rest in stages[0])
    assert "pip wheel --quiet --no-deps" in builder
    assert any(rest.startswith("--from=") for rest in final("COPY")), "the final stage copies the venv"
    for command in final("RUN"):
        for tool in ("gcc", "build-essential", "apt-get", "pip install", "pip wheel"):
            assert tool not in command, f"the final stage runs {tool}"
    # What the builder copies from the context exists.
    for rest in (rest for kw, rest in stages[0] if kw == "COPY" and not rest.startswith("--from")):
        for source in rest.split()[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def test_dockerfile_builds_reproducibly_from_a_pinned_base_and_the_constraints() -> None:
    """A digest-pinned base, the constraints `make` uses too, no frontend fetched from a registry."""
    text = DOCKERFILE.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I), "a # syntax= line makes BuildKit pull a frontend"
    (default,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert re.fullmatch(r"python:3\.12-slim@sha256:[0-9a-f]{64}", default)
    builder = " ".join(rest for _, rest in dockerfile_stages()[0])
    installs = re.findall(r"pip install [^&]*", builder)
    assert installs, "the builder installs nothing"
    assert all("-c constraints.txt" in command for command in installs), installs
    # The wheels' build tools (hatchling, and mypy and setuptools for the compiled one) at the pins too.
    wheels = re.findall(r"pip wheel [^&]*", builder)
    assert len(wheels) == 2, wheels  # the pure wheel, then the compiled one
    assert all("--build-constraint constraints.txt" in command for command in wheels), wheels
    assert re.search(r"HATCH_BUILD_HOOK_ENABLE_CUSTOM=1 \S*pip wheel", builder), "the compiled wheel's hook is off"
    assert "-c $(CONSTRAINTS)" in (ROOT / "Makefile").read_text()
    assert (ROOT / "constraints.txt").is_file()
    # What only installing needs stays in the builder.
    assert re.search(r"pip uninstall [^&]*\bpip\b[^&]*\bsetuptools\b", builder)
    for arg in ("PYTHON_IMAGE", "PIP_INDEX_URL", "DEBIAN_MIRROR"):
        assert f"{arg}=" in text, f"no build argument {arg} for builds behind a mirror"


def test_constraints_pin_every_dependency_of_the_project() -> None:
    """Every requirement in pyproject (runtime and extras) has an exact pin in constraints.txt."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    for requirement in requirements:
        name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement)[0]).lower()  # type: ignore[index]
        if name == "streamwarden":
            continue
        assert name in pins, f"{requirement} has no pin in constraints.txt (run make lock)"


def test_dockerfile_runs_streamwarden_serve_as_non_root() -> None:
    assert dockerfile_uid() != 0
    assert [json.loads(e) for e in final("ENTRYPOINT")] == [["streamwarden"]]
    assert [json.loads(c) for c in final("CMD")] == [["serve"]]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "streamwarden" in scripts
    exposed = {int(p.split("/")[0]) for line in final("EXPOSE") for p in line.split()}
    assert exposed == {int(DEFAULTS["port"]), int(DEFAULTS["admin_port"])} == {8080, 9464}
    env = {m[1]: m[2] for line in final("ENV") for m in re.finditer(r"(\w+)=(\S+)", line)}
    assert env["STREAMWARDEN_HOST"] == "0.0.0.0"
    check_flags(list(env), [], "Dockerfile")


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("given", ["flag", "env"])
@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_dockerfile_healthcheck_follows_the_real_admin_port(
    given: str, status: int, healthy: bool, tmp_path: Path
) -> None:
    """Run the HEALTHCHECK's command beside a process started like the container's `serve`.

    The admin port comes from `--admin-port` in the command or from STREAMWARDEN_ADMIN_PORT; in both
    cases the other source points at a port where nothing listens, so following the wrong one fails.
    """
    (healthcheck,) = final("HEALTHCHECK")
    command = json.loads(healthcheck[healthcheck.index("CMD ") + 4:])
    assert command[0] == "python", "slim has no curl: the check uses Python"
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    wrong = str(free_port())
    right = str(server.server_address[1])
    flag_args, env_port = (["--admin-port", right], wrong) if given == "flag" else ([], right)
    # Stands in for the container's `python /opt/venv/bin/streamwarden serve ...`: its command line and
    # environment are what the check reads from /proc.
    stand_in = tmp_path / "streamwarden"
    stand_in.write_text("import sys\nsys.stdin.read()\n")
    serving = subprocess.Popen(
        [sys.executable, str(stand_in), "serve", "--upstream", "http://backend:8000", *flag_args],
        stdin=subprocess.PIPE, env={"STREAMWARDEN_ADMIN_PORT": env_port},
    )  # fmt: skip
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        result = subprocess.run(
            [sys.executable, *command[1:], str(serving.pid)], capture_output=True, timeout=20, check=False,
            env={"PATH": "/usr/bin:/bin"},  # nothing from the check's own environment decides the port
        )
    finally:
        assert serving.stdin is not None
        serving.stdin.close()
        serving.wait(timeout=10)
        server.shutdown()
        server.server_close()
        thread.join()
    assert (result.returncode == 0) is healthy, result.stderr.decode()


def test_dockerfile_healthcheck_fails_when_the_proxy_is_gone() -> None:
    (healthcheck,) = final("HEALTHCHECK")
    command = json.loads(healthcheck[healthcheck.index("CMD ") + 4:])
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=20, check=True)  # fmt: skip
    result = subprocess.run([sys.executable, *command[1:], gone.stdout.strip()], capture_output=True, timeout=20)
    assert result.returncode == 1
