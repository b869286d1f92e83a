"""Gang decisions, pure: the job's persisted gang state + the pods observed now + the time → the next decision.

`decide` reads as a checklist (after JobSet's reconcile): finished? (stop leftovers, TTL) → deadline →
suspend / resume → pods being replaced (set the lost ones aside) → in-place restarts rank 0 reported → success →
failure policy (lost pods only, not pod 0, rounds left: replace them alone; else the whole gang) → old attempt still
around? (delete it, wait) → missing pods (create) → phase.

A decision's new state is written to the job's status *before* its actions run. An operator killed in between
redoes the same actions on restart instead of forgetting them: e.g. a gang restart persists attempt+1 first,
then deletes the old pods; after a crash those pods are simply stale and get deleted again. Pod names carry
the attempt, so creating a pod twice is a harmless 409, never a duplicate.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from pydantic import Field, model_validator

from paratrain import contract
from paratrain.api import kueue
from paratrain.api import status as status_model
from paratrain.api.spec import FailurePolicyRule, Spec, first_rule
from paratrain.api.status import FAILED, PENDING, RESTARTING, RUNNING, SUCCEEDED, SUSPENDED, clip

from . import decode
from .clock import from_iso, to_iso
from .observe import PodView, as_int

FINISHED = frozenset({SUCCEEDED, FAILED})
# Pod-level reasons for a pod that failed without its program failing: the node, not the code, went away.
DISRUPTIONS = frozenset({"Evicted", "Preempting", "NodeLost", "NodeShutdown", "Shutdown", "Terminated",
                         "UnexpectedAdmissionError", "DeletionByPodGC", "TerminationByKubelet"})
_SIGNALS = {6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}
_STOP_SIGNAL_EXITS = frozenset({128 + 9, 128 + 15})  # how the kubelet stops a deleted pod's container
# The status condition that names a create the API server refused (quota, admission, a name still held), as a
# ReplicaSet's ReplicaFailure does; it goes False once every pod of the attempt exists.
CREATE_REFUSED = "CreateRefused"
# The condition naming pods of an earlier attempt stuck terminating, which the next attempt waits for.
PODS_STUCK = "PodsStuck"
RESTART_BACKOFF_SECONDS, RESTART_BACKOFF_MAX = 10.0, 360.0
# How long past its grace period a deleted pod counts as stuck (its kubelet has not confirmed the deletion).
STUCK_AFTER_SECONDS = float(os.environ.get("PARATRAIN_STUCK_POD_SECONDS", "60"))
# How long a pod whose ranks saw a peer fail (exit 75) or stopped unasked (76) waits for the failing peer's own
# exit to be seen: the peer's pod often shows Failed a moment later (its agent, then its kubelet's status write).
CAUSE_WAIT_SECONDS = 15.0
# Exits a rank makes because another failed: it saw its peer vanish (75), or NCCL's watchdog aborted it (134).
CONSEQUENCE_EXITS = contract.CONSEQUENCE_EXITS


class Failure(status_model.Failure):
    """Why a gang (or the job) failed: `status.failure`'s own model (pod, exitCode, reason, message), plus what the
    decisions alone need, never written to status."""

    retryable: bool = Field(True, exclude=True)
    # Stopped from outside (deleted: a drain, a preemption, by hand; or exit 76, stopped with a checkpoint of the
    # step in flight): not the job's failure, so its gang restart is not counted against backoffLimit.
    preempted: bool = Field(False, exclude=True)
    at: str | None = Field(None, exclude=True)  # when the pod stopped: the earliest failure is the likeliest root cause
    rule: str | None = Field(None, exclude=True)  # the failure-policy rule that decided its action, if one did
    action: str | None = Field(None, exclude=True)  # that rule's action
    stopped_by: str | None = Field(None, exclude=True)  # a deleted pod's DisruptionTarget/TerminationTarget says why

    @model_validator(mode="before")
    @classmethod
    def _clipped(cls, data: Any) -> Any:
        """A pod's message is user text of any length: clipped to the schema's limits, never refused."""
        return status_model.fit_to_schema(status_model.Failure, data) if isinstance(data, Mapping) else data

    def to_status(self) -> dict[str, Any]:
        return self.dump()

    @classmethod
    def from_status(cls, data: Mapping[str, Any] | None) -> Failure | None:
        return cls.model_validate(data) if data else None


def describe_exit(code: int) -> str:
    if code == contract.EXIT_RETRYABLE:
        return "a peer failed or a collective timed out"
    if code == contract.EXIT_INVALID_SPEC:
        return "the trainer rejected the spec"
    if code == contract.EXIT_PREEMPTED:
        return "stopped by SIGTERM after checkpointing its last step"
    if code == contract.EXIT_OUT_OF_MEMORY:
        return "out of device memory: the layout does not fit at this batch"
    if code == contract.EXIT_HUNG:
        return "made no progress for spec.restartPolicy.hangSeconds while alive"
    if code in (126, 127):
        return "the image cannot run the command"
    if code > 128 and code - 128 in _SIGNALS:
        return f"killed by {_SIGNALS[code - 128]}"
    return "error"


def deleted(pod: str, at: str | None = None, stopped_by: str | None = None) -> Failure:
    """A pod deleted from outside before it finished: a stop, not the job's failure (see Failure.preempted).
    `stopped_by`: why, where the deleter said so in a condition (a preemption, an eviction, Kueue)."""
    why = f" ({stopped_by})" if stopped_by else ""
    return Failure(reason="PodDeleted", message=f"pod {pod} was deleted before it finished{why}", pod=pod, at=at,
                   preempted=True, stopped_by=stopped_by)


def classify(pod: PodView) -> Failure | None:
    """A failed or vanishing pod → Failure (retryable or permanent); None for a pod that is fine."""
    if pod.phase == SUCCEEDED:
        return None
    if pod.terminating and (pod.phase != FAILED or pod.exit_code in _STOP_SIGNAL_EXITS):
        # Deleted while running: the kubelet's SIGTERM/SIGKILL exit is the deletion's consequence, whichever of
        # the two states (terminating, or already failed with 143/137) this reconcile happens to see.
        return deleted(pod.name, at=pod.finished_at, stopped_by=pod.stopped_by)
    if pod.phase == FAILED:
        if pod.reason in DISRUPTIONS or pod.exit_code is None:
            reason = pod.reason or "PodFailed"
            detail = f": {pod.message}" if pod.message else ""
            return Failure(reason=reason, message=f"pod {pod.name} failed: {reason}{detail}", pod=pod.name,
                           exit_code=pod.exit_code, at=pod.finished_at)
        code = pod.exit_code
        if code == contract.EXIT_PREEMPTED:
            return Failure(reason="Preempted", message=f"pod {pod.name} was stopped and checkpointed its last step "
                           f"(exit {code})", pod=pod.name, exit_code=code, preempted=True, at=pod.finished_at)
        said = trainer_error(pod.termination_message) if code in contract.EXPLAINED_EXIT_CODES else None
        return Failure(reason=pod.reason or "Error",
                       message=f"pod {pod.name} exited with code {code} ({describe_exit(code)})"
                       + (f": {said}" if said else ""),
                       pod=pod.name, exit_code=code, retryable=code not in contract.PERMANENT_EXIT_CODES,
                       at=pod.finished_at)
    return None


def pod_conditions(pod: PodView) -> list[str]:
    """What a failure-policy rule's podConditions can match on this pod."""
    shown = {"DisruptionTarget": pod.disrupted, "OOMKilled": pod.oom_killed, "Evicted": pod.reason == "Evicted"}
    return [name for name, present in shown.items() if present]


