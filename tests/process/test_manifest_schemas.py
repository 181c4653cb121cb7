"""Every object the manifests can render, checked as a cluster would check it.

Rendered with the real `kubectl kustomize`: each kustomization, and the base with each of its optional
parts switched on (the components left commented, the `release` label patch); and the Helm chart
(charts/streamwarden) with its options on, rendered by Helm's library. The built-in objects are
validated (strict: unknown fields fail) against the Kubernetes API schemas of every version
docs/operations.md claims; the custom ones (InferencePool, PodMonitor, PrometheusRule) against their
CustomResourceDefinitions in tests/process/crds/, the structural schema with its defaults and every CEL
rule (support/kube_crds.py), at each CRD release the docs name. Broken objects prove each check refuses.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from kubernetes_validate.utils import all_versions  # type: ignore[import-untyped]
from support.helm_chart import render_chart
from support.kube_crds import Crd, load_crd

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
GRAFANA = ROOT / "grafana"
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
CRD_DIR = Path(__file__).parent / "crds"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (Debian: kubernetes-client)")

CRDS = {
    ("inference.networking.k8s.io", "InferencePool"): [
        "gie-v1.0.0_inference.networking.k8s.io_inferencepools.yaml",
        "gie-v1.5.0_inference.networking.k8s.io_inferencepools.yaml",
        "gie-main_inference.networking.k8s.io_inferencepools.yaml",
    ],
    ("monitoring.coreos.com", "PodMonitor"): ["prometheus-operator_monitoring.coreos.com_podmonitors.yaml"],
    ("monitoring.coreos.com", "PrometheusRule"): ["prometheus-operator_monitoring.coreos.com_prometheusrules.yaml"],
}


def claimed_versions() -> list[str]:
    found = re.search(r"\*\*Kubernetes versions\*\*: 1\.(\d+) to 1\.(\d+)\.", OPERATIONS)
    assert found, "docs/operations.md says which Kubernetes versions the manifests support"
    return [f"1.{minor}.0" for minor in range(int(found[1]), int(found[2]) + 1)]


def group_of(doc: dict[str, Any]) -> str:
    return str(doc["apiVersion"]).rpartition("/")[0]


def is_custom(doc: dict[str, Any]) -> bool:
    """A kind with CRDs here; any other goes to kubernetes-validate, which fails on a kind it does not know."""
    return (group_of(doc), doc["kind"]) in CRDS


def crds_for(doc: dict[str, Any]) -> list[Crd]:
    return [load_crd(CRD_DIR / name) for name in CRDS[(group_of(doc), doc["kind"])]]


def kustomize(folder: Path) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def base_with(tmp: Path, name: str, edit: Any) -> Path:
    """A copy of the base (and the dashboard component it uses) whose kustomization.yaml `edit` changes."""
    copy_root = tmp / name
    shutil.copytree(KUBERNETES, copy_root / "deploy" / "kubernetes")
    shutil.copytree(GRAFANA, copy_root / "grafana")
    config = copy_root / "deploy" / "kubernetes" / "kustomization.yaml"
    text = config.read_text()
    changed = edit(text)
    assert changed != text, f"{name}: the base's kustomization.yaml no longer has what this variant switches on"
    config.write_text(changed)
    return copy_root / "deploy" / "kubernetes"


def uncomment_patch(text: str) -> str:
    commented = re.search(r"^# patches:\n(?:#.*\n)+", text, re.M)
    assert commented
    return text.replace(commented[0], "".join(line.removeprefix("# ") + "\n" for line in commented[0].splitlines()))


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every rendering: each kustomization, and the base with each optional part switched on."""
    if KUBECTL is None:
        pytest.skip("kubectl is not installed (Debian: kubernetes-client)")
    tmp = tmp_path_factory.mktemp("variants")
    folders = {str(p.parent.relative_to(ROOT)): p.parent for p in KUBERNETES.rglob("kustomization.yaml")
               if yaml.safe_load(p.read_text())["kind"] == "Kustomization"}
    folders["base + without-prometheus-operator"] = base_with(
        tmp, "no-operator", lambda t: t.replace("# - components/without-prometheus-operator",
                                                "- components/without-prometheus-operator"))
    folders["base + model-cache-pvc"] = base_with(
        tmp, "pvc", lambda t: t.replace("# - components/model-cache-pvc", "- components/model-cache-pvc"))
    folders["base + release label"] = base_with(tmp, "release", uncomment_patch)
    renderings = {name: kustomize(folder) for name, folder in folders.items()}
    if importlib.util.find_spec("helm_python") or os.environ.get("CI"):  # charts/streamwarden, every option on
        renderings["helm chart"] = render_chart({
            "inferencePool": {"enabled": True}, "monitoring": {"labels": {"release": "kube-prometheus-stack"}},
            "backends": {"vllm": {"modelCache": {"persistentVolumeClaim": True, "storageClassName": "fast"}}}})
    return renderings


