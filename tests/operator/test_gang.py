"""Gang decisions as tables: observed pods + persisted state + time → decision (no cluster, no operator)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from paratrain import contract
from paratrain.api.spec import FailurePolicyRule
from paratrain_operator import gang, observe
from paratrain_operator.clock import from_iso, to_iso
from paratrain_operator.gang import Failure, GangState, Policy, describe_exit
from paratrain_operator.observe import PodView

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc)
EARLIER = to_iso(NOW - timedelta(minutes=5))
POLICY = Policy(name="job", nodes=3, backoff_limit=2)


def pod(rank: int, phase: str = "Running", attempt: int = 0, **kw) -> PodView:
    return PodView(name=contract.pod_name("job", attempt, rank), attempt=attempt, rank=rank, phase=phase, **kw)


def gang_of(*phases: str, attempt: int = 0, **kw) -> list[PodView]:
    return [pod(r, p, attempt, **kw) for r, p in enumerate(phases)]


RUNNING = GangState(phase="Running", gang_created=True, start_time=EARLIER)


def decide(pods, state=GangState(), policy=POLICY, now=NOW, progress=None):
    return gang.decide(policy, state, pods, now, progress)


def test_a_new_job_creates_every_pod_and_starts_the_clock():
    decision = decide([])
    assert decision.create_ranks == (0, 1, 2) and not decision.delete_pods
    assert decision.state.phase == "Pending" and decision.state.start_time == to_iso(NOW)
    assert [e.reason for e in decision.events] == ["CreatingGang"]


def test_after_an_operator_restart_only_missing_pods_are_created():
    decision = decide(gang_of("Running"))  # created 1 of 3, then the operator died
    assert decision.create_ranks == (1, 2)
    assert not decision.state.gang_created


def test_a_complete_gang_is_remembered_and_runs():
    decision = decide(gang_of("Running", "Running", "Running"), GangState(phase="Pending", start_time=EARLIER))
    assert decision.state.phase == "Running" and decision.state.gang_created
    assert [e.reason for e in decision.events] == ["GangRunning"]
    assert decide(gang_of("Running", "Running", "Running"), decision.state).events == ()  # no repeat Events


def test_pending_pods_keep_the_job_pending_and_say_why():
    decision = decide(gang_of("Running", "Pending", "Running", waiting="ImagePullBackOff: no such image"),
                  GangState(phase="Pending", start_time=EARLIER))
    assert decision.state.phase == "Pending" and not decision.create_ranks
    assert "ImagePullBackOff" in decision.state.message


def test_success_needs_every_pod():
    assert decide(gang_of("Succeeded", "Succeeded", "Running"), RUNNING).state.phase == "Running"
    decision = decide(gang_of("Succeeded", "Succeeded", "Succeeded"), RUNNING)
    assert decision.state.phase == "Succeeded" and decision.state.completion_time == to_iso(NOW)


def test_a_retryable_failure_restarts_the_whole_gang():
    pods = [pod(0), pod(1, "Failed", exit_code=137, reason="Error"), pod(2)]
    decision = decide(pods, RUNNING)
    s = decision.state
    assert (s.phase, s.attempt, s.restarts, s.gang_created) == ("Restarting", 1, 1, False)
    assert s.failure == Failure(reason="Error", message="pod job-0-1 exited with code 137 (killed by SIGKILL)",
                                pod="job-0-1", exit_code=137)
    assert set(decision.delete_pods) == {"job-0-0", "job-0-1", "job-0-2"}  # finished pods too: hostnames are reused
    assert not decision.create_ranks  # the new attempt waits until the old pods are gone
    assert [e.reason for e in decision.events] == ["RestartingGang"]


def test_the_root_cause_is_the_pod_that_failed_not_the_peers_that_noticed():
    pods = [pod(0, "Failed", exit_code=contract.EXIT_RETRYABLE, finished_at="2026-11-29T11:59:02Z"),
            pod(1, "Failed", exit_code=137, finished_at="2026-11-29T11:59:01Z"),
            pod(2, "Failed", exit_code=contract.EXIT_RETRYABLE, finished_at="2026-11-29T11:59:00Z")]
    assert decide(pods, RUNNING).state.failure.pod == "job-0-1"


@pytest.mark.parametrize("consequence", [contract.EXIT_RETRYABLE, contract.EXIT_ABORTED])
def test_a_peer_that_exited_75_or_was_aborted_by_the_nccl_watchdog_is_not_the_cause(consequence):
    """Under NCCL a rank whose peer died is aborted by the watchdog (SIGABRT, 134) rather than exiting 75: the same
    consequence, never named while the pod that really failed is known."""
    pods = [pod(0, "Failed", exit_code=consequence, finished_at="2026-11-29T11:59:00Z"),
            pod(1, "Failed", exit_code=137, finished_at="2026-11-29T11:59:01Z"), pod(2, "Failed", exit_code=consequence)]
    assert decide(pods, RUNNING).state.failure.pod == "job-0-1"


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_the_pod_that_failed_is_named_whichever_pod_is_seen_failed_first(order):
    """Rank 1 killed (137), the others exit 75 (a peer failed) a moment later: the pods' Failed statuses reach the
    operator in any order, one pass per change. Until the killed pod's own failure is seen, a pass that sees only
    peers' 75s waits (a pass is scheduled) rather than restart the gang naming a 75 as the cause."""
    failed = {0: pod(0, "Failed", exit_code=contract.EXIT_RETRYABLE, finished_at=to_iso(NOW - timedelta(seconds=1))),
              1: pod(1, "Failed", exit_code=137, finished_at=to_iso(NOW - timedelta(seconds=2))),
              2: pod(2, "Failed", exit_code=contract.EXIT_RETRYABLE, finished_at=to_iso(NOW - timedelta(seconds=1)))}
    for seen in range(1, 4):
        shown = set(order[:seen])
        decision = decide([failed[r] if r in shown else pod(r) for r in range(3)], RUNNING)
        if 1 in shown:
            break
        assert decision.state == RUNNING and not decision.delete_pods and not decision.events
        assert 0 < decision.pass_after <= gang.CAUSE_WAIT_SECONDS
    failure = decision.state.failure
    assert (decision.state.restarts, failure.pod, failure.exit_code) == (1, "job-0-1", 137), failure
    assert [e.reason for e in decision.events] == ["RestartingGang"] and "job-0-1" in decision.events[0].message


