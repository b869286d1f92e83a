"""A fault-injecting HTTP proxy between the operator and the real API server: the faults real clusters show
(`inject`, `drop_watches` with `expire_history`, `mute_watches`) and the request `log`, on the real thing. Also
the API vocabulary the test support shares: `Resource`, `parse_route`, `ApiError`.

The operator's kubeconfig points at the proxy (plain HTTP on 127.0.0.1, its ServiceAccount token): the proxy
forwards each request over HTTPS (trusting the control plane's CA, presenting no client certificate) with the
client's `Authorization` header unchanged, so the real authenticator and authorizer judge the operator's own
identity. Responses, watch streams included, are streamed back as they come. Everyone else (tests, the test
kubelet) talks to the API server directly, so faults reach the operator only.

It runs in its own thread and event loop: the test thread calls it, the operator's requests never wait on a test.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import time
import threading
import traceback
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import yarl
import yaml

from ...support.control_plane import KubeApi

# Per connection, never passed on (RFC 9110 §7.6.1); the body's length and encoding are the proxy's to set.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                        "upgrade", "host", "content-length", "accept-encoding", "content-encoding"})


@dataclass(frozen=True)
class Resource:
    """An API resource: `Resource.of("v1/pods")`, `Resource.of("apps/v1/deployments")`."""

    group: str
    version: str
    plural: str

    @classmethod
    def of(cls, resource: str | Resource) -> Resource:
        if isinstance(resource, Resource):
            return resource
        *group, version, plural = resource.split("/")
        return cls("/".join(group), version, plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, headers: Mapping[str, str] | None = None,
                 empty: bool = False):
        super().__init__(message)
        self.code, self.reason, self.message, self.headers = code, reason, message, dict(headers or {})
        self.empty = empty

    def response(self) -> aiohttp.web.Response:
        if self.empty:
            return aiohttp.web.Response(status=self.code, body=b"", headers=self.headers)
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message,
                "reason": self.reason, "code": self.code}
        return aiohttp.web.json_response(body, status=self.code, headers=self.headers)


@dataclass
class Route:
    resource: Resource
    namespace: str | None
    name: str | None
    subresource: str | None


def parse_route(path: str) -> Route | None:
    """`/api/v1[/namespaces/NS]/PLURAL[/NAME[/SUB]]` or `/apis/G/V/...`; None for discovery paths."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    return Route(Resource(group, version, rest[0]), namespace, rest[1] if len(rest) > 1 else None,
                 "/".join(rest[2:]) or None)


@dataclass
class Fault:
    """Answer matching requests with an error (or hold them) instead of serving them.

    `after` matching requests are served normally first; the next `times` are faulted (None: all). With
    `hold`, a faulted request waits until `release()` before answering (with `status` if set, else normally):
    a test can kill a client while its request is in flight. With `empty`, the answer is `status` with no body at
    all (a 200 with nothing in it, as a broken proxy or server can send)."""

    method: str | None = None
    path: re.Pattern[str] | None = None
    status: int | None = 500
    times: int | None = 1
    after: int = 0
    hold: bool = False
    retry_after: int | None = None
    empty: bool = False
    message: str | None = None  # the answer's message (default: "injected fault: METHOD PATH")
    seen: int = 0  # matching requests so far
    faulted: int = 0
    faulted_at: list[float] = field(default_factory=list)  # time.monotonic() of each faulted request
    released: bool = False

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method.upper() == method.upper()) and \
            (self.path is None or bool(self.path.search(path)))

    def release(self) -> None:
        self.released = True


def add_fault(faults: list[Fault], method: str | None, path: str | None, **kwargs: Any) -> Fault:
    """A fault on the next matching requests (see `Fault`); `path` is a regular expression searched in the request
    path (not the query), e.g. `r"/pods$"` for pod creation (with method POST)."""
    fault = Fault(method=method, path=re.compile(path) if path else None, **kwargs)
    faults.append(fault)
    return fault


