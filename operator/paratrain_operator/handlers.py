"""kopf handlers, kept thin: each one runs a reconcile pass of one job (see reconcile.py).

Triggers: the job's creation, spec changes and operator restarts (resume); any change of a pod labelled with
the job's name (the pod cache's informer, started here, asks for those passes); and a periodic resync timer,
which also reads training progress, notices a stalled job and the active deadline, and repairs what a lost watch
event hid. A finished job has no timer unless its ttlSecondsAfterFinished is still to come: it costs nothing.
Deleting a job needs no handler: its ownerReferences let Kubernetes' garbage collector take the gang. (kopf puts
its finalizer on each job because of the timer, and takes it off when the job is deleted: while the operator is
down, a deleted job waits for it.)

Settings (environment, set by `python -m paratrain_operator`'s flags): PARATRAIN_RESYNC_SECONDS (default 10),
PARATRAIN_METRICS_PORT (default 9090; 0: off), PARATRAIN_QPS and PARATRAIN_BURST (the API client's rate limit),
PARATRAIN_NAMESPACES (comma-separated; empty: all), PARATRAIN_WATCH_SECONDS (how long one pods watch request
lasts, and how long a silent one is trusted; default 300).
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

from . import kube, metrics, observe, reconcile

JOB = (API_GROUP, API_VERSION, PLURAL)
RESYNC_SECONDS = float(os.environ.get("PARATRAIN_RESYNC_SECONDS", "10"))
METRICS_PORT = int(os.environ.get("PARATRAIN_METRICS_PORT", "9090"))
QPS = float(os.environ.get("PARATRAIN_QPS", str(kube.DEFAULT_QPS)))
BURST = int(os.environ.get("PARATRAIN_BURST", str(kube.DEFAULT_BURST)))
NAMESPACES = [n for n in os.environ.get("PARATRAIN_NAMESPACES", "").split(",") if n]
WATCH_SECONDS = float(os.environ.get("PARATRAIN_WATCH_SECONDS", "300"))
_informer: asyncio.Task[None] | None = None
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
    # A job deleted while its resync timer is mid-pass (the TTL's own pass deletes it) keeps kopf's finalizer until
    # the timer has exited: wait a little for that, then re-check every 2 s rather than kopf's default 60 s.
    settings.background.instant_exit_timeout = 0.5
    settings.background.cancellation_polling = 2
    kube.connect(kube.Kube.from_environment(QPS, BURST))
    global _informer
    reconcile.pods = observe.PodCache(NAMESPACES, changed=reconcile.request, watch_seconds=WATCH_SECONDS)
    _informer = asyncio.get_running_loop().create_task(reconcile.pods.run())
    if METRICS_PORT:
        metrics.serve(METRICS_PORT)
    logger.info("paratrain operator: resync every %ss, API rate limit %s/s (burst %s), metrics on :%s",
                RESYNC_SECONDS, QPS, BURST, METRICS_PORT or "off")


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if _informer is not None:
        _informer.cancel()
    await kube.client().close()
    await observe.close()


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


def _resync_due(status: Mapping[str, Any], spec: Mapping[str, Any], **_: Any) -> bool:
    """Unfinished jobs, and finished ones whose TTL is still to act."""
    finished = status.get("phase") in (SUCCEEDED, FAILED)
    return not finished or (spec.get("runPolicy") or {}).get("ttlSecondsAfterFinished") is not None


@kopf.timer(*JOB, interval=RESYNC_SECONDS, backoff=BACKOFF, when=_resync_due)
async def resync(namespace: str, name: str, body: kopf.Body, **_: Any) -> None:
    await reconcile.refresh_progress(namespace, name)
    await _reconcile(namespace, name, body)


@kopf.on.event(*JOB)
async def job_event(type: str, namespace: str, name: str, body: kopf.Body, **_: Any) -> None:  # noqa: A002
    if type == "DELETED":
        reconcile.forget(namespace, name)
    else:
        reconcile.jobs.offer(body)
