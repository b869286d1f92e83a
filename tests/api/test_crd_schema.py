"""The CRD is a valid, structural apiextensions/v1 object whose schema says what the typed models say."""

from __future__ import annotations

from typing import Any, Iterator

import kubernetes_validate
import pytest

from paratrain import contract
from paratrain.api import crd as crd_module
from paratrain.api.crd import crd_manifest
from paratrain.api.spec import RESERVED_MOUNT_PATHS, Spec
from paratrain.api.status import JobStatus

from .crdsim import (apply_defaults, cel_problems, evaluate, program, schema_of_version, schema_problems,
                     server_defaults, to_cel, without_empty)

# Keywords Kubernetes refuses in a structural schema (or in any CRD schema).
FORBIDDEN = {"$ref", "$defs", "definitions", "anyOf", "oneOf", "allOf", "not", "patternProperties",
             "propertyNames", "additionalItems", "uniqueItems", "title", "const", "dependencies"}


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return crd_manifest()


@pytest.fixture(scope="module")
def root(crd: dict[str, Any]) -> dict[str, Any]:
    return schema_of_version(crd)


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}[*]")
    if "items" in node:
        yield from walk(node["items"], f"{path}[]")


def test_crd_passes_strict_kubernetes_validation(crd: dict[str, Any]) -> None:
    kubernetes_validate.validate(crd, "1.30.0", strict=True)


