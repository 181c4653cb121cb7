"""The metrics side of the deploy files: Grafana dashboard, alert rules and their promtool checks.

Every metric name and label the dashboard and the rules query must be one design section 7 defines, and
every fixed label value one of sections 3 and 10: the contract is written out below, so a renamed metric
or reason breaks a test instead of a dashboard. The promtool tests (marker `prometheus`) check the rules,
run their unit tests, check both Prometheus configs and parse every dashboard query; they are skipped
when promtool is not on PATH (Debian: `apt-get install prometheus`).
"""

from __future__ import annotations

import enum
import json
import re
import shutil
import subprocess
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.contract import (
    ABORT_PHASES,
    APIS,
    CANCELLATION_REASONS,
    KINDS,
    METRICS,
    OUTCOMES,
    REQUEST_REASONS,
    REWRITE_REASONS,
    SOURCES,
)
from support.promql_exprs import (
    DASHBOARD,
    RULES,
    Selector,
    dashboard_exprs,
    dashboard_targets,
    rule_exprs,
    selectors,
    substitute,
)

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES_TEST = PROMETHEUS / "rules_test.yml"
PROMETHEUS_RULE = ROOT / "deploy" / "kubernetes" / "components" / "alerts" / "prometheusrule.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not on PATH (Debian: apt-get install prometheus)"
)

# --- the contract of design section 7 (metrics), 3 and 10 (label values) ------------------------------

# Added by the scrape, not the exporter: the Prometheus Operator and the kubernetes_sd job add pod,
# namespace and container; every scrape adds job and instance.
TARGET_LABELS = frozenset({"pod", "namespace", "container", "endpoint", "service", "job", "instance"})

FIXED_VALUES: dict[tuple[str, str], frozenset[str]] = {
    ("streamwarden_requests_total", "outcome"): OUTCOMES,
    ("streamwarden_requests_total", "reason"): REQUEST_REASONS,
    ("streamwarden_request_duration_seconds", "outcome"): OUTCOMES,
    ("streamwarden_upstream_cancellations_total", "reason"): CANCELLATION_REASONS,
    ("streamwarden_stream_rewrites_total", "reason"): REWRITE_REASONS,
    ("streamwarden_tokens_total", "kind"): KINDS,
    ("streamwarden_tokens_total", "source"): SOURCES,
    ("streamwarden_aborts_total", "phase"): ABORT_PHASES,
    **{(name, "api"): APIS for name, (_, labels) in METRICS.items() if "api" in labels},
    # The jobs the PodMonitors' relabelings and both Prometheus configs name (StreamwardenTargetDown).
    ("up", "job"): frozenset({"streamwarden", "llm-backend"}),
}


# The backend's own series the dashboard shows (job llm-backend, scraped through the proxy's main port),
# with the labels the backends export them with: vLLM's as recorded from a real vLLM
# (/work/shared/research/vllm-cpu-samples/metrics_sample.txt), llama.cpp's from the llama-server tier
# (tests/real: requests_processing, requests_deferred). A name not here is no backend metric.
BACKEND_METRICS: dict[str, frozenset[str]] = {
    "vllm:num_requests_running": frozenset({"engine", "model_name"}),
    "vllm:num_requests_waiting": frozenset({"engine", "model_name"}),
    "vllm:kv_cache_usage_perc": frozenset({"engine", "model_name"}),
    "llamacpp:requests_processing": frozenset(),
    "llamacpp:requests_deferred": frozenset(),
}


def family(series: str) -> tuple[str, frozenset[str]]:
    """The contract metric a series name belongs to, and the labels the series carries."""
    if series in METRICS:
        return series, METRICS[series][1]
    if series in BACKEND_METRICS:
        return series, BACKEND_METRICS[series]
    if series == "up":  # Prometheus' own per-target health series: only target labels
        return series, frozenset()
    for suffix, extra in (("_bucket", {"le"}), ("_sum", set()), ("_count", set())):
        base = series.removesuffix(suffix)
        if base != series and base in METRICS and METRICS[base][0] == "histogram":
            return base, METRICS[base][1] | extra
    raise AssertionError(f"{series!r} is not a metric of design section 7")


def literal_values(op: str, value: str) -> list[str]:
    """The label values an = / != matcher names, or the alternatives of a plain `a|b` regex."""
    if op in ("=", "!="):
        return [value]
    if re.fullmatch(r"\w+(\|\w+)*", value):
        return value.split("|")
    return []  # a real pattern such as .*: nothing fixed to check


