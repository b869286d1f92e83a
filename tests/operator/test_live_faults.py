"""Operator faults (issue 5, part 2) on the real control plane, with the test kubelet and the stand-in trainer:
the operator talks to the API server through the fault proxy (support/fault_proxy.py), which answers chosen
requests with errors, holds them, and drops, silences or expires watch streams, while the tests and the kubelet
talk to the API server directly. API errors on creates and status patches, a deleted job (at once re-created
under its name), a finished job poked by every trigger a pass has, dropped, expired and silent watch streams, a
gang the API server rejects. docs/reliability.md maps each fault to its test; the operator-restart faults are in
test_live_operator_restart.py, a deleted or evicted pod in test_live.py.

One cluster (and operator, resync every second) serves this module; each test uses its own namespace.
"""

from __future__ import annotations

import signal
import time
from datetime import datetime
from collections.abc import Iterator

import pytest

from paratrain.api import API_GROUP, API_VERSION
from paratrain_operator import rbac

from ..support.control_plane import ControlPlane
from .support.cluster import JOBS, condition, fake_job, fake_trainer_command
from .support.real_cluster import RealCluster, install_crd, resource_path
from .support.server import wait_for

pytestmark = pytest.mark.timeout(180)

# Volcano's PodGroup, served as its CRD would serve it: a gang-scheduled job's objects include one.
VOLCANO_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "podgroups.scheduling.volcano.sh"},
    "spec": {"group": "scheduling.volcano.sh", "scope": "Namespaced",
             "names": {"plural": "podgroups", "singular": "podgroup", "kind": "PodGroup", "shortNames": ["pg"]},
             "versions": [{"name": "v1beta1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object",
                                                          "x-kubernetes-preserve-unknown-fields": True}}}]},
}
PODGROUPS = "scheduling.volcano.sh/v1beta1/podgroups"
GANG_KINDS = ("configmaps", "services", "podgroups", "pods")


@pytest.fixture(scope="module")
def cluster(control_plane, tmp_path_factory: pytest.TempPathFactory):
    install_crd(control_plane)
    install_crd(control_plane, VOLCANO_CRD)
    wait_until_collected(control_plane)
    c = RealCluster(control_plane, tmp_path_factory.mktemp("cluster"), command=fake_trainer_command,
                    node="faults-node", faults=True)
    yield c
    c.close()
    assert not c.proxy.internal_errors, c.proxy.internal_errors
    allowed = {(group, resource, verb) for group, resource, verbs in (*rbac.RULES, *rbac.CLUSTER_RULES)
               for verb in verbs}
    assert c.api_calls() <= allowed, sorted(c.api_calls() - allowed)  # faults take no extra rights


def wait_until_collected(plane: ControlPlane) -> None:
    """Kubernetes' garbage collector watches a kind only from its next discovery after the CRD (every 30 s): until
    then a deleted job's PodGroup would stay. A PodGroup owned by a job (no operator runs yet) is collected once it
    watches both."""
    api, ns = plane.api, plane.create_namespace("gc-probe")
    job = api.must(api.create(resource_path(JOBS, ns), {"apiVersion": f"{API_GROUP}/{API_VERSION}",
                                                        "kind": "ParallelTrainJob", "metadata": {"name": "probe"},
                                                        "spec": fake_job()}))
    owner = {"apiVersion": job["apiVersion"], "kind": job["kind"], "name": "probe", "uid": job["metadata"]["uid"]}
    api.must(api.create(resource_path(PODGROUPS, ns), {"apiVersion": "scheduling.volcano.sh/v1beta1",
                                                       "kind": "PodGroup",
                                                       "metadata": {"name": "probe", "ownerReferences": [owner]}}))
    api.must(api.request("DELETE", resource_path(JOBS, ns, "probe")))
    wait_for(lambda: api.get(resource_path(PODGROUPS, ns, "probe")).status == 404, 90,
             "the garbage collector to watch jobs and PodGroups", interval=0.5)


