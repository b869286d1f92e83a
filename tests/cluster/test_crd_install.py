"""The CRD and the install bundle on a real kube-apiserver (scripts/test-cluster.sh): accepted by `kubectl apply`,
explained by `kubectl explain`, every cluster example accepted by a server-side dry run, and the defaults the
server fills in equal to the typed spec's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from paratrain.api import API_GROUP_VERSION, PLURAL, load_job
from paratrain.api.spec import Spec
from paratrain.api.platform import Platform
from paratrain_operator.apply import PLURALS
from paratrain_operator.planning import plan_now
from paratrain_operator.render import render_job

from ..api.crdsim import server_defaults, without_empty
from ..support.control_plane import collection_path, wait_for

REPO = Path(__file__).resolve().parents[2]
MANIFEST_EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))
CLUSTER_SUPPORT = sorted((REPO / "examples" / "cluster").glob("*.yaml"))  # PVCs, claim templates the jobs use
# Kinds whose CRDs come with a gang scheduler (Volcano, scheduler-plugins) this cluster does not run.
ELSEWHERE = ("scheduling.volcano.sh/", "scheduling.x-k8s.io/")


@pytest.fixture(scope="module")
def crd_installed(control_plane):
    proc = control_plane.kubectl("apply", "-f", str(REPO / "manifests" / "crd.yaml"))
    assert proc.returncode == 0, proc.stderr
    control_plane.wait_established(f"{PLURAL}.paratrain.dev")
    return control_plane


def test_the_crd_installs_with_kubectl_apply_and_is_established(crd_installed):
    out = crd_installed.kubectl("get", "crd", f"{PLURAL}.paratrain.dev", "-o", "yaml")
    conditions = {c["type"]: c["status"] for c in yaml.safe_load(out.stdout)["status"]["conditions"]}
    assert conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True", conditions


def test_install_bundle_passes_a_server_side_dry_run(crd_installed):
    # A dry run creates nothing, so the bundle's namespace must exist for the namespaced objects after it.
    if not crd_installed.api.get("/api/v1/namespaces/paratrain-system").ok:
        crd_installed.create_namespace("paratrain-system")
    proc = crd_installed.kubectl("apply", "--dry-run=server", "-f", str(REPO / "manifests" / "install.yaml"))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("example", MANIFEST_EXAMPLES, ids=[p.name for p in MANIFEST_EXAMPLES])
def test_every_cluster_example_passes_a_server_side_dry_run(crd_installed, example):
    proc = crd_installed.kubectl("apply", "--dry-run=server", "-n", "default", "-f", str(example))
    assert proc.returncode == 0, proc.stderr
    assert "(server dry run)" in proc.stdout


@pytest.mark.parametrize("path", CLUSTER_SUPPORT, ids=[p.name for p in CLUSTER_SUPPORT])
def test_the_examples_cluster_objects_pass_a_server_side_dry_run(crd_installed, path):
    proc = crd_installed.kubectl("apply", "--dry-run=server", "-n", "default", "-f", str(path))
    assert proc.returncode == 0, proc.stderr


def test_every_cluster_examples_gang_passes_a_server_side_dry_run(crd_installed):
    """What the operator would create for each example (paratrain render), sent to the real API server: resource
    claims, extended resources, identities, env from Secrets and spread constraints included. The ServiceAccount,
    PriorityClass and RuntimeClass the GPU examples name exist first, as admission requires. A mode auto example is
    planned first, as the operator plans it (these nodes carry no GPU labels: its pods are CPU pods)."""
    api, namespace = crd_installed.api, "example-gangs"
    if not api.get(f"/api/v1/namespaces/{namespace}").ok:
        crd_installed.create_namespace(namespace)
    jobs = [load_job(str(path)) for path in MANIFEST_EXAMPLES]
    jobs = [plan_now(j, [], Platform(), attempt=1)[0] if j.spec.parallelism.mode == "auto" else j for j in jobs]
    for account in {j.spec.pod.service_account_name for j in jobs} - {None}:
        api.create(collection_path("v1", "serviceaccounts", namespace),
                   {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}})
    for priority in {j.spec.scheduling.priority_class_name for j in jobs} - {None}:
        api.create(collection_path("scheduling.k8s.io/v1", "priorityclasses"),
                   {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": priority},
                    "value": 1000})
    for runtime in {j.spec.pod.runtime_class_name for j in jobs} - {None}:
        api.create(collection_path("node.k8s.io/v1", "runtimeclasses"),
                   {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": runtime},
                    "handler": runtime})
    sent = 0
    for job in jobs:
        for obj in render_job(job, namespace, attempt=1):
            if obj["apiVersion"].startswith(ELSEWHERE):
                continue
            plural = PLURALS[obj["kind"]]
            response = api.request("POST", collection_path(obj["apiVersion"], plural, namespace), obj,
                                   {"dryRun": "All", "fieldValidation": "Strict"})
            assert response.ok, (job.metadata.name, obj["kind"], obj["metadata"]["name"], response.body)
            sent += 1
    assert sent >= 3 * len(jobs)


def test_kubectl_explain_describes_the_parallelism_fields(crd_installed):
    proc = crd_installed.kubectl("explain", "ptj.spec.parallelism")
    assert proc.returncode == 0, proc.stderr
    for field in ("data", "tensor", "pipeline", "zeroStage", "microbatches", "pipelineSchedule"):
        assert f"  {field}\t" in proc.stdout or f"  {field} " in proc.stdout, (field, proc.stdout)


def test_kubectl_explain_gives_every_section_a_description_and_every_field_its_default_and_limits(crd_installed):
    """`kubectl explain ptj.spec` said `<no description>` for nine sections; now every one says what it is, and a
    field's explanation carries its default and limits (explain shows neither on its own)."""
    proc = crd_installed.kubectl("explain", "ptj.spec")
    assert proc.returncode == 0, proc.stderr
    assert "<no description>" not in proc.stdout, proc.stdout
    for section in ("checkpoint", "data", "logging", "model", "parallelism", "resources", "runPolicy", "scheduling",
                    "training"):
        assert f"  {section}\t" in proc.stdout or f"  {section} " in proc.stdout, (section, proc.stdout)
    field = crd_installed.kubectl("explain", "ptj.spec.scheduling.startTimeoutSeconds")
    assert field.returncode == 0, field.stderr
    assert "Default: 1200. Limits: ≥ 30, ≤ 604800." in " ".join(field.stdout.split()), field.stdout