def test_the_claimed_versions_are_ones_kubernetes_validate_has() -> None:
    """A claimed version without its schema would be skipped, not checked."""
    versions = claimed_versions()
    assert len(versions) >= 3
    assert set(versions) <= set(all_versions())


@needs_kubectl
def test_the_renderings_cover_every_kind_and_custom_object(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert len(rendered) >= 6, sorted(rendered)
    assert "helm chart" in rendered or not importlib.util.find_spec("helm_python")
    kinds = {(group_of(d), d["kind"]) for docs in rendered.values() for d in docs}
    custom = {k for k in kinds if k[0] in {"inference.networking.k8s.io", "monitoring.coreos.com"}}
    assert custom == set(CRDS), "every custom kind rendered has its CRDs here, and every CRD here is used"
    assert {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "Namespace",
            "PersistentVolumeClaim"} <= {k for _, k in kinds}


@needs_kubectl
@pytest.mark.parametrize("version", claimed_versions())
def test_every_built_in_object_validates_at_each_claimed_kubernetes_version(
        version: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    checked = 0
    for name, docs in rendered.items():
        for doc in docs:
            if is_custom(doc):
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as error:  # pragma: no cover - the failure's message
                pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']} at Kubernetes {version}: {error}")
            checked += 1
    assert checked >= 20


@needs_kubectl
def test_every_custom_object_validates_against_each_crd_release(rendered: dict[str, list[dict[str, Any]]]) -> None:
    checked: set[str] = set()
    for name, docs in rendered.items():
        for doc in filter(is_custom, docs):
            for crd in crds_for(doc):
                assert crd.errors(doc) == [], f"{name}: {doc['kind']} {doc['metadata']['name']} against {crd.path.name}"
                assert crd.errors(doc, old=doc) == [], "an unchanged re-apply (an update) passes too"
                checked.add(crd.path.name)
    assert checked == {f for files in CRDS.values() for f in files}


# --- each check refuses a broken object --------------------------------------------------------------------


def pool() -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((KUBERNETES / "examples" / "inference-pool" / "inferencepool.yaml")
                                             .read_text()) if d]
    return doc


def test_a_broken_built_in_object_is_refused() -> None:
    (deployment,) = [d for d in yaml.safe_load_all((KUBERNETES / "vllm-sidecar.yaml").read_text())
                     if d and d["kind"] == "Deployment"]
    for version in claimed_versions():
        kubernetes_validate.validate(deployment, version, strict=True)
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][1]["ports"][0]["containerPort"] = "8080"
    unknown = copy.deepcopy(deployment)
    unknown["spec"]["template"]["spec"]["containers"][1]["securityContext"]["readOnlyRootFs"] = True
    for bad in (broken, unknown):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, claimed_versions()[0], strict=True)


def test_the_inference_pool_cel_rules_are_evaluated_with_the_schemas_defaults() -> None:
    """`self.kind != 'Service' || has(self.port)`: `kind` is absent in the example and defaults to Service,
    so a picker without a port is refused only because the default is applied first."""
    v100, v150, main = (load_crd(CRD_DIR / f) for f in CRDS[("inference.networking.k8s.io", "InferencePool")])
    no_port = pool()
    del no_port["spec"]["endpointPickerRef"]["port"]
    for crd in (v100, v150, main):
        (error,) = crd.errors(no_port)
        assert "port is required when kind is 'Service'" in error, error
    other_kind = copy.deepcopy(no_port)
    other_kind["spec"]["endpointPickerRef"].update(kind="Gateway", group="gateway.networking.k8s.io")
    assert [crd.errors(other_kind) for crd in (v100, v150, main)] == [[], [], []]


