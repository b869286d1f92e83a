"""kopf handlers, kept thin: each one runs a reconcile pass of one job (see reconcile.py).

Triggers: the job's creation, spec changes and operator restarts (resume); any change of a pod labelled with
the job's name; and a periodic resync timer, which also polls training progress, notices a stalled job, the
active deadline and the TTL, and repairs whatever a dropped or silent watch hid. Deleting a job needs no
handler: its ownerReferences let Kubernetes' garbage collector take the gang. (kopf puts its finalizer on each
job because of the timer, and takes it off when the job is deleted: while the operator is down, a deleted job
waits for it.)

Settings (environment): PARATRAIN_RESYNC_SECONDS (default 10), PARATRAIN_METRICS_PORT (default 9090; 0: off).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from paratrain import contract
from paratrain.api import API_GROUP, API_VERSION, PLURAL

from . import kube, metrics, observe, reconcile

JOB = (API_GROUP, API_VERSION, PLURAL)
RESYNC_SECONDS = float(os.environ.get("PARATRAIN_RESYNC_SECONDS", "10"))
METRICS_PORT = int(os.environ.get("PARATRAIN_METRICS_PORT", "9090"))
# Bounded retries for change handlers; the resync timer keeps reconciling after they give up.
RETRIES, BACKOFF, TIMEOUT = 8, 5, 600


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    # The CR's status is this operator's (paratrain.api.status.JobStatus): kopf keeps its bookkeeping in
    # annotations, and our own Events replace kopf's log-line Events.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)
    settings.posting.enabled = False
    # Watch only the pods of jobs, server-side; reconnect periodically even if a stream goes silent.
    settings.watching.label_selectors["v1", "pods"] = contract.LABEL_JOB
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # A job deleted while its resync timer is mid-pass (the TTL's own pass deletes it) keeps kopf's finalizer until
    # the timer has exited: wait a little for that, then re-check every 2 s rather than kopf's default 60 s.
    settings.background.instant_exit_timeout = 0.5
    settings.background.cancellation_polling = 2
    kube.connect()
    if METRICS_PORT:
        metrics.serve(METRICS_PORT)
    logger.info("paratrain operator: resync every %ss, metrics on :%s", RESYNC_SECONDS, METRICS_PORT or "off")


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    await kube.client().close()
    await observe.close()


async def _reconcile(namespace: str, name: str) -> None:
    try:
        await reconcile.reconcile(namespace, name)
    except kube.ApiError as exc:
        if exc.transient:
            raise kopf.TemporaryError(f"API unavailable: {exc}", delay=exc.retry_after or BACKOFF) from exc
        raise


@kopf.on.resume(*JOB, retries=RETRIES, backoff=BACKOFF, timeout=TIMEOUT)
@kopf.on.create(*JOB, retries=RETRIES, backoff=BACKOFF, timeout=TIMEOUT)
@kopf.on.update(*JOB, field="spec", retries=RETRIES, backoff=BACKOFF, timeout=TIMEOUT)
async def job_changed(namespace: str, name: str, **_: Any) -> None:
    await _reconcile(namespace, name)


@kopf.timer(*JOB, interval=RESYNC_SECONDS, backoff=BACKOFF)
async def resync(namespace: str, name: str, **_: Any) -> None:
    await _reconcile(namespace, name)


@kopf.on.event("v1", "pods", labels={contract.LABEL_JOB: kopf.PRESENT})
async def pod_changed(namespace: str, labels: kopf.Labels, **_: Any) -> None:
    # Event handlers are not retried: a pass that fails here is redone by the resync timer.
    await _reconcile(namespace, labels[contract.LABEL_JOB])


@kopf.on.event(*JOB)
async def job_event(type: str, namespace: str, name: str, **_: Any) -> None:  # noqa: A002 (kopf's kwarg)
    if type == "DELETED":
        reconcile.forget(namespace, name)
