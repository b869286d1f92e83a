"""docs/reference.md (generated: scripts/gen_manifests.py; tests/delivery fails when it drifts) documents every
field of the spec: a row each, and a description for every field that is not just a group of others."""

from __future__ import annotations

from paratrain.api.crd import crd_manifest
from paratrain.api.reference import reference_markdown


def leaf_fields(node, path="spec"):
    for name, child in (node.get("properties") or {}).items():
        child_path = f"{path}.{name}"
        nested = child.get("properties") or (child.get("items") or {}).get("properties")
        if not nested:
            yield child_path
        yield from leaf_fields(child, child_path)
        if (child.get("items") or {}).get("properties"):
            yield from leaf_fields(child["items"], f"{child_path}[]")


def test_every_field_has_a_described_row():
    spec = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[5].strip()
            for line in reference_markdown().splitlines() if line.startswith("| `spec.")}
    fields = list(leaf_fields(spec))
    assert len(fields) > 70 and set(fields) <= set(rows)
    undocumented = [f for f in fields if not rows[f]]
    assert undocumented == [], undocumented
    for named in ("spec.training.minLearningRate", "spec.training.weightDecay", "spec.training.beta1",
                  "spec.training.beta2", "spec.training.gradClip", "spec.training.evalInterval",
                  "spec.training.evalSteps", "spec.checkpoint.interval", "spec.checkpoint.keep",
                  "spec.scheduling.queue", "spec.scheduling.priorityClassName", "spec.scheduling.affinity",
                  "spec.pod.imagePullSecrets", "spec.pod.env", "spec.pod.volumes[].persistentVolumeClaim"):
        assert rows[named], named


def test_the_rules_between_fields_are_listed_with_their_messages():
    text = reference_markdown()
    assert "- `spec.parallelism`: data(…) x tensor(…) x pipeline(…) = … must equal nodes(…) x procsPerNode(…)" in text
    assert "- `spec.training.warmupSteps`: warmupSteps(…) must be <= steps(…)" in text


def test_every_spec_field_is_described_with_its_default_and_limits_for_kubectl_explain():
    """The CRD's descriptions are what `kubectl explain` prints; it shows no default or limit of its own."""
    from paratrain.api.crd import explain_suffix, spec_schema

    def fields(node, path):
        for name, child in (node.get("properties") or {}).items():
            yield f"{path}.{name}", child
            yield from fields(child, f"{path}.{name}")
            yield from fields(child.get("items") or {}, f"{path}.{name}[]")

    checked = 0
    for path, node in fields(spec_schema(), "spec"):
        assert node.get("description"), f"{path} has no description"
        assert node["description"].endswith(explain_suffix(node)), path
        checked += bool(explain_suffix(node))
    nodes = dict(fields(spec_schema(), "spec"))
    assert nodes["spec.nodes"]["description"] == "Pods in the gang. Default: 1. Limits: ≥ 1, ≤ 4096."
    assert checked > 100
