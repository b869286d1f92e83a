"""Elastic gangs (spec.elastic), pure: the gang decision (gang.decide) with shrinking and growing around it.

- Shrink: a pod of the current attempt that found no place (Unschedulable, or held by Kueue) for waitSeconds, while no
  pod of it failed (a failure goes through the failure policy first), ends the attempt: the next one is the largest
  size the job may take (paratrain.api.elastic) at most the pods that did find a place. A gang placed all or nothing
  shows no such count, so it steps down one size per waitSeconds. Its pods are deleted (their ranks save the step in
  flight where they can: a lost peer leaves the others at their newest checkpoint) and the smaller gang resumes from
  the checkpoint, resharded.
- Grow: while a shrunk gang runs, placeholder pods (contract.LABEL_PROBE: the gang's own scheduling, resources and
  queue, a command that only sleeps, no rank) ask the scheduler for the pods it lacks. Once some run, and waitSeconds
  have passed since the last resize, the gang grows to the largest size they make room for: its pods are stopped, save
  the step in flight (never mid-step) and the larger gang resumes there. The placeholders go with them.

A resize is a fresh attempt (new pod names, a new pod group: under Kueue a new Workload, admitted at its size), not
counted against backoffLimit; status.resizes records each (from, to, why, the steps lost), and an Event says it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from paratrain.api import elastic
from paratrain.api.status import Resize, clip

from . import gang
from .clock import from_iso, to_iso
from .gang import FINISHED, RESTARTING, RUNNING, SUSPENDED, Decision, Event, GangState, Policy
from .observe import PodView

RESIZES_KEPT = 16  # status.resizes' bound
Fits = Callable[[int], bool]


def any_size(nodes: int) -> bool:
    """Every size the job's rules allow fits (mode manual)."""
    return True


def decide(policy: Policy, state: GangState, pods: Sequence[PodView], probes: Sequence[PodView], now: datetime,
           progress: Mapping[str, Any] | None = None, fits: Fits = any_size) -> Decision:
    """gang.decide, shrinking first where pods wait for a place, then keeping the placeholders a shrunk running gang
    grows by (or growing it); `probes` are the job's placeholder pods, `pods` the others; `fits`: whether the gang
    can run at a size (under mode auto, whether the planner finds a layout for it)."""
    if (shrunk := shrink(policy, state, pods, now, progress, fits)) is not None:
        return _deleting(shrunk, probes)
    decision = gang.decide(policy, state, pods, now, progress)
    return probing(policy, _resumed(decision), pods, probes, now, progress, fits)


def _waited(pod: PodView, now: datetime) -> float:
    created = from_iso(pod.created_at)
    return (now - created).total_seconds() if created else 0.0


def _step(state: GangState, progress: Mapping[str, Any] | None) -> int | None:
    """The step trained last: rank 0's fresh report where there is one, else the status's (written less often)."""
    step = (progress or {}).get("step")
    return step if isinstance(step, int) else state.last_step


def shrink(policy: Policy, state: GangState, pods: Sequence[PodView], now: datetime,
           progress: Mapping[str, Any] | None = None, fits: Fits = any_size) -> Decision | None:
    """The decision to restart the gang smaller, or None (not elastic, nothing waited long enough, no smaller size)."""
    spec = policy.elastic
    if spec is None or spec.elastic is None or state.phase in FINISHED or state.phase == SUSPENDED or policy.suspend:
        return None
    current = [p for p in pods if p.attempt == state.attempt]
    wait = spec.elastic.wait_seconds
    unplaced = [p for p in current if p.unplaced and _waited(p, now) >= wait]
    if not unplaced or any(gang.classify(p) for p in current if not p.terminating):
        return None
    placed = sum(p.node is not None and p.active for p in current)
    size = elastic.largest_within(spec, policy.nodes - len(unplaced) if placed else policy.nodes - 1, fits=fits)
    if size is None:
        return None
    why = (f"{len(unplaced)} of {policy.nodes} pods found no place for spec.elastic.waitSeconds ({wait}s), e.g. "
           f"{unplaced[0].name}: {unplaced[0].waiting}")
    return _resized(policy, state, pods, size, "Shrunk", why, now, Event("Warning", "ShrinkingGang", ""),
                    _step(state, progress))


