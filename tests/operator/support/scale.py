"""The operator at scale on the real control plane, measured by what it asks of the API server: the operator (as
its ServiceAccount) talks through the fault proxy, which here only counts (every request: verb, path, bytes
answered, start and end), and its pods land on hollow nodes (hollow.py). Shared by bench/operator_scale.py (the
figures in docs/benchmarks.md) and tests/operator/test_scale.py (the counts CI holds the operator to).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paratrain.api import API_GROUP, API_VERSION, PLURAL

from ...support.control_plane import ControlPlane, wait_for
from .cluster import OperatorProcess, fake_job
from .fault_proxy import FaultProxy
from .hollow import HollowNodes
from .real_cluster import install_crd, operator_kubeconfig, resource_path

JOBS = f"{API_GROUP}/{API_VERSION}/{PLURAL}"


@dataclass
class Start:
    """One gang's start, from the job's creation until the operator goes quiet."""

    pods: int
    seconds_to_all_created: float
    requests_per_pod: float
    max_pod_posts_in_flight: int
    aftermath_passes: int  # passes after the last pod was created
    aftermath_pod_bytes_read: int  # pod GETs and LISTs (the watch's bytes are counted apart)
    aftermath_job_gets: int
    aftermath_status_patches: int
    watch_bytes: int  # every watch stream's bytes over the whole start (pods and jobs, all namespaces)
    gang_bytes: int  # the gang's own pods, as JSON
    seconds_to_running: float
    pod_post_seconds: float  # a pod POST's mean time from request to answer (through the proxy)
    cores_while_creating: dict[str, float]  # CPU each process used from the CR to the last create, in cores

    def row(self) -> dict[str, Any]:
        return asdict(self)


class ScaleRig:
    def __init__(self, plane: ControlPlane, workdir: Path, nodes: int, *, resync_seconds: float = 10,
                 operator_args: tuple[str, ...] = (), node_capacity: dict[str, str] | None = None,
                 operator_env: dict[str, str] | None = None, progress: bool = False):
        self.plane, self.api, self.workdir = plane, plane.api, workdir
        install_crd(plane)
        self.proxy = FaultProxy(plane.kubeconfig)
        self.hollow = HollowNodes(plane.api, nodes, capacity=node_capacity, progress=progress,
                                  prefix="hollow-" + re.sub(r"[^a-z0-9]+", "-", workdir.name.lower()).strip("-"))
        self.log = workdir / "operator.log"
        self.resync_seconds, self.operator_env = resync_seconds, operator_env or {}
        self.operator: OperatorProcess | None = None
        self.start_operator(operator_args)

    def start_operator(self, args: tuple[str, ...] = ()) -> None:
        if self.operator:
            self.operator.kill()
        kubeconfig = operator_kubeconfig(self.plane, self.workdir / "operator.kubeconfig", server=self.proxy.url)
        # The default pods watch (5 min) and progress writes (30 s) as in a cluster, not the live tests' 5 s and 1 s.
        self.operator = OperatorProcess(kubeconfig, self.log, self.resync_seconds, args,
                                        env={"PARATRAIN_WATCH_SECONDS": "300", "PARATRAIN_PROGRESS_SECONDS": "30",
                                             **self.operator_env})
        self.operator.start()

    def close(self) -> None:
        if self.operator:
            self.operator.kill()
        self.hollow.close()
        self.proxy.close()

    # ---- jobs --------------------------------------------------------------------------------------------

    def submit(self, namespace: str, name: str, nodes: int, **spec: Any) -> None:
        body = {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "ParallelTrainJob",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {**fake_job(nodes=nodes), "scheduling": {**HollowNodes.scheduling(),
                                                                 **spec.pop("scheduling", {})}, **spec}}
        self.api.must(self.api.request("POST", resource_path(JOBS, namespace), body))

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        response = self.api.get(resource_path(JOBS, namespace, name))
        return (response.body.get("status") or {}) if response.ok else {}

    def pods(self, namespace: str) -> list[dict[str, Any]]:
        return self.api.must(self.api.get(resource_path("v1/pods", namespace)))["items"]

    def passes(self, namespace: str, name: str) -> int:
        return self.log.read_text(errors="replace").count(f" {namespace}/{name}: pass (")

    def requests(self, since: int = 0) -> list[list[Any]]:
        return list(self.proxy.log[since:])

    def wait_created(self, namespace: str, count: int, since: int) -> list[list[Any]]:
        """The operator's successful pod POSTs in `namespace` after log entry `since`, once there are `count`."""
        pods_path = resource_path("v1/pods", namespace)

        def created() -> list[list[Any]]:
            posts = [r for r in self.proxy.log[since:] if r[0] == "POST" and r[1].split("?")[0] == pods_path
                     and r[2] == 201 and r[5] is not None]
            return posts if len(posts) >= count else []
        return wait_for(created, 300, f"{count} pods created in {namespace}", interval=0.05)

    def quiet(self, namespace: str, name: str, seconds: float = 2.0, timeout: float = 120) -> None:
        """Until neither a pass of the job nor a request about its namespace happened for `seconds`."""
        def settled() -> bool:
            passes, count = self.passes(namespace, name), len(self.proxy.log)
            time.sleep(seconds)
            fresh = [r for r in self.proxy.log[count:] if f"/namespaces/{namespace}/" in r[1]]
            return self.passes(namespace, name) == passes and not fresh
        wait_for(settled, timeout, f"{namespace}/{name} to settle", interval=0)

    # ---- scenarios ---------------------------------------------------------------------------------------

    def start(self, namespace: str, size: int, name: str = "gang", **spec: Any) -> Start:
        """Create a `size`-pod job; measure until its pods run and the operator is quiet."""
        self.plane.create_namespace(namespace)
        mark, began = len(self.proxy.log), time.monotonic()
        watch_before = self._watch_bytes()
        assert self.operator and self.operator.process
        cpu = CpuUse(self.operator.process.pid)
        self.submit(namespace, name, size, **spec)
        posts = self.wait_created(namespace, size, since=mark)
        cores = cpu.cores()
        last_created = max(r[5] for r in posts)
        passes_at_created = self.passes(namespace, name)
        wait_for(lambda: self.status(namespace, name).get("phase") == "Running", 300, f"{namespace} Running",
                 interval=0.1)
        running = time.monotonic()
        self.quiet(namespace, name)
        mine = [r for r in self.proxy.log[mark:] if f"/namespaces/{namespace}/" in r[1]]
        after = [r for r in mine if r[4] > last_created]
        job_path = resource_path(JOBS, namespace, name)
        return Start(
            pods=size,
            seconds_to_all_created=round(last_created - began, 3),
            requests_per_pod=round(len(mine) / size, 2),
            max_pod_posts_in_flight=max_overlap([(r[4], r[5]) for r in posts]),
            aftermath_passes=self.passes(namespace, name) - passes_at_created,
            aftermath_pod_bytes_read=sum(r[3] for r in after if r[0] == "GET" and "/pods" in r[1]
                                         and "watch=true" not in r[1]),
            aftermath_job_gets=sum(r[0] == "GET" and r[1].split("?")[0] == job_path for r in after),
            aftermath_status_patches=sum(r[0] == "PATCH" and r[1].split("?")[0] == f"{job_path}/status"
                                         for r in after),
            watch_bytes=self._watch_bytes() - watch_before,
            gang_bytes=sum(len(json.dumps(p, separators=(",", ":"))) for p in self.pods(namespace)),
            seconds_to_running=round(running - began, 3),
            pod_post_seconds=round(sum(r[5] - r[4] for r in posts) / len(posts), 4),
            cores_while_creating=cores,
        )

    def _watch_bytes(self) -> int:
        return sum(r[3] for r in self.proxy.log if "watch=true" in r[1])


