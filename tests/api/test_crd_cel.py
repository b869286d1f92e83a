"""The CRD's CEL rules and `parse_job` reject the same specs, under the same field paths, with the same words.

A new check in `cross_field_problems` needs a row in CROSS_FIELD_CASES (test_every_cross_field_check_has_a_case
counts them) and a CEL twin in paratrain.api.crd (the row fails without one). The random-spec test catches a
twin that drifts: a rule that rejects a little more or less than its Python original.
"""

from __future__ import annotations

import glob
import inspect
import random
from pathlib import Path
from typing import Any

import pytest

from paratrain.api import SpecError, parse_job, read_yaml
from paratrain.api.crd import crd_manifest
from paratrain.api.shapes import PRESETS
from paratrain.api.spec import Spec, cross_field_problems, elastic_problems

from .crdsim import admit, schema_of_version

ROOT = Path(__file__).resolve().parents[2]
CRD = crd_manifest()


def job(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "t"},
            "spec": spec}


def python_problems(doc: dict[str, Any]) -> list[tuple[str, str]]:
    try:
        parse_job(doc)
    except SpecError as exc:
        return [(p.path, p.message) for p in exc.problems]
    return []


def vol(name: str, path: str, **source: Any) -> dict[str, Any]:
    return {"name": name, "mountPath": path, **(source or {"emptyDir": True})}


def claim(name: str, gpus: bool = False) -> dict[str, Any]:
    return {"name": name, "resourceClaimTemplateName": "gpus", "providesGpus": gpus}


def rule(action: str, **matchers: Any) -> dict[str, Any]:
    return {"action": action, **matchers}


def init(name: str) -> dict[str, Any]:
    return {"name": name, "image": "busybox:1.37"}


SECRET_KEY = {"secretKeyRef": {"name": "wandb", "key": "api-key"}}
OWN = {"command": ["torchrun", "train.py"], "args": ["--steps", "100"], "workingDir": "/workspace"}