# Where no rule of the job's own matches: a disruption (preemption, eviction, drain, node shutdown) is not the
# job's failure, so its gang restart is not counted (the trainer's permanent exit codes are classify's).
DEFAULT_RULES = (FailurePolicyRule(action="Ignore", pod_conditions=["DisruptionTarget"]),)


def with_policy(failure: Failure, pod: PodView | None, rules: Sequence[FailurePolicyRule]) -> Failure:
    """The failure with the action of the first rule matching it (the job's rules, then DEFAULT_RULES): FailJob
    makes it permanent, RestartGang counted, Ignore uncounted; RestartInPlace, on a pod that failed all the same
    (its in-place restarts spent), is a counted gang restart. A pod deleted from outside (no exit code, no view)
    stays a stop: no rule turns a `kubectl delete pod` or a drain into the job's failure."""
    if failure.reason == "PodDeleted":
        return failure
    conditions = pod_conditions(pod) if pod else []
    if hit := first_rule(rules, failure.exit_code, conditions):
        where, rule = f"spec.failurePolicy.rules[{hit[0]}]", hit[1]
    elif not failure.preempted and (hit := first_rule(DEFAULT_RULES, failure.exit_code, conditions)):
        # (a stop, exit 76 or a deletion, is already uncounted: it keeps its own words and Event, Preempted)
        where, rule = "the default rule", hit[1]
    else:
        return failure
    named = f"{where} ({rule.describe()})"
    spent = "; its in-place restarts are spent" if rule.action == "RestartInPlace" else ""
    return failure.model_copy(update={"retryable": rule.action != "FailJob", "preempted": rule.action == "Ignore",
                                      "rule": named, "action": rule.action,
                                      "message": f"{failure.message}; {named} applies{spent}"})


def trainer_error(termination_message: str | None, limit: int = 2000) -> str | None:
    """What a trainer that refused the job said (the field and the fix): its termination message's "error", or,
    where it wrote none (the kubelet then gives the log's tail), the last line of that. Tenant text: any parse
    failure is contained, the length bounded."""
    text = (termination_message or "").strip()
    if not text:
        return None
    try:
        parsed = decode.loads(text)
    except decode.Undecodable:
        return clip(text.splitlines()[-1].strip(), limit)
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return clip(error, limit) if isinstance(error, str) and error else None


def _stopped_from_outside(pods: Iterable[PodView], failures: Sequence[Failure]) -> bool:
    """Whether something outside stopped the gang: one of its pods deleted (terminating or gone: a drain, Kueue's
    preemption, by hand) or marked DisruptionTarget. Only then is exit 76 (stopped, step saved) a stop."""
    return any(p.terminating or p.disrupted for p in pods) or any(f.reason == "PodDeleted" for f in failures)


def _unprompted(stop: Failure) -> Failure:
    """Exit 76 that nothing outside asked for (the program stopped itself): counted like any failure, or a job
    that keeps stopping itself would restart its gang forever."""
    return stop.model_copy(update={
        "reason": "Stopped", "preempted": False,
        "message": f"pod {stop.pod} exited with code {stop.exit_code} ({describe_exit(stop.exit_code)}), but nothing "
                   "stopped the gang from outside (no pod of it deleted, evicted or disrupted)"})


def _consequence(failure: Failure) -> bool:
    """A pod that failed because another did (its ranks saw a peer fail, exit 75, or NCCL's watchdog aborted them,
    134) or stopped though nothing stopped the gang (76): what it exited with is not why the gang fails."""
    return failure.retryable and (failure.exit_code in CONSEQUENCE_EXITS or failure.reason == "Stopped")


def _cause_wait(root: Failure, others: Sequence[PodView], now: datetime) -> float:
    """Seconds more to wait for the cause of `root` (a consequence) while another pod of the gang still runs: its
    failure, seen a moment later, is the cause the restart names. 0: decide now. Counted from the pod's finishedAt
    (its node's clock): a node clock ahead of the operator's lengthens the wait by the difference, one behind
    shortens it; either way it ends, and the resync passes meanwhile."""
    since = from_iso(root.at)
    if since is None or not any(p.active for p in others):
        return 0.0
    return min(CAUSE_WAIT_SECONDS, max(0.0, CAUSE_WAIT_SECONDS - (now - since).total_seconds()))  # clocks may differ


