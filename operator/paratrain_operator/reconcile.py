"""One reconcile pass of one job: observe → decide (gang) → persist (status) → act (apply).

Level-triggered and idempotent: a pass starts from what is known now of the job and its pods, so it does not
matter which trigger started it, how many were missed or where the previous pass died. What is known comes from
memory (observe.py): the job's newest body and a watch-fed cache of pods, not a GET and a LIST per pass. Two
rules keep a cached view from causing a wrong action:
- expectations: while the cache does not yet show a create or delete this operator made, the pass waits
  (the event that shows it triggers the next pass);
- every status write is conditional on the job's resourceVersion, and a pass that acts writes (an empty patch
  if need be) before acting: a stale job body costs a 409 and a re-read, never an action.

Passes of one job never overlap (one lock per job), and triggers coalesce: a pod event asks for a pass
COALESCE_SECONDS later, and one pass answers every trigger that came before it started. Rank 0's progress is
read outside the lock (by the resync timer), so a hung rank 0 never holds up a pass.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from paratrain.api import ParallelTrainJob, Problem, SpecError, describe_layout, parse_job
from paratrain.api import elastic, kueue, planner
from paratrain.api.memory import human, parse_bytes
from paratrain.api.platform import Platform, as_the_operator_takes_it, load_platform, spec_size_problem

from . import apply, gang, metrics, observe, planning, resize, status, topology
from .clock import from_iso, now as clock_now
from .gang import Decision, Failure, GangState
from .kube import ApiError
from .observe import JobKey, PodView
from .render import gang_objects, gang_pods, native_pod_group, probe_pods, superseded

log = logging.getLogger("paratrain.operator")
COALESCE_SECONDS = float(os.environ.get("PARATRAIN_COALESCE_SECONDS", "0.5"))
# A job whose pods keep changing (a large gang starting: thousands of events over tens of seconds) gets its passes
# further apart: the wait after a pod event doubles with each pass asked for within STREAK_SECONDS of the one
# before, up to MAX_COALESCE_SECONDS. A pod that ends, fails or is being deleted still gets a pass within
# COALESCE_SECONDS (it may start a restart).
MAX_COALESCE_SECONDS = 4.0
STREAK_SECONDS = MAX_COALESCE_SECONDS + 1
# A status write that moves nothing but training progress waits this long after the job's last one (rank 0 is
# still read every resync, and the stall check uses every read): 500 running jobs then make about 17 writes a
# second against the API budget they share with pod creates, not 50.
PROGRESS_SECONDS = float(os.environ.get("PARATRAIN_PROGRESS_SECONDS", "30"))
PROGRESS_KEYS = frozenset({"progress", "progressText"})
CONFLICT_RETRIES = 3
# A job whose creates or deletes the API server refused (after the client's own retries) sends its next ones this
# long after, doubling with each refusal in a row up to WRITE_BACKOFF_MAX (as the Job controller backs off), and
# from scratch once one goes through: a webhook that is down is not hammered every pass.
WRITE_BACKOFF_SECONDS, WRITE_BACKOFF_MAX = 1.0, 60.0
GANG_RECHECK_SECONDS = 60.0
# The platform's choices for every job (--platform FILE, which the Helm chart writes); the defaults without one.
PLATFORM = load_platform(os.environ["PARATRAIN_PLATFORM"]) if os.environ.get("PARATRAIN_PLATFORM") else Platform()

pods = observe.PodCache()  # replaced at startup (handlers.configure) by one for the served namespaces
jobs = observe.JobCache(max_spec_bytes=parse_bytes(PLATFORM.max_spec_bytes))
expectations = observe.Expectations()
_progress: dict[JobKey, tuple[str, dict[str, Any]]] = {}  # rank 0's pod → its last report
_superseded_gone: dict[JobKey, int] = {}  # the attempt whose predecessor's objects are deleted
_progress_written: dict[JobKey, float] = {}  # when a status write last carried the job's progress (monotonic)
_locks: dict[JobKey, asyncio.Lock] = {}
_issued = 0  # triggers so far (all jobs): a pass started after trigger t answers it
_answered: dict[JobKey, int] = {}
_scheduled: dict[JobKey, tuple[asyncio.Task[None], float]] = {}  # a pass asked for and not started: when it runs
_streaks: dict[JobKey, tuple[int, float]] = {}  # passes asked for in a row, and when the last one was
_tasks: set[asyncio.Task[None]] = set()
_write_backoff: dict[JobKey, tuple[int, float]] = {}  # refusals in a row, and when writes may go again (monotonic)
_backoff_passes: dict[JobKey, asyncio.Task[None]] = {}
_released_groups: dict[JobKey, set[str]] = {}  # Kueue groups whose Workload was deleted (_release_kueue_groups)
KUEUE_FINALIZER = "kueue.x-k8s.io/managed"
_force_deleted: dict[str, None] = {}  # uids of pods force-deleted (insertion-ordered, the oldest forgotten first)
FORCE_DELETED_KEPT = 4096  # the pass asked for at the end of a job's backoff


def job_document(body: Mapping[str, Any]) -> dict[str, Any]:
    """The CR as the spec model reads it: kopf's annotations and the status stay out; the uid stays in (the
    renderer sets ownerReferences from it), and so do the labels (Kueue's queue is one)."""
    meta = body.get("metadata") or {}
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "labels") if k in meta},
            "spec": body.get("spec") or {}}


