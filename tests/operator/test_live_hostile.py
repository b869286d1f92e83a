"""What one tenant can create never stops the operator for the others (issue 42), on the real control plane with
the real operator: a job whose affinity the API server accepted nested 1,500 deep (kopf's watcher once raised
RecursionError, and the operator exited, then crash-looped at every start), and pods of megabytes each.

The deep job is created through a CRD that keeps `affinity` free-form, as every CRD before paratrain typed the
field did: the API server keeps such an object as stored, so an operator may meet it for as long as it lives.
"""

from __future__ import annotations

import json
import re

import pytest

from paratrain.api import API_GROUP, API_VERSION
from paratrain.api.crd import crd_manifest

from ..support.control_plane import ControlPlane
from .support.cluster import JOBS, fake_job, fake_trainer_command
from .support.real_cluster import RealCluster, replace_crd, resource_path
from .support.server import wait_for

pytestmark = pytest.mark.timeout(240)
DEPTH = 1500


def free_form_affinity_crd() -> dict:
    """The CRD with `spec.scheduling.affinity` as any JSON (x-kubernetes-preserve-unknown-fields)."""
    crd = crd_manifest()
    for version in crd["spec"]["versions"]:
        scheduling = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["scheduling"]
        scheduling["properties"]["affinity"] = {"type": "object", "nullable": True,
                                                "x-kubernetes-preserve-unknown-fields": True}
    return crd


def deep_job_body(namespace: str, name: str) -> bytes:
    """A job whose affinity nests DEPTH objects (built as text: Python's own encoder refuses such depth)."""
    doc = {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "ParallelTrainJob",
           "metadata": {"name": name, "namespace": namespace},
           "spec": {**fake_job(), "scheduling": {"affinity": "AFFINITY"}}}
    return json.dumps(doc).replace('"AFFINITY"', '{"a":' * DEPTH + "1" + "}" * DEPTH).encode()


@pytest.fixture
def cluster(control_plane: ControlPlane, tmp_path):
    replace_crd(control_plane, free_form_affinity_crd())
    c = RealCluster(control_plane, tmp_path, command=fake_trainer_command, node="hostile-node")
    yield c
    c.close()
    for namespace in ("hostile-a", "hostile-b"):  # the deep job goes with its namespace
        control_plane.api.request("DELETE", f"/api/v1/namespaces/{namespace}")
    replace_crd(control_plane, crd_manifest())  # paratrain's own CRD again, for the modules after this one


def kubectl_status(cluster: RealCluster, ns: str, name: str, field: str) -> str:
    """A status field as kubectl (Go, which decodes 10,000 levels) reads it: the tests' own client cannot."""
    proc = cluster.kubectl("get", "ptj", name, "-n", ns, "-o", f"jsonpath={{.status.{field}}}")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_job_nested_1500_deep_leaves_every_other_namespace_served_and_says_why_it_is_skipped(
        cluster: RealCluster, control_plane: ControlPlane):
    tenant, other = cluster.namespace("hostile-a"), cluster.namespace("hostile-b")
    created = control_plane.api.request("POST", resource_path(JOBS, tenant), deep_job_body(tenant, "deep"))
    assert created.ok, created.body

    cluster.submit(other, "ok", fake_job(steps=5))
    cluster.wait_phase(other, "ok", "Succeeded", 60)
    events = wait_for(lambda: [e for e in cluster.events(tenant, "deep") if e["reason"] == "Unreadable"], 30,
                      "the deep job's Unreadable Event")
    assert events[0]["type"] == "Warning" and "nested deeper than 64 levels" in events[0]["message"]
    assert events[0]["involvedObject"]["uid"]  # `kubectl describe ptj deep` shows it
    assert kubectl_status(cluster, tenant, "deep", "reason") == "Unreadable"
    assert "affinity" in kubectl_status(cluster, tenant, "deep", "message")
    assert re.search(r"^paratrain_undecodable_objects_total [1-9]", cluster.metrics(), re.M)
    assert "RecursionError" not in cluster.operator_log.read_text()

    # A new operator lists the deep job at its start (the crash loop): it comes up, and serves the next job.
    cluster.kill_operator()
    cluster.start_operator()
    cluster.submit(other, "after-restart", fake_job(steps=3))
    cluster.wait_phase(other, "after-restart", "Succeeded", 60)
    assert cluster.operator is not None and cluster.operator.poll() is None
    assert len([e for e in cluster.events(tenant, "deep") if e["reason"] == "Unreadable"]) == 1  # counted, not new
