"""The live tests' cluster on the real control plane (scripts/test-cluster.sh): the operator runs as its own
ServiceAccount bound to the RBAC it declares (paratrain_operator.rbac, which the Helm chart renders), so the real
authorizer judges least privilege; the test kubelet registers a real Node and runs the pods kube-scheduler binds
to it; the garbage collector, namespace and service-account controllers are Kubernetes' own. With `faults=True`
the operator talks to the API server through a fault-injecting proxy (`self.proxy`, fault_proxy.py).
"""

from __future__ import annotations

import asyncio
import http.server
import json
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from paratrain.api.crd import crd_manifest
from paratrain_operator import rbac

from ...support.control_plane import ApiResponse, ControlPlane, KubeApi, register_node, wait_for
from .cluster import ClusterBase
from .fault_proxy import ApiError, Resource
from .fault_proxy import FaultProxy
from .kubelet import Kubelet, PodNetwork
from .server import OnLoop

OPERATOR_NAMESPACE = "paratrain-system"
OPERATOR_ACCOUNT = "paratrain-operator"
MERGE_PATCH = "application/merge-patch+json"
# One node with room for every test's gang (finished pods hold nothing); a GPU count for GPU-shaped specs.
NODE_CAPACITY = {"cpu": "256", "memory": "1Ti", "pods": "250", "nvidia.com/gpu": "16"}


def resource_path(resource: str | Resource, namespace: str | None = None, name: str | None = None,
                  subresource: str | None = None) -> str:
    """`"v1/pods"` or a Resource → its REST path."""
    res = Resource.of(resource)
    root = f"/api/{res.version}" if not res.group else f"/apis/{res.group}/{res.version}"
    path = f"{root}/namespaces/{namespace}/{res.plural}" if namespace else f"{root}/{res.plural}"
    return path + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")


def _checked(response: ApiResponse) -> dict[str, Any]:
    if not response.ok:
        raise ApiError(response.status, response.body.get("reason", ""), response.body.get("message", ""))
    return response.body