def gang_objects(cluster: RealCluster, ns: str, job: str) -> set[tuple[str, str]]:
    """(resource, name) of every object in `ns` labelled with the job's name or owned by any job of that name."""
    out = set()
    for plural in GANG_KINDS:
        resource = PODGROUPS if plural == "podgroups" else f"v1/{plural}"
        for obj in cluster.api.objects(resource, ns):
            meta = obj["metadata"]
            if (meta.get("labels") or {}).get("paratrain.dev/job-name") == job or any(
                    ref.get("kind") == "ParallelTrainJob" and ref.get("name") == job
                    for ref in meta.get("ownerReferences") or []):
                out.add((plural, meta["name"]))
    return out


def creations(cluster: RealCluster, ns: str) -> dict[str, list[str]]:
    return {plural: cluster.creations(ns, plural) for plural in GANG_KINDS}


# ---- API errors ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("code", [500, 429, 409])
def test_api_errors_on_creates_and_status_patches_are_retried_and_lose_nothing(cluster: RealCluster, ns: str,
                                                                               code: int):
    """500 and 429 (with Retry-After: 1): the status patch fails 4 times in a row, more than the client's
    in-place retries (3), so the whole pass fails and is redone later; each create (ConfigMap, Service, pod)
    fails twice. 409: the status patch conflicts, and each create answers "already exists" although nothing
    exists: a create must be checked, not assumed done (each failed pass is redone after kopf's backoff)."""
    name = f"api-{code}"
    retry_after = 1 if code == 429 else None

    def inject(method: str, path: str, times: int):
        return cluster.proxy.inject(method, path, status=code, times=times, retry_after=retry_after)

    # 409: the Service's second 409 lands in the pass that creates the last pod, after which no pass would
    # create it again: a 409 taken for "exists" would lose it for good.
    patches, configmaps, services, pods = (1, 1, 2, 1) if code == 409 else (4, 2, 2, 2)
    faults = {"status patch": inject("PATCH", rf"/namespaces/{ns}/paralleltrainjobs/{name}/status$", patches),
              "ConfigMap create": inject("POST", rf"/namespaces/{ns}/configmaps$", configmaps),
              "Service create": inject("POST", rf"/namespaces/{ns}/services$", services),
              "pod create": inject("POST", rf"/namespaces/{ns}/pods$", pods)}
    cluster.submit(ns, name, fake_job(steps=10))
    status = cluster.wait_phase(ns, name, "Succeeded", 60)

    assert {what: f.faulted for what, f in faults.items()} == {what: f.times for what, f in faults.items()}
    if code != 409:  # retried with backoff (0.5 s, 1 s, 2 s; at least Retry-After), never hammered
        least = 0.95 if code == 429 else 0.45
        for what, fault in faults.items():
            gaps = [round(b - a, 2) for a, b in zip(fault.faulted_at, fault.faulted_at[1:])]
            assert min(gaps) >= least, f"{what} retried after {gaps} s"
    # Nothing lost, nothing twice: each object of the gang created exactly once, and still there.
    gang = creations(cluster, ns)
    assert gang == {"configmaps": [f"{name}-spec"], "services": [name], "podgroups": [],
                    "pods": [f"{name}-0-0", f"{name}-0-1"]}
    assert gang_objects(cluster, ns, name) == {(plural, n) for plural, names in gang.items() for n in names}
    # The status is right in the end: every field the faults could have left stale or lost.
    assert (status["restarts"], status["attempt"], status["gangCreated"]) == (0, 0, True)
    assert status["pods"] == {"expected": 2, "pending": 0, "running": 0, "succeeded": 2, "failed": 0,
                              "terminating": 0}
    assert status["progress"]["step"] == 10 and status["progressText"] == "10/10" and "failure" not in status
    assert condition(status, "Succeeded")["status"] == "True" and condition(status, "Running")["status"] == "False"
    assert status["observedGeneration"] == 1 and status["startTime"] <= status["completionTime"]
    reasons = cluster.event_reasons(ns, name, until="Succeeded")
    assert reasons[-1] == "Succeeded" and reasons.count("Succeeded") == 1 and "GangRunning" in reasons
    if code == 409:  # a name held by something else is a refusal the user sees, then retried; 5xx/429 are not
        assert set(reasons) == {"CreatingGang", "FailedCreate", "GangRunning", "Succeeded"}, reasons
        assert condition(status, "CreateRefused")["status"] == "False"
    else:
        assert set(reasons) == {"CreatingGang", "GangRunning", "Succeeded"}, reasons
        assert condition(status, "CreateRefused") is None