class CpuUse:
    """The cores each process of the rig used since this was made: the control plane's (by name), the operator's
    and this process's (the counting proxy and the hollow kubelets run here)."""

    CONTROL_PLANE = ("kube-apiserver", "etcd", "kube-scheduler", "kube-controller")

    def __init__(self, operator_pid: int):
        pids: dict[str, list[int]] = {"operator": [operator_pid], "proxy and hollow kubelets": [os.getpid()]}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    name = (entry / "comm").read_text().strip()
                except OSError:
                    continue
                if name in self.CONTROL_PLANE:
                    pids.setdefault(name, []).append(int(entry.name))
        self.pids, self.began = pids, time.monotonic()
        self.start = self._seconds()

    def _seconds(self) -> dict[str, float]:
        out = {}
        for name, pids in self.pids.items():
            total = 0.0
            for pid in pids:
                try:
                    total += cpu_seconds(pid)
                except OSError:  # gone meanwhile
                    pass
            out[name] = total
        return out

    def cores(self) -> dict[str, float]:
        elapsed, now = max(time.monotonic() - self.began, 1e-6), self._seconds()
        return {name: round((now[name] - self.start[name]) / elapsed, 2) for name in self.pids}


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_kib(pid: int, field: str) -> int:
    """A /proc/PID/status field in KiB (VmRSS, VmHWM)."""
    return next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith(f"{field}:"))


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one moment."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = current = 0
    for _, step in edges:
        current += step
        most = max(most, current)
    return most