@pytest.mark.parametrize("code", [contract.EXIT_RETRYABLE, contract.EXIT_PREEMPTED])
def test_a_peer_failure_alone_restarts_the_gang_once_the_wait_is_over_saying_so(code):
    """Its failing peer never exits (a hung rank): after CAUSE_WAIT_SECONDS the gang restarts all the same, and the
    message says that no other pod's failure was seen."""
    finished = NOW - timedelta(seconds=gang.CAUSE_WAIT_SECONDS + 1)
    pods = [pod(0, "Failed", exit_code=code, finished_at=to_iso(finished)), pod(1), pod(2)]
    decision = decide(pods, RUNNING)
    assert decision.state.restarts == 1 and decision.state.failure.pod == "job-0-0"
    assert "no other pod's failure was seen" in decision.state.failure.message
    early = decide(pods, RUNNING, now=finished + timedelta(seconds=5))
    assert early.state == RUNNING and early.pass_after == pytest.approx(gang.CAUSE_WAIT_SECONDS - 5)
    # Nobody left running to wait for: decided at once, and its own words kept.
    alone = decide([pod(0, "Failed", exit_code=code, finished_at=to_iso(NOW)), pod(1, "Succeeded"),
                    pod(2, "Succeeded")], RUNNING)
    assert alone.state.restarts == 1 and "no other pod's failure was seen" in alone.state.failure.message


@pytest.mark.parametrize("code", sorted(contract.PERMANENT_EXIT_CODES))
def test_a_permanent_exit_code_fails_the_job_without_a_restart(code):
    decision = decide([pod(0), pod(1, "Failed", exit_code=code), pod(2)], RUNNING)
    assert decision.state.phase == "Failed" and decision.state.restarts == 0 and decision.state.attempt == 0
    assert decision.state.failure.exit_code == code and decision.state.failure.pod == "job-0-1"
    assert set(decision.delete_pods) == {"job-0-0", "job-0-2"}  # a failed job holds no GPUs


@pytest.mark.parametrize("outside", [dict(terminating=True), dict(disrupted=True)])
def test_a_preempted_gang_restarts_without_spending_its_backoff_limit(outside):
    """Exit 76: the ranks were stopped (SIGTERM) and saved the step in flight. With a pod of the gang deleted (a drain,
    Kueue's preemption) or marked DisruptionTarget, the stop came from outside: even with the budget spent the gang
    restarts, and the restart is not counted."""
    spent = replace(RUNNING, restarts=2, attempt=2)
    pods = gang_of("Failed", "Failed", "Running", attempt=2, exit_code=contract.EXIT_PREEMPTED)
    pods[1] = replace(pods[1], **outside)
    decision = decide(pods, spent)
    s = decision.state
    assert (s.phase, s.attempt, s.restarts, s.reason) == ("Restarting", 3, 2, "Preempted")
    assert s.last_stop.reason == "Preempted" and s.failure is None  # a stop is not a failure
    assert "not counted against backoffLimit" in s.message
    assert [e.reason for e in decision.events] == ["Preempted"]
    assert set(decision.delete_pods) == {"job-2-0", "job-2-2"} | (set() if outside.get("terminating") else {"job-2-1"})
    # A real failure beside a preemption is the root cause, and it is counted.
    mixed = [pod(0, "Failed", exit_code=contract.EXIT_PREEMPTED, finished_at="2026-11-29T11:59:00Z", **outside),
             pod(1, "Failed", exit_code=1, finished_at="2026-11-29T11:59:01Z"), pod(2)]
    counted = decide(mixed, RUNNING).state
    assert (counted.restarts, counted.failure.pod, counted.failure.exit_code) == (1, "job-0-1", 1)


@pytest.mark.parametrize("conditions, event, said", [
    ({}, "PodDeleted", "pod job-0-1 was deleted before it finished;"),
    ({"stopped_by": "StoppedByKueue: Preempted to accommodate a higher priority Workload"}, "Preempted",
     "pod job-0-1 was deleted before it finished (StoppedByKueue: Preempted to accommodate a higher priority "
     "Workload);"),
    ({"stopped_by": "EvictionByEvictionAPI: Eviction API: evicting", "disrupted": True}, "Preempted",
     "pod job-0-1 was deleted before it finished (EvictionByEvictionAPI: Eviction API: evicting);"),
])
def test_a_stop_is_named_by_who_stopped_it_and_names_the_deleted_pod_not_its_peers(conditions, event, said):
    """`kubectl delete pod` is a PodDeleted stop, not a preemption; a deleter that said why (a pod condition:
    DisruptionTarget, Kueue's TerminationTarget) is quoted, a Preempted stop. The peers, which saved the step in
    flight and exited 76 earlier than the deleted pod finished, are not named as the cause."""
    pods = [pod(0, "Failed", exit_code=contract.EXIT_PREEMPTED, finished_at="2026-11-29T11:59:00Z"),
            pod(1, terminating=True, finished_at="2026-11-29T11:59:30Z", **conditions),
            pod(2, "Failed", exit_code=contract.EXIT_PREEMPTED, finished_at="2026-11-29T11:59:01Z")]
    decision = decide(pods, RUNNING)
    assert [e.reason for e in decision.events] == [event] and decision.events[0].message.startswith(said)
    assert decision.state.last_stop.pod == "job-0-1" and decision.state.restarts == 0


def test_a_gang_that_stops_itself_is_counted_and_bounded():
    """Exit 76 with nothing stopping the gang from outside (no pod deleted, gone or disrupted: the program sent
    itself SIGTERM, or exits 76 of its own accord) is a failure like any other: counted, and the budget ends it.
    Uncounted, such a job would restart its gang forever."""
    stopped = gang_of("Failed", "Failed", "Failed", exit_code=contract.EXIT_PREEMPTED)
    s = decide(stopped, RUNNING).state
    assert (s.phase, s.restarts, s.failure.reason, s.failure.exit_code) == ("Restarting", 1, "Stopped", 76)
    assert "nothing stopped the gang from outside" in s.failure.message and s.last_stop is None
    spent = decide(gang_of("Failed", "Failed", "Failed", attempt=2, exit_code=contract.EXIT_PREEMPTED),
                   replace(RUNNING, restarts=2, attempt=2)).state
    assert (spent.phase, spent.reason) == ("Failed", "BackoffLimitExceeded")


