"""No object and no answer can stop a watcher (issue 42, item 1), without a cluster: the bounded decoder, kopf's
watch loop with the guard installed (its own `continuous_watch` and `infinite_watch`, fed by a stand-in stream),
and the names the guard replaces in kopf, so a kopf upgrade that moves them fails here, not in production.
tests/operator/test_live_hostile.py has the live case."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import kopf
import kopf._cogs.clients.api as kopf_api
import kopf._cogs.clients.watching as kopf_watching
import pytest

from paratrain_operator import decode, kopf_guard


def nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize("depth, deep", [(1, False), (decode.MAX_DEPTH, False), (decode.MAX_DEPTH + 1, True),
                                         (1500, True), (9999, True)])
def test_depth_is_measured_exactly_and_strings_do_not_count(depth: int, deep: bool):
    assert decode.deeper_than(nested(depth), decode.MAX_DEPTH) is deep
    as_text = json.dumps({"s": "[{" * 5000}).encode()  # brackets inside a string are text
    assert not decode.deeper_than(as_text, decode.MAX_DEPTH)
    escaped = json.dumps({"s": '\\"[[[[' * 100, "t": [[[]]]}).encode()
    assert not decode.deeper_than(escaped, 4) and decode.deeper_than(escaped, 3)  # the object and three lists


def test_measuring_depth_holds_a_few_copies_of_the_text_not_state_per_escape():
    """A page of pods with 7.8 MB of \\u003c each: a string pattern that steps over escapes kept regex state per
    escape (an operator's relist peaked 200 MiB above its resting size); measuring takes a few copies at most."""
    import tracemalloc

    page = json.dumps({"items": [{"spec": [[[[1]]]], "args": "<" * 1_300_000}] * 3}).replace("<", "\\u003c")
    raw = page.encode()
    tracemalloc.start()
    try:
        assert not decode.deeper_than(raw, decode.MAX_DEPTH) and decode.deeper_than(raw, 6)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(raw), f"{peak / 2**20:.0f} MiB for {len(raw) / 2**20:.0f} MiB of JSON"


def test_a_deep_or_broken_object_is_refused_naming_it():
    line = (b'{"type":"ADDED","object":{"apiVersion":"paratrain.dev/v1alpha1","kind":"ParallelTrainJob",'
            b'"metadata":{"name":"deep","namespace":"team-a","uid":"u-1","generation":3,"ownerReferences":'
            b'[{"uid":"other"}]},"spec":{"scheduling":{"affinity":' + nested(1500) + b"}}}}")
    with pytest.raises(decode.Undecodable) as caught:
        decode.loads(line)
    assert caught.value.reason == f"nested deeper than {decode.MAX_DEPTH} levels"
    assert caught.value.ref == decode.ObjectRef("ParallelTrainJob", "team-a", "deep", "u-1", "3")
    with pytest.raises(decode.Undecodable, match="not JSON"):
        decode.loads(b'{"a": [1, 2')
    assert decode.loads(nested(decode.MAX_DEPTH)) == json.loads(nested(decode.MAX_DEPTH))


def test_the_names_the_guard_replaces_are_still_kopfs():
    """kopf 1.45's stream decodes with the module's `json.loads`, lists with `api.get`, and its infinite watch
    calls `continuous_watch` by its module name: what install() replaces."""
    assert "json.loads(" in inspect.getsource(kopf_api.stream)
    assert "api.get(" in inspect.getsource(kopf._cogs.clients.fetching.fetch_objs)
    assert "continuous_watch(" in inspect.getsource(kopf_watching.infinite_watch)
    request = inspect.signature(kopf_api.request).parameters
    assert {"method", "url", "settings", "payload", "headers", "timeout", "logger"} <= request.keys()
    assert inspect.signature(kopf_guard.bounded_get).parameters.keys() <= \
        inspect.signature(kopf_api.get).parameters.keys() | {"logger"}


def test_the_stream_decoder_skips_what_it_refuses_and_reports_it(caplog):
    heard: list[decode.Undecodable] = []
    kopf_guard.install(heard.append)
    with caplog.at_level(logging.WARNING, "paratrain.operator"):
        skipped = kopf_api.json.loads(b'{"type":"MODIFIED","object":{"kind":"ParallelTrainJob","metadata":'
                                      b'{"name":"deep","namespace":"a","uid":"u"},"spec":' + nested(2000) + b"}}")
    assert skipped == {"type": kopf_guard.SKIPPED_EVENT, "object": {}}
    assert [str(exc.ref) for exc in heard] == ["ParallelTrainJob a/deep"]
    assert "skipped ParallelTrainJob a/deep" in caplog.text
    assert kopf_api.json.loads('{"type":"ADDED","object":{}}') == {"type": "ADDED", "object": {}}


def test_kopfs_watch_loop_passes_a_skipped_event_by_and_survives_any_failure(monkeypatch, caplog):
    """kopf's own infinite_watch → (guarded) continuous_watch → watch_objs, with the stream stood in for: a
    skipped line, then a job, then an error that once ended the operator; the watch starts again, the probe
    reports the failure only while it lasts past DOWN_SECONDS, and the events still flow."""
    kopf_guard.install(lambda exc: None)
    rounds: list[str | None] = []  # what the probe said as each round began

    async def stream(**_: Any) -> AsyncIterator[Any]:
        rounds.append(kopf_guard.problem(float("inf")))
        if len(rounds) == 1:
            yield kopf_guard.BoundedJson.loads(nested(3000))
            yield {"type": "ADDED", "object": {"metadata": {"name": "job-1", "resourceVersion": "5"}}}
            raise RecursionError("maximum recursion depth exceeded")  # what kopf's own watcher once let out
        yield {"type": "ADDED", "object": {"metadata": {"name": f"job-{len(rounds)}", "resourceVersion": "6"}}}
        await asyncio.sleep(3600)

    monkeypatch.setattr(kopf_watching, "watch_objs", stream)
    real_sleep = asyncio.sleep
    monkeypatch.setattr(kopf_guard.asyncio, "sleep", lambda seconds: real_sleep(0.01))
    settings = kopf.OperatorSettings()
    settings.watching.initial_streaming = True
    resource = kopf._cogs.structs.references.Resource("paratrain.dev", "v1alpha1", "paralleltrainjobs")

    async def main() -> tuple[list[str], str | None]:
        names = []
        async for event in kopf_watching.infinite_watch(settings=settings, resource=resource, namespace=None):
            if isinstance(event, dict):
                names.append(event["object"]["metadata"]["name"])
            if len(names) == 2:
                return names, kopf_guard.problem(float("inf"))
        raise AssertionError("the watch ended")

    with caplog.at_level(logging.ERROR, "paratrain.operator"):
        names, after = asyncio.run(asyncio.wait_for(main(), 10))
    assert names == ["job-1", "job-2"]  # the skipped line never reached kopf's handlers
    assert rounds[0] is None and rounds[1] and "RecursionError" in rounds[1]  # down between the two rounds
    assert after is None  # back with the first good event
    assert "failed (RecursionError" in caplog.text


class Elector:
    """leader.Elector's two answers, as a test sets them."""

    def __init__(self) -> None:
        self.why: str | None = None

    def may_write(self) -> str | None:
        return self.why

    def write_time_left(self) -> float:
        return 0.0 if self.why else 5.0


class Answer:
    """What kopf's request returns: a response to read (and close)."""

    def __init__(self, body: bytes):
        self.body = body
        self.content = self

    async def iter_chunked(self, size: int) -> AsyncIterator[bytes]:
        for start in range(0, len(self.body), size):
            yield self.body[start:start + size]

    async def __aenter__(self) -> Answer:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        pass


def settings_with(*backoffs: float) -> Any:
    settings = kopf.OperatorSettings()
    settings.networking.error_backoffs = backoffs
    return settings


def test_kopfs_writes_are_checked_before_every_try_and_never_retried_inside_kopf(monkeypatch):
    """kopf's own request retried a write after sleeping (1 + 1 + 2 + 3 ... s) without asking again: past the
    Lease's renew deadline it could still send one. Reads go as they are."""
    sent: list[tuple[str, Any, Any]] = []
    elector = Elector()

    async def request(method: str, url: str, *, backoffs: Any = None, timeout: Any = None, **_: Any) -> Answer:
        sent.append((method, backoffs, timeout))
        if method == "patch" and len(sent) == 2:
            elector.why = "Lease ops/lease was not renewed within 7s"  # the deadline passes while it waits
            raise kopf._cogs.clients.errors.APIServerError({"code": 500, "message": "etcd timed out"}, status=500,
                                                           headers={})
        return Answer(b"{}")

    monkeypatch.setattr(kopf_guard, "_kopf_request", request)
    kopf_guard.install(lambda exc: None, elector=elector)
    try:
        async def main() -> None:
            assert isinstance(await kopf_api.request("get", "/apis/x", settings=settings_with(0), logger=None),
                              Answer)
            with pytest.raises(kopf_guard.NotLeading, match="PATCH /apis/x: Lease ops/lease was not renewed"):
                await kopf_api.request(method="patch", url="/apis/x", settings=settings_with(0.01, 0.01),
                                       logger=None)
        asyncio.run(main())
    finally:
        kopf_guard.install(lambda exc: None)
    assert [m for m, _, _ in sent] == ["get", "patch"]  # the retry was refused before it went out
    assert sent[1][1] == [] and sent[1][2].total == 5.0  # one try inside kopf; its timeout the time left


def test_an_answer_kopf_cannot_read_is_taken_as_written_and_a_list_page_is_split_around_a_job_it_cannot_read(
        monkeypatch, caplog):
    """kopf's patch answers with the whole job again (a job made deep meanwhile raised RecursionError there), and
    where kopf lists page by page one deep job failed its page forever: the page is asked for again smaller, and
    the job alone is skipped, reported, with the API server's continue token past it."""
    deep_job = (b'{"apiVersion":"paratrain.dev/v1alpha1","kind":"ParallelTrainJob","metadata":{"name":"deep",'
                b'"namespace":"a","uid":"u-9"},"spec":' + nested(3000) + b"}")
    ok_job = b'{"apiVersion":"paratrain.dev/v1alpha1","kind":"ParallelTrainJob","metadata":{"name":"ok"}}'
    jobs = [ok_job, deep_job, ok_job]
    asked: list[str] = []

    async def request(method: str, url: str, **_: Any) -> Answer:
        asked.append(url)
        if method == "patch":
            return Answer(deep_job)
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
        start, limit = int(query.get("continue", "0")), int(query["limit"])
        more = f',"continue":"{start + limit}"' if start + limit < len(jobs) else ""
        return Answer(b'{"kind":"ParallelTrainJobList","metadata":{"resourceVersion":"7"' + more.encode() + b'},'
                      b'"items":[' + b",".join(jobs[start:start + limit]) + b"]}")

    heard: list[decode.Undecodable] = []
    monkeypatch.setattr(kopf_guard, "_kopf_request", request)
    kopf_guard.install(heard.append)
    try:
        async def main() -> tuple[Any, list[Any]]:
            patched = await kopf_api.patch("/apis/x/deep", settings=settings_with(), logger=None, payload={})
            pages, token = [], ""
            while True:
                url = "/apis/x?limit=4" + (f"&continue={token}" if token else "")
                page = await kopf_api.get(url, settings=settings_with(), logger=None)
                pages.append(page)
                token = page["metadata"].get("continue")
                if not token:
                    return patched, pages
        with caplog.at_level(logging.WARNING, "paratrain.operator"):
            patched, pages = asyncio.run(main())
    finally:
        kopf_guard.install(lambda exc: None)
    assert patched == {} and "taken as written" in caplog.text
    names = [item["metadata"]["name"] for page in pages for item in page["items"]]
    assert names == ["ok", "ok"]  # the deep job skipped, nothing else lost
    assert [str(exc.ref) for exc in heard] == ["ParallelTrainJob a/deep"]
    limits = [dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(u).query))["limit"] for u in asked[1:]]
    assert limits == ["4", "2", "1", "4", "2", "1", "4"]  # halved around the deep job; kopf's next page whole


def test_kopfs_bookkeeping_annotations_are_read_within_the_bound():
    """Whoever may edit a job may annotate it: kopf's json.loads of `kubectl annotate ptj x
    paratrain.dev/last-handled-configuration='{'` (or of one nested 5,000 deep) stopped the operator."""
    from paratrain_operator import handlers

    def body(value: str) -> Any:
        return kopf.Body({"metadata": {"name": "x", "namespace": "a", "annotations": {
            "paratrain.dev/last-handled-configuration": value, "paratrain.dev/job_changed": value}}})

    diffbase = handlers.SpecDigestStorage(prefix="paratrain.dev")
    progress = handlers.BoundedProgressStorage(prefix="paratrain.dev")
    for broken in ("{", "[" * 5000 + "]" * 5000):
        assert diffbase.fetch(body=body(broken)) is None
        assert progress.fetch(key=kopf._cogs.structs.ids.HandlerId("job_changed"), body=body(broken)) is None
    assert diffbase.fetch(body=body('{"spec": {"sha256": "ab"}}')) == {"spec": {"sha256": "ab"}}
    assert progress.fetch(key=kopf._cogs.structs.ids.HandlerId("job_changed"), body=body('{"retries": 1}')) == \
        {"retries": 1}
