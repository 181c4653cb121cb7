"""A custom object checked as a Kubernetes API server checks it against its CustomResourceDefinition.

What the API server does on a create (or an update, given the old object), in its order:

1. the structural schema's `default`s are applied (so a CEL rule sees `self.kind` where the schema
   defaults `kind`);
2. the object is validated against `spec.versions[].schema.openAPIV3Schema`: here with jsonschema (Draft 7),
   the `x-kubernetes-*` keys turned into what they mean (`int-or-string`, `nullable`, unknown fields
   rejected unless `x-kubernetes-preserve-unknown-fields`, as kubectl's strict field validation does;
   `list-type: set|map` unique items or keys);
3. every `x-kubernetes-validations` CEL rule is evaluated with `self` bound to the value at the rule's
   node (each item of a list, each value of a map), and only where that value exists. A rule that names
   `oldSelf` is a transition rule: it runs on an update only, where the old object has a value at the same
   place (reached through properties, map values and map-keyed lists, not through atomic lists).

The CEL evaluator is cel-python (`celpy`), a pure-Python implementation of Google's Common Expression
Language; the Kubernetes-specific CEL libraries (quantity, url, ...) are not in it, and a rule that needs
one fails loudly here instead of passing.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import celpy  # type: ignore[import-untyped]
import jsonschema
import yaml

__all__ = ["Crd", "load_crd"]

Json = Any


@dataclass(frozen=True)
class Crd:
    path: Path
    group: str
    kind: str
    schemas: dict[str, Json]  # served version -> openAPIV3Schema

    def errors(self, obj: Json, old: Json = None) -> list[str]:
        """What the API server would refuse in `obj` (an update from `old` if given); [] if nothing."""
        group, _, version = obj["apiVersion"].rpartition("/")
        if group != self.group or obj["kind"] != self.kind:
            return [f"{obj['apiVersion']} {obj['kind']} is not this CRD's {self.group} {self.kind}"]
        if version not in self.schemas:
            return [f"{self.kind} version {version} is not served (served: {sorted(self.schemas)})"]
        schema = self.schemas[version]
        obj = with_defaults(schema, copy.deepcopy(obj))
        old = with_defaults(schema, copy.deepcopy(old)) if old is not None else None
        validator = jsonschema.Draft7Validator(as_jsonschema(schema))
        found = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                 for e in validator.iter_errors(obj)]
        found += list(list_type_errors(schema, obj, "<root>"))
        found += list(cel_errors(schema, obj, old, "<root>"))
        return found


def load_crd(path: Path) -> Crd:
    crd = yaml.safe_load(path.read_text())
    assert crd["kind"] == "CustomResourceDefinition", path
    spec = crd["spec"]
    schemas = {v["name"]: v["schema"]["openAPIV3Schema"] for v in spec["versions"] if v.get("served")}
    return Crd(path, spec["group"], spec["names"]["kind"], schemas)


# --- 1. defaults ------------------------------------------------------------------------------------------


def with_defaults(schema: Json, value: Json) -> Json:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = with_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in set(value) - set(schema.get("properties", {})):
                value[name] = with_defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [with_defaults(schema["items"], item) for item in value]
    return value


# --- 2. the structural schema -----------------------------------------------------------------------------


def as_jsonschema(schema: Json) -> Json:
    """The openAPIV3Schema as a JSON Schema, with the Kubernetes extensions applied, not dropped."""
    out: dict[str, Json] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-") or key in ("nullable", "default", "format"):
            continue
        if key == "properties":
            out[key] = {name: as_jsonschema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = as_jsonschema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [as_jsonschema(sub) for sub in value]
        else:
            out[key] = value
    if schema.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [*out.get("anyOf", []), {"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False  # an unknown field: kubectl's strict field validation refuses it
    return out


def list_type_errors(schema: Json, value: Json, where: str) -> Iterator[str]:
    for sub, item, at, _ in children(schema, value, None, where):
        yield from list_type_errors(sub, item, at)
    if not isinstance(value, list):
        return
    kind = schema.get("x-kubernetes-list-type")
    if kind == "set" and len({yaml.safe_dump(v) for v in value}) != len(value):
        yield f"{where}: duplicate items in a list-type set"
    if kind == "map":
        keys = [tuple(item.get(k) for k in schema.get("x-kubernetes-list-map-keys", [])) for item in value]
        if len(set(keys)) != len(keys):
            yield f"{where}: duplicate keys {schema['x-kubernetes-list-map-keys']} in a list-type map"


# --- 3. the CEL rules -------------------------------------------------------------------------------------

ENV = celpy.Environment()


def children(schema: Json, value: Json, old: Json, where: str) -> Iterator[tuple[Json, Json, str, Json]]:
    """(schema, value, path, old value or None) of each child that has a value."""
    if isinstance(value, dict):
        olds = old if isinstance(old, dict) else {}
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                yield sub, value[name], f"{where}.{name}", olds.get(name)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in set(value) - set(schema.get("properties", {})):
                yield extra, value[name], f"{where}.{name}", olds.get(name)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        keys = schema.get("x-kubernetes-list-map-keys") if schema.get("x-kubernetes-list-type") == "map" else None
        by_key = {tuple(o.get(k) for k in keys): o for o in old} if keys and isinstance(old, list) else {}
        for i, item in enumerate(value):
            matched = by_key.get(tuple(item.get(k) for k in keys)) if keys else None  # atomic lists: no oldSelf
            yield schema["items"], item, f"{where}[{i}]", matched


def cel_errors(schema: Json, value: Json, old: Json, where: str) -> Iterator[str]:
    for rule in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if rule.get("optionalOldSelf"):
            raise NotImplementedError(f"{where}: optionalOldSelf rules are not evaluated here: {rule['rule']}")
        if transition and old is None:
            continue  # a create, or no old value here: the API server skips transition rules too
        activation = {"self": celpy.json_to_cel(value)}
        if transition:
            activation["oldSelf"] = celpy.json_to_cel(old)
        program = ENV.program(ENV.compile(rule["rule"]))
        try:
            result = program.evaluate(activation)
        except celpy.CELEvalError as error:
            result = error
        if isinstance(result, celpy.CELEvalError):
            yield f"{where}: rule {rule['rule']!r} did not evaluate: {result}"
        elif result is not True and not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            yield f"{where}: {rule.get('message') or rule['rule']} (rule {rule['rule']!r})"
    for sub, item, at, old_item in children(schema, value, old, where):
        yield from cel_errors(sub, item, old_item, at)