def test_a_webhook_that_cannot_be_reached_is_named_at_once_and_retried_with_backoff(cluster: RealCluster, ns: str):
    """Issue 42: every pod create answered 500 "failed calling webhook" (a mutating webhook whose service is down)
    for 16 s. The client's own retries (3) are spent, so the pass's create is refused: a FailedCreate Event and
    the status's message name the webhook within one pass, and the next tries come further and further apart
    (1, 2, 4 ... s after each refusal, not every pass). Once the webhook is back, the job succeeds."""
    webhook = ('Internal error occurred: failed calling webhook "inject.sidecar.example.com": failed to call '
               'webhook: Post "https://sidecar.sidecar-system.svc:443/inject": dial tcp 10.96.0.42:443: connect: '
               'connection refused')
    down = cluster.proxy.inject("POST", rf"/namespaces/{ns}/pods$", status=500, times=None, message=webhook)
    cluster.submit(ns, "hooked", fake_job(steps=3))
    refused = wait_for(lambda: (c := condition(cluster.status(ns, "hooked"), "CreateRefused")) and c, 15,
                       "the refusal in the job's status")
    assert refused["status"] == "True" and f"Pod {ns}/hooked-0-0" in refused["message"]
    assert "failed calling webhook" in cluster.status(ns, "hooked")["message"]
    cluster.event_reasons(ns, "hooked", until="FailedCreate")
    event = next(e for e in cluster.events(ns, "hooked") if e["reason"] == "FailedCreate")
    assert event["type"] == "Warning" and "inject.sidecar.example.com" in event["message"]
    time.sleep(16 - (time.monotonic() - down.faulted_at[0]))
    down.times = down.faulted  # the webhook is back
    status = cluster.wait_phase(ns, "hooked", "Succeeded", 90)
    assert (status["restarts"], status["attempt"]) == (0, 0) and condition(status, "CreateRefused")["status"] == "False"
    assert cluster.pod_creations(ns) == ["hooked-0-0", "hooked-0-1"]
    # Each pass's try is a burst of four requests (the client's and its three retries, 0.5, 1 and 2 s apart);
    # between bursts the backoff doubles, so the bursts come further and further apart, never every pass (the
    # resync here runs every second).
    assert down.faulted % 4 == 0, down.faulted_at
    starts = down.faulted_at[::4]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 3 and all(later - earlier >= 0.7 for earlier, later in zip(gaps, gaps[1:])), gaps


# ---- a deleted job, a finished job ------------------------------------------------------------------------

def schedule_as_volcano(cluster: RealCluster, ns: str, job: str, nodes: int) -> None:
    """What Volcano does once every pod of the gang exists (no Volcano runs here): bind them all."""
    pods = wait_for(lambda: len(found := cluster.pods(ns, job)) == nodes and found, 30, "the gang's pods")
    for pod in pods:
        assert pod["spec"]["schedulerName"] == "volcano" and not pod["spec"].get("nodeName")
        cluster.bind(ns, pod["metadata"]["name"])


def test_deleting_a_job_mid_training_removes_every_object_of_its_gang(cluster: RealCluster, ns: str):
    cluster.submit(ns, "gone", {**fake_job(steps=100), "scheduling": {"gang": "volcano"}})
    schedule_as_volcano(cluster, ns, "gone", nodes=2)
    cluster.wait_phase(ns, "gone", "Running", 30)
    gang = gang_objects(cluster, ns, "gone")
    assert {plural for plural, _ in gang} == set(GANG_KINDS), gang  # ConfigMap, Service, PodGroup, pods
    created = creations(cluster, ns)
    cluster.api.delete(JOBS, ns, "gone")
    wait_for(lambda: not gang_objects(cluster, ns, "gone"), 15, "every object of the gang to be collected")
    wait_for(lambda: not [p for p in cluster.api.call(cluster.kubelet.running) if p.startswith(f"{ns}/")], 10,
             "the gang's processes to end")
    time.sleep(1.5)  # the pod events of the collection have been handled: nothing came back
    assert creations(cluster, ns) == created and not gang_objects(cluster, ns, "gone")


