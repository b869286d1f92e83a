"""A Kubernetes API for tests: kmock's KubernetesEmulator with the semantics a real operator relies on.

kmock 0.8 (pinned: this subclass overrides its request entry point) serves discovery and keeps objects with
their history (`emulator.objects[...]`); this subclass serves every resource request itself to close kmock's
gaps: `/api/v1/namespaces` paths; resourceVersion (a global counter, preconditions, 409 Conflict) and JSON-patch
`test` ops; uid, creationTimestamp, generation (bumped by spec changes) and namespace from the URL;
generateName; label and field selectors; ownerReference garbage collection (dangling owners too); finalizers;
graceful pod deletion (a bound, unfinished pod is only marked until its kubelet confirms); the `/status`
subresource (the main resource ignores status, `/status` changes only status); watches that resume from a
resourceVersion and send ADDED/MODIFIED/DELETED; PUT, deletecollection; CRDs that register their resource;
server-side Table output with a CRD's printer columns (what `kubectl get` prints); core discovery `v1`.

Fault injection (`inject`, `drop_watches` (optionally expiring the history a watch resumes from: 410 Gone),
`mute_watches`) lets tests break the API the way real clusters do.
All of it runs on one event loop (see `ApiServer`), so each request's read-modify-write is atomic.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import json
import re
import secrets
import string
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import aiohttp.web
import jsonpatch
import kmock

CORE = ("", "v1")
CRD_RESOURCE = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
PODS = kmock.resource("", "v1", "pods")
NAMESPACES = kmock.resource("", "v1", "namespaces")
_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}
# The resources a paratrain operator and kubectl touch; CRDs add theirs when created.
BUILTIN: dict[str, dict[str, Any]] = {
    "v1/namespaces": dict(kind="Namespace", singular="namespace", namespaced=False, shortnames={"ns"},
                          subresources={"status"}),
    "v1/pods": dict(kind="Pod", singular="pod", namespaced=True, shortnames={"po"}, subresources={"status", "log"}),
    "v1/services": dict(kind="Service", singular="service", namespaced=True, shortnames={"svc"},
                        subresources={"status"}),
    "v1/configmaps": dict(kind="ConfigMap", singular="configmap", namespaced=True, shortnames={"cm"}),
    "v1/secrets": dict(kind="Secret", singular="secret", namespaced=True),
    "v1/events": dict(kind="Event", singular="event", namespaced=True, shortnames={"ev"}),
    "v1/serviceaccounts": dict(kind="ServiceAccount", singular="serviceaccount", namespaced=True),
    "v1/persistentvolumeclaims": dict(kind="PersistentVolumeClaim", singular="persistentvolumeclaim",
                                      namespaced=True, shortnames={"pvc"}, subresources={"status"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": dict(
        kind="CustomResourceDefinition", singular="customresourcedefinition", namespaced=False,
        shortnames={"crd", "crds"}, subresources={"status"}),
}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.headers = code, reason, message, dict(headers or {})

    def response(self) -> aiohttp.web.Response:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message,
                "reason": self.reason, "code": self.code}
        return aiohttp.web.json_response(body, status=self.code, headers=self.headers)


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Route:
    resource: kmock.resource
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
    return Route(kmock.resource(group, version, rest[0]), namespace, rest[1] if len(rest) > 1 else None,
                 "/".join(rest[2:]) or None)


def _split_terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(current.strip())
            current = ""
        else:
            current += ch
    return [t for t in terms + [current.strip()] if t]


def label_matcher(selector: str | None) -> Callable[[Mapping[str, str]], bool]:
    """Kubernetes label selector syntax: `a=b`, `a==b`, `a!=b`, `a`, `!a`, `a in (x,y)`, `a notin (x,y)`."""
    checks: list[Callable[[Mapping[str, str]], bool]] = []
    for term in _split_terms(selector or ""):
        if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term):
            key, op, values = m[1], m[2], {v.strip() for v in m[3].split(",")}
            checks.append(lambda lb, k=key, vs=values, neg=op == "notin": (lb.get(k) in vs) != neg
                          if k in lb else neg)
        elif m := re.fullmatch(r"([^!=\s]+)\s*(==|=|!=)\s*(\S*)", term):
            key, op, value = m[1], m[2], m[3]
            checks.append(lambda lb, k=key, v=value, neg=op == "!=": (lb.get(k) == v) != neg)
        elif term.startswith("!"):
            checks.append(lambda lb, k=term[1:].strip(): k not in lb)
        elif re.fullmatch(r"[^\s!=(),]+", term):
            checks.append(lambda lb, k=term: k in lb)
        else:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r}")
    return lambda labels: all(check(labels) for check in checks)


def field_matcher(selector: str | None) -> Callable[[Mapping[str, Any]], bool]:
    """Field selectors: `metadata.name=x`, `status.phase!=Running`, any dotted path compared as text."""
    checks = []
    for term in _split_terms(selector or ""):
        m = re.fullmatch(r"([\w.]+)\s*(==|=|!=)\s*(.*)", term)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector: {term!r}")
        path, op, value = m[1].split("."), m[2], m[3]
        checks.append((path, op == "!=", value))

    def lookup(obj: Mapping[str, Any], path: list[str]) -> str:
        node: Any = obj
        for part in path:
            node = node.get(part) if isinstance(node, Mapping) else None
        return "" if node is None else str(node).lower() if isinstance(node, bool) else str(node)

    return lambda obj: all((lookup(obj, path) == value) != neg for path, neg, value in checks)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def jsonpath(obj: Any, path: str) -> Any:
    """The subset of kubectl JSONPath that printer columns use: `.a.b`, `[0]`, `[?(@.type=="X")]`."""
    node = obj
    for m in re.finditer(r"\.([\w-]+)|\[(\d+)\]|\[\?\(@\.([\w-]+)\s*==\s*[\"']([^\"']*)[\"']\)\]", path):
        if node is None:
            return None
        if m[1] is not None:
            node = node.get(m[1]) if isinstance(node, Mapping) else None
        elif m[2] is not None:
            node = node[int(m[2])] if isinstance(node, list) and int(m[2]) < len(node) else None
        else:
            node = next((x for x in node if isinstance(x, Mapping) and str(x.get(m[3])) == m[4]), None) \
                if isinstance(node, list) else None
    return node


def human_age(timestamp: str | None) -> str | None:
    """What `kubectl` shows in an AGE column (k8s.io/apimachinery's HumanDuration, roughly)."""
    if not timestamp:
        return None
    then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    s = max(0, int((datetime.now(timezone.utc) - then).total_seconds()))
    if s < 120:
        return f"{s}s"
    if s < 600:
        return f"{s // 60}m{s % 60}s" if s % 60 else f"{s // 60}m"
    if s < 3 * 3600:
        return f"{s // 60}m"
    if s < 8 * 3600:
        return f"{s // 3600}h{(s % 3600) // 60}m"
    return f"{s // 3600}h" if s < 48 * 3600 else f"{s // 86400}d"


@dataclass
class Fault:
    """Answer matching requests with an error (or hold them) instead of serving them.

    `after` matching requests are served normally first; the next `times` are faulted (None: all). With
    `hold`, a faulted request waits until `release()` before answering (with `status` if set, else normally):
    a test can kill a client while its request is in flight."""

    method: str | None = None
    path: re.Pattern[str] | None = None
    status: int | None = 500
    times: int | None = 1
    after: int = 0
    hold: bool = False
    retry_after: int | None = None
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
        raise ApiError(fault.status, reason, f"injected fault: {method} {path}", headers)


def expired_watch_event(position: int, expired_before: int) -> bytes:
    """The line an API server's watch sends once its history no longer reaches back to `position`."""
    status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 410,
              "reason": "Expired", "message": f"too old resource version: {position} ({expired_before})"}
    return json.dumps({"type": "ERROR", "object": status}).encode() + b"\n"


