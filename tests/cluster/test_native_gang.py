"""`scheduling.gang: kubernetes` on the real kube-scheduler (1.37, GenericWorkload): the gang's objects, exactly as
the operator renders them, bind all or nothing.

Nodes are registered through the API with their capacity (no kubelet needs to run for scheduling), in a pool of
this test's own (a label, and a taint the gang tolerates) so that no other test's pods land on them.
"""

from __future__ import annotations

import time

import pytest

from paratrain.api import parse_job
from paratrain_operator.apply import PLURALS
from paratrain_operator.render import render_job

from ..support.control_plane import collection_path, register_node, wait_for

POOL_LABEL = "pool.paratrain.test/name"
ZONE_LABEL = "topology.kubernetes.io/zone"
# Three pods of 3 CPUs; each node has 4, so one pod fits a node, and the gang needs three nodes.
GANG = {"nodes": 3, "parallelism": {"data": 3}, "training": {"batchSize": 9},
        "resources": {"cpu": "3", "memory": "1Gi"}}


@pytest.fixture
def pool(control_plane, request):
    """A namespace and a node-pool name of this test's own; its nodes are removed afterwards."""
    name = f"gang-{abs(hash(request.node.name)) % 10**6}"
    namespace = control_plane.create_namespace(name)
    nodes: list[str] = []

    def add_node(zone: str = "zone-a") -> None:
        nodes.append(f"{name}-node-{len(nodes)}")
        labels = {POOL_LABEL: name, "kubernetes.io/hostname": nodes[-1], ZONE_LABEL: f"{name}-{zone}"}
        register_node(control_plane.api, nodes[-1], labels, {"cpu": "4", "memory": "8Gi", "pods": "110"},
                      [{"key": POOL_LABEL, "value": name, "effect": "NoSchedule"}])

    yield namespace, add_node
    for n in nodes:
        control_plane.api.request("DELETE", f"/api/v1/nodes/{n}")


def gang_job(pool_name: str, **extra: str) -> dict:
    scheduling = {"gang": "kubernetes", "nodeSelector": {POOL_LABEL: pool_name}, **extra,
                  "tolerations": [{"key": POOL_LABEL, "operator": "Equal", "value": pool_name,
                                   "effect": "NoSchedule"}]}
    return {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "gang"},
            "spec": {**GANG, "scheduling": scheduling}}


def create_attempt(api, namespace: str, attempt: int, **scheduling: str) -> list[str]:
    """The gang's objects for `attempt` (the Workload, ConfigMap and Service once); returns its pod names."""
    pods = []
    for obj in render_job(parse_job(gang_job(namespace, **scheduling)), namespace, attempt):
        path = collection_path(obj["apiVersion"], PLURALS[obj["kind"]], namespace)
        response = api.create(path, obj)
        assert response.ok or response.status == 409, (obj["kind"], response.body.get("message"))
        if obj["kind"] == "Pod":
            pods.append(obj["metadata"]["name"])
    return pods


def bound(api, namespace: str, pods: list[str]) -> dict[str, str | None]:
    return {p: api.must(api.get(f"/api/v1/namespaces/{namespace}/pods/{p}"))["spec"].get("nodeName")
            for p in pods}


def test_a_gang_binds_all_or_nothing_and_a_restart_gets_a_fresh_group(control_plane, pool):
    api = control_plane.api
    namespace, add_node = pool
    add_node()
    add_node()  # room for two of the three pods
    pods = create_attempt(api, namespace, attempt=0)
    group = api.must(api.get(f"/apis/scheduling.k8s.io/v1beta1/namespaces/{namespace}/podgroups/gang-0"))
    assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 3}}

    # A plain scheduler would bind two pods by now (it binds one every few milliseconds); a gang binds none.
    time.sleep(8)
    assert bound(api, namespace, pods) == dict.fromkeys(pods), "part of a gang was bound"

    add_node()  # capacity appears: the whole gang starts
    placed = wait_for(lambda: (b := bound(api, namespace, pods)) and all(b.values()) and b, 60,
                      "the gang to bind once it fits")
    assert len(set(placed.values())) == 3, placed

    # A whole-gang restart: attempt 0's pods go, attempt 1 joins a fresh PodGroup and binds as a whole again.
    for p in pods:
        api.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{p}", {"gracePeriodSeconds": 0})
    wait_for(lambda: all(api.get(f"/api/v1/namespaces/{namespace}/pods/{p}").status == 404 for p in pods), 30,
             "attempt 0's pods to go")
    restarted = create_attempt(api, namespace, attempt=1)
    assert api.get(f"/apis/scheduling.k8s.io/v1beta1/namespaces/{namespace}/podgroups/gang-1").ok
    wait_for(lambda: all(bound(api, namespace, restarted).values()), 60, "attempt 1's gang to bind")
    for p in restarted:
        pod = api.must(api.get(f"/api/v1/namespaces/{namespace}/pods/{p}"))
        assert pod["spec"]["schedulingGroup"] == {"podGroupName": "gang-1"}


def test_a_topology_key_keeps_the_whole_gang_in_one_domain(control_plane, pool):
    """scheduling.topology (required, the whole gang): the gang fits the pool only across two zones, so it waits; once one zone can hold it
    all, it binds there as a whole."""
    api = control_plane.api
    namespace, add_node = pool
    for zone in ("zone-a", "zone-a", "zone-b", "zone-b"):
        add_node(zone)  # four nodes of one pod each: room for three, but not in one zone
    pods = create_attempt(api, namespace, attempt=0, topology={"level": ZONE_LABEL})
    time.sleep(8)
    assert bound(api, namespace, pods) == dict.fromkeys(pods), "a gang was spread over zones"

    add_node("zone-b")
    placed = wait_for(lambda: (b := bound(api, namespace, pods)) and all(b.values()) and b, 60,
                      "the gang to bind in the zone that fits it")
    zones = {api.must(api.get(f"/api/v1/nodes/{n}"))["metadata"]["labels"][ZONE_LABEL] for n in placed.values()}
    assert zones == {f"{namespace}-zone-b"}, placed
