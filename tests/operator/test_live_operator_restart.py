"""The operator killed (SIGKILL) at the worst moments, then restarted: it picks up from the job's status and the
pods it finds, creating nothing twice and counting nothing twice. Each test holds one of the operator's API
requests in flight (the fault proxy in front of the real API server: support/fault_proxy.py), kills the operator
while it waits, fails that request, and starts a new operator."""

from __future__ import annotations

from pathlib import Path

import pytest

from .support.cluster import JOBS, fake_job, fake_trainer_command
from .support.real_cluster import RealCluster
from .support.server import wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def cluster(control_plane, tmp_path: Path):
    node = tmp_path.name.lower().replace("_", "-")  # unique per test, as its temp dir
    c = RealCluster(control_plane, tmp_path, command=fake_trainer_command, node=node, faults=True)
    yield c
    c.close()
    assert not c.proxy.internal_errors, c.proxy.internal_errors


def names(cluster: RealCluster, ns: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in cluster.pods(ns))


def test_killed_after_creating_one_of_three_pods(cluster: RealCluster, ns: str):
    held = cluster.proxy.inject("POST", rf"/namespaces/{ns}/pods$", after=1, hold=True, status=503)
    cluster.submit(ns, "big", fake_job(nodes=3, steps=3))
    wait_for(lambda: held.faulted, 30, "the operator to be creating its second pod")
    cluster.kill_operator()
    held.release()
    # A half-created gang: rank 0, perhaps rank 2 (its create goes out beside the held one: slow-start batches)
    assert names(cluster, ns) in (["big-0-0"], ["big-0-0", "big-0-2"])

    cluster.start_operator()
    status = cluster.wait_phase(ns, "big", "Succeeded", 60)
    assert cluster.pod_creations(ns) == ["big-0-0", "big-0-1", "big-0-2"]  # each pod created exactly once
    assert cluster.creations(ns, "configmaps") == ["big-spec"] and cluster.creations(ns, "services") == ["big"]
    assert status["restarts"] == 0 and status["attempt"] == 0 and "failure" not in status
    assert status["pods"]["succeeded"] == 3 and status["progressText"] == "3/3"


def test_killed_in_the_middle_of_a_gang_restart(cluster: RealCluster, ns: str):
    cluster.submit(ns, "job", fake_job(nodes=2, steps=30))
    cluster.wait_phase(ns, "job", "Running", 30)
    # The restart is decided and persisted (attempt 1), then deleting the old gang hangs.
    held = cluster.proxy.inject("DELETE", rf"/namespaces/{ns}/pods/job-0-0$", hold=True, status=503)
    cluster.api.call(cluster.kubelet.kill, ns, "job-0-1")
    wait_for(lambda: held.faulted, 30, "the operator to be deleting the old gang")
    cluster.kill_operator()
    held.release()
    status = cluster.status(ns, "job")
    assert (status["phase"], status["attempt"], status["restarts"]) == ("Restarting", 1, 1)
    assert "job-0-0" in names(cluster, ns)  # the old gang is still there

    cluster.start_operator()
    status = cluster.wait_phase(ns, "job", "Succeeded", 60)
    assert status["restarts"] == 1  # the restart is not counted twice
    assert cluster.pod_creations(ns) == ["job-0-0", "job-0-1", "job-1-0", "job-1-1"]


def test_a_job_and_its_namespace_are_deleted_while_no_operator_runs(cluster: RealCluster, ns: str):
    """No finalizer waits for the operator: with every replica down (a node lost, an upgrade gone wrong), `kubectl
    delete ptj` and `kubectl delete namespace` complete, and the garbage collector takes the gang."""
    cluster.submit(ns, "orphan", fake_job(steps=200))
    cluster.wait_phase(ns, "orphan", "Running", 30)
    assert not cluster.job(ns, "orphan")["metadata"].get("finalizers")
    cluster.kill_operator()
    cluster.api.delete(JOBS, ns, "orphan")
    wait_for(lambda: cluster.job(ns, "orphan") is None, 10, "the job to be deleted")
    wait_for(lambda: not cluster.pods(ns), 30, "the garbage collector to take the gang")
    cluster.api.delete("v1/namespaces", None, ns)
    wait_for(lambda: cluster.api.object("v1/namespaces", None, ns) is None, 60, "the namespace to be deleted")
