"""The operator's memory (observe.PodCache, Expectations, JobCache), its rate limiter and slow-start batches, and
the rule that keeps a pass from acting on a cache that does not show its own writes yet. No API server: the cache
is fed watch events as the informer would feed them; the live tests run the informer itself."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from paratrain import contract
from paratrain_operator import apply, kube, observe, reconcile

JOB_UID = "uid-job"


def pod(name: str, job: str = "job", uid: str | None = None, phase: str = "Pending", deleting: bool = False,
        owner: str = JOB_UID, namespace: str = "ns", version: int = 1) -> dict[str, Any]:
    attempt, rank = name.rsplit("-", 2)[-2:]
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}",
                            "resourceVersion": str(version),
                            "labels": {contract.LABEL_JOB: job, contract.LABEL_ATTEMPT: attempt,
                                       contract.LABEL_NODE_RANK: rank},
                            "ownerReferences": [{"uid": owner}]}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase}}


def listed(pods: list[dict[str, Any]]) -> list[observe.ListedPod]:
    """Pods as a list's pages give them to the cache."""
    return [observe.listed_pod(p) for p in pods]


def names(cache: observe.PodCache, job: str = "job", uid: str | None = JOB_UID) -> list[str]:
    return sorted(p.name for p in cache.pods("ns", job, uid))


def test_watch_events_keep_each_jobs_pods_and_say_which_job_changed():
    changed: list[tuple[tuple[str, str], bool]] = []  # (job, urgent)
    cache = observe.PodCache(changed=lambda key, urgent: changed.append((key, urgent)))
    cache._replace(None, listed([pod("job-0-0"), pod("other-0-0", job="other")]))
    assert asyncio.run(cache.listed("ns")) is None
    assert names(cache) == ["job-0-0"] and names(cache, "other") == ["other-0-0"]
    changed.clear()
    assert cache._apply({"type": "ADDED", "object": pod("job-0-1", version=7)}) == "7"
    cache._apply({"type": "MODIFIED", "object": pod("job-0-0", phase="Running")})
    cache._apply({"type": "MODIFIED", "object": pod("job-0-0", phase="Running")})  # nothing new: no pass
    assert changed == [(("ns", "job"), False), (("ns", "job"), False)]  # a gang starting: passes may wait
    assert {p.name: p.phase for p in cache.pods("ns", "job")} == {"job-0-0": "Running", "job-0-1": "Pending"}
    cache._apply({"type": "MODIFIED", "object": pod("job-0-0", phase="Failed")})
    cache._apply({"type": "DELETED", "object": pod("job-0-1")})
    cache._apply({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}})
    assert changed[-2:] == [(("ns", "job"), True), (("ns", "job"), True)]  # a pod ended, one went: a pass soon
    assert names(cache) == ["job-0-0"] and len(cache) == 2


def test_a_same_named_earlier_jobs_pods_are_not_this_jobs():
    cache = observe.PodCache()
    cache._replace(None, listed([pod("job-0-0"), pod("job-0-1", owner="uid-earlier")]))
    assert names(cache) == ["job-0-0"] and names(cache, uid=None) == ["job-0-0", "job-0-1"]


def test_a_relist_drops_pods_deleted_while_the_watch_was_away():
    """After 410 Gone the informer lists again: a pod deleted meanwhile sent no event, and must go anyway."""
    changed: list[tuple[str, str]] = []
    cache = observe.PodCache(["ns", "other-ns"], changed=lambda key, urgent: changed.append(key))
    cache._replace("ns", listed([pod("job-0-0"), pod("job-0-1")]))
    assert asyncio.run(cache.listed("ns")) is None  # its own scope listed: a pass there goes ahead
    assert not cache._settled["other-ns"].is_set()
    cache._replace("other-ns", listed([pod("job-0-0", namespace="other-ns")]))
    changed.clear()
    cache._replace("ns", listed([pod("job-0-0")]))
    assert names(cache) == ["job-0-0"] and changed == [("ns", "job")]
    assert [p.name for p in cache.pods("other-ns", "job")] == ["job-0-0"]  # another scope's list leaves it be


def test_an_error_event_is_raised_so_that_the_informer_lists_again():
    with pytest.raises(kube.ApiError) as caught:
        observe.PodCache()._apply({"type": "ERROR", "object": {"code": 410, "reason": "Expired", "message": "old"}})
    assert caught.value.status == 410


def test_namespace_patterns_watch_everything_and_keep_what_matches():
    cache = observe.PodCache(["team-*"])
    assert cache.scopes == [None]
    cache._replace(None, listed([pod("job-0-0", namespace="team-a"), pod("job-0-0", namespace="kube-system")]))
    assert len(cache) == 1 and cache.pods("team-a", "job")
    assert observe.PodCache(["a", "b"]).scopes == ["a", "b"] and observe.PodCache().scopes == [None]


