"""The pods informer cannot die quietly (issue 31): watch streams are read in chunks and split into lines by the
operator itself, so an oversized pod cannot overflow a line buffer; an event that cannot be read is skipped with a
warning naming its pod; any other error lists again; and a cache that cannot be kept fails the liveness probe.
A real HTTP server on loopback streams the events; tests/operator/test_live_faults.py has the live case."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import kubernetes
import pytest

from paratrain_operator import kube, observe

from .test_cache import pod


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def collect(iterator: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in iterator]


def test_lines_are_split_across_chunks_and_an_oversized_line_is_dropped_naming_its_object(caplog):
    big = b'{"type":"ADDED","object":{"kind":"Pod","metadata":{"name":"huge","generateName":"h","namespace":"team"'
    stream = chunks(b'{"a":1}\n{"b"', b":2}\n\n", big + b"x" * 50, b"x" * 50 + b'"}}\n{"c":3}')
    with caplog.at_level(logging.WARNING, "paratrain.operator"):
        lines = asyncio.run(collect(kube.lines(stream, 120, "watch pods")))
    assert lines == [b'{"a":1}', b'{"b":2}', b'{"c":3}']
    assert "team/huge" in caplog.text and "over 120" in caplog.text


def test_an_event_that_is_not_a_json_object_is_skipped(caplog):
    with caplog.at_level(logging.WARNING, "paratrain.operator"):
        assert kube.parse_event(b'{"type":"ADDED","object":{"metadata":{"name":"p","namespace":"n"},"x":[[[',
                                "watch pods") is None
        assert kube.parse_event(b"[" * 100_000 + b"]" * 100_000, "watch pods") is None  # RecursionError
        assert kube.parse_event(b"[1]", "watch pods") is None
    assert "n/p" in caplog.text
    assert kube.parse_event(b'{"type":"BOOKMARK"}', "w") == {"type": "BOOKMARK"}


def stream_events(lines: list[bytes]) -> list[dict[str, Any]]:
    """What Kube.watch yields for a server streaming these lines."""
    async def watch(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        for line in lines:
            await response.write(line + b"\n")
        await response.write_eof()
        return response

    async def main() -> list[dict[str, Any]]:
        app = aiohttp.web.Application()
        app.router.add_get("/api/v1/pods", watch)
        runner = aiohttp.web.AppRunner(app, access_log=None)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        configuration = kubernetes.client.Configuration()
        configuration.host = f"http://127.0.0.1:{runner.addresses[0][1]}"
        client = kube.Kube(configuration)
        try:
            return await collect(client.watch("/api/v1/pods", {}, silence=10))
        finally:
            await client.close()
            await runner.cleanup()

    return asyncio.run(main())


def test_a_pod_of_megabytes_escaped_is_one_event_like_any_other():
    """A tenant's pod whose argument holds 400 KB of '<', which the API server escapes as \\u003c: a 2.4 MB line.
    aiohttp's line reader raised LineTooLong (not a ClientError) past 2 MiB, and the informer ended silently."""
    huge = pod("huge-0-0", job="huge")
    huge["spec"] = {"containers": [{"name": "c", "args": ["<" * 400_000]}]}
    line = json.dumps({"type": "ADDED", "object": huge}).replace("<", "\\u003c").encode()
    assert len(line) > 2_400_000
    after = {"type": "ADDED", "object": pod("job-0-0")}
    events = stream_events([line, b"not json at all", json.dumps(after).encode()])
    assert [e["object"]["metadata"]["name"] for e in events] == ["huge-0-0", "job-0-0"]
    assert events[0]["object"]["spec"]["containers"][0]["args"] == ["<" * 400_000]


def test_an_event_the_cache_cannot_read_is_skipped_naming_the_pod(caplog):
    cache = observe.PodCache()
    broken = pod("job-0-0")
    del broken["metadata"]["namespace"]
    broken["metadata"]["name"] = "broken"
    with caplog.at_level(logging.WARNING, "paratrain.operator"):
        assert cache._apply_event({"type": "ADDED", "object": broken}) is None
        assert cache._apply_event({"type": "ADDED", "object": "a string"}) is None
    assert "?/broken" in caplog.text
    assert cache._apply_event({"type": "ADDED", "object": pod("job-0-1", version=5)}) == "5" and len(cache) == 1


class FlakyApi:
    """A client whose first list fails with an error that is not an ApiError, then serves one pod."""

    def __init__(self) -> None:
        self.lists = 0
        self.watched = asyncio.Event()

    async def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        self.lists += 1
        if self.lists == 1:
            return {"metadata": {}}  # no resourceVersion: KeyError, as a malformed answer would raise
        return {"metadata": {"resourceVersion": "1"}, "items": [pod("job-0-0")]}

    async def watch(self, path: str, params: Any, silence: float) -> AsyncIterator[dict[str, Any]]:
        self.watched.set()
        await asyncio.sleep(3600)
        yield {}


