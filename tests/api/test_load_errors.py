"""Bad jobs are refused by parse_job with every problem named by its field path, in words a user can act on."""

from __future__ import annotations

from typing import Any

import pytest

from paratrain.api import SpecError, parse_job

BASE = {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "t"}}


def problems(doc: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        parse_job(doc)
    return [(p.path, p.message) for p in info.value.problems]


# (document changes, field path, words the message must contain)
CASES = [
    ({"spec": {"nodez": 2}}, "spec.nodez", "unknown field (did you mean 'nodes'?)"),
    ({"spec": {"parallelism": {"tensr": 2}}}, "spec.parallelism.tensr", "unknown field (did you mean 'tensor'?)"),
    ({"spec": {"training": {"learningRat": 1e-3}}}, "spec.training.learningRat",
     "unknown field (did you mean 'learningRate'?)"),
    ({"spec": {"pod": {"volumes": [{"name": "v", "mountPath": "/v", "persistentVolumeClam": "c"}]}}},
     "spec.pod.volumes[0].persistentVolumeClam", "did you mean 'persistentVolumeClaim'?"),
    ({"spec": {"training": {"zzzz": 1}}}, "spec.training.zzzz", "unknown field (misspelt?)"),
    ({"spec": {"nodes": 0}}, "spec.nodes", "greater than or equal to 1"),
    ({"spec": {"nodes": "two"}}, "spec.nodes", "integer"),
    ({"spec": {"restartPolicy": {"hangSeconds": 5}}}, "spec.restartPolicy.hangSeconds",
     "greater than or equal to 10"),
    ({"spec": {"precision": "fp8"}}, "spec.precision", "'fp32', 'bf16' or 'fp16'"),
    ({"spec": {"parallelism": {"zeroStage": 4}}}, "spec.parallelism.zeroStage", "0, 1, 2 or 3"),
    ({"spec": {"model": {"dropout": 1.0}}}, "spec.model.dropout", "less than 1"),
    ({"spec": {"image": "evil\nkind: Secret"}}, "spec.image", "container image reference"),
    ({"spec": {"resources": {"memory": "lots"}}}, "spec.resources.memory", "Kubernetes quantity"),
    ({"spec": {"pod": {"volumes": [{"name": "v", "mountPath": "rel", "emptyDir": True}]}}},
     "spec.pod.volumes[0].mountPath", "absolute path"),
    ({"metadata": {"name": "Has_Caps"}}, "metadata.name", "DNS label"),
    ({"metadata": {"name": "x" * 51}}, "metadata.name", "at most 50 characters"),
    # kubectl's strict field validation refuses a key ObjectMeta does not have: so does `paratrain validate`
    ({"metadata": {"name": "t", "lables": {"a": "b"}}}, "metadata.lables", "did you mean 'labels'?"),
    ({"metadata": {"name": "t", "labels": {"a": 5}}}, "metadata.labels.a", "string"),
    ({"spec": {"pod": {"env": [{"name": "1BAD"}]}}}, "spec.pod.env[0].name", "environment variable name"),
    ({"spec": {"pod": {"env": [{"name": "RANK", "value": "3"}]}}}, "spec.pod.env[0].name", "RANK is reserved"),
    ({"spec": {"pod": {"labels": {"bad key!": "x"}}}}, "spec.pod.labels['bad key!']", "invalid key: must be a label key"),
    ({"spec": {"pod": {"labels": {"ok": "bad value!"}}}}, "spec.pod.labels.ok", "label value"),
    ({"spec": {"scheduling": {"nodeSelector": {"-x": "y"}}}}, "spec.scheduling.nodeSelector['-x']", "label key"),
    ({"spec": {"pod": {"volumes": [{"name": "v", "mountPath": "/v"}]}}}, "spec.pod.volumes[0]",
     "exactly one of persistentVolumeClaim, configMap, secret, emptyDir"),
    ({"spec": {"pod": {"volumes": [{"name": "v", "mountPath": "/v", "secret": "Not_DNS"}]}}},
     "spec.pod.volumes[0].secret", "DNS subdomain"),
    ({"spec": {"scheduling": {"tolerations": [{"value": "x"}]}}}, "spec.scheduling.tolerations[0]",
     "operator must be Exists when key is empty"),
    ({"spec": {"scheduling": {"priorityClassName": "UPPER"}}}, "spec.scheduling.priorityClassName", "DNS subdomain"),
    ({"spec": {"pod": {"annotations": {f"k{i}": "v" for i in range(65)}}}}, "spec.pod.annotations",
     "at most 64 items"),
    ({"spec": {"nodes": 2}}, "spec.parallelism", "data(1) x tensor(1) x pipeline(1) = 1 must equal nodes(2) x "
                                                 "procsPerNode(1) = 2"),
    ({"spec": {"scheduling": {"queue": "q"}}}, "spec.scheduling.queue", "needs scheduling.gang 'volcano'"),
]


@pytest.mark.parametrize("change,path,words", CASES, ids=[c[1] + ":" + c[2][:20] for c in CASES])
def test_bad_job_is_refused_naming_the_field(change: dict[str, Any], path: str, words: str) -> None:
    doc = {**BASE, **{k: ({**BASE.get(k, {}), **v} if isinstance(v, dict) else v) for k, v in change.items()}}
    found = problems(doc)
    assert any(p == path and words in m for p, m in found), found


def test_every_problem_is_reported_not_just_the_first() -> None:
    found = problems({**BASE, "spec": {"nodes": 0, "precision": "fp8", "pod": {"env": [{"name": "1X"}]}}})
    assert [p for p, _ in found] == ["spec.nodes", "spec.precision", "spec.pod.env[0].name"]


def test_long_bad_values_are_shortened_in_messages() -> None:
    volume = {"name": "v", "mountPath": "x" * 4000, "emptyDir": True}
    ((path, message),) = problems({**BASE, "spec": {"pod": {"volumes": [volume]}}})
    assert path == "spec.pod.volumes[0].mountPath" and len(message) < 200 and message.endswith("...")


def test_not_a_mapping() -> None:
    with pytest.raises(SpecError, match="expected a mapping"):
        parse_job(["not", "a", "job"])


@pytest.mark.parametrize("spec, fix", [
    ({"nodes": 2, "parallelism": {"data": 2, "tensor": 2}},
     "set parallelism.data: 1 (for this gang), or nodes: 4 (for this layout)"),
    ({"nodes": 3, "procsPerNode": 2, "parallelism": {"data": 2, "tensor": 2}},
     "set parallelism.data: 3 (for this gang), or nodes: 2 (for this layout)"),
    ({"nodes": 2, "procsPerNode": 3, "parallelism": {"data": 1, "tensor": 4}}, "set procsPerNode: 2 (for this layout)"),
])
def test_a_layout_that_does_not_fit_the_gang_names_values_that_would(spec: dict[str, Any], fix: str) -> None:
    """Issue 46: the layout error said what was wrong and no value that would work."""
    with pytest.raises(SpecError) as refused:
        parse_job({**BASE, "spec": {**BASE.get("spec", {}), **spec}})
    (problem,) = refused.value.problems
    assert problem.path == "spec.parallelism" and fix in problem.fix and fix in str(refused.value)


def test_a_job_read_back_from_the_cluster_keeps_its_metadata() -> None:
    meta = {"name": "t", "namespace": "ns", "uid": "1d2c", "resourceVersion": "42", "generation": 3,
            "creationTimestamp": "2026-12-06T00:00:00Z", "labels": {"a": "b"}, "annotations": {"c": "d"},
            "finalizers": ["paratrain.dev/x"], "ownerReferences": [{"apiVersion": "v1", "kind": "X", "name": "o",
                                                                   "uid": "9"}],
            "managedFields": [{"manager": "kubectl", "operation": "Apply", "fieldsV1": {"f:spec": {}}}]}
    job = parse_job({**BASE, "metadata": meta, "spec": {}})
    assert job.metadata.uid == "1d2c" and job.metadata.labels == {"a": "b"}
    assert job.dump()["metadata"] == meta