def _cause_unseen(root: Failure) -> Failure:
    if not _consequence(root):
        return root
    return root.model_copy(update={"message": (
        f"{root.message}; no other pod's failure was seen (a rank may hang: this pod's log names the ranks that did "
        "not answer its roll call)")})


def root_cause(failures: Sequence[Failure]) -> Failure:
    """Permanent failures decide the job; among retryable ones, a pod that merely saw its peer die (exit 75, or 134:
    NCCL's watchdog aborted it) is a consequence, not the cause, then one that was stopped (exit 76, it saved its step) or whose failure a rule
    ignores, and among stops the deleted pod before its peers that exited 76 on its account; then the earliest.
    So a deleted or disrupted pod whose peers exit 75 restarts the gang uncounted, naming the deleted pod."""
    return min(failures, key=lambda f: (f.retryable, f.exit_code in CONSEQUENCE_EXITS, f.preempted,
                                        f.exit_code == contract.EXIT_PREEMPTED, f.at or "~", f.pod or ""))


@dataclass(frozen=True)
class GangState:
    """The part of `status` that decisions depend on; persisted so that an operator restart loses nothing."""

    phase: str | None = None
    attempt: int = 0  # the gang generation: part of pod names; bumped by restarts and resumes
    restarts: int = 0  # failure-triggered gang restarts, counted against runPolicy.backoffLimit
    in_place_restarts: int = 0  # every attempt's in-place restarts (rank 0's reports), not counted
    attempt_in_place_restarts: int = 0  # this attempt's, as rank 0 last reported them
    pod_replacements: int = 0  # every attempt's pods replaced alone, not counted
    attempt_pod_replacements: int = 0  # this attempt's
    replacing: tuple[tuple[int, str], ...] = ()  # (node rank, the lost pod's uid) of pods being replaced now
    gang_created: bool = False  # every pod of this attempt was seen: a pod missing from now on was deleted
    start_time: str | None = None
    attempt_start_time: str | None = None  # this attempt's first create: startTimeoutSeconds runs from it
    create_refused: str = ""  # the last refused create of this attempt ("Pod ns/name: the API's message")
    failures_in_a_row: int = 0  # gang restarts since a step was last trained (the restart backoff's count)
    restart_not_before: str | None = None  # this attempt's pods are created no sooner (the restart backoff)
    uncounted_restarts: int = 0  # gang restarts not counted against backoffLimit (stops, Ignore rules)
    start_timeouts: int = 0  # attempts ended by startTimeoutSeconds (their own limit: startAttempts)
    last_restart_reason: str = ""  # why the gang last restarted, and when (`kubectl get ptj -o wide`)
    last_restart_time: str | None = None
    resumed_from: int | None = None  # the step this attempt's ranks resumed from (its last round's), as rank 0 said
    stuck: str = ""  # pods of an earlier attempt stuck terminating (this pass's finding; not read back)
    completion_time: str | None = None
    failure: Failure | None = None
    last_stop: Failure | None = None  # a stop the gang restarted from (not counted, not a failure)
    reason: str = ""
    message: str = ""
    nodes: int = 0  # an elastic gang's size, as last resized (0: spec.nodes)
    resizes: tuple[status_model.Resize, ...] = ()  # an elastic gang's resizes, oldest first (resize.py)
    last_step: int | None = None  # the step rank 0 last reported (status.progress; read, never written from here)

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> GangState:
        s = status or {}
        return cls(phase=s.get("phase"), attempt=as_int(s.get("attempt"), 0), restarts=as_int(s.get("restarts"), 0),
                   in_place_restarts=as_int(s.get("inPlaceRestarts"), 0),
                   attempt_in_place_restarts=as_int(s.get("attemptInPlaceRestarts"), 0),
                   pod_replacements=as_int(s.get("podReplacements"), 0),
                   attempt_pod_replacements=as_int(s.get("attemptPodReplacements"), 0),
                   replacing=_replacing(s.get("replacing")),
                   gang_created=bool(s.get("gangCreated")), start_time=s.get("startTime"),
                   attempt_start_time=s.get("attemptStartTime"), create_refused=_refusal(s.get("conditions")),
                   failures_in_a_row=as_int(s.get("failuresInARow"), 0), restart_not_before=s.get("restartNotBefore"),
                   uncounted_restarts=as_int(s.get("uncountedRestarts"), 0),
                   start_timeouts=as_int(s.get("startTimeouts"), 0),
                   last_restart_reason=s.get("lastRestartReason") or "", last_restart_time=s.get("lastRestartTime"),
                   resumed_from=s.get("resumedFromStep") if isinstance(s.get("resumedFromStep"), int) else None,
                   completion_time=s.get("completionTime"), failure=Failure.from_status(s.get("failure")),
                   last_stop=Failure.from_status(s.get("lastStop")), reason=s.get("reason") or "",
                   message=s.get("message") or "", nodes=as_int(s.get("nodes"), 0), resizes=_resizes(s.get("resizes")),
                   last_step=_step(s.get("progress")))

    def new_attempt(self, **changes: Any) -> GangState:
        """This state for the next attempt: its gang, clock and refusals start afresh."""
        fresh: dict[str, Any] = {"restart_not_before": None, **changes}
        return replace(self, attempt=self.attempt + 1, gang_created=False, attempt_start_time=None, create_refused="",
                       attempt_in_place_restarts=0, attempt_pod_replacements=0, replacing=(), resumed_from=None,
                       **fresh)

    def restarted(self, now: datetime, **changes: Any) -> GangState:
        """The next attempt after a gang restart (a failure or a stop): the first since a step was trained starts at
        once; each later one waits twice as long as the one before, from RESTART_BACKOFF_SECONDS up to
        RESTART_BACKOFF_MAX (the Job controller's 10 s doubling to 6 min), so a gang that fails before training
        anything does not hammer the scheduler, the image registry and the API server."""
        failures = self.failures_in_a_row + 1
        delay = 0.0 if failures == 1 else min(RESTART_BACKOFF_MAX, RESTART_BACKOFF_SECONDS * 2 ** (failures - 2))
        not_before = to_iso(now + timedelta(seconds=delay)) if delay else None
        return self.new_attempt(failures_in_a_row=failures, **changes, restart_not_before=not_before,
                                last_restart_reason=changes.get("reason") or "", last_restart_time=to_iso(now))


