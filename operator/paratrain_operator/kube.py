"""The operator's own API access: one async HTTP session speaking plain JSON, with bounded retries and a
client-side rate limit (a token bucket: `qps` requests a second on average, bursts of up to `burst`), as
client-go's clients have, so that a 1,024-pod gang does not flood the API server. Watches stream on a session of
their own and are not rate limited (one per informer, open for minutes).

Credentials come from the `kubernetes` package's config loaders (the pod's service account in a cluster, else
the kubeconfig): the same sources kopf's default login uses, so both act as one identity. Objects travel as
plain dicts, so whatever the renderer builds reaches the API unchanged (no client-side model conversion).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import re
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp

from . import decode, metrics
from .decode import ObjectRef

TRANSIENT = frozenset({429, 500, 502, 503, 504})
RETRY_DELAYS = (0.5, 1.0, 2.0)  # in-place retries of transient errors; then kopf's handler retry takes over
MAX_RETRY_AFTER = 10.0
BEARER_TOKEN_KEY = "BearerToken"
DEFAULT_QPS, DEFAULT_BURST = 100.0, 200
MAX_CONNECTIONS = 64  # requests in flight at once (aiohttp's pool); more wait for a connection
# One watch event at most: etcd stores objects of up to 1.5 MiB, and JSON can escape each byte as six (\u003c).
MAX_EVENT_BYTES = 10 << 20
# One answer to a plain request at most: one object, or a page of a list (see observe.PodCache._list).
MAX_RESPONSE_BYTES = 4 * MAX_EVENT_BYTES
# ApiError.status of what no retry mends: an answer the operator will not decode (too large, too deep, not JSON);
# a write refused before it left because this replica may not write (its Lease's renew deadline passed).
UNDECODABLE, NOT_LEADING = 1, 2
log = logging.getLogger("paratrain.operator")
_NAMESPACED = re.compile(r"/apis?/(?:[^/]+/)*?namespaces/([^/?]+)/")


class RateLimiter:
    """A token bucket (`burst` requests at once, then `qps` a second; qps <= 0: no limit) shared fairly between
    namespaces, as the API server's own priority and fairness shares its capacity between flows: while requests
    wait, tokens go round-robin to the namespaces that have some waiting, in the order they asked. One tenant's
    4,096 pod creates then delay another tenant's status write by one request per busy namespace, not by the whole
    queue, and a tenant alone still gets the whole budget."""

    def __init__(self, qps: float, burst: int):
        self.qps, self.burst = qps, max(1, burst)
        self._tokens, self._at = float(self.burst), time.monotonic()
        self._waiting: dict[str | None, collections.deque[asyncio.Future[None]]] = {}  # insertion order: the turn
        self._server: asyncio.Task[None] | None = None

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.qps)
        self._at = now

    async def acquire(self, namespace: str | None = None) -> None:
        if self.qps <= 0:
            return
        self._refill()
        if not self._waiting and self._tokens >= 1:  # nobody queued: no turn to keep
            self._tokens -= 1
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(namespace, collections.deque()).append(granted)
        if self._server is None or self._server.done() or self._server.get_loop() is not granted.get_loop():
            self._server = asyncio.create_task(self._serve())
        await granted  # a cancelled waiter's token is skipped by _serve (the future is done)

    async def _serve(self) -> None:
        while self._waiting:
            self._refill()
            if self._tokens < 1:
                await asyncio.sleep((1 - self._tokens) / self.qps)
                continue
            namespace = next(iter(self._waiting))
            queue = self._waiting.pop(namespace)
            granted = queue.popleft()
            if queue:
                self._waiting[namespace] = queue  # back of the line: the next namespace is served next
            if not granted.done():
                self._tokens -= 1
                granted.set_result(None)


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None):
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message, self.retry_after = status, reason, message, retry_after

    @property
    def transient(self) -> bool:
        """Worth retrying as is: throttling, server errors, no connection (status 0)."""
        return self.status in TRANSIENT or self.status == 0


def namespace_of(path: str) -> str | None:
    """The namespace a request acts in (None: cluster-scoped), the flow the rate limiter shares fairly by."""
    match = _NAMESPACED.match(path)
    return match[1] if match else None


def api_path(api_version: str, plural: str, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> str:
    """`/api/v1/namespaces/NS/pods/NAME/status`-style paths for core and group resources."""
    parts = ["/api/v1" if api_version == "v1" else f"/apis/{api_version}"]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(plural)
    parts += [p for p in (name, subresource) if p]
    return "/".join(parts)


class Kube:
    def __init__(self, configuration: Any, qps: float = DEFAULT_QPS, burst: int = DEFAULT_BURST):
        self._config = configuration
        self._session: aiohttp.ClientSession | None = None
        self._watch_session: aiohttp.ClientSession | None = None
        self._ssl_context: ssl.SSLContext | bool | None = None
        self.limiter = RateLimiter(qps, burst)
        self.stopped = False
        # Why this replica may not write now (None: it may), and how long it still may: leader election sets
        # them, so that no write leaves after the Lease's renew deadline, whatever pass or handler sends it.
        self.write_guard: Callable[[], str | None] = lambda: None
        self.write_time_left: Callable[[], float] = lambda: math.inf

    @classmethod
    def from_environment(cls, qps: float = DEFAULT_QPS, burst: int = DEFAULT_BURST) -> Kube:
        import kubernetes

        configuration = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=configuration)
        return cls(configuration, qps, burst)

    def _ssl(self) -> ssl.SSLContext | bool:
        if self._ssl_context is None:
            c = self._config
            if not c.host.startswith("https"):
                self._ssl_context = False
            else:
                context = ssl.create_default_context(cafile=c.ssl_ca_cert or None)
                if not c.verify_ssl:  # the kubeconfig's insecure-skip-tls-verify
                    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
                if c.cert_file:
                    context.load_cert_chain(c.cert_file, c.key_file)
                self._ssl_context = context
        return self._ssl_context

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "paratrain-operator"}
        # Calls the loader's refresh hook: a rotated service-account token is re-read. The `kubernetes` package
        # keeps the token under "BearerToken" (older releases: "authorization"): without it every call would be
        # anonymous, and a real API server forbids them all.
        token = (self._config.get_api_key_with_prefix(BEARER_TOKEN_KEY)
                 or self._config.get_api_key_with_prefix("authorization"))
        if token:
            headers["Authorization"] = token
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def close(self) -> None:
        for session in (self._session, self._watch_session):
            if session is not None:
                await session.close()
        self._session = self._watch_session = None

    async def stop(self) -> None:
        """Close, and refuse every later request (an operator handing its Lease over must not write again)."""
        self.stopped = True
        await self.close()

    async def request(self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                      content_type: str | None = None, max_bytes: int = MAX_RESPONSE_BYTES) -> Any:
        """One API call, retried in place on transient errors; raises ApiError (with the server's reason). An
        answer over `max_bytes`, or one decode refuses, raises ApiError with status UNDECODABLE (not retried)."""
        if body is not None and content_type is None:
            content_type = "application/json"
        for delay in (*RETRY_DELAYS, None):
            try:
                await self.limiter.acquire(namespace_of(path))
                return await self._once(method, path, body, params, content_type, max_bytes)
            except ApiError as exc:
                if not exc.transient or delay is None or self.stopped:
                    raise
                await asyncio.sleep(min(max(delay, exc.retry_after or 0), MAX_RETRY_AFTER))
        raise AssertionError("unreachable")

    async def _once(self, method: str, path: str, body: Any, params: Mapping[str, str] | None,
                    content_type: str | None, max_bytes: int) -> Any:
        if self.stopped:  # checked after every wait: not even a retry goes out after stop()
            raise ApiError(0, "Stopped", f"{method} {path}: the operator is stopping")
        if method != "GET" and (why := self.write_guard()):  # the last check before a write leaves
            raise ApiError(NOT_LEADING, "NotLeading", f"{method} {path}: {why}")
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30, sock_connect=5),
                                                  connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS))
        url = self._config.host.rstrip("/") + path
        # A write is sent within the time left before the deadline or not at all (it may wait for a connection).
        timeout = None if method == "GET" else aiohttp.ClientTimeout(total=min(30.0, self.write_time_left()),
                                                                     sock_connect=5)
        try:
            async with self._session.request(method, url, json=body, params=params, ssl=self._ssl(),
                                             headers=self._headers(content_type), timeout=timeout) as response:
                raw = await read_body(response, max_bytes)
                if response.status >= 400:
                    data = lenient_json(raw)
                    retry_after = response.headers.get("Retry-After")
                    raise ApiError(response.status, str(data.get("reason") or response.reason),
                                   str(data.get("message") or ""),
                                   float(retry_after) if retry_after and retry_after.isdigit() else None)
                return decode.loads(raw) if raw.strip() else None
        except decode.Undecodable as exc:  # the answer, not the request, is at fault: sending it again won't help
            raise ApiError(UNDECODABLE, "Undecodable", f"{method} {path}: the answer is {exc.reason}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise ApiError(0, type(exc).__name__, f"{method} {path}: {exc}") from None

    async def watch(self, path: str, params: Mapping[str, str], silence: float) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch request (`watch=true` is added), until the server ends it or `silence`
        seconds pass without data (a silent stream is cut, and its client resumes). The stream is read in chunks
        and split into lines here, so no event can overflow a line buffer (aiohttp's raises LineTooLong past
        2 MiB, which is not a ClientError): an event over MAX_EVENT_BYTES, or one that is not a JSON object, is
        skipped with a warning naming its object. Raises ApiError."""
        if self._watch_session is None:
            self._watch_session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=silence))
        url = self._config.host.rstrip("/") + path
        try:
            async with self._watch_session.get(url, params={**params, "watch": "true"}, ssl=self._ssl(),
                                               headers=self._headers(None)) as response:
                if response.status >= 400:
                    try:
                        data = lenient_json(await read_body(response, MAX_EVENT_BYTES))
                    except decode.Undecodable:
                        data = {}
                    raise ApiError(response.status, str(data.get("reason") or response.reason),
                                   str(data.get("message") or ""))
                async for line in lines(response.content.iter_any(), MAX_EVENT_BYTES, path):
                    event = parse_event(line, path)
                    if event is not None:
                        yield event
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise ApiError(0, type(exc).__name__, f"watch {path}: {exc}") from None


