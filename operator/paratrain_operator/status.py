"""The job's status, pure: gang state + observed pods + training progress → the `status` object and the patch.

Fields written (all under `.status`):

    phase               Pending | Running | Restarting | Succeeded | Failed | Suspended
    reason, message     why the job is in that phase, for people (`kubectl describe`)
    layout              e.g. `data 2 × tensor 1 × pipeline 1, fp32` (printer column)
    observedGeneration  the spec generation this status describes
    attempt             gang attempt; pod names are `<job>-<attempt>-<rank>`
    restarts            failure-triggered gang restarts so far (limit: runPolicy.backoffLimit)
    inPlaceRestarts     rounds of in-place restarts so far (attemptInPlaceRestarts: this attempt's)
    podReplacements     pods replaced alone so far (attemptPodReplacements: this attempt's; replacing: those
                        under way, each {nodeRank, lostUid})
    gangCreated         every pod of this attempt has been seen (a pod missing after that was deleted)
    startTime, completionTime
    failure             {pod, exitCode, reason, message}: the root cause of the last restart or of the failure
    pods                {expected, pending, running, succeeded, failed, terminating}: the current attempt's pods
    progress            {step, totalSteps, loss, valLoss, tokensPerSecond, etaSeconds, updatedAt, phase}
                        as last reported by rank 0 (its clock for updatedAt)
    progressText        `step/totalSteps` (printer column)
    placement           a topology job's gang as it started running: {attempt, level, domains: [{domain,
                        nodeRanks}], splitGroups}
    nodes, resizes      an elastic gang's size as last resized, and each resize {time, attempt, fromNodes,
                        toNodes, reason, message, atStep, resumedFromStep, stepsLost} (resize.py)
    conditions          [{type, status, reason, message, lastTransitionTime}] for Running, Restarting,
                        Suspended, Succeeded, Failed and Stalled; lastTransitionTime changes only when status
                        flips; condition types written by others are kept as they are

The shape is `paratrain.api.status.JobStatus` (the CRD's status schema is generated from it): `build` goes through
that model, so a field the schema would prune fails a test here instead of vanishing on a real API server.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from paratrain import contract
from paratrain.api.planner import with_measurements
from paratrain.api.status import JobStatus, fit_to_schema, progress_text

from . import decode, gang
from .clock import from_iso, to_iso
from .gang import GangState
from .observe import PodView

PHASE_CONDITIONS = (gang.RUNNING, gang.RESTARTING, gang.SUSPENDED, gang.SUCCEEDED, gang.FAILED)
STALLED = "Stalled"
GANG_SCHEDULED = "GangScheduled"  # gang: kubernetes only: did kube-scheduler place the gang as a whole?
# Every top-level status key this module owns; a key it no longer writes is removed by the patch.
OWNED_KEYS = ("phase", "reason", "message", "layout", "platformDefaults", "observedGeneration", "attempt",
              "restarts", "inPlaceRestarts", "attemptInPlaceRestarts", "podReplacements", "attemptPodReplacements",
              "replacing", "gangCreated", "startTime", "attemptStartTime", "failuresInARow", "restartNotBefore",
              "uncountedRestarts", "startTimeouts", "restartsText", "lossText", "eta", "failureReason",
              "lastRestartReason", "lastRestartTime", "resumedFromStep",
              "completionTime", "failure", "lastStop",
              "pods", "progress", "progressText", "conditions", "plan", "nodes", "resizes", "placement")
_PROGRESS_NUMBERS = {"step": int, "startStep": int, "totalSteps": int, "loss": float, "valLoss": float,
                     "tokensPerSecond": int, "etaSeconds": float, "restartsInPlace": int,
                     "peakMemoryBytes": int}
_SIGNED = frozenset({"loss", "valLoss"})
_RANK_FAILURE_NUMBERS = ("rank", "nodeRank", "exitCode")
_TRAINER_PHASES = frozenset({"starting", "training", "done"})


def clean_progress(raw: Any) -> dict[str, Any] | None:
    """Rank 0's JSON → the progress block; nothing from a pod reaches status unchecked (types, finiteness,
    length), since the pod runs user code."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = decode.loads(raw)
        except decode.Undecodable:
            return None
    if not isinstance(raw, Mapping):
        return None
    out: dict[str, Any] = {}
    for key, kind in _PROGRESS_NUMBERS.items():
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        if value < 0 and key not in _SIGNED or kind is int and value >= 1 << 62:  # the schema's bounds
            continue
        out[key] = round(value) if kind is int else round(float(value), 6)
    if "step" not in out:
        return None
    updated = from_iso(raw.get("updatedAt"))
    if updated:
        out["updatedAt"] = to_iso(updated)
    if raw.get("phase") in _TRAINER_PHASES:
        out["phase"] = raw["phase"]
    failed = raw.get("lastFailure")
    if isinstance(failed, Mapping):
        numbers = {k: failed[k] for k in _RANK_FAILURE_NUMBERS
                   if isinstance(failed.get(k), int) and not isinstance(failed[k], bool) and 0 <= failed[k] < 1 << 31}
        if numbers:
            out["lastFailure"] = numbers
    return out


