"""What one tenant can create never stops the operator for the others (issue 42), on the real control plane with
the real operator: a job whose affinity the API server accepted nested 1,500 deep (kopf's watcher once raised
RecursionError, and the operator exited, then crash-looped at every start); and a property test: hypothesis
draws batches of what a tenant with namespace `edit` can create (jobs with free-form content deep and wide and
huge annotations, labelled pods with odd labels and megabytes of fields, large Events), and after each batch an
ordinary job in another namespace must still run to Succeeded, the operator's memory stay under the chart's limit
and `/healthz` answer healthy. Its examples are derandomized (the same seeds every run); a shrunk failure found
is kept as an `@example`.

The affinity is free-form in paratrain's CRD (Kubernetes' own structure, checked by the pod schema), so the API
server stores whatever JSON it is given there, up to its own depth limit.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from paratrain.api import API_GROUP, API_VERSION

from ..support.control_plane import ControlPlane
from .support.cluster import JOBS, fake_job, fake_trainer_command
from .support.real_cluster import RealCluster, resource_path
from .support.server import wait_for

pytestmark = pytest.mark.timeout(240)
DEPTH = 1500


def deep_job_body(namespace: str, name: str, affinity: str | None = None, annotations: dict | None = None) -> bytes:
    """A job whose affinity is the JSON text `affinity` (default: DEPTH nested objects), built as text: Python's
    own encoder refuses such depth."""
    doc = {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "ParallelTrainJob",
           "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
           "spec": {**fake_job(), "scheduling": {"affinity": "AFFINITY"}}}
    affinity = affinity or '{"a":' * DEPTH + "1" + "}" * DEPTH
    return json.dumps(doc).replace('"AFFINITY"', affinity).encode()


NAMESPACES = ("hostile-a", "hostile-b", "tenant", "ordinary")
CHART_MEMORY_LIMIT = 512 * 2**20  # charts/paratrain/values.yaml: resources.limits.memory


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory):
    c = RealCluster(control_plane, tmp_path_factory.mktemp("hostile"), command=fake_trainer_command,
                    node="hostile-node")
    yield c
    c.close()
    for namespace in NAMESPACES:  # the tenants' objects go with their namespaces
        control_plane.api.request("DELETE", f"/api/v1/namespaces/{namespace}")


def kubectl_status(cluster: RealCluster, ns: str, name: str, field: str) -> str:
    """A status field as kubectl (Go, which decodes 10,000 levels) reads it: the tests' own client cannot."""
    proc = cluster.kubectl("get", "ptj", name, "-n", ns, "-o", f"jsonpath={{.status.{field}}}")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_job_nested_1500_deep_leaves_every_other_namespace_served_and_says_why_it_is_skipped(
        cluster: RealCluster, control_plane: ControlPlane):
    tenant, other = cluster.namespace(NAMESPACES[0]), cluster.namespace(NAMESPACES[1])
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


# ---- the property test ---------------------------------------------------------------------------------------

KEYS = st.text(alphabet="abcxyz-_.$\u00e9\u4e2d\"\\", min_size=1, max_size=8)
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1),
                   st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))  # JSON has no Infinity


@st.composite
def free_form(draw: st.DrawFn) -> str:
    """An object's JSON text: a chain `depth` deep (objects or lists, as drawn) ending in `width` leaves."""
    depth = draw(st.sampled_from([1, 8, 63, 64, 65, 300, 1500, 5000]))
    width = draw(st.sampled_from([1, 50, 5000]))
    inner = ",".join(json.dumps(draw(LEAVES)) for _ in range(min(width, 3)))
    inner = ",".join([inner] * max(1, width // 3))
    text = f"[{inner}]"
    for level in range(depth):
        text = f"[{text}]" if draw(st.booleans()) and level % 7 else f"{{{json.dumps(draw(KEYS))}:{text}}}"
    return f'{{"k":{text}}}'


def odd_pod(job: str, index: int, kind: str) -> dict:
    """A labelled pod the operator's informer sees but no job of it owns: never scheduled."""
    labels = {"paratrain.dev/job-name": job, "paratrain.dev/attempt": "x", "paratrain.dev/node-rank": "9" * 30}
    args = ["<" * 1_000_000] if kind == "huge" else ["\u0000\u202e\ud7ff" * 1000] if kind == "odd" else []
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{job}-x-{index}", "labels": labels,
                         "annotations": {"a": "\u4e2d" * 60_000} if kind == "annotated" else {}},
            "spec": {"schedulerName": "nobody", "containers": [{"name": "c", "image": "none", "args": args}]}}


BATCH = st.fixed_dictionaries({
    "affinities": st.lists(free_form(), min_size=1, max_size=3),
    "annotation_bytes": st.sampled_from([0, 1000, 200_000]),
    "pods": st.lists(st.sampled_from(["plain", "huge", "odd", "annotated"]), max_size=4),
    "event_bytes": st.sampled_from([0, 1000, 600_000]),
})
_batches = itertools.count()


def rss(cluster: RealCluster) -> int:
    assert cluster.operator is not None
    status = Path(f"/proc/{cluster.operator.pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) * 1024


@settings(max_examples=10, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(batch=BATCH)
# Kept: the shrunk case of a run under CI=true (hypothesis' CI profile drew other examples): escapes in keys.
@example(batch={"affinities": ['{"k":{"\\\\":[null]}}', '{"k":{"\\"\\\\":[1e308]}}'], "annotation_bytes": 0,
                "pods": [], "event_bytes": 0})
def test_whatever_a_tenant_creates_every_ordinary_job_still_runs_and_the_operator_tells_the_truth(
        cluster: RealCluster, control_plane: ControlPlane, batch: dict):
    n = next(_batches)
    tenant, ordinary = NAMESPACES[2], NAMESPACES[3]
    for namespace in (tenant, ordinary):
        if not control_plane.api.get(f"/api/v1/namespaces/{namespace}").ok:
            cluster.namespace(namespace)
    api = control_plane.api
    notes = {"a": "x" * batch["annotation_bytes"]} if batch["annotation_bytes"] else {}
    for i, affinity in enumerate(batch["affinities"]):
        created = api.request("POST", resource_path(JOBS, tenant), deep_job_body(tenant, f"t{n}-{i}", affinity, notes))
        assert created.ok, created.body  # every such job is one the API server accepts: the operator must cope
    for i, kind in enumerate(batch["pods"]):
        pod = api.request("POST", resource_path("v1/pods", tenant), odd_pod(f"t{n}-0", i, kind))
        assert pod.ok or kind == "odd", pod.body  # NUL and lone surrogates may be refused
    if batch["event_bytes"]:
        api.request("POST", resource_path("v1/events", tenant), {
            "metadata": {"name": f"t{n}-event"}, "type": "Warning", "reason": "Hostile",
            "message": "m" * batch["event_bytes"],
            "involvedObject": {"kind": "ParallelTrainJob", "namespace": tenant, "name": f"t{n}-0"}})

    cluster.submit(ordinary, f"ok-{n}", fake_job(steps=3))
    cluster.wait_phase(ordinary, f"ok-{n}", "Succeeded", 60)
    assert cluster.operator is not None and cluster.operator.poll() is None
    assert rss(cluster) < CHART_MEMORY_LIMIT
    # Healthy (200), and what it says it holds catches up within kopf's 10 s cache of probe results.
    wait_for(lambda: (cluster.health().get("pods") or {}).get("cachedPods", 0) >= 2 * (n + 1), 15,
             "the liveness answer to count the ordinary jobs' pods")