def request(key: JobKey, urgent: bool = False) -> None:
    """Ask for a pass of the job soon (its pods changed). Requests share the pass already asked for; an urgent one
    (a pod ended or is being deleted) brings it forward to COALESCE_SECONDS."""
    loop = asyncio.get_running_loop()
    now = loop.time()
    if key in _scheduled:
        task, due = _scheduled[key]
        if not urgent or due <= now + COALESCE_SECONDS:
            return
        task.cancel()
    delay = COALESCE_SECONDS if urgent else coalesce_delay(key, now)
    task = loop.create_task(_later(key, delay))
    _scheduled[key] = (task, now + delay)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


def coalesce_delay(key: JobKey, now: float) -> float:
    """COALESCE_SECONDS, doubled for each pass asked for within STREAK_SECONDS of the one before, up to
    MAX_COALESCE_SECONDS: passes of a 1,024-pod start come at 0.5, 1.5, 3.5, 7.5 s, then every 4 s."""
    streak, last = _streaks.get(key, (0, float("-inf")))
    streak = streak + 1 if now - last < STREAK_SECONDS else 0
    _streaks[key] = (streak, now)
    return min(COALESCE_SECONDS * 2 ** min(streak, 16), max(MAX_COALESCE_SECONDS, COALESCE_SECONDS))


def requested_passes() -> list[asyncio.Task[None]]:
    """The passes asked for by pod events and not finished yet (a graceful stop cancels them)."""
    return list(_tasks)


async def _later(key: JobKey, delay: float) -> None:
    await asyncio.sleep(delay)
    _scheduled.pop(key, None)
    await _pass_logged(key)


async def _pass_logged(key: JobKey) -> None:
    """A pass whose failure is logged, not raised: the resync timer redoes it."""
    try:
        await reconcile(*key)
    except Exception as exc:  # noqa: BLE001
        log.warning("%s/%s: a pass failed (the resync retries): %s", *key, exc)


async def reconcile(namespace: str, name: str, body: Mapping[str, Any] | None = None) -> None:
    """Run one pass (unless a pass that started after this call answers it), from `body` or the newest body
    known of the job."""
    global _issued
    key = (namespace, name)
    _issued += 1
    ticket = _issued
    if body is not None:
        jobs.offer(body)
    async with _locks.setdefault(key, asyncio.Lock()):
        if _answered.get(key, 0) >= ticket:
            return
        _answered[key] = _issued
        started = time.monotonic()
        try:
            for _ in range(CONFLICT_RETRIES):
                current = jobs.get(key) or await _read(key)
                if current is None:
                    forget(namespace, name)
                    return
                try:
                    await _pass(current)
                    return
                except apply.Conflict:
                    await _read(key)  # another writer (kopf's annotations, a user) was first: read, redo
            raise ApiError(409, "Conflict", f"{namespace}/{name} kept changing under {CONFLICT_RETRIES} passes")
        except Exception:
            metrics.RECONCILE_ERRORS.inc()
            raise
        finally:
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


async def _read(key: JobKey) -> dict[str, Any] | None:
    body = await observe.get_job(*key)
    if body is not None:
        jobs.offer(body)
    return body


def forget(namespace: str, name: str) -> None:
    """Drop what is kept in memory about a deleted job."""
    key = (namespace, name)
    _locks.pop(key, None)
    _answered.pop(key, None)
    _streaks.pop(key, None)
    _progress.pop(key, None)
    _progress_written.pop(key, None)
    _superseded_gone.pop(key, None)
    _released_groups.pop(key, None)
    _write_backoff.pop(key, None)
    if (waiting := _backoff_passes.pop(key, None)) is not None:
        waiting.cancel()
    jobs.forget(key)
    expectations.forget(key)
    metrics.forget(namespace, name)