def test_a_job_recreated_at_once_under_its_name_starts_clean(cluster: RealCluster, ns: str):
    """`kubectl delete` then `kubectl apply` of the same job while the old gang is still terminating (its pods
    frozen, so they take their grace period): the new job is not confused by the old job's pods."""
    cluster.submit(ns, "again", fake_job(steps=100))
    cluster.wait_phase(ns, "again", "Running", 30)
    for rank in (0, 1):
        cluster.api.call(cluster.kubelet.pause, ns, f"again-0-{rank}")
    cluster.api.delete(JOBS, ns, "again")
    wait_for(lambda: cluster.job(ns, "again") is None, 10, "the job to go (it carries no finalizer)")
    # The old gang: still there, terminating (the garbage collector deletes it once it sees the job go).
    wait_for(lambda: any(p["metadata"].get("deletionTimestamp") for p in cluster.pods(ns)), 5,
             "the old gang to be terminating")
    uid = cluster.submit(ns, "again", fake_job(steps=5))["metadata"]["uid"]
    status = cluster.wait_phase(ns, "again", "Succeeded", 60)
    assert (status["restarts"], status["attempt"]) == (0, 0) and "failure" not in status, status
    assert cluster.event_reasons(ns, "again").count("RestartingGang") == 0
    for pod in cluster.pods(ns, "again"):  # the pods now there are the new job's
        assert [ref["uid"] for ref in pod["metadata"]["ownerReferences"]] == [uid]


@pytest.mark.parametrize("end", ["Succeeded", "Failed"])
def test_a_finished_job_is_never_given_new_pods(cluster: RealCluster, ns: str, end: str):
    """Every trigger of a pass, after the end: its pods deleted (by hand, or by the pod garbage collector), a spec
    change. And a finished job costs nothing: no resync passes, no API requests."""
    name = end.lower()
    spec = fake_job(steps=3) if end == "Succeeded" else fake_job(steps=100, exit_code=127, exit_step=1, exit_rank=1)
    cluster.submit(ns, name, spec)
    before = cluster.wait_phase(ns, name, end, 30)

    def stopped() -> bool:  # and not being deleted: a pod the operator stops when the job fails then goes
        return all(p["status"].get("phase") in ("Succeeded", "Failed") and not p["metadata"].get("deletionTimestamp")
                   for p in cluster.pods(ns))
    wait_for(stopped, 15, "the job's pods to have stopped")
    time.sleep(1)  # the passes the last pod events asked for are over
    passes, requests = cluster.passes(ns, name), len(cluster.operator_requests())
    time.sleep(3 * cluster.resync_seconds + 1)
    assert cluster.passes(ns, name) == passes  # no resync of a finished job (it has no TTL)
    assert not [r for r in cluster.operator_requests()[requests:] if f"/namespaces/{ns}/" in r[1]]

    created, reasons = creations(cluster, ns), cluster.event_reasons(ns, name)
    for pod in cluster.pods(ns):
        cluster.api.delete("v1/pods", ns, pod["metadata"]["name"], gracePeriodSeconds=0)
    wait_for(lambda: cluster.passes(ns, name) >= passes + 1, 15, "a pass for the pods' deletion")
    cluster.api.patch(JOBS, ns, name, {"spec": {"runPolicy": {"backoffLimit": 7}}})
    wait_for(lambda: cluster.passes(ns, name) >= passes + 2, 15, "a pass for the spec change")
    time.sleep(0.5)
    assert creations(cluster, ns) == created and cluster.pods(ns) == []
    after = cluster.status(ns, name)
    assert {k: after.get(k) for k in ("phase", "attempt", "restarts", "completionTime", "failure")} == \
        {k: before.get(k) for k in ("phase", "attempt", "restarts", "completionTime", "failure")}
    assert cluster.event_reasons(ns, name) == reasons  # not even a CreatingGang Event


# ---- dropped watch streams --------------------------------------------------------------------------------

