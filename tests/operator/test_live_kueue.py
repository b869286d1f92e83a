"""Kueue admits a job's gang as a whole, live: the real Kueue controller manager (built from its Go module by
scripts/kueuebin.sh, installed from its own release kustomization; see support/kueue.py) on a control plane of this
module's own, the operator as its ServiceAccount, and the real trainer in the test kubelet's pods.

A job labelled `kueue.x-k8s.io/queue-name` gets pods that Kueue gates until its ClusterQueue has quota for all of
them: too little quota holds the whole gang (no pod is bound); raising it admits the gang whole and it trains.
A higher-priority job then preempts a running one: Kueue evicts the gang, its ranks checkpoint the step in flight,
the operator queues a fresh gang without counting a restart, and the job resumes at the step it was stopped.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from paratrain.api import kueue, parse_job, read_yaml
from paratrain_operator.render import render_job

from ..support.control_plane import REPO, ControlPlane, wait_for
from ..reliability.gang import FAULTS
from .support.kueue import Kueue
from .support.real_cluster import RealCluster, install_crd
from .test_live_trainer import apply, tiny_job

pytestmark = pytest.mark.timeout(420)
KUEUE = "kueue.x-k8s.io/v1beta2"


@pytest.fixture(scope="module")
def kueue_plane(tmp_path_factory):
    """A control plane of its own: Kueue's pod webhook (failurePolicy Fail) sees every pod created on it."""
    plane = ControlPlane(tmp_path_factory.mktemp("kueue-plane"))
    manager = Kueue(plane, tmp_path_factory.mktemp("kueue"))
    yield plane, manager
    manager.close()
    plane.close()


@pytest.fixture
def cluster(kueue_plane, tmp_path: Path, request: pytest.FixtureRequest):
    plane, manager = kueue_plane
    c = RealCluster(plane, tmp_path, node=f"kueue-node-{abs(hash(request.node.name)) % 10**6}")
    c.kueue = manager
    yield c
    c.close()


def create(cluster: RealCluster, path: str, body: dict[str, Any]) -> dict[str, Any]:
    api = cluster.plane.api
    return api.must(api.create(path, body))


def queues(cluster: RealCluster, ns: str, cpu: str, **cluster_queue_spec: Any) -> str:
    """A ClusterQueue of `cpu` (and ample memory) for `ns`'s LocalQueue 'team'; returns the ClusterQueue's name."""
    if not cluster.plane.api.get(f"/apis/{KUEUE}/resourceflavors/default").ok:
        create(cluster, f"/apis/{KUEUE}/resourceflavors", {"apiVersion": KUEUE, "kind": "ResourceFlavor",
                                                             "metadata": {"name": "default"}})
    name = f"cq-{ns}"
    spec = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [{"name": "default", "resources": [
                {"name": "cpu", "nominalQuota": cpu}, {"name": "memory", "nominalQuota": "64Gi"}]}]}],
            **cluster_queue_spec}
    create(cluster, f"/apis/{KUEUE}/clusterqueues", {"apiVersion": KUEUE, "kind": "ClusterQueue",
                                                      "metadata": {"name": name}, "spec": spec})
    create(cluster, f"/apis/{KUEUE}/namespaces/{ns}/localqueues", {
        "apiVersion": KUEUE, "kind": "LocalQueue", "metadata": {"name": "team", "namespace": ns},
        "spec": {"clusterQueue": name}})
    return name


def priority_classes(cluster: RealCluster) -> None:
    """Kueue's WorkloadPriorityClasses `low` (10) and `high` (1000), once per control plane."""
    for name, value in (("low", 10), ("high", 1000)):
        if not cluster.plane.api.get(f"/apis/{KUEUE}/workloadpriorityclasses/{name}").ok:
            create(cluster, f"/apis/{KUEUE}/workloadpriorityclasses", {
                "apiVersion": KUEUE, "kind": "WorkloadPriorityClass", "metadata": {"name": name}, "value": value})