async def refresh_progress(namespace: str, name: str) -> None:
    """Read rank 0's progress report of a running job (outside the job's lock) for the next pass to write."""
    key = (namespace, name)
    body = jobs.get(key) or {}
    state = GangState.from_status(body.get("status"))
    if state.phase != gang.RUNNING:
        return
    rank0 = _rank0(state, pods.pods(namespace, name, body["metadata"].get("uid")))
    if rank0 is None or rank0.phase != gang.RUNNING or not rank0.ip:
        return
    report = status.clean_progress(await observe.fetch_progress(rank0.ip))
    if report:
        _progress[key] = (rank0.name, report)


def _rank0(state: GangState, views: Sequence[PodView]) -> PodView | None:
    return next((p for p in views if p.attempt == state.attempt and p.rank == 0 and not p.terminating and not p.probe),
                None)


async def _pass(body: dict[str, Any]) -> str | None:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    key = (namespace, name)
    prev = body.get("status") or {}
    state, now = GangState.from_status(prev), clock_now()
    refused = await pods.listed(namespace)
    if refused:  # an empty cache here says nothing of the job's pods: never act on it
        await apply.post_event(body, gang.Event("Warning", "PodsNotListed", f"{refused}; this job waits for it"))
        return prev.get("phase")
    everything = pods.pods(namespace, name, meta["uid"])
    unseen = expectations.unseen(key, everything)
    views, probes = [p for p in everything if not p.probe], [p for p in everything if p.probe]
    log.debug("%s/%s: pass (%d pods cached)", namespace, name, len(views))
    if unseen:
        log.debug("%s/%s: waiting for the watch to show %d of our own creates/deletes", namespace, name,
                  len(unseen))
        return prev.get("phase")
    gang_build: GangBuild | None = None
    job: ParallelTrainJob | None = None
    plan: dict[str, Any] | None = None  # status.plan, for a mode auto job
    filled: list[str] = []  # what the platform's jobDefaults filled in
    try:
        if (size := jobs.oversized(key)) is not None:  # not kept: refused before it is read
            raise SpecError([Problem("spec", spec_size_problem(size, PLATFORM) or "")])
        job, filled = as_the_operator_takes_it(parse_job(job_document(body)), PLATFORM)
        sized = job = at_its_size(job, state)  # what a resize resizes (under mode auto: before it is planned)
        if job.spec.parallelism.mode == "auto":
            job, plan = await _planned(job, prev, views, state)
    except SpecError as exc:
        decision = gang.invalid_spec(state, views, "; ".join(str(p) for p in exc.problems), now)
    else:
        policy = replace(gang.Policy.from_job(job), elastic=sized.spec if sized.spec.elastic else None)
        decision = resize.decide(policy, state, views, probes, now, _progress_of(body, state, views),
                                 await _sizes_that_fit(sized))
        if decision.create_ranks and not views and (held := over_namespace_limit(key, jobs.items())):
            # The decided state (a resume's new attempt included), without its creates and their clocks; the
            # Event once, when the job begins to wait.
            waiting = replace(decision.state, phase=gang.PENDING, reason="NamespaceJobLimit", message=held,
                              start_time=state.start_time, attempt_start_time=state.attempt_start_time)
            told = () if state.reason == "NamespaceJobLimit" else (gang.Event("Normal", "NamespaceJobLimit", held),)
            decision = Decision(waiting, events=(*decision.events, *told))
        if decision.create_ranks:
            try:
                # Off the event loop: thousands of pods take seconds of CPU, during which the Lease, the liveness
                # probe and every other job's pass would otherwise wait. The pods are built batch by batch as they
                # are created (apply.create_gang); the first one here, so that a spec the renderer cannot build
                # fails the job before anything is created.
                gang_build = await asyncio.to_thread(GangBuild.of, job, namespace, decision.state.attempt,
                                                     decision.create_ranks)
            except Exception as exc:  # noqa: BLE001 (a spec the renderer cannot build fails the job, visibly)
                failure = Failure(reason="RenderFailed", message=f"cannot build the gang: {exc}", retryable=False)
                decision = gang.fail(state, views, failure, now)

    if plan is not None and plan is not prev.get("plan"):
        decision = replace(decision, events=(*decision.events, _planned_event(plan, prev.get("plan"))))
    written = await _persist(body, decision, job, views, filled, plan)
    if written is None:
        forget(namespace, name)  # deleted meanwhile: its DELETED event may be one nobody could read
        return None
    try:
        await _act(written, decision, gang_build, views, job)
        await _delete_superseded(key, job, decision, views)
        await _release_kueue_groups(key, decision, everything)
    except (apply.MissingResource, ApiError) as exc:
        rejected = _rejection(exc)
        if rejected is None:
            if isinstance(exc, apply.Refused) and exc.reason not in ("Stopped", "NotLeading"):
                _back_off(key)
                await _report_refusal(written, decision, job, views, filled, exc)
            # Maybe fixable (quota freed, a name released, a webhook back): retried with backoff by the next
            # passes, until spec.scheduling.startTimeoutSeconds ends the attempt; transient errors likewise.
            raise
        decision = gang.fail(decision.state, views, rejected, now)
        written = await _persist_rejection(written, decision, job, views, filled)
        if written is not None:
            await _act(written, decision, None, views)
    metrics.record_phase(namespace, name, decision.state.phase or gang.PENDING)
    if decision.state.restarts > state.restarts:
        metrics.GANG_RESTARTS.labels(namespace).inc()
    return decision.state.phase