async def lines(chunks: AsyncIterator[bytes], limit: int, what: str) -> AsyncIterator[bytes]:
    """The non-blank newline-terminated lines of a byte stream (and a last unterminated one). A line longer than
    `limit` bytes is dropped as it streams (never held whole) with a warning naming its object."""
    buffer, skipped = bytearray(), 0  # skipped: bytes of an oversized line dropped so far (0: none)
    head = b""
    async for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if skipped:
                skipped += len(piece)
            else:
                buffer += piece
                if len(buffer) > limit:
                    head, skipped = bytes(buffer[:4096]), len(buffer)
                    buffer.clear()
            if end < 0:
                break
            if skipped:
                metrics.UNDECODABLE.inc()
                log.warning("%s: skipped a watch event of %d bytes (over %d) for %s", what, skipped, limit,
                            ObjectRef.of(head))
                skipped = 0
            elif buffer.strip():
                yield bytes(buffer)
            buffer.clear()
            start = end + 1
    if buffer.strip() and not skipped:
        yield bytes(buffer)


async def read_body(response: aiohttp.ClientResponse, max_bytes: int) -> bytearray:
    """A response's body, read in chunks and refused (decode.Undecodable) past `max_bytes` before it is held whole."""
    body = bytearray()
    async for chunk in response.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > max_bytes:
            raise decode.Undecodable(f"over {max_bytes} bytes", bytes(body[:4096]))
    return body


def lenient_json(raw: bytes | bytearray) -> Mapping[str, Any]:
    """An error answer's Status object, or {} where it is none (a proxy's text page, say)."""
    try:
        data = decode.loads(raw)
    except decode.Undecodable:
        return {}
    return data if isinstance(data, Mapping) else {}


def parse_event(line: bytes, what: str) -> dict[str, Any] | None:
    """One watch event's JSON, or None (with a warning naming its object) where it is not a JSON object or is
    nested deeper than the operator reads (decode.MAX_DEPTH)."""
    try:
        event = decode.loads(line)
    except decode.Undecodable as exc:
        metrics.UNDECODABLE.inc()
        log.warning("%s: skipped a watch event for %s: %s", what, exc.ref, exc.reason)
        return None
    if not isinstance(event, dict):
        log.warning("%s: skipped a watch event that is not an object", what)
        return None
    return event


_client: Kube | None = None


def connect(client: Kube | None = None) -> Kube:
    """Set up the process-wide client (at operator startup)."""
    global _client
    _client = client or Kube.from_environment()
    return _client


def client() -> Kube:
    if _client is None:
        raise RuntimeError("kube.connect() has not been called (the operator's startup handler does)")
    return _client
