"""End to end with the real trainer on the real control plane: `kubectl apply` of the CRD and a job → the operator
(as its ServiceAccount) creates the gang → kube-scheduler binds it → each pod runs `paratrain node` (the test
kubelet runs the rendered command as local processes, CPU/gloo) → the job's status tells the truth; and a pod
killed mid-training restarts the whole gang, which resumes from the latest checkpoint (`kubectl logs` shows it).
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from paratrain.api.crd import crd_manifest

from ..reliability.gang import FAULTS
from ..trainer.harness import MUTANTS, run_job
from .support.cluster import ClusterBase as Cluster
from .support.real_cluster import RealCluster
from .support.server import wait_for

pytestmark = pytest.mark.timeout(300)


def tiny_job(name: str, namespace: str, checkpoints: Path, steps: int) -> dict[str, Any]:
    return {
        "apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodes": 2, "procsPerNode": 1, "parallelism": {"data": 2},
            "model": {"layers": 1, "heads": 2, "embedDim": 32, "blockSize": 16, "vocabSize": 64},
            "training": {"steps": steps, "batchSize": 4, "warmupSteps": 1, "evalInterval": steps, "evalSteps": 1},
            "checkpoint": {"path": str(checkpoints), "interval": 10},
            # A vanished peer surfaces within seconds, not the default 10 minutes.
            "runPolicy": {"backoffLimit": 2, "collectiveTimeoutSeconds": 30},
        },
    }


@pytest.fixture
def cluster(control_plane, tmp_path: Path, request: pytest.FixtureRequest):
    c = RealCluster(control_plane, tmp_path, node=f"trainer-node-{abs(hash(request.node.name)) % 10**6}")
    yield c
    c.close()


def apply(cluster: Cluster, doc: dict[str, Any], path: Path) -> str:
    """`kubectl apply`, the server's OpenAPI validation included."""
    path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    result = cluster.kubectl("apply", "-f", str(path))
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_kubectl_applies_a_two_node_job_that_trains_to_success(cluster: Cluster, ns: str, tmp_path: Path):
    assert "customresourcedefinition.apiextensions.k8s.io/paralleltrainjobs.paratrain.dev" in apply(
        cluster, crd_manifest(), tmp_path / "crd.yaml")
    apply(cluster, tiny_job("tiny", ns, tmp_path / "ckpt", steps=12), tmp_path / "job.yaml")

    waited = cluster.kubectl("wait", "-n", ns, "--for=condition=Succeeded", "ptj/tiny", "--timeout=150s",
                            timeout=170)
    assert waited.returncode == 0, f"{waited.stderr}\n{cluster.diagnostics(ns, 'tiny')}"
    assert waited.stdout.strip() == "paralleltrainjob.paratrain.dev/tiny condition met"
    status = cluster.status(ns, "tiny")
    progress = status["progress"]
    assert progress["step"] == progress["totalSteps"] == 12 and progress["phase"] == "done"  # the final report
    assert progress["loss"] > 0 and progress["valLoss"] > 0 and progress["tokensPerSecond"] > 0
    assert status["restarts"] == 0, cluster.diagnostics(ns, "tiny")
    assert status["layout"] == "data 2 × tensor 1 × pipeline 1, fp32"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000010", "step-00000012"]

    table = cluster.kubectl("get", "ptj", "-n", ns)
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "LAYOUT", "STEP", "LOSS", "RESTARTS", "ETA", "AGE"]
    # Four significant digits of loss; no ETA once finished (kubectl leaves the cell empty).
    loss = r"(\d\.\d{3}|\d\d\.\d\d)"
    assert re.match(rf"tiny\s+Succeeded\s+data 2 × tensor 1 × pipeline 1, fp32\s+12/12\s+{loss}\s+0\s+\d+s$", row), row
    events = cluster.kubectl("get", "events", "-n", ns, "--field-selector=involvedObject.kind=ParallelTrainJob",
                             "-o", "json")
    items = sorted(json.loads(events.stdout)["items"], key=lambda e: int(e["metadata"]["resourceVersion"]))
    assert [e["reason"] for e in items] == ["CreatingGang", "GangRunning", "Succeeded"]


