"""kopf handlers, kept thin: each one runs a reconcile pass of one job (see reconcile.py).

Triggers: the job's creation, spec changes and operator restarts (resume); any change of a pod labelled with
the job's name (the pod cache's informer, started here, asks for those passes); and a resync of each job (ours,
every RESYNC_SECONDS at the job's own offset, as a task of its own), which also reads training progress, notices a
stalled job and the active deadline, and repairs what a lost watch event hid. A finished job is not resynced unless its ttlSecondsAfterFinished is still to come:
it costs nothing. Deleting a job needs no handler: its ownerReferences let Kubernetes' garbage collector take the
gang. The resync is not a kopf timer because a kopf timer puts kopf's finalizer on every job, and then deleting a
job, or its namespace, waits for a running operator; without one, deletion never waits for the operator.

Settings (environment, set by `python -m paratrain_operator`'s flags): PARATRAIN_RESYNC_SECONDS (default 10),
PARATRAIN_METRICS_PORT (default 9090; 0: off), PARATRAIN_QPS and PARATRAIN_BURST (the API client's rate limit),
PARATRAIN_NAMESPACES (comma-separated; empty: all), PARATRAIN_PAGED_LISTS (non-empty: never stream lists),
PARATRAIN_WATCH_SECONDS (how long one pods watch request
lasts; default 300), PARATRAIN_PROGRESS_SECONDS (at most one progress-only status write a job this often; default
30; reconcile.py reads it).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from paratrain.api import API_GROUP, API_GROUP_VERSION, API_VERSION, KIND, PLURAL
from paratrain.api.status import FAILED, SUCCEEDED, SUSPENDED

from . import apply, decode, kube, leader, metrics, observe, reconcile, kopf_guard
from .gang import Event

JOB = (API_GROUP, API_VERSION, PLURAL)
RESYNC_SECONDS = float(os.environ.get("PARATRAIN_RESYNC_SECONDS", "10"))
METRICS_PORT = int(os.environ.get("PARATRAIN_METRICS_PORT", "9090"))
QPS = float(os.environ.get("PARATRAIN_QPS", str(kube.DEFAULT_QPS)))
BURST = int(os.environ.get("PARATRAIN_BURST", str(kube.DEFAULT_BURST)))
NAMESPACES = [n for n in os.environ.get("PARATRAIN_NAMESPACES", "").split(",") if n]
WATCH_SECONDS = float(os.environ.get("PARATRAIN_WATCH_SECONDS", "300"))
PAGED_LISTS = os.environ.get("PARATRAIN_PAGED_LISTS", "") not in ("", "0")
_tasks: list[asyncio.Task[None]] = []  # the pod informer, the resync loop, the Lease's renewal
_resyncs: dict[observe.JobKey, asyncio.Task[None]] = {}  # each job's resync in flight
# Bounded retries for change handlers; the resync timer keeps reconciling after they give up.
RETRIES, BACKOFF, TIMEOUT = 8, 5, 600
log = logging.getLogger("paratrain.operator")
# (uid, generation, reason) already told to the job's owner, oldest first (the oldest forgotten past the bound).
_unreadable_reported: dict[tuple[str, ...], None] = {}
UNREADABLE_KEPT = 4096


class SpecDigestStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's last-handled state of a job as a digest of its spec, not a copy of the spec and the job's annotations:
    such a copy of a large job passes the API server's 256 KiB limit on annotations, and kopf then retries the
    refused patch forever, holding it in memory (about 4 MB per 1 MiB job, measured). Only `on.update(field="spec")`
    reads it: a spec that changes changes the digest, under `spec`."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        spec = json.dumps(dict(body.get("spec") or {}), sort_keys=True, separators=(",", ":"), default=str)
        return {"spec": {"sha256": hashlib.sha256(spec.encode()).hexdigest()}}

    def fetch(self, *, body: kopf.Body) -> Any:
        return _annotation(body, self.make_keys(self.key, body=body))


class BoundedProgressStorage(kopf.AnnotationsProgressStorage):
    """kopf's handler progress in annotations, read through decode.loads: anyone who may edit a job may write
    its annotations (`kubectl annotate`), and kopf's own json.loads of a deep or broken one stopped the operator."""

    def fetch(self, *, key: Any, body: kopf.Body) -> Any:
        return _annotation(body, self.make_keys(key, body=body))


