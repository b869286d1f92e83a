"""A test kubelet: runs each pod's container as a local process and reports it through the pod's status.

For every new pod it binds the pod to its node, gives it a loopback IP of its own (127.0.0.N, stable per
hostname.subdomain, like the pod's DNS name), materialises its ConfigMap / Secret / emptyDir / PVC volumes in
a temp dir, and starts `command + args` with the container's env (the downward API resolved). What a real
cluster provides by other means is emulated by rewriting the process's env, command and args:

- DNS: `<hostname>.<subdomain>.<namespace>.svc[.cluster.local]` becomes that pod's IP;
- mounts: a volume's mountPath (and the container's terminationMessagePath) becomes its temp dir or file, in the
  env, the command and args, and the files of ConfigMap volumes (the job's spec names /checkpoints/...);
- ports: torch's TCPStore binds MASTER_PORT on all interfaces, so two gangs on one machine would collide on
  the same port although their pod IPs differ; each (namespace, master address, port) gets a free host port.

It adds OMP_NUM_THREADS=1 and PARATRAIN_DEVICE=cpu, and reports Running, then Succeeded or Failed with the
container's exit code (128+N for signal N) and termination message. As with a container, all processes the
program starts belong to it (found by an env marker: torchrun puts its workers in sessions of their own) and
end with its main process. A deleted pod's main process gets SIGTERM, every process SIGKILL after the grace
period (capped), then the kubelet confirms the deletion, as a real one does.

Its API (`api`: listen, changes, fetch, patch_object, delete_object) is `real_cluster.NodeApi` on the real control
plane, which shows it only the pods the scheduler bound to its node (the binding patch changes nothing there); it
talks to the API server directly, so faults injected through the fault proxy hit the operator only.

Hooks for tests: `kill` (the container crashes), `kill_rank` (one rank's worker dies), `report_exit_late`, `evict` (the node evicts the pod), `pause`/`unpause`
(SIGSTOP/SIGCONT: a hung pod), `command` (replace every container's command, e.g. with a stand-in trainer).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import re
import signal
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .fault_proxy import ApiError, Resource

PODS, CONFIGMAPS, SECRETS = Resource.of("v1/pods"), Resource.of("v1/configmaps"), Resource.of("v1/secrets")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
_DNS = re.compile(r"\b([a-z0-9]([-a-z0-9]*[a-z0-9])?)\.([a-z0-9]([-a-z0-9]*[a-z0-9])?)\.([a-z0-9]([-a-z0-9]*"
                  r"[a-z0-9])?)\.svc(\.cluster\.local)?\b")
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
MASTER_PORT_VARS = ("PET_MASTER_PORT", "MASTER_PORT")
MASTER_ADDR_VARS = ("PET_MASTER_ADDR", "MASTER_ADDR")
MAX_TERMINATION_MESSAGE = 4096
# Every process of a container inherits this (torchrun starts its workers in sessions of their own, so a
# process group is not a container; the marker finds them all, even once reparented).
CONTAINER_MARKER = "TEST_KUBELET_CONTAINER"
# Pod IPs 127.P.0.2, 127.P.0.3, ... with P from the process id: test runs of other engineers (or pytest
# processes) on the same machine get other IPs, so their pods' fixed ports (progress) never collide.
_LOOPBACK = itertools.count((os.getpid() % 254 + 1) << 16 | 2)


@dataclass
class PodNetwork:
    """Pod IPs (by DNS name) and master ports: one cluster's, shared by the kubelets of all its nodes, so a pod on
    one node reaches its gang's master on another at the same address."""

    ips: dict[tuple[str, ...], str] = field(default_factory=dict)
    ports: dict[tuple[str, str, str], tuple[str, int]] = field(default_factory=dict)  # key → (port, users)


@dataclass
class _Container:
    namespace: str
    pod: str
    name: str
    process: asyncio.subprocess.Process
    started_at: str
    dir: Path
    log: Path
    termination_log: Path
    port_keys: list[tuple[str, str, str]] = field(default_factory=list)
    evicted: tuple[str, str] | None = None  # (reason, message) when the node evicted the pod
    disrupted: bool = False  # its eviction set the DisruptionTarget condition
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