def test_a_job_the_trainer_refuses_says_why_in_its_status_and_a_warning_event(cluster: Cluster, ns: str,
                                                                              tmp_path: Path):
    """The data file is missing in the pods, which only the trainer can see: its refusal (the field and the fix)
    reaches status.failure and the Warning Event, not only the pod's log."""
    spec = tiny_job("nodata", ns, tmp_path / "ckpt", steps=5)["spec"]
    spec["data"] = {"source": "text", "path": str(tmp_path / "missing.txt")}
    cluster.submit(ns, "nodata", spec)
    status = cluster.wait_phase(ns, "nodata", "Failed", 120)
    said = f"spec.data.path: {tmp_path / 'missing.txt'}: no such file in this pod or process"
    assert status["failure"]["exitCode"] == 2 and said in status["failure"]["message"], status
    assert status["restarts"] == 0
    wait_for(lambda: any(said in e["message"] for e in cluster.events(ns, "nodata") if e["type"] == "Warning"), 15,
             "a Warning Event with the trainer's words")


def test_a_pod_killed_mid_training_restarts_the_gang_which_resumes_from_its_checkpoint(cluster: Cluster, ns: str,
                                                                                      tmp_path: Path):
    checkpoints = tmp_path / "ckpt"
    cluster.submit(ns, "resume", tiny_job("resume", ns, checkpoints, steps=60)["spec"])
    cluster.wait_phase(ns, "resume", "Running", 90)
    first = checkpoints / "step-00000020" / "manifest.json"
    wait_for(first.exists, 120, "the checkpoint at step 20")
    cluster.api.call(cluster.kubelet.kill, ns, "resume-0-1", signal.SIGKILL)  # the container dies

    status = cluster.wait_phase(ns, "resume", "Succeeded", 180)
    assert (status["restarts"], status["attempt"]) == (1, 1), cluster.diagnostics(ns, "resume")
    assert status["failure"]["pod"] == "resume-0-1" and status["failure"]["exitCode"] == 137
    assert status["progress"]["step"] == 60
    assert cluster.pod_creations(ns) == ["resume-0-0", "resume-0-1", "resume-1-0", "resume-1-1"]
    logs = cluster.kubectl("logs", "-n", ns, "resume-1-0")  # the new gang's rank 0
    resumed = re.search(r"resume step=(\d+)", logs.stdout)
    assert resumed and int(resumed[1]) >= 20, logs.stdout[-3000:]


def test_a_rank_that_cannot_join_fails_the_preflight_fast_and_is_retried_as_infrastructure(control_plane,
                                                                                         tmp_path: Path):
    """Rank 1 never checks in (the trainer's `absent:1` mutant: its pod runs, its worker cannot reach rank 0):
    rank 0's preflight gives up after the job's 5-second bound, names the rank, and exits 75, which the operator
    counts as a retryable failure (a gang restart), never as a permanent one; with the budget spent the job fails
    saying why."""
    mutant = {"PARATRAIN_TEST_MUTANT": "absent:1", "PYTHONPATH": str(MUTANTS)}
    cluster = RealCluster(control_plane, tmp_path, node="preflight-node", extra_env=mutant)
    try:
        ns = cluster.namespace("preflight")
        job = tiny_job("preflight", ns, tmp_path / "ckpt", steps=4)["spec"]
        job["runPolicy"] = {"backoffLimit": 1, "collectiveTimeoutSeconds": 5}
        cluster.submit(ns, "preflight", job)
        status = cluster.wait_phase(ns, "preflight", "Failed", 120)
        assert (status["restarts"], status["failure"]["exitCode"]) == (1, 75), cluster.diagnostics(ns, "preflight")
        assert status["failure"]["pod"] == "preflight-1-0", status  # rank 0 of the last attempt: its preflight
        logs = cluster.kubectl("logs", "-n", ns, "preflight-1-0")
        assert "preflight: rank 0 on " in logs.stdout and "rank(s) 1 of 2 did not reach the rendezvous" in \
            logs.stdout, logs.stdout[-2000:]
    finally:
        cluster.close()


