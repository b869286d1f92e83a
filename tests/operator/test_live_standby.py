"""Two operator replicas (`--leader-elect`, as the Helm chart runs them) on the real control plane: one acts, the
other stands by (healthy, doing nothing) and takes over when the first dies, without duplicating a pod; a leader
that stops gracefully releases its Lease and the standby takes over at once. Both run as the operator's
ServiceAccount with the chart's rules (a Role for Leases in its own namespace)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .support.cluster import OperatorProcess, fake_job, fake_trainer_command
from .support.real_cluster import OPERATOR_NAMESPACE, RealCluster
from .support.server import wait_for

pytestmark = pytest.mark.timeout(180)


def replica_args(lease: str) -> tuple[str, ...]:
    return ("--leader-elect", "--lease-namespace", OPERATOR_NAMESPACE, "--lease-name", lease, "--lease-seconds", "10")


def lease_of(tmp_path: Path) -> str:
    return f"lease-{tmp_path.name.lower().replace('_', '-')}"[:60].strip("-")


@pytest.fixture
def cluster(control_plane, tmp_path: Path) -> Iterator[RealCluster]:
    """The cluster's operator leads: it came first."""
    c = RealCluster(control_plane, tmp_path, command=fake_trainer_command, node=lease_of(tmp_path),
                    operator_args=replica_args(lease_of(tmp_path)))
    yield c
    c.close()


@pytest.fixture
def standby(cluster: RealCluster, tmp_path: Path) -> Iterator[OperatorProcess]:
    """A second replica, standing by."""
    replica = OperatorProcess(cluster.operator_kubeconfig(), tmp_path / "standby.log", cluster.resync_seconds,
                              replica_args(lease_of(tmp_path)))
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


def test_a_leader_that_stops_gracefully_hands_over_at_once(cluster: RealCluster, standby: OperatorProcess, ns: str):
    cluster.kill_operator(signal.SIGTERM)  # a rolling update: the leader releases its Lease on the way out
    stopped = time.monotonic()
    wait_for(lambda: "leading: acquired" in log(standby), 10, "the standby to take the released Lease")
    assert time.monotonic() - stopped <= 5, log(standby)
    cluster.submit(ns, "after", fake_job(steps=3))
    cluster.wait_phase(ns, "after", "Succeeded", 30)