def restarts_text(state: GangState) -> str:
    """`1`, or `1 (2 in place, 1 pod replaced, 1 stop)`: the gang restarts counted against backoffLimit first,
    then every other kind, so that no restart goes unseen in `kubectl get ptj`."""
    others = [f"{n} {what}" for n, what in ((state.in_place_restarts, "in place"),
                                             (state.pod_replacements, "pod replaced" if state.pod_replacements == 1
                                              else "pods replaced"),
                                             (state.uncounted_restarts, "stop" if state.uncounted_restarts == 1
                                              else "stops")) if n]
    return f"{state.restarts}" + (f" ({', '.join(others)})" if others else "")


def duration(seconds: float) -> str:
    """`45s`, `12m30s`, `3h05m`, `2d04h`: as kubectl shows ages."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def pod_counts(nodes: int, attempt: int, pods: Sequence[PodView]) -> dict[str, int]:
    current = [p for p in pods if p.attempt == attempt and not p.terminating]
    count = {phase: sum(p.phase == phase for p in current) for phase in (gang.PENDING, gang.RUNNING,
                                                                           gang.SUCCEEDED, gang.FAILED)}
    return {"expected": nodes, "pending": count[gang.PENDING], "running": count[gang.RUNNING],
            "succeeded": count[gang.SUCCEEDED], "failed": count[gang.FAILED],
            "terminating": sum(p.terminating for p in pods)}


def set_condition(conditions: Sequence[Mapping[str, Any]], type_: str, status: bool, reason: str, message: str,
                  now: datetime) -> list[dict[str, Any]]:
    """Upsert one condition; lastTransitionTime moves only when its status flips."""
    value = "True" if status else "False"
    out, found = [], False
    for cond in conditions:
        if cond.get("type") != type_:
            out.append(dict(cond))
            continue
        found = True
        since = cond.get("lastTransitionTime") if cond.get("status") == value else None
        out.append({"type": type_, "status": value, "reason": reason, "message": message,
                    "lastTransitionTime": since or to_iso(now)})
    if not found:
        out.append({"type": type_, "status": value, "reason": reason, "message": message,
                    "lastTransitionTime": to_iso(now)})
    return out


def _condition(conditions: Sequence[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def stall(state: GangState, conditions: Sequence[Mapping[str, Any]], progress: Mapping[str, Any] | None,
          stall_timeout: int, now: datetime) -> tuple[bool, str, str] | None:
    """(stalled?, reason, message) while running; None when the question does not apply.

    Silent means: no step since the later of the gang becoming Running and rank 0's last update. A hung rank 0
    stops answering; a deadlocked one answers with an old updatedAt; both go silent."""
    if state.phase != gang.RUNNING:
        return None
    running = _condition(conditions, gang.RUNNING)
    since = [t for t in (from_iso((running or {}).get("lastTransitionTime")),
                         from_iso((progress or {}).get("updatedAt"))) if t]
    if not since:
        return None
    last = max(since)
    silent = (now - last).total_seconds()
    if silent > stall_timeout:
        step = (progress or {}).get("step")
        at = f" (last at step {step})" if step is not None else ""
        return True, "ProgressStalled", (f"no training progress for {int(silent)}s{at}, longer than "
                                         f"runPolicy.stallTimeoutSeconds ({stall_timeout}s)")
    return False, "Progressing", f"progress within runPolicy.stallTimeoutSeconds ({stall_timeout}s)"


def build(prev: Mapping[str, Any] | None, state: GangState, *, nodes: int, pods: Sequence[PodView],
          progress: Mapping[str, Any] | None, stall_timeout: int, generation: int | None, layout: str | None,
          now: datetime, platform_defaults: Sequence[str] = (), plan: Mapping[str, Any] | None = None,
          placement: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The whole status this operator owns (other keys in `prev` are left to their writers). `placement`: the
    attempt's, when read now; else the one read earlier in the same attempt is kept."""
    prev = prev or {}
    out: dict[str, Any] = {"phase": state.phase or gang.PENDING, "reason": state.reason, "message": state.message}
    if layout:
        out["layout"] = f"{layout} (planned)" if plan else layout
    if platform_defaults:  # once the platform fills nothing, the patch removes an earlier list (OWNED_KEYS)
        out["platformDefaults"] = list(platform_defaults)
    if generation is not None:
        out["observedGeneration"] = generation
    out.update(attempt=state.attempt, restarts=state.restarts, gangCreated=state.gang_created)
    if state.in_place_restarts:
        out["inPlaceRestarts"] = state.in_place_restarts
    if state.attempt_in_place_restarts:
        out["attemptInPlaceRestarts"] = state.attempt_in_place_restarts
    if state.pod_replacements:
        out["podReplacements"] = state.pod_replacements
    if state.attempt_pod_replacements:
        out["attemptPodReplacements"] = state.attempt_pod_replacements
    if state.replacing:
        out["replacing"] = [{"nodeRank": rank, "lostUid": uid} for rank, uid in state.replacing]
    for key, value in (("failuresInARow", state.failures_in_a_row), ("restartNotBefore", state.restart_not_before),
                       ("uncountedRestarts", state.uncounted_restarts), ("startTimeouts", state.start_timeouts)):
        if value:
            out[key] = value
    if state.start_time:
        out["startTime"] = state.start_time
    if state.attempt_start_time:
        out["attemptStartTime"] = state.attempt_start_time
    if state.completion_time:
        out["completionTime"] = state.completion_time
    if state.failure:
        out["failure"] = state.failure.to_status()
    if state.last_stop:
        out["lastStop"] = state.last_stop.to_status()
    out["pods"] = pod_counts(nodes, state.attempt, pods)
    out["restartsText"] = restarts_text(state)
    if state.phase == gang.FAILED and state.failure:
        out["failureReason"] = state.failure.reason or "Failed"
    if state.last_restart_reason and state.last_restart_time:
        out["lastRestartReason"], out["lastRestartTime"] = state.last_restart_reason, state.last_restart_time
    if state.resumed_from is not None:
        out["resumedFromStep"] = state.resumed_from
    if state.nodes:
        out["nodes"] = state.nodes
    if state.resizes:
        out["resizes"] = [r.dump() for r in state.resizes]
    kept = prev.get("placement")
    placement = placement or (kept if isinstance(kept, Mapping) and kept.get("attempt") == state.attempt else None)
    if placement:
        out["placement"] = dict(placement)
    if plan:  # mode auto's choice and, once this attempt has trained, what was measured beside its predictions
        out["plan"] = with_measurements(dict(plan), progress, contract.MEASURE_AFTER_STEPS)
    progress = progress or prev.get("progress")
    if progress:
        out["progress"] = dict(progress)
        if "totalSteps" in progress:
            out["progressText"] = progress_text(progress["step"], progress["totalSteps"])
        if isinstance(progress.get("loss"), (int, float)):
            out["lossText"] = f"{progress['loss']:#.4g}"
        if out["phase"] == gang.RUNNING and isinstance(progress.get("etaSeconds"), (int, float)):
            out["eta"] = duration(progress["etaSeconds"])
        if out["phase"] == gang.SUCCEEDED and progress.get("startStep", -1) >= progress.get("totalSteps", 1 << 62):
            # A re-applied job whose checkpoint already held its last step: it succeeded without training.
            out["message"] = (f"{state.message}; nothing was trained: the checkpoint was already at the last step "
                              f"({progress['totalSteps']}); raise spec.training.steps to train longer, or give "
                              "spec.checkpoint.path another directory to start afresh")

    conditions: list[dict[str, Any]] = [dict(c) for c in prev.get("conditions") or []]
    present = {c.get("type") for c in conditions}
    for type_ in PHASE_CONDITIONS:
        if type_ == out["phase"]:
            conditions = set_condition(conditions, type_, True, state.reason or type_, state.message, now)
        elif type_ in present:
            conditions = set_condition(conditions, type_, False, out["phase"], f"the job is {out['phase']}", now)
    if state.stuck:
        conditions = set_condition(conditions, gang.PODS_STUCK, True, "TerminatingPastGracePeriod", state.stuck, now)
    elif gang.PODS_STUCK in present:
        conditions = set_condition(conditions, gang.PODS_STUCK, False, "NoneStuck", "no pod is stuck terminating",
                                   now)
    if state.create_refused:
        conditions = set_condition(conditions, gang.CREATE_REFUSED, True, "FailedCreate", state.create_refused, now)
    elif gang.CREATE_REFUSED in present:
        conditions = set_condition(conditions, gang.CREATE_REFUSED, False, "Created",
                                   "no create of this attempt is refused", now)
    stalled = stall(state, conditions, progress, stall_timeout, now)
    if stalled:
        conditions = set_condition(conditions, STALLED, *stalled, now)
    elif STALLED in present:
        conditions = set_condition(conditions, STALLED, False, "NotRunning",
                                   f"only a running job can stall; this one is {out['phase']}", now)
    out["conditions"] = conditions
    return JobStatus.model_validate(fit_to_schema(JobStatus, out)).dump()