def test_a_vanished_pod_makes_its_peers_exit_76_a_stop():
    """The drained pod already gone (its deletion finished), its peers saved and exited 76: still a stop."""
    peers = [pod(0, "Failed", exit_code=contract.EXIT_PREEMPTED), pod(2, "Failed", exit_code=contract.EXIT_PREEMPTED)]
    s = decide(peers, replace(RUNNING, restarts=2)).state
    assert (s.phase, s.restarts, s.failure) == ("Restarting", 2, None) and s.last_stop.preempted


def test_the_backoff_limit_ends_the_restarts():
    state = replace(RUNNING, restarts=2, attempt=2)
    decision = decide(gang_of("Running", "Failed", "Running", attempt=2, exit_code=1), state)
    assert decision.state.phase == "Failed" and decision.state.reason == "BackoffLimitExceeded"
    assert decision.state.restarts == 2 and "backoffLimit (2" in decision.state.message


@pytest.mark.parametrize("victim,counted", [
    (dict(phase="Failed", reason="Evicted", message="The node was low on resource: memory."), 1),  # maybe its own
    (dict(phase="Running", terminating=True), 0),  # deleted from outside: a stop
])
def test_evicted_or_deleted_pods_are_retryable_failures(victim, counted):
    decision = decide([pod(0), pod(1, **victim), pod(2)], RUNNING)
    assert decision.state.phase == "Restarting" and decision.state.restarts == counted
    recorded = decision.state.failure if counted else decision.state.last_stop
    assert recorded.pod == "job-0-1"


@pytest.mark.parametrize("seen", [
    dict(phase="Running", terminating=True),
    dict(phase="Failed", terminating=True, exit_code=143, reason="Error"),  # the kubelet's SIGTERM landed first
    dict(phase="Failed", terminating=True, exit_code=137, reason="Error"),  # ... or its SIGKILL
])
def test_a_deleted_pod_is_reported_as_deleted_whichever_state_is_seen(seen):
    """A pod deleted from outside (a drain, a preemption, by hand) is a stop, not the job's failure: the gang
    restarts from its newest checkpoint without spending backoffLimit."""
    state = decide([pod(0), pod(1, **seen), pod(2)], RUNNING).state
    assert (state.last_stop.reason, state.last_stop.message) == ("PodDeleted",
                                                                 "pod job-0-1 was deleted before it finished")
    assert (state.phase, state.attempt, state.restarts) == ("Restarting", 1, 0)


def test_a_pod_that_failed_on_its_own_and_was_then_deleted_keeps_its_own_failure():
    failure = decide([pod(0), pod(1, phase="Failed", terminating=True, exit_code=3), pod(2)], RUNNING).state.failure
    assert (failure.reason, failure.exit_code) == ("Error", 3)


def test_a_pod_that_vanished_from_a_complete_gang_counts_as_deleted():
    decision = decide([pod(0), pod(2)], RUNNING)
    assert decision.state.phase == "Restarting" and decision.state.last_stop.reason == "PodDeleted"
    assert decision.state.last_stop.pod == "job-0-1" and decision.state.restarts == 0


def rules(*rules: dict) -> Policy:
    return replace(POLICY, failure_rules=tuple(FailurePolicyRule.model_validate(r) for r in rules))


def test_a_fail_job_rule_ends_the_job_on_the_first_matching_exit_naming_the_rule():
    policy = rules({"action": "RestartGang", "podConditions": ["OOMKilled"]}, {"action": "FailJob", "exitCodes": [3, 4]})
    decision = decide([pod(0), pod(1, "Failed", exit_code=3, reason="Error"), pod(2)], RUNNING, policy)
    s = decision.state
    assert (s.phase, s.reason, s.restarts, s.attempt) == ("Failed", "FailurePolicy", 0, 0)
    assert s.failure.dump() == {"pod": "job-0-1", "exitCode": 3, "reason": "Error", "message": (
        "pod job-0-1 exited with code 3 (error); spec.failurePolicy.rules[1] (exitCodes [3, 4]: FailJob) applies")}
    assert set(decision.delete_pods) == {"job-0-0", "job-0-2"}
    # Any other code is still the default's: a counted gang restart.
    other = decide([pod(0), pod(1, "Failed", exit_code=5), pod(2)], RUNNING, policy).state
    assert (other.phase, other.restarts) == ("Restarting", 1)


def test_a_disrupted_pod_restarts_the_gang_uncounted_by_default_and_counted_where_a_rule_says():
    """DisruptionTarget (the scheduler's preemption, an eviction, a drain, a node shutdown) is not the job's
    failure, even with peers that saw it die (exit 75): the default rule ignores it. A rule of the job's own wins."""
    evicted = dict(phase="Failed", reason="Evicted", exit_code=137, disrupted=True, finished_at="2026-11-29T11:59:01Z")
    pods = [pod(0, "Failed", exit_code=contract.EXIT_RETRYABLE, finished_at="2026-11-29T11:59:00Z"),
            pod(1, **evicted), pod(2)]
    decision = decide(pods, replace(RUNNING, restarts=2))
    s = decision.state
    assert (s.phase, s.restarts, s.attempt, s.failure) == ("Restarting", 2, 1, None)
    assert s.last_stop.pod == "job-0-1" and "the default rule (podConditions [DisruptionTarget]: Ignore)" in \
        s.last_stop.message
    assert [(e.type, e.reason) for e in decision.events] == [("Normal", "RestartingGang")]
    assert "(not counted against backoffLimit)" in decision.events[0].message
    counted = decide(pods, RUNNING, rules({"action": "RestartGang", "podConditions": ["DisruptionTarget"]})).state
    assert (counted.restarts, counted.failure.pod) == (1, "job-0-1")
    # Evicted without the condition (a kubelet older than 1.26) is counted unless a rule says otherwise.
    old_kubelet = [pod(0), pod(1, **{**evicted, "disrupted": False}), pod(2)]
    assert decide(old_kubelet, RUNNING).state.restarts == 1
    ignored = decide(old_kubelet, RUNNING, rules({"action": "Ignore", "podConditions": ["Evicted"]})).state
    assert (ignored.restarts, ignored.last_stop.pod) == (0, "job-0-1")


