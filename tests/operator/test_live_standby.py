"""Two operator replicas (`--leader-elect`, as the Helm chart runs them) on the real control plane: one acts, the
other stands by (healthy, doing nothing) and takes over when the first dies, without duplicating a pod; a leader
that stops gracefully releases its Lease and the standby takes over at once; a leader whose renewals hang or fail
(500, 409, an empty 200) stops writing before the standby acts, and exits. Both run as the operator's ServiceAccount with the chart's rules (a Role for
Leases in its own namespace). The leader talks to the API server through the fault proxy (which logs its every
request); the standby directly."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from .support.cluster import OperatorProcess, fake_job, fake_trainer_command
from .support.real_cluster import OPERATOR_NAMESPACE, RealCluster, operator_kubeconfig
from .support.server import wait_for

pytestmark = pytest.mark.timeout(180)
WRITES = ("POST", "PUT", "PATCH", "DELETE")


def replica_args(lease: str) -> tuple[str, ...]:
    return ("--leader-elect", "--lease-namespace", OPERATOR_NAMESPACE, "--lease-name", lease, "--lease-seconds", "10")


def lease_of(tmp_path: Path) -> str:
    return f"lease-{tmp_path.name.lower().replace('_', '-')}"[:60].strip("-")


@pytest.fixture
def cluster(control_plane, tmp_path: Path) -> Iterator[RealCluster]:
    """The cluster's operator leads: it came first."""
    c = RealCluster(control_plane, tmp_path, command=fake_trainer_command, node=lease_of(tmp_path), faults=True,
                    operator_args=replica_args(lease_of(tmp_path)))
    yield c
    c.close()


@pytest.fixture
def standby(cluster: RealCluster, tmp_path: Path) -> Iterator[OperatorProcess]:
    """A second replica, standing by."""
    direct = operator_kubeconfig(cluster.plane, tmp_path / "standby.kubeconfig")
    replica = OperatorProcess(direct, tmp_path / "standby.log", cluster.resync_seconds, replica_args(lease_of(tmp_path)))
    try:
        replica.start()  # returns once its liveness endpoint answers: a standby is healthy
        wait_for(lambda: "standing by" in replica.log.read_text(), 20, "the second replica to stand by")
        yield replica
    finally:
        replica.kill()


def log(process: OperatorProcess) -> str:
    return process.log.read_text(errors="replace")


def test_the_standby_takes_over_a_running_job_when_the_leader_dies(cluster: RealCluster, standby: OperatorProcess,
                                                                   ns: str):
    cluster.submit(ns, "ha", fake_job(steps=60, step_seconds=0.2))
    cluster.wait_phase(ns, "ha", "Running", 30)
    assert " pass (" not in log(standby)  # standing by means doing nothing

    cluster.kill_operator(signal.SIGKILL)  # no goodbye: the standby waits out the Lease
    killed = time.monotonic()
    wait_for(lambda: "leading: acquired" in log(standby), 20, "the standby to take the Lease")
    wait_for(lambda: f" {ns}/ha: pass (" in log(standby), 10, "the new leader to act on the job")
    assert time.monotonic() - killed <= 15, log(standby)
    status = cluster.wait_phase(ns, "ha", "Succeeded", 60)
    assert cluster.pod_creations(ns) == ["ha-0-0", "ha-0-1"]  # nothing created twice
    assert (status["restarts"], status["attempt"]) == (0, 0)


def test_a_leader_that_stops_gracefully_hands_over_at_once(cluster: RealCluster, standby: OperatorProcess, ns: str,
                                                           tmp_path: Path):
    cluster.submit(ns, "during", fake_job(steps=100, step_seconds=0.2))  # passes and status writes in progress
    cluster.wait_phase(ns, "during", "Running", 30)
    cluster.kill_operator(signal.SIGTERM)  # a rolling update: the leader releases its Lease on the way out
    stopped = time.monotonic()
    wait_for(lambda: "leading: acquired" in log(standby), 10, "the standby to take the released Lease")
    assert time.monotonic() - stopped <= 5, log(standby)
    # It stopped every pass and write before the release: the release is its last write.
    requests = cluster.operator_requests()
    release = max(i for i, e in enumerate(requests) if e[0] == "PUT" and f"/leases/{lease_of(tmp_path)}" in e[1])
    assert [e[:2] for e in requests[release + 1:] if e[0] in WRITES] == []
    cluster.wait_phase(ns, "during", "Succeeded", 60)
    cluster.submit(ns, "after", fake_job(steps=3))
    cluster.wait_phase(ns, "after", "Succeeded", 30)


# How the leader's Lease requests go wrong (the fault proxy's injection: method, status, hold, empty).
LEASE_FAULTS = {
    "hang": ("PUT", None, True, False),  # a stalled connection: renewals never answer
    "500": ("PUT", 500, False, False),  # every renewal refused by a server error
    "409": ("PUT", 409, False, False),  # every renewal loses a conflict it cannot win
    "empty 2xx": ("GET", 200, False, True),  # the Lease read answers 200 with no body at all
}


@pytest.mark.parametrize("fault", LEASE_FAULTS)
def test_a_leader_whose_renewals_fail_makes_no_write_once_the_standby_leads(cluster: RealCluster,
                                                                            standby: OperatorProcess, ns: str,
                                                                            tmp_path: Path, fault: str):
    """The split-leader case: the leader's Lease requests fail (hang, 500, 409, an empty 200), its other requests
    still pass. It must stop acting within its renew deadline (7 s of its last renewal), before the standby may
    take the Lease (10 s after it last saw it renewed): after that, not one write of the old leader's arrives,
    and it exits (to restart as a standby)."""
    cluster.submit(ns, "split", fake_job(steps=200, step_seconds=0.2))  # 40 s of progress: a status write a resync
    cluster.wait_phase(ns, "split", "Running", 30)
    time.sleep(3)
    before = time.monotonic()
    job_writes = [e for e in cluster.operator_requests() if e[0] == "PATCH" and f"/{ns}/" in e[1]]
    assert len([e for e in job_writes if e[4] > before - 3]) >= 2  # a leader that kept acting would be seen

    lease = lease_of(tmp_path)
    method, status, hold, empty = LEASE_FAULTS[fault]
    held = cluster.proxy.inject(method, rf"/leases/{lease}$", status=status, hold=hold, times=None, empty=empty)
    wait_for(lambda: "leading: acquired" in log(standby), 30, "the standby to take the Lease")
    spec = cluster.plane.api.must(cluster.plane.api.get(
        f"/apis/coordination.k8s.io/v1/namespaces/{OPERATOR_NAMESPACE}/leases/{lease}"))["spec"]
    acquired_wall = datetime.fromisoformat(spec["acquireTime"]).timestamp()
    acquired = acquired_wall - time.time() + time.monotonic()  # the standby's clock is this host's
    time.sleep(5)  # any write the old leader still makes arrives meanwhile
    held.release()

    late = [(method, path) for method, path, _, _, start, _ in cluster.operator_requests()
            if method in WRITES and start > acquired]
    assert late == [], cluster.operator_log.read_text()[-3000:]
    assert held.faulted >= 1
    assert cluster.operator is not None and cluster.operator.poll() == 1  # it exited, as a lost Lease must
    assert "could not renew Lease" in cluster.operator_log.read_text()
    status = cluster.wait_phase(ns, "split", "Succeeded", 90)  # the new leader finishes the job
    assert cluster.pod_creations(ns) == ["split-0-0", "split-0-1"]
    assert (status["restarts"], status["attempt"]) == (0, 0)
