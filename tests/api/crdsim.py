"""What the API server does with a ParallelTrainJob under our CRD, offline: structural defaulting, the OpenAPI
checks the CRD uses, list-map key uniqueness and the CEL rules (evaluated with cel-python).

`admit(crd, obj, old)` returns the problems as (field path, message), the path built the way the API server
builds it (`spec.pod.env[0].name`; a rule's fieldPath appended to where the rule sits), so tests can compare it
with `parse_job`'s problem paths. Not a full API server: formats and CEL cost are not checked here.
"""

from __future__ import annotations

import copy
import re
from functools import cache
from typing import Any

import celpy
from celpy import celtypes

from paratrain.api.shapes import SHAPE_FIELDS
from paratrain.api.spec import Spec

Problems = list[tuple[str, str]]
_ENV = celpy.Environment()


def schema_of_version(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: prune the nulls of fields that are not nullable, fill absent properties that have a
    default, recurse into what exists."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name in out and out[name] is None and not sub.get("nullable"):
                del out[name]
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = apply_defaults(sub, out[name])
        return out
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        return {k: apply_defaults(schema["additionalProperties"], v) for k, v in value.items()}
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    return value


_TYPES = {"string": str, "boolean": bool, "object": dict, "array": list}


def _type_ok(kind: str, value: Any) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def schema_problems(schema: dict[str, Any], value: Any, path: str) -> Problems:
    """The OpenAPI keywords a structural schema may use, checked like the API server does (unknown fields too)."""
    if value is None:
        return [] if schema.get("nullable") else [(path, "must not be null")]
    if "type" in schema and not _type_ok(schema["type"], value):
        return [(path, f"must be of type {schema['type']}")]
    out = _scalar_problems(schema, value, path)
    if isinstance(value, dict):
        out += _object_problems(schema, value, path)
    if isinstance(value, list):
        out += _list_problems(schema, value, path)
    return out


def _scalar_problems(schema: dict[str, Any], value: Any, path: str) -> Problems:
    out: Problems = []
    if "enum" in schema and value not in schema["enum"]:
        out.append((path, f"must be one of {schema['enum']}"))
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)):
            out.append((path, f"must have at most {schema['maxLength']} characters"))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append((path, f"must match {schema['pattern']}"))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None and (value < low or (schema.get("exclusiveMinimum") and value == low)):
            out.append((path, f"must be {'>' if schema.get('exclusiveMinimum') else '>='} {low}"))
        if high is not None and (value > high or (schema.get("exclusiveMaximum") and value == high)):
            out.append((path, f"must be {'<' if schema.get('exclusiveMaximum') else '<='} {high}"))
    return out


def _object_problems(schema: dict[str, Any], value: dict[str, Any], path: str) -> Problems:
    out: Problems = [(f"{path}.{name}", "required") for name in schema.get("required", []) if name not in value]
    if len(value) > schema.get("maxProperties", len(value)):
        out.append((path, f"must have at most {schema['maxProperties']} items"))
    if "properties" in schema:
        for name, item in value.items():
            if name not in schema["properties"]:
                if path != ".metadata":  # ObjectMeta: the CRD may constrain only name and generateName
                    out.append((f"{path}.{name}", "unknown field"))  # kubectl's strict field validation
            else:
                out += schema_problems(schema["properties"][name], item, f"{path}.{name}")
    elif isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            out += schema_problems(schema["additionalProperties"], item, f"{path}[{key}]")
    return out


def _list_problems(schema: dict[str, Any], value: list[Any], path: str) -> Problems:
    out: Problems = []
    if len(value) > schema.get("maxItems", len(value)):
        out.append((path, f"must have at most {schema['maxItems']} items"))
    for i, item in enumerate(value):
        out += schema_problems(schema["items"], item, f"{path}[{i}]")
    if schema.get("x-kubernetes-list-type") == "map":
        keys = schema["x-kubernetes-list-map-keys"]
        seen = [tuple(item.get(k) for k in keys) for item in value]
        if len(set(seen)) != len(seen):
            # The API server names the repeated item (`env[1]: Duplicate value`); parse_job names the list.
            out.append((path, "Duplicate value"))
    return out


def to_cel(schema: dict[str, Any], value: Any) -> Any:
    """JSON → CEL values typed by the schema, as Kubernetes does (a `number` field is a double even if written 1)."""
    if value is None:
        return None
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return celpy.json_to_cel(value)
    kind = schema["type"]
    if kind == "object":
        if "properties" in schema:  # unknown fields are pruned before the rules run
            return celtypes.MapType({celtypes.StringType(k): to_cel(schema["properties"][k], v)
                                     for k, v in value.items() if k in schema["properties"]})
        return celtypes.MapType({celtypes.StringType(k): to_cel(schema["additionalProperties"], v)
                                 for k, v in value.items()})
    if kind == "array":
        return celtypes.ListType([to_cel(schema["items"], v) for v in value])
    return {"integer": celtypes.IntType, "number": lambda v: celtypes.DoubleType(float(v)),
            "string": celtypes.StringType, "boolean": celtypes.BoolType}[kind](value)