def test_rules_can_make_a_permanent_code_retryable_and_an_out_of_memory_kill_permanent():
    policy = rules({"action": "RestartGang", "exitCodes": [contract.EXIT_INVALID_SPEC]},
                   {"action": "FailJob", "podConditions": ["OOMKilled"]})
    retried = decide([pod(0), pod(1, "Failed", exit_code=contract.EXIT_INVALID_SPEC), pod(2)], RUNNING, policy).state
    assert (retried.phase, retried.restarts) == ("Restarting", 1)
    oom = decide([pod(0), pod(1, "Failed", exit_code=137, reason="OOMKilled", oom_killed=True), pod(2)], RUNNING,
                 policy).state
    assert (oom.phase, oom.reason, oom.failure.reason) == ("Failed", "FailurePolicy", "OOMKilled")


@pytest.mark.parametrize("seen", [dict(phase="Running", terminating=True),
                                  dict(phase="Failed", terminating=True, exit_code=143, reason="Error")])
def test_no_rule_turns_a_deletion_into_a_failure(seen):
    """`kubectl delete pod` or a drain ends the container with 143 or 137: still a stop, whatever the rules say of
    those codes (a rule for them is for a program that gets such a signal on its own)."""
    policy = rules({"action": "FailJob", "exitCodes": [137, 143]})
    state = decide([pod(0), pod(1, **seen), pod(2)], RUNNING, policy).state
    assert (state.phase, state.restarts, state.last_stop.reason) == ("Restarting", 0, "PodDeleted")


def test_in_place_restarts_rank_0_reports_are_counted_once_with_the_failed_rank_named():
    policy = replace(POLICY, in_place_limit=3)
    report = {"step": 40, "startStep": 0, "restartsInPlace": 1,
              "lastFailure": {"rank": 5, "nodeRank": 2, "exitCode": 137}}
    resuming = {k: v for k, v in report.items() if k != "startStep"}  # the round's rank 0 still loading
    assert decide(gang_of("Running", "Running", "Running"), RUNNING, policy, progress=resuming).events == ()
    decision = decide(gang_of("Running", "Running", "Running"), RUNNING, policy, progress=report)
    s = decision.state
    assert (s.phase, s.attempt, s.restarts, s.in_place_restarts, s.attempt_in_place_restarts) == ("Running", 0, 0, 1, 1)
    message = ("rank 5 in pod job-0-2 exited with code 137 (killed by SIGKILL); every rank restarted in place, from "
               "step 0: no checkpoint yet, no pod replaced (in-place restart 1 of spec.restartPolicy.inPlaceLimit 3 "
               "in attempt 0)")
    assert s.failure.dump() == {"pod": "job-0-2", "exitCode": 137, "reason": "Error", "message": message}
    assert [(e.type, e.reason, e.message) for e in decision.events] == [("Warning", "RestartedInPlace", message)]
    assert not decision.create_ranks and not decision.delete_pods  # nothing for the operator to do
    again = decide(gang_of("Running", "Running", "Running"), s, policy, progress=report)
    assert again.events == () and again.state.in_place_restarts == 1  # the same report is not counted twice
    two_more = decide(gang_of("Running", "Running", "Running"), s, policy, progress={**report, "restartsInPlace": 3})
    assert (two_more.state.in_place_restarts, two_more.state.attempt_in_place_restarts) == (3, 3)
    # A gang restart starts the attempt's count afresh; the total stays.
    restarted = decide([pod(0), pod(1, "Failed", exit_code=1), pod(2)], two_more.state, policy).state
    assert (restarted.attempt, restarted.in_place_restarts, restarted.attempt_in_place_restarts) == (1, 3, 0)
    done = decide(gang_of("Succeeded", "Succeeded", "Succeeded", attempt=1), restarted, policy,
                  progress={"step": 60, "startStep": 50, "restartsInPlace": 1,
                            "lastFailure": {"rank": 0, "nodeRank": 0, "exitCode": 1}}).state
    assert (done.phase, done.in_place_restarts) == ("Succeeded", 4) and "1 restarts, 4 in place" in done.message


def test_a_hung_round_is_said_as_the_gangs_stall_not_as_one_ranks_exit():
    """Every rank blocked on a hung one stops beating too: the rank named is the one whose agent looked first."""
    policy = replace(POLICY, in_place_limit=2)
    report = {"step": 30, "startStep": 20, "restartsInPlace": 1,
              "lastFailure": {"rank": 0, "nodeRank": 0, "exitCode": contract.EXIT_HUNG}}
    s = decide(gang_of("Running", "Running", "Running"), RUNNING, policy, progress=report).state
    assert s.failure.exit_code == contract.EXIT_HUNG and s.failure.pod == "job-0-0"
    assert s.failure.message.startswith(
        "a rank hung: the gang made no progress for spec.restartPolicy.hangSeconds, seen first by the agent of rank 0 "
        "in pod job-0-0 (exit code 79; each pod's log holds its ranks' stacks); every rank restarted in place, from "
        "step 20"), s.failure.message
    assert describe_exit(contract.EXIT_HUNG) == "made no progress for spec.restartPolicy.hangSeconds while alive"


def test_a_restarted_gang_says_the_step_it_resumed_from_once_its_rank_0_does():
    stopped = decide([pod(0), pod(1, terminating=True), pod(2)], replace(RUNNING, resumed_from=0)).state
    assert (stopped.attempt, stopped.resumed_from) == (1, None)
    running = replace(stopped, phase="Running", gang_created=True)
    pods = gang_of("Running", "Running", "Running", attempt=1)
    assert decide(pods, running, progress={"step": 3}).events == ()  # rank 0 still loading: nothing said yet
    told = decide(pods, running, progress={"step": 313, "startStep": 312})
    assert [(e.reason, e.message) for e in told.events] == [
        ("TrainingResumed", "attempt 1's ranks resumed from step 312, their newest checkpoint")]
    assert told.state.resumed_from == 312
    assert decide(pods, told.state, progress={"step": 320, "startStep": 312}).events == ()  # said once
    fresh = decide(pods, running, progress={"step": 1, "startStep": 0})
    assert [e.message for e in fresh.events] == ["attempt 1's ranks started from step 0: no checkpoint yet"]
    # A first attempt from scratch is no news; one that found a checkpoint (a job applied again) is.
    assert decide(gang_of("Running", "Running", "Running"), RUNNING, progress={"step": 1, "startStep": 0}).events == ()
    again = decide(gang_of("Running", "Running", "Running"), RUNNING, progress={"step": 600, "startStep": 600})
    assert [e.message for e in again.events] == ["attempt 0's ranks resumed from step 600, their newest checkpoint"]
    # An in-place round moves the step, said by its own Event only.
    policy = replace(POLICY, in_place_limit=2)
    in_place = decide(pods, told.state, policy, progress={"step": 401, "startStep": 400, "restartsInPlace": 1,
                                                         "lastFailure": {"rank": 1, "nodeRank": 1, "exitCode": 1}})
    assert [e.reason for e in in_place.events] == ["RestartedInPlace"] and in_place.state.resumed_from == 400