def open_watches(cluster: RealCluster) -> set[str]:
    """The resources the operator is watching right now (its streams still open)."""
    return {where.partition("?")[0].rsplit("/", 1)[-1] for _, where, status, *_ in cluster.operator_requests()
            if status is None and "watch=true" in where}


@pytest.fixture
def without_resync(cluster: RealCluster) -> Iterator[RealCluster]:
    """The module's operator restarted with a resync of an hour, then again as it was."""
    def restart(resync_seconds: float) -> None:
        cluster.kill_operator()
        cluster.resync_seconds = resync_seconds
        cluster.start_operator()
    resync = cluster.resync_seconds
    restart(3600)
    yield cluster
    restart(resync)


def test_pod_changes_after_dropped_watches_are_acted_on(without_resync: RealCluster, ns: str):
    """An operator without a resync (an hour): only its watches can tell it what happens. Every stream is
    dropped (as by a load balancer or an API server going away), twice, and pods change while it reconnects:
    it resumes from the last resourceVersion it saw and misses nothing."""
    c = without_resync
    watched = lambda: {"pods", "paralleltrainjobs"} <= open_watches(c)  # noqa: E731
    c.submit(ns, "drop", fake_job(steps=30))
    c.wait_phase(ns, "drop", "Running", 30)
    wait_for(watched, 10, "the operator's watches")
    assert c.proxy.drop_watches() >= 2
    c.api.call(c.kubelet.kill, ns, "drop-0-1", signal.SIGKILL)
    status = wait_for(lambda: (s := c.status(ns, "drop")).get("restarts") == 1 and s, 15,
                      "the failure to be acted on")
    assert status["failure"]["pod"] == "drop-0-1"
    wait_for(watched, 10, "the operator to watch again")
    assert c.proxy.drop_watches() >= 2  # again, while the new gang starts
    c.wait_phase(ns, "drop", "Succeeded", 30)
    assert c.pod_creations(ns) == ["drop-0-0", "drop-0-1", "drop-1-0", "drop-1-1"]


def test_pods_gone_while_the_watch_history_expired_are_noticed_by_the_resync(cluster: RealCluster, ns: str):
    """An API server restart whose watch cache moved on: every stream ends, resuming answers 410 Gone and the
    operator must list again. The whole gang is force-deleted while the operator's next pods request is held, so
    what it sees next shows no pods and no event will ever say they went: the resync notices the gang is gone and
    restarts it."""
    cluster.submit(ns, "relist", fake_job(steps=30))
    cluster.wait_phase(ns, "relist", "Running", 30)
    wait_for(lambda: {"pods", "paralleltrainjobs"} <= open_watches(cluster), 10, "the operator's watches")
    held = cluster.proxy.inject("GET", r"^/api/v1/pods$", status=None, hold=True)  # kopf's pods watch or list
    cluster.api.create("v1/configmaps", {"metadata": {"name": "later"}}, ns)  # history moves past the operator's
    assert cluster.proxy.drop_watches(expire_history=True) >= 2
    # kopf (1.45) resumes a dropped stream from the last resourceVersion it saw and lists only after a 410, so the
    # request held is the resumed watch; its 410 comes after the deletion, and so does the list.
    wait_for(lambda: held.faulted, 10, "the operator to ask for pods again")
    for rank in (0, 1):
        cluster.api.delete("v1/pods", ns, f"relist-0-{rank}", gracePeriodSeconds=0)
    held.release()
    wait_for(lambda: cluster.proxy.expired_watches, 10, "a resumed watch to be refused (410)")
    status = cluster.wait_phase(ns, "relist", "Succeeded", 60)
    # Deleted from outside: a stop (restarted once, not counted against backoffLimit).
    assert (status["attempt"], status["restarts"], status["lastStop"]["reason"]) == (1, 0, "PodDeleted")
    assert "failure" not in status  # a stop is not a failure
    assert cluster.pod_creations(ns) == ["relist-0-0", "relist-0-1", "relist-1-0", "relist-1-1"]


