"""`kubectl apply -k` installs everything an operator needs, and every kustomization renders.

The base (deploy/kubernetes) carries the alerts component; the components (alerts, the one for
clusters without the Prometheus Operator, the sidecar patch for an existing Deployment) are rendered
through the kustomizations that use them, with the real `kubectl kustomize`, and what comes out is
checked: every core object validates against the Kubernetes schema, the sidecar patch gives a pod
whose Service reaches the proxy and whose PodMonitor selects it, the PDBs select their pods.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from kubernetes_validate.utils import latest_version  # type: ignore[import-untyped]

from proxy.config import Config

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
COMPONENTS = KUBERNETES / "components"
EXAMPLE = KUBERNETES / "examples" / "existing-deployment"
README = (ROOT / "README.md").read_text()
KUBECTL = shutil.which("kubectl")
SIDECAR = "streamwarden"
DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (Debian: kubernetes-client)")


def kustomize(root: Path) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "kustomize", str(root)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


GRAFANA = ROOT / "grafana"
POOL = KUBERNETES / "examples" / "inference-pool"


def kustomizations() -> list[Path]:
    return sorted([GRAFANA, *(p.parent for p in KUBERNETES.rglob("kustomization.yaml"))])


def is_component(folder: Path) -> bool:
    return bool(yaml.safe_load((folder / "kustomization.yaml").read_text())["kind"] == "Component")


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def validate_core(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if not doc["apiVersion"].startswith(("monitoring.coreos.com/", "inference.networking.k8s.io/")):
            kubernetes_validate.validate(doc, latest_version(), strict=True)


def pod_ports(pod: dict[str, Any], container: str) -> dict[str, int]:
    (found,) = [c for c in pod["spec"]["containers"] if c["name"] == container]
    return {p["name"]: p["containerPort"] for p in found.get("ports", [])}


# --- every kustomization and component ----------------------------------------------------------------


def test_every_component_is_used_by_a_rendered_kustomization() -> None:
    """A component cannot be rendered alone: each one must be reachable from a kustomization tested here."""
    components = {p for p in kustomizations() if is_component(p)}
    assert components == {
        COMPONENTS / "alerts", COMPONENTS / "without-prometheus-operator", COMPONENTS / "sidecar", GRAFANA,
        COMPONENTS / "model-cache-pvc",
    }
    used: set[Path] = set()
    for folder in kustomizations():
        config = yaml.safe_load((folder / "kustomization.yaml").read_text())
        used |= {(folder / c).resolve() for c in config.get("components", [])}
    used.add(COMPONENTS / "without-prometheus-operator")  # commented out in the base; rendered below
    used.add(COMPONENTS / "model-cache-pvc")  # the same
    assert components <= used


@needs_kubectl
@pytest.mark.parametrize(
    "folder", [p for p in kustomizations() if not is_component(p)], ids=lambda p: str(p.relative_to(KUBERNETES))
)
def test_every_kustomization_renders_and_validates(folder: Path) -> None:
    rendered = kustomize(folder)
    assert rendered
    validate_core(rendered)
    if folder != POOL:
        assert of_kind(rendered, "PrometheusRule"), "the alerts come with `kubectl apply -k`"


@needs_kubectl
def test_the_base_renders_alerts_pdbs_and_monitors_for_each_backend() -> None:
    rendered = kustomize(KUBERNETES)
    deployments = of_kind(rendered, "Deployment")
    assert len(deployments) == 2
    for deployment in deployments:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        (pdb,) = [p for p in of_kind(rendered, "PodDisruptionBudget")
                  if p["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert pdb["spec"]["maxUnavailable"] == 1, "a one-replica Deployment must not block node drains"
        (monitor,) = [m for m in of_kind(rendered, "PodMonitor")
                      if m["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        jobs = {r["replacement"] for e in monitor["spec"]["podMetricsEndpoints"] for r in e["relabelings"]}
        assert jobs == {"streamwarden", "llm-backend"}
    (rule,) = of_kind(rendered, "PrometheusRule")
    annotations = [r["annotations"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert all(a["runbook_url"].endswith(".md#" + a["runbook_url"].split("#")[1]) for a in annotations)


@needs_kubectl
def test_the_release_label_patch_of_the_readme_labels_every_monitoring_object(tmp_path: Path) -> None:
    """kube-prometheus-stack selects PodMonitors and PrometheusRules by `release`: the README's step works."""
    text = (KUBERNETES / "kustomization.yaml").read_text()
    commented = re.search(r"^# patches:\n(?:#.*\n)+", text, re.M)
    assert commented, "kustomization.yaml carries the release patch, commented"
    patch = "".join(line.removeprefix("# ") + "\n" for line in commented[0].splitlines())
    blocks = [textwrap.dedent(b) for b in re.findall(r"```yaml\n(.*?)^\s*```", README, re.M | re.S)]
    assert patch in blocks, "the README's step shows this patch"
    copy = tmp_path / "deploy" / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    shutil.copytree(GRAFANA, tmp_path / "grafana")  # the base's dashboard component
    (copy / "kustomization.yaml").write_text(text.replace(commented[0], patch))
    rendered = kustomize(copy)
    monitoring = [d for d in rendered if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {d["kind"] for d in monitoring} == {"PodMonitor", "PrometheusRule"}
    assert all(d["metadata"]["labels"]["release"] == "kube-prometheus-stack" for d in monitoring)
    others = [d for d in rendered if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert all("release" not in d["metadata"].get("labels", {}) for d in others)


@needs_kubectl
def test_apply_k_brings_the_dashboard_for_the_grafana_sidecar() -> None:
    """kube-prometheus-stack's Grafana sidecar loads ConfigMaps labelled grafana_dashboard: "1";
    the base renders one from grafana/streamwarden.json, byte for byte, under a name that does not change."""
    rendered = kustomize(KUBERNETES)
    (dashboard,) = [c for c in of_kind(rendered, "ConfigMap") if c["metadata"].get("labels", {}).get(
        "grafana_dashboard") == "1"]
    assert dashboard["metadata"]["name"] == "streamwarden-dashboard", "no hash suffix: apply -k does not prune"
    assert dashboard["data"] == {"streamwarden.json": (GRAFANA / "streamwarden.json").read_text()}
    copies = [p for p in ROOT.rglob("*.json") if ".venv" not in p.parts and not p.is_symlink()  # the chart's link
              and "uid" in p.read_text()[:200]
              and '"streamwarden"' in p.read_text()]
    assert copies == [GRAFANA / "streamwarden.json"], "one copy of the dashboard"


@needs_kubectl
def test_the_runbook_base_is_one_setting_of_the_alerts_component(tmp_path: Path) -> None:
    """runbook_url pointed at an organisation that does not exist; where docs/runbooks.md lives
    is set once (components/alerts/runbooks.yaml) and reaches every rule, and the setting is not applied."""
    setting = COMPONENTS / "alerts" / "runbooks.yaml"
    (base,) = {yaml.safe_load(setting.read_text())["data"]["base"]}
    assert base.endswith("/docs/runbooks.md")
    copy = tmp_path / "deploy" / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    shutil.copytree(GRAFANA, tmp_path / "grafana")
    mine = "https://wiki.internal.example/llm/runbooks.md"
    (copy / "components" / "alerts" / "runbooks.yaml").write_text(setting.read_text().replace(base, mine))
    for folder, wanted in ((KUBERNETES, base), (copy, mine)):
        rendered = kustomize(folder)
        assert not [c for c in of_kind(rendered, "ConfigMap") if c["metadata"]["name"] == "streamwarden-runbooks"]
        (rule,) = of_kind(rendered, "PrometheusRule")
        urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]]
        assert len(urls) >= 9
        assert all(u == f"{wanted}#{r['alert'].lower()}" for u, r in zip(
            urls, [r for g in rule["spec"]["groups"] for r in g["rules"]], strict=True)), urls
    assert "github.com/streamwarden" not in (ROOT / "deploy" / "prometheus" / "rules.yml").read_text()