def test_expectations_hold_until_the_cache_shows_our_own_creates_and_deletes():
    key, exp = ("ns", "job"), observe.Expectations()
    cache = observe.PodCache()
    cache._replace(None, listed([pod("job-0-0", phase="Running")]))
    exp.created(key, "job-1-0", "uid-new")
    exp.deleted(key, "job-0-0", "uid-job-0-0")
    assert sorted(exp.unseen(key, cache.pods("ns", "job"))) == ["job-0-0", "job-1-0"]
    cache._apply({"type": "MODIFIED", "object": pod("job-0-0", deleting=True)})  # terminating: deletion seen
    cache._apply({"type": "ADDED", "object": pod("job-1-0", uid="uid-other")})  # not the pod we created
    assert exp.unseen(key, cache.pods("ns", "job")) == ["job-1-0"]
    cache._apply({"type": "MODIFIED", "object": pod("job-1-0", uid="uid-new")})
    assert exp.unseen(key, cache.pods("ns", "job")) == []
    exp.timeout = 0
    exp.created(key, "job-1-1", "uid-lost")
    time.sleep(0.01)
    assert exp.unseen(key, cache.pods("ns", "job")) == []  # an event never seen is given up after the timeout


def test_a_relist_ends_the_expectations_of_its_scope_only():
    """A fresh list shows the truth: nothing of that scope is still to come. Other namespaces' stay."""
    exp = observe.Expectations()
    assert exp.timeout == 300  # client-go's: a slow watch on a large gang is not taken for a lost one
    cache = observe.PodCache(["ns", "other"], relisted=exp.relisted)
    exp.created(("ns", "job"), "job-0-0", "uid-a")
    exp.created(("other", "job"), "job-0-0", "uid-b")
    cache._replace("ns", listed([]))
    assert exp.unseen(("ns", "job"), []) == [] and exp.unseen(("other", "job"), []) == ["job-0-0"]


def test_a_failed_delete_leaves_the_deletes_that_went_out_expected(monkeypatch: pytest.MonkeyPatch):
    """Three deletes in slow-start batches (1, then 2): the first is answered, one of the second fails. Before,
    the failure dropped every expectation of the job, and the next pass decided on a cache that still showed the
    first pod alive."""
    class Api:
        async def request(self, method: str, path: str, **_: Any) -> Any:
            if path.endswith("/job-0-1"):
                raise kube.ApiError(403, "Forbidden", "denied by a webhook")
            return {}

    monkeypatch.setattr(kube, "_client", Api())
    monkeypatch.setattr(reconcile, "expectations", observe.Expectations())
    views = [observe.pod_view(pod(f"job-0-{r}", phase="Running")) for r in range(3)]
    body = {"metadata": {"name": "job", "namespace": "ns", "uid": JOB_UID}}
    decision = reconcile.Decision(reconcile.GangState(), delete_pods=("job-0-0", "job-0-1", "job-0-2"))
    with pytest.raises(apply.Refused):
        asyncio.run(reconcile._act(body, decision, None, views))
    assert sorted(reconcile.expectations.unseen(("ns", "job"), views)) == ["job-0-0", "job-0-2"]


