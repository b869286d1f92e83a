"""Status building as tables: gang state + pods + progress + time → status object and merge patch."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from paratrain.api.status import JobStatus
from paratrain_operator import status
from paratrain_operator.clock import to_iso
from paratrain_operator.gang import Failure, GangState
from paratrain_operator.observe import PodView

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc)
RUNNING = GangState(phase="Running", reason="GangRunning", message="all 2 pods running", gang_created=True,
                    start_time=to_iso(NOW - timedelta(hours=1)))
PODS = [PodView(name="j-0-0", attempt=0, rank=0, phase="Running"), PodView(name="j-0-1", attempt=0, rank=1,
                                                                          phase="Running")]


def build(prev=None, state=RUNNING, progress=None, now=NOW, pods=PODS, stall_timeout=600):
    return status.build(prev, state, nodes=2, pods=pods, progress=progress, stall_timeout=stall_timeout,
                        generation=3, layout="data 2 × tensor 1 × pipeline 1, fp32", now=now)


def condition(st, type_):
    return next(c for c in st["conditions"] if c["type"] == type_)


def test_a_running_job_reports_everything_the_printer_columns_need():
    st = build(progress={"step": 40, "totalSteps": 100, "loss": 2.5})
    assert st["phase"] == "Running" and st["layout"] == "data 2 × tensor 1 × pipeline 1, fp32" and st["observedGeneration"] == 3
    assert st["progressText"] == "40/100" and st["progress"]["loss"] == 2.5 and st["restarts"] == 0
    assert st["pods"] == {"expected": 2, "pending": 0, "running": 2, "succeeded": 0, "failed": 0, "terminating": 0}
    assert condition(st, "Running")["status"] == "True"
    JobStatus.model_validate(st)  # the CRD's status schema would keep every field


@pytest.mark.parametrize("state, shown", [
    (RUNNING, "0"),
    (GangState(phase="Running", restarts=1, in_place_restarts=2), "1 (2 in place)"),
    (GangState(phase="Running", pod_replacements=1, uncounted_restarts=3), "0 (1 pod replaced, 3 stops)"),
])
def test_kubectl_get_shows_restarts_of_every_kind(state, shown):
    """Issue 46: after a killed rank and a replaced pod RESTARTS said 0; only STEP going backwards told."""
    assert build(state=state)["restartsText"] == shown


def test_kubectl_get_shows_the_loss_to_four_digits_whole_tokens_an_eta_and_a_failure_only_when_failed():
    running = build(progress=status.clean_progress({"step": 40, "totalSteps": 100, "loss": 2.719734,
                                                     "tokensPerSecond": 68807.250277, "etaSeconds": 750.4}))
    assert running["lossText"] == "2.720" and running["progress"]["tokensPerSecond"] == 68807
    assert running["eta"] == "12m30s"
    assert build(progress={"step": 1, "totalSteps": 2, "loss": 1.98132})["lossText"] == "1.981"
    failed_before = GangState(phase="Running", restarts=1, failure=Failure(reason="Error", message="exit 1"),
                              last_restart_reason="Error", last_restart_time=to_iso(NOW))
    healthy = build(state=failed_before, progress={"step": 50, "totalSteps": 100, "etaSeconds": 5})
    assert "failureReason" not in healthy  # a running job shows no current failure
    assert (healthy["lastRestartReason"], healthy["lastRestartTime"]) == ("Error", to_iso(NOW))
    done = build(state=GangState(phase="Failed", failure=Failure(reason="OOMKilled", message="...")),
                 progress={"step": 50, "totalSteps": 100, "etaSeconds": 5})
    assert done["failureReason"] == "OOMKilled" and "eta" not in done
    JobStatus.model_validate(healthy)
    JobStatus.model_validate(done)


def test_rebuilding_an_unchanged_status_patches_nothing():
    first = build(progress={"step": 1, "totalSteps": 2})
    assert status.patch(first, build(first, now=NOW + timedelta(seconds=30))) == {}


def test_last_transition_time_moves_only_when_a_condition_flips():
    first = build()
    later = build(first, now=NOW + timedelta(minutes=1))
    assert condition(later, "Running")["lastTransitionTime"] == to_iso(NOW)
    done = build(later, GangState(phase="Succeeded", reason="Succeeded", message="ok"), now=NOW + timedelta(minutes=2))
    assert condition(done, "Running") == {"type": "Running", "status": "False", "reason": "Succeeded",
                                          "message": "the job is Succeeded",
                                          "lastTransitionTime": to_iso(NOW + timedelta(minutes=2))}
    assert condition(done, "Succeeded")["status"] == "True"
    assert "Failed" not in {c["type"] for c in done["conditions"]}  # never true: not listed


def test_conditions_written_by_others_are_kept():
    foreign = {"type": "QuotaReserved", "status": "True", "reason": "Kueue", "message": "",
               "lastTransitionTime": "2026-11-29T10:00:00Z"}
    assert foreign in build({"conditions": [foreign]})["conditions"]


def test_a_silent_running_job_is_stalled():
    running_since_long = build(now=NOW - timedelta(hours=1))
    old = to_iso(NOW - timedelta(seconds=700))
    st = build(running_since_long, progress={"step": 7, "totalSteps": 100, "updatedAt": old})
    stalled = condition(st, "Stalled")
    assert stalled["status"] == "True" and stalled["reason"] == "ProgressStalled"
    assert "last at step 7" in stalled["message"] and "stallTimeoutSeconds (600s)" in stalled["message"]
    assert status.stall_event(running_since_long["conditions"], st["conditions"]).reason == "Stalled"
    fresh = build(st, progress={"step": 8, "totalSteps": 100, "updatedAt": to_iso(NOW)})
    assert condition(fresh, "Stalled")["status"] == "False"
    assert status.stall_event(st["conditions"], fresh["conditions"]).reason == "Progressing"


def test_a_job_that_never_reported_is_stalled_from_when_it_started_running():
    just_running = build(now=NOW)
    assert condition(just_running, "Stalled")["status"] == "False"
    assert status.stall_event([], just_running["conditions"]) is None  # nothing to announce
    assert condition(build(just_running, now=NOW + timedelta(seconds=601)), "Stalled")["status"] == "True"


def test_stalled_is_not_judged_unless_running():
    pending = build(state=GangState(phase="Pending"))
    assert "Stalled" not in {c["type"] for c in pending["conditions"]}
    # A job that ran and then failed is not "stalled" for a reason named Failed: the condition says it is not
    # running, and why it failed stays in the Failed condition.
    failed = build(build(), state=GangState(phase="Failed", reason="BackoffLimitExceeded", message="..."))
    assert {k: condition(failed, "Stalled")[k] for k in ("status", "reason", "message")} == {
        "status": "False", "reason": "NotRunning", "message": "only a running job can stall; this one is Failed"}


def test_failure_and_times_are_reported():
    failed = GangState(phase="Failed", reason="BackoffLimitExceeded", message="m", start_time=to_iso(NOW),
                       completion_time=to_iso(NOW),
                       failure=Failure(reason="Error", message="pod j-0-1 exited with code 137", pod="j-0-1",
                                       exit_code=137))
    st = build(state=failed)
    assert st["failure"] == {"pod": "j-0-1", "exitCode": 137, "reason": "Error",
                             "message": "pod j-0-1 exited with code 137"}
    assert st["completionTime"] == "2026-11-29T12:00:00Z"


def test_the_patch_sets_changes_and_removes_dropped_keys():
    before = {"phase": "Running", "startTime": "x", "restarts": 0, "kopf": {"dummy": 1}}
    after = {"phase": "Suspended", "restarts": 0}
    assert status.patch(before, after) == {"phase": "Suspended", "startTime": None}  # kopf's key left alone


def test_progress_from_a_pod_is_sanitised():
    raw = '{"step": 5, "totalSteps": 10, "loss": NaN, "valLoss": Infinity, "tokensPerSecond": true, ' \
          '"etaSeconds": 12.5, "updatedAt": "2026-11-29T11:00:00+00:00", "phase": "rm -rf", "evil": "x"}'
    assert status.clean_progress(raw) == {"step": 5, "totalSteps": 10, "etaSeconds": 12.5,
                                          "updatedAt": "2026-11-29T11:00:00Z"}
    assert status.clean_progress("not json") is None and status.clean_progress({"loss": 1.0}) is None
    assert status.clean_progress([1, 2]) is None
    assert status.clean_progress("[" * 5000 + "]" * 5000) is None  # a termination message nested deeper than json's stack


def test_in_place_restarts_from_a_pod_are_sanitised_and_fit_the_schema():
    raw = {"step": 5, "restartsInPlace": 2, "lastFailure": {"rank": 3, "nodeRank": 1, "exitCode": 137, "x": "y"}}
    assert status.clean_progress(raw) == {"step": 5, "restartsInPlace": 2,
                                          "lastFailure": {"rank": 3, "nodeRank": 1, "exitCode": 137}}
    hostile = {"step": 5, "restartsInPlace": -1, "etaSeconds": -3.0, "lastFailure": {"rank": True, "exitCode": 1 << 40,
                                                                                     "nodeRank": "0"}}
    assert status.clean_progress(hostile) == {"step": 5}
    assert status.clean_progress({"step": 1 << 70}) is None
    state = GangState(phase="Running", in_place_restarts=3, attempt_in_place_restarts=1)
    built = status.build({}, state, nodes=2, pods=PODS, progress=status.clean_progress(raw), stall_timeout=900,
                         generation=1, layout=None, now=NOW)
    assert (built["inPlaceRestarts"], built["attemptInPlaceRestarts"]) == (3, 1)
    assert built["progress"]["lastFailure"] == {"rank": 3, "nodeRank": 1, "exitCode": 137}


def test_a_field_the_crd_schema_lacks_is_caught_here():
    with pytest.raises(ValidationError):
        status.build(None, GangState(phase="Exploded"), nodes=1, pods=[], progress=None, stall_timeout=10,
                     generation=1, layout=None, now=NOW)


def test_a_1024_pod_gang_waiting_to_be_scheduled_fits_in_status():
    """Every pod Unschedulable with the scheduler's long message: the message summarises by reason, with a count
    and the first pod names, and the status stays far inside its schema (one line per pod made 34 kB at 200 pods,
    past the 32 kB limit, and every reconcile pass then failed before it wrote anything)."""
    from paratrain import contract
    from paratrain_operator import gang

    why = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: " * 3
    pods = [PodView(name=contract.pod_name("big", 0, r), attempt=0, rank=r, phase="Pending",
                    waiting=f"Unschedulable: {why}") for r in range(1020)]
    pods += [PodView(name=contract.pod_name("big", 0, r), attempt=0, rank=r, phase="Pending",
                     waiting="ContainerCreating") for r in range(1020, 1024)]
    decision = gang.decide(gang.Policy(name="big", nodes=1024, backoff_limit=1),
                       GangState(phase="Pending", start_time=to_iso(NOW)), pods, NOW)
    message = decision.state.message
    assert message.startswith("0/1024 pods running (attempt 0); 1020 Unschedulable (big-0-0, big-0-1, big-0-2 and "
                              "1017 more): 0/3 nodes are available"), message
    assert "; 4 ContainerCreating (big-0-1020, big-0-1021, big-0-1022 and 1 more)" in message
    assert len(message) < 1000
    st = status.build(None, decision.state, nodes=1024, pods=pods, progress=None, stall_timeout=600, generation=1,
                      layout="dp1024", now=NOW)
    assert st["phase"] == "Pending" and st["pods"]["pending"] == 1024 and st["message"] == message
    assert len(str(st)) < 4000


def test_every_string_is_clipped_to_its_schema_limit():
    """A pod's termination message is user text of any length: clipped, never a status the schema refuses."""
    huge = "x" * 100_000
    state = GangState(phase="Failed", reason="Error", message=huge,
                      failure=Failure(reason="Error", message=huge, pod="j-0-1"))
    st = build(state=state)
    assert len(st["message"]) == 32768 and st["message"].endswith("…")
    assert len(st["failure"]["message"]) == 32768
    assert len(condition(st, "Failed")["message"]) == 32768
    JobStatus.model_validate(st)


