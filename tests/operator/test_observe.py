"""Rank 0's progress read (observe.fetch_progress) against a real HTTP server on loopback: the pod runs user code,
so what it answers is bounded, a redirect is never followed, nothing but JSON is parsed, one host is read at most
once a PROGRESS_MIN_INTERVAL, and one session serves every read."""

from __future__ import annotations

import asyncio
import json

import aiohttp.web
import pytest

from paratrain_operator import observe

REPORT = {"step": 7, "totalSteps": 10, "loss": 2.5}


@pytest.fixture(autouse=True)
def fresh_hosts(monkeypatch):
    """Each test starts with no host read lately."""
    monkeypatch.setattr(observe, "_progress_read_at", {})


async def serve(body: bytes, status: int = 200, content_type: str = "application/json",
                headers: dict | None = None, hits: list | None = None) -> tuple[aiohttp.web.AppRunner, int]:
    async def progress(_: aiohttp.web.Request) -> aiohttp.web.Response:
        if hits is not None:
            hits.append(1)
        return aiohttp.web.Response(body=body, status=status, content_type=content_type, headers=headers)

    app = aiohttp.web.Application()
    app.router.add_get("/progress", progress)
    runner = aiohttp.web.AppRunner(app, access_log=None)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


def read(body: bytes, status: int = 200, reads: int = 1, **serve_args) -> list:
    async def main() -> list:
        runner, port = await serve(body, status, **serve_args)
        try:
            results, sessions = [], set()
            for _ in range(reads):
                results.append(await observe.fetch_progress("127.0.0.1", port))
                sessions.add(id(observe._progress_session))
            return [*results, len(sessions)]
        finally:
            await observe.close()
            await runner.cleanup()

    return asyncio.run(main())


def test_a_report_is_read_and_one_session_serves_every_read(monkeypatch):
    monkeypatch.setattr(observe, "PROGRESS_MIN_INTERVAL", 0.0)
    *results, sessions = read(json.dumps(REPORT).encode(), reads=3)
    assert results == [REPORT] * 3 and sessions == 1


def test_one_host_is_read_at_most_once_an_interval(monkeypatch):
    monkeypatch.setattr(observe, "PROGRESS_MIN_INTERVAL", 0.3)

    async def main() -> list:
        runner, port = await serve(json.dumps(REPORT).encode())
        try:
            first = await observe.fetch_progress("127.0.0.1", port)
            too_soon = await observe.fetch_progress("127.0.0.1", port)
            await asyncio.sleep(0.35)
            return [first, too_soon, await observe.fetch_progress("127.0.0.1", port)]
        finally:
            await observe.close()
            await runner.cleanup()

    assert asyncio.run(main()) == [REPORT, None, REPORT]


def test_a_redirect_is_never_followed():
    """A tenant's rank 0 answering 302 to another address: the operator must not fetch it (reproduced before:
    aiohttp followed up to 10 redirects, and the other server's numbers landed in the tenant's status)."""
    async def main() -> tuple:
        hits: list = []
        elsewhere, elsewhere_port = await serve(json.dumps({"step": 999}).encode(), hits=hits)
        runner, port = await serve(b"", status=302,
                                   headers={"Location": f"http://127.0.0.1:{elsewhere_port}/progress"})
        try:
            return await observe.fetch_progress("127.0.0.1", port), hits
        finally:
            await observe.close()
            await runner.cleanup()
            await elsewhere.cleanup()

    report, hits = asyncio.run(main())
    assert report is None and hits == []


def test_only_json_is_parsed_and_deep_nesting_is_no_report():
    """A deeply nested body raised RecursionError, which no handler caught: every pass of the job failed."""
    assert read(json.dumps(REPORT).encode(), content_type="text/html")[0] is None
    assert read(b"[" * 100_000 + b"]" * 100_000)[0] is None


def test_an_oversized_or_failed_answer_is_no_report():
    huge = json.dumps({**REPORT, "padding": "x" * (observe.PROGRESS_MAX_BYTES + 1)}).encode()
    assert read(huge)[0] is None
    assert read(json.dumps(REPORT).encode(), status=503)[0] is None
    assert read(b"{not json")[0] is None


def test_no_answer_is_no_report():
    async def main():
        try:
            return await observe.fetch_progress("127.0.0.1", 9)  # discard port: nothing listens
        finally:
            await observe.close()

    assert asyncio.run(main()) is None
