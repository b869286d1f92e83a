"""kopf handlers, kept thin: each one runs a reconcile pass of one job (see reconcile.py).

Triggers: the job's creation, spec changes and operator restarts (resume); any change of a pod labelled with
the job's name (the pod cache's informer, started here, asks for those passes); and a resync loop (ours, every
RESYNC_SECONDS), which also reads training progress, notices a stalled job and the active deadline, and repairs
what a lost watch event hid. A finished job is not resynced unless its ttlSecondsAfterFinished is still to come:
it costs nothing. Deleting a job needs no handler: its ownerReferences let Kubernetes' garbage collector take the
gang. The resync is not a kopf timer because a kopf timer puts kopf's finalizer on every job, and then deleting a
job, or its namespace, waits for a running operator; without one, deletion never waits for the operator.

Settings (environment, set by `python -m paratrain_operator`'s flags): PARATRAIN_RESYNC_SECONDS (default 10),
PARATRAIN_METRICS_PORT (default 9090; 0: off), PARATRAIN_QPS and PARATRAIN_BURST (the API client's rate limit),
PARATRAIN_NAMESPACES (comma-separated; empty: all), PARATRAIN_WATCH_SECONDS (how long one pods watch request
lasts; default 300).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from paratrain.api import API_GROUP, API_VERSION, PLURAL
from paratrain.api.status import FAILED, SUCCEEDED

from . import kube, leader, metrics, observe, reconcile

JOB = (API_GROUP, API_VERSION, PLURAL)
RESYNC_SECONDS = float(os.environ.get("PARATRAIN_RESYNC_SECONDS", "10"))
METRICS_PORT = int(os.environ.get("PARATRAIN_METRICS_PORT", "9090"))
QPS = float(os.environ.get("PARATRAIN_QPS", str(kube.DEFAULT_QPS)))
BURST = int(os.environ.get("PARATRAIN_BURST", str(kube.DEFAULT_BURST)))
NAMESPACES = [n for n in os.environ.get("PARATRAIN_NAMESPACES", "").split(",") if n]
WATCH_SECONDS = float(os.environ.get("PARATRAIN_WATCH_SECONDS", "300"))
_tasks: list[asyncio.Task[None]] = []  # the pod informer, the resync loop, the Lease's renewal
# Bounded retries for change handlers; the resync timer keeps reconciling after they give up.
RETRIES, BACKOFF, TIMEOUT = 8, 5, 600


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    # The CR's status is this operator's (paratrain.api.status.JobStatus): kopf keeps its bookkeeping in
    # annotations, and our own Events replace kopf's log-line Events.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)
    settings.posting.enabled = False
    # Reconnect periodically even if a stream goes silent.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    kube.connect(kube.Kube.from_environment(QPS, BURST))
    loop = asyncio.get_running_loop()
    if leader.elector is not None:
        _tasks.append(loop.create_task(_keep_lease(leader.elector, logger)))
    reconcile.pods = observe.PodCache(NAMESPACES, changed=reconcile.request, watch_seconds=WATCH_SECONDS)
    _tasks.append(loop.create_task(reconcile.pods.run()))
    _tasks.append(loop.create_task(_resync_forever(logger)))
    if METRICS_PORT:
        metrics.serve(METRICS_PORT)
    logger.info("paratrain operator: resync every %ss, API rate limit %s/s (burst %s), metrics on :%s",
                RESYNC_SECONDS, QPS, BURST, METRICS_PORT or "off")


@kopf.on.probe(id="pods")
def pods_informer(**_: Any) -> dict[str, int]:
    """Liveness (kopf answers 500 when a probe fails): the pod cache every pass reads must be kept up to date."""
    problem = reconcile.pods.problem() if reconcile.pods is not None else "the pods informer has not started"
    if problem:
        raise kopf.PermanentError(problem)
    return {"cachedPods": len(reconcile.pods)}


async def _keep_lease(elector: leader.Elector, logger: logging.Logger) -> None:
    try:
        await elector.keep()
    except leader.LostLease as exc:
        # Another replica may act from now on: stop acting this instant, as client-go's elector does (the
        # container restarts and stands by).
        logger.error("%s: exiting", exc)
        logging.shutdown()
        os._exit(1)


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    """Stop every pass and write first (kopf's handlers are done by now; ours are cancelled and awaited, and the
    API client refuses any later request), then release the Lease: the standby may act the moment it is free."""
    for task in _tasks:
        task.cancel()
    await asyncio.gather(*_tasks, return_exceptions=True)
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
    """Unfinished jobs, and finished ones whose TTL is still to act."""
    finished = (body.get("status") or {}).get("phase") in (SUCCEEDED, FAILED)
    return not finished or ((body.get("spec") or {}).get("runPolicy") or {}).get("ttlSecondsAfterFinished") is not None


async def _resync_forever(logger: logging.Logger) -> None:
    """Every RESYNC_SECONDS, a pass of every job that may need one (all at once: a quiet job's pass sends nothing,
    and progress reads share one HTTP session)."""
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        due = [key for key, body in reconcile.jobs.items() if resync_due(body)]
        for (namespace, name), outcome in zip(due, await asyncio.gather(*(_resync(*key) for key in due),
                                                                         return_exceptions=True), strict=True):
            if isinstance(outcome, Exception):
                logger.warning("%s/%s: resync failed (the next one retries): %s", namespace, name, outcome)


async def _resync(namespace: str, name: str) -> None:
    await reconcile.refresh_progress(namespace, name)
    await reconcile.reconcile(namespace, name)


@kopf.on.event(*JOB)
async def job_event(type: str, namespace: str, name: str, body: kopf.Body, **_: Any) -> None:  # noqa: A002
    if type == "DELETED":
        reconcile.forget(namespace, name)
    else:
        reconcile.jobs.offer(body)