def _replacing(said: Any) -> tuple[tuple[int, str], ...]:
    """status.replacing as (node rank, lost uid) pairs; an entry that is not one is dropped."""
    out = []
    for entry in said if isinstance(said, list) else []:
        rank = as_int(entry.get("nodeRank"), 0) if isinstance(entry, Mapping) else 0
        if rank > 0:
            out.append((rank, str(entry.get("lostUid") or "")))
    return tuple(out)


def _resizes(said: Any) -> tuple[status_model.Resize, ...]:
    """status.resizes as models; an entry that is not one is dropped."""
    out = []
    for entry in said if isinstance(said, list) else []:
        try:
            out.append(status_model.Resize.model_validate(entry))
        except ValueError:
            continue
    return tuple(out)


def _step(progress: Any) -> int | None:
    step = progress.get("step") if isinstance(progress, Mapping) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _refusal(conditions: Any) -> str:
    found = next((c for c in conditions or [] if isinstance(c, Mapping) and c.get("type") == CREATE_REFUSED), None)
    return str(found.get("message") or "") if found and found.get("status") == "True" else ""


@dataclass(frozen=True)
class Policy:
    """The job fields the decisions read."""

    name: str
    nodes: int
    backoff_limit: int = 3
    suspend: bool = False
    active_deadline_seconds: int | None = None
    ttl_seconds_after_finished: int | None = None
    under_kueue: bool = False  # admitted by Kueue (the job names a LocalQueue)
    start_timeout_seconds: int = 1200
    start_attempts: int = 3
    max_uncounted_restarts: int = 100
    failure_rules: tuple[FailurePolicyRule, ...] = ()
    in_place_limit: int = 0
    elastic: Spec | None = None  # the job's spec when it has spec.elastic (resize.py reads its sizes), else None

    @classmethod
    def from_job(cls, job: Any) -> Policy:
        spec, rp = job.spec, job.spec.run_policy
        return cls(name=job.metadata.name, nodes=spec.nodes, backoff_limit=rp.backoff_limit, suspend=rp.suspend,
                   active_deadline_seconds=rp.active_deadline_seconds,
                   ttl_seconds_after_finished=rp.ttl_seconds_after_finished,
                   under_kueue=bool(kueue.queue_name(job)),
                   start_timeout_seconds=spec.scheduling.start_timeout_seconds,
                   start_attempts=spec.scheduling.start_attempts, max_uncounted_restarts=rp.max_uncounted_restarts,
                   failure_rules=tuple(spec.failure_policy.rules), in_place_limit=spec.restart_policy.in_place_limit,
                   elastic=spec if spec.elastic else None)


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    """The new state to persist, then the actions to take (in this order)."""

    state: GangState
    create_ranks: tuple[int, ...] = ()
    delete_pods: tuple[str, ...] = ()
    stuck_pods: tuple[str, ...] = ()  # to force-delete if their node is lost, else to report
    delete_job: bool = False
    events: tuple[Event, ...] = field(default_factory=tuple)
    pass_after: float | None = None  # seconds until a pass must look again (nothing else may bring one sooner)
    create_probes: tuple[int, ...] = ()  # an elastic gang's placeholder pods to create, by the rank each probes for


def _active(pods: Sequence[PodView]) -> tuple[str, ...]:
    return tuple(p.name for p in pods if p.active)


def fail(state: GangState, pods: Sequence[PodView], failure: Failure, now: datetime,
         reason: str | None = None, message: str | None = None) -> Decision:
    """Failed for good: remember why and stop every pod still running (a finished job holds no GPUs)."""
    reason, message = reason or failure.reason, message or failure.message
    new = replace(state, phase=FAILED, completion_time=to_iso(now), failure=failure, reason=reason, message=message)
    return Decision(new, delete_pods=_active(pods), events=(Event("Warning", reason, message),))


def invalid_spec(state: GangState, pods: Sequence[PodView], message: str, now: datetime) -> Decision:
    """A spec that can never train: Failed with the field named, and no pods."""
    if state.phase in FINISHED:
        return Decision(state, delete_pods=_active(pods))
    return fail(state, pods, Failure(reason="InvalidSpec", message=message, retryable=False), now)