class RealApi(OnLoop):
    """The tests' view of the real API (objects, create, patch, delete), plus the loop the kubelet runs on
    (`call` runs a function there)."""

    def __init__(self, plane: ControlPlane):
        self.plane, self.http = plane, plane.api
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-kubelet", daemon=True)
        self._thread.start()

    def objects(self, resource: str, namespace: str | None = None, labels: str | None = None) -> list[dict[str, Any]]:
        query = {"labelSelector": labels} if labels else None
        return _checked(self.http.request("GET", resource_path(resource, namespace), query=query))["items"]

    def object(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        response = self.http.get(resource_path(resource, namespace, name))
        return None if response.status == 404 else _checked(response)

    def create(self, resource: str, body: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        """As kubectl creates: strict field validation (an unknown field is an error, not silently pruned)."""
        return _checked(self.http.request("POST", resource_path(resource, namespace), body,
                                          {"fieldValidation": "Strict"}))

    def patch(self, resource: str, namespace: str | None, name: str, body: Any, subresource: str | None = None
              ) -> dict[str, Any]:
        return _checked(self.http.request("PATCH", resource_path(resource, namespace, name, subresource), body,
                                          content_type=MERGE_PATCH))

    def delete(self, resource: str, namespace: str | None, name: str, **options: Any) -> dict[str, Any]:
        return _checked(self.http.request("DELETE", resource_path(resource, namespace, name), options or None))

    def create_namespace(self, name: str) -> None:
        self.plane.create_namespace(name)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class NodeApi:
    """What the test kubelet needs of the API, for one node:
    a watch of every pod (to record creations) that passes on the pods bound to this node."""

    def __init__(self, http: KubeApi, node: str, loop: asyncio.AbstractEventLoop):
        self.http, self.node, self._loop = http, node, loop
        self.pod_logs: dict[tuple[str, str], Path] = {}
        self.created: dict[str, list[str]] = {}  # namespace → pod names, once per creation (uid)
        self._uids: set[str] = set()
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._wakes: list[asyncio.Event] = []
        self._stopped = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"pods-watch-{node}", daemon=True)
        self._watcher.start()

    # ---- the kubelet's calls -----------------------------------------------------------------------------

    def listen(self) -> asyncio.Event:
        wake = asyncio.Event()
        self._wakes.append(wake)
        return wake

    def changes(self, since: int, res: Resource) -> tuple[list[dict[str, Any]], int]:
        with self._lock:
            return self._events[since:], len(self._events)

    def fetch(self, res: Resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        response = self.http.get(resource_path(res, namespace, name))
        return None if response.status == 404 else _checked(response)

    def patch_object(self, res: Resource, namespace: str | None, name: str, body: Any,
                     subresource: str | None = None) -> dict[str, Any]:
        return _checked(self.http.request("PATCH", resource_path(res, namespace, name, subresource), body,
                                          content_type=MERGE_PATCH))

    def delete_object(self, res: Resource, namespace: str | None, name: str,
                      options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return _checked(self.http.request("DELETE", resource_path(res, namespace, name), dict(options or {})))

    def stop(self) -> None:
        self._stopped.set()

    # ---- the watch ---------------------------------------------------------------------------------------

    def _watch(self) -> None:
        version = ""
        while not self._stopped.is_set():
            try:
                if not version:
                    listed = _checked(self.http.get("/api/v1/pods"))
                    for pod in listed["items"]:
                        self._seen("ADDED", pod)
                    version = listed["metadata"]["resourceVersion"]
                version = self._stream(version)
            except (OSError, ApiError, ValueError):
                version = ""  # e.g. 410 Gone: list again (the kubelet ignores pods it already runs)
                self._stopped.wait(0.5)

    def _stream(self, version: str) -> str:
        with self.http.watch("/api/v1/pods", resourceVersion=version, allowWatchBookmarks="true",
                             timeoutSeconds="60") as stream:
            for line in stream:
                if self._stopped.is_set():
                    break
                event = json.loads(line)
                if event["type"] == "ERROR":
                    raise ApiError(event["object"].get("code", 500), "", event["object"].get("message", ""))
                version = event["object"]["metadata"]["resourceVersion"]
                if event["type"] != "BOOKMARK":
                    self._seen(event["type"], event["object"])
        return version

    def _seen(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if meta["uid"] not in self._uids:
            self._uids.add(meta["uid"])
            self.created.setdefault(meta["namespace"], []).append(meta["name"])
        if (pod.get("spec") or {}).get("nodeName") != self.node:
            return
        with self._lock:
            self._events.append({"type": kind, "object": pod})
        for wake in self._wakes:
            self._loop.call_soon_threadsafe(wake.set)


class LogServer:
    """The one kubelet API the tests use: `GET /containerLogs/NS/POD/CONTAINER`, which the API server proxies for
    `kubectl logs`. HTTPS with the control plane's serving certificate (the API server does not verify it)."""

    def __init__(self, logs: Mapping[tuple[str, str], Path], pki: Path):
        logs_ = logs

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server API)
                parts = urllib.parse.urlparse(self.path).path.split("/")
                path = logs_.get((parts[2], parts[3])) if len(parts) >= 4 and parts[1] == "containerLogs" else None
                body = path.read_bytes() if path and path.exists() else b""
                self.send_response(200 if path else 404)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(pki / "apiserver.crt", pki / "apiserver.key")
        self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="kubelet-logs", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class RealCluster(ClusterBase):
    def __init__(self, plane: ControlPlane, workdir: Path, *,
                 command: Callable[[Mapping[str, Any]], list[str] | None] | None = None,
                 resync_seconds: float = 1.0, node: str = "test-node", faults: bool = False,
                 operator_args: tuple[str, ...] = (), extra_env: Mapping[str, str] | None = None,
                 capacity: Mapping[str, str] = NODE_CAPACITY):
        super().__init__(workdir, resync_seconds, operator_args)
        self.plane, self.kubeconfig = plane, plane.kubeconfig
        install_crd(plane)
        self.api = RealApi(plane)
        self.node_api = NodeApi(plane.api, node, self.api._loop)
        self.logs = LogServer(self.node_api.pod_logs, plane.workdir / "pki")
        register_node(plane.api, node, {"kubernetes.io/hostname": node}, dict(capacity), kubelet_port=self.logs.port)
        self.network = PodNetwork()  # every node's kubelet resolves the gang's names alike
        self._command, self._extra_env = command, extra_env
        self.kubelet = Kubelet(self.node_api, workdir, node_name=node, command=command, extra_env=extra_env,
                               network=self.network)
        self._kubelet_run = self.api.start(self.kubelet.run)
        self._more: list[tuple[Kubelet, NodeApi, LogServer, Any]] = []  # add_node's
        self.proxy = FaultProxy(plane.kubeconfig) if faults else None
        self.start_operator()

    def add_node(self, name: str, capacity: Mapping[str, str] = NODE_CAPACITY,
                 labels: Mapping[str, str] | None = None) -> Kubelet:
        """Another node, served by a kubelet of its own (the same command hook and env as the first)."""
        node_api = NodeApi(self.plane.api, name, self.api._loop)
        logs = LogServer(node_api.pod_logs, self.plane.workdir / "pki")
        register_node(self.plane.api, name, {"kubernetes.io/hostname": name, **(labels or {})}, dict(capacity),
                      kubelet_port=logs.port)
        kubelet = Kubelet(node_api, self.workdir, node_name=name, command=self._command,
                          extra_env=self._extra_env, network=self.network)
        self._more.append((kubelet, node_api, logs, self.api.start(kubelet.run)))
        return kubelet

    def cordon(self, node: str, unschedulable: bool = True) -> None:
        """`kubectl cordon NODE` (or uncordon, with False)."""
        _checked(self.plane.api.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": unschedulable}},
                                        content_type=MERGE_PATCH))

    def operator_kubeconfig(self) -> Path:
        return operator_kubeconfig(self.plane, self.workdir / "operator.kubeconfig",
                                   server=self.proxy.url if self.proxy else None)

    def operator_requests(self) -> list[list[Any]]:
        return list(self._faults().log)

    def pod_creations(self, namespace: str) -> list[str]:
        """The name of every pod created in `namespace`, once per creation (a name twice: re-created)."""
        return sorted(self.node_api.created.get(namespace, []))

    def creations(self, namespace: str, plural: str) -> list[str]:
        """The name of every object of resource `plural` the operator created in `namespace`, once per creation."""
        created = list(self._faults().created)
        return sorted(name for ns, plural_, name in created if ns == namespace and plural_ == plural)

    def bind(self, namespace: str, pod: str) -> None:
        """Bind a pod to this cluster's node, as the scheduler it names would (one this cluster does not run,
        such as Volcano)."""
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": self.kubelet.node_name}}
        _checked(self.plane.api.request("POST", resource_path("v1/pods", namespace, pod, "binding"), binding))

    def kubectl_binary(self) -> str:
        return str(self.plane.bin / "kubectl")

    def _faults(self) -> FaultProxy:
        assert self.proxy, "only the fault proxy sees the operator's requests: RealCluster(faults=True)"
        return self.proxy

    def close(self) -> None:
        self.kill_operator()
        if self.proxy:
            self.proxy.close()
        for kubelet, node_api, logs, run in self._more:
            self.api.call(kubelet.stop)
            run.cancel()
            node_api.stop()
            logs.close()
            self.plane.api.request("DELETE", f"/api/v1/nodes/{kubelet.node_name}")
        self.api.call(self.kubelet.stop)
        self._kubelet_run.cancel()
        self.node_api.stop()
        self.logs.close()
        self.api.close()
        self.plane.api.request("DELETE", f"/api/v1/nodes/{self.kubelet.node_name}")


def install_crd(plane: ControlPlane, manifest: Mapping[str, Any] | None = None) -> None:
    """Paratrain's CRD, or `manifest`'s, once per control plane; returns once its resource is served."""
    crd, crds = manifest or crd_manifest(), "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    if plane.api.get(f"{crds}/{crd['metadata']['name']}").status == 404:
        plane.api.must(plane.api.create(crds, dict(crd)))
    group, version = crd["spec"]["group"], crd["spec"]["versions"][0]["name"]
    wait_for(lambda: plane.api.get(f"/apis/{group}/{version}").ok, 30, f"the CRD of {group} to be served")


def replace_crd(plane: ControlPlane, manifest: Mapping[str, Any]) -> None:
    """Replace (or create) the CRD `manifest` names with it; returns once its resource is served."""
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    existing = plane.api.get(f"{crds}/{manifest['metadata']['name']}")
    if existing.status == 404:
        install_crd(plane, manifest)
        return
    body = {**manifest, "metadata": {**manifest["metadata"],
                                     "resourceVersion": existing.body["metadata"]["resourceVersion"]}}
    plane.api.must(plane.api.request("PUT", f"{crds}/{manifest['metadata']['name']}", body))
    group, version = manifest["spec"]["group"], manifest["spec"]["versions"][0]["name"]
    wait_for(lambda: plane.api.get(f"/apis/{group}/{version}").ok, 30, f"the CRD of {group} to be served")


def operator_kubeconfig(plane: ControlPlane, path: Path, server: str | None = None) -> Path:
    """A kubeconfig for the operator's ServiceAccount, bound cluster-wide to exactly the rules it declares; at
    `server` (plain HTTP: the fault proxy) instead of the API server if given."""
    api = plane.api
    if not api.get(f"/api/v1/namespaces/{OPERATOR_NAMESPACE}").ok:
        plane.create_namespace(OPERATOR_NAMESPACE)
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": OPERATOR_ACCOUNT},
            "rules": rbac.policy_rules() + rbac.policy_rules(rbac.CLUSTER_RULES)}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": OPERATOR_ACCOUNT},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": OPERATOR_ACCOUNT},
               "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_ACCOUNT, "namespace": OPERATOR_NAMESPACE}]}
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": OPERATOR_ACCOUNT}}
    # Leader election's Lease, in the operator's own namespace only (as the chart's Role).
    lease_role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                  "metadata": {"name": f"{OPERATOR_ACCOUNT}-leader-election"},
                  "rules": rbac.policy_rules(rbac.LEASE_RULES)}
    lease_binding = {**binding, "kind": "RoleBinding", "metadata": lease_role["metadata"],
                     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                 "name": lease_role["metadata"]["name"]}}
    namespaced = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{OPERATOR_NAMESPACE}"
    for path_, body in ((f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/serviceaccounts", account),
                        ("/apis/rbac.authorization.k8s.io/v1/clusterroles", role),
                        ("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding),
                        (f"{namespaced}/roles", lease_role), (f"{namespaced}/rolebindings", lease_binding)):
        response = api.create(path_, body)
        if response.status == 409:  # another test module's: bring the rules up to date
            api.must(api.request("PUT", f"{path_}/{body['metadata']['name']}", _with_version(api, path_, body)))
        else:
            api.must(response)
    token = api.must(api.create(f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/serviceaccounts/{OPERATOR_ACCOUNT}/token",
                                {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                 "spec": {"expirationSeconds": 7200}}))["status"]["token"]
    admin = yaml.safe_load(plane.kubeconfig.read_text())
    admin["users"] = [{"name": OPERATOR_ACCOUNT, "user": {"token": token}}]
    admin["contexts"][0]["context"]["user"] = OPERATOR_ACCOUNT
    if server:
        admin["clusters"][0]["cluster"] = {"server": server}
    path.write_text(yaml.safe_dump(admin))
    return path


def _with_version(api: KubeApi, collection: str, body: dict[str, Any]) -> dict[str, Any]:
    current = api.must(api.get(f"{collection}/{body['metadata']['name']}"))
    return {**body, "metadata": {**body["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]}}
