"""An elastic gang under `scheduling.gang: kubernetes` with a required topology, through the operator on the real
kube-scheduler (1.37, GenericWorkload + TopologyAwareWorkloadScheduling): each attempt's PodGroup asks for the
gang at its size within one rack; a node lost from the rack shrinks the gang to 2; its placeholders ask for the
running pods' rack, so a free node in another rack does not grow it (the grown gang would find no rack and shrink
again); the node returns and the gang grows back into the rack. Hollow nodes of 4 CPUs (support/hollow.py), one
3-CPU pod each, whose rank 0 reports a step that grows 10 a second.
"""

from __future__ import annotations

import time

import pytest

from ..support.control_plane import wait_for
from .support.hollow import HOLLOW, MERGE_PATCH
from .support.scale import ScaleRig

pytestmark = pytest.mark.timeout(300)
NS, JOB = "native-elastic", "gang"
RACK, POOL = "topology.paratrain.test/rack", "pool.paratrain.test/name"
PODGROUPS = f"/apis/scheduling.k8s.io/v1beta1/namespaces/{NS}/podgroups"
WAIT_SECONDS = 10


@pytest.fixture
def rig(control_plane, tmp_path):
    r = ScaleRig(control_plane, tmp_path, nodes=5, resync_seconds=2, progress=True,
                 node_capacity={"cpu": "4", "memory": "8Gi", "pods": "110"})
    yield r
    r.close()


def patch_node(rig: ScaleRig, node: str, body: dict) -> None:
    rig.api.must(rig.api.request("PATCH", f"/api/v1/nodes/{node}", body, content_type=MERGE_PATCH))


def placed(rig: ScaleRig, prefix: str, probes: bool = True) -> dict[str, str | None]:
    """Pod name → node, for the pods whose names start with `prefix` (and are no placeholders, unless `probes`)."""
    return {p["metadata"]["name"]: p["spec"].get("nodeName") for p in rig.pods(NS)
            if p["metadata"]["name"].startswith(prefix) and not p["metadata"].get("deletionTimestamp")
            and (probes or "-probe-" not in p["metadata"]["name"])}


def min_count(rig: ScaleRig, attempt: int) -> int:
    group = rig.api.must(rig.api.get(f"{PODGROUPS}/{JOB}-{attempt}"))
    return group["spec"]["schedulingPolicy"]["gang"]["minCount"]


def test_a_native_elastic_gang_shrinks_within_its_rack_and_grows_back_only_into_it(rig: ScaleRig):
    rack_a, rack_b = rig.hollow.names[:4], rig.hollow.names[4:]
    for node in rig.hollow.names:
        patch_node(rig, node, {"metadata": {"labels": {RACK: "a" if node in rack_a else "b", POOL: NS}}})
    rig.plane.create_namespace(NS)
    scheduling = {"gang": "kubernetes", "topology": {"level": RACK},
                  "nodeSelector": {HOLLOW: "true", POOL: NS}}
    rig.submit(NS, JOB, 4, scheduling=scheduling, resources={"cpu": "3", "memory": "1Gi"},
               elastic={"minNodes": 2, "waitSeconds": WAIT_SECONDS}, checkpoint={"path": "/ckpt"})
    first = wait_for(lambda: (b := placed(rig, f"{JOB}-0-")) and len(b) == 4 and all(b.values()) and b, 60,
                     "the 4-pod gang bound")
    assert set(first.values()) == set(rack_a), "rack b's one node cannot hold the gang: all in rack a"
    wait_for(lambda: (rig.status(NS, JOB).get("progress") or {}).get("step", 0) >= 1, 60, "a trained step")

    lost = first[f"{JOB}-0-3"]
    patch_node(rig, lost, {"spec": {"unschedulable": True}})
    rig.api.must(rig.api.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{JOB}-0-3"))
    shrunk = wait_for(lambda: (s := rig.status(NS, JOB)).get("nodes") == 2 and s.get("phase") == "Running" and s,
                      90, "the gang running at 2 pods")
    assert [(r["fromNodes"], r["toNodes"], r["reason"]) for r in shrunk["resizes"]] == [(4, 2, "Shrunk")], shrunk
    # The deleted pod restarted the gang (no in-place replacement asked for): that attempt's 4 pods found no rack.
    assert "4 of 4 pods found no place" in shrunk["resizes"][0]["message"], shrunk["resizes"]
    small = shrunk["attempt"]
    gang = wait_for(lambda: (b := placed(rig, f"{JOB}-{small}-", probes=False)) and len(b) == 2 and
                    all(b.values()) and b, 30, "the shrunk attempt's 2 pods bound")
    assert set(gang.values()) <= set(rack_a) and min_count(rig, small) == 2

    # Rack a has one schedulable node left, rack b one: the placeholders for ranks 2 and 3 must both be in rack a.
    probes = wait_for(lambda: (b := placed(rig, f"{JOB}-{small}-probe-")) and len(b) == 2 and
                      sum(map(bool, b.values())) == 1 and b, 30, "one of the two placeholders bound")
    assert [n for n in probes.values() if n] == [n for n in rack_a if n not in {lost, *gang.values()}], probes
    time.sleep(WAIT_SECONDS + 5)  # past waitSeconds: had the other placeholder run in rack b, the gang would grow
    status = rig.status(NS, JOB)
    assert status["nodes"] == 2 and len(status["resizes"]) == 1, status
    assert not any(n in rack_b for n in placed(rig, f"{JOB}-{small}-probe-").values())

    patch_node(rig, lost, {"spec": {"unschedulable": False}})  # the node returns
    grown = wait_for(lambda: (s := rig.status(NS, JOB)).get("nodes") == 4 and s.get("phase") == "Running" and s,
                     90, "the gang grown back to 4")
    assert [(r["fromNodes"], r["toNodes"], r["reason"]) for r in grown["resizes"]] == [
        (4, 2, "Shrunk"), (2, 4, "Grown")], grown
    third = wait_for(lambda: (b := placed(rig, f"{JOB}-{small + 1}-", probes=False)) and len(b) == 4 and
                     all(b.values()) and b, 30, "the grown attempt's 4 pods bound")
    assert set(third.values()) == set(rack_a) and min_count(rig, small + 1) == 4
    wait_for(lambda: not placed(rig, f"{JOB}-{small}-probe-"), 30, "the placeholders gone")
    assert (grown["attempt"], grown["restarts"]) == (small + 1, 0), grown