async def _sizes_that_fit(job: ParallelTrainJob) -> resize.Fits:
    """Whether an elastic gang can run at a size: every size its rules allow, and under mode auto one the planner
    finds a layout for (on the GPU the nodes' labels name, as the gang will be planned), asked only when a resize
    is weighed."""
    if job.spec.elastic is None or job.spec.parallelism.mode != "auto":
        return resize.any_size
    labels = await observe.gpu_node_labels(planning.GFD_PRODUCT) if job.spec.resources.gpus_per_node else None

    def fits(nodes: int) -> bool:
        spec = elastic.resized(job.spec, nodes)
        try:
            return spec is not None and bool(planning.plan_now(job.model_copy(update={"spec": spec}), labels,
                                                                PLATFORM, 0))
        except planner.NoPlan:
            return False
    return fits


def at_its_size(job: ParallelTrainJob, state: GangState) -> ParallelTrainJob:
    """The job as its current attempt runs it: an elastic gang at the size it last resized to (resize.py), where
    the spec still allows that size; else the spec's own."""
    if job.spec.elastic is None or not state.nodes or state.nodes == job.spec.nodes:
        return job
    spec = elastic.resized(job.spec, state.nodes)
    return job.model_copy(update={"spec": spec}) if spec is not None else job


async def _planned(job: ParallelTrainJob, prev: Mapping[str, Any], views: Sequence[PodView], state: GangState
                   ) -> tuple[ParallelTrainJob, dict[str, Any]]:
    """A mode auto job as its gang runs it, and its status.plan: the recorded layout while any pod of the job
    exists or once it has finished, else planned now (planning's docstring)."""
    kept = prev.get("plan")
    if kept and kept.get("layout") and (views or state.phase in gang.FINISHED):
        return planning.recorded(job, kept), kept
    labels = await observe.gpu_node_labels(planning.GFD_PRODUCT) if job.spec.resources.gpus_per_node else None
    try:
        # Off the event loop, as the gang's build: a search over thousands of layouts takes a fraction of a second.
        planned, plan = await asyncio.to_thread(planning.plan_now, job, labels, PLATFORM, state.attempt)
    except planner.NoPlan as exc:
        raise SpecError([Problem("spec.parallelism", str(exc))]) from None
    if kept and kept.get("layout") == plan["layout"] and kept.get("source") == plan["source"]:
        return planned, kept  # the same plan: its measurements stay
    return planned, plan


def _planned_event(plan: Mapping[str, Any], before: Mapping[str, Any] | None) -> gang.Event:
    what = "planned again (a fresh gang)" if before else "planned"
    return gang.Event("Normal", "Planned", (
        f"{what}: {plan['summary']}, for {plan['accelerator']} from {plan['source']}; predicted peak "
        f"{human(plan['predictedPeakBytes'])} a rank, {plan['predictedStepSeconds']:.3g} s a step "
        f"({plan['predictedTokensPerSecond']:,} tokens/s); {plan['feasible']} of {plan['considered']} layouts "
        "feasible"))


@dataclass(frozen=True)
class GangBuild:
    """What a pass creates: the gang's shared objects, built, and its pods, built on demand by rank."""

    job: ParallelTrainJob
    namespace: str
    attempt: int
    shared: list[dict[str, Any]]

    @classmethod
    def of(cls, job: ParallelTrainJob, namespace: str, attempt: int, ranks: Sequence[int]) -> GangBuild:
        gang_pods(job, namespace, attempt, ranks[:1])  # a spec the renderer cannot build fails here
        return cls(job, namespace, attempt, gang_objects(job, namespace, attempt, PLATFORM))

    def pods(self, ranks: Sequence[int]) -> list[dict[str, Any]]:
        return gang_pods(self.job, self.namespace, self.attempt, ranks)