# --- dashboard -----------------------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def test_dashboard_panels_use_the_datasource_variable() -> None:
    board = dashboard()
    assert 36 <= board["schemaVersion"] <= 41
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
    for panel, target in dashboard_targets():
        assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
    assert list(variables)[:4] == ["datasource", "namespace", "pod", "api"]
    for name in ("namespace", "pod", "api"):
        variable = variables[name]
        assert variable["datasource"]["uid"] == "${datasource}"
        assert re.fullmatch(rf"label_values\(.+, {name}\)", variable["definition"])
        assert variable["includeAll"] is True
        assert variable["allValue"] == ".*"


def test_dashboard_queries_filter_by_namespace_pod_and_api() -> None:
    for panel, target in dashboard_targets():
        expr = substitute(target["expr"], {"namespace": "<ns>", "pod": "<pod>", "api": "<api>"})
        for selector in selectors(expr):
            matchers = {(m.label, m.op, m.value) for m in selector.matchers}
            assert ("namespace", "=~", "<ns>") in matchers, f"{panel['title']}: {selector.metric} misses $namespace"
            assert ("pod", "=~", "<pod>") in matchers, f"{panel['title']}: {selector.metric} misses $pod"
            if "api" in family(selector.metric)[1]:
                assert ("api", "=~", "<api>") in matchers, f"{panel['title']}: {selector.metric} misses $api"


def test_dashboard_has_the_panels_of_the_brief() -> None:
    found = [(s.metric, s.grouping, {(m.label, m.value) for m in s.matchers})
             for e in dashboard_exprs() for s in selectors(e)]

    def has(metric: str, grouping: set[str], matcher: tuple[str, str] | None = None) -> bool:
        return any(m == metric and grouping <= g and (matcher is None or matcher in ms) for m, g, ms in found)

    assert has("streamwarden_requests_total", {"outcome"})
    assert has("streamwarden_requests_total", {"reason"})
    assert has("streamwarden_requests_total", {"api"}, ("outcome", "error"))
    assert has("streamwarden_requests_total", {"api"}, ("outcome", "aborted"))
    assert has("streamwarden_tokens_total", {"kind", "source"})
    assert has("streamwarden_inflight_requests", {"api"})
    assert has("streamwarden_upstream_cancellations_total", {"reason"})
    assert has("streamwarden_stream_rewrites_total", {"reason"})
    assert has("streamwarden_upstream_responses_total", {"code"})
    assert has("streamwarden_upstream_up", {"pod"})
    assert has("streamwarden_build_info", {"version"})
    assert has("streamwarden_aborts_total", {"phase"})
    # Resumes, cancel-hook failures and the backend's own queue and KV cache
    assert has("streamwarden_stream_resumes_total", {"reason", "result"})
    assert has("streamwarden_cancel_hook_failures_total", {"reason"})
    for backend in BACKEND_METRICS:
        assert has(backend, {"pod"}), backend
    exprs = "\n".join(dashboard_exprs())
    for histogram in (
        "streamwarden_time_to_first_token_seconds",
        "streamwarden_request_duration_seconds",
        "streamwarden_inter_token_latency_seconds",
        "streamwarden_time_per_output_token_seconds",
    ):
        for quantile in ("0.50", "0.95", "0.99"):
            assert f"histogram_quantile({quantile}, sum by (le) (rate({histogram}_bucket" in exprs
    for quantile in ("0.50", "0.95"):
        assert f"histogram_quantile({quantile}, sum by (le) (rate(streamwarden_abort_wait_seconds_bucket" in exprs


# What a panel shows decides its unit (rewrites are not requests). Rates of counters of
# requests are reqps; ratios percentunit; quantiles of a *_seconds histogram s; other counts per
# second name what they count.
RATE_UNITS = {
    "streamwarden_requests_total": "reqps",
    "streamwarden_upstream_responses_total": "reqps",
    "streamwarden_upstream_cancellations_total": "reqps",
    "streamwarden_aborts_total": "reqps",
    "streamwarden_stream_rewrites_total": "suffix: rewrites/s",
    "streamwarden_tokens_total": "suffix: tokens/s",
    "streamwarden_stream_resumes_total": "reqps",
    "streamwarden_cancel_hook_failures_total": "reqps",
}


