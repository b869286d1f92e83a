"""One reconcile pass of one job: observe → decide (gang) → persist (status) → act (apply).

Level-triggered and idempotent: every pass starts from a fresh read of the job and its pods, so it does not
matter which event triggered it, how many events were missed (a dropped watch, an operator restart) or where
the previous pass died. Passes of one job never overlap (one lock per job, one operator replica).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from paratrain.api import ParallelTrainJob, SpecError, layout_label, parse_job, require_cluster_ready

from . import apply, gang, metrics, observe, status
from .clock import now as clock_now
from .gang import Decision, Failure, GangState
from .observe import PodView
from .kube import ApiError
from .render import render_job

log = logging.getLogger("paratrain.operator")
_locks: dict[tuple[str, str], asyncio.Lock] = {}


def job_document(body: Mapping[str, Any]) -> dict[str, Any]:
    """The CR as the spec model reads it: kopf's annotations and the status stay out; the uid stays in (the
    renderer sets ownerReferences from it)."""
    meta = body.get("metadata") or {}
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid") if k in meta}, "spec": body.get("spec") or {}}


async def reconcile(namespace: str, name: str) -> str | None:
    """Run one pass; returns the job's phase, or None when the job is gone."""
    async with _locks.setdefault((namespace, name), asyncio.Lock()):
        started = time.monotonic()
        try:
            body = await observe.get_job(namespace, name)
            if body is None:
                forget(namespace, name)
                return None
            return await _pass(body)
        except Exception:
            metrics.RECONCILE_ERRORS.inc()
            raise
        finally:
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


def forget(namespace: str, name: str) -> None:
    """Drop what is kept in memory about a deleted job."""
    _locks.pop((namespace, name), None)
    metrics.forget(namespace, name)


async def _pass(body: dict[str, Any]) -> str | None:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    prev = body.get("status") or {}
    state, now = GangState.from_status(prev), clock_now()
    pods = [observe.pod_view(p) for p in await observe.list_pods(namespace, name, meta["uid"])]
    objects: list[dict[str, Any]] = []
    job: ParallelTrainJob | None = None
    try:
        job = require_cluster_ready(parse_job(job_document(body)))
    except SpecError as exc:
        decision = gang.invalid_spec(state, pods, "; ".join(str(p) for p in exc.problems), now)
    else:
        decision = gang.decide(gang.Policy.from_job(job), state, pods, now)
        if decision.create_ranks:
            try:
                objects = render_job(job, namespace, decision.state.attempt)
            except Exception as exc:  # noqa: BLE001 (a spec the renderer cannot build fails the job, visibly)
                decision = gang.fail(state, pods, Failure("RenderFailed", f"cannot build the gang: {exc}",
                                                      retryable=False), now)

    written = await _persist(body, prev, decision, job, pods)
    if written is None:
        return None  # the job was deleted meanwhile
    try:
        await _act(body, decision, objects)
    except (apply.MissingResource, ApiError) as exc:
        rejected = _rejection(exc)
        if rejected is None:
            raise  # transient, or maybe fixable (RBAC, quota): retried; the resync keeps trying
        decision = gang.fail(decision.state, pods, rejected, now)
        if await _persist(body, written, decision, job, pods) is not None:
            await _act(body, decision, [])
    metrics.record_phase(namespace, name, decision.state.phase or gang.PENDING)
    if decision.state.restarts > state.restarts:
        metrics.GANG_RESTARTS.labels(namespace).inc()
    return decision.state.phase


def _rejection(exc: Exception) -> Failure | None:
    """A gang the cluster will never accept, as the job's failure; None for errors worth retrying."""
    if isinstance(exc, apply.MissingResource):
        return Failure("MissingResource", str(exc), retryable=False)
    if isinstance(exc, ApiError) and exc.status in (400, 422):
        return Failure("RejectedByAPI", f"the API server rejected the gang: {exc.message}", retryable=False)
    return None


async def _persist(body: dict[str, Any], prev: Mapping[str, Any], decision: Decision, job: ParallelTrainJob | None,
                   pods: Sequence[PodView]) -> dict[str, Any] | None:
    """Write the decision's state (before any action: see gang's docstring) and post its Events; returns the status
    now stored, or None when the job is gone."""
    meta = body["metadata"]
    progress = await _progress(decision.state, pods)
    new = status.build(prev, decision.state, nodes=job.spec.nodes if job else 0, pods=pods, progress=progress,
                       stall_timeout=job.spec.run_policy.stall_timeout_seconds if job else 0,
                       generation=meta.get("generation"), layout=layout_label(job.spec) if job else None,
                       now=clock_now())
    patch = status.patch(prev, new)
    if patch and not await apply.patch_status(meta["namespace"], meta["name"], patch):
        return None
    events = list(decision.events)
    stalled = status.stall_event(prev.get("conditions") or [], new.get("conditions") or [])
    if stalled:
        events.append(stalled)
    for event in events:
        log.info("%s/%s: %s: %s", meta["namespace"], meta["name"], event.reason, event.message)
        await apply.post_event(body, event)
    return new


async def _progress(state: GangState, pods: Sequence[PodView]) -> dict[str, Any] | None:
    """Rank 0's report: polled while it runs; once it has exited, its termination message (the final one)."""
    rank0 = next((p for p in pods if p.attempt == state.attempt and p.rank == 0 and not p.terminating), None)
    if rank0 is None:
        return None
    if rank0.done:
        return status.clean_progress(rank0.termination_message)
    if state.phase == gang.RUNNING and rank0.phase == gang.RUNNING and rank0.ip:
        return status.clean_progress(await observe.fetch_progress(rank0.ip))
    return None


async def _act(body: dict[str, Any], decision: Decision, objects: Sequence[dict[str, Any]]) -> None:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    if decision.create_ranks and objects:
        created = await apply.create_gang(objects, decision.create_ranks)
        if created:
            log.info("%s/%s: created pods %s", namespace, name, ", ".join(created))
    for pod in decision.delete_pods:
        await apply.delete_pod(namespace, pod)
    if decision.delete_pods:
        log.info("%s/%s: deleting pods %s", namespace, name, ", ".join(decision.delete_pods))
    if decision.delete_job:
        log.info("%s/%s: ttlSecondsAfterFinished passed: deleting the job", namespace, name)
        await apply.delete_job(namespace, name, meta["uid"])