async def _delete_superseded(key: JobKey, job: ParallelTrainJob | None, decision: Decision,
                             views: Sequence[PodView]) -> None:
    """Delete what the current attempt replaces (the previous attempt's native PodGroup) once its gang is being
    created or exists, in every pass until a delete succeeds: one that fails is retried by the next pass, not
    left behind. After a restart of the operator, the first pass of each job sends it once more (a 404)."""
    attempt = decision.state.attempt
    if job is None or _superseded_gone.get(key) == attempt or decision.state.phase in gang.FINISHED or not (
            decision.create_ranks or any(p.attempt == attempt for p in views)):
        return
    for obj in superseded(job, key[0], attempt):
        await apply.delete_object(obj)
    _superseded_gone[key] = attempt


async def _release_kueue_groups(key: JobKey, decision: Decision, pods: Sequence[PodView]) -> None:
    """Delete the Kueue Workload of each pod group of the job's, other than the current attempt's gang, whose pods
    are being deleted while Kueue's finalizer holds them: a group of deleted pods that were never admitted never
    ends (Kueue waits for their replacements), and deleting its Workload is how Kueue lets them go. Once per group,
    and only a Workload its own pods own."""
    current = kueue.pod_group(key[1], decision.state.attempt)
    held = {p.kueue_group for p in pods if p.kueue_group and p.kueue_group != current and p.terminating
            and KUEUE_FINALIZER in p.finalizers} - _released_groups.get(key, set())
    for group in sorted(held):
        ref = {"apiVersion": kueue.API_VERSION, "kind": "Workload", "metadata": {"namespace": key[0], "name": group}}
        try:
            workload = await observe.get_object(ref, "workloads")
            owners = {o.get("uid") for o in ((workload or {}).get("metadata") or {}).get("ownerReferences") or []}
            if workload is not None and owners & {p.uid for p in pods}:
                log.info("%s/%s: deleting Kueue's Workload %s, whose pods this job gave up", *key, group)
                await apply.delete_object(ref)
        except ApiError as exc:
            if exc.status != 403:
                raise
            log.warning("%s/%s: may not delete Kueue's Workload %s (its pods stay until Kueue lets them go): %s",
                        *key, group, exc)
        _released_groups.setdefault(key, set()).add(group)


async def _release_stuck(body: dict[str, Any], stuck: Sequence[str], views: Sequence[PodView]) -> None:
    """Pods stuck terminating: where their node is gone or tainted out-of-service no kubelet will confirm the
    deletion, so they are force-deleted (as the pod garbage collector does), once per pod, and the restart
    proceeds; elsewhere (a NotReady node may still run the containers, or nodes cannot be read) a second copy of
    a rank must never run beside them: they are reported and waited for, until startTimeoutSeconds ends the
    attempt (gang.decide)."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    by_name = {p.name: p for p in views}
    for name in stuck:
        pod = by_name[name]
        if pod.uid in _force_deleted:  # once: a finalizer keeps a force-deleted pod; saying it again helps nobody
            continue
        gone = await observe.node_gone(pod.node) if pod.node else True  # never bound: no kubelet holds it
        where = f"node {pod.node}" if pod.node else "no node"
        if gone:
            expectations.deleted(key, name, pod.uid)
            await apply.force_delete_pod(meta["namespace"], name, pod.uid)
            _force_deleted[pod.uid] = None
            while len(_force_deleted) > FORCE_DELETED_KEPT:
                _force_deleted.pop(next(iter(_force_deleted)))
            message = (f"pod {name} was stuck terminating past its grace period (ended {pod.gone_by}) on {where}, "
                       "which is gone or tainted out-of-service: force-deleted so that the gang can restart")
            await apply.post_event(body, gang.Event("Warning", "ForceDeleted", message))
        else:
            why = "still there and not tainted out-of-service" if gone is False else \
                "of unknown state (the operator may not read nodes)"
            message = (f"pod {name} is stuck terminating past its grace period (ended {pod.gone_by}), held by "
                       f"{gang.holder(pod)}; {where} is {why}: waiting (once the node is really down, taint it "
                       f"{observe.OUT_OF_SERVICE_TAINT}=nodeshutdown:NoExecute and the pod is force-deleted)")
            await apply.post_event(body, gang.Event("Warning", "PodStuck", message))


def _names(names: Sequence[str], shown: int = 8) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _rejection(exc: Exception) -> Failure | None:
    """A gang the cluster will never accept, as the job's failure; None for errors worth retrying."""
    if isinstance(exc, apply.MissingResource):
        return Failure(reason="MissingResource", message=str(exc), retryable=False)
    if not isinstance(exc, ApiError):
        return None
    if exc.status in (400, 422):
        what = exc if isinstance(exc, apply.Refused) else exc.message
        return Failure(reason="RejectedByAPI", message=f"the API server rejected the gang: {what}", retryable=False)
    if exc.status == 403 and "violates PodSecurity" in exc.message:
        # The namespace's Pod Security level forbids what the spec asks for (host network, IPC_LOCK): every retry
        # would be refused the same way.
        return Failure(reason="PodSecurity", message=f"the namespace's Pod Security admission refused {exc}",
                       retryable=False)
    return None