def expected_unit(expr: str) -> str:
    metrics = {s.metric for s in selectors(substitute(expr))}
    if expr.startswith("histogram_quantile("):
        [metric] = metrics
        assert metric.endswith("_seconds_bucket"), expr
        return "s"
    if "\n/\n" in expr:
        return "percentunit"
    if "rate(" in expr:
        units = {RATE_UNITS[m] for m in metrics}
        assert len(units) == 1, expr
        return units.pop()
    [metric] = metrics
    if metric == "vllm:kv_cache_usage_perc":
        return "percentunit"  # a fraction already: 1 is full
    if metric in BACKEND_METRICS:
        return "short"  # requests in the backend's queue
    return {"streamwarden_inflight_requests": "short"}.get(metric, "none")  # a count; up/build info: values


def test_every_panel_has_the_unit_of_what_it_shows() -> None:
    checked = 0
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            continue
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        expected = {expected_unit(target["expr"]) for target in panel["targets"]}
        assert {unit} == expected, f"{panel['title']}: unit {unit!r}, shows {expected}"
        checked += 1
    assert checked >= 17


def _without_threshold(expr: str) -> str:
    match = re.search(r"\s*>\s*[\d.]+\s*$", expr)
    assert match is not None, expr
    return expr[: match.start()]


def test_dashboard_error_ratio_is_the_alerts_expression() -> None:
    """The panel and the alert agree on what counts (client errors but 408 and 429 do not)."""
    [panel] = [p for p in dashboard()["panels"] if p["title"] == "Error ratio by api"]
    [target] = panel["targets"]
    shown = target["expr"].replace('namespace=~"$namespace", pod=~"$pod", api=~"$api", ', "")
    shown = shown.replace('{namespace=~"$namespace", pod=~"$pod", api=~"$api"}', "")
    shown = shown.replace("$__rate_interval", "5m").replace("sum by (api)", "sum by (namespace, api)")
    [rule] = [r for r in alert_rules() if r["alert"] == "StreamwardenHighErrorRatio"]
    assert " ".join(shown.split()) == " ".join(_without_threshold(str(rule["expr"])).split())
    assert "upstream_4xx" in shown
    assert 'code=~"408|429"' in shown


def bad_enum_values(obj: Any, where: str) -> list[str]:
    """Fields the SDK declares as enums but that hold a value outside the enum (it does not check)."""
    if isinstance(obj, list):
        return [bad for i, item in enumerate(obj) for bad in bad_enum_values(item, f"{where}[{i}]")]
    if not type(obj).__module__.startswith("grafana_foundation_sdk"):
        return []
    try:
        hints = typing.get_type_hints(type(obj))
    except (NameError, TypeError):  # an annotation the SDK leaves unresolvable: nothing to check there
        return []
    bad: list[str] = []
    for name, hint in hints.items():
        value = getattr(obj, name, None)
        if value is None:
            continue
        enums = [t for t in (typing.get_args(hint) or (hint,)) if isinstance(t, type) and issubclass(t, enum.Enum)]
        if enums and not isinstance(value, enum.Enum):
            if not any(value in {member.value for member in e} for e in enums):
                bad.append(f"{where}/{name}: {value!r} is not a {enums[0].__name__}")
        else:
            bad.extend(bad_enum_values(value, f"{where}/{name}"))
    return bad