def queued_job(ns: str, name: str, checkpoints: Path, steps: int, priority: str | None = None) -> dict[str, Any]:
    job = tiny_job(name, ns, checkpoints, steps)
    job["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team"} | ({kueue.PRIORITY_CLASS_LABEL: priority}
                                                               if priority else {})
    return job


def workloads(cluster: RealCluster, ns: str) -> list[dict[str, Any]]:
    return cluster.plane.api.must(cluster.plane.api.get(f"/apis/{KUEUE}/namespaces/{ns}/workloads"))["items"]


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def test_too_little_quota_holds_the_whole_gang_and_raising_it_admits_the_gang_whole(cluster: RealCluster,
                                                                                    tmp_path: Path):
    ns = cluster.namespace("kueue-admit")
    cluster_queue = queues(cluster, ns, cpu="1")  # each of the 2 pods asks for 1 CPU: room for half the gang
    apply(cluster, queued_job(ns, "tiny", tmp_path / "ckpt", steps=12), tmp_path / "job.yaml")

    def gated_gang() -> list[dict[str, Any]]:
        pods = cluster.pods(ns, "tiny")
        gated = [p for p in pods if {"name": kueue.ADMISSION_GATE} in p["spec"].get("schedulingGates", [])]
        return pods if len(gated) == 2 else []
    pods = wait_for(gated_gang, 60, f"the gang's 2 pods, gated by Kueue\n{cluster.diagnostics(ns, 'tiny')}")
    for pod in pods:
        assert pod["metadata"]["labels"][kueue.QUEUE_LABEL] == "team"
        assert pod["metadata"]["labels"][kueue.POD_GROUP_LABEL] == "tiny-0"
        assert pod["metadata"]["annotations"][kueue.POD_GROUP_TOTAL_COUNT] == "2"

    def pending_workload() -> dict[str, Any] | None:
        found = workloads(cluster, ns)
        return found[0] if len(found) == 1 and condition(found[0], "QuotaReserved").get("status") == "False" else None
    workload = wait_for(pending_workload, 60, "Kueue's Workload for the gang, pending")
    assert "insufficient quota for cpu" in condition(workload, "QuotaReserved")["message"]
    assert sum(p["count"] for p in workload["spec"]["podSets"]) == 2  # one Workload for the whole gang

    # Held as a whole: for a while, not one pod is bound, and the job says why.
    wait_for(lambda: "QueuedByKueue" in cluster.status(ns, "tiny").get("message", ""), 30,
             f"the job's status to say Kueue holds it\n{cluster.diagnostics(ns, 'tiny')}")
    for _ in range(20):
        assert not any(p["spec"].get("nodeName") for p in cluster.pods(ns, "tiny")), "a pod was bound before admission"
        time.sleep(1)
    status = cluster.status(ns, "tiny")
    assert status["phase"] == "Pending" and status["pods"]["pending"] == 2, status
    assert "LocalQueue team" in status["message"], status["message"]

    patch = [{"op": "replace", "path": "/spec/resourceGroups/0/flavors/0/resources/0/nominalQuota", "value": "2"}]
    cluster.plane.api.must(cluster.plane.api.request("PATCH", f"/apis/{KUEUE}/clusterqueues/{cluster_queue}", patch,
                                                     content_type="application/json-patch+json"))
    status = cluster.wait_phase(ns, "tiny", "Succeeded", timeout=180)
    assert status["restarts"] == 0 and status["progress"]["step"] == 12, status
    admitted = workloads(cluster, ns)
    assert len(admitted) == 1 and condition(admitted[0], "Admitted").get("status") == "True", admitted
    assert wait_for(lambda: condition(workloads(cluster, ns)[0], "Finished").get("status") == "True", 60,
                    "Kueue to see the gang finish")
    # Finished, Kueue lets the pods go (its finalizer is off them), so deleting the job leaves nothing behind.
    wait_for(lambda: not any(p["metadata"].get("finalizers") for p in cluster.pods(ns, "tiny")), 60,
             "Kueue to release its finalizers")


