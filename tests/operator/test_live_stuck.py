"""A gang restart whose old pod is stuck terminating (issue 26): on the real control plane, with hollow nodes whose
kubelets can hang (`hold`) or be lost (`lose`: the node NotReady and tainted unreachable). The operator counts a pod
as stuck once its grace period plus PARATRAIN_STUCK_POD_SECONDS (2 s here) has passed: on a Ready node it names the
pod and waits (a second copy of a rank must never run beside a container that may still be stopping), on a lost
node it force-deletes the pod, as the pod garbage collector does, and the restart proceeds."""

from __future__ import annotations

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

    rig.hollow.lose(node)  # now the node is NotReady: no kubelet will ever confirm the deletion
    wait_for(lambda: rig.status(ns, "gang").get("phase") == "Running" and rig.status(ns, "gang")["attempt"] == 1,
             60, "the restarted gang to run")
    status = rig.status(ns, "gang")
    assert status["restarts"] == 1 and condition(status, "PodsStuck")["status"] == "False"
    assert sorted(p["metadata"]["name"] for p in rig.pods(ns)) == ["gang-1-0", "gang-1-1"]
    assert "ForceDeleted" in event_reasons(rig, ns)


def event_reasons(rig: ScaleRig, ns: str) -> list[str]:
    return [e["reason"] for e in rig.api.must(rig.api.get(f"/api/v1/namespaces/{ns}/events"))["items"]]