def test_crd_identity(crd: dict[str, Any]) -> None:
    assert crd["metadata"]["name"] == "paralleltrainjobs.paratrain.dev"
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["shortNames"] == ["ptj"]
    (version,) = crd["spec"]["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def test_schema_is_structural(root: dict[str, Any]) -> None:
    for path, node in walk(root):
        assert not FORBIDDEN & node.keys(), f"{path}: {FORBIDDEN & node.keys()}"
        assert "type" in node, f"{path}: every node needs a type"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties", {}) is not False, path
        if node.get("x-kubernetes-list-type") == "map":
            item = node["items"]
            for key in node["x-kubernetes-list-map-keys"]:
                assert key in item.get("required", []) or "default" in item["properties"][key], (path, key)


def test_metadata_restricts_only_the_name(root: dict[str, Any]) -> None:
    meta = root["properties"]["metadata"]
    assert set(meta["properties"]) == {"name"}  # Kubernetes allows only name and generateName here
    assert schema_problems(meta, {"name": "a" * 50}, "metadata") == []
    assert schema_problems(meta, {"name": "a" * 51}, "metadata")
    assert schema_problems(meta, {"name": "has.dot"}, "metadata")  # would break the Service and DNS names


def test_optional_fields_are_nullable_not_unions(root: dict[str, Any]) -> None:
    spec = root["properties"]["spec"]
    assert spec["properties"]["checkpoint"]["properties"]["path"]["nullable"] is True
    affinity = dict(spec["properties"]["scheduling"]["properties"]["affinity"])
    assert affinity.pop("description")
    assert affinity == {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "nullable": True}


def test_every_default_is_valid_for_its_own_schema(root: dict[str, Any]) -> None:
    defaults = [(path, node) for path, node in walk(root) if "default" in node]
    assert len(defaults) > 30
    for path, node in defaults:
        value = apply_defaults(node, node["default"])
        assert schema_problems(node, value, path) == [], path
        # What the API server does when the CRD is created: every CEL rule on the raw default, nested defaults not
        # applied (a rule reading a field that only a nested default provides fails, and the CRD is refused).
        assert cel_problems(node, to_cel(node, node["default"]), path) == [], path


def test_crd_defaults_equal_the_models_defaults(root: dict[str, Any]) -> None:
    """An empty spec defaulted by the API server is exactly what pydantic fills in: one source of truth."""
    spec = root["properties"]["spec"]
    assert "spec" in root["required"] and "default" not in spec  # see crd_manifest: a default {} is refused
    defaulted = apply_defaults(spec, {})
    assert without_empty(defaulted) == server_defaults(Spec())
    assert Spec.model_validate(defaulted) == Spec(), "the shape fields the server leaves out resolve to Spec's"
    assert apply_defaults(spec, {"parallelism": {"data": 2}})["parallelism"] == {
        **Spec().dump()["parallelism"], "data": 2}


def test_bounds_carried_over(root: dict[str, Any]) -> None:
    spec = root["properties"]["spec"]["properties"]
    assert (spec["nodes"]["minimum"], spec["nodes"]["maximum"]) == (1, 4096)
    assert spec["precision"]["enum"] == ["fp32", "bf16", "fp16"]
    assert spec["parallelism"]["properties"]["zeroStage"]["enum"] == [0, 1, 2, 3]
    frac = spec["data"]["properties"]["valFraction"]
    assert (frac["minimum"], frac["exclusiveMinimum"], frac["maximum"], frac["exclusiveMaximum"]) == (0, True, 1, True)
    assert spec["pod"]["properties"]["env"]["maxItems"] == 256
    assert spec["image"]["pattern"] and spec["image"]["maxLength"] == 512


def test_cel_cost_inputs_are_bounded(root: dict[str, Any]) -> None:
    """Kubernetes' CEL cost estimator prices every list, map and string by its declared maximum size."""
    for path, node in walk(root["properties"]["spec"], "spec"):
        if node.get("x-kubernetes-preserve-unknown-fields"):
            continue  # affinity: opaque to CEL
        if node["type"] == "string":
            assert "maxLength" in node or "enum" in node, f"{path}: string without maxLength"
        if node["type"] == "array":
            assert "maxItems" in node, f"{path}: list without maxItems"
        if node["type"] == "object" and "additionalProperties" in node:
            assert "maxProperties" in node, f"{path}: map without maxProperties"


def all_rules(root: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for path, node in walk(root):
        for rule in node.get("x-kubernetes-validations", []):
            yield path, node, rule


def test_every_cel_rule_and_message_compiles(root: dict[str, Any]) -> None:
    rules = list(all_rules(root))
    assert len(rules) >= 25
    for path, _, rule in rules:
        program(rule["rule"])
        if "messageExpression" in rule:
            program(rule["messageExpression"])
        assert ("message" in rule) != ("messageExpression" in rule), path
        assert "\n" not in rule.get("message", ""), path


def test_every_field_path_names_a_declared_field(root: dict[str, Any]) -> None:
    for path, node, rule in all_rules(root):
        target = node
        for part in filter(None, rule.get("fieldPath", "").split(".")):
            assert part in target.get("properties", {}), f"{path}: fieldPath {rule['fieldPath']}"
            target = target["properties"][part]


@pytest.mark.parametrize("field", crd_module.IMMUTABLE)
def test_layout_fields_are_immutable(root: dict[str, Any], field: str) -> None:
    node = root["properties"]["spec"]["properties"][field]
    (rule,) = [r for r in node["x-kubernetes-validations"] if "oldSelf" in r["rule"]]
    value = apply_defaults(node, {} if node["type"] == "object" else 2)
    changed = apply_defaults(node, {"data": 2} if field == "parallelism" else {"layers": 8}) \
        if node["type"] == "object" else 3
    assert evaluate(rule["rule"], to_cel(node, value), to_cel(node, value))
    assert not evaluate(rule["rule"], to_cel(node, changed), to_cel(node, value))


def test_printer_columns(crd: dict[str, Any], root: dict[str, Any]) -> None:
    (version,) = crd["spec"]["versions"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"] if not c.get("priority")}
    assert list(columns) == ["Phase", "Layout", "Step", "Loss", "Restarts", "ETA", "Age"]
    for column in version["additionalPrinterColumns"]:
        node = root
        for part in column["jsonPath"].strip(".").split("."):
            node = node["properties"][part] if part != "creationTimestamp" else {"type": "string"}
        kinds = {"string": "string", "number": "number", "integer": "integer", "date": "string"}
        assert node["type"] == kinds[column["type"]], column


def test_status_schema_takes_what_the_operator_writes(root: dict[str, Any]) -> None:
    status = {
        "phase": "Running", "reason": "GangRunning", "message": "2/2 pods running", "layout": "dp2·tp1·pp1 z0 fp32",
        "progressText": "120/2000", "observedGeneration": 3, "attempt": 1, "restarts": 1, "gangCreated": True,
        "conditions": [{"type": "Stalled", "status": "False", "reason": "Progressing", "message": "ok",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        "pods": {"expected": 2, "pending": 0, "running": 2, "succeeded": 0, "failed": 0, "terminating": 0},
        "startTime": "2026-01-01T00:00:00Z",
        "failure": {"pod": "job-0-1", "exitCode": 75, "reason": "Error", "message": "peer vanished"},
        "progress": {"step": 120, "totalSteps": 2000, "loss": 2.5, "valLoss": 2.6, "tokensPerSecond": 100000,
                     "etaSeconds": 30, "updatedAt": "2026-01-01T00:01:00Z", "phase": "training"},
    }
    assert JobStatus.model_validate(status).dump() == status
    assert schema_problems(root["properties"]["status"], status, "status") == []
    assert schema_problems(root["properties"]["status"], {**status, "phase": "Exploded"}, "status")
    assert schema_problems(root["properties"]["status"], {**status, "progres": {}}, "status")


def test_reserved_mount_paths_match_the_contract() -> None:
    assert contract.SPEC_MOUNT_DIR in RESERVED_MOUNT_PATHS and "/dev/shm" in RESERVED_MOUNT_PATHS
