"""Rank 0's progress read (observe.fetch_progress) against a real HTTP server on loopback: the pod runs user code,
so what it answers is bounded, and one session serves every read."""

from __future__ import annotations

import asyncio
import json

import aiohttp.web

from paratrain_operator import observe

REPORT = {"step": 7, "totalSteps": 10, "loss": 2.5}


async def serve(body: bytes, status: int = 200) -> tuple[aiohttp.web.AppRunner, int]:
    async def progress(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(body=body, status=status, content_type="application/json")

    app = aiohttp.web.Application()
    app.router.add_get("/progress", progress)
    runner = aiohttp.web.AppRunner(app, access_log=None)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


def read(body: bytes, status: int = 200, reads: int = 1) -> list:
    async def main() -> list:
        runner, port = await serve(body, status)
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


def test_a_report_is_read_and_one_session_serves_every_read():
    *results, sessions = read(json.dumps(REPORT).encode(), reads=3)
    assert results == [REPORT] * 3 and sessions == 1


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
