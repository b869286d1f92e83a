"""What the operator reads: jobs, their pods and rank 0's progress endpoint, mostly from memory.

- `PodCache`: every job's pods (each parsed into a `PodView`), fed by one list + watch of labelled pods per served
  namespace (or one cluster-wide), as client-go's informers are. A pass reads it instead of listing: a 256-pod
  start costs the pod events once, not a LIST per event. A watch that ends resumes from its last
  resourceVersion; one refused with 410 Gone (history moved on) lists again and replaces the cache, so pods that
  went meanwhile go from it too; a stream silent for a minute (or `watch_seconds`, if shorter) is cut and
  resumed. Lists are paged (LIST_PAGE pods a request). A pass waits for its own namespace's first list only, and a
  namespace the operator may not list (403) is reported and skipped: its jobs wait, every other job goes on.
- `Expectations`: the creates and deletes this operator made whose watch events the cache has not shown yet
  (after `pkg/controller`'s ControllerExpectations). While any is outstanding, a pass does not decide: the cache
  might still show the old gang running, or miss the pods just created.
- `JobCache`: the newest body seen of each job (kopf's job events, our own status writes). Writes based on it
  are conditional on its resourceVersion, so a stale body costs a 409 and a re-read, never a wrong action.
"""

from __future__ import annotations

import asyncio
import copy
import fnmatch
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from paratrain import contract
from paratrain.api import API_GROUP_VERSION, PLURAL, kueue
from paratrain.api.platform import spec_bytes
from paratrain.api.status import FAILED, PENDING, SUCCEEDED

from . import decode
from .kube import UNDECODABLE, ApiError, api_path, client

log = logging.getLogger("paratrain.operator")
# A pods watch that says nothing (not even a bookmark) for this long is cut and resumed: a resumed watch costs
# little, and the API server redelivers what a silent stream held back.
SILENCE_SECONDS = 60.0
# A scope whose list or watch keeps failing this long makes the liveness probe fail: the pod restarts and lists
# afresh, and the failure shows as restarts, not as jobs quietly waiting on a cache that no longer moves.
UNHEALTHY_AFTER = 300.0
# Pods per LIST page (client-go's informers page by 500 too), where lists are not streamed: a relist of 10,000
# pods is 20 short requests, none near the client's timeout, and only one page is held as raw JSON at a time.
LIST_PAGE = 500
LIST_PAGE_BYTES = 16 << 20  # one page's JSON at most (a page over it is asked for again, smaller)
# A list streamed as watch events (Kubernetes' WatchList, on by default from 1.34 and in 1.32): each object is one
# event line, read within kube.MAX_EVENT_BYTES, so no relist holds more than one object's JSON at a time whatever
# the pods hold; the list ends at a bookmark annotated INITIAL_EVENTS_END.
STREAMING_LIST = {"sendInitialEvents": "true", "resourceVersionMatch": "NotOlderThan", "allowWatchBookmarks": "true"}
INITIAL_EVENTS_END = "k8s.io/initial-events-end"
STREAMED_LIST_SECONDS = 600.0  # a streamed list's watch request may last this long (its list must end within it)
PROGRESS_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
PROGRESS_MAX_BYTES = 64 * 1024  # a progress report is a few hundred bytes
PROGRESS_MIN_INTERVAL = 1.0  # seconds between two reads of one host
# Pod conditions by which whoever deletes a pod says why: Kubernetes' (eviction, preemption, a node's shutdown)
# and Kueue's (it stops a gang it preempts or evicts).
STOP_CONDITIONS = ("DisruptionTarget", "TerminationTarget")
PROGRESS_HOSTS_KEPT = 4096
_progress_session: aiohttp.ClientSession | None = None
_progress_read_at: dict[tuple[str, int], float] = {}  # (host, port) → when its last read started


def initial_events_end(event: Mapping[str, Any]) -> bool:
    """Whether a watch event is the bookmark that ends a streamed list."""
    if event.get("type") != "BOOKMARK":
        return False
    meta = (event.get("object") or {}).get("metadata") or {}
    return (meta.get("annotations") or {}).get(INITIAL_EVENTS_END) == "true"


