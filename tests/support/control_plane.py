"""The real control plane under the tests: `scripts/test-cluster.sh up DIR` (kube-apiserver, etcd,
kube-controller-manager, kube-scheduler built from pinned sources), and a minimal client for its API.

The client speaks plain HTTPS with the kubeconfig's client certificate: tests see exactly what the server says
(status codes, `details.causes`), with no client library deciding what is an error.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

REPO = Path(__file__).resolve().parents[2]
TEST_CLUSTER = REPO / "scripts" / "test-cluster.sh"
TESTBIN = REPO / "scripts" / "testbin.sh"
T = TypeVar("T")


class ControlPlaneUnavailable(RuntimeError):
    """The control plane cannot be built or started here; the message says how to get it."""


def testbin() -> Path:
    """The folder of the pinned binaries (kubectl included), building them on first use."""
    if shutil.which("go") is None and subprocess.run(["bash", str(TESTBIN), "--path"],
                                                     capture_output=True).returncode != 0:
        raise ControlPlaneUnavailable(
            "the live tests run on a real Kubernetes control plane built from source, which needs Go 1.26 or newer: "
            "install it (https://go.dev/doc/install), then `bash scripts/testbin.sh` builds and caches the binaries")
    proc = subprocess.run(["bash", str(TESTBIN)], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise ControlPlaneUnavailable(f"scripts/testbin.sh failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


@dataclass
class ApiResponse:
    status: int
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def causes(self) -> list[dict[str, Any]]:
        return (self.body.get("details") or {}).get("causes") or []


class KubeApi:
    """Requests as the kubeconfig's user (admin unless another kubeconfig is given)."""

    def __init__(self, kubeconfig: Path):
        config = yaml.safe_load(kubeconfig.read_text())
        cluster = config["clusters"][0]["cluster"]
        user = config["users"][0]["user"]
        self.server = cluster["server"]
        self.tls = ssl.create_default_context(cafile=cluster.get("certificate-authority"))  # none: plain HTTP
        if "client-certificate" in user:
            self.tls.load_cert_chain(user["client-certificate"], user["client-key"])
        self._token = user.get("token")
        # What the owner of the server can say about it when it does not answer (ControlPlane.health).
        self.health: Callable[[], str] = lambda: ""

    def request(self, method: str, path: str, body: Any = None, query: dict[str, str] | None = None,
                content_type: str = "application/json") -> ApiResponse:
        url = self.server + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method, headers=self._headers(content_type))
        try:
            with urllib.request.urlopen(req, context=self.tls, timeout=30) as response:
                raw = response.read() or b"{}"
                try:
                    return ApiResponse(response.status, json.loads(raw))
                except RecursionError:  # an object nested deeper than Python decodes (test_live_hostile's)
                    return ApiResponse(response.status, {"undecodable": len(raw)})
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                body = json.loads(raw)
            except ValueError:
                body = {"message": raw.decode(errors="replace")}
            return ApiResponse(exc.code, body)
        except TimeoutError as exc:
            raise TimeoutError(f"{method} {path}: no answer in 30 s. {self.health()}") from exc

    def watch(self, path: str, **query: str) -> http.client.HTTPResponse:
        """A watch of `path` (`resourceVersion`, `timeoutSeconds`… in `query`): a response to read line by line
        (an event each) as the server sends them. An error status raises urllib.error.HTTPError."""
        url = f"{self.server}{path}?{urllib.parse.urlencode({'watch': 'true', **query})}"
        return urllib.request.urlopen(urllib.request.Request(url, headers=self._headers()), context=self.tls,
                                      timeout=90)

    def _headers(self, content_type: str = "application/json") -> dict[str, str]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def get(self, path: str, **query: str) -> ApiResponse:
        return self.request("GET", path, query=query or None)

    def create(self, path: str, body: dict[str, Any], dry_run: bool = False) -> ApiResponse:
        return self.request("POST", path, body, {"dryRun": "All"} if dry_run else None)

    def must(self, response: ApiResponse) -> dict[str, Any]:
        assert response.ok, f"{response.status}: {response.body.get('message', response.body)}"
        return response.body