def test_a_native_gang_placed_whole_or_not_is_told_apart_by_its_podgroup():
    placed = {"status": {"conditions": [{"type": "PodGroupInitiallyScheduled", "status": "True"}]}}
    assert status.gang_scheduled(placed, "j-0")[:2] == (True, "ScheduledAsGang")
    # A scheduler without the GenericWorkload gate leaves the group untouched, or the group is gone.
    for group in ({"status": {}}, {"status": {"conditions": [{"type": "PodGroupInitiallyScheduled",
                                                              "status": "False"}]}}, None):
        ok, reason, message = status.gang_scheduled(group, "j-0")
        assert (ok, reason) == (False, "GangNotEnforced") and "j-0" in message and "GenericWorkload" in message


def test_a_job_that_succeeded_without_training_says_so():
    done = GangState(phase="Succeeded", reason="Succeeded", message="all 2 pods succeeded", gang_created=True)
    again = build(state=done, progress={"step": 600, "startStep": 600, "totalSteps": 600, "phase": "done"})
    assert again["message"].startswith("all 2 pods succeeded; nothing was trained: the checkpoint was already at "
                                       "the last step (600)") and again["progress"]["startStep"] == 600
    trained = build(state=done, progress={"step": 600, "startStep": 250, "totalSteps": 600, "phase": "done"})
    assert trained["message"] == "all 2 pods succeeded"
    assert build(state=done, progress={"step": 600, "totalSteps": 600})["message"] == "all 2 pods succeeded"


