"""Checks for what the cluster would enforce: the restricted Pod Security Standard and least-privilege RBAC.

`restricted_violations` (one checker, shared with the render tests) follows the Pod Security Standards' baseline
and restricted controls; it returns every violation as text, so a failing test names them all.
"""

from __future__ import annotations

from typing import Any, Iterator

from ..operator.pss import restricted_violations

__all__ = ["granted", "only", "pod_specs", "rbac_wildcards", "restricted_violations"]


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one object of `kind`; fails when there are none or several."""
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}: {[o['kind'] for o in objects]}"
    return found[0]


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, pod spec) of every Pod and of every workload's pod template."""
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] == "Pod":
            yield name, obj["spec"]
        elif obj["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}:
            yield name, obj["spec"]["template"]["spec"]


def rbac_wildcards(rules: list[dict[str, Any]]) -> list[str]:
    """Every `*` in apiGroups, resources, verbs or resourceNames, and any nonResourceURLs."""
    out = []
    for i, rule in enumerate(rules):
        for field in ("apiGroups", "resources", "verbs", "resourceNames"):
            if any("*" in item for item in rule.get(field, [])):
                out.append(f"rules[{i}].{field}: {rule[field]}")
        if rule.get("nonResourceURLs"):
            out.append(f"rules[{i}].nonResourceURLs: {rule['nonResourceURLs']}")
    return out


def granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """The (apiGroup, resource, verb) triples the rules grant."""
    return {(g, r, v) for rule in rules for g in rule.get("apiGroups", []) for r in rule.get("resources", [])
            for v in rule.get("verbs", [])}