def decide(policy: Policy, state: GangState, pods: Sequence[PodView], now: datetime,
           progress: Mapping[str, Any] | None = None) -> Decision:
    """`progress`: the current attempt's rank 0 report, if one was read (it tells of in-place restarts)."""
    if state.phase in FINISHED:
        return _keep_finished(policy, state, pods, now)
    start = from_iso(state.start_time)
    deadline = policy.active_deadline_seconds
    if deadline and start and now >= start + timedelta(seconds=deadline):
        message = f"the job ran longer than activeDeadlineSeconds ({deadline}s, started {state.start_time})"
        return fail(state, pods, Failure(reason="DeadlineExceeded", message=message, retryable=False), now)
    if policy.suspend:
        return _suspend(state, pods)
    events: list[Event] = []
    if state.phase == SUSPENDED:
        # A fresh attempt (new pod names); the deadline clock restarts, as for a resumed Kubernetes Job.
        state = state.new_attempt(phase=PENDING, start_time=None, reason="Resumed",
                                  message="resumed: creating a fresh gang")
        events.append(Event("Normal", "Resumed", f"resumed: creating gang attempt {state.attempt}"))

    current = {p.rank: p for p in pods if p.attempt == state.attempt}
    stale = [p for p in pods if p.attempt != state.attempt]
    if state.failures_in_a_row and trained_a_step(progress):
        state = replace(state, failures_in_a_row=0)  # the restart backoff starts from scratch
    state, current, lost_pods = _set_aside_lost(state, current)
    if in_place := restarted_in_place(policy, state, progress):
        state, events = in_place.state, [*events, *in_place.events]
    state, told = _resumed(state, progress, said_elsewhere=in_place is not None)
    events += told
    if len(current) == policy.nodes and all(p.phase == SUCCEEDED for p in current.values()):
        in_place = f", {state.in_place_restarts} in place" if state.in_place_restarts else ""
        msg = f"all {policy.nodes} pods succeeded (attempt {state.attempt}, {state.restarts} restarts{in_place})"
        new = replace(state, phase=SUCCEEDED, completion_time=to_iso(now), reason="Succeeded", message=msg)
        return Decision(new, delete_pods=_active(stale), events=(*events, Event("Normal", "Succeeded", msg)))

    failed = [(pod.rank, pod, f) for pod in current.values() if (f := classify(pod))]
    if state.gang_created:
        being_replaced = {rank for rank, _ in state.replacing}
        failed += [(r, None, deleted(contract.pod_name(policy.name, state.attempt, r)))
                   for r in range(policy.nodes) if r not in current and r not in being_replaced]
    if failed and not _stopped_from_outside(current.values(), [f for _, _, f in failed]):
        failed = [(rank, pod, _unprompted(f) if f.preempted and f.exit_code == contract.EXIT_PREEMPTED else f)
                  for rank, pod, f in failed]
    failed = [(rank, pod, with_policy(f, pod, policy.failure_rules)) for rank, pod, f in failed]
    if failed:
        if replaceable(policy, state, failed):
            return _replace(state, failed, now, events)
        root = root_cause([f for _, _, f in failed])
        if _consequence(root):
            failing = {rank for rank, _, _ in failed}
            if (wait := _cause_wait(root, [p for r, p in current.items() if r not in failing], now)) > 0:
                return Decision(state, events=tuple(events), pass_after=wait)
            root = _cause_unseen(root)
        return _on_failure(policy, state, pods, list(current.values()), root, now, events)

    gang_created = state.gang_created or len(current) == policy.nodes
    state = replace(state, gang_created=gang_created, create_refused="" if gang_created else state.create_refused)
    if stale:
        gone = [p.name for p in stale if not p.terminating]
        stuck = [p for p in stale if _stuck(p, now)]
        if held := [p for p in stuck if _stuck(p, now, policy.start_timeout_seconds)]:
            return _stuck_timed_out(policy, state, pods, held, now, events)
        phase = RESTARTING if state.phase == RESTARTING else PENDING
        msg = f"waiting for {len(stale)} pod(s) of an earlier attempt to go before starting attempt {state.attempt}"
        said = ", ".join(f"{p.name} (held by {holder(p)}; grace period ended {p.gone_by})" for p in stuck[:8])
        if stuck:
            said = f"{len(stuck)} pod(s) stuck terminating: {said}"
            msg = f"{msg}; {said}"
        return Decision(replace(state, phase=phase, message=msg, stuck=said),
                        delete_pods=(*gone, *undeleted(lost_pods)), stuck_pods=tuple(p.name for p in stuck),
                        events=tuple(events))

    # A lost pod still there holds its name: its replacement is created once it is gone.
    held = {p.rank for p in lost_pods}
    missing = tuple(r for r in range(policy.nodes) if r not in current and r not in held)
    not_before = from_iso(state.restart_not_before)
    if missing and not current and not_before and now < not_before:  # the restart backoff (the resync ends it)
        msg = (f"restarting: attempt {state.attempt}'s gang is created at {state.restart_not_before} (restart "
               f"backoff: {state.failures_in_a_row} gang restarts since a step was last trained)")
        return Decision(replace(state, phase=RESTARTING, message=msg), events=tuple(events))
    if policy.under_kueue:
        # The deadline clocks run from Kueue's admission of the gang, as for a Job that Kueue suspends while queued.
        queued = bool(missing) or any(p.queued for p in current.values())
        state = replace(state, start_time=None if queued else state.start_time or to_iso(now),
                        attempt_start_time=None if queued else state.attempt_start_time or to_iso(now))
    else:
        state = replace(state, attempt_start_time=state.attempt_start_time or to_iso(now))
        if missing:
            state = replace(state, start_time=state.start_time or to_iso(now))
    if missing:
        events.append(Event("Normal", "CreatingGang", f"creating {len(missing)} of {policy.nodes} pods "
                            f"(attempt {state.attempt})"))
    started = sum(p.phase in (RUNNING, SUCCEEDED) for p in current.values())
    if started == policy.nodes:
        msg = f"all {policy.nodes} pods running (attempt {state.attempt})"
        if state.phase != RUNNING:
            events.append(Event("Normal", "GangRunning", msg))
        return Decision(replace(state, phase=RUNNING, reason="GangRunning", message=msg), events=tuple(events))
    waiting = waiting_summary(list(current.values()))
    attempt_start = from_iso(state.attempt_start_time)
    if attempt_start and now >= attempt_start + timedelta(seconds=policy.start_timeout_seconds):
        return _start_timed_out(policy, state, pods, list(current.values()), started, waiting, now, events)
    msg = f"{started}/{policy.nodes} pods running (attempt {state.attempt})" + (f"; {waiting}" if waiting else "")
    if state.create_refused:
        msg = _with_refusal(msg, state.create_refused)
    phase = RESTARTING if state.phase == RESTARTING else PENDING
    reason = state.reason if phase == RESTARTING else "GangStarting"
    # A lost pod stuck terminating on a node that is gone is force-deleted like an earlier attempt's (its node's
    # kubelet will never confirm the deletion), so that its replacement can have its name.
    return Decision(replace(state, phase=phase, reason=reason, message=msg), create_ranks=missing,
                    delete_pods=undeleted(lost_pods), stuck_pods=tuple(p.name for p in lost_pods if _stuck(p, now)),
                    events=tuple(events))