def test_platform_defaults_are_removed_once_the_platform_fills_nothing():
    """The list was written when a platform's jobDefaults filled fields; dropped from the build, it must be removed
    by the patch (a merge patch only removes a key it names as null)."""
    filled = status.build(None, RUNNING, nodes=2, pods=PODS, progress=None, stall_timeout=600, generation=3,
                          layout=None, now=NOW, platform_defaults=["spec.resources.cpu"])
    assert filled["platformDefaults"] == ["spec.resources.cpu"]
    assert status.patch(filled, build(filled))["platformDefaults"] is None


@pytest.mark.parametrize("parallelism, precision, words", [
    ({"data": 2}, "fp32", "data 2 × tensor 1 × pipeline 1, fp32"),
    ({"data": 2, "tensor": 2, "pipeline": 2, "zeroStage": 1, "microbatches": 2}, "bf16",
     "data 2 × tensor 2 × pipeline 2, ZeRO-1, bf16"),
    ({"data": 2}, {"precision": "bf16", "reducePrecision": "bf16"},
     "data 2 × tensor 1 × pipeline 1, bf16, reduced in bf16"),
])
def test_the_layout_column_is_spelled_out(parallelism, precision, words):
    from paratrain.api import describe_layout, parse_job

    nodes = parallelism.get("data", 1) * parallelism.get("tensor", 1) * parallelism.get("pipeline", 1)
    job = parse_job({"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "j"},
                     "spec": {"nodes": nodes, "parallelism": parallelism,
                              **(precision if isinstance(precision, dict) else {"precision": precision}),
                              "model": {"layers": 2}, "data": {"source": "synthetic"}}})
    assert describe_layout(job.spec) == words