async def _report_refusal(body: dict[str, Any], decision: Decision, job: ParallelTrainJob | None,
                          views: Sequence[PodView], filled: Sequence[str], refused: apply.Refused) -> None:
    """A refused create or delete where the user looks: a Warning Event on the job (FailedCreate, FailedDelete;
    repeats raise its count) and, for a create, the status's message and CreateRefused condition, which
    also give the attempt's failure reason if startTimeoutSeconds ends it."""
    what = str(refused)
    if refused.verb == "create":
        timeout = job.spec.scheduling.start_timeout_seconds if job else 0
        state = gang.refused_create(decision.state, what)
        event = gang.Event("Warning", "FailedCreate", f"{what} (retrying until the gang runs, or for "
                           f"spec.scheduling.startTimeoutSeconds, {timeout}s, from the attempt's start)")
    else:
        state = replace(decision.state, message=f"cannot delete {what}; retrying")
        event = gang.Event("Warning", "FailedDelete", what)
    try:
        await _persist_rejection(body, Decision(state, events=(event,)), job, views, filled)
    except Exception as exc:  # noqa: BLE001 (the refusal itself is what the caller re-raises)
        log.warning("%s: could not record the refusal: %s", what, exc)


def over_namespace_limit(key: JobKey, known: Sequence[tuple[JobKey, Mapping[str, Any]]],
                         limit: int | None = None) -> str | None:
    """Why the job `key` may not start yet, where the platform caps the unfinished jobs of a namespace
    (maxJobsPerNamespace): the jobs already started there count first, then the waiting ones by creation; a job
    past the cap waits for one of them to finish or be suspended."""
    limit = PLATFORM.max_jobs_per_namespace if limit is None else limit
    if not limit:
        return None
    ahead, order = 0, {}
    for other, body in known:
        status, spec = body.get("status") or {}, body.get("spec") or {}
        if other[0] != key[0] or status.get("phase") in gang.FINISHED or (spec.get("runPolicy") or {}).get("suspend"):
            continue
        started = status.get("phase") not in (None, gang.PENDING, gang.SUSPENDED) or \
            bool(status.get("attemptStartTime"))
        order[other] = (not started, (body.get("metadata") or {}).get("creationTimestamp") or "", other[1])
    mine = order.get(key, (True, "~", key[1]))
    ahead = sum(place < mine for other, place in order.items() if other != key)
    if ahead < limit:
        return None
    return (f"waiting: {ahead} unfinished jobs in namespace {key[0]} start before this one, and the platform "
            f"lets {limit} run at once there (maxJobsPerNamespace); this job starts when one finishes or is suspended")


def _acts(decision: Decision) -> bool:
    return bool(decision.create_ranks or decision.delete_pods or decision.delete_job or decision.create_probes)


async def _persist(body: dict[str, Any], decision: Decision, job: ParallelTrainJob | None,
                   views: Sequence[PodView], filled: Sequence[str] = (), plan: Mapping[str, Any] | None = None
                   ) -> dict[str, Any] | None:
    """Write the decision's state (before any action: see gang's docstring), conditional on `body`'s
    resourceVersion, and post its Events; returns the job as now stored (`body` when nothing was written), or
    None when the job is gone. Raises apply.Conflict when the job changed since `body`."""
    meta, stored_status = body["metadata"], body.get("status") or {}
    prev, events = stored_status, list(decision.events)
    started = prev.get("phase") != gang.RUNNING
    if job is not None and decision.state.phase == gang.RUNNING and (started or _gang_unconfirmed(prev)):
        prev, warning = await _with_gang_check(prev, job, meta["namespace"], decision.state.attempt)
        events += [warning] if warning and started else []
    placed = None
    if job is not None and job.spec.scheduling.topology and decision.state.phase == gang.RUNNING and started:
        placed, told = await _placement(job, decision.state.attempt, views)
        events += told
    progress = _progress_of(body, decision.state, views)
    new = status.build(prev, decision.state, nodes=job.spec.nodes if job else 0, pods=views, progress=progress,
                       stall_timeout=job.spec.run_policy.stall_timeout_seconds if job else 0,
                       generation=meta.get("generation"), layout=describe_layout(job.spec) if job else None,
                       platform_defaults=filled, plan=plan, placement=placed, now=clock_now())
    patch = _paced((meta["namespace"], meta["name"]), status.patch(stored_status, new))
    stored = body
    if patch or _acts(decision):
        stored = await apply.patch_status(meta["namespace"], meta["name"], patch, meta.get("resourceVersion"))
        if stored is None:
            return None
        jobs.offer(stored)
    stalled = status.stall_event(stored_status.get("conditions") or [], new.get("conditions") or [])
    if stalled:
        events.append(stalled)
    for event in events:
        log.info("%s/%s: %s: %s", meta["namespace"], meta["name"], event.reason, event.message)
        await apply.post_event(body, event)
    return stored


