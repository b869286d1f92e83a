"""The operator's writes against an in-memory API server: an Event is one object however often its POST is retried
or whichever replica posts it again; every write asks for strict field validation; the previous attempt's PodGroup
is deleted even when the first delete fails; a GangScheduled condition found False is read again and corrected."""

from __future__ import annotations

import asyncio
import copy
import json
from datetime import timedelta
from typing import Any

import pytest

from paratrain.api import parse_job
from paratrain_operator import apply, handlers, kube, observe, reconcile
from paratrain_operator.clock import now, to_iso
from paratrain_operator.gang import RUNNING, Decision, Event, GangState
from paratrain_operator.observe import PodView
from paratrain_operator.render import native_pod_group

JOB = {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob",
       "metadata": {"name": "job", "namespace": "ml", "uid": "uid-job", "resourceVersion": "7"}}


class Api:
    """Events and ConfigMaps by name. `answer_lost`: the next POST is stored but its answer lost, so the client
    sends it again (kube.Kube retries a lost connection in place): the second POST is what the caller sees."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.answer_lost = False
        self.failing_deletes = 0  # the next DELETEs that fail (a webhook down, the API server overloaded)

    async def request(self, method: str, path: str, *, body: Any = None, params: Any = None,
                      content_type: str | None = None) -> Any:
        self.requests.append((method, path, dict(params or {})))
        if method == "POST":
            name = body["metadata"].get("name") or f"{body['metadata']['generateName']}{len(self.objects)}"
            if name in self.objects:
                raise kube.ApiError(409, "AlreadyExists", f'"{name}" already exists')
            self.objects[name] = {**copy.deepcopy(body), "metadata": {**body["metadata"], "name": name}}
            if self.answer_lost:
                self.answer_lost = False
                return await self.request(method, path, body=body, params=params, content_type=content_type)
            return copy.deepcopy(self.objects[name])
        name = path.rsplit("/", 1)[-1] if not path.endswith("/status") else path.split("/")[-2]
        if method == "DELETE" and self.failing_deletes:
            self.failing_deletes -= 1
            raise kube.ApiError(500, "InternalError", "etcdserver: request timed out")
        if name not in self.objects:
            raise kube.ApiError(404, "NotFound", f'"{name}" not found')
        if method == "DELETE":
            return self.objects.pop(name)
        if method == "PATCH":
            merge_patch(self.objects[name], copy.deepcopy(body))
        return copy.deepcopy(self.objects[name])


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386, as the API server applies a merge patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = value


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Api:
    fake = Api()
    monkeypatch.setattr(kube, "_client", fake)
    monkeypatch.setattr(apply, "_posted", apply.OrderedDict())
    return fake


def events(api: Api) -> list[dict[str, Any]]:
    return [o for o in api.objects.values() if o.get("kind") == "Event"]


def test_an_event_whose_post_is_retried_is_posted_once(api: Api):
    """A POST whose answer is lost is sent again; with a generated name the API server stored two Events."""
    api.answer_lost = True
    asyncio.run(apply.post_event(JOB, Event("Warning", "FailedCreate", "exceeded quota")))
    [event] = events(api)
    assert (event["reason"], event["count"]) == ("FailedCreate", 1)


def test_event_series_survive_a_failover(api: Api):
    """The Events a replica posted are remembered in its memory; a new leader finds the same Event by its name and
    raises its count, instead of posting a second one beside it."""
    first = Event("Warning", "FailedCreate", "exceeded quota")
    asyncio.run(apply.post_event(JOB, first))
    asyncio.run(apply.post_event(JOB, first))
    apply._posted.clear()  # a new leader: nothing posted in its memory
    asyncio.run(apply.post_event(JOB, first))
    asyncio.run(apply.post_event(JOB, Event("Warning", "FailedCreate", "another message")))
    counts = sorted((e["message"], e["count"]) for e in events(api))
    assert counts == [("another message", 1), ("exceeded quota", 3)]


def test_every_write_asks_for_strict_field_validation(api: Api):
    """A field the API server does not know (a typo, a field of a newer release) is an error, never dropped."""
    api.objects["job"] = copy.deepcopy(JOB)
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "job-config", "namespace": "ml"},
              "data": {"a": "1"}}

    async def main() -> None:
        await apply.ensure(config)
        await apply.ensure({**config, "data": {"a": "2"}})  # exists: brought up to date by a PATCH
        await apply.patch_status("ml", "job", {"phase": "Running"}, "7")
        await apply.post_event(JOB, Event("Normal", "Created", "created 2 pods"))
        await apply.post_event(JOB, Event("Normal", "Created", "created 2 pods"))  # its count raised: a PATCH
    asyncio.run(main())
    writes = [(method, path, params) for method, path, params in api.requests if method in ("POST", "PUT", "PATCH")]
    assert {m for m, _, _ in writes} == {"POST", "PATCH"} and len(writes) >= 5
    assert [w for w in writes if w[2].get("fieldValidation") != "Strict"] == []


NATIVE = parse_job({"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob",
                    "metadata": {"name": "job", "namespace": "ml"},
                    "spec": {"nodes": 2, "parallelism": {"data": 2}, "training": {"batchSize": 8},
                             "scheduling": {"gang": "kubernetes"}}})


def test_a_failed_delete_of_the_previous_attempts_podgroup_is_retried_by_the_next_pass(
        api: Api, monkeypatch: pytest.MonkeyPatch):
    """Before, only the pass that created the new gang deleted the old PodGroup: if that delete failed, it stayed."""
    monkeypatch.setattr(reconcile, "_superseded_gone", {})
    old = native_pod_group(NATIVE, "ml", 0)["metadata"]["name"]
    api.objects[old] = {"kind": "PodGroup"}
    api.failing_deletes = 1
    state, key = GangState(phase=RUNNING, attempt=1), ("ml", "job")
    running = [PodView(name="job-1-0", attempt=1, rank=0, phase=RUNNING)]
    with pytest.raises(kube.ApiError):
        asyncio.run(reconcile._delete_superseded(key, NATIVE, Decision(state, create_ranks=(0, 1)), []))
    asyncio.run(reconcile._delete_superseded(key, NATIVE, Decision(state), running))  # a later pass: no creates
    asyncio.run(reconcile._delete_superseded(key, NATIVE, Decision(state), running))  # done: nothing sent
    assert old not in api.objects
    assert [(m, p.rsplit("/", 1)[-1]) for m, p, _ in api.requests] == [("DELETE", old), ("DELETE", old)]


def gang_condition(status: str, age_seconds: float) -> dict[str, Any]:
    since = to_iso(now() - timedelta(seconds=age_seconds))
    return {"type": "GangScheduled", "status": status, "reason": "GangNotEnforced", "message": "placed one by one",
            "lastTransitionTime": since}


@pytest.mark.parametrize("age, corrected", [(10, True), (120, False)])
def test_a_gang_found_not_placed_whole_is_read_again_in_its_first_minute(api: Api, age: float, corrected: bool):
    """kube-scheduler may mark the PodGroup placed a moment after its pods run: read once, the condition said
    GangNotEnforced for good. Now it is read again while False, for a minute (then the answer stands)."""
    group = native_pod_group(NATIVE, "ml", 0)["metadata"]["name"]
    api.objects[group] = {"status": {"conditions": [{"type": "PodGroupInitiallyScheduled", "status": "True"}]}}
    body = {**copy.deepcopy(JOB), "spec": {}, "status": {"phase": RUNNING, "attempt": 0,
                                                          "conditions": [gang_condition("False", age)]}}
    api.objects["job"] = copy.deepcopy(body)
    stored = asyncio.run(reconcile._persist(body, Decision(GangState(phase=RUNNING)), NATIVE, []))
    [condition] = [c for c in stored["status"]["conditions"] if c["type"] == "GangScheduled"]
    assert condition["status"] == ("True" if corrected else "False")
    assert (("GET", group) in [(m, p.rsplit("/", 1)[-1]) for m, p, _ in api.requests]) == corrected
    assert events(api) == []  # the Warning was posted when the gang started running, not again


def test_a_large_gang_is_built_batch_by_batch_as_it_is_created(api: Api):
    """A 600-pod gang: its pods are built RENDER_CHUNK at a time, each chunk only once the one before last is
    created, so the operator never holds the whole gang's pods (1 GiB for 4,096 pods with large annotations); every
    pod is still created once, in rank order, and a repeated pass creates nothing."""
    job = parse_job({**JOB, "spec": {"nodes": 600, "parallelism": {"data": 600}, "training": {"batchSize": 600}}})
    build = reconcile.GangBuild.of(job, "ml", 0, tuple(range(600)))
    built: list[tuple[int, int]] = []  # (pods built in the call, pods created before it)

    def render(ranks):
        built.append((len(ranks), sum(o.get("kind") == "Pod" for o in api.objects.values())))
        return build.pods(ranks)
    created = asyncio.run(apply.create_gang(build.shared, tuple(range(600)), render))
    assert created == [f"job-0-{r}" for r in range(600)]
    chunk = apply.RENDER_CHUNK
    assert [n for n, _ in built] == [chunk] * (600 // chunk) + [600 % chunk]
    assert all(created_before >= (i - 1) * chunk for i, (_, created_before) in enumerate(built))
    assert [o["kind"] for o in api.objects.values()][:2] == ["ConfigMap", "Service"]  # before any pod
    assert asyncio.run(apply.create_gang(build.shared, tuple(range(600)), render)) == []  # all exist: none again


def test_a_job_over_max_spec_bytes_is_not_kept_and_fails_naming_the_limit(api: Api, monkeypatch: pytest.MonkeyPatch):
    """Issue 31: hundreds of near-1.5 MiB jobs, even suspended, filled the operator's memory (each whole body was
    kept). Now the cache keeps only what the operator reads (a tenant's annotations stay out) and no spec over the
    platform's maxSpecBytes: that job's pass fails it, saying why, without reading it."""
    jobs = observe.JobCache(max_spec_bytes=64 << 10)
    monkeypatch.setattr(reconcile, "jobs", jobs)
    cache = observe.PodCache(["ml"])
    cache._replace("ml", [])  # listed: nothing there
    monkeypatch.setattr(reconcile, "pods", cache)
    note = {"annotations": {"note": "<" * 400_000}, "managedFields": [{"manager": "kubectl"}]}
    spec = {"nodes": 1, "training": {"batchSize": 8}, "pod": {"env": [{"name": "BLOB", "value": "x" * 300_000}]}}
    body = {**copy.deepcopy(JOB), "metadata": {**JOB["metadata"], **note}, "spec": spec}
    api.objects["job"] = copy.deepcopy(body)
    jobs.offer(body)
    kept = jobs.get(("ml", "job"))
    assert kept["spec"] == {} and jobs.oversized(("ml", "job")) > 300_000
    assert len(json.dumps(kept)) < 1000  # neither the annotations nor the spec
    assert asyncio.run(reconcile._pass(kept)) == "Failed"
    status = api.objects["job"]["status"]
    assert status["phase"] == "Failed" and "maxSpecBytes (64.00 KiB)" in status["failure"]["message"], status
    assert not [r for r in api.requests if r[0] == "POST" and "/pods" in r[1]]  # nothing created

    smaller = {**body, "metadata": {**body["metadata"], "resourceVersion": "8"}, "spec": {"nodes": 1}}
    jobs.offer(smaller)  # fixed by its owner: kept again
    assert jobs.oversized(("ml", "job")) is None and jobs.get(("ml", "job"))["spec"] == {"nodes": 1}


def test_kopf_keeps_a_digest_of_the_spec_not_a_copy_of_the_job():
    """kopf's own last-handled state was a copy of the spec and the annotations in an annotation: for a 1 MiB job the
    API server refused that patch (annotations hold 256 KiB), and kopf retried it forever, holding it in memory.
    Now it is a digest: small whatever the job, the same for the same spec, different when the spec changes, and the
    change shows under `spec` (what `on.update(field="spec")` reacts to)."""
    import kopf
    from kopf._cogs.structs import diffs  # kopf's own diff, as its processing computes the update's cause

    storage = handlers.SpecDigestStorage(prefix="paratrain.dev")
    huge = {**copy.deepcopy(JOB), "metadata": {**JOB["metadata"], "annotations": {"note": "y" * 200_000}},
            "spec": {"nodes": 1, "pod": {"env": [{"name": f"V{i}", "value": "x" * 28_000} for i in range(38)]}}}
    essence = storage.build(body=kopf.Body(huge))
    patch = kopf.Patch()
    storage.store(body=kopf.Body(huge), patch=patch, essence=essence)
    assert len(json.dumps(dict(patch))) < 500
    reordered = {**huge, "metadata": {**huge["metadata"], "labels": {"a": "b"}},
                 "spec": dict(reversed(list(huge["spec"].items())))}
    assert storage.build(body=kopf.Body(reordered)) == essence  # labels, annotations and key order do not count
    changed = {**huge, "spec": {**huge["spec"], "nodes": 2}}
    diff = diffs.diff(essence, storage.build(body=kopf.Body(changed)))
    assert diff and all(op.field[0] == "spec" for op in diff)