def _set_aside_lost(state: GangState, current: dict[int, PodView]
                    ) -> tuple[GangState, dict[int, PodView], list[PodView]]:
    """For pods being replaced (state.replacing): the state, the current pods less the lost ones still there (a
    deleted pod terminating, an evicted one not yet deleted), and those lost pods. A replacement seen running
    (another uid under the same name) ends its entry."""
    if not state.replacing:
        return state, current, []
    lost_uids = dict(state.replacing)
    lost = [p for r, p in current.items() if r in lost_uids and lost_uids[r] and p.uid == lost_uids[r]]
    current = {r: p for r, p in current.items() if p not in lost}
    running = {r for r, p in current.items() if r in lost_uids and p.phase in (RUNNING, SUCCEEDED)}
    return replace(state, replacing=tuple(e for e in state.replacing if e[0] not in running)), current, lost


def _lost(pod: PodView | None, failure: Failure) -> bool:
    """Whether the pod was lost (deleted, evicted, its node gone) rather than its program having failed."""
    return pod is None or pod.terminating or pod.disrupted or pod.reason in DISRUPTIONS or \
        failure.reason == "PodDeleted"


def replaceable(policy: Policy, state: GangState, failed: Sequence[tuple[int, PodView | None, Failure]]) -> bool:
    """Whether the failed pods can be replaced alone: every one of them was lost, none is pod 0 (its agent hosts
    the gang's rendezvous store, which the others' agents keep using), no rule of the job asks for more than a
    restart (FailJob, RestartGang), the job restarts in place (its other pods' agents must start a round that
    waits for the replacement) with rounds left this attempt as rank 0 last reported, and Kueue does not manage
    it (its pod group is finished once a pod of it fails; a replacement would not be admitted)."""
    if not policy.in_place_limit or state.attempt_in_place_restarts >= policy.in_place_limit or policy.under_kueue:
        return False
    return all(rank != 0 and _lost(pod, f) and f.retryable and f.action in (None, "Ignore", "RestartInPlace")
               for rank, pod, f in failed)


def _replace(state: GangState, failed: Sequence[tuple[int, PodView | None, Failure]], now: datetime,
             events: list[Event]) -> Decision:
    """Recreate only the lost pods (the next passes create each once its old pod is gone); the others' agents
    restart their ranks in place, a round that waits for the replacements within startTimeoutSeconds, as the
    replacements' start does here."""
    root = root_cause([f for _, _, f in failed])
    count = state.attempt_pod_replacements + len(failed)
    names = ", ".join(f.pod or "?" for _, _, f in failed)
    msg = (f"{root.message}; replacing only {'pod' if len(failed) == 1 else 'pods'} {names} (pod replacement "
           f"{count} in attempt {state.attempt}): the other pods' ranks wait for it in place, then every rank "
           "restarts from the newest checkpoint; not counted against backoffLimit")
    new = replace(state, phase=RESTARTING, reason="ReplacingPod", message=msg, last_stop=root,
                  pod_replacements=state.pod_replacements + len(failed), attempt_pod_replacements=count,
                  replacing=(*state.replacing, *((rank, pod.uid if pod else "") for rank, pod, _ in failed)),
                  attempt_start_time=to_iso(now), last_restart_reason=f"{root.reason}: pod replaced",
                  last_restart_time=to_iso(now))
    doomed = undeleted([pod for _, pod, _ in failed if pod])  # an evicted pod holds its name
    gone = tuple(rank for rank, pod, _ in failed if pod is None)
    return Decision(new, create_ranks=gone, delete_pods=doomed, events=(*events, Event("Normal", "ReplacingPod", msg)))


def restarted_in_place(policy: Policy, state: GangState, progress: Mapping[str, Any] | None) -> Decision | None:
    """The state once rank 0's report shows in-place restarts this state has not counted yet (`paratrain node`
    restarted every rank in the same pods: nothing for the operator to do but say so), with an Event naming the
    rank that failed (a Warning), or the pod replaced (Normal: a stop is not the job's failure, and `failure`
    stays as it was); None when there are none."""
    count = as_int((progress or {}).get("restartsInPlace"), 0)
    start = (progress or {}).get("startStep")
    if count <= state.attempt_in_place_restarts or not isinstance(start, int):
        return None  # none new, or the round's rank 0 has not resumed yet: told once it says from which step
    resumed = f"from step {start}" if start else "from step 0: no checkpoint yet"
    said = (progress or {}).get("lastFailure") or {}
    node_rank, rank, code = (said.get(k) for k in ("nodeRank", "rank", "exitCode"))
    rounds = (f"in-place restart {count} of spec.restartPolicy.inPlaceLimit {policy.in_place_limit} in attempt "
              f"{state.attempt}")
    new = replace(state, in_place_restarts=state.in_place_restarts + count - state.attempt_in_place_restarts,
                  attempt_in_place_restarts=count)
    replaced = state.last_stop.pod if state.attempt_pod_replacements and state.last_stop else None
    if replaced and code in (contract.EXIT_RETRYABLE, contract.EXIT_PREEMPTED):  # its peers' ranks saw it go
        msg = f"pod {replaced} was replaced; every rank restarted in place, {resumed} ({rounds})"
        return Decision(new, events=(Event("Normal", "RestartedInPlace", msg),))
    pod = contract.pod_name(policy.name, state.attempt, node_rank) if isinstance(node_rank, int) else None
    what = ("a rank hung: the gang made no progress for spec.restartPolicy.hangSeconds, seen first by the agent "
            f"of rank {rank} in pod {pod} (exit code 79; each pod's log holds its ranks' stacks)"
            if pod and code == contract.EXIT_HUNG else
            f"rank {rank} in pod {pod} exited with code {code} ({describe_exit(code)})"
            if pod and isinstance(code, int) else "a rank failed")
    failure = Failure(reason="Error", pod=pod, exit_code=code if isinstance(code, int) else None, message=(
        f"{what}; every rank restarted in place, {resumed}, no pod replaced ({rounds})"))
    return Decision(replace(new, failure=failure), events=(Event("Warning", "RestartedInPlace", failure.message),))