def test_the_server_fills_in_the_typed_specs_defaults(crd_installed):
    """A job with only a name comes back from the real server with every default of paratrain's own Spec."""
    api = crd_installed.api
    job = {"apiVersion": API_GROUP_VERSION, "kind": "ParallelTrainJob", "metadata": {"name": "defaults"},
           "spec": {}}
    created = api.must(api.create(collection_path(API_GROUP_VERSION, PLURAL, "default"), job, dry_run=True))
    assert without_empty(created["spec"]) == server_defaults(Spec())
    assert Spec.model_validate(created["spec"]) == Spec()


def test_kubectl_get_shows_the_printer_columns(crd_installed):
    job = {"apiVersion": API_GROUP_VERSION, "kind": "ParallelTrainJob", "metadata": {"name": "columns"},
           "spec": {"nodes": 2, "parallelism": {"data": 2}}}
    api = crd_installed.api
    api.must(api.create(collection_path(API_GROUP_VERSION, PLURAL, "default"), job))
    try:
        out = wait_for(lambda: crd_installed.kubectl("get", "ptj", "columns", "-n", "default", "-o", "wide"), 10,
                       "kubectl get ptj")
        header = out.stdout.splitlines()[0].split()
        assert header[:8] == ["NAME", "PHASE", "LAYOUT", "STEP", "LOSS", "RESTARTS", "ETA", "AGE"], out.stdout
        assert {"NODES", "TOKENS/S", "LAST-RESTART", "RESTARTED", "FAILURE"} <= set(header), out.stdout
    finally:
        api.request("DELETE", collection_path(API_GROUP_VERSION, PLURAL, "default") + "/columns")