def test_grafana_foundation_sdk_reads_the_dashboard_without_losing_anything() -> None:
    """Grafana's own types (grafana-foundation-sdk) parse the dashboard and re-emit it: no field is
    dropped as unknown, no value changes, every enum-typed field holds one of its enum's values, and
    every panel's options and field config take its plugin's types (a typo in a key, a bad enum value
    or an unknown panel type shows here)."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard, Panel, RowPanel

    register_default_plugins()
    source = dashboard()
    parsed = Dashboard.from_json(source)
    emitted = json.loads(json.dumps(parsed, cls=JSONEncoder))
    lost: list[str] = []

    def compare(mine: Any, theirs: Any, where: str) -> None:
        if isinstance(mine, dict) and isinstance(theirs, dict):
            for key, value in mine.items():
                if key not in theirs:
                    lost.append(f"{where}/{key}")
                else:
                    compare(value, theirs[key], f"{where}/{key}")
        elif isinstance(mine, list) and isinstance(theirs, list):
            if len(mine) != len(theirs):
                lost.append(f"{where}: {len(mine)} items became {len(theirs)}")
            for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
                compare(a, b, f"{where}[{i}]")
        elif mine != theirs:
            lost.append(f"{where}: {mine!r} became {theirs!r}")

    compare(source, emitted, "")
    # Two fields Grafana writes itself that the SDK's schema does not model: the built-in annotation's
    # marker and a query variable's `definition` (the query as the editor shows it).
    unmodelled = {"/annotations/list[0]/builtIn"} | {
        f"/templating/list[{i}]/definition" for i, v in enumerate(source["templating"]["list"]) if v["type"] == "query"
    }
    assert set(lost) == unmodelled, lost
    assert bad_enum_values(parsed, "") == []
    panels = parsed.panels or []
    assert len(panels) == len(source["panels"])
    for panel in panels:
        assert isinstance(panel, (Panel, RowPanel))
        if isinstance(panel, Panel):
            assert not isinstance(panel.options, dict), f"{panel.title}: {panel.type} options were not typed"
            assert panel.field_config is not None
            assert panel.field_config.defaults is not None


# --- every PromQL expression: dashboard, rules, and the rules' unit-test series --------------------------


def rules_test_series() -> list[str]:
    document = yaml.safe_load(RULES_TEST.read_text())
    return [series["series"] for test in document["tests"] for series in test["input_series"]]


SOURCES = {
    "dashboard": dashboard_exprs,
    "rules": rule_exprs,
    "rules_test": rules_test_series,
}


@pytest.mark.parametrize("source", SOURCES)
def test_promql_names_only_contract_metrics_and_labels(source: str) -> None:
    exprs = SOURCES[source]()
    assert exprs
    for expr in exprs:
        found: list[Selector] = selectors(expr)
        assert found, f"no series selector in {expr!r}"
        known = set(TARGET_LABELS)
        for selector in found:
            _, labels = family(selector.metric)
            known |= labels
            for matcher in selector.matchers:
                assert matcher.label in labels | TARGET_LABELS, f"{selector.metric} has no label {matcher.label}"
        assert found[0].grouping <= known, f"grouping by a label no metric has: {expr!r}"


def test_legends_name_labels_the_query_keeps() -> None:
    for panel, target in dashboard_targets():
        expr = substitute(target["expr"])
        kept = set().union(*(s.grouping for s in selectors(expr)))
        for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
            assert label in kept, f"{panel['title']}: legend {{{{{label}}}}} is not kept by {expr!r}"


@pytest.mark.parametrize("source", SOURCES)
def test_label_values_are_from_the_fixed_sets(source: str) -> None:
    checked = 0
    for expr in SOURCES[source]():
        for selector in selectors(expr):
            name, _ = family(selector.metric)
            for matcher in selector.matchers:
                allowed = FIXED_VALUES.get((name, matcher.label))
                if allowed is None:
                    continue
                for value in literal_values(matcher.op, matcher.value):
                    assert value in allowed, f"{name}{{{matcher.label}={value!r}}} is not a value of the contract"
                    checked += 1
    assert checked, f"{source}: no fixed label value was checked"


# --- alert rules (the promtool runs are in test_prometheus_rules.py) -------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def test_every_alert_has_for_severity_and_text() -> None:
    rules = alert_rules()
    assert len(rules) >= 6
    for rule in rules:
        assert rule["alert"].startswith("Streamwarden")
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["description"]


def test_every_alert_keeps_the_namespace_label() -> None:
    """Alerts say which namespace (grouped by it, or not aggregated at all)."""
    for rule in alert_rules():
        expr = str(rule["expr"])
        groupings = [s.grouping for s in selectors(expr)]
        aggregated = re.search(r"\b(sum|max|min|avg|count)\b", expr) is not None
        assert not aggregated or all("namespace" in g for g in groupings), rule["alert"]
        assert "namespace" in rule["annotations"]["description"], rule["alert"]


def test_prometheusrule_manifest_carries_the_same_rules() -> None:
    """The PrometheusRule for prometheus-operator users is rules.yml's groups, kept identical."""
    manifest = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["metadata"]["name"] == "streamwarden"
    assert set(manifest["spec"]) == {"groups"}
    assert manifest["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"], (
        "deploy/kubernetes/components/alerts/prometheusrule.yaml differs from rules.yml: copy its groups under spec"
    )