def _format(template: celtypes.StringType, values: celtypes.ListType) -> celtypes.StringType:
    """Kubernetes' CEL `string.format` (strings extension), for the `%s` and `%%` the CRD's messages use."""
    pieces = iter(values)
    return celtypes.StringType(re.sub(r"%[s%]", lambda m: "%" if m[0] == "%%" else _show(next(pieces)), template))


def _show(value: Any) -> str:
    if isinstance(value, celtypes.DoubleType):
        return repr(float(value))
    return str(value)


def _sum(values: celtypes.ListType) -> Any:
    """Kubernetes' CEL list library `sum()`."""
    return sum(values[1:], values[0]) if values else celtypes.IntType(0)


def _index_of(values: celtypes.ListType, item: Any) -> celtypes.IntType:
    """Kubernetes' CEL list library `indexOf()`: the first index of an equal element, or -1."""
    return celtypes.IntType(next((i for i, v in enumerate(values) if v == item), -1))


@cache
def program(expression: str) -> Any:
    return _ENV.program(_ENV.compile(expression), functions={"format": _format, "sum": _sum, "indexOf": _index_of})


def evaluate(expression: str, self_value: Any, old_value: Any = None) -> Any:
    activation = {"self": self_value}
    if old_value is not None:
        activation["oldSelf"] = old_value
    result = program(expression).evaluate(activation)
    if isinstance(result, celpy.CELEvalError):
        raise AssertionError(f"CEL rule failed to evaluate: {expression}: {result}")
    return result


def rule_failures(rule: dict[str, Any], self_cel: Any, old_cel: Any, path: str, fired: set[str] | None) -> Problems:
    transition = "oldSelf" in rule["rule"]
    if transition and old_cel is None:
        return []  # transition rules run on updates only, where the old value exists
    if evaluate(rule["rule"], self_cel, old_cel if transition else None):
        return []
    if fired is not None:
        fired.add(rule["rule"])
    message = (str(evaluate(rule["messageExpression"], self_cel, old_cel)) if "messageExpression" in rule
               else rule.get("message", f"failed rule: {rule['rule']}"))
    return [(path + rule.get("fieldPath", ""), message)]


def cel_problems(schema: dict[str, Any], value: Any, path: str, old: Any = None,
                 fired: set[str] | None = None) -> Problems:
    """Every rule at every node of `value`; `fired` collects the rules that rejected something."""
    if value is None:
        return []
    out: Problems = []
    if schema.get("x-kubernetes-validations"):
        self_cel, old_cel = to_cel(schema, value), to_cel(schema, old)
        for rule in schema["x-kubernetes-validations"]:
            out += rule_failures(rule, self_cel, old_cel, path, fired)
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name in value:
                old_sub = old.get(name) if isinstance(old, dict) else None
                out += cel_problems(sub, value[name], f"{path}.{name}", old_sub, fired)
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            out += cel_problems(schema["additionalProperties"], item, f"{path}[{key}]", None, fired)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += cel_problems(schema["items"], item, f"{path}[{i}]", None, fired)
    return out


_BLOCKING = ("must be of type", "must not be null", "required")


def admit(crd: dict[str, Any], obj: dict[str, Any], old: dict[str, Any] | None = None,
          fired: set[str] | None = None) -> Problems:
    """Default, check the schema, then run the CEL rules unless a type or required error makes their inputs
    malformed (the API server skips them then, too)."""
    root = schema_of_version(crd)
    obj = apply_defaults(root, obj)
    old = apply_defaults(root, old) if old is not None else None
    problems = schema_problems(root, obj, "")
    if not any(m.startswith(_BLOCKING) for _, m in problems):
        problems += cel_problems(root, obj, "", old, fired)
    return [(p.removeprefix("."), m) for p, m in problems]


def server_defaults(spec: Spec) -> dict[str, Any]:
    """What the API server stores for a job submitted with an empty spec, if `spec` is that job's parsed Spec: its
    dump less empty lists and maps (the CRD defaults no collection) and less the model's shape fields, which have
    no schema default so that a preset can fill them in (paratrain.api.shapes)."""
    out = without_empty(spec.dump())
    out["model"] = {k: v for k, v in out["model"].items() if k not in SHAPE_FIELDS}
    return out


def without_empty(value: Any) -> Any:
    """A spec less its empty lists and maps: the CRD defaults no collection, and a section whose fields all default
    to null (logging) is an empty map on the server and absent from a dump. Compare both sides through this."""
    if isinstance(value, dict):
        pruned = {k: without_empty(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v not in ({}, [])}
    return value
