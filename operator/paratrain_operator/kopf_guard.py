"""kopf's client, made to survive any object and any answer, and to write only while this replica may (kopf 1.45
offers no hook for any of it).

kopf decodes each watch line with `json.loads` and each list page with aiohttp's `response.json()`, unbounded,
and a watcher that raises ends the whole operator: its multitasker fails and `kopf.run` returns, so one tenant's
job nested 1,500 deep stopped every namespace, and a restarted operator failed again at its first list. `install`
replaces these names of kopf's client modules before kopf starts any watcher:
- `api.json` (the stream's decoder): a line is decoded by `decode.loads`; one it refuses becomes an event of a
  type kopf ignores (it logs it), and `on_undecodable` is told which object it was;
- `api.get` (lists, discovery): the body is read within kube.MAX_RESPONSE_BYTES and decoded by `decode.loads`;
  a list page it refuses is asked for again smaller, and a job that alone cannot be read is skipped;
- `api.patch`, `api.post`, `api.delete`: their answers (the whole object again) bounded the same way;
- `watching.continuous_watch` (one list + watch): any exception is caught, logged and counted; the watcher
  waits with exponential backoff and starts again (kopf's `infinite_watch` loops), and `problem()` reports a
  watcher that has not been back for DOWN_SECONDS, which fails the liveness probe (the kubelet restarts a replica
  that cannot recover);
- `api.request` (every call kopf makes): a write (kopf's bookkeeping annotations on a job) is refused while the
  Lease's elector says this replica may not write, checked before every try: a replica past its renew deadline
  writes nothing, kopf's writes included.
With `settings.watching.initial_streaming` (set where the API server streams lists), kopf reads its initial list
as watch events, one object a line, so an undecodable job is skipped alone instead of failing a whole page.
tests/operator/test_kopf_guard.py checks that the names replaced still exist with the signatures used.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import aiohttp
import kopf._cogs.clients.api as kopf_api
import kopf._cogs.clients.errors as kopf_errors
import kopf._cogs.clients.watching as kopf_watching

from . import decode
from .kube import MAX_RESPONSE_BYTES, read_body

log = logging.getLogger("paratrain.operator")
SKIPPED_EVENT = "ParatrainUndecodable"  # not ADDED/MODIFIED/DELETED/BOOKMARK: kopf's watch loop passes it by
DOWN_SECONDS = 60.0  # a watcher failing this long without one good event fails the liveness probe
_down_since: dict[str, float] = {}  # watcher → when it began failing
_failures: dict[str, int] = {}
_last_error: dict[str, str] = {}
_on_undecodable: Callable[[decode.Undecodable], None] = lambda exc: None
_elector: Any = None  # leader.Elector where replicas elect a leader: its may_write and write_time_left
_kopf_request = kopf_api.request
LIST_LIMIT = 100  # jobs a page where kopf lists page by page (kopf's own default asks for all at once)


class NotLeading(RuntimeError):
    """A write kopf was about to send while this replica may not write."""


class BoundedJson:
    """Stands in for the `json` module inside kopf's client: `loads` is decode.loads, and a line it refuses is
    reported and becomes an event kopf passes by."""

    dumps = staticmethod(json.dumps)

    @staticmethod
    def loads(text: str | bytes) -> Any:
        try:
            return decode.loads(text)
        except decode.Undecodable as exc:
            log.warning("jobs watch: skipped %s: %s", exc.ref, exc.reason)
            _on_undecodable(exc)
            return {"type": SKIPPED_EVENT, "object": {}}


async def bounded_get(url: str, *, settings: Any, payload: object | None = None,
                      headers: dict[str, str] | None = None, timeout: Any = None, logger: Any) -> Any:
    """kopf's `api.get`, its answer read within MAX_RESPONSE_BYTES and decoded within decode.MAX_DEPTH. A list
    page that cannot be read is asked for again, smaller, down to one object (see skip_unreadable_page)."""
    response = await guarded_request(method="get", url=url, payload=payload, headers=headers, timeout=timeout,
                                     settings=settings, logger=logger)
    async with response:
        raw = await read_body(response, MAX_RESPONSE_BYTES)
    try:
        return decode.loads(raw)
    except decode.Undecodable:
        page = await skip_unreadable_page(url, raw, settings=settings, logger=logger)
        if page is None:
            raise
        return page


async def guarded_request(method: str, url: str, *, settings: Any, backoffs: Any = None,
                          timeout: Any = None, **kwargs: Any) -> Any:
    """kopf's `api.request`. A write is refused while `_elector` says this replica may not write, and it is
    retried here, not inside kopf's request (which sleeps and sends again without asking), with the check before
    every try and each try's timeout capped at the time left before the renew deadline."""
    if method.lower() == "get" or _elector is None:
        return await _kopf_request(method, url, settings=settings, backoffs=backoffs, timeout=timeout, **kwargs)
    delays = settings.networking.error_backoffs if backoffs is None else backoffs
    delays = list(delays) if isinstance(delays, Iterable) else [delays]
    for delay in [*delays, None]:
        if why := _elector.may_write():
            raise NotLeading(f"{method.upper()} {url}: {why}")
        left = _elector.write_time_left()
        capped = aiohttp.ClientTimeout(total=min(left, (timeout.total if timeout and timeout.total else left)),
                                       sock_connect=getattr(timeout, "sock_connect", None))
        try:
            return await _kopf_request(method, url, settings=settings, backoffs=[], timeout=capped, **kwargs)
        except (aiohttp.ClientConnectionError, kopf_errors.APIServerError, asyncio.TimeoutError,
                kopf_errors.APIForbiddenError, kopf_errors.APITooManyRequestsError):
            if delay is None:
                raise
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