# One row per `out.append` in cross_field_problems and elastic_problems, in order: (id, spec, the paths both must report).
CROSS_FIELD_CASES = [
    ("world-size", {"nodes": 2}, {"spec.parallelism"}),
    ("embed-by-heads", {"model": {"embedDim": 130, "heads": 4}}, {"spec.model.embedDim"}),
    ("heads-by-tensor", {"nodes": 2, "parallelism": {"tensor": 2}, "model": {"heads": 3, "embedDim": 12}},
     {"spec.model.heads"}),
    ("heads-by-kv-heads", {"model": {"family": "llama", "heads": 4, "kvHeads": 3, "embedDim": 32}},
     {"spec.model.kvHeads"}),
    ("kv-heads-by-tensor", {"nodes": 4, "parallelism": {"tensor": 4},
                            "model": {"family": "llama", "heads": 8, "kvHeads": 2, "embedDim": 64}},
     {"spec.model.kvHeads"}),
    ("ffn-by-tensor", {"nodes": 8, "parallelism": {"tensor": 8}, "model": {"heads": 3, "embedDim": 9}},
     {"spec.model.heads", "spec.model.ffnDim"}),
    ("rope-even-head-dim", {"model": {"family": "llama", "heads": 4, "embedDim": 36}}, {"spec.model.embedDim"}),
    ("gpt-no-gqa", {"model": {"heads": 4, "kvHeads": 2}}, {"spec.model.kvHeads"}),
    ("llama-no-bias", {"model": {"family": "llama", "bias": True}}, {"spec.model.bias"}),
    ("gpt-no-rope", {"model": {"ropeTheta": 10000}}, {"spec.model.ropeTheta"}),
    ("layers-per-stage", {"nodes": 4, "parallelism": {"pipeline": 4, "microbatches": 4}, "model": {"layers": 2}},
     {"spec.model.layers"}),
    ("batch-by-data", {"nodes": 3, "parallelism": {"data": 3}}, {"spec.training.batchSize"}),
    ("rank-batch-by-accumulation", {"nodes": 2, "parallelism": {"data": 2}, "training": {"gradientAccumulation": 3}},
     {"spec.training.gradientAccumulation"}),
    ("rank-batch-by-microbatches", {"nodes": 2, "parallelism": {"pipeline": 2, "microbatches": 3}},
     {"spec.parallelism.microbatches"}),
    ("compile-not-deepspeed-zero3", {"nodes": 2, "parallelism": {"data": 2, "zeroStage": 3},
                                     "training": {"compile": True}}, {"spec.training.compile"}),
    ("microbatches-need-pipeline", {"parallelism": {"microbatches": 2}}, {"spec.parallelism.microbatches"}),
    ("1f1b-microbatches", {"nodes": 4, "parallelism": {"pipeline": 4, "microbatches": 2}},
     {"spec.parallelism.microbatches"}),
    ("zero-needs-data", {"parallelism": {"zeroStage": 1}}, {"spec.parallelism.zeroStage"}),
    ("min-lr", {"training": {"learningRate": 0.001, "minLearningRate": 0.01}}, {"spec.training.minLearningRate"}),
    ("warmup", {"training": {"steps": 5, "warmupSteps": 10}}, {"spec.training.warmupSteps"}),
    ("source-needs-path", {"data": {"source": "tokens"}}, {"spec.data.path"}),  # and text: the random specs
    ("planner-field-under-manual", {"parallelism": {"objective": "minGPUs"}}, {"spec.parallelism.objective"}),
    ("auto-with-entrypoint", {"entrypoint": OWN, "parallelism": {"mode": "auto"}}, {"spec.parallelism.mode"}),
    ("reduce-precision", {"precision": "bf16", "reducePrecision": "fp16"}, {"spec.reducePrecision"}),
    ("gpus-per-proc", {"resources": {"gpusPerNode": 2}}, {"spec.resources.gpusPerNode"}),
    ("queue-needs-volcano", {"scheduling": {"queue": "q"}}, {"spec.scheduling.queue"}),
    ("topology-holds-whole-pods", {"nodes": 2, "procsPerNode": 2, "parallelism": {"data": 4},
                                   "scheduling": {"topology": {"level": "x.io/rack", "ranksPerDomain": 1}}},
     {"spec.scheduling.topology.ranksPerDomain"}),
    ("topology-divides-the-gang", {"nodes": 3, "parallelism": {"data": 3}, "training": {"batchSize": 12},
                                   "scheduling": {"topology": {"level": "x.io/rack", "ranksPerDomain": 2}}},
     {"spec.scheduling.topology.ranksPerDomain"}),
    ("topology-holds-whole-replicas", {"nodes": 4, "parallelism": {"data": 2, "tensor": 2},
                                       "scheduling": {"topology": {"level": "x.io/rack", "ranksPerDomain": 1}}},
     {"spec.scheduling.topology.ranksPerDomain"}),
    ("elastic-min-above-nodes", {"checkpoint": {"path": "/c"}, "elastic": {"minNodes": 2}}, {"spec.elastic.minNodes"}),
    ("elastic-max-below-nodes", {"nodes": 2, "parallelism": {"data": 2}, "checkpoint": {"path": "/c"},
                                 "elastic": {"minNodes": 1, "maxNodes": 1}}, {"spec.elastic.maxNodes"}),
    ("elastic-without-checkpoint", {"elastic": {"minNodes": 1}}, {"spec.elastic"}),
    ("elastic-with-entrypoint", {"entrypoint": OWN, "elastic": {"minNodes": 1}}, {"spec.elastic"}),
    ("elastic-with-min-gpus", {"parallelism": {"mode": "auto", "objective": "minGPUs"}, "checkpoint": {"path": "/c"},
                               "elastic": {"minNodes": 1}}, {"spec.elastic"}),
    ("volume-name-twice", {"pod": {"volumes": [vol("a", "/a"), vol("a", "/b")]}}, {"spec.pod.volumes"}),
    ("mount-path-twice", {"pod": {"volumes": [vol("a", "/a"), vol("b", "/a")]}}, {"spec.pod.volumes"}),
    ("reserved-mount", {"pod": {"volumes": [vol("a", "/dev/shm")]}}, {"spec.pod.volumes"}),
    ("reserved-volume-name", {"pod": {"volumes": [vol("paratrain-x", "/x")]}}, {"spec.pod.volumes[0].name"}),
    ("reserved-label", {"pod": {"labels": {"paratrain.dev/job-name": "other"}}}, {"spec.pod.labels"}),
    # Kueue's keys belong on the job, or each pod would be admitted on its own.
    ("kueue-label-on-pods", {"pod": {"labels": {"kueue.x-k8s.io/queue-name": "team-a"}}}, {"spec.pod.labels"}),
    ("reserved-env", {"pod": {"env": [{"name": "A"}, {"name": "MASTER_ADDR", "value": "evil"}]}},
     {"spec.pod.env[1].name"}),
    ("env-twice", {"pod": {"env": [{"name": "A"}, {"name": "A", "value": "2"}]}}, {"spec.pod.env"}),
    ("entrypoint-with-training", {"entrypoint": OWN, "training": {"steps": 5, "warmupSteps": 0}},
     {"spec.training"}),
    ("entrypoint-with-gpu-memory", {"entrypoint": OWN, "resources": {"gpuMemory": "80Gi"}},
     {"spec.resources.gpuMemory"}),
    ("entrypoint-with-in-place-restarts", {"entrypoint": OWN, "restartPolicy": {"inPlaceLimit": 2}},
     {"spec.restartPolicy.inPlaceLimit"}),
    ("gpu-resource-in-extra", {"resources": {"extra": {"nvidia.com/gpu": 2}}}, {"spec.resources.extra"}),
    ("kubernetes-owned-gpu-resource", {"resources": {"gpuResource": "kubernetes.io/gpu"}},
     {"spec.resources.gpuResource"}),
    ("kubernetes-owned-extra", {"resources": {"extra": {"rdma/ib": 1, "node.kubernetes.io/x": 1}}},
     {"spec.resources.extra"}),
    ("two-claims-provide-gpus", {"procsPerNode": 2, "parallelism": {"data": 2}, "resources": {
        "gpusPerNode": 2, "claims": [claim("a", True), claim("b", True)]}}, {"spec.resources.claims"}),
    ("gpu-claim-without-gpus", {"resources": {"claims": [claim("a", True)]}}, {"spec.resources.gpusPerNode"}),
    ("claim-twice", {"resources": {"claims": [claim("a"), claim("a")]}}, {"spec.resources.claims"}),
    ("spread-min-domains-soft", {"pod": {"topologySpreadConstraints": [{
        "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway", "minDomains": 2}]}},
     {"spec.pod.topologySpreadConstraints[0].minDomains"}),
    ("init-container-twice", {"pod": {"initContainers": [init("a"), init("a")]}}, {"spec.pod.initContainers"}),
    ("init-container-named-trainer", {"pod": {"initContainers": [init("trainer")]}},
     {"spec.pod.initContainers[0].name"}),
    ("failure-rules-clash", {"failurePolicy": {"rules": [rule("FailJob", exitCodes=[3, 4]),
                                                         rule("RestartGang", exitCodes=[5, 4])]}},
     {"spec.failurePolicy.rules"}),
]
# The model validators the CRD mirrors, and more shapes of the checks above.
MORE_CASES = [
    ("topology-key-and-topology", {"scheduling": {"topologyKey": "x.io/rack", "topology": {"level": "x.io/rack"}}},
     {"spec.scheduling"}),
    ("volume-no-source", {"pod": {"volumes": [{"name": "a", "mountPath": "/a"}]}}, {"spec.pod.volumes[0]"}),
    ("volume-two-sources", {"pod": {"volumes": [vol("a", "/a", secret="s", configMap="c")]}},
     {"spec.pod.volumes[0]"}),
    ("toleration-empty-key", {"scheduling": {"tolerations": [{"effect": "NoSchedule"}]}},
     {"spec.scheduling.tolerations[0]"}),
    ("toleration-exists-value", {"scheduling": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
     {"spec.scheduling.tolerations[0]"}),
    ("toleration-seconds", {"scheduling": {"tolerations": [{"key": "k", "tolerationSeconds": 5}]}},
     {"spec.scheduling.tolerations[0]"}),
    ("text-explicit-null-path", {"data": {"source": "text", "path": None}}, {"spec.data.path"}),
    ("reserved-annotation", {"pod": {"annotations": {"paratrain.dev/attempt": "9"}}}, {"spec.pod.annotations"}),
    ("kueue-annotation-on-pods", {"pod": {"annotations": {"kueue.x-k8s.io/pod-group-total-count": "1"}}},
     {"spec.pod.annotations"}),
    ("reserved-env-prefix", {"pod": {"env": [{"name": "PET_NNODES", "value": "9"}]}}, {"spec.pod.env[0].name"}),
    ("reserved-torchrun-name", {"pod": {"env": [{"name": "GROUP_WORLD_SIZE", "value": "9"}]}},
     {"spec.pod.env[0].name"}),
    ("env-value-and-value-from", {"pod": {"env": [{"name": "A", "value": "x", "valueFrom": SECRET_KEY}]}},
     {"spec.pod.env[0]"}),
    ("env-two-sources", {"pod": {"env": [{"name": "A", "valueFrom": {**SECRET_KEY, "fieldRef": {
        "fieldPath": "spec.nodeName"}}}]}}, {"spec.pod.env[0].valueFrom"}),
    ("env-no-source", {"pod": {"env": [{"name": "A", "valueFrom": {}}]}}, {"spec.pod.env[0].valueFrom"}),
    ("entrypoint-with-model", {"entrypoint": OWN, "model": {"layers": 2}}, {"spec.model"}),
    ("entrypoint-with-model-dropout", {"entrypoint": OWN, "model": {"dropout": 0.1}}, {"spec.model"}),
    ("entrypoint-with-data", {"entrypoint": OWN, "data": {"source": "text", "path": "/d.txt"}}, {"spec.data"}),
    ("entrypoint-with-checkpoint", {"entrypoint": OWN, "checkpoint": {"path": "/ckpt"}}, {"spec.checkpoint"}),
    ("entrypoint-with-async-save", {"entrypoint": OWN, "checkpoint": {"asyncSave": True}}, {"spec.checkpoint"}),
    ("entrypoint-with-logging", {"entrypoint": OWN, "logging": {"tensorboard": "/tb"}}, {"spec.logging"}),
    ("init-env-two-sources", {"pod": {"initContainers": [{**init("a"), "env": [{"name": "A", "value": "x",
                                                                                "valueFrom": SECRET_KEY}]}]}},
     {"spec.pod.initContainers[0].env[0]"}),
    ("reserved-spec-mount", {"pod": {"volumes": [vol("a", "/etc/paratrain")]}}, {"spec.pod.volumes"}),
    ("several-at-once", {"nodes": 2, "parallelism": {"zeroStage": 1}, "training": {"steps": 5}},
     {"spec.parallelism", "spec.parallelism.zeroStage", "spec.training.warmupSteps"}),
    ("micro-step-batch-by-microbatches", {"nodes": 2, "parallelism": {"pipeline": 2, "microbatches": 4},
                                          "training": {"gradientAccumulation": 4}}, {"spec.parallelism.microbatches"}),
    ("preset-by-tensor", {"nodes": 3, "parallelism": {"tensor": 3}, "model": {"preset": "llama3-1b"}},
     {"spec.model.heads", "spec.model.kvHeads", "spec.model.ffnDim"}),
    ("preset-overridden", {"model": {"preset": "llama3-8b", "kvHeads": 5}}, {"spec.model.kvHeads"}),
    ("llama-preset-as-gpt", {"model": {"preset": "debug", "family": "gpt"}}, {"spec.model.kvHeads"}),
    ("llama-ffn-default-by-tensor", {"nodes": 3, "parallelism": {"tensor": 3},
                                     "model": {"family": "llama", "heads": 3, "embedDim": 48}},
     {"spec.model.ffnDim"}),
    ("failure-rule-matches-nothing", {"failurePolicy": {"rules": [rule("FailJob")]}},
     {"spec.failurePolicy.rules[0]"}),
    ("failure-rule-matches-both", {"failurePolicy": {"rules": [
        rule("Ignore", podConditions=["Evicted"]), rule("FailJob", exitCodes=[3], podConditions=["OOMKilled"])]}},
     {"spec.failurePolicy.rules[1]"}),
    ("in-place-by-condition", {"failurePolicy": {"rules": [rule("RestartInPlace", podConditions=["OOMKilled"])]}},
     {"spec.failurePolicy.rules[0]"}),
    ("failure-conditions-clash", {"failurePolicy": {"rules": [
        rule("RestartGang", exitCodes=[1]), rule("Ignore", podConditions=["Evicted", "DisruptionTarget"]),
        rule("RestartGang", podConditions=["OOMKilled", "DisruptionTarget"])]}}, {"spec.failurePolicy.rules"}),
    ("failure-rules-clash-with-a-copy", {"failurePolicy": {"rules": [
        rule("FailJob", exitCodes=[3]), rule("Ignore", exitCodes=[9]), rule("FailJob", exitCodes=[3]),
        rule("RestartGang", exitCodes=[9, 3])]}}, {"spec.failurePolicy.rules"}),
    ("pin-under-manual", {"parallelism": {"pin": ["tensor"]}}, {"spec.parallelism.pin"}),
    ("allow-under-manual", {"parallelism": {"allow": []}}, {"spec.parallelism.allow"}),
    ("headroom-under-manual", {"parallelism": {"memoryHeadroom": 0}}, {"spec.parallelism.memoryHeadroom"}),
    ("annotations-too-big", {"pod": {"annotations": {f"k{i}": "x" * 60_000 for i in range(5)}}},
     {"spec.pod.annotations"}),
]
# Map keys: the CRD's rule sits on the map, parse_job names the key itself (`spec.pod.labels['a b']`).
KEY_CASES = [
    ("label-key", {"pod": {"labels": {"a b": "x"}}}, "spec.pod.labels"),
    ("annotation-key", {"pod": {"annotations": {"x\nkind: Secret": "x"}}}, "spec.pod.annotations"),
    ("node-selector-key", {"scheduling": {"nodeSelector": {"-pool": "gpu"}}}, "spec.scheduling.nodeSelector"),
    ("long-key", {"pod": {"labels": {"a" * 64: "x"}}}, "spec.pod.labels"),
    ("extended-resource", {"resources": {"extra": {"ib": 1}}}, "spec.resources.extra"),
]


def test_every_cross_field_check_has_a_case() -> None:
    checks = sum(inspect.getsource(f).count("out.append(") for f in (cross_field_problems, elastic_problems))
    assert len(CROSS_FIELD_CASES) == checks, "a check was added to cross_field_problems: add its row (and CEL twin)"


@pytest.mark.parametrize("name,spec,paths", CROSS_FIELD_CASES + MORE_CASES, ids=[c[0] for c in
                                                                                  CROSS_FIELD_CASES + MORE_CASES])
def test_python_and_cel_reject_the_same_bad_spec(name: str, spec: dict[str, Any], paths: set[str]) -> None:
    python = python_problems(job(spec))
    crd = admit(CRD, job(spec))
    assert {p for p, _ in python} == paths
    assert {p for p, _ in crd} == paths
    for path, message in crd:
        if message != "Duplicate value":  # list-map keys: the API server's own wording
            assert message in [m for p, m in python if p == path], (path, message, python)


@pytest.mark.parametrize("name,spec,path", KEY_CASES, ids=[c[0] for c in KEY_CASES])
def test_python_and_cel_reject_the_same_bad_key(name: str, spec: dict[str, Any], path: str) -> None:
    python = python_problems(job(spec))
    assert [p for p, _ in admit(CRD, job(spec))] == [path]
    assert python and all(p.startswith(path + "[") for p, _ in python), python


def test_every_cel_rule_rejects_some_case() -> None:
    """No rule is dead or untested: each fires for at least one of the bad specs above."""
    fired: set[str] = set()
    for _, spec, _ in CROSS_FIELD_CASES + MORE_CASES + KEY_CASES:
        admit(CRD, job(spec), fired=fired)
    spec_schema = schema_of_version(CRD)["properties"]["spec"]
    rules = set()
    stack = [spec_schema]
    while stack:
        node = stack.pop()
        rules |= {r["rule"] for r in node.get("x-kubernetes-validations", []) if "oldSelf" not in r["rule"]}
        stack += list(node.get("properties", {}).values()) + [node[k] for k in ("items", "additionalProperties")
                                                              if isinstance(node.get(k), dict)]
    assert rules - fired == set()


VALID = [
    {},
    {"nodes": 4, "parallelism": {"pipeline": 4, "microbatches": 2, "pipelineSchedule": "GPipe"}},
    {"nodes": 2, "procsPerNode": 2, "parallelism": {"data": 2, "tensor": 2}, "resources": {"gpusPerNode": 2}},
    {"data": {"source": "text", "path": "/d.txt"}, "scheduling": {"gang": "volcano", "queue": "q"}},
    {"scheduling": {"gang": "kai", "queue": "q"}},
    {"training": {"learningRate": 1, "minLearningRate": 1}},  # integers where numbers are expected
    {"model": {"preset": "llama3-8b"}},
    {"nodes": 8, "parallelism": {"tensor": 8}, "model": {"preset": "llama3-8b", "ropeTheta": 10000}},
    {"nodes": 2, "parallelism": {"tensor": 2}, "model": {"family": "llama", "kvHeads": 2, "ffnDim": 100}},
    {"model": {"preset": "gpt2", "layers": 2}},
    # An explicit null is "unset", for enum fields too (their CRD enum must list null: the server checks it).
    {"model": {"preset": None, "family": None, "layers": None},
     "scheduling": {"tolerations": [{"key": "k", "operator": None, "effect": None}]}},
    {"scheduling": {"tolerations": [{"operator": "Exists"}, {"key": "k", "value": "v"},
                                    {"key": "k", "operator": "Exists", "effect": "NoExecute",
                                     "tolerationSeconds": 60}]}},
    {"pod": {"volumes": [vol("data", "/data", persistentVolumeClaim="corpus.v1"), vol("tmp", "/tmp")],
             "env": [{"name": "PYTHONPATH", "value": "/x"}], "labels": {"example.com/team": "a"}}},
    {"entrypoint": OWN, "nodes": 2, "parallelism": {"data": 2}, "precision": "bf16"},
    # Under mode auto the layout fields are the planner's: the manual layout rules do not hold them.
    {"nodes": 2, "parallelism": {"mode": "auto", "objective": "minGPUs", "pin": ["tensor"], "allow": ["data", "zero"],
                                 "memoryHeadroom": 0.2}},
    {"nodes": 3, "parallelism": {"mode": "auto", "zeroStage": 1, "microbatches": 2}, "training": {"batchSize": 7}},
    {"restartPolicy": {"inPlaceLimit": 3},
     "failurePolicy": {"rules": [rule("FailJob", exitCodes=[3, 4]), rule("FailJob", exitCodes=[4]),
                                 rule("Ignore", podConditions=["DisruptionTarget", "Evicted"]),
                                 rule("RestartGang", podConditions=["OOMKilled"]), rule("Ignore", exitCodes=[143]),
                                 rule("RestartInPlace", exitCodes=[1, 137])]}},
    # The built-in trainer's defaults (batchSize 8, heads 4, 1F1B) do not constrain a program's layout.
    {"entrypoint": OWN, "nodes": 24, "parallelism": {"data": 3, "tensor": 4, "pipeline": 2}},
    {"entrypoint": OWN, "model": {"dropout": 0}, "training": {"learningRate": 0.001, "seed": 1337},
     "checkpoint": {"asyncSave": False}},  # the defaults, written out
    # A GPU cluster's: fabric tuning, RDMA devices, a DRA claim for the GPUs, identity, secrets, an init container.
    {"nodes": 2, "procsPerNode": 2, "parallelism": {"data": 4},
     "resources": {"gpusPerNode": 2, "gpuResource": "amd.com/gpu", "extra": {"rdma/ib": 1},
                   "claims": [claim("gpus", True), claim("nic")]},
     "pod": {"env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}, {"name": "TORCH_NCCL_BLOCKING_WAIT", "value": "1"},
                     {"name": "KEY", "valueFrom": SECRET_KEY}, {"name": "NODE", "valueFrom": {"fieldRef": {
                         "fieldPath": "metadata.labels['team']"}}}, {"name": "EMPTY", "value": "", "valueFrom": {
                             "configMapKeyRef": {"name": "c", "key": "k", "optional": True}}}],
             "serviceAccountName": "trainer", "runtimeClassName": "nvidia",
             "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "minDomains": 2}],
             "initContainers": [{**init("fetch"), "command": ["sh", "-c", "true"], "env": [{"name": "A",
                                                                                           "value": "1"}]}]}},
]
JOB_FILES = sorted(glob.glob(str(ROOT / "tests/operator/jobs/*.yaml")) + glob.glob(str(ROOT / "examples/*.yaml")))


