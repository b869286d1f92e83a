"""The only module that writes to the API: idempotent creates, deletes, the status patch and Events.

Pods are created and deleted concurrently, in slow-start batches (1, 2, 4, ... as Kubernetes' Job controller
does): a gang the cluster refuses (quota, admission) fails after one request, not after a thousand; a gang it
accepts goes out as fast as the client's rate limit (kube.RateLimiter) lets it. Every create and patch asks for
strict field validation: a field the API server does not know (a renamed beta field) is an error, not silently
dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from paratrain.api import API_GROUP_VERSION, PLURAL
from paratrain.api.status import clip

from .clock import now, to_iso
from .gang import Event
from .kube import ApiError, api_path, client

log = logging.getLogger("paratrain.operator")
# The kinds the renderer builds. A PodGroup's CRD (Volcano's or scheduler-plugins') may be missing (404).
PLURALS = {"ConfigMap": "configmaps", "Service": "services", "Pod": "pods", "PodGroup": "podgroups",
           "Workload": "workloads", "NetworkPolicy": "networkpolicies"}
MERGE_PATCH = "application/merge-patch+json"
STRICT = {"fieldValidation": "Strict"}
# The largest slow-start batch: pod creates or deletes in flight at once for one job (--write-concurrency).
WRITE_CONCURRENCY = int(os.environ.get("PARATRAIN_WRITE_CONCURRENCY", "64"))
RENDER_CHUNK = 64  # pods built at a time (the next chunk while one is created): two chunks in memory at most
EVENT_MESSAGE_LIMIT = 1024
# The Events posted lately, by what they say → count: (namespace, job uid, type, reason, message).
POSTED_EVENTS_KEPT = 4096
_posted: OrderedDict[tuple[str, ...], int] = OrderedDict()
EVENT_TOKEN = "paratrain.dev/post"  # a random token a POST carries: a retried POST knows its own Event by it


class MissingResource(Exception):
    """The cluster does not serve a kind the job needs (e.g. Volcano's PodGroup without Volcano)."""


class Refused(ApiError):
    """The API server refused to create or delete one of a gang's objects (quota, admission, a name still held):
    its error, naming the object."""

    def __init__(self, verb: str, obj: Mapping[str, Any], error: ApiError) -> None:
        super().__init__(error.status, error.reason, error.message, error.retry_after)
        meta = obj.get("metadata") or {}
        self.verb = verb
        self.object = f"{obj.get('kind', 'Pod')} {meta.get('namespace')}/{meta.get('name')}"

    def __str__(self) -> str:
        return f"{self.object}: {self.message or self.reason}"


# The gang schedulers whose PodGroup is one per job, not per attempt (plan.plan_gang).
REUSED_POD_GROUPS = frozenset({"scheduling.volcano.sh/v1beta1", "scheduling.run.ai/v2alpha2",
                               "scheduling.x-k8s.io/v1alpha1"})


class Conflict(Exception):
    """A write conditional on a job's resourceVersion found a newer job: the pass must read it again."""


def _path(obj: Mapping[str, Any], *, named: bool) -> str:
    meta = obj["metadata"]
    return api_path(obj["apiVersion"], PLURALS[obj["kind"]], meta.get("namespace"), meta["name"] if named else None)


async def ensure(obj: Mapping[str, Any]) -> str | None:
    """Create `obj`; the uid of the object this call created, or None when it existed already.

    One that exists already (409) is fine if this job owns it (an earlier pass, or an operator killed midway,
    created it); a ConfigMap, or a Volcano, KAI or scheduler-plugins PodGroup (reused by every attempt), that exists is
    brought up to date (a new attempt may follow a spec change or an elastic resize). A name
    held by an object this job does not own, typically one of a same-named job deleted moments ago that the
    garbage collector or its kubelet has not removed yet, is an error until it goes: taken as ours, it would
    vanish under the gang."""
    try:
        created = await client().request("POST", _path(obj, named=False), body=obj, params=STRICT)
        return str(((created or {}).get("metadata") or {}).get("uid", ""))
    except ApiError as exc:
        if exc.status == 404 and obj["kind"] not in ("ConfigMap", "Service", "Pod"):
            raise MissingResource(f"the cluster does not serve {obj['kind']} ({obj['apiVersion']}): {exc.message}")
        if exc.status != 409:
            raise
        conflict = exc
    try:
        existing = await client().request("GET", _path(obj, named=True))
    except ApiError as exc:
        if exc.status != 404:
            raise
        existing = None
    if not _owned_alike(obj, existing):
        meta = obj["metadata"]
        held = "no longer exists" if existing is None else "is not this job's (an earlier job's, being deleted?)"
        raise ApiError(409, conflict.reason, f"{obj['kind']} {meta['namespace']}/{meta['name']} already exists but "
                       f"{held}: retrying until the name is free")
    if obj["kind"] == "ConfigMap":
        await client().request("PATCH", _path(obj, named=True), body={"data": obj.get("data") or {}},
                               content_type=MERGE_PATCH, params=STRICT)
    elif obj["kind"] == "PodGroup" and obj["apiVersion"] in REUSED_POD_GROUPS:
        # Reused by every attempt: an elastic gang's new size (minMember) must reach it.
        await client().request("PATCH", _path(obj, named=True), body={"spec": obj.get("spec") or {}},
                               content_type=MERGE_PATCH, params=STRICT)
    return None


def _owned_alike(obj: Mapping[str, Any], existing: Mapping[str, Any] | None) -> bool:
    """`existing` is alive and has the owner `obj` would have."""
    if existing is None or (existing.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return _owner_uids(existing) >= _owner_uids(obj)


def _owner_uids(obj: Mapping[str, Any]) -> set[str]:
    return {ref.get("uid") for ref in (obj.get("metadata") or {}).get("ownerReferences") or []}


async def in_batches(items: Sequence[Any], call: Callable[[Any], Awaitable[Any]],
                     limit: int | None = None, first: int = 1) -> list[Any]:
    """`call` on every item, concurrently in slow-start batches (`first`, then doubling up to `limit`, default
    WRITE_CONCURRENCY); the first error raised stops it after its batch (the rest of that batch still finishes).
    Returns the results in order."""
    limit = max(1, limit or WRITE_CONCURRENCY)
    results: list[Any] = []
    size = max(1, min(first, limit))
    while len(results) < len(items):
        batch = items[len(results):len(results) + size]
        outcomes = await asyncio.gather(*(call(item) for item in batch), return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            raise errors[0]
        results += outcomes
        size = min(size * 2, limit)
    return results


async def create_gang(shared: Sequence[Mapping[str, Any]], ranks: Sequence[int],
                      render_pods: Callable[[Sequence[int]], Sequence[Mapping[str, Any]]],
                      created: Callable[[str, str], None] = lambda name, uid: None) -> list[str]:
    """The gang's shared objects, then the pods of `ranks`, built by `render_pods` RENDER_CHUNK ranks at a time in a
    worker thread, each chunk while the one before is created (a 4,096-pod gang never has all its pods in memory,
    and building them never holds up the event loop); returns the pods it created, and tells `created` (name,
    uid) of each as soon as its create is answered.

    Safe to repeat after a crash at any point: only what is missing gets created."""
    for obj in shared:
        await ensure(obj)

    async def create(pod: Mapping[str, Any]) -> str | None:
        try:
            uid = await ensure(pod)
        except ApiError as exc:
            raise Refused("create", pod, exc) from exc
        if uid is not None:
            created(pod["metadata"]["name"], uid)
            return pod["metadata"]["name"]
        return None
    chunks = [ranks[start:start + RENDER_CHUNK] for start in range(0, len(ranks), RENDER_CHUNK)]
    names: list[str] = []
    built = asyncio.ensure_future(asyncio.to_thread(render_pods, chunks[0])) if chunks else None
    try:
        for i in range(len(chunks)):
            assert built is not None
            pods = await built
            # The next chunk is built while this one is created (its requests mostly wait on the API server).
            built = asyncio.ensure_future(asyncio.to_thread(render_pods, chunks[i + 1])) if i + 1 < len(chunks) \
                else None
            # The slow start is the gang's, not the chunk's: later chunks go at full concurrency.
            names += [name for name in await in_batches(pods, create, first=1 if i == 0 else WRITE_CONCURRENCY)
                      if name]
    finally:
        if built is not None:
            built.cancel()
    return names


async def delete_pods(namespace: str, names: Sequence[str],
                      deleted: Callable[[str], None] = lambda name: None) -> None:
    """Delete the pods, telling `deleted` of each as soon as its delete is answered (one already gone too)."""
    async def delete(name: str) -> None:
        try:
            await delete_pod(namespace, name)
        except ApiError as exc:
            raise Refused("delete", {"kind": "Pod", "metadata": {"namespace": namespace, "name": name}}, exc) from exc
        deleted(name)
    await in_batches(names, delete)


async def delete_pod(namespace: str, name: str) -> None:
    try:
        await client().request("DELETE", api_path("v1", "pods", namespace, name))
    except ApiError as exc:
        if exc.status != 404:
            raise


async def force_delete_pod(namespace: str, name: str, uid: str) -> None:
    """Delete the pod without waiting for its kubelet (grace period 0), only if it is still that pod (uid)."""
    options = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
    try:
        await client().request("DELETE", api_path("v1", "pods", namespace, name), body=options)
    except ApiError as exc:
        if exc.status not in (404, 409):
            raise Refused("delete", {"kind": "Pod", "metadata": {"namespace": namespace, "name": name}}, exc) from exc


async def delete_object(obj: Mapping[str, Any]) -> None:
    """Delete `obj` (a reference: apiVersion, kind, name, namespace); one already gone is fine."""
    try:
        await client().request("DELETE", _path(obj, named=True))
    except ApiError as exc:
        if exc.status != 404:
            raise


async def delete_job(namespace: str, name: str, uid: str) -> None:
    """Delete the job (its gang goes with it through ownerReferences); the uid guards a same-named new job."""
    options = {"propagationPolicy": "Background", "preconditions": {"uid": uid}}
    try:
        await client().request("DELETE", api_path(API_GROUP_VERSION, PLURAL, namespace, name), body=options)
    except ApiError as exc:
        if exc.status not in (404, 409):
            raise


async def patch_status(namespace: str, name: str, patch: Mapping[str, Any],
                       resource_version: str | None = None) -> dict[str, Any] | None:
    """Merge-patch the status subresource; the job as now stored, or None when the job is gone. With
    `resource_version`, only if the job is still at that version (else Conflict): the patch may be empty, to check
    that a pass about to act decided on the job as it is."""
    body: dict[str, Any] = {"status": dict(patch)}
    if resource_version:
        body["metadata"] = {"resourceVersion": resource_version}
    try:
        return await client().request("PATCH", api_path(API_GROUP_VERSION, PLURAL, namespace, name, "status"),
                                      body=body, content_type=MERGE_PATCH, params=STRICT)
    except ApiError as exc:
        if exc.status == 404:
            return None
        if exc.status == 409:
            raise Conflict(f"{namespace}/{name} changed since it was read") from exc
        raise


async def post_event(job: Mapping[str, Any], event: Event) -> None:
    """A Kubernetes Event on the job (`kubectl describe ptj`). Best effort: a lost Event never fails a reconcile.

    An Event saying what one already says (a pass repeating itself while pod creation keeps failing, say) raises
    that Event's count instead of adding another, as client-go's EventCorrelator does. Its name comes from what it
    says (job uid, type, reason, message), so a POST retried after a lost answer finds its own Event (the token it
    carries) instead of adding a second, and a new leader after a failover finds the old leader's and counts on."""
    meta = job["metadata"]
    stamp = to_iso(now())
    message = clip(event.message, EVENT_MESSAGE_LIMIT)
    key = (meta["namespace"], meta.get("uid") or meta["name"], event.type, event.reason, message)
    name = f"{meta['name']}.{hashlib.sha256(chr(31).join(key).encode()).hexdigest()[:16]}"
    path = api_path("v1", "events", meta["namespace"], name)
    try:
        if key in _posted:
            try:
                await _count(key, path, _posted[key] + 1, stamp)
                return
            except ApiError as exc:
                if exc.status != 404:  # 404: the Event expired (the API server keeps them an hour): post anew
                    raise
        token = uuid.uuid4().hex
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": meta["namespace"], "annotations": {EVENT_TOKEN: token}},
            "involvedObject": {"apiVersion": API_GROUP_VERSION, "kind": job.get("kind", "ParallelTrainJob"),
                               "name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid")},
            "type": event.type, "reason": event.reason, "message": message,
            "source": {"component": "paratrain-operator"}, "reportingComponent": "paratrain.dev/operator",
            "reportingInstance": socket.gethostname(), "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }
        try:
            await client().request("POST", api_path("v1", "events", meta["namespace"]), body=body, params=STRICT)
            _remember(key, 1)
        except ApiError as exc:
            if exc.status != 409:
                raise
            existing = await client().request("GET", path)
            count = int(existing.get("count") or 1)
            if ((existing.get("metadata") or {}).get("annotations") or {}).get(EVENT_TOKEN) == token:
                _remember(key, count)  # our own POST, sent again after its answer was lost
            else:
                await _count(key, path, count + 1, stamp)  # posted before, by this replica's predecessor
    except ApiError as exc:
        log.warning("could not post event %s on %s/%s: %s", event.reason, meta["namespace"], meta["name"], exc)


async def _count(key: tuple[str, ...], path: str, count: int, stamp: str) -> None:
    await client().request("PATCH", path, body={"count": count, "lastTimestamp": stamp}, content_type=MERGE_PATCH,
                           params=STRICT)
    _remember(key, count)


def _remember(key: tuple[str, ...], count: int) -> None:
    _posted[key] = count
    _posted.move_to_end(key)
    if len(_posted) > POSTED_EVENTS_KEPT:
        _posted.popitem(last=False)