def probing(policy: Policy, decision: Decision, pods: Sequence[PodView], probes: Sequence[PodView],
            now: datetime, progress: Mapping[str, Any] | None = None, fits: Fits = any_size) -> Decision:
    """The decision with the placeholder pods a running, shrunk gang keeps (created where missing; the others
    deleted), or the decision to grow it once they run, the gang has trained a step since it started, and
    waitSeconds have passed since the last resize."""
    spec, state = policy.elastic, decision.state
    ours = [p for p in probes if p.attempt == state.attempt and not p.terminating and not p.done]
    high = elastic.bounds(spec)[1] if spec else 0
    if spec is None or state.phase != RUNNING or policy.nodes >= high or decision.delete_pods or \
            decision.create_ranks:
        return _deleting(decision, probes)
    running = sum(p.phase == RUNNING for p in ours)
    last = state.resizes[-1].time if state.resizes else None
    settled = gang.trained_a_step(progress) and (last is None or (now - last).total_seconds() >=
                                                 spec.elastic.wait_seconds)
    size = elastic.largest_within(spec, policy.nodes + running, least=policy.nodes, fits=fits) if settled else None
    if size is not None:
        why = f"{running} placeholder pod(s) found room for more pods"
        grown = _resized(policy, state, pods, size, "Grown", why, now, Event("Normal", "GrowingGang", ""),
                         _step(state, progress))
        return _deleting(grown, probes)
    have = {p.rank for p in ours}
    missing = tuple(r for r in range(policy.nodes, high) if r not in have)
    doomed = tuple(p.name for p in probes if not p.terminating and p not in ours)
    return replace(decision, create_probes=missing, delete_pods=(*decision.delete_pods, *doomed))


def _resized(policy: Policy, state: GangState, pods: Sequence[PodView], size: int, reason: str, why: str,
             now: datetime, event: Event, at_step: int | None) -> Decision:
    """A fresh attempt of `size` pods, recorded in status.resizes, with the Event saying so; the old pods deleted."""
    assert policy.elastic is not None
    before, after = policy.elastic, elastic.resized(policy.elastic, size)
    assert after is not None
    layout = ("the planner lays the new size out afresh" if before.parallelism.mode == "auto" else
              f"data {before.parallelism.data} → {after.parallelism.data}, gradient accumulation "
              f"{before.training.gradient_accumulation} → {after.training.gradient_accumulation}, the global batch "
              f"kept at {before.training.batch_size} sequences")
    how = ("its pods save the step in flight and a larger gang resumes there" if reason == "Grown" else
           "the smaller gang resumes from the newest checkpoint, resharded")
    msg = (f"{why}; {'growing' if reason == 'Grown' else 'shrinking'} the gang from {policy.nodes} to {size} pods "
           f"({layout}): {how} (attempt {state.attempt + 1}; not counted against backoffLimit)")
    record = Resize(time=now, attempt=state.attempt + 1, from_nodes=policy.nodes, to_nodes=size, reason=reason,
                    message=clip(why, 1024), at_step=at_step)
    new = state.new_attempt(phase=RESTARTING, nodes=size, reason=reason, message=msg,
                            resizes=(*state.resizes, record)[-RESIZES_KEPT:],
                            last_restart_reason=f"{reason}: {policy.nodes} → {size} pods", last_restart_time=to_iso(now))
    return Decision(new, delete_pods=gang.undeleted(pods), events=(replace(event, message=msg),))


def _resumed(decision: Decision) -> Decision:
    """Once the resized attempt's rank 0 says where it resumed, its resize records the step and the steps lost."""
    state = decision.state
    last = state.resizes[-1] if state.resizes else None
    if last is None or last.attempt != state.attempt or last.resumed_from_step is not None or \
            state.resumed_from is None:
        return decision
    lost = max(0, last.at_step - state.resumed_from) if last.at_step is not None else None
    done = last.model_copy(update={"resumed_from_step": state.resumed_from, "steps_lost": lost})
    return replace(decision, state=replace(state, resizes=(*state.resizes[:-1], done)))


def _deleting(decision: Decision, probes: Sequence[PodView]) -> Decision:
    """The decision, with every placeholder pod deleted too."""
    doomed = tuple(p.name for p in probes if not p.terminating and p.name not in decision.delete_pods)
    return replace(decision, delete_pods=(*decision.delete_pods, *doomed)) if doomed else decision