async def _placement(job: ParallelTrainJob, attempt: int, views: Sequence[PodView]
                     ) -> tuple[dict[str, Any] | None, list[gang.Event]]:
    """status.placement of a topology job's gang as it starts running, and a Warning Event naming the node ranks
    that landed outside their group's domain with what the planner predicts that costs; nothing where the operator
    may not list nodes."""
    level = job.spec.scheduling.topology.level if job.spec.scheduling.topology else ""
    domains = await observe.node_domains(level)
    if domains is None:
        return None, []
    nodes = {p.rank: (p.name, p.node) for p in views if p.attempt == attempt and p.node and not p.terminating}
    placed, outliers = topology.placement(job, attempt, nodes, domains)
    if not outliers:
        return placed, []
    labels = await observe.gpu_node_labels(planning.GFD_PRODUCT) if job.spec.resources.gpus_per_node else None
    cost = await asyncio.to_thread(planning.split_cost, job.spec, labels, PLATFORM)
    named = "; ".join(f"node rank {o.rank} (pod {o.pod} on node {o.node}) is in {level}={o.domain or '(unset)'}, "
                      f"outside its group's {o.group_domain or '(unset)'} (node ranks {o.group[0]}-{o.group[1]})"
                      for o in outliers[:3])
    more = f" and {len(outliers) - 3} more" if len(outliers) > 3 else ""
    mode = job.spec.scheduling.topology.mode if job.spec.scheduling.topology else "required"
    message = (f"{named}{more}: {placed['splitGroups']} group(s) split across domains of {level} (mode {mode}); "
               f"{cost}")
    return placed, [gang.Event("Warning", "SplitAcrossDomains", message)]