@pytest.mark.parametrize("spec", VALID)
def test_valid_specs_are_admitted(spec: dict[str, Any]) -> None:
    assert python_problems(job(spec)) == []
    assert admit(CRD, job(spec)) == []


@pytest.mark.parametrize("path", JOB_FILES, ids=[Path(p).name for p in JOB_FILES])
def test_job_files_are_admitted(path: str) -> None:
    doc = read_yaml(path)
    if doc.get("kind") != "ParallelTrainJob":
        pytest.skip(f"{path} is a {doc.get('kind')}")
    assert python_problems(doc) == []
    assert admit(CRD, doc) == []


def test_layout_is_immutable_but_the_rest_is_not() -> None:
    old = job({"nodes": 2, "parallelism": {"data": 2}})
    assert admit(CRD, job({"nodes": 2, "parallelism": {"data": 2}, "image": "x:2"}), old) == []
    assert [p for p, _ in admit(CRD, job({"nodes": 4, "parallelism": {"data": 4}}), old)] == [
        "spec.nodes", "spec.parallelism"]
    assert [p for p, _ in admit(CRD, job({"nodes": 2, "parallelism": {"data": 2}, "model": {"layers": 8}}), old)] \
        == ["spec.model"]
    assert admit(CRD, job({"nodes": 2, "parallelism": {"data": 2}, "model": {"blockSize": 64}}), old) == [], \
        "writing out a default is not a change"
    # The shape fields have no schema default (a preset fills them in): writing one out is a change.
    assert [p for p, _ in admit(CRD, job({"nodes": 2, "parallelism": {"data": 2}, "model": {"layers": 4}}), old)] \
        == ["spec.model"]