async def apply_faults(faults: list[Fault], method: str, path: str) -> None:
    """Count the request against each matching fault; raise the first fault's error (after holding the request,
    if it holds). Returns when none faults it, or a held one with no status is released."""
    for fault in list(faults):
        if not fault.matches(method, path):
            continue
        fault.seen += 1
        if fault.seen <= fault.after or (fault.times is not None and fault.faulted >= fault.times):
            continue
        fault.faulted += 1
        fault.faulted_at.append(time.monotonic())
        while fault.hold and not fault.released:
            await asyncio.sleep(0.02)
        if fault.status is None:
            return
        headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
        reason = {403: "Forbidden", 409: "Conflict", 422: "Invalid", 429: "TooManyRequests",
                  503: "ServiceUnavailable"}.get(fault.status, "InternalError")
        raise ApiError(fault.status, reason, fault.message or f"injected fault: {method} {path}", headers,
                       empty=fault.empty)


def expired_watch_event(position: int, expired_before: int) -> bytes:
    """The line an API server's watch sends once its history no longer reaches back to `position`."""
    status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 410,
              "reason": "Expired", "message": f"too old resource version: {position} ({expired_before})"}
    return json.dumps({"type": "ERROR", "object": status}).encode() + b"\n"


def is_watch(query: Mapping[str, str]) -> bool:
    return query.get("watch") in ("true", "1")


@dataclass(eq=False)
class _Stream:
    """An open watch stream."""

    resource: Resource
    upstream: aiohttp.ClientResponse
    dropped: bool = False
    muted: bool = False