def _paced(key: JobKey, patch: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """`patch`, or nothing when it moves only training progress and the job's last progress write is less than
    PROGRESS_SECONDS old. Progress rides along with any other change (a phase, a condition, pod counts)."""
    now = time.monotonic() if now is None else now
    if patch and patch.keys() <= PROGRESS_KEYS and now - _progress_written.get(key, -PROGRESS_SECONDS) < \
            PROGRESS_SECONDS:
        return {}
    if patch.keys() & PROGRESS_KEYS:
        _progress_written[key] = now
    return patch


def _gang_unconfirmed(prev: Mapping[str, Any]) -> bool:
    """GangScheduled is False, and was found so less than GANG_RECHECK_SECONDS ago: kube-scheduler may mark the
    PodGroup a moment after its pods run, so the passes of that first minute read it again."""
    condition = next((c for c in prev.get("conditions") or [] if c.get("type") == status.GANG_SCHEDULED), None)
    since = from_iso((condition or {}).get("lastTransitionTime"))
    return bool(condition and condition.get("status") == "False" and since
                and (clock_now() - since).total_seconds() < GANG_RECHECK_SECONDS)


async def _with_gang_check(prev: Mapping[str, Any], job: ParallelTrainJob, namespace: str,
                           attempt: int) -> tuple[Mapping[str, Any], gang.Event | None]:
    """`prev` with the GangScheduled condition of a native gang that runs (read when it starts running, and again
    while it reads False in the first minute), and a Warning Event when the gang was not enforced."""
    ref = native_pod_group(job, namespace, attempt)
    if ref is None:
        return prev, None
    name = ref["metadata"]["name"]
    placed, reason, message = status.gang_scheduled(await observe.get_object(ref, "podgroups"), name)
    conditions = status.set_condition(prev.get("conditions") or [], status.GANG_SCHEDULED, placed, reason, message,
                                      clock_now())
    return {**prev, "conditions": conditions}, None if placed else gang.Event("Warning", reason, message)


async def _persist_rejection(body: dict[str, Any], decision: Decision, job: ParallelTrainJob | None,
                             views: Sequence[PodView], filled: Sequence[str]) -> dict[str, Any] | None:
    """`_persist` a gang the API server refused, re-reading the job on a conflict instead of redoing the pass
    (which would send the refused objects again)."""
    for _ in range(CONFLICT_RETRIES):
        try:
            return await _persist(body, decision, job, views, filled)
        except apply.Conflict:
            fresh = await _read((body["metadata"]["namespace"], body["metadata"]["name"]))
            if fresh is None:
                return None
            body = fresh
    raise ApiError(409, "Conflict", f"{body['metadata']['name']} kept changing while its failure was written")


def _progress_of(body: Mapping[str, Any], state: GangState, views: Sequence[PodView]) -> dict[str, Any] | None:
    """Rank 0's report: the last one read while it runs; once it has exited, its termination message (the
    final one)."""
    rank0 = _rank0(state, views)
    if rank0 is None:
        return None
    if rank0.done:
        return status.clean_progress(rank0.termination_message)
    meta = body["metadata"]
    read = _progress.get((meta["namespace"], meta["name"]))
    return read[1] if read and read[0] == rank0.name and state.phase == gang.RUNNING else None


async def _act(body: dict[str, Any], decision: Decision, gang_build: GangBuild | None,
               views: Sequence[PodView], job: ParallelTrainJob | None = None) -> None:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    key = (namespace, name)
    if (decision.create_ranks or decision.delete_pods) and (wait := _backoff_left(key)) > 0:
        log.info("%s/%s: creates and deletes wait %.1fs more (backing off after refusals)", namespace, name, wait)
        _pass_after(key, wait)
    elif decision.create_ranks or decision.delete_pods:
        await _write_pods(key, decision, gang_build, views)
        _write_backoff.pop(key, None)
    if decision.create_probes and job is not None:
        await _create_probes(key, job, decision)
    if decision.pass_after:
        _pass_after(key, decision.pass_after)
    if decision.stuck_pods:
        await _release_stuck(body, decision.stuck_pods, views)
    if decision.delete_job:
        log.info("%s/%s: ttlSecondsAfterFinished passed: deleting the job", namespace, name)
        await apply.delete_job(namespace, name, meta["uid"])


async def _write_pods(key: JobKey, decision: Decision, gang_build: GangBuild | None,
                      views: Sequence[PodView]) -> None:
    namespace, name = key
    if decision.create_ranks and gang_build:
        created = await apply.create_gang(gang_build.shared, decision.create_ranks, gang_build.pods,
                                          created=lambda pod, uid: expectations.created(key, pod, uid))
        if created:
            log.info("%s/%s: created %d pods: %s", namespace, name, len(created), _names(created))
    if decision.delete_pods:
        uids = {p.name: p.uid for p in views}
        # Expected once answered: a delete that failed (or never went out) leaves nothing to wait for, and the
        # deletes that did go out are still waited for, whatever failed beside them.
        await apply.delete_pods(namespace, decision.delete_pods,
                                deleted=lambda pod: expectations.deleted(key, pod, uids.get(pod, "")))
        log.info("%s/%s: deleting %d pods: %s", namespace, name, len(decision.delete_pods),
                 _names(decision.delete_pods))


async def _create_probes(key: JobKey, job: ParallelTrainJob, decision: Decision) -> None:
    """An elastic gang's placeholder pods (resize.py); a refused one is retried by the next pass."""
    group = elastic.bounds(job.spec)[1] - job.spec.nodes
    for probe in probe_pods(job, key[0], decision.state.attempt, decision.create_probes, group):
        try:
            uid = await apply.ensure(probe)
        except ApiError as exc:
            log.warning("%s/%s: placeholder pod %s not created (the next pass retries): %s", *key,
                        probe["metadata"]["name"], exc)
            continue
        if uid is not None:
            expectations.created(key, probe["metadata"]["name"], uid)


async def _after_backoff(key: JobKey, delay: float) -> None:
    """A pass once a job's backoff is over (not `_later`'s: that one answers a pod event's request)."""
    await asyncio.sleep(delay)
    await _pass_logged(key)


def _back_off(key: JobKey) -> None:
    """One more refusal in a row: the job's next creates and deletes wait twice as long as the last ones did."""
    refusals = _write_backoff.get(key, (0, 0.0))[0] + 1
    delay = min(WRITE_BACKOFF_MAX, WRITE_BACKOFF_SECONDS * 2 ** (refusals - 1))
    _write_backoff[key] = (refusals, time.monotonic() + delay)
    _pass_after(key, delay)


def _backoff_left(key: JobKey) -> float:
    return _write_backoff.get(key, (0, 0.0))[1] - time.monotonic()


def _pass_after(key: JobKey, delay: float) -> None:
    """A pass of the job once `delay` seconds have passed (one at a time: a later call leaves the first, unless it
    comes from that pass itself)."""
    waiting = _backoff_passes.get(key)
    if waiting is not None and waiting is not asyncio.current_task() and not waiting.done():
        return
    task = asyncio.get_running_loop().create_task(_after_backoff(key, delay))
    _backoff_passes[key] = task
    _tasks.add(task)

    def done(finished: asyncio.Task[None]) -> None:
        _tasks.discard(finished)
        if _backoff_passes.get(key) is finished:
            del _backoff_passes[key]
    task.add_done_callback(done)