def _annotation(body: Mapping[str, Any], keys: Iterable[str]) -> Any:
    """The first of the `keys` annotations the job has, decoded within decode.MAX_DEPTH; None when it has none or
    it cannot be read (kopf then takes the job as never handled: a pass, which is idempotent)."""
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    for key in keys:
        if (encoded := annotations.get(key)) is not None:
            try:
                return decode.loads(encoded)
            except decode.Undecodable as exc:
                log.warning("%s/%s: annotation %s is %s; ignored", (body.get("metadata") or {}).get("namespace"),
                            (body.get("metadata") or {}).get("name"), key, exc.reason)
                return None
    return None


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    # The CR's status is this operator's (paratrain.api.status.JobStatus): kopf keeps its bookkeeping in
    # annotations, and our own Events replace kopf's log-line Events.
    settings.persistence.progress_storage = BoundedProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = SpecDigestStorage(prefix=API_GROUP)
    settings.posting.enabled = False
    # Reconnect periodically even if a stream goes silent.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    kube.connect(kube.Kube.from_environment(QPS, BURST))
    if leader.elector is not None:  # no write of ours, nor of kopf's, leaves past the Lease's renew deadline
        kube.client().write_guard = leader.elector.may_write
        kube.client().write_time_left = leader.elector.write_time_left
    # Jobs listed as watch events, one object a line, wherever the API server can (Kubernetes 1.34+, and 1.32):
    # one job the operator cannot read is then skipped alone (kopf_guard), not a whole page with it.
    plain = [n for n in NAMESPACES if not any(ch in n for ch in "*?[")]  # a namespaced RBAC may list only these
    settings.watching.initial_streaming = not PAGED_LISTS and await observe.streams_lists(
        kube.api_path(API_GROUP_VERSION, PLURAL, plain[0] if plain and len(plain) == len(NAMESPACES) else None))
    if not settings.watching.initial_streaming:  # pages kopf_guard can split, to skip one job it cannot read
        settings.watching.chunk_size = kopf_guard.LIST_LIMIT
    kopf_guard.install(on_undecodable=_report_unreadable, elector=leader.elector)
    loop = asyncio.get_running_loop()
    if leader.elector is not None:
        _tasks.append(loop.create_task(_keep_lease(leader.elector, logger)))
    reconcile.pods = observe.PodCache(NAMESPACES, changed=reconcile.request, watch_seconds=WATCH_SECONDS,
                                      relisted=reconcile.expectations.relisted)
    reconcile.pods.streaming = settings.watching.initial_streaming
    _tasks.append(loop.create_task(reconcile.pods.run()))
    _tasks.append(loop.create_task(_resync_forever(logger)))
    if METRICS_PORT:
        metrics.serve(METRICS_PORT)
    logger.info("paratrain operator: resync every %ss, API rate limit %s/s (burst %s), metrics on :%s",
                RESYNC_SECONDS, QPS, BURST, METRICS_PORT or "off")


@kopf.on.probe(id="pods")
def pods_informer(**_: Any) -> dict[str, int]:
    """Liveness (kopf answers 500 when a probe fails): the pod cache every pass reads must be kept up to date,
    and kopf's own watchers (the jobs') must be running."""
    problem = reconcile.pods.problem() if reconcile.pods is not None else "the pods informer has not started"
    if problem := problem or kopf_guard.problem():
        raise kopf.PermanentError(problem)
    return {"cachedPods": len(reconcile.pods)}


def _report_unreadable(exc: decode.Undecodable) -> None:
    """A job kopf's watch skipped (kopf_guard): counted, and told once per generation on the job itself, as a
    Warning Event and the status's reason and message, where its first bytes name it."""
    metrics.UNDECODABLE.inc()
    ref = exc.ref
    if ref.kind != KIND or not (ref.namespace and ref.name):
        return
    reconcile.forget(ref.namespace, ref.name)  # never acted on from a body older than what it now is (or gone)
    key = (ref.uid, ref.generation, exc.reason)
    if not ref.uid or key in _unreadable_reported:
        return
    _unreadable_reported[key] = None
    while len(_unreadable_reported) > UNREADABLE_KEPT:
        del _unreadable_reported[next(iter(_unreadable_reported))]
    task = asyncio.get_running_loop().create_task(_tell_unreadable(ref, exc.reason))
    _tasks.append(task)
    task.add_done_callback(_tasks.remove)