class FaultProxy:
    def __init__(self, kubeconfig: Path):
        cluster = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]
        self.upstream = cluster["server"].rstrip("/")
        self._tls = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self._admin = KubeApi(kubeconfig)  # only to read the server's current resourceVersion
        self.faults: list[Fault] = []
        # [method, path?query, status (None while in flight), bytes answered, start, end (monotonic seconds)] of
        # every request; a watch's bytes grow as its events pass.
        self.log: list[list[Any]] = []
        self.created: list[tuple[str | None, str, str]] = []  # (namespace, plural, name) of each successful create
        self.internal_errors: list[str] = []  # proxy bugs (tests assert there are none)
        self.expired_watches = 0
        self._expired_before = 0  # watches resuming from an older resourceVersion get 410 Gone
        self._streams: set[_Stream] = set()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True).start()
        self.url = self._call(self._start())

    # ---- the tests' API ----------------------------------------------------------------

    def inject(self, method: str | None = None, path: str | None = None, **kwargs: Any) -> Fault:
        """Fault the next matching requests: see `Fault`."""
        return add_fault(self.faults, method, path, **kwargs)

    def drop_watches(self, resource: str | None = None, *, expire_history: bool = False) -> int:
        """End open watch streams (all, or of one resource such as "v1/pods"), as an API server restart does.
        With `expire_history`, a watch resuming from before now gets 410 Gone (its client must list again)."""
        if expire_history:
            self._expired_before = int(self._admin.must(self._admin.get("/api/v1/namespaces", limit="1"))
                                       ["metadata"]["resourceVersion"])
        return self._call(self._drop(resource))

    def mute_watches(self, resource: str | None = None) -> int:
        """Keep open watch streams connected but silent: their clients miss every change from now on."""
        async def mute() -> int:
            streams = self._select(resource)
            for stream in streams:
                stream.muted = True
            return len(streams)
        return self._call(mute())

    def close(self) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)

    # ---- serving ---------------------------------------------------------------------------------------------

    async def _start(self) -> str:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        # A client that hangs up (e.g. the operator killed) cancels its request here: a held request is not
        # served later, and a watch no longer listened to ends.
        self._runner = aiohttp.web.AppRunner(self._app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    def _app(self) -> aiohttp.web.Application:
        app = aiohttp.web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{path:.*}", self._handle)
        return app

    async def _stop(self) -> None:
        for fault in self.faults:  # a request still held would hold up the shutdown
            fault.release()
        await self._drop(None)
        await self._runner.cleanup()
        await self._session.close()

    async def _handle(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        # Logged on arrival: watches stay open long.
        entry: list[Any] = [request.method, request.path_qs, None, 0, time.monotonic(), None]
        self.log.append(entry)
        try:
            await apply_faults(self.faults, request.method, request.path)
            if request.method == "GET" and is_watch(request.query):
                response = await self._watch(request, entry)
            else:
                response = await self._forward(request, entry)
        except ApiError as exc:
            response = exc.response()
        except (asyncio.CancelledError, ConnectionResetError):
            entry[2] = 499  # the client hung up (nginx's code for it): nothing more to answer
            raise
        except Exception as exc:  # noqa: BLE001 (a proxy bug: answer 502 and keep it for the test to see)
            self.internal_errors.append(f"{request.method} {request.path_qs}: {traceback.format_exc()}")
            response = ApiError(502, "BadGateway", f"fault proxy error: {exc!r}").response()
        entry[2], entry[5] = response.status, time.monotonic()
        return response

    def _send(self, request: aiohttp.web.Request, body: bytes | None = None) -> Any:
        # Uncompressed, so that the bytes passed back are the body (and a create's body can be read).
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP} | \
            {"Accept-Encoding": "identity"}
        return self._session.request(request.method, yarl.URL(self.upstream + request.raw_path, encoded=True),
                                     data=body, headers=headers, ssl=self._tls)

    @staticmethod
    async def _answer(request: aiohttp.web.Request, upstream: aiohttp.ClientResponse) -> aiohttp.web.StreamResponse:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        response = aiohttp.web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        await response.prepare(request)
        return response

    async def _forward(self, request: aiohttp.web.Request, entry: list[Any]) -> aiohttp.web.Response:
        async with self._send(request, await request.read() or None) as upstream:
            body = await upstream.read()
            if request.method == "POST" and upstream.ok:
                self._record_creation(request.path, body)
            # Logged before the client can see the answer: a test reads the log as soon as its call returns.
            entry[2], entry[3], entry[5] = upstream.status, len(body), time.monotonic()
            headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
            return aiohttp.web.Response(status=upstream.status, reason=upstream.reason, headers=headers, body=body)

    def _record_creation(self, path: str, body: bytes) -> None:
        route = parse_route(path)
        if route is None or route.name is not None:  # a subresource (binding, token): nothing of `path` created
            return
        name = (json.loads(body).get("metadata") or {}).get("name")
        if name:  # reviews (access, token) answer a create but store nothing
            self.created.append((route.namespace, route.resource.plural, name))

    async def _watch(self, request: aiohttp.web.Request, entry: list[Any]) -> aiohttp.web.StreamResponse:
        since = request.query.get("resourceVersion", "")
        if since not in ("", "0") and int(since) < self._expired_before:
            return await self._expired(request, int(since))
        route = parse_route(request.path)
        assert route is not None, f"a watch of {request.path}"
        async with self._send(request) as upstream:
            response = await self._answer(request, upstream)
            stream = _Stream(route.resource, upstream)
            self._streams.add(stream)
            try:
                async for line in _lines(upstream.content):
                    if stream.dropped:
                        break
                    if not stream.muted:
                        entry[3] += len(line)
                        await response.write(line)
            except aiohttp.ClientError:
                pass  # the upstream stream broke (dropping closes it under the reader): the client's ends too
            finally:
                self._streams.discard(stream)
            await response.write_eof()
            return response

    async def _expired(self, request: aiohttp.web.Request, since: int) -> aiohttp.web.StreamResponse:
        """What the API server answers a watch resuming from history it no longer has: 200, then an ERROR
        event with the 410 status."""
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(expired_watch_event(since, self._expired_before))
        await response.write_eof()
        self.expired_watches += 1
        return response

    def _select(self, resource: str | None) -> list[_Stream]:
        res = Resource.of(resource) if resource else None
        return [s for s in self._streams if res is None or s.resource == res]

    async def _drop(self, resource: str | None) -> int:
        streams = self._select(resource)
        for stream in streams:
            stream.dropped = True
            stream.upstream.close()
        return len(streams)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The stream's lines (one watch event each), however its chunks cut them."""
    pending = b""
    async for chunk in content.iter_any():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line + b"\n"
    if pending:
        yield pending