class NoApi:
    """A client that fails the test's pass the moment it would touch the API."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def request(self, method: str, path: str, **_: Any) -> Any:
        self.calls.append((method, path))
        raise kube.ApiError(503, "Unavailable", "the test's API is down")


def test_a_pass_never_acts_on_a_cache_that_misses_its_own_creates(monkeypatch: pytest.MonkeyPatch):
    """Pods just created, not yet in the cache: a pass deciding now would see a gang short of those pods and create
    them again (or, after a restart, see the old gang still running). It waits; once the watch shows them it
    goes ahead."""
    api = NoApi()
    monkeypatch.setattr(kube, "_client", api)
    monkeypatch.setattr(reconcile, "pods", observe.PodCache())
    monkeypatch.setattr(reconcile, "expectations", observe.Expectations())
    reconcile.pods._replace(None, listed([]))
    body = {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob",
            "metadata": {"name": "job", "namespace": "ns", "uid": JOB_UID, "resourceVersion": "5"},
            "spec": {"nodes": 2, "parallelism": {"data": 2}, "training": {"batchSize": 8}},
            "status": {"phase": "Pending", "attempt": 0}}
    reconcile.expectations.created(("ns", "job"), "job-0-0", "uid-job-0-0")
    assert asyncio.run(reconcile._pass(body)) == "Pending" and api.calls == []
    reconcile.pods._apply({"type": "ADDED", "object": pod("job-0-0")})
    with pytest.raises(kube.ApiError):
        asyncio.run(reconcile._pass(body))
    assert api.calls and api.calls[0][0] == "PATCH"  # the status write that comes before creating job-0-1


class PagedApi:
    """Serves `pods` by namespace in pages of at most `limit`, as an API server that does not stream lists does;
    refuses `forbidden`; the first `huge` pods weigh megabytes, and a page of more than `max_huge` of them is over
    the client's byte bound."""

    def __init__(self, pods: dict[str, list[dict[str, Any]]], forbidden: frozenset[str] = frozenset(),
                 huge: int = 0, max_huge: int = 1 << 30):
        self.pods, self.forbidden, self.huge, self.max_huge = pods, forbidden, huge, max_huge
        self.lists: list[tuple[str, dict[str, str]]] = []  # (namespace, query) of each LIST
        self.watched: list[tuple[str, str]] = []

    async def request(self, method: str, path: str, params: dict[str, str], **_: Any) -> Any:
        namespace = path.split("/")[4]
        self.lists.append((namespace, dict(params)))
        if namespace in self.forbidden:
            raise kube.ApiError(403, "Forbidden", f'pods is forbidden: cannot list resource "pods" in "{namespace}"')
        start, limit = int(params.get("continue", "0")), int(params["limit"])
        if len(range(start, min(start + limit, self.huge))) > self.max_huge:
            raise kube.ApiError(kube.UNDECODABLE, "Undecodable", "the answer is over 16777216 bytes")
        items = self.pods[namespace][start:start + limit]
        more = start + limit < len(self.pods[namespace])
        return {"metadata": {"resourceVersion": "77", **({"continue": str(start + limit)} if more else {})},
                "items": items}

    async def watch(self, path: str, params: dict[str, str], silence: float) -> Any:
        if path.split("/")[4] in self.forbidden:
            raise kube.ApiError(403, "Forbidden", "pods is forbidden")
        if params.get("sendInitialEvents"):
            raise kube.ApiError(422, "Invalid", "sendInitialEvents is forbidden for watch unless the WatchList "
                                "feature gate is enabled")
        self.watched.append((path.split("/")[4], params["resourceVersion"]))
        await asyncio.sleep(3600)
        yield {}