async def _tell_unreadable(ref: decode.ObjectRef, reason: str) -> None:
    message = (f"The operator skips this job: it is {reason} (the operator reads at most {decode.MAX_DEPTH}; a "
               "Kubernetes affinity needs about 10). Fix spec.scheduling.affinity or other free-form fields.")
    job = {"kind": KIND, "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid}}
    await apply.post_event(job, Event("Warning", "Unreadable", message))
    try:
        await apply.patch_status(ref.namespace, ref.name, {"reason": "Unreadable", "message": message})
    except kube.ApiError as exc:
        if exc.status != kube.UNDECODABLE:  # written: only its answer, the whole job again, cannot be read
            log.warning("%s: could not write its status: %s", ref, exc)


async def _keep_lease(elector: leader.Elector, logger: logging.Logger) -> None:
    try:
        await elector.keep()
    except Exception as exc:  # noqa: BLE001 (fail-stop: whatever ends renewals ends leadership)
        # Another replica may act from now on: stop acting this instant, as client-go's elector does (the
        # container restarts and stands by). Writes already stop at the renew deadline (Elector.may_write).
        elector.leading = False
        why = exc if isinstance(exc, leader.LostLease) else \
            f"could not renew Lease {elector.namespace}/{elector.name}: {type(exc).__name__}: {exc}"
        logger.error("%s: exiting", why)
        logging.shutdown()
        os._exit(1)


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    """Stop every pass and write first (kopf's handlers are done by now; ours are cancelled and awaited, and the
    API client refuses any later request), then release the Lease: the standby may act the moment it is free."""
    passes = [*_tasks, *_resyncs.values(), *reconcile.requested_passes()]
    for task in passes:
        task.cancel()
    await asyncio.gather(*passes, return_exceptions=True)
    await kube.client().stop()
    await observe.close()
    if leader.elector is not None:
        await leader.elector.release()
        await leader.elector.api.close()


async def _reconcile(namespace: str, name: str, body: Mapping[str, Any]) -> None:
    try:
        await reconcile.reconcile(namespace, name, body)
    except kube.ApiError as exc:
        if exc.transient:
            raise kopf.TemporaryError(f"API unavailable: {exc}", delay=exc.retry_after or BACKOFF) from exc
        raise


@kopf.on.resume(*JOB, retries=RETRIES, backoff=BACKOFF, timeout=TIMEOUT)
@kopf.on.create(*JOB, retries=RETRIES, backoff=BACKOFF, timeout=TIMEOUT)
@kopf.on.update(*JOB, field="spec", retries=RETRIES, backoff=BACKOFF, timeout=TIMEOUT)
async def job_changed(namespace: str, name: str, body: kopf.Body, **_: Any) -> None:
    await _reconcile(namespace, name, body)


def resync_due(body: Mapping[str, Any]) -> bool:
    """Unfinished jobs, and finished ones whose TTL is still to act; a suspended job costs nothing until it is
    resumed (the spec change that resumes it starts a pass; so do its pods' events while they go)."""
    phase = (body.get("status") or {}).get("phase")
    run_policy = (body.get("spec") or {}).get("runPolicy") or {}
    if phase == SUSPENDED and run_policy.get("suspend"):
        return False
    return phase not in (SUCCEEDED, FAILED) or run_policy.get("ttlSecondsAfterFinished") is not None


class ResyncSchedule:
    """When each job's next resync is due: every `period` seconds, at an offset of its own (from a hash of its
    name), so 500 jobs spread their progress reads and status writes over the period instead of all at once."""

    def __init__(self, period: float):
        self.period = period
        self._due: dict[observe.JobKey, float] = {}

    def take_due(self, keys: Iterable[observe.JobKey], now: float) -> list[observe.JobKey]:
        """The jobs among `keys` whose resync is due at `now`, each moved on to its next slot; forgets the rest."""
        keys = list(keys)
        for gone in self._due.keys() - set(keys):
            del self._due[gone]
        due = []
        for key in keys:
            at = self._due.setdefault(key, now + self.offset(key))
            if now >= at:
                due.append(key)
                self._due[key] = at + self.period * max(1, math.ceil((now - at) / self.period))
        return due

    def offset(self, key: observe.JobKey) -> float:
        digest = hashlib.blake2b("/".join(key).encode(), digest_size=4).digest()
        return self.period * int.from_bytes(digest, "big") / 2**32


async def _resync_forever(logger: logging.Logger) -> None:
    """Each job that may need one gets a pass every RESYNC_SECONDS, at its own offset in the period (ResyncSchedule),
    as a task of its own: a slow job (a rank 0 that answers late, a pass waiting on the API) delays only its own
    next resync, never another job's deadline or stall check."""
    schedule, loop = ResyncSchedule(RESYNC_SECONDS), asyncio.get_running_loop()
    while True:
        await asyncio.sleep(min(1.0, RESYNC_SECONDS / 4))
        due = [key for key, body in reconcile.jobs.items() if resync_due(body)]
        for key in schedule.take_due(due, loop.time()):
            if key not in _resyncs:  # the previous resync still runs: this slot is skipped, never stacked
                _resyncs[key] = task = loop.create_task(_resync(*key, logger))
                task.add_done_callback(lambda _, key=key: _resyncs.pop(key, None))


async def _resync(namespace: str, name: str, logger: logging.Logger) -> None:
    try:
        await reconcile.refresh_progress(namespace, name)
        await reconcile.reconcile(namespace, name)
    except Exception as exc:  # noqa: BLE001 (the next resync retries)
        logger.warning("%s/%s: resync failed (the next one retries): %s", namespace, name, exc)


@kopf.on.event(*JOB)
async def job_event(type: str, namespace: str, name: str, body: kopf.Body, **_: Any) -> None:  # noqa: A002
    if type == "DELETED":
        reconcile.forget(namespace, name)
    else:
        reconcile.jobs.offer(body)