def test_kueue_preempts_a_running_gang_for_a_higher_priority_job_and_it_resumes_at_the_stopped_step(
        cluster: RealCluster, tmp_path: Path):
    ns = cluster.namespace("kueue-preempt")
    priority_classes(cluster)
    # Room for one 2-pod gang; a higher priority takes it from a lower one.
    queues(cluster, ns, cpu="2", preemption={"withinClusterQueue": "LowerPriority"})
    checkpoints = tmp_path / "long"
    long = queued_job(ns, "long", checkpoints, steps=400, priority="low")  # long enough to be stopped mid-run
    long["spec"]["checkpoint"]["interval"] = 0  # only the stop and the end save
    apply(cluster, long, tmp_path / "long.yaml")
    cluster.wait_phase(ns, "long", "Running", 90)
    wait_for(lambda: (cluster.status(ns, "long").get("progress") or {}).get("step", 0) >= 10, 120, "step 10")

    apply(cluster, queued_job(ns, "urgent", tmp_path / "urgent", steps=12, priority="high"), tmp_path / "urgent.yaml")
    urgent = cluster.wait_phase(ns, "urgent", "Succeeded", 180)
    status = cluster.wait_phase(ns, "long", "Succeeded", 240)
    assert (status["restarts"], status["attempt"]) == (0, 1), cluster.diagnostics(ns, "long")
    assert "Preempted" in cluster.event_reasons(ns, "long"), cluster.event_reasons(ns, "long")
    # The preempted gang was queued again and admitted only once the urgent job had finished.
    second = [p for p in cluster.pods(ns, "long") if p["metadata"]["labels"][kueue.POD_GROUP_LABEL] == "long-1"]
    started = min(c["state"]["running"]["startedAt"] if "running" in c["state"] else
                  c["state"]["terminated"]["startedAt"] for p in second for c in p["status"]["containerStatuses"])
    assert started >= urgent["completionTime"], (started, urgent["completionTime"])

    logs = cluster.kubectl("logs", "-n", ns, "long-1-0").stdout  # the new gang's rank 0
    resumed = re.search(r"resume step=(\d+)", logs)
    assert resumed and 10 <= int(resumed[1]) < 400, logs[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step-{int(resumed[1]):08d}", "step-00000400"]


def test_the_kueue_examples_pass_a_server_side_dry_run_and_kueue_gates_the_examples_gang(kueue_plane):
    plane, _ = kueue_plane
    install_crd(plane)
    ns = plane.create_namespace("kueue-examples")
    for path in ("examples/kueue/queues.yaml", "examples/kueue.yaml"):
        dry = plane.kubectl("apply", "--dry-run=server", "-n", ns, "-f", str(REPO / path))
        assert dry.returncode == 0, dry.stderr
    job = read_yaml(REPO / "examples" / "kueue.yaml")
    for obj in render_job(parse_job(job), ns, 0):
        if obj["kind"] == "Pod":
            admitted = plane.api.must(plane.api.create(f"/api/v1/namespaces/{ns}/pods", obj, dry_run=True))
            assert {"name": kueue.ADMISSION_GATE} in admitted["spec"]["schedulingGates"], admitted["spec"]


def test_kueue_topology_aware_scheduling_keeps_each_group_of_ranks_in_one_rack_in_rank_order(kueue_plane):
    """spec.scheduling.topology under Kueue's TAS (beta, on by default): five one-pod nodes in racks a (2), b (2)
    and c (1), a Topology of rack then hostname, a flavor on it. A 4-pod gang with ranksPerDomain 2 (one rank a
    pod) is admitted whole and placed as two slices of two pods, each slice within one rack (c, with one node,
    holds none), node ranks 0-1 in one rack and 2-3 in the other: the pods' node-rank label is Kueue's pod
    index. The real Kueue, kube-scheduler and API server; nothing runs in the pods."""
    from paratrain import contract
    from paratrain_operator.apply import PLURALS

    from ..support.control_plane import collection_path, register_node

    plane, _ = kueue_plane
    api, rack, pool = plane.api, "tas.paratrain.test/rack", "tas.paratrain.test/pool"
    ns = plane.create_namespace("kueue-tas")
    taint = {"key": pool, "value": "tas", "effect": "NoSchedule"}
    nodes = {f"tas-{r}{i}": r for r, count in (("a", 2), ("b", 2), ("c", 1)) for i in range(count)}
    for node, name in nodes.items():
        register_node(api, node, {"kubernetes.io/hostname": node, rack: f"rack-{name}", pool: "tas"},
                      {"cpu": "8", "memory": "32Gi", "pods": "1"}, [taint])
    def create_on_plane(path: str, body: dict[str, Any]) -> None:
        api.must(api.create(path, body))

    create_on_plane(f"/apis/{KUEUE}/topologies", {
        "apiVersion": KUEUE, "kind": "Topology", "metadata": {"name": "racks"},
        "spec": {"levels": [{"nodeLabel": rack}, {"nodeLabel": "kubernetes.io/hostname"}]}})
    create_on_plane(f"/apis/{KUEUE}/resourceflavors", {
        "apiVersion": KUEUE, "kind": "ResourceFlavor", "metadata": {"name": "tas-racks"},
        "spec": {"nodeLabels": {pool: "tas"}, "topologyName": "racks", "tolerations": [
            {"key": pool, "operator": "Equal", "value": "tas", "effect": "NoSchedule"}]}})
    create_on_plane(f"/apis/{KUEUE}/clusterqueues", {
        "apiVersion": KUEUE, "kind": "ClusterQueue", "metadata": {"name": "cq-tas"},
        "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                 "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [{"name": "tas-racks",
                                     "resources": [{"name": "cpu", "nominalQuota": "40"},
                                                   {"name": "memory", "nominalQuota": "160Gi"}]}]}]}})
    create_on_plane(f"/apis/{KUEUE}/namespaces/{ns}/localqueues", {
        "apiVersion": KUEUE, "kind": "LocalQueue", "metadata": {"name": "team", "namespace": ns},
        "spec": {"clusterQueue": "cq-tas"}})
    job = tiny_job("tas", ns, Path("/checkpoints/tas"), steps=10)
    job["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team"}
    job["spec"].update(nodes=4, parallelism={"data": 4}, resources={"cpu": "1", "memory": "1Gi"})
    job["spec"]["training"]["batchSize"] = 8
    job["spec"]["scheduling"] = {"topology": {"level": rack, "ranksPerDomain": 2},
                                 "tolerations": [{"key": pool, "operator": "Equal", "value": "tas",
                                                  "effect": "NoSchedule"}]}
    pods = []
    for obj in render_job(parse_job(job), ns, 0):
        api.must(api.create(collection_path(obj["apiVersion"], PLURALS[obj["kind"]], ns), obj))
        if obj["kind"] == "Pod":
            pods.append(obj["metadata"]["name"])

    def placed() -> dict[int, str] | None:
        bound = {}
        for name in pods:
            body = api.must(api.get(f"/api/v1/namespaces/{ns}/pods/{name}"))
            if not body["spec"].get("nodeName"):
                return None
            bound[int(body["metadata"]["labels"][contract.LABEL_NODE_RANK])] = nodes[body["spec"]["nodeName"]]
        return bound

    wait_for(placed, 120, "Kueue to admit the gang and TAS to place it")
    where = placed()
    assert where[0] == where[1] and where[2] == where[3] and where[0] != where[2], where
    assert "c" not in where.values(), where
    for name in pods:  # TAS's own placement (its ungater writes the assigned domain), not the scheduler's luck
        selector = api.must(api.get(f"/api/v1/namespaces/{ns}/pods/{name}"))["spec"].get("nodeSelector", {})
        assert "kubernetes.io/hostname" in selector or rack in selector, (name, selector)