def test_a_gang_the_api_server_rejects_fails_the_job_visibly(cluster: RealCluster, ns: str):
    rejected = cluster.proxy.inject("POST", rf"/namespaces/{ns}/pods$", status=422, after=1, times=None)
    cluster.submit(ns, "refused", fake_job(steps=50))
    status = cluster.wait_phase(ns, "refused", "Failed")
    assert status["reason"] == "RejectedByAPI" and "injected fault" in status["message"]
    wait_for(lambda: not cluster.pods(ns), 15, "the half-created gang to be stopped")
    assert rejected.faulted == 1  # not retried: the same object would be rejected again
    cluster.proxy.faults.remove(rejected)


def test_a_quota_smaller_than_the_gang_is_named_at_once_and_ends_the_attempt_at_its_start_timeout(
        cluster: RealCluster, ns: str):
    """Issue 26: a ResourceQuota of 2 pods (enforced: the control plane runs the resource-quota controller) and a
    4-pod job. The refused create is a FailedCreate Event and the CreateRefused condition within one pass; at
    startTimeoutSeconds the attempt ends with that reason, its pods are deleted and no restart is counted."""
    cluster.api.create("v1/resourcequotas", {"metadata": {"name": "two-pods"}, "spec": {"hard": {"pods": "2"}}}, ns)
    wait_for(lambda: (cluster.api.object("v1/resourcequotas", ns, "two-pods").get("status") or {}).get("hard"), 30,
             "the resource-quota controller to take up the quota")
    submitted = time.monotonic()
    cluster.submit(ns, "quota", {**fake_job(nodes=4, steps=1000),
                                 "scheduling": {"startTimeoutSeconds": 30, "startAttempts": 1}})
    refused = wait_for(lambda: (c := condition(cluster.status(ns, "quota"), "CreateRefused")) and c, 15,
                       "the refusal in the job's status")
    assert refused["status"] == "True" and refused["reason"] == "FailedCreate"
    assert "exceeded quota: two-pods" in refused["message"] and f"Pod {ns}/quota-0-" in refused["message"]
    assert "cannot create" in cluster.status(ns, "quota")["message"]
    cluster.event_reasons(ns, "quota", until="FailedCreate")
    event = next(e for e in cluster.events(ns, "quota") if e["reason"] == "FailedCreate")
    assert event["type"] == "Warning" and "exceeded quota" in event["message"]
    status = cluster.wait_phase(ns, "quota", "Failed", 60)
    assert time.monotonic() - submitted < 60
    # The bound itself, on the status's own clock (whole seconds: a wall clock started here can read 29.8 s).
    waited = datetime.fromisoformat(status["completionTime"]) - datetime.fromisoformat(status["attemptStartTime"])
    assert 30 <= waited.total_seconds() < 60, status
    assert (status["reason"], status["failure"]["reason"], status["restarts"]) == ("StartTimeout", "FailedCreate", 0)
    assert "exceeded quota" in status["failure"]["message"] and "startTimeoutSeconds" in status["message"]
    wait_for(lambda: not cluster.pods(ns, "quota"), 30, "the partly created gang to be released")
    assert len(cluster.pod_creations(ns)) == 2  # the refused pods were never created; the quota held


def test_a_gang_that_cannot_all_be_placed_is_started_afresh_then_fails_at_the_start_timeout(cluster: RealCluster,
                                                                                            ns: str):
    """The job's pods can never be scheduled (no node has the label): at startTimeoutSeconds the attempt ends,
    its pods are deleted and the gang is created afresh (startAttempts: 2, no restart counted); at the second
    timeout the job fails with the scheduler's reason, Unschedulable, and its pods are deleted."""
    spec = {**fake_job(steps=1000), "scheduling": {"startTimeoutSeconds": 30, "startAttempts": 2,
                                                  "nodeSelector": {"paratrain.dev/nowhere": "true"}}}
    cluster.submit(ns, "unplaced", spec)
    status = cluster.wait_phase(ns, "unplaced", "Failed", 110)
    assert (status["reason"], status["failure"]["reason"], status["restarts"]) == ("StartTimeout", "Unschedulable", 0)
    assert (status["attempt"], status["startTimeouts"]) == (1, 1) and status["lastStop"]["reason"] == "Unschedulable"
    assert "2 Unschedulable" in status["message"] and "startAttempts (2) spent" in status["message"]
    wait_for(lambda: not cluster.pods(ns, "unplaced"), 30, "the unplaced gang to be deleted")
    wait_for(lambda: cluster.event_reasons(ns, "unplaced").count("StartTimeout") == 2, 15, "both StartTimeout Events")
    assert cluster.pod_creations(ns) == ["unplaced-0-0", "unplaced-0-1", "unplaced-1-0", "unplaced-1-1"]


