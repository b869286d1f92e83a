"""A gang restart whose old pod is stuck terminating (issues 26 and 42): on the real control plane, with hollow nodes
whose kubelets can hang (`hold`), be lost (`lose`: the node NotReady and tainted unreachable) or be shut down
(`shut_down`: the out-of-service taint an admin sets). The operator counts a pod as stuck once its grace period
plus PARATRAIN_STUCK_POD_SECONDS (2 s here) has passed. As Kubernetes' pod garbage collector, it force-deletes
such a pod only where its node is gone or out of service, once; on a Ready or merely NotReady node (a partition
may leave the containers running) it names the pod and what holds it and waits, and a pod held longer than
startTimeoutSeconds (a finalizer no controller removes) ends the attempt, naming the pod and the finalizer."""

from __future__ import annotations

import time

import pytest

from ..support.control_plane import wait_for
from .support.cluster import condition
from .support.scale import ScaleRig

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def rig(control_plane, tmp_path_factory: pytest.TempPathFactory):
    r = ScaleRig(control_plane, tmp_path_factory.mktemp("stuck"), nodes=2, resync_seconds=1,
                 node_capacity={"cpu": "8", "memory": "64Gi", "pods": "1"},  # one pod per node
                 operator_env={"PARATRAIN_STUCK_POD_SECONDS": "2"})
    yield r
    r.close()


def test_a_pod_stuck_terminating_on_a_lost_node_is_force_deleted_and_the_gang_restarts(rig: ScaleRig):
    ns = "stuck"
    rig.plane.create_namespace(ns)
    rig.hollow.add(1)  # a spare node for the restarted rank
    rig.submit(ns, "gang", 2, pod={"terminationGracePeriodSeconds": 10})
    wait_for(lambda: rig.status(ns, "gang").get("phase") == "Running", 60, "the gang to run")
    node = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in rig.pods(ns)}["gang-0-1"]
    rig.hollow.hold(node)  # rank 1's kubelet hangs: its node still says Ready
    rig.hollow.finish(ns, "gang-0-0", 1)  # rank 0 fails: the gang restarts, deleting gang-0-1

    def stuck() -> dict | None:
        found = condition(rig.status(ns, "gang"), "PodsStuck")
        return found if found and found["status"] == "True" else None
    named = wait_for(stuck, 60, "the stuck pod to be named")  # 10 s grace + 2 s
    assert "gang-0-1" in named["message"] and node in named["message"]
    assert rig.status(ns, "gang")["phase"] == "Restarting"
    assert any(p["metadata"]["name"] == "gang-0-1" for p in rig.pods(ns))  # a Ready node: never force-deleted
    assert "PodStuck" in event_reasons(rig, ns)

    rig.hollow.lose(node)  # NotReady and unreachable: cut off, perhaps with its containers still running
    wait_for(lambda: any("is still there and not tainted out-of-service" in m for m in event_messages(rig, ns)), 30,
             "the wait to name the taint")
    time.sleep(5)
    assert rig.status(ns, "gang")["phase"] == "Restarting" and "ForceDeleted" not in event_reasons(rig, ns)
    assert any(p["metadata"]["name"] == "gang-0-1" for p in rig.pods(ns))  # never a second copy of rank 1

    rig.hollow.shut_down(node)  # the admin says it is down: out-of-service
    wait_for(lambda: rig.status(ns, "gang").get("phase") == "Running" and rig.status(ns, "gang")["attempt"] == 1,
             60, "the restarted gang to run")
    status = rig.status(ns, "gang")
    assert status["restarts"] == 1 and condition(status, "PodsStuck")["status"] == "False"
    assert sorted(p["metadata"]["name"] for p in rig.pods(ns)) == ["gang-1-0", "gang-1-1"]
    assert event_reasons(rig, ns).count("ForceDeleted") == 1


def test_a_pod_a_finalizer_holds_ends_the_attempt_at_the_start_timeout_naming_it(rig: ScaleRig):
    ns = "held"
    rig.plane.create_namespace(ns)
    rig.hollow.add(2)
    rig.submit(ns, "gang", 2, pod={"terminationGracePeriodSeconds": 10}, scheduling={"startTimeoutSeconds": 30})
    wait_for(lambda: rig.status(ns, "gang").get("phase") == "Running", 60, "the gang to run")
    pod = f"/api/v1/namespaces/{ns}/pods/gang-0-1"
    rig.api.must(rig.api.request("PATCH", pod, {"metadata": {"finalizers": ["example.com/hold"]}},
                                 content_type="application/merge-patch+json"))
    rig.hollow.finish(ns, "gang-0-0", 1)  # the gang restarts: gang-0-1 is deleted, and its finalizer holds it
    wait_for(lambda: "finalizer(s) example.com/hold" in stuck_message(rig, ns), 30, "the holder to be named")
    status = wait_for(lambda: (s := rig.status(ns, "gang")).get("phase") == "Failed" and s, 60, "the attempt to end")
    assert status["reason"] == "StartTimeout" and status["failure"]["reason"] == "PodStuckTerminating"
    assert status["failure"]["pod"] == "gang-0-1"
    assert "example.com/hold" in status["failure"]["message"] and "startTimeoutSeconds" in status["message"]
    assert "ForceDeleted" not in event_reasons(rig, ns)  # a Ready node: the finalizer is not the operator's to lift
    rig.api.request("PATCH", pod, {"metadata": {"finalizers": None}}, content_type="application/merge-patch+json")


def stuck_message(rig: ScaleRig, ns: str) -> str:
    return (condition(rig.status(ns, "gang"), "PodsStuck") or {}).get("message", "")


def event_reasons(rig: ScaleRig, ns: str) -> list[str]:
    return [e["reason"] for e in rig.api.must(rig.api.get(f"/api/v1/namespaces/{ns}/events"))["items"]]


def event_messages(rig: ScaleRig, ns: str) -> list[str]:
    return [e["message"] for e in rig.api.must(rig.api.get(f"/api/v1/namespaces/{ns}/events"))["items"]]