def test_the_informer_lists_again_after_any_error_and_liveness_reports_a_cache_that_cannot_be_kept(monkeypatch):
    api = FlakyApi()
    monkeypatch.setattr(observe, "client", lambda: api)
    monkeypatch.setattr(observe.asyncio, "sleep", _fast_sleep)

    async def main() -> tuple[int, int, str | None, str | None]:
        cache = observe.PodCache()
        cache.streaming = False  # paged lists (the streamed list is test_a_streamed_list_...)
        task = asyncio.create_task(cache.run())
        await asyncio.wait_for(api.watched.wait(), 5)
        healthy = cache.problem()
        cache._failed(None, 0, RuntimeError("forbidden"))
        failing = cache.problem(asyncio.get_running_loop().time() + observe.UNHEALTHY_AFTER + 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cache.problem() == "the pods informer has stopped"
        return api.lists, len(cache), healthy, failing

    lists, cached, healthy, failing = asyncio.run(main())
    assert lists == 2 and cached == 1 and healthy is None
    assert failing and "no list or watch has succeeded" in failing and "forbidden" in failing


class StreamingApi:
    """A client whose watch streams the list (sendInitialEvents) where asked to, then one change; it refuses to
    stream where `refuse` is set (an API server without WatchList), and then serves paged lists; with `cut`, its
    first streamed list ends before its last pod (the request's time ran out)."""

    def __init__(self, refuse: bool = False, cut: bool = False) -> None:
        self.refuse, self.cut, self.watches, self.pages = refuse, cut, [], 0
        self.done = asyncio.Event()

    async def request(self, method: str, path: str, *, params: Any = None, **_: Any) -> dict[str, Any]:
        self.pages += 1
        return {"metadata": {"resourceVersion": "7"}, "items": [pod("job-0-0"), pod("job-0-1")]}

    async def watch(self, path: str, params: Any, silence: float) -> AsyncIterator[dict[str, Any]]:
        self.watches.append(dict(params))
        if params.get("sendInitialEvents") == "true":
            if self.refuse:
                raise kube.ApiError(422, "Invalid", "sendInitialEvents is forbidden for watch unless ...")
            yield {"type": "ADDED", "object": pod("job-0-0", version=3)}
            if self.cut and len(self.watches) == 1:
                return  # cut short: no end bookmark
            yield {"type": "ADDED", "object": "not a pod"}  # skipped, naming nothing
            yield {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "4"}}}  # not the end yet
            yield {"type": "ADDED", "object": pod("job-0-1", version=4)}
            yield {"type": "BOOKMARK", "object": {"metadata": {
                "resourceVersion": "5", "annotations": {observe.INITIAL_EVENTS_END: "true"}}}}
        yield {"type": "DELETED", "object": pod("job-0-0", version=6)}
        self.done.set()
        await asyncio.sleep(3600)


@pytest.mark.parametrize("refuse, cut", [(False, False), (True, False), (False, True)],
                         ids=["streamed", "paged where streaming is refused", "a streamed list cut short"])
def test_a_streamed_list_fills_the_cache_one_pod_at_a_time_and_the_watch_goes_on_from_its_end(monkeypatch, refuse,
                                                                                             cut):
    """A list cut short (no end bookmark) is a failure, retried with backoff: never taken for the whole list."""
    api = StreamingApi(refuse, cut)
    monkeypatch.setattr(observe, "client", lambda: api)
    monkeypatch.setattr(observe.asyncio, "sleep", _fast_sleep)
    relisted = []

    async def main() -> list[str]:
        cache = observe.PodCache(relisted=relisted.append)
        task = asyncio.create_task(cache.run())
        await asyncio.wait_for(api.done.wait(), 5)
        names = sorted(p.name for p in cache.pods("ns", "job"))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return names

    assert asyncio.run(main()) == ["job-0-1"]  # both listed, then job-0-0 deleted
    assert relisted == [None]
    if refuse:
        assert api.pages == 1 and api.watches[-1]["resourceVersion"] == "7"
    elif cut:
        assert api.pages == 0 and len(api.watches) == 2  # listed again, in full
    else:
        assert api.pages == 0 and len(api.watches) == 1  # one request: the list, then the watch, from it


_real_sleep = asyncio.sleep


async def _fast_sleep(seconds: float, *args: Any) -> Any:
    return await _real_sleep(min(seconds, 0.01), *args)


def test_the_liveness_probe_fails_while_the_cache_cannot_be_kept(monkeypatch):
    import kopf

    from paratrain_operator import handlers, reconcile

    cache = observe.PodCache()
    monkeypatch.setattr(reconcile, "pods", cache)
    assert handlers.pods_informer() == {"cachedPods": 0}
    cache.stopped = True
    with pytest.raises(kopf.PermanentError, match="informer has stopped"):
        handlers.pods_informer()