def admitted_group(cluster: RealCluster, ns: str, name: str) -> tuple[int, str] | None:
    """(pods, Admitted status) of the Workload Kueue made for pod group `name`, once it exists."""
    found = [w for w in workloads(cluster, ns) if w["metadata"]["name"] == name]
    return (sum(p["count"] for p in found[0]["spec"]["podSets"]), condition(found[0], "Admitted").get("status")) \
        if found else None


def test_an_elastic_gang_preempted_in_part_shrinks_into_the_quota_left_and_grows_back_when_it_frees(
        kueue_plane, tmp_path: Path):
    """spec.elastic under Kueue and mode auto: an urgent job takes half of a 4-CPU queue from a running 4-pod elastic
    gang (the planner lays out each size). Kueue evicts the gang whole; its fresh 4-pod group cannot be admitted, so
    after waitSeconds the operator shrinks it to 2 pods, a new Workload Kueue admits beside the urgent job. The
    placeholders are a Kueue group of their own, admitted once the urgent job finishes; the gang then grows back
    to 4 and succeeds."""
    plane, manager = kueue_plane
    slow = {"PARATRAIN_TEST_FAULT": "slow_steps:0.08", "PYTHONPATH": str(FAULTS)}
    cluster = RealCluster(plane, tmp_path, node="kueue-elastic-node", extra_env=slow)
    try:
        ns = cluster.namespace("kueue-elastic")
        priority_classes(cluster)
        queues(cluster, ns, cpu="4", preemption={"withinClusterQueue": "LowerPriority"})
        elastic = queued_job(ns, "el", tmp_path / "ckpt", steps=1200, priority="low")
        # mode auto: the planner lays out each size the gang takes (data 4 and ZeRO-1 at 4 CPU pods, data 2 at 2)
        elastic["spec"] |= {"nodes": 4, "parallelism": {"mode": "auto"}, "elastic": {"minNodes": 2, "waitSeconds": 10}}
        elastic["spec"]["training"]["batchSize"] = 8
        apply(cluster, elastic, tmp_path / "el.yaml")
        cluster.wait_phase(ns, "el", "Running", 120)
        wait_for(lambda: (cluster.status(ns, "el").get("progress") or {}).get("step", 0) >= 1, 120, "a step")

        urgent = queued_job(ns, "urgent", tmp_path / "urgent", steps=500, priority="high")  # outlasts the shrink
        apply(cluster, urgent, tmp_path / "urgent.yaml")
        try:
            shrunk = wait_for(lambda: (s := cluster.status(ns, "el")).get("nodes") == 2 and s.get("phase") == "Running"
                              and s, 180, "the gang running at 2 pods")
        except AssertionError:
            said = [(w["metadata"]["name"], [(c["type"], c["status"], c.get("message", "")[:200]) for c in
                                             w.get("status", {}).get("conditions", [])]) for w in workloads(cluster, ns)]
            raise AssertionError(f"{said}\n{cluster.status(ns, 'urgent')}\n{cluster.diagnostics(ns, 'el')}") from None
        assert "QueuedByKueue" in shrunk["resizes"][0]["message"], shrunk["resizes"]
        assert cluster.status(ns, "urgent")["phase"] in ("Running", "Succeeded")  # side by side in the quota
        admitted = {w["metadata"]["name"]: (sum(p["count"] for p in w["spec"]["podSets"]),
                                            condition(w, "Admitted").get("status")) for w in workloads(cluster, ns)}
        assert admitted[kueue.pod_group("el", 2)] == (2, "True"), admitted  # attempt 2: a Workload of 2, admitted
        placeholders = wait_for(lambda: admitted_group(cluster, ns, kueue.probe_group("el", 2)), 60,
                                "the placeholders' own Workload")
        assert placeholders[0] == 2, placeholders  # a group of 2, held while the urgent job has the quota

        status = cluster.wait_phase(ns, "el", "Succeeded", 300)
        assert [(r["fromNodes"], r["toNodes"], r["reason"]) for r in status["resizes"]] == [
            (4, 2, "Shrunk"), (2, 4, "Grown")], cluster.diagnostics(ns, "el")
        assert status["restarts"] == 0 and status["nodes"] == 4, status
        assert status["plan"]["layout"]["nodes"] == 4 and status["plan"]["attempt"] == 3, status["plan"]
        final = next(w for w in workloads(cluster, ns) if w["metadata"]["name"] == kueue.pod_group("el", 3))
        assert sum(p["count"] for p in final["spec"]["podSets"]) == 4, final  # the grown gang, admitted at 4
    finally:
        cluster.close()