def _resumed(state: GangState, progress: Mapping[str, Any] | None, said_elsewhere: bool
             ) -> tuple[GangState, list[Event]]:
    """The step this attempt resumed from, once its rank 0 says it, with an Event the first time where it is news:
    a gang restarted (from step N, or from 0 with no checkpoint yet) or a job that found a checkpoint. In-place
    rounds move the step with their own Event (`said_elsewhere`)."""
    start = (progress or {}).get("startStep")
    if not isinstance(start, int) or start == state.resumed_from:
        return state, []
    first, new = state.resumed_from is None, replace(state, resumed_from=start)
    if not first or said_elsewhere or not (state.attempt or start):
        return new, []
    msg = (f"attempt {state.attempt}'s ranks resumed from step {start}, their newest checkpoint" if start else
           f"attempt {state.attempt}'s ranks started from step 0: no checkpoint yet")
    return new, [Event("Normal", "TrainingResumed", msg)]


def _stuck(pod: PodView, now: datetime, seconds: float = STUCK_AFTER_SECONDS) -> bool:
    """Deleted, and still there `seconds` after its grace period ended (deletionTimestamp)."""
    gone_by = from_iso(pod.gone_by) if pod.terminating else None
    return gone_by is not None and now >= gone_by + timedelta(seconds=seconds)


def holder(pod: PodView) -> str:
    """What keeps a deleted pod in the API: its finalizers, else a kubelet that has not confirmed the deletion."""
    if pod.finalizers:
        return f"finalizer(s) {', '.join(pod.finalizers)} (the controller that owns them has not removed them)"
    return f"node {pod.node}, whose kubelet has not confirmed the deletion" if pod.node else "nothing known"


def _stuck_timed_out(policy: Policy, state: GangState, pods: Sequence[PodView], held: Sequence[PodView],
                     now: datetime, events: list[Event]) -> Decision:
    """A pod of an earlier attempt still terminating startTimeoutSeconds after its grace period ended: the next
    attempt would wait for it forever, so this one ends, naming the pod and what holds it."""
    pod = held[0]
    others = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
    message = (f"pod {pod.name}{others} of an earlier attempt has been terminating for longer than "
               f"spec.scheduling.startTimeoutSeconds ({policy.start_timeout_seconds}s past its grace period, which "
               f"ended {pod.gone_by}): held by {holder(pod)}; attempt {state.attempt} cannot start beside it")
    failure = Failure(reason="PodStuckTerminating", pod=pod.name, message=message, retryable=False)
    decision = fail(state, pods, failure, now, reason="StartTimeout", message=message)
    return replace(decision, events=(*events, *decision.events))


def waiting_summary(pods: Sequence[PodView], reasons: int = 4, names: int = 3, message_chars: int = 300) -> str:
    """Why pods wait, grouped by reason, largest group first: a count, the first few pod names and the first
    message of each. Its length is bounded whatever the gang's size (a 1,024-pod gang must still fit in status)."""
    groups: dict[str, list[PodView]] = {}
    for p in sorted(pods, key=lambda p: p.rank):
        if p.waiting:
            groups.setdefault(p.waiting.partition(": ")[0], []).append(p)
    ranked = sorted(groups.items(), key=lambda item: -len(item[1]))
    parts = []
    for reason, group in ranked[:reasons]:
        shown = ", ".join(p.name for p in group[:names])
        more = f" and {len(group) - names} more" if len(group) > names else ""
        message = clip(group[0].waiting.partition(": ")[2], message_chars)
        parts.append(f"{len(group)} {clip(reason, 64)} ({shown}{more})" + (f": {message}" if message else ""))
    if len(ranked) > reasons:
        parts.append(f"{sum(len(g) for _, g in ranked[reasons:])} waiting for {len(ranked) - reasons} other reason(s)")
    return "; ".join(parts)


def refused_create(state: GangState, what: str) -> GangState:
    """The state once a create of this attempt was refused (`what`: the pod and the API's message): the message
    and the CreateRefused condition name it until every pod exists, and a start timeout gives it as the reason."""
    return replace(state, create_refused=what, message=_with_refusal(state.message, what))


def _with_refusal(message: str, what: str) -> str:
    return f"{message}; cannot create {what}"


