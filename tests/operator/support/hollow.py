"""Hollow nodes for scale runs (bench/operator_scale.py, the pass-count test): nodes registered through the API
with no kubelet behind them, so the real kube-scheduler binds pods to them, and one thread that plays all their
kubelets just enough for the operator: a bound pod is reported Running (pod IP 127.0.0.1, where nothing answers
the progress read), a pod being deleted is removed at once, and `finish` ends a pod with an exit code. No process
runs: a 1,024-pod gang costs the API server its objects and this thread a few thousand requests.

With `progress=True` every pod gets a loopback address of its own (127.0.0.0/8 all reaches this host) whose
progress port answers rank 0's `GET /progress` (one thread serves them all), as a training pod would (its step
grows 10 a second), counting the reads: what running jobs cost the operator when they report progress.
"""

from __future__ import annotations

import http.server
import itertools
import json
import os
import resource
import selectors
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

from paratrain import contract

from ...support.control_plane import KubeApi, register_node
from .fake_trainer import json_handler

MERGE_PATCH = "application/merge-patch+json"
HOLLOW = "paratrain.test/hollow"  # the nodes' label and taint: only jobs that ask (`scheduling()`) land there


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ProgressServer:
    """Rank 0's progress endpoint of every hollow pod, on each pod's own loopback address: a listening socket per
    address (127.P.128.1 on, P from the process id as the try-out kubelet's 127.P.0.x are), all served by one
    thread. Not one socket on 0.0.0.0: that would collide with any trainer's progress server on the same port (the
    other test worker's try-out pods)."""

    def __init__(self) -> None:
        self.reads: Counter[str] = Counter()  # pod IP → progress reads
        self.said: dict[str, dict[str, Any]] = {}  # pod IP → more the pod's report says (restartsInPlace, ...)
        base = os.getpid() % 254 + 1
        self._addresses = (f"127.{base}.{b}.{c}" for b, c in itertools.product(range(128, 256), range(1, 255)))
        self._lock, started, reads, said = threading.Lock(), time.time(), self.reads, self.said
        # a socket per pod: thousands in the operator benches
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))

        def report(request: http.server.BaseHTTPRequestHandler) -> dict[str, Any]:
            address = request.connection.getsockname()[0]  # the pod's own
            reads[address] += 1
            now = time.time()
            return {"step": int((now - started) * 10) + 1, "totalSteps": 10**9, "loss": 2.5,
                    "tokensPerSecond": 1000.0, "phase": "training",
                    "updatedAt": datetime.fromtimestamp(now, timezone.utc).isoformat(), **said.get(address, {})}

        # Never bound: it only handles the connections the sockets below accept (a thread per request).
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), json_handler(report), bind_and_activate=False)
        self.server.daemon_threads = True
        self._selector, self._closed = selectors.DefaultSelector(), threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hollow-progress", daemon=True)
        self._thread.start()

    def address(self) -> str:
        """A fresh pod address, its progress port listening."""
        with self._lock:
            ip = next(self._addresses)
            listening = socket.create_server((ip, contract.PROGRESS_PORT))
            listening.setblocking(False)
            self._selector.register(listening, selectors.EVENT_READ)
            return ip

    def _serve(self) -> None:
        while not self._closed.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                try:
                    connection, peer = key.fileobj.accept()
                except (BlockingIOError, OSError):
                    continue
                connection.setblocking(True)
                self.server.process_request(connection, peer)

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        with self._lock:
            for key in list(self._selector.get_map().values()):
                self._selector.unregister(key.fileobj)
                key.fileobj.close()
        self._selector.close()
        self.server.server_close()


