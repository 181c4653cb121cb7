"""Every PromQL expression the deploy files query, ready to run, and a small reader for their selectors.

`dashboard_exprs()` and `rule_exprs()` give the expressions of grafana/streamwarden.json and
deploy/prometheus/rules.yml, so a test can run each one against a real Prometheus. Grafana variables are
replaced by concrete values (`$namespace`, `$pod` and `$api` by `.*`, their "All" value, which also matches a series
without the label; `$__rate_interval` by `1m`, ...), and an unknown variable is an error rather than a
query that silently fails to parse.

`selectors()` reads which series an expression selects and which labels it groups by: a tokenizer and a
few rules, enough for the contract checks (metric names, label names and values) without a full
PromQL parser. promtool, where installed, checks the full syntax.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "DASHBOARD",
    "DEFAULT_VARIABLES",
    "RULES",
    "Matcher",
    "Selector",
    "dashboard_exprs",
    "dashboard_targets",
    "rule_exprs",
    "selectors",
    "substitute",
]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "grafana" / "streamwarden.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"

DEFAULT_VARIABLES: Mapping[str, str] = {
    "namespace": ".*",
    "pod": ".*",
    "api": ".*",
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
    "__range_s": "3600",
    "__range_ms": "3600000",
    "__interval_ms": "15000",
}

# $name, ${name}, ${name:format}, [[name]]
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<selector>.+?)\s*,\s*(?P<label>\w+)\s*\)\s*$", re.S)


def substitute(expr: str, variables: Mapping[str, str] | None = None) -> str:
    """Replace Grafana variables in `expr`; raise KeyError naming one that has no value."""
    values = {**DEFAULT_VARIABLES, **(variables or {})}

    def replace(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group is not None)
        if name not in values:
            raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(replace, expr)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows keep their panels inside


def dashboard_targets(path: Path = DASHBOARD) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every query target of every panel, rows' nested panels included."""
    dashboard = json.loads(path.read_text())
    return [(panel, target) for panel in _panels(dashboard["panels"]) for target in panel.get("targets", [])]


def _variable_queries(path: Path) -> list[str]:
    dashboard = json.loads(path.read_text())
    queries = []
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def dashboard_exprs(path: Path = DASHBOARD, variables: Mapping[str, str] | None = None) -> list[str]:
    """Every panel query, then the series selector of every `label_values(...)` variable query."""
    exprs = [substitute(target["expr"], variables) for _, target in dashboard_targets(path)]
    for query in _variable_queries(path):
        match = _LABEL_VALUES.match(query)
        if match is None:
            raise ValueError(f"variable query is not label_values(<selector>, <label>): {query!r}")
        exprs.append(substitute(match["selector"], variables))
    return exprs


def rule_exprs(path: Path = RULES) -> list[str]:
    """The `expr` of every alerting and recording rule."""
    document = yaml.safe_load(path.read_text())
    return [str(rule["expr"]).strip() for group in document["groups"] for rule in group["rules"]]


# --- selectors -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str  # = != =~ !~
    value: str


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: tuple[Matcher, ...] = ()
    # labels named by the by/without/on/ignoring/group_* clauses of the whole expression
    grouping: frozenset[str] = field(default_factory=frozenset)


_TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<number>\d[\w.]*|\.\d[\w.]*)
  | (?P<ident>[A-Za-z_:][\w:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^@<>=,(){}\[\]])
    """,
    re.X,
)
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"}
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}


def _tokens(expr: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise ValueError(f"cannot read PromQL at {expr[pos:pos + 20]!r} in {expr!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            tokens.append((kind, match.group()))
        pos = match.end()
    return tokens


def _unquote(text: str) -> str:
    """A PromQL string literal's value (Go escapes; JSON's are the same for label values)."""
    if text.startswith("`"):
        return text[1:-1]
    if text.startswith("'"):
        text = '"' + text[1:-1].replace("\\'", "'").replace('"', '\\"') + '"'
    return str(json.loads(text))


def selectors(expr: str) -> list[Selector]:
    """The series selectors of one expression (after `substitute`), in order of appearance."""
    tokens = _tokens(expr)
    found: list[tuple[str, list[Matcher]]] = []
    grouping: set[str] = set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if text == "[":  # a range or subquery: durations only
            i = next(j for j in range(i, len(tokens)) if tokens[j][1] == "]") + 1
        elif kind == "ident" and text in _GROUPING:
            i += 1
            if following == "(":
                end = next(j for j in range(i, len(tokens)) if tokens[j][1] == ")")
                grouping.update(t for k, t in tokens[i + 1:end] if k == "ident")
                i = end + 1
        elif kind == "ident" and (following == "(" or following in _GROUPING or text.lower() in _KEYWORDS):
            i += 1  # a function or aggregation name (`sum by (...)` too), or a keyword
        elif kind == "ident" or text == "{":
            metric = text if kind == "ident" else ""
            i += 1 if kind == "ident" else 0
            matchers: list[Matcher] = []
            if i < len(tokens) and tokens[i][1] == "{":
                i += 1
                while tokens[i][1] != "}":
                    label, op, value = tokens[i][1], tokens[i + 1][1], tokens[i + 2]
                    if op not in ("=", "!=", "=~", "!~") or value[0] != "string":
                        raise ValueError(f"cannot read the label matcher at {label!r} in {expr!r}")
                    matchers.append(Matcher(label, op, _unquote(value[1])))
                    i += 3
                    if tokens[i][1] == ",":
                        i += 1
                i += 1
            if not metric:
                names = [m.value for m in matchers if m.label == "__name__" and m.op == "="]
                metric = names[0] if names else ""
            found.append((metric, [m for m in matchers if m.label != "__name__"]))
        else:
            i += 1
    frozen = frozenset(grouping)
    return [Selector(metric, tuple(matchers), frozen) for metric, matchers in found]