def test_an_in_place_rule_on_a_pod_that_failed_all_the_same_restarts_the_gang_counted():
    policy = rules({"action": "RestartInPlace", "exitCodes": [1]})
    s = decide([pod(0), pod(1, "Failed", exit_code=1), pod(2)], RUNNING, policy).state
    assert (s.phase, s.restarts) == ("Restarting", 1)
    assert s.failure.message.endswith("spec.failurePolicy.rules[0] (exitCodes [1]: RestartInPlace) applies; its "
                                      "in-place restarts are spent")


def test_the_new_attempt_waits_for_every_old_pod_to_go():
    restarting = GangState(phase="Restarting", attempt=1, restarts=1, start_time=EARLIER)
    old = gang_of("Running", "Failed", "Succeeded", attempt=0)
    decision = decide(old, restarting)
    assert set(decision.delete_pods) == {"job-0-0", "job-0-1", "job-0-2"} and not decision.create_ranks
    going = gang_of("Running", "Running", "Running", attempt=0, terminating=True)
    decision = decide(going, restarting)
    assert not decision.delete_pods and not decision.create_ranks and decision.state.phase == "Restarting"
    decision = decide([], restarting)
    assert decision.create_ranks == (0, 1, 2) and decision.state.phase == "Restarting"
    assert decide(gang_of("Running", "Running", "Running", attempt=1), decision.state).state.phase == "Running"


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_finished_job_never_gets_new_pods(phase):
    done = GangState(phase=phase, completion_time=to_iso(NOW), gang_created=True)
    decision = decide([pod(0, "Succeeded"), pod(1, "Running")], done)
    assert not decision.create_ranks and decision.delete_pods == ("job-0-1",) and decision.state == done
    assert decide([], done).create_ranks == ()


def test_ttl_after_finished_deletes_the_job_when_due():
    done = GangState(phase="Succeeded", completion_time=to_iso(NOW - timedelta(seconds=30)))
    assert not decide([], done, replace(POLICY, ttl_seconds_after_finished=60)).delete_job
    assert decide([], done, replace(POLICY, ttl_seconds_after_finished=30)).delete_job
    assert not decide([], done).delete_job  # no TTL: kept


def test_the_active_deadline_fails_the_job_and_stops_its_pods():
    policy = replace(POLICY, active_deadline_seconds=300)
    decision = decide(gang_of("Running", "Running", "Running"), RUNNING, policy)
    assert decision.state.phase == "Failed" and decision.state.reason == "DeadlineExceeded"
    assert len(decision.delete_pods) == 3
    assert decide(gang_of("Running", "Running", "Running"), RUNNING, replace(POLICY, active_deadline_seconds=301)
                  ).state.phase == "Running"


def test_under_kueue_the_deadline_clock_starts_at_admission_not_while_the_gang_is_queued():
    policy = replace(POLICY, active_deadline_seconds=300, under_kueue=True)
    created = decide([], policy=policy)
    assert created.create_ranks == (0, 1, 2) and created.state.start_time is None
    queued = decide(gang_of("Pending", "Pending", "Pending", queued=True), created.state, policy,
                    now=NOW + timedelta(hours=5))  # hours in the queue: no deadline, no start time
    assert queued.state.phase == "Pending" and queued.state.start_time is None
    admitted = decide(gang_of("Pending", "Pending", "Pending"), queued.state, policy, now=NOW + timedelta(hours=5))
    assert admitted.state.start_time == to_iso(NOW + timedelta(hours=5))
    later = NOW + timedelta(hours=5, seconds=301)
    assert decide(gang_of("Running", "Running", "Running"), admitted.state, policy, now=later).state.reason == \
        "DeadlineExceeded"


def test_suspend_deletes_the_gang_and_resume_starts_a_fresh_attempt():
    policy = replace(POLICY, suspend=True)
    decision = decide(gang_of("Running", "Running", "Running"), RUNNING, policy)
    assert decision.state.phase == "Suspended" and len(decision.delete_pods) == 3 and decision.state.start_time is None
    assert decision.state.restarts == 0
    again = decide([], decision.state, policy)
    assert again.events == () and not again.create_ranks  # staying suspended is quiet
    resumed = decide([], again.state)
    assert resumed.state.attempt == 1 and resumed.create_ranks == (0, 1, 2)
    assert resumed.state.restarts == 0 and [e.reason for e in resumed.events] == ["Resumed", "CreatingGang"]


def test_a_job_created_suspended_never_creates_pods():
    decision = decide([], GangState(), replace(POLICY, suspend=True))
    assert decision.state.phase == "Suspended" and not decision.create_ranks


def test_an_invalid_spec_fails_with_the_field_and_creates_nothing():
    decision = gang.invalid_spec(GangState(), [], "spec.parallelism: data(3) x ... must equal ...", NOW)
    assert decision.state.phase == "Failed" and decision.state.reason == "InvalidSpec"
    assert decision.state.failure.message.startswith("spec.parallelism") and not decision.create_ranks
    done = GangState(phase="Succeeded")
    assert gang.invalid_spec(done, [], "x", NOW).state == done