async def streams_lists(path: str, patience: float = 30.0) -> bool:
    """Whether the API server streams lists of the collection at `path` (sendInitialEvents): it answers such a
    watch with its end bookmark, where one that cannot refuses it (400 or 422). A list that matches nothing is
    asked for, so the answer costs one short request. Transient refusals (a watch cache still initialising: 429)
    are retried for `patience` seconds; past that it says yes, as every supported release but 1.33 would."""
    params = {"labelSelector": f"{contract.LABEL_JOB}=paratrain-probe,!{contract.LABEL_JOB}", **STREAMING_LIST,
              "timeoutSeconds": "10"}
    deadline, delay = time.monotonic() + patience, 0.2
    while True:
        events = client().watch(path, params, silence=15)
        try:
            async for event in events:
                return initial_events_end(event)
            return False
        except ApiError as exc:
            if exc.status in (400, 422):
                log.info("the API server does not stream lists of %s (%s): kopf lists jobs page by page", path, exc)
                return False
            if not exc.transient or time.monotonic() + delay > deadline:
                log.warning("could not ask whether the API server streams lists (%s): assuming it does", exc)
                return True
        finally:
            await events.aclose()
        await asyncio.sleep(delay)
        delay = min(2.0, delay * 2)


@dataclass(frozen=True)
class PodView:
    """What the decisions need from one pod."""

    name: str
    attempt: int  # -1 when the label is missing or unreadable: never mistaken for the current attempt
    rank: int
    phase: str = PENDING  # Pending | Running | Succeeded | Failed | Unknown
    terminating: bool = False
    exit_code: int | None = None
    reason: str | None = None  # the pod's (Evicted) or else its container's (Error, OOMKilled)
    message: str | None = None
    finished_at: str | None = None
    waiting: str | None = None  # why it is not running yet (ImagePullBackOff, Unschedulable)
    queued: bool = False  # Kueue holds it (its admission gate) until the whole gang is admitted
    ip: str | None = None
    termination_message: str | None = None
    node: str | None = None  # the node it was bound to
    gone_by: str | None = None  # deletionTimestamp: when a deleted pod's grace period ends
    disrupted: bool = False  # a DisruptionTarget condition: evicted, preempted or its node shutting down
    stopped_by: str | None = None  # who asked it to stop, where a condition says: DisruptionTarget's or Kueue's
    # TerminationTarget's reason and message ("StoppedByKueue: Preempted to accommodate a higher priority Workload")
    oom_killed: bool = False  # the failed container was ended by the kernel's OOM killer (even where the pod's
    # own reason, e.g. Evicted, is what `reason` shows)
    uid: str = ""
    finalizers: tuple[str, ...] = ()  # what must let a deleted pod go before the API server removes it
    owners: frozenset[str] = frozenset()  # ownerReferences' uids: a same-named earlier job's pods are not ours
    created_at: str | None = None  # creationTimestamp: how long an unplaced pod has waited
    probe: bool = False  # an elastic gang's placeholder (contract.LABEL_PROBE): no rank; `rank` is the one it probes
    kueue_group: str | None = None  # the Kueue pod group it belongs to, where Kueue manages it

    @property
    def unplaced(self) -> bool:
        """Waiting for a place: held by Kueue, or found no node (Unschedulable), and not being deleted."""
        return self.node is None and not self.terminating and (self.queued or (self.waiting or "").startswith(
            "Unschedulable"))

    @property
    def done(self) -> bool:
        return self.phase in (SUCCEEDED, FAILED)

    @property
    def active(self) -> bool:
        """Still (about to be) running a program, and nobody asked it to stop."""
        return not self.done and not self.terminating


# A listed pod as the cache keeps it: (namespace, name), its job label, and its view (None when it has no job).
ListedPod = tuple[tuple[str, str], "str | None", "PodView | None"]


def listed_pod(pod: Mapping[str, Any]) -> ListedPod:
    meta = pod["metadata"]
    job = (meta.get("labels") or {}).get(contract.LABEL_JOB)
    return (meta["namespace"], meta["name"]), job, pod_view(pod) if job else None