def test_alerts_cover_the_brief() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    by_expr = {name: " ".join(str(rule["expr"]).split()) for name, rule in rules.items()}

    def alert(*fragments: str) -> str:
        names = [name for name, expr in by_expr.items() if all(f in expr for f in fragments)]
        assert len(names) == 1, f"expected one alert on {fragments}, found {names}"
        return str(names[0])

    alert('outcome="error"', "[5m]")
    alert('outcome="aborted"')
    assert by_expr[alert("streamwarden_upstream_up")] == "streamwarden_upstream_up == 0"
    assert rules[alert("streamwarden_upstream_up")]["for"] == "1m"
    alert("streamwarden_stream_rewrites_total", 'reason="stall_timeout"')
    alert("streamwarden_stream_rewrites_total", 'reason="stray_http_block"')
    alert("histogram_quantile(0.95", "streamwarden_time_to_first_token_seconds_bucket")
    alert("histogram_quantile(0.95", "streamwarden_inter_token_latency_seconds_bucket")
    alert("streamwarden_aborts_total", 'phase=~"before_headers|before_first_token"')


def test_rule_unit_tests_show_every_alert_firing_and_silent() -> None:
    document = yaml.safe_load(RULES_TEST.read_text())
    assert document["rule_files"] == ["rules.yml"]
    cases = [case for test in document["tests"] for case in test.get("alert_rule_test", [])]
    for rule in alert_rules():
        mine = [case for case in cases if case["alertname"] == rule["alert"]]
        assert any(case.get("exp_alerts") for case in mine), f"{rule['alert']} is never shown firing"
        assert any(not case.get("exp_alerts") for case in mine), f"{rule['alert']} is never shown silent"


# --- promtool ------------------------------------------------------------------------------------------


def promtool(*args: str) -> str:
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=30, cwd=ROOT, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


@pytest.mark.prometheus
@needs_promtool
def test_promtool_checks_the_rules() -> None:
    assert f"SUCCESS: {len(rule_exprs())} rules found" in promtool("check", "rules", str(RULES))


@pytest.mark.prometheus
@needs_promtool
def test_promtool_runs_the_rule_unit_tests() -> None:
    assert "SUCCESS" in promtool("test", "rules", str(RULES_TEST))


@pytest.mark.prometheus
@needs_promtool
def test_promtool_checks_the_compose_config() -> None:
    output = promtool("check", "config", str(PROMETHEUS / "prometheus.yml"))
    assert "SUCCESS: 1 rule files found" in output


def _knows_kubernetes_sd(tmp_path: Path) -> bool:
    """Debian's promtool is built without Kubernetes discovery and rejects the whole section."""
    probe = tmp_path / "probe.yml"
    job = {"job_name": "probe", "kubernetes_sd_configs": [{"role": "pod"}]}
    probe.write_text(yaml.safe_dump({"scrape_configs": [job]}))
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "check", "config", str(probe)], capture_output=True, text=True, timeout=30)
    if "field kubernetes_sd_configs not found" in result.stdout + result.stderr:
        return False
    assert result.returncode == 0, result.stdout + result.stderr
    return True


@pytest.mark.prometheus
@needs_promtool
def test_promtool_checks_the_kubernetes_config(tmp_path: Path) -> None:
    """The whole file where promtool has Kubernetes discovery; else all of it but the discovery block
    (the relabelling, the rule files), which test_deploy_files.py checks against the manifests."""
    config = yaml.safe_load((PROMETHEUS / "prometheus-kubernetes.yml").read_text())
    if not _knows_kubernetes_sd(tmp_path):
        for job in config["scrape_configs"]:
            assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
            job["static_configs"] = [{"targets": ["10.0.0.7:9464"]}]
    for rule_file in config["rule_files"]:
        shutil.copy(PROMETHEUS / rule_file, tmp_path / rule_file)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    assert "SUCCESS: 1 rule files found" in promtool("check", "config", str(tmp_path / "prometheus.yml"))


@pytest.mark.prometheus
@needs_promtool
def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """Each query, its Grafana variables substituted, as a recording rule that promtool parses."""
    exprs = dashboard_exprs()
    rules = [{"record": f"dashboard_query_{i}", "expr": expr} for i, expr in enumerate(exprs)]
    path = tmp_path / "dashboard.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"SUCCESS: {len(exprs)} rules found" in promtool("check", "rules", str(path))