@needs_kubectl
def test_the_inference_pool_sends_the_gateways_traffic_to_the_proxy() -> None:
    """An InferencePool (Gateway API Inference Extension v1) over the base's vLLM pods
    targets the proxy's main port (which forwards /metrics to vLLM for the endpoint picker), never vLLM's."""
    (pool,) = kustomize(POOL)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["kind"] == "InferencePool"
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    base = kustomize(KUBERNETES)
    assert pool["metadata"]["namespace"] == kustomize(KUBERNETES)[0]["metadata"]["name"] == "llm"
    pods = [d["spec"]["template"] for d in of_kind(base, "Deployment")
            if spec["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    (pod,) = pods
    assert [p["number"] for p in spec["targetPorts"]] == [pod_ports(pod, SIDECAR)["http"]] == [DEFAULTS["port"]]
    (backend,) = [c for c in pod["spec"]["containers"] if c["name"] != SIDECAR]
    assert "--host=127.0.0.1" in backend["args"], "the pool's pods are reachable only through the proxy"
    assert spec["endpointPickerRef"]["name"]
    assert spec["endpointPickerRef"]["port"]["number"] > 0


@needs_kubectl
def test_the_model_cache_component_keeps_weights_on_a_claim_per_backend(tmp_path: Path) -> None:
    """emptyDir by default (each restart downloads the model), a PVC per backend with the
    component, as vLLM's production-stack does; nothing else changes."""
    text = (KUBERNETES / "kustomization.yaml").read_text()
    commented = "  # - components/model-cache-pvc\n"
    assert commented in text
    copy = tmp_path / "deploy" / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    shutil.copytree(GRAFANA, tmp_path / "grafana")
    (copy / "kustomization.yaml").write_text(text.replace(commented, commented.replace("# ", "")))
    default, with_pvc = kustomize(KUBERNETES), kustomize(copy)
    validate_core(with_pvc)
    claims = {c["metadata"]["name"]: c for c in of_kind(with_pvc, "PersistentVolumeClaim")}
    assert not of_kind(default, "PersistentVolumeClaim")
    for before, after in zip(of_kind(default, "Deployment"), of_kind(with_pvc, "Deployment"), strict=True):
        volumes = {v["name"]: v for v in before["spec"]["template"]["spec"]["volumes"]}
        assert "emptyDir" in volumes["model-cache"], "emptyDir is the default"
        changed = {v["name"]: v for v in after["spec"]["template"]["spec"]["volumes"]}
        claim = changed["model-cache"]["persistentVolumeClaim"]["claimName"]
        assert claims[claim]["metadata"]["namespace"] == after["metadata"]["namespace"]
        size = claims[claim]["spec"]["resources"]["requests"]["storage"]
        assert size == volumes["model-cache"]["emptyDir"]["sizeLimit"]
        assert {k: v for k, v in changed.items() if k != "model-cache"} == {
            k: v for k, v in volumes.items() if k != "model-cache"}
    assert len(claims) == 2


# --- the backends' settings -----------------------------------------------------------------------------


def manifest_deployment(name: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((KUBERNETES / name).read_text()) if d]
    (deployment,) = of_kind(docs, "Deployment")
    return deployment


def test_vllm_sends_usage_in_every_stream_and_rolls_out_on_one_gpu() -> None:
    """Exact token counts (not estimates) need vLLM's forced usage; a surge pod would wait for a 2nd GPU."""
    deployment = manifest_deployment("vllm-sidecar.yaml")
    (vllm,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    assert "--enable-force-include-usage" in vllm["args"]
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling == {"maxSurge": 0, "maxUnavailable": 1}
    text = (KUBERNETES / "vllm-sidecar.yaml").read_text()
    assert "maxSurge: 1" in text.split("strategy:")[0], "the comment says what to use with a spare GPU"


def test_llamacpp_serves_its_own_metrics() -> None:
    deployment = manifest_deployment("llamacpp-sidecar.yaml")
    (llama,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] != SIDECAR]
    assert "--metrics" in llama["args"]


BACKENDS = {"vllm-sidecar.yaml": "vllm", "llamacpp-sidecar.yaml": "llama-server"}


@pytest.mark.parametrize("name", BACKENDS)
def test_kubectl_logs_shows_the_backend_and_the_backend_is_hardened(name: str) -> None:
    """The default container is the backend; it binds loopback only (the pod IP reaches
    only the proxy); it runs non-root with no capabilities; llama.cpp's image tag does not float."""
    deployment = manifest_deployment(name)
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"] == BACKENDS[name]
    (backend,) = [c for c in pod["spec"]["containers"] if c["name"] == BACKENDS[name]]
    assert "--host=127.0.0.1" in backend["args"]
    assert not backend.get("ports"), "nothing to publish: the backend is reached through the proxy"
    context = backend["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] != 0
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    if context["readOnlyRootFilesystem"]:
        mounts = {m["mountPath"] for m in backend["volumeMounts"]}
        assert "/tmp" in mounts
    if name == "vllm-sidecar.yaml":
        # getpass.getuser() (torch's and vLLM's cache folders, at import) fails for a UID without a
        # passwd entry unless an environment variable names the user: it reads LOGNAME, USER first.
        env = {e["name"]: e.get("value") for e in backend["env"]}
        assert env.get("USER") or env.get("LOGNAME"), "vLLM would die on import as an arbitrary UID"
    image = backend["image"]
    assert re.fullmatch(r"[^:]+:(v\d+\.\d+\.\d+|server-b\d+)", image), image
    if name == "llamacpp-sidecar.yaml":
        script = (ROOT / "scripts" / "build-llama-server.sh").read_text()
        assert 'LLAMA_CPP_PYTHON_VERSION:-0.3.36' in script, "b11312 is what llama-cpp-python 0.3.36 vendors"
        assert image.endswith(":server-b11312")
    compose = (ROOT / "deploy" / "compose.yaml").read_text()
    assert "llama.cpp:server\n" not in compose
    assert "llama.cpp:server-b11312" in compose


# --- the sidecar component on an existing Deployment -------------------------------------------------------


@needs_kubectl
def test_the_sidecar_component_puts_the_proxy_in_front_of_an_existing_deployment() -> None:
    before = [d for d in yaml.safe_load_all((EXAMPLE / "vllm.yaml").read_text()) if d]
    rendered = kustomize(EXAMPLE)
    validate_core(rendered)
    (deployment,) = of_kind(rendered, "Deployment")
    (original,) = of_kind(before, "Deployment")
    pod = deployment["spec"]["template"]
    names = [c["name"] for c in pod["spec"]["containers"]]
    assert sorted(names) == sorted([SIDECAR, "vllm"])
    (backend,) = [c for c in pod["spec"]["containers"] if c["name"] == "vllm"]
    (untouched,) = original["spec"]["template"]["spec"]["containers"]
    # The overlay binds the backend to loopback and probes it through the proxy; the
    # component names it the default container. Nothing else of the backend changes.
    assert "--host=127.0.0.1" in backend["args"]
    assert backend["args"] == [a for a in untouched["args"] if a.startswith("--model")] + ["--host=127.0.0.1"] + [
        a for a in untouched["args"] if not a.startswith("--model")]
    assert backend["readinessProbe"] == {"httpGet": {"path": "/health", "port": "sw-http"}}
    assert {k: v for k, v in backend.items() if k not in ("args", "readinessProbe")} == {
        k: v for k, v in untouched.items() if k not in ("args", "readinessProbe")}, "the rest is left as it was"
    assert pod["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"] == "vllm"
    assert deployment["spec"]["selector"] == original["spec"]["selector"], "a selector is immutable"
    (proxy,) = [c for c in pod["spec"]["containers"] if c["name"] == SIDECAR]
    assert proxy["image"] == "registry.example.com/streamwarden:0.1.0"
    env = {e["name"]: e["value"] for e in proxy["env"]}
    backend_port = pod_ports(pod, "vllm")["http"]
    assert env["STREAMWARDEN_UPSTREAM"] == f"http://127.0.0.1:{backend_port}"
    ports = pod_ports(pod, SIDECAR)
    assert ports == {"sw-http": DEFAULTS["port"], "sw-metrics": DEFAULTS["admin_port"]}
    assert not set(ports) & set(pod_ports(pod, "vllm")), "port names are unique in a pod"
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "sw-metrics"}
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "sw-metrics"}
    drain = float(env["STREAMWARDEN_DRAIN_TIMEOUT"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > 5 + drain
    assert pod["spec"]["enableServiceLinks"] is False
    # The Service now reaches the proxy, not the backend.
    (service,) = of_kind(rendered, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "sw-http"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    # The PodMonitor selects the patched pod and scrapes the proxy and, through it, the backend.
    (monitor,) = of_kind(rendered, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    endpoints = {e["relabelings"][0]["replacement"]: e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert endpoints == {"streamwarden": "sw-metrics", "llm-backend": "sw-http"}
    assert of_kind(rendered, "PrometheusRule")