def test_pod_changes_missed_by_a_silent_watch_are_still_acted_on(cluster: RealCluster, ns: str):
    cluster.submit(ns, "deaf", fake_job(steps=40))
    cluster.wait_phase(ns, "deaf", "Running", 30)
    assert cluster.proxy.mute_watches("v1/pods") >= 1
    time.sleep(1)  # passes that pod events from before the mute started are over: none will see the kill
    cluster.api.call(cluster.kubelet.kill, ns, "deaf-0-0")
    status = wait_for(lambda: (s := cluster.status(ns, "deaf")).get("restarts") == 1 and s, 30,
                      "the silent stream to be cut and resumed, and the failure noticed")
    assert status["failure"]["pod"] == "deaf-0-0"
    cluster.proxy.drop_watches()  # reconnects get unmuted streams
    cluster.wait_phase(ns, "deaf", "Succeeded", 60)


def test_a_tenants_oversized_pod_does_not_stop_pod_tracking(cluster: RealCluster, ns: str):
    """A plain pod carrying the job label, whose argument holds 400 KB of '<' (escaped by the API server as
    \\u003c: a 2.4 MB watch event). aiohttp's line reader raised LineTooLong past 2 MiB, the informer task ended
    silently, and from then on no job's pods were tracked: this job, submitted after it, stayed Pending."""
    cluster.api.create("v1/pods", {
        "metadata": {"name": "oversized", "labels": {"paratrain.dev/job-name": "not-a-job"}},
        "spec": {"nodeSelector": {"paratrain.dev/nowhere": "true"},  # never scheduled, never run
                 "containers": [{"name": "c", "image": "busybox", "args": ["<" * 400_000]}]}}, ns)
    cluster.api.patch("v1/pods", ns, "oversized", {"metadata": {"annotations": {"touched": "1"}}})  # a MODIFIED
    cluster.submit(ns, "tracked", fake_job(steps=20))
    cluster.wait_phase(ns, "tracked", "Succeeded", 60)
    assert "pods informer" not in cluster.operator_log.read_text(errors="replace")  # no error, nothing skipped


@pytest.fixture
def two_namespaces_one_refused(cluster: RealCluster, ns: str) -> Iterator[tuple[str, str]]:
    """The module's operator restarted to serve `ns` and a namespace whose pods the proxy refuses to list (403, as
    a namespaced install missing one RoleBinding does), then again as it was."""
    locked = cluster.namespace(f"{ns[:55]}-lock")
    refusal = cluster.proxy.inject("GET", rf"/namespaces/{locked}/pods$", status=403, times=None)
    cluster.kill_operator()
    cluster.operator_args = ("--namespace", ns, "--namespace", locked)
    cluster.start_operator()
    yield ns, locked
    refusal.times = 0
    cluster.kill_operator()
    cluster.operator_args = ()
    cluster.start_operator()


def test_a_namespace_the_operator_may_not_list_stops_only_its_own_jobs(cluster: RealCluster,
                                                                        two_namespaces_one_refused: tuple[str, str]):
    """Before, the pod cache waited for every namespace's first list: one refused namespace kept every job of
    every namespace Pending, and the liveness probe restarted the operator every five minutes to no avail."""
    ns, locked = two_namespaces_one_refused
    cluster.submit(locked, "waits", fake_job(steps=5))
    cluster.submit(ns, "runs", fake_job(steps=5))
    cluster.wait_phase(ns, "runs", "Succeeded", 60)
    cluster.event_reasons(locked, "waits", until="PodsNotListed", timeout=30)
    message = next(e["message"] for e in cluster.events(locked, "waits") if e["reason"] == "PodsNotListed")
    assert f"may not list pods in namespace {locked} (403" in message, message
    assert cluster.pod_creations(locked) == []  # nothing done on a cache that cannot hold its pods
    assert cluster._operator is not None and cluster._operator.healthy()
