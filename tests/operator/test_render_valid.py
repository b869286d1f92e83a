"""Every rendered object is one the API server accepts: strict Kubernetes 1.30 schemas for core kinds, the
upstream PodGroup CRDs' schemas (below) for the gang schedulers' kinds, the `restricted` Pod Security Standard for
pods; and `paratrain render` prints a YAML stream of exactly those objects."""

from __future__ import annotations

import copy
import glob
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from paratrain.api import load_job
from paratrain.cli import main as cli_main
from paratrain.api.platform import Platform
from paratrain_operator import planning
from paratrain_operator.render import render_job

from ..api.crdsim import schema_problems
from .pss import restricted_violations

ROOT = Path(__file__).resolve().parents[2]
JOB_FILES = sorted(glob.glob(str(ROOT / "tests/operator/jobs/*.yaml")) + glob.glob(str(ROOT / "examples/*.yaml")))
JOB_IDS = [str(Path(p).relative_to(ROOT)) for p in JOB_FILES]
H100_NODE = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559",
             "nvidia.com/gpu.count": "8"}

# The spec part of the PodGroup CRDs as published upstream (Volcano v1beta1; KAI v2alpha2; scheduler-plugins v1alpha1);
# kubernetes-validate has no schemas for custom resources. Unknown fields count as errors.
_QUANTITIES = {"type": "object", "additionalProperties": {"type": "string"}}
_KAI_TOPOLOGY = {"type": "object", "required": ["topology"], "properties": {
    "topology": {"type": "string"}, "requiredTopologyLevel": {"type": "string"},
    "preferredTopologyLevel": {"type": "string"}}}
PODGROUP_SPEC_SCHEMAS = {
    "scheduling.volcano.sh/v1beta1": {"type": "object", "required": ["minMember"], "properties": {
        "minMember": {"type": "integer", "minimum": 1}, "minTaskMember": {"type": "object",
                                                                         "additionalProperties": {"type": "integer"}},
        "queue": {"type": "string"}, "priorityClassName": {"type": "string"}, "minResources": _QUANTITIES,
        "networkTopology": {"type": "object"}}},
    # KAI v0.15+ (pkg/apis/scheduling/v2alpha2/podgroup_types.go): minMember and minSubGroup exclusive
    "scheduling.run.ai/v2alpha2": {"type": "object", "required": ["queue"], "properties": {
        "minMember": {"type": "integer", "minimum": 0}, "minSubGroup": {"type": "integer", "minimum": 0},
        "queue": {"type": "string"}, "priorityClassName": {"type": "string"},
        "topologyConstraint": _KAI_TOPOLOGY,
        "subGroups": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
            "minMember": {"type": "integer", "minimum": 0}, "parent": {"type": "string"},
            "topologyConstraint": _KAI_TOPOLOGY}}}}},
    "scheduling.x-k8s.io/v1alpha1": {"type": "object", "properties": {
        "minMember": {"type": "integer", "minimum": 1}, "minResources": _QUANTITIES,
        "scheduleTimeoutSeconds": {"type": "integer"}}},
}


def validate(obj: dict[str, Any]) -> None:
    """Raise on anything the API server would refuse: of 1.30, the oldest supported, except for Kubernetes' own
    gang scheduling (scheduling.k8s.io Workload and PodGroup, a pod's schedulingGroup), which needs 1.37."""
    native_gang = obj["apiVersion"].startswith("scheduling.k8s.io/") or "schedulingGroup" in obj.get("spec", {})
    if obj["kind"] != "PodGroup" or native_gang:
        kubernetes_validate.validate(obj, "1.37.0" if native_gang else "1.30.0", strict=True)
        return
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}, set(obj)
    # ObjectMeta is the same for every kind: check it strictly on a ConfigMap carrying it.
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}, "1.30.0",
                                 strict=True)
    assert schema_problems(PODGROUP_SPEC_SCHEMAS[obj["apiVersion"]], obj["spec"], "spec") == []


def render_file(path: str, attempt: int = 0) -> list[dict[str, Any]]:
    job = load_job(path)
    if job.spec.parallelism.mode == "auto":  # as the operator renders it: planned (CPU pods, or a labelled H100)
        job, _ = planning.plan_now(job, [H100_NODE], Platform(), attempt)
    return render_job(job, job.metadata.namespace or "default", attempt)


@pytest.mark.parametrize("path", JOB_FILES, ids=JOB_IDS)
def test_every_rendered_object_validates(path: str) -> None:
    objects = render_file(path, attempt=2)
    assert {o["kind"] for o in objects} >= {"ConfigMap", "Service", "Pod"}
    for obj in objects:
        validate(obj)


@pytest.mark.parametrize("path", JOB_FILES, ids=JOB_IDS)
def test_pods_meet_the_restricted_pod_security_standard(path: str) -> None:
    pods = [o for o in render_file(path) if o["kind"] == "Pod"]
    assert pods
    for pod in pods:
        assert restricted_violations(pod["spec"]) == []
        # A token only for a job that names its ServiceAccount (workload identity).
        assert pod["spec"]["automountServiceAccountToken"] is ("serviceAccountName" in pod["spec"])
        assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


def test_validation_and_pss_checks_can_fail() -> None:
    """The checks above are not vacuous: a misspelt field, a bad PodGroup and a privileged pod are caught."""
    objects = render_file(str(ROOT / "tests/operator/jobs/gpu-3d-volcano.yaml"))
    pod = copy.deepcopy(next(o for o in objects if o["kind"] == "Pod"))
    pod["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(pod)
    group = copy.deepcopy(next(o for o in objects if o["kind"] == "PodGroup"))
    group["spec"]["minMembers"] = 4
    with pytest.raises(AssertionError):
        validate(group)
    bad = copy.deepcopy(next(o for o in objects if o["kind"] == "Pod"))
    bad["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    bad["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    bad["spec"]["securityContext"].pop("runAsNonRoot")
    found = restricted_violations(bad["spec"])
    assert "container trainer: privileged" in found and "volume host: type not allowed" in found
    assert "container trainer: runAsNonRoot must be true" in found


def test_cli_render_prints_a_valid_yaml_stream(capsys: pytest.CaptureFixture[str]) -> None:
    for path in JOB_FILES:  # every one cluster-shaped, as it is
        assert cli_main(["render", path, "--attempt", "1"]) == 0, capsys.readouterr().err
        docs = list(yaml.safe_load_all(capsys.readouterr().out))
        assert docs == render_file(path, 1), path
        for doc in docs:
            validate(doc)


def test_installed_paratrain_command_renders(tmp_path: Path) -> None:
    path = ROOT / "tests/operator/jobs/dp2-cpu.yaml"
    out = subprocess.run([sys.executable, "-m", "paratrain.cli", "render", str(path), "--namespace", "team-b"],
                         capture_output=True, text=True, check=True).stdout
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "NetworkPolicy", "Pod", "Pod"]
    assert {d["metadata"]["namespace"] for d in docs} == {"team-b"}


def test_cli_render_refuses_a_bad_job_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: paratrain.dev/v1alpha1\nkind: ParallelTrainJob\nmetadata: {name: bad}\n"
                   "spec: {nodes: 2}\n")
    assert cli_main(["render", str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "spec.parallelism: data(1) x tensor(1) x pipeline(1)" in captured.err