def test_a_page_over_the_byte_bound_is_asked_for_again_at_half_the_size(monkeypatch: pytest.MonkeyPatch):
    """40 pods of megabytes first, then 960 small ones: a page of 500 with them all would be read whole. Past the
    byte bound the same page is asked for again at half the limit, down to what fits; each page after one that
    fit is asked at twice its size again, so the small pods still come 500 a page."""
    api = PagedApi({"ns": [pod(f"job-0-{r}") for r in range(1000)]}, huge=40, max_huge=5)
    monkeypatch.setattr(observe, "client", lambda: api)

    async def main() -> int:
        cache = observe.PodCache(["ns"])
        cache.streaming = False
        task = asyncio.create_task(cache.run())
        await asyncio.wait_for(cache.listed("ns"), 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return len(cache)

    assert asyncio.run(main()) == 1000
    limits = [int(q["limit"]) for _, q in api.lists]
    assert limits[:8] == [500, 250, 125, 62, 31, 15, 7, 3]  # halved until the first page fits
    assert max(limits[8:]) == 500 and len(limits) < 40, limits  # and back to full pages past the big pods


def test_a_relist_is_paged_and_a_namespace_the_operator_may_not_list_stops_only_its_own_jobs(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """1,201 pods come in three pages of at most 500 (one the cache cannot read is skipped, naming it, instead of
    failing the whole list over and over); a namespace whose list is forbidden is reported (its jobs learn why)
    and never blocks the other's passes nor fails liveness (a restart cannot grant RBAC)."""
    broken = {**pod("job-0-9999"), "status": {"containerStatuses": [{"state": "not a map"}]}}
    api = PagedApi({"ns": [pod(f"job-0-{r}") for r in range(700)] + [broken] +
                    [pod(f"job-0-{r}") for r in range(700, 1200)]}, forbidden=frozenset({"locked"}))
    monkeypatch.setattr(observe, "client", lambda: api)

    async def main() -> tuple[str | None, str | None, str | None]:
        cache = observe.PodCache(["ns", "locked"])
        task = asyncio.create_task(cache.run())
        served = await asyncio.wait_for(cache.listed("ns"), 5)
        refused = await asyncio.wait_for(cache.listed("locked"), 5)
        assert len(cache) == 1200 and ("ns", "77") in api.watched  # the watch starts where the pages ended
        failing = cache.problem(asyncio.get_running_loop().time() + observe.UNHEALTHY_AFTER + 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return served, refused, failing

    served, refused, failing = asyncio.run(main())
    assert served is None and failing is None
    assert refused and "may not list pods in namespace locked" in refused and "403 Forbidden" in refused
    pages = [query for namespace, query in api.lists if namespace == "ns"]
    assert [q.get("continue") for q in pages] == [None, "500", "1000"]
    assert "skipped a pod it cannot read, ns/job-0-9999" in caplog.text
    assert {q["limit"] for q in pages} == {str(observe.LIST_PAGE)} == {"500"}


def test_a_job_in_a_namespace_the_operator_may_not_list_is_told_why_and_nothing_is_done(
        monkeypatch: pytest.MonkeyPatch):
    events: list[tuple[str, str]] = []

    async def post_event(body: Any, event: Any) -> None:
        events.append((event.reason, event.message))

    api = NoApi()
    monkeypatch.setattr(kube, "_client", api)
    monkeypatch.setattr(apply, "post_event", post_event)
    cache = observe.PodCache(["ns"])
    cache._refuse("ns", kube.ApiError(403, "Forbidden", "pods is forbidden"))
    monkeypatch.setattr(reconcile, "pods", cache)
    body = {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob",
            "metadata": {"name": "job", "namespace": "ns", "uid": JOB_UID, "resourceVersion": "5"},
            "spec": {"nodes": 2, "parallelism": {"data": 2}, "training": {"batchSize": 8}}, "status": {}}
    assert asyncio.run(reconcile._pass(body)) is None and api.calls == []  # no create on an empty cache
    assert events == [("PodsNotListed", "the operator may not list pods in namespace ns (403 Forbidden: pods is "
                       "forbidden); this job waits for it")]


def test_the_newer_body_of_a_job_is_kept():
    jobs = observe.JobCache()
    body = lambda version, uid="a": {"metadata": {"namespace": "ns", "name": "j", "uid": uid,  # noqa: E731
                                                  "resourceVersion": str(version)}}
    jobs.offer(body(10))
    jobs.offer(body(9))  # a watch event older than our own write's answer
    assert jobs.get(("ns", "j"))["metadata"]["resourceVersion"] == "10"
    jobs.offer(body(3, uid="b"))  # a new job of the same name
    assert jobs.get(("ns", "j"))["metadata"]["uid"] == "b"


def test_the_rate_limiter_lets_a_burst_through_then_paces():
    async def main() -> float:
        limiter = kube.RateLimiter(qps=50, burst=10)
        start = time.monotonic()
        for _ in range(20):
            await limiter.acquire()
        return time.monotonic() - start
    elapsed = asyncio.run(main())
    assert 0.15 <= elapsed < 2.0  # 10 at once, then 10 more at 50/s: about 0.2 s


def test_the_rate_limiter_shares_its_budget_fairly_between_namespaces():
    """One tenant's 100 queued creates do not hold back another tenant's request: tokens go round-robin to the
    namespaces with requests waiting, and a cancelled request's turn is not spent."""
    async def main() -> tuple[list[str], int]:
        limiter, order = kube.RateLimiter(qps=200, burst=1), []

        async def call(namespace: str) -> None:
            await limiter.acquire(namespace)
            order.append(namespace)

        flood = [asyncio.create_task(call("big")) for _ in range(100)]
        await asyncio.sleep(0.02)  # the flood is queued (a few granted)
        granted_before = len(order)
        cancelled = asyncio.create_task(call("gone"))
        small = [asyncio.create_task(call("small")) for _ in range(3)]
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(*flood, *small)
        return order, granted_before
    order, granted_before = asyncio.run(main())
    first_small = order.index("small")
    assert order[first_small:first_small + 6:2] == ["small"] * 3, order  # every other grant, from its first on
    assert first_small <= granted_before + 2 and "gone" not in order and len(order) == 103, (granted_before, order)
    assert kube.namespace_of("/api/v1/namespaces/team-a/pods") == "team-a"
    assert kube.namespace_of("/apis/paratrain.dev/v1alpha1/namespaces/b/paralleltrainjobs/x/status") == "b"
    assert kube.namespace_of("/api/v1/pods") is None and kube.namespace_of("/api/v1/nodes/n1") is None


def test_slow_start_batches_double_and_stop_after_a_failing_batch():
    sizes: list[int] = []
    in_flight = 0

    async def call(item: int) -> int:
        nonlocal in_flight
        in_flight += 1
        await asyncio.sleep(0.01)
        sizes.append(in_flight)
        in_flight -= 1
        if item == 5:
            raise RuntimeError("refused")
        return item * 2

    assert asyncio.run(apply.in_batches(list(range(5)), call)) == [0, 2, 4, 6, 8]
    assert max(sizes) == 2  # batches of 1, 2, then the last 2 of a batch of 4
    sizes.clear()
    with pytest.raises(RuntimeError):
        asyncio.run(apply.in_batches(list(range(100)), call))
    assert len(sizes) == 7  # batches of 1, 2 and 4: item 5 is in the third, which finishes; nothing after it