def is_watch(query: Mapping[str, str]) -> bool:
    return query.get("watch") in ("true", "1")


@dataclass
class _Change:
    rv: int
    resource: kmock.resource
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass(eq=False)
class _Watch:
    resource: kmock.resource
    namespace: str | None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: bool = False
    muted: bool = False


class Emulator(kmock.KubernetesEmulator):
    """See the module docstring. Create and use it inside its event loop (`ApiServer` does)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, info in BUILTIN.items():
            self.resources[key] = kmock.ResourceInfo(verbs=_VERBS, **info)
        self.faults: list[Fault] = []
        self.log: list[list[Any]] = []  # [method, path?query, status (None while in flight)] of every request
        self.internal_errors: list[str] = []  # emulator bugs (tests assert there are none)
        self.printer_columns: dict[kmock.resource, list[dict[str, Any]]] = {}
        self.pod_logs: dict[tuple[str, str], Any] = {}  # (namespace, pod) → Path, filled by the kubelet
        self._rv = 0
        self._expired_before = 0  # watches resuming from an older resourceVersion get 410 Gone
        self.expired_watches = 0  # how many did
        self._changes: list[_Change] = []
        self._watches: set[_Watch] = set()
        self._listeners: set[asyncio.Event] = set()  # in-process clients (the kubelet): never faulted
        self.create_object(NAMESPACES, None, {"metadata": {"name": "default"}})

    # ---- entry point -------------------------------------------------------------------------------------

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        body = await raw.read()
        entry: list[Any] = [raw.method, raw.path_qs, None]  # logged on arrival: watches stay open a long time
        self.log.append(entry)
        try:
            await apply_faults(self.faults, raw.method, raw.path)
            route = parse_route(raw.path)
            if route is None:
                response = await super().__call__(raw)  # discovery: kmock's
            else:
                response = await self._serve(raw, route, body)
        except ApiError as exc:
            response = exc.response()
        except Exception as exc:  # noqa: BLE001 (an emulator bug: answer 500 and keep it for the test to see)
            self.internal_errors.append(f"{raw.method} {raw.path_qs}: {traceback.format_exc()}")
            response = ApiError(500, "InternalError", f"emulator error: {exc!r}").response()
        entry[2] = response.status
        return response

    async def _serve(self, raw: aiohttp.web.BaseRequest, route: Route, body: bytes) -> aiohttp.web.StreamResponse:
        res, q = route.resource, raw.query
        info = self._info(res)
        if route.namespace is not None and not info.namespaced:
            raise ApiError(404, "NotFound", f"{res.plural} is not namespaced")
        if body.strip() and "json" not in raw.content_type:
            raise ApiError(415, "UnsupportedMediaType", f"only JSON bodies are served, not {raw.content_type}")
        try:
            data = json.loads(body) if body.strip() else None
        except ValueError as exc:
            raise ApiError(400, "BadRequest", f"the body is not JSON: {exc}") from None
        method = raw.method.upper()
        if route.subresource == "log" and res == PODS and method == "GET":
            return self._serve_log(route)
        if route.subresource not in (None, "status"):
            raise ApiError(404, "NotFound", f"subresource {route.subresource} is not served")
        if route.name is None:
            if method == "GET" and is_watch(q):
                return await self._serve_watch(raw, route)
            if method == "GET":
                items = self.select(res, route.namespace, q.get("labelSelector"), q.get("fieldSelector"))
                return self._respond_list(raw, res, items)
            if method == "POST":
                return aiohttp.web.json_response(self.create_object(res, route.namespace, data), status=201)
            if method == "DELETE":
                deleted = [self.delete_object(res, o["metadata"].get("namespace"), o["metadata"]["name"], data or {})
                           for o in self.select(res, route.namespace, q.get("labelSelector"), q.get("fieldSelector"))
                           if self._current(res, o["metadata"].get("namespace"), o["metadata"]["name"])]
                return aiohttp.web.json_response({"kind": f"{info.kind}List", "apiVersion": _api_version(res),
                                                  "metadata": {"resourceVersion": str(self._rv)}, "items": deleted})
        else:
            if method == "GET" and is_watch(q):
                return await self._serve_watch(raw, route, name=route.name)
            if method == "GET":
                obj = self.fetch(res, route.namespace, route.name)
                if obj is None:
                    raise self._not_found(res, route.name)
                return aiohttp.web.json_response(obj)
            if method == "PUT":
                return aiohttp.web.json_response(self.replace_object(res, route.namespace, route.name, data,
                                                              route.subresource))
            if method == "PATCH":
                return aiohttp.web.json_response(self.patch_object(res, route.namespace, route.name, data,
                                                            raw.content_type, route.subresource))
            if method == "DELETE":
                options = dict(data or {})
                if "gracePeriodSeconds" in q:
                    options["gracePeriodSeconds"] = int(q["gracePeriodSeconds"])
                return aiohttp.web.json_response(self.delete_object(res, route.namespace, route.name, options))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")

    # ---- discovery fix -----------------------------------------------------------------------------------

    async def _serve_version(self, request: kmock.Request) -> Any:
        served = await super()._serve_version(request)
        if request.resource is not None and request.resource.group == "":
            served["groupVersion"] = request.resource.version  # kmock says "/v1", which breaks kubectl
        for entry in served["resources"]:
            if "/" in entry["name"]:  # subresources have no short names (kubectl warns of ambiguity otherwise)
                entry.update(shortNames=[], categories=[], singularName="")
        return served

    # ---- the store ---------------------------------------------------------------------------------------

    def _info(self, res: kmock.resource) -> kmock.ResourceInfo:
        if res not in self.resources:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({res.plural})")
        return self.resources[res]

    def _not_found(self, res: kmock.resource, name: str) -> ApiError:
        return ApiError(404, "NotFound", f'{res.plural} "{name}" not found')

    def _current(self, res: kmock.resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (res, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw

    def _each(self, res: kmock.resource | None = None) -> Iterator[tuple[kmock.resource, dict[str, Any]]]:
        for (r, _, _), obj in list(self.objects.items()):
            if (res is None or r == res) and not obj.deleted:
                yield r, obj.raw

    def _record(self, res: kmock.resource, type_: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        self._changes.append(_Change(self._rv, res, type_, copy.deepcopy(obj), copy.deepcopy(old)))
        for watch in self._watches:
            watch.wake.set()
        for wake in self._listeners:
            wake.set()

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def fetch(self, res: kmock.resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        obj = self._current(res, namespace, name)
        return copy.deepcopy(obj) if obj is not None else None

    def select(self, res: kmock.resource, namespace: str | None = None, labels: str | None = None,
             fields: str | None = None) -> list[dict[str, Any]]:
        self._info(res)
        match_labels, match_fields = label_matcher(labels), field_matcher(fields)
        return [copy.deepcopy(o) for _, o in self._each(res)
                if (namespace is None or o["metadata"].get("namespace") == namespace)
                and match_labels(o["metadata"].get("labels") or {}) and match_fields(o)]

    def create_object(self, res: kmock.resource, namespace: str | None, body: Any) -> dict[str, Any]:
        info = self._info(res)
        if not isinstance(body, Mapping):
            raise ApiError(400, "BadRequest", "the body of the request must be an object")
        obj = copy.deepcopy(dict(body))
        meta = obj.setdefault("metadata", {})
        if info.namespaced:
            namespace = namespace or meta.get("namespace")
            if meta.get("namespace", namespace) != namespace:
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the "
                                                  "namespace sent on the request")
            if not namespace:
                raise ApiError(400, "BadRequest", "a namespace is required")
            if self._current(NAMESPACES, None, namespace) is None:
                raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found')
            meta["namespace"] = namespace
        else:
            namespace = None
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", "metadata.name or metadata.generateName is required")
            alphabet = string.ascii_lowercase + string.digits
            meta["name"] = meta["generateName"] + "".join(secrets.choice(alphabet) for _ in range(5))
        name = meta["name"]
        if self._current(res, namespace, name) is not None:
            raise ApiError(409, "AlreadyExists", f'{res.plural} "{name}" already exists')
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(key, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_iso(), generation=1, resourceVersion=self._next_rv())
        obj.setdefault("apiVersion", _api_version(res))
        obj.setdefault("kind", info.kind)
        if "status" in info.subresources and res != CRD_RESOURCE:
            obj.pop("status", None)  # status is written through /status only
        key = (res, namespace, name)
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        self._record(res, "ADDED", obj, None)
        if res == CRD_RESOURCE:
            self._register_crd(obj)
        self._collect_garbage()
        return copy.deepcopy(obj)

    def _store(self, res: kmock.resource, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        """Persist an update: immutable metadata kept, generation and resourceVersion bumped, event sent."""
        meta, old_meta = new.setdefault("metadata", {}), old["metadata"]
        for key in ("uid", "creationTimestamp", "name", "namespace", "deletionTimestamp",
                    "deletionGracePeriodSeconds", "generation"):
            if key in old_meta:
                meta[key] = old_meta[key]
            else:
                meta.pop(key, None)
        if meta.get("resourceVersion", old_meta["resourceVersion"]) != old_meta["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {res.plural} "{meta["name"]}": the '
                                            "object has been modified; please apply your changes to the latest "
                                            "version and try again")
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if new == old:
            return copy.deepcopy(old)  # a no-op write changes nothing, not even the resourceVersion
        essence = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
        if essence(new) != essence(old):
            meta["generation"] = old_meta.get("generation", 1) + 1
        meta["resourceVersion"] = self._next_rv()
        key = (res, meta.get("namespace"), meta["name"])
        if meta.get("deletionTimestamp") and old_meta.get("finalizers") and not meta.get("finalizers"):
            return self._remove(res, key, new)  # the last finalizer is gone
        self.objects[key].history.append(new)
        self._record(res, "MODIFIED", new, old)
        if res == CRD_RESOURCE:
            self._register_crd(new)
        return copy.deepcopy(new)

    def _with_subresource(self, res: kmock.resource, old: dict[str, Any], new: dict[str, Any],
                          subresource: str | None) -> dict[str, Any]:
        if subresource == "status":
            out = copy.deepcopy(old)
            out["status"] = new.get("status")
            out["metadata"]["resourceVersion"] = new.get("metadata", {}).get("resourceVersion",
                                                                              old["metadata"]["resourceVersion"])
            if out["status"] is None:
                out.pop("status")
            return out
        if "status" in self._info(res).subresources:
            new = dict(new)
            new.pop("status", None)
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
        return new

    def replace_object(self, res: kmock.resource, namespace: str | None, name: str, body: Any,
                subresource: str | None = None) -> dict[str, Any]:
        old = self._current(res, namespace, name)
        if old is None:
            raise self._not_found(res, name)
        if not isinstance(body, Mapping):
            raise ApiError(400, "BadRequest", "the body of the request must be an object")
        return self._store(res, old, self._with_subresource(res, old, copy.deepcopy(dict(body)), subresource))

    def patch_object(self, res: kmock.resource, namespace: str | None, name: str, body: Any,
              content_type: str = "application/merge-patch+json", subresource: str | None = None) -> dict[str, Any]:
        old = self._current(res, namespace, name)
        if old is None:
            raise self._not_found(res, name)
        if content_type == "application/json-patch+json":
            try:
                new = jsonpatch.apply_patch(copy.deepcopy(old), body)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise ApiError(409, "Conflict", f"the JSON patch test failed: {exc}") from None
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise ApiError(422, "Invalid", f"the JSON patch cannot be applied: {exc}") from None
        elif content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            # Strategic merge is served as a plain merge patch: lists are replaced, never merged by key.
            new = merge_patch(copy.deepcopy(old), body)
        else:
            raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {content_type}")
        return self._store(res, old, self._with_subresource(res, old, new, subresource))

    def delete_object(self, res: kmock.resource, namespace: str | None, name: str,
               options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        options = options or {}
        old = self._current(res, namespace, name)
        if old is None:
            raise self._not_found(res, name)
        meta = old["metadata"]
        pre = options.get("preconditions") or {}
        if (pre.get("uid") and pre["uid"] != meta["uid"]) or \
                (pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]):
            raise ApiError(409, "Conflict", f'precondition failed for {res.plural} "{name}"')
        key = (res, namespace, name)
        grace = options.get("gracePeriodSeconds")
        if meta.get("finalizers") or self._graceful(res, old, grace):
            if meta.get("deletionTimestamp"):
                if grace == 0 and not meta.get("finalizers"):
                    return self._remove(res, key, old)
                return copy.deepcopy(old)
            new = copy.deepcopy(old)
            new["metadata"]["deletionTimestamp"] = now_iso()
            if self._graceful(res, old, grace):
                spec_grace = (old.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
                new["metadata"]["deletionGracePeriodSeconds"] = grace if grace is not None else spec_grace
            new["metadata"]["resourceVersion"] = self._next_rv()
            self.objects[key].history.append(new)
            self._record(res, "MODIFIED", new, old)
            return copy.deepcopy(new)
        return self._remove(res, key, old)

    @staticmethod
    def _graceful(res: kmock.resource, obj: Mapping[str, Any], grace: int | None) -> bool:
        """A pod bound to a node and not finished stops first: its kubelet kills it, then confirms."""
        return (res == PODS and grace != 0 and bool((obj.get("spec") or {}).get("nodeName"))
                and (obj.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))

    def _remove(self, res: kmock.resource, key: tuple[Any, ...], last: dict[str, Any]) -> dict[str, Any]:
        final = copy.deepcopy(last)
        final["metadata"]["resourceVersion"] = self._next_rv()
        self.objects[key].delete()
        self._record(res, "DELETED", final, last)
        if res == NAMESPACES:
            for r, o in list(self._each()):
                if o["metadata"].get("namespace") == key[2] and self._current(r, key[2], o["metadata"]["name"]):
                    self.delete_object(r, key[2], o["metadata"]["name"], {"gracePeriodSeconds": 0})
        if res == CRD_RESOURCE:
            spec = last.get("spec") or {}
            for version in spec.get("versions") or []:
                plural = kmock.resource(spec.get("group"), version["name"], spec["names"]["plural"])
                self.resources.pop(plural, None)
        self._collect_garbage()
        return final

    def _collect_garbage(self) -> None:
        """Background cascading deletion: an object whose owners are all gone goes too."""
        while True:
            alive = {o["metadata"]["uid"] for _, o in self._each()}
            orphans = [(r, o) for r, o in self._each()
                       if (refs := o["metadata"].get("ownerReferences"))
                       and not any(ref.get("uid") in alive for ref in refs)
                       and not o["metadata"].get("deletionTimestamp")]
            if not orphans:
                return
            for r, o in orphans:
                if self._current(r, o["metadata"].get("namespace"), o["metadata"]["name"]) is not None:
                    self.delete_object(r, o["metadata"].get("namespace"), o["metadata"]["name"])

    def _register_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        for version in spec.get("versions") or []:
            if not version.get("served", True):
                continue
            res = kmock.resource(spec.get("group"), version["name"], names.get("plural"))
            self.resources[res] = kmock.ResourceInfo(
                kind=names.get("kind"), singular=names.get("singular"), namespaced=spec.get("scope") == "Namespaced",
                shortnames=set(names.get("shortNames") or []), categories=set(names.get("categories") or []),
                verbs=_VERBS, subresources=set((version.get("subresources") or {}).keys()))
            self.printer_columns[res] = version.get("additionalPrinterColumns") or []

    # ---- lists, tables, logs -----------------------------------------------------------------------------

    def _respond_list(self, raw: aiohttp.web.BaseRequest, res: kmock.resource,
                      items: list[dict[str, Any]]) -> aiohttp.web.Response:
        meta = {"resourceVersion": str(self._rv)}
        if "as=Table" in raw.headers.get("Accept", ""):
            return aiohttp.web.json_response(self._table(res, items, meta))
        kind = f"{self._info(res).kind}List"
        return aiohttp.web.json_response({"kind": kind, "apiVersion": _api_version(res), "metadata": meta,
                                          "items": items})

    def _table(self, res: kmock.resource, items: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
        """What the API server answers `kubectl get`: cells computed from the CRD's printer columns."""
        columns = self.printer_columns.get(res) or [
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        definitions = [{"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}]
        definitions += [{"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
                         "description": c.get("description", ""), "priority": c.get("priority", 0)}
                        for c in columns]
        rows = []
        for obj in items:
            cells: list[Any] = [obj["metadata"]["name"]]
            for c in columns:
                value = jsonpath(obj, c["jsonPath"])
                cells.append(human_age(value) if c.get("type") == "date" else value)
            rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                                    "metadata": obj["metadata"]}})
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta, "columnDefinitions": definitions,
                "rows": rows}

    def _serve_log(self, route: Route) -> aiohttp.web.Response:
        if self._current(PODS, route.namespace, route.name or "") is None:
            raise self._not_found(PODS, route.name or "")
        path = self.pod_logs.get((route.namespace or "", route.name or ""))
        return aiohttp.web.Response(text=path.read_text(errors="replace") if path and path.exists() else "")

    # ---- watches -----------------------------------------------------------------------------------------

    def _matches(self, obj: Mapping[str, Any] | None, namespace: str | None, name: str | None,
                 labels: Callable[[Mapping[str, str]], bool], fields: Callable[[Mapping[str, Any]], bool]) -> bool:
        if obj is None:
            return False
        meta = obj["metadata"]
        return ((namespace is None or meta.get("namespace") == namespace) and (name is None or meta["name"] == name)
                and labels(meta.get("labels") or {}) and fields(obj))

    def changes(self, since: int, res: kmock.resource, namespace: str | None = None, name: str | None = None,
                labels: str | None = None, fields: str | None = None) -> tuple[list[dict[str, Any]], int]:
        """Watch events after resourceVersion `since`, as a watch with these filters would send them; and the
        position to continue from. An object leaving the selection is DELETED, one entering it is ADDED."""
        match_labels, match_fields = label_matcher(labels), field_matcher(fields)
        start = bisect.bisect_right(self._changes, since, key=lambda c: c.rv)
        events = []
        for change in self._changes[start:]:
            if change.resource != res:
                continue
            now_in = self._matches(change.obj, namespace, name, match_labels, match_fields)
            was_in = self._matches(change.old, namespace, name, match_labels, match_fields)
            type_ = change.type
            if change.type == "MODIFIED" and now_in != was_in:
                type_ = "ADDED" if now_in else "DELETED"
            if now_in or was_in:
                events.append({"type": type_, "object": copy.deepcopy(change.obj)})
        return events, self._rv

    def listen(self) -> asyncio.Event:
        """An event set on every change, for in-process clients that read `changes` (faults never reach them)."""
        wake = asyncio.Event()
        self._listeners.add(wake)
        return wake

    async def _serve_watch(self, raw: aiohttp.web.BaseRequest, route: Route,
                           name: str | None = None) -> aiohttp.web.StreamResponse:
        q = raw.query
        res = route.resource
        labels, fields = q.get("labelSelector"), q.get("fieldSelector")
        label_matcher(labels), field_matcher(fields)  # a bad selector fails before the stream starts
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        since = q.get("resourceVersion")
        if not since or since == "0":  # no position: the current state first, as ADDED
            for obj in self.select(res, route.namespace, labels, fields):
                if name is None or obj["metadata"]["name"] == name:
                    await response.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            position = self._rv
        else:
            position = int(since)
            if position < self._expired_before:  # what an API server says once its watch cache moved on
                await response.write(expired_watch_event(position, self._expired_before))
                self.expired_watches += 1
                return response
        deadline = time.monotonic() + float(q["timeoutSeconds"]) if q.get("timeoutSeconds") else None
        watch = _Watch(res, route.namespace)
        self._watches.add(watch)
        try:
            while not watch.dropped:
                events, position = self.changes(position, res, route.namespace, name, labels, fields)
                if not watch.muted:
                    for event in events:
                        await response.write(json.dumps(event).encode() + b"\n")
                remaining = deadline - time.monotonic() if deadline else 5.0
                if remaining <= 0:
                    break
                watch.wake.clear()
                try:
                    await asyncio.wait_for(watch.wake.wait(), timeout=min(remaining, 5.0))
                except asyncio.TimeoutError:
                    pass
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watches.discard(watch)
        return response

    # ---- faults ------------------------------------------------------------------------------------------

    def inject(self, method: str | None = None, path: str | None = None, **kwargs: Any) -> Fault:
        return add_fault(self.faults, method, path, **kwargs)

    def _select_watches(self, resource: str | None) -> list[_Watch]:
        res = kmock.resource(resource) if resource else None
        return [w for w in self._watches if res is None or w.resource == res]

    def drop_watches(self, resource: str | None = None, *, expire_history: bool = False) -> int:
        """End open watch streams (all, or of one resource such as "v1/pods"), as an API server restart does.
        With `expire_history`, a watch resuming from before now gets 410 Gone (its client must list again)."""
        if expire_history:
            self._expired_before = self._rv
        watches = self._select_watches(resource)
        for watch in watches:
            watch.dropped = True
            watch.wake.set()
        return len(watches)

    def mute_watches(self, resource: str | None = None) -> int:
        """Keep open watch streams connected but silent: their clients miss every change from now on."""
        watches = self._select_watches(resource)
        for watch in watches:
            watch.muted = True
        return len(watches)


def _api_version(res: kmock.resource) -> str:
    return f"{res.group}/{res.version}" if res.group else res.version
