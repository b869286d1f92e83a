"""The real operator (`python -m paratrain_operator`) on the real control plane (scripts/test-cluster.sh), as its
own ServiceAccount under the RBAC it declares — so any call beyond it fails these tests — with the test kubelet
running the pods kube-scheduler binds to its node, and a stand-in trainer (tests/operator/support/fake_trainer.py:
the real one's progress endpoint and exit codes, no torch) so that failure handling is exercised in seconds.
test_live_trainer.py runs the real trainer; test_live_faults.py injects API faults (through the fault proxy).

One cluster (and operator) serves this module; each test uses its own namespace.
"""

from __future__ import annotations

import re
import signal
import time
from typing import Any

import pytest

from paratrain import contract

from .support.cluster import ClusterBase as Cluster
from .support.cluster import condition, fake_job, fake_trainer_command
from .support.fault_proxy import ApiError
from .support.real_cluster import RealCluster
from .support.server import wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(control_plane, tmp_path_factory: pytest.TempPathFactory):
    c = RealCluster(control_plane, tmp_path_factory.mktemp("cluster"), command=fake_trainer_command,
                    node="live-node")
    yield c
    c.close()


def wait_running(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return cluster.wait_phase(ns, name, "Running", 30)


def test_a_job_succeeds_with_final_progress_events_and_metrics(cluster: Cluster, ns: str):
    cluster.submit(ns, "ok", fake_job(steps=5))
    status = cluster.wait_phase(ns, "ok", "Succeeded")
    assert status["progress"]["step"] == 5 and status["progress"]["phase"] == "done"  # rank 0's final report
    assert status["progressText"] == "5/5" and status["restarts"] == 0 and status["attempt"] == 0
    assert status["pods"]["succeeded"] == 2 and status["observedGeneration"] == 1
    assert status["startTime"] <= status["completionTime"]
    assert condition(status, "Succeeded")["status"] == "True" and condition(status, "Running")["status"] == "False"
    assert cluster.event_reasons(ns, "ok", until="Succeeded") == ["CreatingGang", "GangRunning", "Succeeded"]
    assert cluster.pod_creations(ns) == ["ok-0-0", "ok-0-1"]
    pod = cluster.pods(ns, "ok")[0]
    assert pod["metadata"]["ownerReferences"][0]["uid"] == cluster.job(ns, "ok")["metadata"]["uid"]
    metrics = cluster.metrics()
    assert re.search(r'^paratrain_jobs\{phase="Succeeded"\} [1-9]', metrics, re.M)
    assert "paratrain_reconcile_duration_seconds_count" in metrics


def test_an_invalid_spec_is_refused_by_the_api_server_naming_the_field(cluster: Cluster, ns: str):
    """The CRD's schema and CEL rules refuse what `paratrain validate` refuses, before any job exists."""
    with pytest.raises(ApiError) as refused:
        cluster.submit(ns, "bad", {"nodes": 2, "parallelism": {"data": 3}})
    assert refused.value.code == 422
    assert "spec.parallelism: Invalid value: data(3) x tensor(1) x pipeline(1) = 3 must equal nodes(2)" in str(
        refused.value)
    with pytest.raises(ApiError, match=r'unknown field "spec.paralelism"'):
        cluster.submit(ns, "typo", {"nodes": 1, "paralelism": {"data": 1}})
    assert cluster.job(ns, "bad") is None and cluster.job(ns, "typo") is None


def test_a_gang_the_quota_refuses_posts_one_event_that_counts_the_repeats(cluster: Cluster, ns: str):
    """While every pod create is refused (a quota of 0 pods), each pass says the same thing again: one
    CreatingGang Event whose count grows, not a new Event per pass."""
    cluster.api.create("v1/resourcequotas", {"metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}}, ns)
    # What the quota controller (not run on the test control plane) would record; admission enforces it from then.
    cluster.api.patch("v1/resourcequotas", ns, "no-pods", {"status": {"hard": {"pods": "0"}, "used": {"pods": "0"}}},
                      subresource="status")
    cluster.submit(ns, "quota", fake_job())

    def creating_events() -> list[dict[str, Any]] | None:
        events = [e for e in cluster.events(ns, "quota") if e["reason"] == "CreatingGang"]
        return events if sum(e.get("count", 1) for e in events) >= 3 else None

    events = wait_for(creating_events, 90, "three passes trying to create the gang")
    assert len(events) == 1 and events[0]["count"] >= 3, events
    assert events[0]["lastTimestamp"] >= events[0]["firstTimestamp"]
    assert cluster.pods(ns, "quota") == []


def test_a_spec_only_the_operator_refuses_fails_naming_the_field_and_creates_nothing(cluster: Cluster, ns: str):
    """A relative checkpoint path is a valid spec (it works locally) that no pod could use: the operator fails the
    job, naming the field, before creating anything."""
    cluster.submit(ns, "relative", {**fake_job(), "checkpoint": {"path": "runs/ckpt"}})
    status = cluster.wait_phase(ns, "relative", "Failed")
    assert status["reason"] == "InvalidSpec" and status["message"].startswith("spec.checkpoint.path:")
    time.sleep(1.5)  # a few resync periods: still nothing
    assert cluster.pods(ns) == [] and cluster.pod_creations(ns) == []
    assert cluster.api.objects("v1/configmaps", ns, "paratrain.dev/job-name=relative") == []
    assert cluster.api.objects("v1/services", ns) == []
    assert cluster.event_reasons(ns, "relative") == ["InvalidSpec"]


def test_a_killed_pod_restarts_the_whole_gang_once(cluster: Cluster, ns: str):
    cluster.submit(ns, "crash", fake_job(steps=30))
    wait_running(cluster, ns, "crash")
    cluster.api.call(cluster.kubelet.kill, ns, "crash-0-1", signal.SIGKILL)
    status = cluster.wait_phase(ns, "crash", "Succeeded", 60)
    assert status["restarts"] == 1 and status["attempt"] == 1
    assert status["failure"] == {"pod": "crash-0-1", "exitCode": 137, "reason": "Error",
                                 "message": "pod crash-0-1 exited with code 137 (killed by SIGKILL)"}
    assert cluster.pod_creations(ns) == ["crash-0-0", "crash-0-1", "crash-1-0", "crash-1-1"]  # each once
    assert sorted(p["metadata"]["name"] for p in cluster.pods(ns)) == ["crash-1-0", "crash-1-1"]
    assert cluster.event_reasons(ns, "crash", until="Succeeded") == [
        "CreatingGang", "GangRunning", "RestartingGang", "CreatingGang", "GangRunning", "Succeeded"]
    assert 'paratrain_gang_restarts_total{namespace="%s"} 1.0' % ns in cluster.metrics()


def test_a_permanent_exit_code_fails_the_job_without_a_restart(cluster: Cluster, ns: str):
    cluster.submit(ns, "perm", fake_job(steps=100, exit_code=127, exit_step=1, exit_rank=1))
    status = cluster.wait_phase(ns, "perm", "Failed")
    assert status["restarts"] == 0 and status["failure"]["exitCode"] == 127
    assert status["failure"]["pod"] == "perm-0-1" and "cannot run the command" in status["message"]
    # A failed job holds no nodes: the survivor is stopped; the failed pod stays for its logs.
    wait_for(lambda: [p["metadata"]["name"] for p in cluster.pods(ns)] == ["perm-0-1"], 15, "the survivor to go")
    time.sleep(1.5)
    assert cluster.pod_creations(ns) == ["perm-0-0", "perm-0-1"]  # and is never given new pods


def test_the_backoff_limit_stops_restarting(cluster: Cluster, ns: str):
    cluster.submit(ns, "flaky", fake_job(steps=100, run_policy={"backoffLimit": 1}, exit_code=1, exit_step=1,
                                         exit_rank=0))
    status = cluster.wait_phase(ns, "flaky", "Failed", 60)
    assert status["reason"] == "BackoffLimitExceeded" and status["restarts"] == 1 and status["attempt"] == 1
    assert status["failure"]["pod"] == "flaky-1-0" and status["failure"]["exitCode"] == 1


def test_a_failure_the_restart_cures_ends_in_success(cluster: Cluster, ns: str):
    cluster.submit(ns, "cured", fake_job(steps=3, exit_code=contract.EXIT_RETRYABLE, exit_step=1, fail_attempts=1))
    status = cluster.wait_phase(ns, "cured", "Succeeded", 60)
    assert status["restarts"] == 1 and status["failure"]["exitCode"] == contract.EXIT_RETRYABLE


@pytest.mark.parametrize("how", ["evicted", "evicted-counted", "evicted-by-an-old-kubelet", "deleted",
                                 "force-deleted"])
def test_an_evicted_or_deleted_pod_restarts_the_whole_gang_once(cluster: Cluster, ns: str, how: str):
    """A node evicting a pod (or losing it), `kubectl delete pod` (graceful: the pod may be seen terminating) and
    `--force --grace-period=0` (it is just gone): the whole gang is restarted once. An eviction with the
    DisruptionTarget condition (kubelets since 1.26) is not counted against backoffLimit (the default failure
    policy), unless a rule of the job says so; one without (an old kubelet) is; a deletion from outside is a stop."""
    rules = [{"action": "RestartGang", "podConditions": ["DisruptionTarget"]}] if how == "evicted-counted" else []
    cluster.submit(ns, how, fake_job(steps=30, failure_rules=rules))
    wait_running(cluster, ns, how)
    if how.startswith("evicted"):
        cluster.api.call(cluster.kubelet.evict, ns, f"{how}-0-0", disruption=how != "evicted-by-an-old-kubelet")
    else:
        cluster.api.delete("v1/pods", ns, f"{how}-0-0", **({"gracePeriodSeconds": 0} if how == "force-deleted"
                                                            else {}))
    status = cluster.wait_phase(ns, how, "Succeeded", 60)
    counted = how in ("evicted-counted", "evicted-by-an-old-kubelet")
    assert (status["restarts"], status["attempt"]) == (int(counted), 1)
    evicted = {"reason": "Evicted", "exitCode": 137,
               "message": f"pod {how}-0-0 failed: Evicted: The node was low on resource: memory."}
    expected = {"evicted": {**evicted, "message": evicted["message"] + "; the default rule (podConditions "
                            "[DisruptionTarget]: Ignore) applies"},
                "evicted-counted": {**evicted, "message": evicted["message"] + "; spec.failurePolicy.rules[0] "
                                    "(podConditions [DisruptionTarget]: RestartGang) applies"},
                "evicted-by-an-old-kubelet": evicted,
                "deleted": {"reason": "PodDeleted", "message": f"pod {how}-0-0 was deleted before it finished"},
                "force-deleted": {"reason": "PodDeleted", "message": f"pod {how}-0-0 was deleted before it finished"}
                }[how]
    # A counted restart is a failure; an uncounted one a stop, kept apart: the job Succeeded with no failure.
    recorded = "failure" if counted else "lastStop"
    assert status[recorded] == {"pod": f"{how}-0-0", **expected} and len({"failure", "lastStop"} & set(status)) == 1
    # The whole gang was restarted (the survivor too), each pod created once.
    assert cluster.pod_creations(ns) == [f"{how}-0-0", f"{how}-0-1", f"{how}-1-0", f"{how}-1-1"]
    assert sorted(p["metadata"]["name"] for p in cluster.pods(ns)) == [f"{how}-1-0", f"{how}-1-1"]
    assert cluster.event_reasons(ns, how).count("PodDeleted" if how.endswith("deleted") else "RestartingGang") == 1


def test_a_fail_job_rule_ends_the_job_at_the_first_matching_exit_naming_the_rule(cluster: Cluster, ns: str):
    """`failurePolicy.rules: [{exitCodes: [3], action: FailJob}]`: a pod exiting 3 fails the job at once (no
    restart, whatever backoffLimit allows), the rule named in its status and Event; the survivor is stopped."""
    rules = [{"action": "Ignore", "podConditions": ["DisruptionTarget"]}, {"action": "FailJob", "exitCodes": [3]}]
    cluster.submit(ns, "rule", fake_job(steps=100, exit_code=3, exit_step=1, exit_rank=1, failure_rules=rules,
                                        run_policy={"backoffLimit": 5}))
    status = cluster.wait_phase(ns, "rule", "Failed", 60)
    rule = "spec.failurePolicy.rules[1] (exitCodes [3]: FailJob) applies"
    assert (status["reason"], status["restarts"], status["attempt"]) == ("FailurePolicy", 0, 0)
    assert status["failure"] == {"pod": "rule-0-1", "exitCode": 3, "reason": "Error",
                                 "message": f"pod rule-0-1 exited with code 3 (error); {rule}"}
    # (GangRunning too, where a pass saw both pods running before rank 1 exited at its first step)
    reasons = cluster.event_reasons(ns, "rule", until="FailurePolicy")
    assert [r for r in reasons if r != "GangRunning"] == ["CreatingGang", "FailurePolicy"]
    wait_for(lambda: [p["metadata"]["name"] for p in cluster.pods(ns)] == ["rule-0-1"], 15, "the survivor to go")
    assert cluster.pod_creations(ns) == ["rule-0-0", "rule-0-1"]


def test_a_silent_job_gets_the_stalled_condition(cluster: Cluster, ns: str):
    cluster.submit(ns, "stuck", fake_job(steps=100, stall_after=2, run_policy={"stallTimeoutSeconds": 10}))
    wait_running(cluster, ns, "stuck")
    status = wait_for(lambda: (s := cluster.status(ns, "stuck")) and (condition(s, "Stalled") or {}).get(
        "status") == "True" and s, 30, "the Stalled condition")
    stalled = condition(status, "Stalled")
    assert stalled["reason"] == "ProgressStalled" and "last at step 2" in stalled["message"]
    assert status["phase"] == "Running" and status["progress"]["step"] == 2
    cluster.event_reasons(ns, "stuck", until="Stalled")  # the Event reporting it
    cluster.api.delete("paratrain.dev/v1alpha1/paralleltrainjobs", ns, "stuck")


def test_suspend_deletes_the_gang_and_resume_starts_a_fresh_one(cluster: Cluster, ns: str):
    cluster.submit(ns, "pause", fake_job(steps=40))
    wait_running(cluster, ns, "pause")
    jobs = "paratrain.dev/v1alpha1/paralleltrainjobs"
    cluster.api.patch(jobs, ns, "pause", {"spec": {"runPolicy": {"suspend": True}}})
    status = cluster.wait_phase(ns, "pause", "Suspended")
    wait_for(lambda: not cluster.pods(ns), 15, "the suspended gang to go")
    assert condition(status, "Suspended")["status"] == "True" and status["restarts"] == 0
    cluster.api.patch(jobs, ns, "pause", {"spec": {"runPolicy": {"suspend": False}}})
    status = cluster.wait_phase(ns, "pause", "Succeeded", 60)
    assert status["attempt"] == 1 and status["restarts"] == 0  # a resume is not a failure
    assert cluster.event_reasons(ns, "pause", until="Succeeded")[-4:] == [
        "Resumed", "CreatingGang", "GangRunning", "Succeeded"]


def test_a_job_created_suspended_waits_without_pods(cluster: Cluster, ns: str):
    cluster.submit(ns, "queued", fake_job(run_policy={"suspend": True}))
    cluster.wait_phase(ns, "queued", "Suspended")
    time.sleep(1.5)
    assert cluster.pod_creations(ns) == []


def test_the_active_deadline_fails_the_job_and_stops_it(cluster: Cluster, ns: str):
    cluster.submit(ns, "slow", fake_job(steps=1000, run_policy={"activeDeadlineSeconds": 3}))
    status = cluster.wait_phase(ns, "slow", "Failed", 30)
    assert status["reason"] == "DeadlineExceeded" and "activeDeadlineSeconds (3s" in status["message"]
    wait_for(lambda: not cluster.pods(ns), 15, "the gang to be stopped")


def test_ttl_after_finished_deletes_the_job_and_its_gang(cluster: Cluster, ns: str):
    cluster.submit(ns, "brief", fake_job(steps=2, run_policy={"ttlSecondsAfterFinished": 3}))
    cluster.wait_phase(ns, "brief", "Succeeded", 30)
    time.sleep(1)  # within the TTL: the job and its completed pods (their logs) are kept
    assert cluster.job(ns, "brief") is not None and len(cluster.pods(ns)) == 2
    wait_for(lambda: cluster.job(ns, "brief") is None, 30, "the job to be deleted after its TTL")
    # Kubernetes' garbage collector removes the gang; it watches a CRD's kind from its next discovery (every 30 s)
    wait_for(lambda: not cluster.pods(ns) and not cluster.api.objects("v1/configmaps", ns), 60, "the gang to go")