def test_pod_view_reads_labels_exit_codes_and_why_a_pod_waits():
    raw = {"metadata": {"name": "job-1-0", "labels": {contract.LABEL_ATTEMPT: "1", contract.LABEL_NODE_RANK: "0"},
                        "deletionTimestamp": "2026-11-29T12:00:00Z"},
           "status": {"phase": "Failed", "podIP": "10.0.0.5", "containerStatuses": [
               {"name": "trainer", "state": {"terminated": {"exitCode": 75, "reason": "Error",
                                                            "finishedAt": "2026-11-29T11:59:00Z", "message": "m"}}}]}}
    view = observe.pod_view(raw)
    assert (view.attempt, view.rank, view.phase, view.exit_code, view.terminating, view.ip) == \
        (1, 0, "Failed", 75, True, "10.0.0.5")
    assert view.finished_at == "2026-11-29T11:59:00Z" and view.termination_message == "m"
    waiting = observe.pod_view({"metadata": {"name": "x", "labels": {}}, "status": {"phase": "Pending",
                             "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                             "message": "0/4 nodes have a free GPU"}]}})
    assert waiting.attempt == -1 and waiting.waiting == "Unschedulable: 0/4 nodes have a free GPU"
    held = observe.pod_view({"metadata": {"name": "x", "labels": {"kueue.x-k8s.io/queue-name": "team-a",
                                                                  "kueue.x-k8s.io/pod-group-name": "job-0"}},
                             "spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]},
                             "status": {"phase": "Pending", "conditions": [
                                 {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
                                  "message": "Scheduling is blocked due to non-empty scheduling gates"}]}})
    assert held.queued and held.waiting == ("QueuedByKueue: Kueue has not admitted the gang yet (LocalQueue team-a, "
                                            "pod group job-0)")
    assert not view.disrupted and not held.disrupted
    drained = observe.pod_view({"metadata": {"name": "x"}, "status": {"phase": "Running", "conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]}})
    assert drained.disrupted and drained.stopped_by == "EvictionByEvictionAPI" and view.stopped_by is None
    by_kueue = observe.pod_view({"metadata": {"name": "x"}, "status": {"phase": "Running", "conditions": [
        {"type": "TerminationTarget", "status": "True", "reason": "StoppedByKueue", "message": "Preempted to "
         "accommodate a higher priority Workload"}]}})
    assert by_kueue.stopped_by == "StoppedByKueue: Preempted to accommodate a higher priority Workload"
    assert not by_kueue.disrupted  # (Kueue's own condition, which failure-policy rules do not match)


def test_classify():
    assert gang.classify(pod(0, "Succeeded")) is None and gang.classify(pod(0)) is None
    assert not gang.classify(pod(0, "Failed", exit_code=127)).retryable
    assert gang.classify(pod(0, "Failed", exit_code=1)).retryable
    assert gang.classify(pod(0, "Failed")).retryable  # no exit code: the node, not the program


# --- the start deadline (spec.scheduling.startTimeoutSeconds) ---------------------------------------------------
QUICK = replace(POLICY, start_timeout_seconds=60)
STARTING = GangState(phase="Pending", start_time=EARLIER, attempt_start_time=EARLIER)


def test_the_attempts_clock_starts_at_its_first_create_and_waiting_inside_it_is_fine():
    assert decide([]).state.attempt_start_time == to_iso(NOW)
    unplaced = gang_of("Running", "Pending", "Pending", waiting="Unschedulable: 0/2 nodes are available")
    recent = replace(STARTING, attempt_start_time=to_iso(NOW - timedelta(seconds=59)))
    decision = decide(unplaced, recent, policy=QUICK)
    assert decision.state.phase == "Pending" and not decision.delete_pods


def test_a_gang_not_all_running_by_the_start_timeout_starts_afresh_then_fails_with_the_pods_reason():
    """A brief capacity gap need not fail the job: the attempt ends and the gang is created afresh (not counted
    against backoffLimit), startAttempts times in all; then the job fails with what kept the pods waiting."""
    unplaced = [pod(0), *(pod(r, "Pending", waiting="Unschedulable: 0/2 nodes are available") for r in (1, 2))]
    requeued = decide(unplaced, STARTING, policy=QUICK)
    assert requeued.state.phase == "Restarting" and requeued.state.reason == "StartTimeout"
    assert (requeued.state.attempt, requeued.state.start_timeouts, requeued.state.restarts) == (1, 1, 0)
    assert requeued.state.last_stop.reason == "Unschedulable" and "start attempt 2 of 3" in requeued.state.message
    assert set(requeued.delete_pods) == {p.name for p in unplaced} and not requeued.create_ranks
    assert [e.reason for e in requeued.events] == ["StartTimeout"]
    fresh = decide([], replace(requeued.state, attempt_start_time=None))
    assert fresh.create_ranks == (0, 1, 2) and fresh.state.attempt_start_time == to_iso(NOW)  # a new clock

    last = replace(STARTING, start_timeouts=2)
    decision = decide(unplaced, last, policy=QUICK)
    assert decision.state.phase == "Failed" and decision.state.reason == "StartTimeout"
    assert decision.state.failure.reason == "Unschedulable" and decision.state.restarts == 0
    assert "startTimeoutSeconds" in decision.state.message and "2 Unschedulable" in decision.state.message
    assert "startAttempts (3) spent" in decision.state.message
    assert set(decision.delete_pods) == {p.name for p in unplaced}  # the pods that did start are released too
    assert [e.reason for e in decision.events] == ["StartTimeout"]


def test_a_refused_create_is_the_reason_when_the_start_timeout_ends_the_attempt():
    refusal = 'Pod ns/job-0-2: pods "job-0-2" is forbidden: exceeded quota: q, used: pods=2, limited: pods=2'
    waiting = gang.refused_create(STARTING, refusal)
    pending = decide(gang_of("Running", "Running"), replace(waiting, attempt_start_time=to_iso(NOW)), policy=QUICK)
    assert pending.state.create_refused == refusal and "cannot create" in pending.state.message
    assert pending.create_ranks == (2,)
    decision = decide(gang_of("Running", "Running"), waiting, policy=replace(QUICK, start_attempts=1))
    assert decision.state.phase == "Failed" and decision.state.failure.reason == "FailedCreate"
    assert "exceeded quota" in decision.state.failure.message and decision.state.restarts == 0


def test_a_complete_gang_clears_the_refusal_and_a_running_one_has_no_start_deadline():
    waiting = gang.refused_create(STARTING, "Pod ns/job-0-2: conflict")
    decision = decide(gang_of("Running", "Running", "Pending"), waiting)
    assert decision.state.create_refused == "" and decision.state.phase == "Pending"
    running = replace(RUNNING, attempt_start_time=to_iso(NOW - timedelta(days=2)))
    assert decide(gang_of("Running", "Running", "Running"), running, policy=QUICK).state.phase == "Running"


def test_a_gang_restart_starts_a_new_clock_once_the_old_pods_are_gone():
    failed = [pod(0), pod(1, "Failed", exit_code=1, reason="Error"), pod(2)]
    restart = decide(failed, replace(RUNNING, attempt_start_time=EARLIER), policy=QUICK)
    assert restart.state.attempt == 1 and restart.state.attempt_start_time is None
    waiting_for_old = decide([pod(0, terminating=True)], restart.state, policy=QUICK)
    assert waiting_for_old.state.attempt_start_time is None
    assert decide([], restart.state, policy=QUICK).state.attempt_start_time == to_iso(NOW)


def test_under_kueue_the_start_clock_waits_for_admission():
    queued = gang_of("Pending", "Pending", "Pending", queued=True, waiting="SchedulingGated: kueue")
    kueue_policy = replace(QUICK, under_kueue=True)
    decision = decide(queued, GangState(phase="Pending"), policy=kueue_policy, now=NOW + timedelta(hours=1))
    assert decision.state.attempt_start_time is None and decision.state.phase == "Pending"


# --- the trainer's own words --------------------------------------------------------------------------------------
MISSING_DATA = "spec.data.path: data/nope.txt: no such file in this pod (mount it with spec.pod.volumes)"


@pytest.mark.parametrize("said, shown", [
    (f'{{"error": "{MISSING_DATA}"}}', MISSING_DATA),  # what paratrain train writes when it refuses the job
    (f"2026-12-02 [rank 0] paratrain.train ERROR: {MISSING_DATA}\n", f"2026-12-02 [rank 0] paratrain.train ERROR: "
                                                                       f"{MISSING_DATA}"),  # the kubelet's log tail
    ("[" * 5000, "[" * 1999 + "…"),  # nested past the parser's stack: contained, clipped
    ('{"step": 3}', None),
    (None, None),
])
def test_a_refusing_trainers_words_become_the_failure_message(said, shown):
    failure = gang.classify(pod(1, "Failed", exit_code=contract.EXIT_INVALID_SPEC, termination_message=said))
    assert not failure.retryable
    if shown:
        assert failure.message.endswith(f"(the trainer rejected the spec): {shown}")
    else:
        assert failure.message.endswith("(the trainer rejected the spec)")


# --- pods of an earlier attempt stuck terminating -----------------------------------------------------------------
def test_a_pod_terminating_past_its_grace_period_and_the_margin_is_named_as_stuck():
    restarting = GangState(phase="Restarting", attempt=1, restarts=1)
    recent = to_iso(NOW - timedelta(seconds=gang.STUCK_AFTER_SECONDS - 1))
    ended = to_iso(NOW - timedelta(seconds=gang.STUCK_AFTER_SECONDS + 1))
    waiting = decide([pod(0, terminating=True, gone_by=recent, node="n1")], restarting)
    assert waiting.stuck_pods == () and waiting.state.stuck == ""  # still within its grace period and margin
    decision = decide([pod(0, terminating=True, gone_by=ended, node="n1"), pod(1, terminating=True, gone_by=recent)],
                      restarting)
    assert decision.stuck_pods == ("job-0-0",) and not decision.create_ranks
    assert "1 pod(s) stuck terminating: job-0-0 (held by node n1, whose kubelet has not confirmed" in \
        decision.state.message
    assert decision.state.stuck in decision.state.message


def test_a_pod_held_terminating_past_the_start_timeout_ends_the_attempt_naming_it_and_its_holder():
    """A finalizer nobody removes (or a hung node) kept the next attempt waiting forever: past
    startTimeoutSeconds after its grace period the attempt ends, with the pod and what holds it in the reason."""
    restarting = GangState(phase="Restarting", attempt=1, restarts=1)
    timeout = POLICY.start_timeout_seconds
    within = to_iso(NOW - timedelta(seconds=timeout - 1))
    past = to_iso(NOW - timedelta(seconds=timeout + 1))
    held = pod(0, terminating=True, gone_by=past, node="n1", finalizers=("example.com/hold",))
    assert decide([replace(held, gone_by=within)], restarting).state.phase == "Restarting"
    decision = decide([held, pod(1, terminating=True, gone_by=past, node="n2")], restarting)
    assert decision.state.phase == "Failed" and decision.state.reason == "StartTimeout"
    failure = decision.state.failure
    assert (failure.reason, failure.pod, failure.retryable) == ("PodStuckTerminating", "job-0-0", False)
    assert "held by finalizer(s) example.com/hold" in failure.message and "(and 1 more)" in failure.message
    assert f"startTimeoutSeconds ({timeout}s past its grace period" in failure.message
    assert [e.reason for e in decision.events] == ["StartTimeout"]


# --- the restart backoff and the bound on uncounted restarts ------------------------------------------------------
def test_gang_restarts_without_a_step_trained_back_off_doubling_and_a_step_resets_it():
    """The first gang restart since a step was trained starts at once; each later one waits twice as long, from
    10 s up to 6 min (the Job controller's backoff); rank 0 reporting a step trained resets the count."""
    failing = [pod(0), pod(1, "Failed", exit_code=1, reason="Error"), pod(2)]
    state, waits = RUNNING, []
    for _ in range(8):
        decision = decide(failing, replace(state, restarts=0), policy=replace(POLICY, backoff_limit=100))
        state = decision.state
        not_before = from_iso(state.restart_not_before)
        waits.append(round((not_before - NOW).total_seconds()) if not_before else 0)
        failing = [replace(p, attempt=state.attempt) for p in failing]
    assert waits == [0, 10, 20, 40, 80, 160, 320, 360]
    assert state.failures_in_a_row == 8 and "restarts since a step was last trained" in state.message
    assert (state.last_restart_reason, state.last_restart_time) == ("Error", to_iso(NOW))  # `kubectl get -o wide`

    waiting = decide([], state)  # the old pods are gone: nothing is created before restartNotBefore
    assert waiting.create_ranks == () and waiting.state.phase == "Restarting" and "restart backoff" in \
        waiting.state.message
    due = decide([], state, now=from_iso(state.restart_not_before))
    assert due.create_ranks == (0, 1, 2)
    trained = decide(gang_of("Running", "Running", "Running", attempt=state.attempt), state,
                     progress={"step": 120, "startStep": 100})
    assert trained.state.failures_in_a_row == 0


def test_restarts_not_counted_have_a_bound_of_their_own():
    stopped = [pod(0), pod(1, terminating=True), pod(2)]  # deleted from outside: a stop, not counted
    many = replace(RUNNING, uncounted_restarts=99)
    restarted = decide(stopped, many)
    assert restarted.state.phase == "Restarting" and restarted.state.uncounted_restarts == 100
    assert restarted.state.restarts == 0
    ended = decide(stopped, replace(RUNNING, uncounted_restarts=100))
    assert ended.state.phase == "Failed" and ended.state.reason == "MaxUncountedRestartsExceeded"
    assert "runPolicy.maxUncountedRestarts (100" in ended.state.message


# --- single-pod replacement ---------------------------------------------------------------------------------------
REPLACING = replace(POLICY, in_place_limit=2)


def test_a_deleted_pod_is_replaced_alone_and_its_replacement_ends_the_replacement():
    deleted = decide([pod(0), pod(1, terminating=True, uid="u1"), pod(2)], RUNNING, REPLACING)
    s = deleted.state
    assert (s.phase, s.reason, s.attempt, s.restarts, s.pod_replacements, s.attempt_pod_replacements) == \
        ("Restarting", "ReplacingPod", 0, 0, 1, 1)
    assert s.replacing == ((1, "u1"),) and s.last_stop.reason == "PodDeleted" and s.failure is None
    assert not deleted.create_ranks and not deleted.delete_pods  # its name is held until it is gone
    message = ("pod job-0-1 was deleted before it finished; replacing only pod job-0-1 (pod replacement 1 in attempt "
               "0): the other pods' ranks wait for it in place, then every rank restarts from the newest checkpoint; "
               "not counted against backoffLimit")
    assert [(e.type, e.reason, e.message) for e in deleted.events] == [("Normal", "ReplacingPod", message)]

    still_there = decide([pod(0), pod(1, terminating=True, uid="u1"), pod(2)], s, REPLACING)
    assert still_there.state.pod_replacements == 1 and not still_there.events and not still_there.create_ranks
    gone = decide([pod(0), pod(2)], s, REPLACING)
    assert gone.create_ranks == (1,) and gone.state.phase == "Restarting" and gone.state.pod_replacements == 1
    starting = decide([pod(0), pod(1, "Pending", uid="u2"), pod(2)], gone.state, REPLACING).state
    assert starting.replacing == ((1, "u1"),) and starting.phase == "Restarting"
    running = decide([pod(0), pod(1, uid="u2"), pod(2)], starting, REPLACING)
    assert (running.state.phase, running.state.replacing, running.state.attempt) == ("Running", (), 0)
    assert [e.reason for e in running.events] == ["GangRunning"]
    # Its peers' ranks restarted in place for it: rank 0's report of that round says so, without a failure.
    report = {"step": 30, "startStep": 20, "restartsInPlace": 1,
              "lastFailure": {"rank": 0, "nodeRank": 0, "exitCode": 76}}
    told = decide([pod(0), pod(1, uid="u2"), pod(2)], running.state, REPLACING, progress=report)
    assert told.state.failure is None and told.state.in_place_restarts == 1
    assert [(e.type, e.reason, e.message) for e in told.events] == [("Normal", "RestartedInPlace", (
        "pod job-0-1 was replaced; every rank restarted in place, from step 20 (in-place restart 1 of "
        "spec.restartPolicy.inPlaceLimit 2 in attempt 0)"))]
    # A replacement that fails on its own is a failure like any other.
    failed = decide([pod(0), pod(1, "Failed", exit_code=1, uid="u2"), pod(2)], told.state, REPLACING).state
    assert (failed.phase, failed.attempt, failed.restarts, failed.replacing) == ("Restarting", 1, 1, ())


def test_an_evicted_pod_is_deleted_then_replaced_and_counted_once():
    evicted = dict(phase="Failed", reason="Evicted", exit_code=137, disrupted=True, uid="u1")
    first = decide([pod(0), pod(1, **evicted), pod(2)], RUNNING, REPLACING)
    assert first.delete_pods == ("job-0-1",) and first.state.replacing == ((1, "u1"),)
    assert first.state.last_stop.reason == "Evicted" and first.state.restarts == 0
    again = decide([pod(0), pod(1, **evicted), pod(2)], first.state, REPLACING)  # the delete not seen yet
    assert again.delete_pods == ("job-0-1",) and not again.create_ranks and again.state.pod_replacements == 1


def test_a_pod_that_vanished_is_recreated_at_once():
    vanished = decide([pod(0), pod(2)], RUNNING, REPLACING)
    assert vanished.create_ranks == (1,) and vanished.state.replacing == ((1, ""),)
    assert decide([pod(0), pod(1, "Pending", uid="u2"), pod(2)], vanished.state, REPLACING).state.replacing == \
        ((1, ""),)


@pytest.mark.parametrize("why,policy,state,pods", [
    ("pod 0 hosts the rendezvous store", REPLACING, RUNNING, [pod(0, terminating=True), pod(1), pod(2)]),
    ("no in-place restarts", POLICY, RUNNING, [pod(0), pod(1, terminating=True), pod(2)]),
    ("the attempt's in-place restarts are spent", REPLACING, replace(RUNNING, attempt_in_place_restarts=2),
     [pod(0), pod(1, terminating=True), pod(2)]),
    ("Kueue's pod group is finished", replace(REPLACING, under_kueue=True), RUNNING,
     [pod(0), pod(1, terminating=True), pod(2)]),
    ("a rule asks for the gang", replace(REPLACING, failure_rules=(FailurePolicyRule(
        action="RestartGang", pod_conditions=["DisruptionTarget"]),)), RUNNING,
     [pod(0), pod(1, "Failed", reason="Evicted", disrupted=True), pod(2)]),
    ("a program failed too", REPLACING, RUNNING, [pod(0), pod(1, terminating=True), pod(2, "Failed", exit_code=1)]),
    ("a program failed, no pod was lost", REPLACING, RUNNING, [pod(0), pod(1, "Failed", exit_code=1), pod(2)]),
])
def test_where_a_pod_cannot_be_replaced_alone_the_whole_gang_restarts(why, policy, state, pods):
    decision = decide(pods, state, policy)
    assert (decision.state.attempt, decision.state.pod_replacements) == (1, 0), why
    assert [e.reason for e in decision.events] in (["RestartingGang"], ["PodDeleted"], ["Preempted"]), why


def test_a_lost_pod_stuck_terminating_is_handed_on_as_stuck():
    gone_by = to_iso(NOW - timedelta(seconds=gang.STUCK_AFTER_SECONDS + 1))
    lost = [pod(0), pod(1, terminating=True, uid="u1", gone_by=gone_by, node="gone-node"), pod(2)]
    replacing = decide(lost, RUNNING, REPLACING).state
    assert decide(lost, replacing, REPLACING).stuck_pods == ("job-0-1",)
