"""`scheduling.gang: kubernetes` through the operator, as its ServiceAccount, on the real kube-scheduler (1.37,
GenericWorkload): the gang is held whole while capacity is short (and the job's status says why), binds whole when
it arrives, and a restart goes into a fresh PodGroup while the old attempt's is deleted. Hollow nodes of 4 CPUs
(support/hollow.py): one 3-CPU pod fits a node, so the 3-pod gang needs three nodes.
(tests/cluster/test_native_gang.py proves the scheduler's side with the rendered objects and admin credentials.)
"""

from __future__ import annotations

import pytest

from ..support.control_plane import wait_for
from .support.scale import ScaleRig

pytestmark = pytest.mark.timeout(240)
NS, JOB = "native-gang", "gang"
PODGROUPS = f"/apis/scheduling.k8s.io/v1beta1/namespaces/{NS}/podgroups"


@pytest.fixture(scope="module")
def rig(control_plane, tmp_path_factory: pytest.TempPathFactory):
    r = ScaleRig(control_plane, tmp_path_factory.mktemp("native"), nodes=2, resync_seconds=2,
                 node_capacity={"cpu": "4", "memory": "8Gi", "pods": "110"})
    yield r
    r.close()


def bound(rig: ScaleRig, attempt: int) -> dict[str, str | None]:
    return {p["metadata"]["name"]: p["spec"].get("nodeName") for p in rig.pods(NS)
            if p["metadata"]["name"].startswith(f"{JOB}-{attempt}-")}


def test_a_native_gang_is_held_whole_binds_whole_and_restarts_into_a_fresh_podgroup(rig: ScaleRig):
    rig.plane.create_namespace(NS)
    rig.submit(NS, JOB, 3, scheduling={"gang": "kubernetes"}, resources={"cpu": "3", "memory": "1Gi"})
    wait_for(lambda: len(bound(rig, 0)) == 3, 30, "the gang's three pods")
    # Two nodes: room for two of the three pods. A plain scheduler binds two within milliseconds; a gang binds none.
    # The status names the cause once the scheduler has tried every pod and the operator's next pass has read it
    # (waited for, not slept: 8 s fell short on a loaded machine).
    status = wait_for(lambda: "3 Unschedulable" in (s := rig.status(NS, JOB)).get("message", "") and s, 60,
                      "the status to name 3 unschedulable pods")
    assert set(bound(rig, 0).values()) == {None}, "part of the gang was bound"
    assert status["phase"] == "Pending", status
    assert "pod group" in status["message"]  # the scheduler's own word on why, through the pods' conditions

    rig.hollow.add(1)  # capacity arrives: the whole gang binds
    placed = wait_for(lambda: (b := bound(rig, 0)) and all(b.values()) and b, 60, "the gang to bind whole")
    assert len(set(placed.values())) == 3
    status = wait_for(lambda: (s := rig.status(NS, JOB)).get("phase") == "Running" and s, 30, "the job Running")
    gang = next(c for c in status["conditions"] if c["type"] == "GangScheduled")  # read off the PodGroup
    assert (gang["status"], gang["reason"]) == ("True", "ScheduledAsGang"), gang

    rig.hollow.finish(NS, f"{JOB}-0-1", exit_code=1)  # a retryable failure: the whole gang restarts
    restarted = wait_for(lambda: (b := bound(rig, 1)) and len(b) == 3 and all(b.values()) and b, 60,
                         "attempt 1's gang to bind whole")
    assert len(set(restarted.values())) == 3
    status = wait_for(lambda: (s := rig.status(NS, JOB)).get("phase") == "Running" and s, 30, "attempt 1 Running")
    assert (status["attempt"], status["restarts"]) == (1, 1)
    pod = rig.api.must(rig.api.get(f"/api/v1/namespaces/{NS}/pods/{JOB}-1-0"))
    assert pod["spec"]["schedulingGroup"] == {"podGroupName": f"{JOB}-1"}

    # The old attempt's PodGroup is deleted (its protection finalizer may hold it a moment), not left to pile up.
    def old_group_deleted() -> bool:
        response = rig.api.get(f"{PODGROUPS}/{JOB}-0")
        return response.status == 404 or bool(response.body.get("metadata", {}).get("deletionTimestamp"))
    wait_for(old_group_deleted, 30, "attempt 0's PodGroup to be deleted")
    assert rig.api.get(f"{PODGROUPS}/{JOB}-1").ok

    # Every create asked for strict field validation (a field the server does not know is an error, not dropped).
    creates = [r[1] for r in rig.requests() if r[0] == "POST" and f"/namespaces/{NS}/" in r[1]
               and not r[1].split("?")[0].endswith("/events")]
    assert creates and all("fieldValidation=Strict" in c for c in creates), creates


def test_a_lost_pod_of_a_native_gang_is_replaced_alone_into_its_attempts_podgroup(rig: ScaleRig):
    """With in-place restarts, a deleted pod of a running native gang is recreated alone under its name, naming
    the attempt's PodGroup, and kube-scheduler binds it there: the group's other pods are bound, so the gang
    stays whole (minCount is met by the bound pods and the new one together). No new attempt, no new PodGroup."""
    rig.hollow.add(2)  # the first test's gang holds three nodes
    rig.submit(NS, "swap", 2, scheduling={"gang": "kubernetes"}, resources={"cpu": "3", "memory": "1Gi"},
               restartPolicy={"inPlaceLimit": 1})
    wait_for(lambda: (b := {p["metadata"]["name"]: p["spec"].get("nodeName") for p in rig.pods(NS)
                            if p["metadata"]["name"].startswith("swap-0-")}) and len(b) == 2 and all(b.values()),
             60, "the gang to bind whole")
    wait_for(lambda: rig.status(NS, "swap").get("phase") == "Running", 30, "the job Running")
    uid = {n: rig.api.must(rig.api.get(f"/api/v1/namespaces/{NS}/pods/swap-0-{n}"))["metadata"]["uid"] for n in (0, 1)}
    lost = uid[1]
    rig.api.must(rig.api.request("DELETE", f"/api/v1/namespaces/{NS}/pods/swap-0-1"))

    def replaced() -> dict | None:
        pod = rig.api.get(f"/api/v1/namespaces/{NS}/pods/swap-0-1").body
        meta = pod.get("metadata") or {}
        return pod if meta.get("uid") not in (None, lost) and pod["spec"].get("nodeName") else None
    pod = wait_for(replaced, 60, "the replacement of swap-0-1 to bind")
    assert pod["spec"]["schedulingGroup"] == {"podGroupName": "swap-0"}
    status = wait_for(lambda: (s := rig.status(NS, "swap")).get("phase") == "Running" and s, 30, "Running again")
    assert (status["attempt"], status["restarts"], status.get("podReplacements")) == (0, 0, 1), status
    assert "replacing" not in status
    assert rig.api.get(f"/api/v1/namespaces/{NS}/pods/swap-0-0").body["metadata"]["uid"] == uid[0]  # untouched
    assert not rig.api.get(f"{PODGROUPS}/swap-1").ok and rig.api.get(f"{PODGROUPS}/swap-0").ok