def test_duplicate_target_ports_fail_the_cel_rule_where_there_is_one() -> None:
    v100, v150, main = (load_crd(CRD_DIR / f) for f in CRDS[("inference.networking.k8s.io", "InferencePool")])
    twice = pool()
    twice["spec"]["targetPorts"] *= 2
    assert any("maxItems" in e or "too long" in e for e in v100.errors(twice)), "v1.0.0: one port at most"
    for crd in (v150, main):
        assert any("port number must be unique" in e for e in crd.errors(twice)), crd.path.name
    two = pool()
    two["spec"]["targetPorts"].append({"number": 8081})
    assert v150.errors(two) == main.errors(two) == []


def test_a_missing_picker_fails_before_v1_6_and_passes_main() -> None:
    v100, v150, main = (load_crd(CRD_DIR / f) for f in CRDS[("inference.networking.k8s.io", "InferencePool")])
    unpicked = pool()
    del unpicked["spec"]["endpointPickerRef"]
    assert any("endpointPickerRef" in e for e in v100.errors(unpicked))
    assert any("endpointPickerRef" in e for e in v150.errors(unpicked))
    assert main.errors(unpicked) == []


def test_broken_monitoring_objects_are_refused_by_the_structural_schema() -> None:
    monitor = next(d for d in yaml.safe_load_all((KUBERNETES / "vllm-sidecar.yaml").read_text())
                   if d and d["kind"] == "PodMonitor")
    crd = load_crd(CRD_DIR / CRDS[("monitoring.coreos.com", "PodMonitor")][0])
    assert crd.errors(monitor) == []
    typo = copy.deepcopy(monitor)
    typo["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    assert any("intervall" in e for e in crd.errors(typo)), "an unknown field is refused, as kubectl --validate=strict"
    wrong = copy.deepcopy(monitor)
    wrong["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    assert any("interval" in e for e in crd.errors(wrong)), "the Duration pattern"
    rule = next(d for d in yaml.safe_load_all(
        (KUBERNETES / "components" / "alerts" / "prometheusrule.yaml").read_text()) if d)
    rules_crd = load_crd(CRD_DIR / CRDS[("monitoring.coreos.com", "PrometheusRule")][0])
    assert rules_crd.errors(rule) == []
    unnamed = copy.deepcopy(rule)
    del unnamed["spec"]["groups"][0]["name"]
    assert rules_crd.errors(unnamed)
    twice = copy.deepcopy(rule)
    twice["spec"]["groups"].append(twice["spec"]["groups"][0])
    assert any("duplicate" in e for e in rules_crd.errors(twice)), "groups is a list-type map keyed by name"


def test_transition_rules_see_old_self_only_on_an_update(tmp_path: Path) -> None:
    """Kubernetes' scoping: `self` is the value at the rule's node; a rule naming `oldSelf` runs on an update
    only, where the old object has a value there (correlated through map-keyed lists by key)."""
    crd = yaml.safe_load((CRD_DIR / CRDS[("inference.networking.k8s.io", "InferencePool")][2]).read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    spec["properties"]["selector"]["x-kubernetes-validations"] = [
        {"rule": "self == oldSelf", "message": "selector is immutable"}]
    ports = spec["properties"]["targetPorts"]
    ports["x-kubernetes-validations"] = [{"rule": "self.size() >= oldSelf.size()", "message": "ports are only added"}]
    ports["x-kubernetes-list-type"] = "map"
    ports["x-kubernetes-list-map-keys"] = ["number"]
    ports["items"]["x-kubernetes-validations"] = [{"rule": "self == oldSelf", "message": "an entry is immutable"}]
    (tmp_path / "crd.yaml").write_text(yaml.safe_dump(crd))
    immutable = load_crd(tmp_path / "crd.yaml")
    created = pool()
    assert immutable.errors(created) == [], "a create has no oldSelf: transition rules are skipped"
    relabelled = copy.deepcopy(created)
    relabelled["spec"]["selector"]["matchLabels"]["tier"] = "gpu"
    assert any("selector is immutable" in e for e in immutable.errors(relabelled, old=created))
    assert immutable.errors(relabelled) == []
    added = copy.deepcopy(created)
    added["spec"]["targetPorts"].insert(0, {"number": 80})
    assert immutable.errors(added, old=created) == [], "entries are matched by key, not by index; a new one has none"
    assert any("ports are only added" in e for e in immutable.errors(created, old=added))
