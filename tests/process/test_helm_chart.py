"""charts/streamwarden: the kustomize base's deployment as a Helm chart, linted and rendered by Helm's own
library (helm-python-sdk), its objects equal to `kubectl kustomize`'s for the default values and for each
switch that matches a kustomize option (no Prometheus Operator, the `release` label, model caches on
claims, the InferencePool example). The Namespace is the one object only kustomize makes: Helm installs
into `--namespace llm --create-namespace`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.helm_chart import CHART, helm, render_chart

from proxy import __version__

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
GRAFANA = ROOT / "grafana"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (Debian: kubernetes-client)")
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()


def kustomize(folder: Path) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def base_with(tmp: Path, edit: Any) -> Path:
    shutil.copytree(KUBERNETES, tmp / "deploy" / "kubernetes")
    shutil.copytree(GRAFANA, tmp / "grafana")
    config = tmp / "deploy" / "kubernetes" / "kustomization.yaml"
    text = config.read_text()
    assert edit(text) != text
    config.write_text(edit(text))
    return tmp / "deploy" / "kubernetes"


def by_identity(docs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    keyed = {(d["apiVersion"], d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] != "Namespace"}
    assert len(keyed) == len([d for d in docs if d["kind"] != "Namespace"]), "one object per identity"
    return keyed


def assert_same_objects(chart: list[dict[str, Any]], kustomized: list[dict[str, Any]]) -> None:
    mine, theirs = by_identity(chart), by_identity(kustomized)
    assert sorted(mine) == sorted(theirs)
    for key in theirs:
        assert mine[key] == theirs[key], f"{key} differs between the chart and kustomize"


def test_the_chart_lints_clean_at_each_claimed_kubernetes_version() -> None:
    library = helm()
    found = re.search(r"\*\*Kubernetes versions\*\*: 1\.(\d+) to 1\.(\d+)\.", OPERATIONS)
    assert found
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">=1.{found[1]}.0-0"
    assert chart["version"] == chart["appVersion"] == __version__
    for minor in (int(found[1]), int(found[2])):
        report = library.lint(CHART, strict=True, namespace="llm", kube_version=f"v1.{minor}.0")
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report["messages"]


@needs_kubectl
def test_the_default_values_render_the_kustomize_base() -> None:
    chart = render_chart()
    assert_same_objects(chart, kustomize(KUBERNETES))
    assert {d["metadata"]["namespace"] for d in chart} == {"llm"}
    assert [d["metadata"]["namespace"] for d in render_chart(namespace="inference")].count("inference") == len(chart)


@needs_kubectl
def test_without_the_operator_the_chart_leaves_out_what_the_component_leaves_out(tmp_path: Path) -> None:
    variant = base_with(tmp_path, lambda t: t.replace("# - components/without-prometheus-operator",
                                                      "- components/without-prometheus-operator"))
    assert_same_objects(render_chart({"monitoring": {"enabled": False}}), kustomize(variant))


@needs_kubectl
def test_the_release_label_reaches_the_monitors_and_the_rules_as_the_readmes_patch_does(tmp_path: Path) -> None:
    def uncomment(text: str) -> str:
        commented = re.search(r"^# patches:\n(?:#.*\n)+", text, re.M)
        assert commented
        return text.replace(commented[0], "".join(x.removeprefix("# ") + "\n" for x in commented[0].splitlines()))

    labelled = render_chart({"monitoring": {"labels": {"release": "kube-prometheus-stack"}}})
    assert_same_objects(labelled, kustomize(base_with(tmp_path, uncomment)))


@needs_kubectl
def test_model_caches_on_claims_as_the_component_puts_them(tmp_path: Path) -> None:
    variant = base_with(tmp_path, lambda t: t.replace("# - components/model-cache-pvc", "- components/model-cache-pvc"))
    claims = {"backends": {b: {"modelCache": {"persistentVolumeClaim": True}} for b in ("vllm", "llamacpp")}}
    assert_same_objects(render_chart(claims), kustomize(variant))
    classed = render_chart({"backends": {"vllm": {"modelCache": {"persistentVolumeClaim": True,
                                                                  "storageClassName": "fast"}}}})
    (claim,) = [d for d in classed if d["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["storageClassName"] == "fast"


@needs_kubectl
def test_the_inference_pool_option_is_the_example(tmp_path: Path) -> None:
    (pool,) = kustomize(KUBERNETES / "examples" / "inference-pool")
    pooled = render_chart({"inferencePool": {"enabled": True}})
    assert_same_objects(pooled, [*kustomize(KUBERNETES), pool])
    assert not [d for d in render_chart() if d["kind"] == "InferencePool"], "off by default"


def test_the_runbook_base_reaches_every_rule_and_the_image_its_tag() -> None:
    mine = "https://wiki.internal.example/llm/runbooks.md"
    docs = render_chart({"alerts": {"runbookBase": mine}, "image": {"repository": "r.example/sw", "tag": "9.9.9"}})
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert len(rules) >= 9
    assert [r["annotations"]["runbook_url"] for r in rules] == [f"{mine}#{r['alert'].lower()}" for r in rules]
    images = {c["image"] for d in docs if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "streamwarden"}
    assert images == {"r.example/sw:9.9.9"}


def test_the_chart_reads_the_one_copy_of_the_rules_and_the_dashboard(tmp_path: Path) -> None:
    """files/ holds links to deploy/prometheus/rules.yml and grafana/streamwarden.json, not copies; Helm
    follows them when it loads the chart and when it packages it: the archive renders the same objects."""
    library = helm()
    archive = library.package(CHART, destination=tmp_path)
    with library.Chart.load(archive) as packaged:
        rendered = packaged.render({}, name="llm", namespace="llm")
    from_archive = [d for path, text in sorted(rendered.items()) if path.endswith(".yaml")
                    for d in yaml.safe_load_all(text) if d]
    assert from_archive == render_chart()
    (dashboard,) = [d for d in from_archive if d["kind"] == "ConfigMap"]
    assert dashboard["data"]["streamwarden.json"] == (GRAFANA / "streamwarden.json").read_text()
    files = CHART / "files"
    assert {p.name: p.resolve() for p in files.iterdir()} == {
        "rules.yml": ROOT / "deploy" / "prometheus" / "rules.yml",
        "streamwarden.json": GRAFANA / "streamwarden.json",
    }
    assert all(p.is_symlink() for p in files.iterdir())


def test_values_schema_refuses_a_misspelled_or_mistyped_value() -> None:
    """values.schema.json: `helm install --set monitoring.label.release=x` fails instead of doing nothing."""
    library = helm()
    for wrong, where in (({"monitoring": {"label": {"release": "x"}}}, "label"),
                         ({"backends": {"vllm": {"port": "8000"}}}, "/backends/vllm/port"),
                         ({"sidecar": {"logFormat": "text"}}, "/sidecar/logFormat")):
        with pytest.raises(library.HelmValuesError, match=where):
            render_chart(wrong)
        report = library.lint(CHART, wrong, strict=True)
        assert any(m["severity"] == 3 and where in m["error"] for m in report["messages"]), report
    assert render_chart({"backends": {"llamacpp": {"enabled": False}}})