class Kubelet:
    def __init__(self, api: Any, workdir: Path, *, node_name: str = "test-node",
                 command: Callable[[Mapping[str, Any]], list[str] | None] | None = None, max_grace: float = 5.0,
                 extra_env: Mapping[str, str] | None = None, default_cwd: Path | None = None,
                 network: PodNetwork | None = None):
        self.api, self.workdir, self.node_name = api, workdir, node_name
        self.default_cwd = default_cwd  # the image's working directory, for containers that name none
        self.command, self.max_grace = command, max_grace
        self.extra_env = {"OMP_NUM_THREADS": "1", "PARATRAIN_DEVICE": "cpu", **(extra_env or {})}
        self.containers: dict[tuple[str, str], _Container] = {}
        network = network or PodNetwork()
        self._ips, self._ports = network.ips, network.ports
        self._seen: set[str] = set()  # pod uids already started (a pod never runs twice)
        self._terminating: set[str] = set()  # pod uids being stopped
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._late_exits: dict[tuple[str, str], float] = {}  # (ns, pod) → seconds its exit is reported late

    # ---- the loop ----------------------------------------------------------------------------------------

    async def run(self) -> None:
        wake = self.api.listen()
        position = 0
        try:
            while not self._stopping:
                events, position = self.api.changes(position, PODS)
                for event in events:
                    await self._on_event(event["type"], event["object"])
                wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), 1.0)
        finally:
            await self.stop()

    async def stop(self) -> None:
        self._stopping = True
        for c in list(self.containers.values()):
            self._signal(c, signal.SIGKILL)
        for c in list(self.containers.values()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c.process.wait(), 5)

    async def _on_event(self, type_: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        if type_ == "DELETED":
            if key in self.containers:
                self._signal(self.containers[key], signal.SIGKILL)  # forced deletion: no grace
            return
        if meta.get("deletionTimestamp"):
            if meta["uid"] not in self._terminating:
                self._terminating.add(meta["uid"])
                self._spawn(self._terminate(pod))
            return
        if meta["uid"] not in self._seen and (pod.get("spec") or {}).get("nodeName") in (None, self.node_name):
            self._seen.add(meta["uid"])
            self._spawn(self._start(pod))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- pod lifecycle -----------------------------------------------------------------------------------

    def _status(self, namespace: str, name: str, status: dict[str, Any]) -> bool:
        try:
            self.api.patch_object(PODS, namespace, name, {"status": status}, subresource="status")
            return True
        except ApiError:  # the pod is gone already
            return False

    async def _start(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        ns, name = meta["namespace"], meta["name"]
        try:
            self.api.patch_object(PODS, ns, name, {"spec": {"nodeName": self.node_name}})
        except ApiError:
            return
        ip = self._ip(ns, spec.get("subdomain"), spec.get("hostname"), name)
        conditions = [_cond("PodScheduled")]
        base = {"podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1", "startTime": now_iso()}
        if not self._status(ns, name, {**base, "phase": "Pending", "conditions": conditions}):
            return
        container = (spec.get("containers") or [{}])[0]
        try:
            launched = await self._launch(pod, container, ip)
        except (OSError, ValueError) as exc:  # e.g. a command that does not exist: the container cannot start
            self._status(ns, name, {**base, "phase": "Failed", "conditions": conditions, "containerStatuses": [
                _container_status(container, {"terminated": {"exitCode": 128, "reason": "StartError",
                                                             "message": str(exc), "finishedAt": now_iso()}})]})
            return
        self.containers[(ns, name)] = launched
        current = self.api.fetch(PODS, ns, name)
        if current is None:  # deleted while starting (the stop found nothing to stop and confirmed it)
            self._signal(launched, signal.SIGKILL)
        running = {"running": {"startedAt": launched.started_at}}
        ready = [_cond("PodScheduled"), _cond("Initialized"), _cond("ContainersReady"), _cond("Ready")]
        self._status(ns, name, {**base, "phase": "Running", "conditions": ready,
                                "containerStatuses": [_container_status(container, running, ready=True)]})
        code = await launched.process.wait()
        await self._reap(launched)  # a container ends with its main process
        self.containers.pop((ns, name), None)
        self._release_ports(launched)
        await self._report_exit(pod, container, launched, code, base)

    async def _report_exit(self, pod: dict[str, Any], container: Mapping[str, Any], c: _Container, code: int,
                           base: dict[str, Any]) -> None:
        exit_code = code if code >= 0 else 128 - code
        terminated: dict[str, Any] = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                      "startedAt": c.started_at, "finishedAt": now_iso()}
        if code < 0:
            terminated["signal"] = -code
        message = c.termination_log.read_bytes()[-MAX_TERMINATION_MESSAGE:].decode(errors="replace") \
            if c.termination_log.exists() else ""
        if not message and exit_code and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = c.log.read_bytes()[-2048:].decode(errors="replace") if c.log.exists() else ""
        if message:
            terminated["message"] = message
        status: dict[str, Any] = {**base, "phase": "Succeeded" if exit_code == 0 else "Failed",
                                  "conditions": [_cond("PodScheduled"), _cond("Initialized"),
                                                 _cond("ContainersReady", False), _cond("Ready", False)],
                                  "containerStatuses": [_container_status(container, {"terminated": terminated})]}
        if c.evicted:
            status.update(phase="Failed", reason=c.evicted[0], message=c.evicted[1])
        if c.disrupted:
            status["conditions"].append({**_cond("DisruptionTarget"), "reason": "TerminationByKubelet",
                                         "message": c.evicted[1] if c.evicted else ""})
        if late := self._late_exits.pop((c.namespace, c.pod), 0.0):
            await asyncio.sleep(late)
        self._status(c.namespace, c.pod, status)
        current = self.api.fetch(PODS, c.namespace, c.pod)
        if current and current["metadata"].get("deletionTimestamp"):
            self._confirm_deletion(c.namespace, c.pod)

    async def _terminate(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        c = self.containers.get(key)
        if c is None:  # nothing runs (finished, or never started): confirm at once
            if meta["uid"] in self._seen or not (pod.get("spec") or {}).get("nodeName"):
                self._confirm_deletion(*key)
            return
        self._signal_main(c, signal.SIGTERM)
        grace = min(float(meta.get("deletionGracePeriodSeconds") or 0), self.max_grace)
        try:
            await asyncio.wait_for(asyncio.shield(c.process.wait()), grace)
        except asyncio.TimeoutError:
            self._signal(c, signal.SIGKILL)
        # _start() reports the exit and then confirms the deletion.

    def _confirm_deletion(self, namespace: str, name: str) -> None:
        with contextlib.suppress(ApiError):
            self.api.delete_object(PODS, namespace, name, {"gracePeriodSeconds": 0})

    # ---- hooks for tests ---------------------------------------------------------------------------------

    @staticmethod
    def _pids(c: _Container) -> list[int]:
        """Every live process of the container (what its cgroup would hold)."""
        marker = f"{CONTAINER_MARKER}={c.id}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
        return pids

    def _signal(self, c: _Container, sig: int) -> None:
        """Signal every process of the container (a crash, an OOM kill, a freeze)."""
        for pid in self._pids(c):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    async def _reap(self, c: _Container, timeout: float = 10.0) -> None:
        """Kill what is left of the container and wait until it is gone (its ports and files are free)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._pids(c) and asyncio.get_running_loop().time() < deadline:
            self._signal(c, signal.SIGKILL)
            await asyncio.sleep(0.05)

    @staticmethod
    def _signal_main(c: _Container, sig: int) -> None:
        """Signal the container's main process only: a stop starts with SIGTERM to PID 1."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(c.process.pid, sig)

    def kill(self, namespace: str, pod: str, sig: int = signal.SIGKILL) -> None:
        """The container dies (every process in it), as in a crash or an OOM kill."""
        self._signal(self.containers[(namespace, pod)], sig)

    def report_exit_late(self, namespace: str, pod: str, seconds: float) -> None:
        """A slow kubelet: the pod's exit reaches the API `seconds` after it happened (finishedAt stays true)."""
        self._late_exits[(namespace, pod)] = seconds

    def kill_rank(self, namespace: str, pod: str, rank: int, sig: int = signal.SIGKILL) -> int:
        """One rank's worker process dies (the trainer names it `paratrain-rN`), its agent left to notice; the
        number of processes signalled."""
        named = [pid for pid in self._pids(self.containers[(namespace, pod)])
                 if _comm(pid) == f"paratrain-r{rank}"]
        for pid in named:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        return len(named)

    def evict(self, namespace: str, pod: str, reason: str = "Evicted",
              message: str = "The node was low on resource: memory.", disruption: bool = True) -> None:
        """The node evicts the pod: its processes are killed and the pod fails with the eviction reason, and, as
        kubelets do since Kubernetes 1.26 (`disruption`), a DisruptionTarget condition (TerminationByKubelet)."""
        c = self.containers[(namespace, pod)]
        c.evicted = (reason, message)
        c.disrupted = disruption
        self._signal(c, signal.SIGKILL)

    def pause(self, namespace: str, pod: str) -> None:
        self._signal(self.containers[(namespace, pod)], signal.SIGSTOP)

    def unpause(self, namespace: str, pod: str) -> None:
        self._signal(self.containers[(namespace, pod)], signal.SIGCONT)

    def running(self) -> list[str]:
        return sorted(f"{ns}/{name}" for ns, name in self.containers)

    # ---- what a node provides ----------------------------------------------------------------------------

    def _ip(self, namespace: str, subdomain: str | None, hostname: str | None, pod: str) -> str:
        key = (namespace, subdomain or "", hostname) if hostname and subdomain else (namespace, "pod", pod)
        if key not in self._ips:
            n = next(_LOOPBACK)  # unique in this process: kubelets of different test clusters never share an IP
            self._ips[key] = f"127.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
        return self._ips[key]

    def _resolve(self, match: re.Match[str]) -> str:
        hostname, subdomain, namespace = match[1], match[3], match[5]
        return self._ip(namespace, subdomain, hostname, "")

    def _volumes(self, pod: Mapping[str, Any], pod_dir: Path) -> dict[str, Path]:
        ns = pod["metadata"]["namespace"]
        out: dict[str, Path] = {}
        for volume in (pod.get("spec") or {}).get("volumes") or []:
            path = pod_dir / "volumes" / volume["name"]
            if volume.get("persistentVolumeClaim"):
                path = self.workdir / "pvc" / ns / volume["persistentVolumeClaim"]["claimName"]
            elif volume.get("hostPath"):
                path = Path(volume["hostPath"]["path"])
            path.mkdir(parents=True, exist_ok=True)
            for kind, res, key in (("configMap", CONFIGMAPS, "name"), ("secret", SECRETS, "secretName")):
                if volume.get(kind):
                    source = self.api.fetch(res, ns, volume[kind][key])
                    if source is None:
                        raise ValueError(f"{kind} {volume[kind][key]} not found")
                    data = dict(source.get("data") or {})
                    if kind == "secret":
                        data = {k: base64.b64decode(v).decode() for k, v in data.items()}
                    items = volume[kind].get("items") or [{"key": k, "path": k} for k in data]
                    for item in items:
                        (path / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                        (path / item["path"]).write_text(data.get(item["key"], ""))
            out[volume["name"]] = path
        return out

    def _env_value(self, pod: Mapping[str, Any], item: Mapping[str, Any], ip: str) -> str | None:
        if "value" in item:
            return str(item["value"])
        source = item.get("valueFrom") or {}
        meta = pod["metadata"]
        if ref := source.get("fieldRef"):
            path = ref["fieldPath"]
            if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
                return (meta.get(m[1]) or {}).get(m[2], "")
            return {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                    "metadata.uid": meta["uid"], "status.podIP": ip, "status.hostIP": "127.0.0.1",
                    "spec.nodeName": self.node_name,
                    "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", "default"),
                    }.get(path, "")
        for kind, res in (("configMapKeyRef", CONFIGMAPS), ("secretKeyRef", SECRETS)):
            if ref := source.get(kind):
                obj = self.api.fetch(res, meta["namespace"], ref["name"]) or {}
                value = (obj.get("data") or {}).get(ref["key"])
                if value is None:
                    return None if ref.get("optional") else ""
                return base64.b64decode(value).decode() if res == SECRETS else value
        if source.get("resourceFieldRef"):
            return "1"
        return None

    async def _launch(self, pod: dict[str, Any], container: Mapping[str, Any], ip: str) -> _Container:
        meta = pod["metadata"]
        ns, name = meta["namespace"], meta["name"]
        pod_dir = self.workdir / "pods" / ns / name
        pod_dir.mkdir(parents=True, exist_ok=True)
        volumes = self._volumes(pod, pod_dir)
        termination_log = pod_dir / "termination-log"
        rewrites = {m["mountPath"]: str(volumes[m["name"]] / m.get("subPath", "")).rstrip("/")
                    for m in container.get("volumeMounts") or [] if m["name"] in volumes}
        rewrites[container.get("terminationMessagePath") or "/dev/termination-log"] = str(termination_log)

        # One pass, longest mount first, so a rewritten path is never rewritten again (/dev/x → /tmp/.. → ...).
        longest_first = sorted(rewrites, key=len, reverse=True)
        mounts = re.compile("|".join(re.escape(m) + r"(?=/|$|[^\w.-])" for m in longest_first))

        def localise(text: str) -> str:
            return mounts.sub(lambda m: rewrites[m[0]], _DNS.sub(self._resolve, text))

        # A ConfigMap's files (the job's spec) name paths as the pod sees them, /checkpoints/...: what the user's
        # volume would show there is in its local directory. (Not paratrain's own /tmp: tests name host paths there.)
        users = {m["mountPath"]: rewrites[m["mountPath"]] for m in container.get("volumeMounts") or []
                 if m["name"] in volumes and not m["name"].startswith("paratrain-")}
        if users:
            user_mounts = re.compile("|".join(re.escape(m) + r"(?=/|$|[^\w.-])" for m in sorted(users, key=len,
                                                                                                reverse=True)))
            for volume in (pod.get("spec") or {}).get("volumes") or []:
                if volume.get("configMap"):
                    for file in (f for f in volumes[volume["name"]].rglob("*") if f.is_file()):
                        file.write_text(user_mounts.sub(lambda m: users[m[0]], file.read_text()))

        env: dict[str, str] = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}  # pods get no API access
        env["HOSTNAME"] = (pod.get("spec") or {}).get("hostname") or name
        for item in container.get("env") or []:
            value = self._env_value(pod, item, ip)
            if value is not None:
                env[item["name"]] = localise(_VAR_REF.sub(lambda m: env.get(m[1], m[0]), value))
        c = _Container(ns, name, container.get("name", "main"), None, now_iso(), pod_dir,  # type: ignore[arg-type]
                       self.workdir / "logs" / f"{ns}_{name}.log", termination_log)
        for port_var, addr_var in zip(MASTER_PORT_VARS, MASTER_ADDR_VARS):
            if port_var in env:
                key = (ns, env.get(addr_var, ""), env[port_var])
                env[port_var] = self._host_port(key)
                c.port_keys.append(key)
        env.update(self.extra_env)
        env[CONTAINER_MARKER] = c.id
        argv = [*(container.get("command") or []), *(container.get("args") or [])]
        argv = [localise(_VAR_REF.sub(lambda m: env.get(m[1], m[0]), a)) for a in argv]
        if self.command is not None:
            argv = self.command(pod) or argv
        if not argv:
            raise ValueError("the container has no command (images' entrypoints are not emulated)")
        c.log.parent.mkdir(parents=True, exist_ok=True)
        self.api.pod_logs[(ns, name)] = c.log
        cwd = localise(container["workingDir"]) if container.get("workingDir") else str(self.default_cwd or pod_dir)
        with open(c.log, "ab") as log:
            c.process = await asyncio.create_subprocess_exec(*argv, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
                                                             stdout=log, stderr=log, start_new_session=True)
        return c

    def _host_port(self, key: tuple[str, str, str]) -> str:
        if key not in self._ports:
            with socket.socket() as s:
                s.bind(("", 0))
                self._ports[key] = (str(s.getsockname()[1]), 0)
        port, users = self._ports[key]
        self._ports[key] = (port, users + 1)
        return port

    def _release_ports(self, c: _Container) -> None:
        for key in c.port_keys:
            port, users = self._ports[key]
            if users <= 1:
                del self._ports[key]  # the next gang attempt gets a fresh port
            else:
                self._ports[key] = (port, users - 1)


def _cond(type_: str, status: bool = True) -> dict[str, Any]:
    return {"type": type_, "status": "True" if status else "False", "lastTransitionTime": now_iso()}


def _container_status(container: Mapping[str, Any], state: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    return {"name": container.get("name", "main"), "image": container.get("image", ""), "imageID": "",
            "containerID": "", "ready": ready, "started": "running" in state, "restartCount": 0, "state": state}