def _start_timed_out(policy: Policy, state: GangState, pods: Sequence[PodView], current: Sequence[PodView],
                     started: int, waiting: str, now: datetime, events: list[Event]) -> Decision:
    """The gang was not all running in startTimeoutSeconds: the job fails with what kept it waiting, its pods go,
    and no restart is counted (no step was trained; a new attempt would most likely wait the same way)."""
    missing = policy.nodes - len(current)
    if state.create_refused and missing:
        reason, why = "FailedCreate", f"{missing} pod(s) could not be created: {state.create_refused}"
    else:
        reason = _main_waiting_reason(current) or "NotRunning"
        why = waiting or f"{policy.nodes - started} pod(s) not running"
    message = (f"not all {policy.nodes} pods were running {policy.start_timeout_seconds}s after attempt "
               f"{state.attempt} began (spec.scheduling.startTimeoutSeconds; {started} running): {why}")
    if state.start_timeouts + 1 < policy.start_attempts:  # requeued, as Kueue requeues after waitForPodsReady
        stop = Failure(reason=reason, message=message, retryable=True)
        msg = (f"{message}; starting the gang afresh (start attempt {state.start_timeouts + 2} of "
               f"{policy.start_attempts}, spec.scheduling.startAttempts)")
        new = state.new_attempt(phase=RESTARTING, reason="StartTimeout", message=msg, last_stop=stop,
                                start_timeouts=state.start_timeouts + 1, last_restart_reason="StartTimeout",
                                last_restart_time=to_iso(now))
        return Decision(new, delete_pods=undeleted(current), events=(*events, Event("Warning", "StartTimeout", msg)))
    if policy.start_attempts > 1:
        message = f"{message}; startAttempts ({policy.start_attempts}) spent"
    failure = Failure(reason=reason, message=message, retryable=False)
    decision = fail(state, pods, failure, now, reason="StartTimeout", message=message)
    return replace(decision, events=(*events, *decision.events))


def trained_a_step(progress: Mapping[str, Any] | None) -> bool:
    """Whether rank 0's report shows a step trained by this run (past the checkpoint it resumed from)."""
    step, start = (progress or {}).get("step"), (progress or {}).get("startStep") or 0
    return isinstance(step, int) and isinstance(start, int) and step > start


def _main_waiting_reason(pods: Sequence[PodView]) -> str | None:
    """The reason most of the waiting pods give (Unschedulable, ImagePullBackOff, ...)."""
    reasons = [p.waiting.partition(": ")[0] for p in pods if p.waiting]
    return max(set(reasons), key=lambda r: (reasons.count(r), r)) if reasons else None


def _on_failure(policy: Policy, state: GangState, pods: Sequence[PodView], current: Sequence[PodView],
                root: Failure, now: datetime, events: list[Event]) -> Decision:
    if not root.retryable:
        decision = fail(state, pods, root, now, reason="FailurePolicy" if root.rule else None)
        return replace(decision, events=(*events, *decision.events))
    if root.preempted:  # stopped from outside (its ranks save the step in flight when they can), or ignored by a rule
        if state.uncounted_restarts >= policy.max_uncounted_restarts:
            msg = (f"{root.message}; runPolicy.maxUncountedRestarts ({policy.max_uncounted_restarts} gang restarts "
                   "not counted against backoffLimit) reached")
            decision = fail(state, pods, root, now, reason="MaxUncountedRestartsExceeded", message=msg)
            return replace(decision, events=(*events, *decision.events))
        what = "not counted" if root.rule else "a stop, not counted"
        new = state.restarted(now, phase=RESTARTING, last_stop=root, reason=root.reason,
                              uncounted_restarts=state.uncounted_restarts + 1)
        msg = (f"{root.message}; restarting the whole gang from its newest checkpoint{_after(new, now)} ({what} "
               "against backoffLimit)")
        event = Event("Normal", _stop_event_reason(root), msg)
        return Decision(replace(new, message=msg), delete_pods=undeleted(current), events=(*events, event))
    if state.restarts >= policy.backoff_limit:
        msg = f"{root.message}; backoffLimit ({policy.backoff_limit} gang restarts) reached"
        decision = fail(state, pods, root, now, reason="BackoffLimitExceeded", message=msg)
        return replace(decision, events=(*events, *decision.events))
    restarts = state.restarts + 1
    new = state.restarted(now, phase=RESTARTING, restarts=restarts, failure=root, reason=root.reason)
    msg = f"{root.message}; restarting the whole gang{_after(new, now)} (restart {restarts} of {policy.backoff_limit})"
    return Decision(replace(new, message=msg), delete_pods=undeleted(current),
                    events=(*events, Event("Warning", "RestartingGang", msg)))


def _stop_event_reason(stop: Failure) -> str:
    """A stop's Event: RestartingGang where a rule ignored a failure; PodDeleted for a deletion nobody gave a reason
    for (by hand, most often); Preempted where the deleter said why or the ranks saved their step on SIGTERM."""
    if stop.rule:
        return "RestartingGang"
    return "PodDeleted" if stop.reason == "PodDeleted" and not stop.stopped_by else "Preempted"


def _after(state: GangState, now: datetime) -> str:
    """When the restarted gang starts, where the restart backoff delays it."""
    not_before = from_iso(state.restart_not_before)
    if not_before is None or not_before <= now:
        return ""
    return (f" in {int((not_before - now).total_seconds())}s ({state.failures_in_a_row} restarts since a step was "
            "last trained: each waits twice as long)")


def undeleted(pods: Sequence[PodView]) -> tuple[str, ...]:
    """The pods not yet deleted, finished ones too: a whole gang goes so that the next attempt can reuse its
    hostnames (and rendezvous address); a lost pod so that its replacement can have its name."""
    return tuple(p.name for p in pods if not p.terminating)


def _suspend(state: GangState, pods: Sequence[PodView]) -> Decision:
    doomed = tuple(p.name for p in pods if not p.terminating)
    msg = f"suspended: deleting {len(doomed)} pod(s)" if doomed else "suspended"
    events = () if state.phase == SUSPENDED else (Event("Normal", "Suspended", msg),)
    new = replace(state, phase=SUSPENDED, gang_created=False, start_time=None, attempt_start_time=None,
                  create_refused="", reason="Suspended", message=msg)
    return Decision(new, delete_pods=doomed, events=events)


def _keep_finished(policy: Policy, state: GangState, pods: Sequence[PodView], now: datetime) -> Decision:
    """A finished job never gets new pods; leftovers still running are stopped; after the TTL the job goes."""
    ttl, done_at = policy.ttl_seconds_after_finished, from_iso(state.completion_time)
    expired = ttl is not None and done_at is not None and now >= done_at + timedelta(seconds=ttl)
    return Decision(state, delete_pods=_active(pods), delete_job=expired)