def register_node(api: KubeApi, name: str, labels: dict[str, str], capacity: dict[str, str],
                  taints: list[dict[str, str]] = (), kubelet_port: int = 0) -> None:
    """A Ready node with this capacity, as a kubelet registers one (on 127.0.0.1, its API on `kubelet_port`, where
    the API server fetches `kubectl logs`). The API server's TaintNodesByCondition admission adds
    `node.kubernetes.io/not-ready` to every new node; the node lifecycle controller would lift it once the kubelet
    reports Ready, and this control plane runs none, so the registration lifts it itself."""
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "spec": {"taints": list(taints)},
            "status": {"capacity": capacity, "allocatable": capacity,
                       "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                       "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "message": "paratrain test node"}]}}
    api.must(api.create("/api/v1/nodes", body))
    api.must(api.request("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": list(taints) or None}},
                         content_type="application/merge-patch+json"))


def collection_path(api_version: str, plural: str, namespace: str | None = None) -> str:
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"


def wait_for(check: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class ControlPlane:
    """`scripts/test-cluster.sh up DIR` … `down DIR`, as a user would run it."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.bin = testbin()
        proc = subprocess.run(["bash", str(TEST_CLUSTER), "up", str(workdir)], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise ControlPlaneUnavailable(f"scripts/test-cluster.sh up failed ({proc.returncode}):\n{proc.stderr}")
        self.kubeconfig = workdir / "kubeconfig"
        self.api = KubeApi(self.kubeconfig)
        self.api.health = self.health
        # The namespace controller and service-account controller must be running before tests create pods.
        wait_for(lambda: self.api.get("/api/v1/namespaces/default/serviceaccounts/default").ok, 60,
                 "the default ServiceAccount (controller-manager up)")

    def health(self) -> str:
        """Whether each component still runs, the room left where etcd and the logs write, and the end of the
        etcd and kube-apiserver logs: what tells a server that is gone from one that is starved."""
        pids = (self.workdir / "pids").read_text().split() if (self.workdir / "pids").exists() else []
        names = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
        alive = [f"{name} {'runs' if Path(f'/proc/{pid}').exists() else 'has exited'}"
                 for name, pid in zip(names, pids)]
        room = [f"{shutil.disk_usage(where).free / 2**30:.1f} GiB free at {where}"
                for where in {self.workdir, (self.workdir / "etcd").resolve()} if where.exists()]
        logs = []
        for name in ("etcd", "kube-apiserver"):
            log = self.workdir / "logs" / f"{name}.log"
            if log.exists():
                logs.append(f"{name}.log ends:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-5:]))
        return "; ".join(alive + room) + "\n" + "\n".join(logs)

    def kubectl(self, *args: str, input: str | None = None, kubeconfig: Path | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig or self.kubeconfig)}
        return subprocess.run([str(self.bin / "kubectl"), f"--cache-dir={self.workdir / 'kube-cache'}", *args],
                              capture_output=True, text=True, input=input, timeout=timeout, env=env)

    def create_namespace(self, name: str) -> str:
        self.api.must(self.api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                              "metadata": {"name": name}}))
        wait_for(lambda: self.api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default").ok, 30,
                 f"namespace {name}'s default ServiceAccount")
        return name

    def wait_established(self, crd: str, timeout: float = 60) -> None:
        """Until the CRD named `crd` is Established. Not `kubectl wait --for=condition=Established`: on a CRD
        created a moment ago, before the server has written its conditions, that fails at once ("accessor error:
        <nil> is of the type <nil>") instead of waiting."""
        def established() -> bool:
            got = self.api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}")
            if not got.ok:
                return False
            conditions = (got.body.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)
        wait_for(established, timeout, f"CRD {crd} to be Established")

    def close(self) -> None:
        subprocess.run(["bash", str(TEST_CLUSTER), "down", str(self.workdir)], capture_output=True, timeout=60)