def as_int(value: Any, default: int) -> int:
    """`value` as an int, or `default` when it is missing or unreadable (labels and status are strings)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def pod_view(pod: Mapping[str, Any]) -> PodView:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    labels = meta.get("labels") or {}
    statuses = status.get("containerStatuses") or []
    terminated = [s["state"]["terminated"] for s in statuses if (s.get("state") or {}).get("terminated")]
    # The container that failed says why the pod failed; a clean exit only counts if none failed.
    term = next((t for t in terminated if t.get("exitCode")), terminated[0] if terminated else {})
    waiting = next(((s.get("state") or {}).get("waiting") for s in statuses
                    if ((s.get("state") or {}).get("waiting") or {}).get("reason")), None)
    unschedulable = next((c for c in status.get("conditions") or []
                          if c.get("type") == "PodScheduled" and c.get("status") == "False"), None)
    blocker = waiting or unschedulable
    queued = kueue.ADMISSION_GATE in {g.get("name") for g in (pod.get("spec") or {}).get("schedulingGates") or []}
    if queued:  # the scheduler's own words say only "blocked by scheduling gates"
        blocker = {"reason": "QueuedByKueue", "message": "Kueue has not admitted the gang yet (LocalQueue "
                   f"{labels.get(kueue.QUEUE_LABEL)}, pod group {labels.get(kueue.POD_GROUP_LABEL)})"}
    return PodView(
        name=meta.get("name", ""),
        attempt=as_int(labels.get(contract.LABEL_ATTEMPT), -1),
        rank=as_int(labels.get(contract.LABEL_PROBE, labels.get(contract.LABEL_NODE_RANK)), -1),
        phase=status.get("phase") or PENDING,
        terminating=bool(meta.get("deletionTimestamp")),
        exit_code=term.get("exitCode"),
        reason=status.get("reason") or term.get("reason"),
        message=status.get("message") or term.get("message"),
        finished_at=term.get("finishedAt") or meta.get("deletionTimestamp"),
        waiting=f"{blocker.get('reason')}: {blocker.get('message', '')}".rstrip(": ") if blocker else None,
        queued=queued,
        ip=status.get("podIP"),
        termination_message=term.get("message"),
        node=(pod.get("spec") or {}).get("nodeName"),
        gone_by=meta.get("deletionTimestamp"),
        disrupted=any(c.get("type") == "DisruptionTarget" and c.get("status") == "True"
                      for c in status.get("conditions") or []),
        stopped_by=_stopped_by(status.get("conditions") or []),
        oom_killed=term.get("reason") == "OOMKilled",
        uid=meta.get("uid", ""),
        finalizers=tuple(str(f) for f in meta.get("finalizers") or ())[:8],
        owners=frozenset(ref.get("uid") for ref in meta.get("ownerReferences") or []),
        created_at=meta.get("creationTimestamp"),
        probe=contract.LABEL_PROBE in labels,
        kueue_group=labels.get(kueue.POD_GROUP_LABEL),
    )


def _stopped_by(conditions: list[Mapping[str, Any]], limit: int = 300) -> str | None:
    said = next((c for c in conditions if c.get("type") in STOP_CONDITIONS and c.get("status") == "True"), None)
    if said is None:
        return None
    return f"{said.get('reason') or said['type']}: {said.get('message') or ''}".rstrip(": ")[:limit]


JobKey = tuple[str, str]  # (namespace, job name)


class PodCache:
    """The pods of every job, by job, fed by list + watch (see the module docstring).

    `namespaces`: the namespaces served (plain names: one informer each, as a namespaced Role allows; any glob
    pattern: one cluster-wide informer, filtered); empty: all. `changed(key, urgent)` is called for every job whose
    pods changed: urgent when a pod ended, began terminating or went (a restart may be due)."""

    def __init__(self, namespaces: Sequence[str] = (),
                 changed: Callable[[JobKey, bool], None] = lambda key, urgent: None,
                 watch_seconds: float = 300, relisted: Callable[[str | None], None] = lambda scope: None):
        globbed = any(ch in n for n in namespaces for ch in "*?[")
        self.scopes: list[str | None] = [None] if globbed or not namespaces else list(namespaces)
        self._patterns = list(namespaces) if globbed else []
        self._changed, self._relisted, self.watch_seconds = changed, relisted, watch_seconds
        self._jobs: dict[JobKey, dict[str, PodView]] = {}
        self._job_of: dict[tuple[str, str], str] = {}  # (namespace, pod) → its job
        # Set once a scope has been listed, or refused (403): a pass waits for its own namespace's scope only.
        self._settled: dict[str | None, asyncio.Event] = {scope: asyncio.Event() for scope in self.scopes}
        self._refused: dict[str | None, str] = {}  # scope → why the operator may not list its pods
        self._failing_since: dict[str | None, float] = {}  # scope → when its list or watch began to fail
        self._last_error = ""
        self.stopped = False
        self.streaming = True  # list by streaming (sendInitialEvents) until the API server refuses it

    def pods(self, namespace: str, job: str, job_uid: str | None = None) -> list[PodView]:
        """The job's pods of any attempt; with `job_uid`, only those that job owns."""
        views = (self._jobs.get((namespace, job)) or {}).values()
        return [p for p in views if job_uid is None or job_uid in p.owners]

    def __len__(self) -> int:
        return len(self._job_of)

    async def listed(self, namespace: str) -> str | None:
        """Wait until the cache holds the pods of `namespace` (its scope listed once). Returns why it never will
        instead, when the operator may not list them: a pass must not act on an empty cache there."""
        scope = None if self.scopes == [None] else namespace
        settled = self._settled.get(scope)
        if settled is None:
            return f"the operator does not watch pods in namespace {namespace} (it serves {', '.join(self.scopes)})"
        await settled.wait()
        return self._refused.get(scope)

    async def run(self) -> None:
        """Keep every scope's informer going (until cancelled)."""
        try:
            await asyncio.gather(*(self._inform(scope) for scope in self.scopes))
        finally:
            self.stopped = True

    def problem(self, now: float | None = None) -> str | None:
        """Why the cache cannot be trusted, for the liveness probe (a restart lists afresh), or None: its informer
        ended, or a scope has failed to list or watch for UNHEALTHY_AFTER seconds."""
        now = time.monotonic() if now is None else now
        if self.stopped:
            return "the pods informer has stopped"
        # A refused scope is reported (log, its jobs' Events) but not a liveness failure: a restart cannot grant RBAC.
        failing = sorted((since, scope or "all namespaces") for scope, since in self._failing_since.items()
                         if now - since >= UNHEALTHY_AFTER and scope not in self._refused)
        if failing:
            since, scope = failing[0]
            return f"pods in {scope}: no list or watch has succeeded for {now - since:.0f} s: {self._last_error}"
        return None

    async def _inform(self, scope: str | None) -> None:
        path, selector = api_path("v1", "pods", scope), {"labelSelector": contract.LABEL_JOB}
        version: str | None = None
        failures = 0
        while True:
            try:
                if version is None and not self.streaming:
                    items, version = await self._list(path, selector)
                    self._listed(scope, items)
                if version is None:  # a streaming list: the initial pods as events, then the watch goes on
                    # Long enough for any list to arrive whole (a list cut short starts again from nothing).
                    params = {**selector, **STREAMING_LIST,
                              "timeoutSeconds": str(int(max(self.watch_seconds, STREAMED_LIST_SECONDS)))}
                else:
                    params = {**selector, "resourceVersion": version, "allowWatchBookmarks": "true",
                              "timeoutSeconds": str(int(self.watch_seconds))}
                listing: list[ListedPod | None] | None = [] if version is None else None
                async for event in client().watch(path, params,
                                                  silence=min(self.watch_seconds, SILENCE_SECONDS) + 5):
                    if listing is None:
                        version = self._apply_event(event) or version
                        self._failing_since.pop(scope, None)
                    elif initial_events_end(event):
                        version, listing = event["object"]["metadata"]["resourceVersion"], self._listed(scope, listing)
                    elif event.get("type") == "ADDED":
                        listing.append(self._read_listed(event.get("object")))
                    else:
                        self._apply_event(event)  # an ERROR ends the stream; a bookmark before the end says nothing
                if listing is not None:  # the stream ended before the list did: a failure, retried with backoff
                    raise ApiError(0, "ListCutShort", f"the pods list of {scope or 'all namespaces'} ended before "
                                   f"its last pod ({len(listing)} read)")
                failures = 0
            except ApiError as exc:
                if exc.status == 410:
                    version = None  # resuming (or an expired continue token) is refused: list again
                    continue
                if version is None and self.streaming and exc.status in (400, 422):
                    log.info("pods (%s): the API server does not stream lists (%s); paging instead",
                             scope or "all namespaces", exc)
                    self.streaming = False
                    continue
                failures = self._failed(scope, failures, exc)
                if exc.status == 403:
                    self._refuse(scope, exc)
                else:
                    log.warning("pods watch (%s): %s; retrying", scope or "all namespaces", exc)
                await asyncio.sleep(min(30.0, 0.5 * 2 ** min(failures, 6)))
            except Exception as exc:  # noqa: BLE001 (a malformed list, a bug: never end quietly, list again)
                failures = self._failed(scope, failures, exc)
                log.exception("pods informer (%s): %s; listing again", scope or "all namespaces", exc)
                version = None
                await asyncio.sleep(min(30.0, 0.5 * 2 ** min(failures, 6)))

    def _listed(self, scope: str | None, items: Sequence[ListedPod | None]) -> None:
        """A scope's list is complete: it replaces what the cache held there."""
        self._replace(scope, [item for item in items if item is not None])
        log.info("pods (%s): listed %d labelled pods (%s)", scope or "all namespaces", len(items),
                 "streamed" if self.streaming else "paged")
        self._failing_since.pop(scope, None)
        if self._refused.pop(scope, None):
            log.info("pods in %s: listed again, the refusal is over", scope or "all namespaces")

    @staticmethod
    def _read_listed(pod: Any) -> ListedPod | None:
        """One listed pod, or None (with a warning naming it) where the cache cannot read it."""
        try:
            return listed_pod(pod)
        except Exception as exc:  # noqa: BLE001 (one tenant's odd object never stops the list)
            meta = (pod.get("metadata") if isinstance(pod, Mapping) else None) or {}
            log.warning("pods list: skipped a pod it cannot read, %s/%s: %s: %s", meta.get("namespace", "?"),
                        meta.get("name", "?"), type(exc).__name__, exc)
            return None

    async def _list(self, path: str, selector: Mapping[str, str]) -> tuple[list[ListedPod | None], str]:
        """Every labelled pod of a scope, page by page (`limit`/`continue`), and the list's resourceVersion, where
        the API server does not stream lists. Each page is read within kube.MAX_RESPONSE_BYTES and parsed into
        views before the next is read: one page of raw JSON is held at a time. A page over LIST_PAGE_BYTES is asked
        for again at half the size, down to one pod (which always fits: etcd holds 1.5 MiB an object, 9 MiB as
        escaped JSON), and each page after it at twice the size of the one before, up to LIST_PAGE. The pages are
        one consistent snapshot; a continue token that expired (410) ends the list, and the informer lists again
        from the start."""
        listed: list[ListedPod | None] = []
        limit, token = LIST_PAGE, ""
        while True:
            params = {**selector, "limit": str(limit), **({"continue": token} if token else {})}
            try:
                page = await client().request("GET", path, params=params, max_bytes=LIST_PAGE_BYTES)
            except ApiError as exc:
                if exc.status != UNDECODABLE or limit == 1:
                    raise
                limit = max(1, limit // 2)
                continue
            listed += [self._read_listed(pod) for pod in page.get("items") or []]
            meta = page["metadata"]
            if not meta.get("continue"):
                return listed, meta["resourceVersion"]
            token, limit = meta["continue"], min(LIST_PAGE, limit * 2)  # back up to full pages past the big pods

    def _refuse(self, scope: str | None, exc: ApiError) -> None:
        """The operator may not list or watch this scope's pods: said once in the log and to every job there (a
        pass there sends an Event instead of acting), retried with backoff; the other scopes go on."""
        where = f"namespace {scope}" if scope else "all namespaces"
        why = f"the operator may not list pods in {where} ({exc.status} {exc.reason}: {exc.message[:200]})"
        if scope not in self._refused:
            log.warning("%s; its jobs wait until the operator's RBAC allows it (retrying)", why)
        self._refused[scope] = why
        self._settled[scope].set()

    def _failed(self, scope: str | None, failures: int, exc: Exception) -> int:
        self._failing_since.setdefault(scope, time.monotonic())
        self._last_error = f"{type(exc).__name__}: {exc}"[:300]
        return failures + 1

    def _apply_event(self, event: Mapping[str, Any]) -> str | None:
        """`_apply`, with an event it cannot read skipped (with a warning naming the pod) instead of ending the
        watch: one tenant's odd object must not stop the cache for every job."""
        try:
            return self._apply(event)
        except ApiError:
            raise  # an ERROR event: the watch ends and the informer lists again
        except Exception as exc:  # noqa: BLE001
            obj = event.get("object")
            meta = (obj.get("metadata") if isinstance(obj, Mapping) else None) or {}
            where = f"{meta.get('namespace', '?')}/{meta.get('name', '?')}" if isinstance(meta, Mapping) else "?"
            log.warning("pods watch: skipped an event it cannot read for %s: %s: %s", where, type(exc).__name__,
                        exc)
            return None

    def _apply(self, event: Mapping[str, Any]) -> str | None:
        """One watch event into the cache; returns the resourceVersion it moves the watch to."""
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            raise ApiError(as_int(obj.get("code"), 500), str(obj.get("reason", "")), str(obj.get("message", "")))
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            self._put(obj)
        elif kind == "DELETED":
            self._drop((obj["metadata"]["namespace"], obj["metadata"]["name"]))
        return version

    def _served(self, namespace: str) -> bool:
        return not self._patterns or any(fnmatch.fnmatchcase(namespace, p) for p in self._patterns)

    def _put(self, pod: Mapping[str, Any]) -> None:
        self._store(listed_pod(pod))

    def _store(self, listed: ListedPod) -> None:
        where, job, view = listed
        if not job or view is None or not self._served(where[0]):
            self._drop(where)
            return
        if self._job_of.get(where) not in (None, job):
            self._drop(where)  # relabelled to another job
        pods = self._jobs.setdefault((where[0], job), {})
        before = pods.get(where[1])
        if before != view:
            pods[where[1]] = view
            self._job_of[where] = job
            ended = (view.done and not (before and before.done)) or \
                (view.terminating and not (before and before.terminating))
            self._changed((where[0], job), ended)

    def _drop(self, where: tuple[str, str]) -> None:
        job = self._job_of.pop(where, None)
        if job is None:
            return
        pods = self._jobs.get((where[0], job)) or {}
        pods.pop(where[1], None)
        if not pods:
            self._jobs.pop((where[0], job), None)
        self._changed((where[0], job), True)

    def _replace(self, scope: str | None, listed: Sequence[ListedPod]) -> None:
        """A fresh list of `scope` replaces what the cache held there (pods deleted unseen go)."""
        present = {where for where, _, _ in listed}
        for where in [w for w in self._job_of if (scope is None or w[0] == scope) and w not in present]:
            self._drop(where)
        for entry in listed:
            self._store(entry)
        self._relisted(scope)
        self._settled[scope].set()


class Expectations:
    """Creates and deletes of pods whose watch events the cache has not shown yet, by job.

    A create is seen when the cache holds the pod with the uid the API server gave it; a delete when the cache no
    longer holds that pod alive (gone, terminating, or replaced). A relist shows the truth: it ends every
    expectation of its scope (`relisted`). One not seen within `timeout` seconds (client-go's 5 minutes: a slow
    watch on a large gang is not mistaken for a lost one) is given up."""

    def __init__(self, timeout: float = 300.0):
        self.timeout = timeout
        self._creates: dict[JobKey, dict[str, tuple[str, float]]] = {}  # name → (uid, deadline)
        self._deletes: dict[JobKey, dict[str, tuple[str, float]]] = {}

    def created(self, key: JobKey, name: str, uid: str) -> None:
        self._creates.setdefault(key, {})[name] = (uid, time.monotonic() + self.timeout)

    def deleted(self, key: JobKey, name: str, uid: str) -> None:
        self._deletes.setdefault(key, {})[name] = (uid, time.monotonic() + self.timeout)

    def unseen(self, key: JobKey, pods: Iterable[PodView]) -> list[str]:
        """The pods whose create or delete the cache (`pods`, the job's) does not show yet; forgets the rest."""
        by_name, now = {p.name: p for p in pods}, time.monotonic()

        def seen_created(name: str, uid: str) -> bool:
            return name in by_name and by_name[name].uid == uid

        def seen_deleted(name: str, uid: str) -> bool:
            pod = by_name.get(name)
            return pod is None or pod.uid != uid or pod.terminating

        out = []
        for table, seen in ((self._creates, seen_created), (self._deletes, seen_deleted)):
            pending = table.get(key) or {}
            for name, (uid, deadline) in list(pending.items()):
                if seen(name, uid) or now > deadline:
                    del pending[name]
                else:
                    out.append(name)
            if not pending:
                table.pop(key, None)
        return out

    def forget(self, key: JobKey) -> None:
        self._creates.pop(key, None)
        self._deletes.pop(key, None)

    def relisted(self, scope: str | None) -> None:
        """The cache of `scope` (a namespace; None: all) was just listed afresh: nothing in it is still to come."""
        for table in (self._creates, self._deletes):
            for key in [k for k in table if scope is None or k[0] == scope]:
                del table[key]


class JobCache:
    """The newest body seen of each job, as much of it as the operator reads: apiVersion, kind, spec, status and
    the metadata it names (a tenant's megabytes of annotations stay out). A spec over `max_spec_bytes` (the
    platform's maxSpecBytes) is not kept either: its size is, and the job's pass refuses it. resourceVersions are
    compared as numbers only to keep the newer of two bodies; correctness never rests on it (writes are conditional
    on the body's resourceVersion)."""

    KEPT_METADATA = ("name", "namespace", "uid", "resourceVersion", "generation", "labels", "creationTimestamp",
                     "deletionTimestamp")

    def __init__(self, max_spec_bytes: int | None = None) -> None:
        self.max_spec_bytes = max_spec_bytes
        self._bodies: dict[JobKey, dict[str, Any]] = {}
        self._oversized: dict[JobKey, int] = {}

    def offer(self, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        held = self._bodies.get(key)
        if held is None or held["metadata"].get("uid") != meta.get("uid") or \
                as_int(meta.get("resourceVersion"), 0) >= as_int(held["metadata"].get("resourceVersion"), 0):
            # Weighed before it is copied (a spec over the limit is never held twice), then copied: kopf's Body is a
            # live view.
            size = spec_bytes(dict(body.get("spec") or {}))
            if self.max_spec_bytes is not None and size > self.max_spec_bytes:
                self._oversized[key], spec = size, {}
            else:
                self._oversized.pop(key, None)
                spec = copy.deepcopy(dict(body.get("spec") or {}))
            self._bodies[key] = {
                "apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                "metadata": {k: copy.deepcopy(meta[k]) for k in self.KEPT_METADATA if k in meta},
                "spec": spec, "status": copy.deepcopy(dict(body.get("status") or {}))}

    def get(self, key: JobKey) -> dict[str, Any] | None:
        return self._bodies.get(key)

    def oversized(self, key: JobKey) -> int | None:
        """The size of the job's spec when it is over the limit (and so not kept), else None."""
        return self._oversized.get(key)

    def items(self) -> list[tuple[JobKey, dict[str, Any]]]:
        return list(self._bodies.items())

    def forget(self, key: JobKey) -> None:
        self._bodies.pop(key, None)
        self._oversized.pop(key, None)


async def get_object(ref: Mapping[str, Any], plural: str) -> dict[str, Any] | None:
    """The object `ref` (apiVersion, kind, name, namespace) names, or None when it does not exist."""
    meta = ref["metadata"]
    try:
        return await client().request("GET", api_path(ref["apiVersion"], plural, meta.get("namespace"), meta["name"]))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"


async def node_gone(name: str) -> bool | None:
    """Whether node `name` is known to run nothing any more, as Kubernetes' pod garbage collector judges it before
    it force-deletes a pod: the Node is gone, or an admin tainted it `node.kubernetes.io/out-of-service` (the node
    is shut down). A NotReady node may only be cut off from the network with its containers still running: a
    pod of it force-deleted could leave two copies of a rank. None when the operator may not read nodes."""
    try:
        node = await client().request("GET", api_path("v1", "nodes", None, name))
    except ApiError as exc:
        if exc.status == 404:
            return True
        if exc.status == 403:
            return None
        raise
    return any(t.get("key") == OUT_OF_SERVICE_TAINT for t in (node.get("spec") or {}).get("taints") or [])


NODE_LABELS_SECONDS = 60.0  # how long a list of the GPU nodes' labels serves mode auto's plans
_node_labels: tuple[float, list[dict[str, str]] | None] | None = None


async def gpu_node_labels(label: str) -> list[dict[str, str]] | None:
    """The labels of the nodes that carry `label` (GPU Feature Discovery's gpu.product), listed at most once a
    NODE_LABELS_SECONDS for every job's plan, a page at a time; None when the operator may not list nodes."""
    global _node_labels
    if _node_labels is not None and time.monotonic() - _node_labels[0] < NODE_LABELS_SECONDS:
        return _node_labels[1]
    nodes = await _nodes_labelled(label)
    labels = None if nodes is None else [node_labels for _, node_labels in nodes]
    _node_labels = (time.monotonic(), labels)
    return labels


async def node_domains(level: str) -> dict[str, str] | None:
    """Each node's value of label `level` (the nodes that carry it), a page at a time; None when the operator may
    not list nodes (a namespaced install)."""
    nodes = await _nodes_labelled(level)
    return None if nodes is None else {name: labels.get(level, "") for name, labels in nodes}


async def _nodes_labelled(label: str) -> list[tuple[str, dict[str, str]]] | None:
    """(name, labels) of every node that carries `label`, listed a page of 500 at a time; None when the operator
    may not list nodes (a namespaced install)."""
    out: list[tuple[str, dict[str, str]]] = []
    token = ""
    try:
        while True:
            params = {"labelSelector": label, "limit": "500", **({"continue": token} if token else {})}
            page = await client().request("GET", api_path("v1", "nodes", None), params=params)
            for item in page.get("items") or []:
                meta = item.get("metadata") or {}
                out.append((str(meta.get("name")), dict(meta.get("labels") or {})))
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                return out
    except ApiError as exc:
        if exc.status != 403:
            raise
        return None


async def get_job(namespace: str, name: str) -> dict[str, Any] | None:
    return await get_object({"apiVersion": API_GROUP_VERSION, "metadata": {"namespace": namespace, "name": name}},
                            PLURAL)


async def fetch_progress(pod_ip: str, port: int = contract.PROGRESS_PORT) -> Any:
    """Rank 0's `GET /progress` JSON, or None when it does not answer (starting, hung, gone) or answers anything but
    a JSON body of at most PROGRESS_MAX_BYTES from that address: the pod runs user code, so a redirect is never
    followed (the operator would fetch any URL a tenant names, from its own network position) and nothing but
    JSON is parsed. One read of a host at a time, and at most one a PROGRESS_MIN_INTERVAL: one host cannot take the
    operator's attention from the others. Pods need no API credentials to report progress; one HTTP session
    serves every job's reads."""
    global _progress_session
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip  # IPv6 pod IPs
    now = time.monotonic()
    if now - _progress_read_at.get((host, port), -PROGRESS_MIN_INTERVAL) < PROGRESS_MIN_INTERVAL:
        return None
    _progress_read_at[(host, port)] = now
    if len(_progress_read_at) > 4 * PROGRESS_HOSTS_KEPT:  # forget hosts not read lately (pods come and go)
        for key in [k for k, at in _progress_read_at.items() if now - at >= PROGRESS_MIN_INTERVAL]:
            del _progress_read_at[key]
    if _progress_session is None or _progress_session.closed:
        _progress_session = aiohttp.ClientSession(timeout=PROGRESS_TIMEOUT)
    try:
        async with _progress_session.get(f"http://{host}:{port}/progress", allow_redirects=False) as response:
            if response.status != 200 or response.content_type != "application/json":
                return None
            body = await response.content.read(PROGRESS_MAX_BYTES + 1)
            if len(body) > PROGRESS_MAX_BYTES:
                return None
            return decode.loads(body)
    except (aiohttp.ClientError, asyncio.TimeoutError, decode.Undecodable):
        return None


async def close() -> None:
    """Close the progress reads' session (at operator shutdown)."""
    if _progress_session is not None:
        await _progress_session.close()