def patch(prev: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch turning `prev` into `new` for the keys this module owns (None deletes a key)."""
    prev = prev or {}
    out = {k: v for k, v in new.items() if prev.get(k) != v}
    out.update({k: None for k in OWNED_KEYS if k in prev and k not in new})
    return out


def stall_event(prev: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> gang.Event | None:
    """An Event when the Stalled condition flips (phase changes have their own Events)."""
    before, after = _condition(prev, STALLED), _condition(new, STALLED)
    if not after or (before or {}).get("status") == after.get("status"):
        return None
    if after.get("status") == "True":
        return gang.Event("Warning", "Stalled", after.get("message", ""))
    if (before or {}).get("status") == "True" and after.get("reason") == "Progressing":
        return gang.Event("Normal", "Progressing", "training progress resumed")
    return None


def gang_scheduled(pod_group: Mapping[str, Any] | None, name: str) -> tuple[bool, str, str]:
    """(placed whole?, reason, message) from a native PodGroup, read once its gang runs. kube-scheduler marks a
    group it placed whole `PodGroupInitiallyScheduled=True`; one without the GenericWorkload gate ignores the group
    and places the pods one by one, leaving no such condition: the cluster did not enforce the gang."""
    conditions = (pod_group or {}).get("status", {}).get("conditions") or []
    placed = next((c for c in conditions if c.get("type") == "PodGroupInitiallyScheduled"), None)
    if placed and placed.get("status") == "True":
        return True, "ScheduledAsGang", f"kube-scheduler placed the gang as a whole (PodGroup {name})"
    why = "does not exist" if pod_group is None else "has no PodGroupInitiallyScheduled=True condition"
    return False, "GangNotEnforced", (f"the pods run, but PodGroup {name} {why}: kube-scheduler placed them one by "
                                      "one, not all or nothing (is its GenericWorkload feature gate on?)")