class HollowNodes:
    def __init__(self, api: KubeApi, count: int, *, prefix: str = "hollow", pods_per_node: int = 128,
                 capacity: dict[str, str] | None = None, workers: int = 8, progress: bool = False):
        self.api, self.prefix, self.names = api, prefix, []
        self.progress = ProgressServer() if progress else None
        self.capacity = capacity or {"cpu": "512", "memory": "4Ti", "pods": str(pods_per_node), "nvidia.com/gpu": "8"}
        self._mine: set[str] = set()
        self.add(count)
        self._started: set[str] = set()  # uids reported Running
        self._removed: set[str] = set()
        self._held: set[str] = set()  # nodes whose kubelet no longer answers (hold, lose)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="hollow-kubelet")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hollow-nodes", daemon=True)
        self._thread.start()

    def add(self, count: int) -> None:
        """Register `count` more nodes."""
        for _ in range(count):
            name = f"{self.prefix}-{len(self.names)}"
            register_node(self.api, name, {"kubernetes.io/hostname": name, HOLLOW: "true"}, self.capacity,
                          [{"key": HOLLOW, "value": "true", "effect": "NoSchedule"}])
            self.names.append(name)
            self._mine.add(name)

    @staticmethod
    def scheduling() -> dict[str, Any]:
        """A job spec's `scheduling` that puts its pods on hollow nodes."""
        return {"nodeSelector": {HOLLOW: "true"},
                "tolerations": [{"key": HOLLOW, "operator": "Equal", "value": "true", "effect": "NoSchedule"}]}

    def finish(self, namespace: str, pod: str, exit_code: int, message: str = "") -> None:
        """The pod's container exits with `exit_code` (its termination message `message`)."""
        body = self.api.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}").body
        containers = [c["name"] for c in body["spec"]["containers"]]
        terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                      "message": message, "startedAt": _now(), "finishedAt": _now()}
        status = {"phase": "Succeeded" if exit_code == 0 else "Failed",
                  "containerStatuses": [{"name": c, "ready": False, "restartCount": 0, "image": "hollow",
                                         "imageID": "", "state": {"terminated": terminated}} for c in containers]}
        self.api.must(self.api.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{pod}/status",
                                       {"status": status}, content_type=MERGE_PATCH))

    def hold(self, node: str) -> None:
        """The node's kubelet stops acting (a hung kubelet): its pods' deletions are never confirmed."""
        self._held.add(node)

    def lose(self, node: str) -> None:
        """The node is lost: its kubelet silent (hold) and the node NotReady and tainted unreachable, as the node
        lifecycle controller marks it (this control plane runs none)."""
        self.hold(node)
        self.api.must(self.api.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"taints": [
            {"key": HOLLOW, "value": "true", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"}]}}, content_type=MERGE_PATCH))
        condition = {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                     "message": "Kubelet stopped posting node status.", "lastTransitionTime": _now()}
        self.api.must(self.api.request("PATCH", f"/api/v1/nodes/{node}/status",
                                       {"status": {"conditions": [condition]}},
                                       content_type="application/strategic-merge-patch+json"))

    def shut_down(self, node: str) -> None:
        """An admin marks the lost node as shut down (non-graceful node shutdown): the out-of-service taint, after
        which Kubernetes' pod garbage collector force-deletes its terminating pods."""
        node_body = self.api.must(self.api.get(f"/api/v1/nodes/{node}"))
        taints = [*(node_body["spec"].get("taints") or []),
                  {"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute"}]
        self.api.must(self.api.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"taints": taints}},
                                       content_type=MERGE_PATCH))

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.progress:
            self.progress.close()
        for name in self.names:
            self.api.request("DELETE", f"/api/v1/nodes/{name}")

    # ---- the kubelets ------------------------------------------------------------------------------------

    def _watch(self) -> None:
        version = ""
        while not self._stop.is_set():
            try:
                if not version:
                    listed = self.api.must(self.api.get("/api/v1/pods", labelSelector=contract.LABEL_JOB))
                    for pod in listed["items"]:
                        self._seen(pod)
                    version = listed["metadata"]["resourceVersion"]
                with self.api.watch("/api/v1/pods", labelSelector=contract.LABEL_JOB, resourceVersion=version,
                                    allowWatchBookmarks="true", timeoutSeconds="60") as stream:
                    for line in stream:
                        if self._stop.is_set():
                            return
                        event = json.loads(line)
                        if event["type"] == "ERROR":
                            version = ""
                            break
                        version = event["object"]["metadata"]["resourceVersion"]
                        if event["type"] in ("ADDED", "MODIFIED"):
                            self._seen(event["object"])
            except (OSError, ValueError, AssertionError):
                version = ""
                self._stop.wait(0.5)

    def _seen(self, pod: dict[str, Any]) -> None:
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        if spec.get("nodeName") not in self._mine or spec.get("nodeName") in self._held:
            return
        uid, where = meta["uid"], f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        if meta.get("deletionTimestamp"):
            if uid not in self._removed:
                self._removed.add(uid)
                self._pool.submit(self.api.request, "DELETE", where, {"gracePeriodSeconds": 0})
        elif status.get("phase", "Pending") == "Pending" and uid not in self._started:
            self._started.add(uid)
            self._pool.submit(self._run, where, [c["name"] for c in spec["containers"]])

    def _run(self, where: str, containers: list[str]) -> None:
        started = _now()
        ip = self.progress.address() if self.progress else "127.0.0.1"
        status = {"phase": "Running", "hostIP": "127.0.0.1", "podIP": ip, "podIPs": [{"ip": ip}],
                  "startTime": started,
                  "conditions": [{"type": t, "status": "True", "lastTransitionTime": started}
                                 for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")],
                  "containerStatuses": [{"name": c, "ready": True, "restartCount": 0, "image": "hollow",
                                         "imageID": "", "started": True, "state": {"running": {"startedAt": started}}}
                                        for c in containers]}
        self.api.request("PATCH", f"{where}/status", {"status": status}, content_type=MERGE_PATCH)