def test_a_stopped_pod_checkpoints_the_step_in_flight_and_the_gang_resumes_there_uncounted(cluster: Cluster, ns: str,
                                                                                          tmp_path: Path):
    """One pod deleted mid-training (what a drain or a Kueue preemption does: its kubelet sends SIGTERM), with
    checkpoints only at the end: its ranks and their peers finish the step, save it together and exit 76; the
    operator restarts the gang without counting it, the new gang resumes at that step, and the whole loss curve is
    the uninterrupted run's."""
    checkpoints = tmp_path / "ckpt"
    spec = tiny_job("stopped", ns, checkpoints, steps=400)["spec"]  # long enough to be stopped mid-run on a busy CPU
    spec["checkpoint"]["interval"] = 0
    cluster.submit(ns, "stopped", spec)
    cluster.wait_phase(ns, "stopped", "Running", 90)
    wait_for(lambda: (cluster.status(ns, "stopped").get("progress") or {}).get("step", 0) >= 10, 120, "step 10")
    cluster.api.delete("v1/pods", ns, "stopped-0-1")

    status = cluster.wait_phase(ns, "stopped", "Succeeded", 180)
    assert (status["restarts"], status["attempt"]) == (0, 1), cluster.diagnostics(ns, "stopped")
    # The stop is kept apart from failures: `kubectl get ptj -o wide` shows no FAILURE for a job that succeeded.
    # Whether the operator sees the deleted pod terminating or already gone, or its exit 76 first.
    assert status["lastStop"]["reason"] in ("Preempted", "PodDeleted") and "failure" not in status, status
    logs = cluster.kubectl("logs", "-n", ns, "stopped-1-0").stdout  # the new gang's rank 0
    resumed = re.search(r"resume step=(\d+)", logs)
    assert resumed and 10 <= int(resumed[1]) < 400, logs[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step-{int(resumed[1]):08d}", "step-00000400"]
    final = json.loads((checkpoints / "step-00000400" / "manifest.json").read_text())
    _, straight = run_job(tmp_path / "straight", job={"apiVersion": "paratrain.dev/v1alpha1",
                                                       "kind": "ParallelTrainJob", "metadata": {"name": "straight"},
                                                       "spec": {**spec, "checkpoint": {}}})
    assert final["losses"] == straight["losses"], "the curve goes on from the stopped step exactly"


def test_a_deleted_pod_is_replaced_alone_while_its_peers_wait_in_place_and_the_curve_goes_on_exactly(
        cluster: Cluster, ns: str, tmp_path: Path):
    """spec.restartPolicy.inPlaceLimit, and pod 1 deleted mid-training (a drain, by hand): its ranks and their peers
    save the step in flight; pod 0's agent restarts its ranks in place, which wait at its rendezvous store; the
    operator recreates only pod 1 (same name, once the old one is gone), whose fresh ranks join them; the gang
    resumes at the saved step, nothing counted, and the whole loss curve is the uninterrupted run's."""
    checkpoints = tmp_path / "ckpt"
    spec = tiny_job("replace", ns, checkpoints, steps=400)["spec"]
    spec["checkpoint"]["interval"] = 0
    spec["restartPolicy"] = {"inPlaceLimit": 2}
    cluster.submit(ns, "replace", spec)
    cluster.wait_phase(ns, "replace", "Running", 90)
    wait_for(lambda: (cluster.status(ns, "replace").get("progress") or {}).get("step", 0) >= 10, 120, "step 10")
    lost_uid = cluster.api.object("v1/pods", ns, "replace-0-1")["metadata"]["uid"]
    cluster.api.delete("v1/pods", ns, "replace-0-1")

    status = cluster.wait_phase(ns, "replace", "Succeeded", 240)
    assert (status["restarts"], status["attempt"], status.get("podReplacements")) == (0, 0, 1), \
        cluster.diagnostics(ns, "replace")
    assert "failure" not in status and status["lastStop"]["pod"] == "replace-0-1", status
    assert cluster.pod_creations(ns) == ["replace-0-0", "replace-0-1", "replace-0-1"]  # pod 1 twice, pod 0 once
    new_uid = cluster.api.object("v1/pods", ns, "replace-0-1")["metadata"]["uid"]
    assert new_uid != lost_uid
    reasons = cluster.event_reasons(ns, "replace", until="Succeeded")
    assert "ReplacingPod" in reasons and "RestartingGang" not in reasons and "Preempted" not in reasons, reasons
    logs = cluster.kubectl("logs", "-n", ns, "replace-0-0").stdout  # rank 0, both rounds, in the same pod
    resumed = re.search(r"resume step=(\d+)", logs)
    assert resumed and 10 <= int(resumed[1]) < 400, logs[-3000:]
    final = json.loads((checkpoints / "step-00000400" / "manifest.json").read_text())
    _, straight = run_job(tmp_path / "straight", job={"apiVersion": "paratrain.dev/v1alpha1",
                                                       "kind": "ParallelTrainJob", "metadata": {"name": "straight"},
                                                       "spec": {**spec, "checkpoint": {}}})
    assert final["losses"] == straight["losses"], "the curve goes on from the saved step exactly"


def assert_the_curve_went_on_exactly(final_checkpoint: Path, spec: dict[str, Any], workdir: Path) -> None:
    """The restarted run's whole loss curve (its final checkpoint's) is the uninterrupted run's, exactly."""
    final = json.loads((final_checkpoint / "manifest.json").read_text())
    _, straight = run_job(workdir, job={"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob",
                                        "metadata": {"name": "straight"}, "spec": {**spec, "checkpoint": {}}})
    assert final["losses"] == straight["losses"], "the curve goes on from the checkpoint exactly"


def test_a_failed_rank_is_restarted_in_place_no_pod_replaced_and_the_curve_goes_on_exactly(control_plane,
                                                                                            tmp_path: Path):
    """spec.restartPolicy.inPlaceLimit: rank 1 exits 1 after step 25 (in the first round only). Its pod's agent
    restarts its worker and rank 0's agent (whose worker saw its peer die) restarts its own, in the same pods; the
    new round resumes from the checkpoint of step 20. The operator creates no pod, counts the restart apart from
    backoffLimit's and names the rank; the whole loss curve is the uninterrupted run's."""
    fault = {"PARATRAIN_TEST_FAULT": "exit_at:1:25:1:1", "PYTHONPATH": str(FAULTS)}
    cluster = RealCluster(control_plane, tmp_path, node="in-place-node", extra_env=fault)
    try:
        ns = cluster.namespace("in-place")
        checkpoints = tmp_path / "ckpt"
        spec = tiny_job("inplace", ns, checkpoints, steps=40)["spec"]
        spec["restartPolicy"] = {"inPlaceLimit": 2}
        cluster.submit(ns, "inplace", spec)
        status = cluster.wait_phase(ns, "inplace", "Succeeded", 240)
        assert (status["restarts"], status["attempt"], status.get("inPlaceRestarts")) == (0, 0, 1), \
            cluster.diagnostics(ns, "inplace")
        assert cluster.pod_creations(ns) == ["inplace-0-0", "inplace-0-1"]  # no pod replaced
        said = ("rank 1 in pod inplace-0-1 exited with code 1 (error); every rank restarted in place, from step 20, "
                "no pod replaced (in-place restart 1 of spec.restartPolicy.inPlaceLimit 2 in attempt 0)")
        assert status["failure"] == {"pod": "inplace-0-1", "exitCode": 1, "reason": "Error", "message": said}
        assert cluster.event_reasons(ns, "inplace", until="Succeeded") == [
            "CreatingGang", "GangRunning", "RestartedInPlace", "Succeeded"]
        logs = cluster.kubectl("logs", "-n", ns, "inplace-0-0").stdout  # rank 0, both rounds
        assert "resume step=20" in logs, logs[-3000:]
        assert_the_curve_went_on_exactly(checkpoints / "step-00000040", spec, tmp_path / "straight")
    finally:
        cluster.close()


def test_a_rank_hung_alive_is_restarted_in_place_within_hang_seconds_and_a_few_more(control_plane, tmp_path: Path):
    """spec.restartPolicy.hangSeconds: rank 1 stops making progress after step 25 but lives, holding the gang
    (rank 0 blocks in an all-reduce whose timeout, 120 s, never comes). An agent sees its rank's heartbeat go stale,
    ends the round in node 0's store, the other agent stops its worker through the store, and the gang resumes
    from step 20 in place within hangSeconds and a few seconds; the operator says so; the curve is exact."""
    hang, events, faults = 10, tmp_path / "events.jsonl", tmp_path / "faults.log"
    env = {"PARATRAIN_TEST_FAULT": "hang_at:1:25", "PYTHONPATH": str(FAULTS), "PARATRAIN_TEST_FAULT_LOG": str(faults),
           "PARATRAIN_EVENTS_FILE": str(events)}  # rank 0's events (only it reports)
    cluster = RealCluster(control_plane, tmp_path, node="hang-node", extra_env=env)
    try:
        ns = cluster.namespace("hang")
        checkpoints = tmp_path / "ckpt"
        spec = tiny_job("hang", ns, checkpoints, steps=40)["spec"]
        spec["runPolicy"]["collectiveTimeoutSeconds"] = 120
        spec["restartPolicy"] = {"inPlaceLimit": 2, "hangSeconds": hang}
        cluster.submit(ns, "hang", spec)
        status = cluster.wait_phase(ns, "hang", "Succeeded", 240)
        assert (status["restarts"], status.get("inPlaceRestarts")) == (0, 1), cluster.diagnostics(ns, "hang")
        assert cluster.pod_creations(ns) == ["hang-0-0", "hang-0-1"]
        assert status["failure"]["exitCode"] == 79 and status["failure"]["message"].startswith(
            "a rank hung: the gang made no progress for spec.restartPolicy.hangSeconds"), status["failure"]
        records = [json.loads(line) for line in events.read_text().splitlines()]
        resumed = next(r for r in records if r["event"] == "start" and r["startStep"] == 20)
        waited = resumed["time"] - float(faults.read_text().split()[0])
        assert hang < waited < hang + 20, waited
        logs = {p: cluster.kubectl("logs", "-n", ns, p).stdout for p in ("hang-0-0", "hang-0-1")}
        saw = [("made no progress for" in text, "ended by another pod" in text) for text in logs.values()]
        # one agent saw the stall and the other stopped its worker through the store; or, a few milliseconds
        # apart, both saw it
        assert sorted(saw) in ([(False, True), (True, False)], [(True, False), (True, False)]), logs
        assert all("the stacks of this pod's workers follow" in text for text in logs.values()), logs
        assert_the_curve_went_on_exactly(checkpoints / "step-00000040", spec, tmp_path / "straight")
    finally:
        cluster.close()


def test_in_place_restarts_past_the_limit_fall_back_to_a_whole_gang_restart(control_plane, tmp_path: Path):
    """inPlaceLimit 1, and rank 1 fails again in the restarted round (5 steps into each, before any checkpoint):
    its agent's budget is spent, so its pod fails with the code and the operator restarts the whole gang
    (counted), whose new pods run clean."""
    fault = {"PARATRAIN_TEST_FAULT": "exit_at:1:5:1:2", "PYTHONPATH": str(FAULTS)}
    cluster = RealCluster(control_plane, tmp_path, node="in-place-limit-node", extra_env=fault)
    try:
        ns = cluster.namespace("in-place-limit")
        spec = tiny_job("limit", ns, tmp_path / "ckpt", steps=40)["spec"]
        spec["restartPolicy"] = {"inPlaceLimit": 1}
        cluster.submit(ns, "limit", spec)
        status = cluster.wait_phase(ns, "limit", "Succeeded", 240)
        # The in-place round may fail before rank 0's first report is read: counted only where it was seen.
        assert (status["restarts"], status["attempt"]) == (1, 1), cluster.diagnostics(ns, "limit")
        assert status.get("inPlaceRestarts", 0) <= 1
        assert status["failure"] == {"pod": "limit-0-1", "exitCode": 1, "reason": "Error",
                                     "message": "pod limit-0-1 exited with code 1 (error)"}
        assert cluster.pod_creations(ns) == ["limit-0-0", "limit-0-1", "limit-1-0", "limit-1-1"]
        reasons = [r for r in cluster.event_reasons(ns, "limit", until="Succeeded") if r != "RestartedInPlace"]
        assert reasons == ["CreatingGang", "GangRunning", "RestartingGang", "CreatingGang", "GangRunning",
                           "TrainingResumed", "Succeeded"]
        said = [e["message"] for e in cluster.events(ns, "limit") if e["reason"] == "TrainingResumed"]
        assert said == ["attempt 1's ranks started from step 0: no checkpoint yet"], said
    finally:
        cluster.close()


def test_a_killed_rank_is_named_as_the_cause_of_every_gang_restart(control_plane, tmp_path: Path):
    """Rank 1's worker SIGKILLed (its agent has no in-place restarts: the pod exits 137), four times: each time rank
    0 sees its peer vanish and its pod exits 75 at about the same moment, and which pod's Failed status reaches the
    operator first varies; on every other kill the killed pod's kubelet reports its exit 3 s late, so the peer's 75
    surely comes first. Every gang restart must name the killed pod and 137, never the peer-failure exit."""
    cluster = RealCluster(control_plane, tmp_path, node="kill-rank-node")
    try:
        ns = cluster.namespace("kill-rank")
        spec = tiny_job("kills", ns, tmp_path / "ckpt", steps=100_000)["spec"]
        spec["runPolicy"]["backoffLimit"] = 5
        cluster.submit(ns, "kills", spec)
        for attempt in range(4):
            def training(attempt: int = attempt) -> bool:
                status = cluster.status(ns, "kills")
                progress = status.get("progress") or {}
                return status.get("attempt", 0) == attempt and status.get("phase") == "Running" and \
                    progress.get("step", 0) > (progress.get("startStep") or 0)
            wait_for(training, 120, f"attempt {attempt} training")
            pod = f"kills-{attempt}-1"
            if attempt % 2 == 0:
                cluster.kubelet.report_exit_late(ns, pod, 3.0)
            # (The status may still show the last attempt's progress: the new worker may not be forked yet.)
            wait_for(lambda p=pod: cluster.api.call(cluster.kubelet.kill_rank, ns, p, 1), 60, f"rank 1 in {pod}")
            status = wait_for(lambda a=attempt: (s := cluster.status(ns, "kills")).get("restarts", 0) > a and s, 60,
                              f"the gang restart after killing rank 1 of {pod}")
            assert (status["failure"]["pod"], status["failure"]["exitCode"]) == (pod, 137), status["failure"]
            restarts = [e["message"] for e in cluster.events(ns, "kills") if e["reason"] == "RestartingGang"]
            assert all("exited with code 137" in m for m in restarts), restarts
    finally:
        cluster.close()