async def skip_unreadable_page(url: str, raw: bytes | bytearray, *, settings: Any, logger: Any) -> Any:
    """A list page (where kopf lists page by page: `limit` in the URL) that cannot be read, as a page that can:
    asked for again at half the size, down to one object, which is then skipped (reported like a skipped watch
    event) with the continue token the API server gave for it, so the list goes on past it. None for anything
    else (not a list page)."""
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    limit = int(query["limit"]) if query.get("limit", "").isdigit() else 0
    if limit > 1:
        smaller = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode({**query,
                                                                                        "limit": limit // 2})))
        return await bounded_get(smaller, settings=settings, logger=logger)
    if limit != 1:
        return None
    head, _, item = bytes(raw[:decode.HEAD_BYTES]).partition(b'"items":[')
    found = {key: re.search(rb'"%s":"([^"\\]*)"' % key.encode(), head) for key in ("resourceVersion", "continue")}
    if found["resourceVersion"] is None:
        return None
    skipped = decode.Undecodable("not decodable (a list page of it alone)", item)
    log.warning("jobs list: skipped %s: %s", skipped.ref, skipped.reason)
    _on_undecodable(skipped)
    return {"metadata": {key: match[1].decode() for key, match in found.items() if match}, "items": []}


def bounded_answer(method: str) -> Callable[..., Awaitable[Any]]:
    """kopf's `api.patch` / `post` / `delete`: the answer (the whole object again) read within
    MAX_RESPONSE_BYTES and decoded within decode.MAX_DEPTH; one that cannot be is `{}`, which kopf takes as no
    body to check its patch against (the write itself went through)."""
    async def call(url: str, *, settings: Any, logger: Any, **kwargs: Any) -> Any:
        response = await guarded_request(method=method, url=url, settings=settings, logger=logger, **kwargs)
        async with response:
            try:
                return decode.loads(await read_body(response, MAX_RESPONSE_BYTES))
            except decode.Undecodable as exc:
                log.warning("%s %s: its answer is %s; taken as written", method.upper(), url, exc.reason)
                return {}
    return call


def resilient(watch: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """`watch` (kopf's continuous_watch), ended by any exception after a backoff instead of ending kopf."""

    async def continuous_watch(**kwargs: Any) -> AsyncIterator[Any]:
        namespace, resource = kwargs.get("namespace"), kwargs.get("resource")
        name = f"{getattr(resource, 'plural', resource)} in {namespace or 'all namespaces'}"
        try:
            async for event in watch(**kwargs):
                if _down_since.pop(name, None) is not None:
                    log.info("watcher of %s is back", name)
                _failures.pop(name, None)
                yield event
        except Exception as exc:  # noqa: BLE001 (nothing a watch meets may end the operator)
            failures = _failures[name] = _failures.get(name, 0) + 1
            _down_since.setdefault(name, time.monotonic())
            _last_error[name] = f"{type(exc).__name__}: {exc}"[:300]
            delay = min(30.0, 0.5 * 2 ** min(failures, 6))
            log.error("watcher of %s failed (%s); starting it again in %.1f s", name, _last_error[name], delay)
            await asyncio.sleep(delay)

    return continuous_watch


def problem(now: float | None = None) -> str | None:
    """Why a kopf watcher cannot be trusted (for the liveness probe), or None."""
    now = time.monotonic() if now is None else now
    down = sorted((since, name) for name, since in _down_since.items() if now - since >= DOWN_SECONDS)
    if not down:
        return None
    since, name = down[0]
    return f"the watcher of {name} has failed for {now - since:.0f} s: {_last_error.get(name, '')}"


def install(on_undecodable: Callable[[decode.Undecodable], None], elector: Any = None) -> None:
    """Bound kopf's decoding, keep its watchers going and guard its writes with `elector` (idempotent);
    `on_undecodable` hears of each skipped object, on the event loop."""
    global _on_undecodable, _elector
    _on_undecodable, _elector = on_undecodable, elector
    kopf_api.json = BoundedJson  # type: ignore[assignment]
    kopf_api.get = bounded_get  # type: ignore[assignment]
    kopf_api.request = guarded_request  # type: ignore[assignment]
    for method in ("patch", "post", "delete"):
        setattr(kopf_api, method, bounded_answer(method))
    if not getattr(kopf_watching.continuous_watch, "paratrain_resilient", False):
        wrapped = resilient(kopf_watching.continuous_watch)
        wrapped.paratrain_resilient = True  # type: ignore[attr-defined]
        kopf_watching.continuous_watch = wrapped  # type: ignore[assignment]