def test_field_errors_are_caught_by_the_schema_too() -> None:
    for spec, path in [({"model": {"dropout": 1.0}}, "spec.model.dropout"), ({"precision": "fp8"}, "spec.precision"),
                       ({"parallelism": {"dta": 2}}, "spec.parallelism.dta"),
                       ({"pod": {"env": [{"name": "1X"}]}}, "spec.pod.env[0].name"),
                       ({"resources": {"memory": "lots"}}, "spec.resources.memory")]:
        assert [p for p, _ in admit(CRD, job(spec))] == [path]
        assert [p.path for p in _spec_error(job(spec)).problems] == [path]


def _spec_error(doc: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_job(doc)
    return info.value


def random_spec(rng: random.Random) -> dict[str, Any]:
    """Field-valid specs, each rule broken now and then, in many combinations."""
    pick = rng.choice

    def mostly(good: Any, *bad: Any) -> Any:
        return good if rng.random() < 0.92 else pick(bad)

    data, tensor, pipeline = pick([1, 2, 3, 4]), pick([1, 2, 4]), pick([1, 2, 4])
    procs = pick([p for p in (1, 2) if (data * tensor * pipeline) % p == 0])
    heads = tensor * pick([1, 2])
    volumes = [vol("a", "/data", persistentVolumeClaim="d"), vol("b", "/dev/shm"), vol("a", "/ckpt"),
               vol("paratrain-x", "/x", secret="s"), vol("c", "/data", configMap="c"), vol("d", "/etc/paratrain")]
    envs = [{"name": "FOO"}, {"name": "FOO", "value": "x"}, {"name": "RANK"}, {"name": "TORCH_X"}, {"name": "BAR"}]
    failure_rules = [rule("FailJob", exitCodes=[3]), rule("RestartGang", exitCodes=[1, 3]), rule("FailJob", exitCodes=[3]),
                     rule("Ignore", podConditions=["DisruptionTarget"]), rule("Ignore", exitCodes=[137]),
                     rule("RestartGang", podConditions=["OOMKilled", "DisruptionTarget"])]
    return {
        "nodes": mostly(data * tensor * pipeline // procs, 1, 3), "procsPerNode": procs,
        "parallelism": {"data": data, "tensor": tensor, "pipeline": pipeline,
                        "zeroStage": mostly(0, 1, 2, 3), "pipelineSchedule": pick(["GPipe", "1F1B"]),
                        "microbatches": mostly(pipeline, 1, 2, 3),
                        **mostly({}, {"mode": "auto"}, {"mode": "auto", "objective": "minGPUs", "pin": ["tensor"]},
                                 {"memoryHeadroom": 0.1}, {"mode": "manual", "allow": ["data"]})},
        "model": {"layers": mostly(4, 1, 2), "heads": mostly(heads, 3, 6), "embedDim": mostly(8 * heads, 9, 12),
                  **pick([{}, {"family": "llama"}, {"family": "gpt"}]),
                  **mostly({}, {"kvHeads": max(1, heads // 2)}, {"kvHeads": 3}, {"ffnDim": 6}, {"ropeTheta": 1e4},
                           {"bias": pick([True, False])},
                           {"preset": pick(sorted(PRESETS))}, {"preset": "debug", "embedDim": 36})},
        "training": {"steps": mostly(100, 5), "warmupSteps": 10, "batchSize": mostly(24 * data * pipeline, 4, 6),
                     "gradientAccumulation": mostly(pick([1, 2]), 5, 8),
                     "learningRate": 0.001, "minLearningRate": mostly(0.0001, 0.01), "compile": mostly(False, True)},
        "data": mostly({}, {"source": "text"}, {"source": "text", "path": "/d.txt"}, {"path": "/d.txt"},
                       {"source": "tokens"}, {"source": "tokens", "path": "/tokens"}),
        "resources": {"gpusPerNode": mostly(0, procs, 2)},
        "scheduling": mostly({}, {"gang": "volcano", "queue": "q"}, {"queue": "q"}, {"gang": "coscheduling"},
                             {"topology": {"level": "x.io/rack", "ranksPerDomain": mostly(procs, 1, 2, 4, 6)}},
                             {"topologyKey": "x.io/rack", "gang": "kubernetes"}),
        "pod": {"volumes": rng.sample(volumes, mostly(0, 1, 2, 3)), "env": rng.sample(envs, mostly(0, 1, 2)),
                "labels": mostly({}, {"team": "a"}, {"paratrain.dev/x": "y"}),
                "annotations": mostly({}, {"paratrain.dev/x": "y", "a": "b"})},
        "failurePolicy": {"rules": rng.sample(failure_rules, mostly(0, 1, 2, 3, 4))},
        **mostly({}, {"elastic": {"minNodes": 1}}, {"elastic": {"minNodes": 3, "maxNodes": 2}},
                 {"elastic": {"minNodes": 1}, "checkpoint": {"path": "/c"}}),
    }


def test_random_specs_get_the_same_verdict_from_python_and_cel() -> None:
    rng = random.Random(20261129)
    rejected = 0
    for _ in range(250):
        spec = random_spec(rng)
        python = cross_field_problems(Spec.model_validate(spec, context={"defer_cross_field": True}))
        crd = admit(CRD, job(spec))
        assert {p for p, _ in crd} == {p for p, _ in python}, spec
        for path, message in crd:
            if message != "Duplicate value":
                assert message in [m for p, m in python if p == path], (spec, path, message)
        rejected += bool(python)
    assert 50 < rejected < 250, "the generator should produce both valid and invalid specs"
