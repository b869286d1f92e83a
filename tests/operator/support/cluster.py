"""A whole test cluster: an API server + the test kubelet + the real operator (`python -m paratrain_operator`, a
subprocess, as the Helm chart runs it) + kubectl against it.

`ClusterBase` is what every live test uses; `real_cluster.RealCluster` puts it on the real control plane
(scripts/test-cluster.sh), with the fault proxy in front of the operator where a test injects API faults.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from paratrain.api import API_GROUP, API_VERSION, PLURAL

from ...support.control_plane import testbin
from .fault_proxy import parse_route
from .kubelet import Kubelet
from .server import wait_for

JOBS = f"{API_GROUP}/{API_VERSION}/{PLURAL}"
REPO = Path(__file__).resolve().parents[3]
FAKE_TRAINER = Path(__file__).with_name("fake_trainer.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_trainer_command(pod: Mapping[str, Any]) -> list[str]:
    return [sys.executable, str(FAKE_TRAINER)]


def fake_job(nodes: int = 2, steps: int = 5, step_seconds: float = 0.1, run_policy: dict | None = None,
             failure_rules: list[dict] | None = None, **env: Any) -> dict[str, Any]:
    """A spec whose pods run the stand-in trainer with these FAKE_* settings."""
    settings = {"FAKE_STEPS": steps, "FAKE_STEP_SECONDS": step_seconds,
                **{f"FAKE_{k.upper()}": v for k, v in env.items()}}
    return {"nodes": nodes, "parallelism": {"data": nodes}, "training": {"batchSize": 4 * nodes, "warmupSteps": 0},
            "runPolicy": run_policy or {}, "failurePolicy": {"rules": failure_rules or []},
            "pod": {"env": [{"name": k, "value": str(v)} for k, v in settings.items()]}}


def condition(status: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


class OperatorProcess:
    """The operator as the chart runs it, with its liveness and metrics endpoints on free ports."""

    def __init__(self, kubeconfig: Path, log: Path, resync_seconds: float, args: tuple[str, ...] = (),
                 env: Mapping[str, str] | None = None):
        self.kubeconfig, self.log, self.resync_seconds = kubeconfig, log, resync_seconds
        # Pods watches of 5 s by default: a silent stream (test_live_faults) is cut and resumed within seconds;
        # progress written every second (the default 30 s would make every progress check wait that long).
        self.args, self.env = args, {"PARATRAIN_WATCH_SECONDS": "5", "PARATRAIN_PROGRESS_SECONDS": "1", **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None
        self.health_port = self.metrics_port = 0

    def start(self) -> None:
        self.health_port, self.metrics_port = free_port(), free_port()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1", **self.env}
        cmd = [sys.executable, "-m", "paratrain_operator", "--liveness", f"http://127.0.0.1:{self.health_port}/healthz",
               "--metrics-port", str(self.metrics_port), "--resync-seconds", str(self.resync_seconds), "--verbose",
               *self.args]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            wait_for(self.healthy, 30, "the operator's liveness endpoint")
        except BaseException:
            self.kill()  # one that never came up is not left running after the test
            raise

    def healthy(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"the operator exited with {self.process.returncode}:\n{self.log_tail()}")
        return http(f"http://127.0.0.1:{self.health_port}/healthz") is not None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:  # a graceful stop that hangs is still a stop
                self.process.kill()
                self.process.wait(5)
        self.process = None

    def metrics(self) -> str:
        return http(f"http://127.0.0.1:{self.metrics_port}/metrics") or ""

    def log_tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def http(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


class ClusterBase:
    """Jobs, pods and the operator, over `self.api` (create / object / objects / patch / delete / call) and
    `self.kubelet`; subclasses set both and `self.kubeconfig`, then call `start_operator`."""

    api: Any
    kubelet: Kubelet
    kubeconfig: Path

    def __init__(self, workdir: Path, resync_seconds: float, operator_args: tuple[str, ...] = ()):
        self.workdir = workdir
        self.operator_log = workdir / "operator.log"
        self.resync_seconds, self.operator_args = resync_seconds, operator_args
        self._operator: OperatorProcess | None = None

    # ---- the operator ------------------------------------------------------------------------------------

    def operator_kubeconfig(self) -> Path:
        return self.kubeconfig

    def start_operator(self) -> None:
        self._operator = OperatorProcess(self.operator_kubeconfig(), self.operator_log, self.resync_seconds,
                                         self.operator_args)
        self._operator.start()

    @property
    def operator(self) -> subprocess.Popen[bytes] | None:
        return self._operator.process if self._operator else None

    def kill_operator(self, sig: int = signal.SIGKILL) -> None:
        if self._operator:
            self._operator.kill(sig)

    def metrics(self) -> str:
        return self._operator.metrics() if self._operator else ""

    def health(self) -> dict[str, Any]:
        """The operator's /healthz answer (kopf's probes by id), or {} when it does not answer 200."""
        body = http(f"http://127.0.0.1:{self._operator.health_port}/healthz") if self._operator else None
        return json.loads(body) if body else {}

    def operator_requests(self) -> list[list[Any]]:
        """[method, path?query, status (None while in flight), bytes, start, end] of every API request the operator
        made so far."""
        raise NotImplementedError

    def passes(self, namespace: str, name: str) -> int:
        """The operator's reconcile passes of a job so far, as its log (--verbose) tells them."""
        return self.operator_log.read_text(errors="replace").count(f" {namespace}/{name}: pass (")

    def api_calls(self) -> set[tuple[str, str, str]]:
        """(apiGroup, resource, verb) of every API request the operator made so far, discovery aside."""
        used = set()
        for method, where, *_ in self.operator_requests():
            path, _, query = where.partition("?")
            route = parse_route(path)
            if route is None:
                continue  # discovery: allowed to every authenticated user
            named = route.name is not None
            verb = {"GET": "watch" if "watch=true" in query else "get" if named else "list", "POST": "create",
                    "PATCH": "patch", "PUT": "update", "DELETE": "delete" if named else "deletecollection"}[method]
            resource = route.resource.plural + (f"/{route.subresource}" if route.subresource else "")
            used.add((route.resource.group, resource, verb))
        return used

    # ---- jobs and pods -----------------------------------------------------------------------------------

    def namespace(self, name: str) -> str:
        self.api.create_namespace(name)
        return name

    def submit(self, namespace: str, name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
        doc = {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "ParallelTrainJob",
               "metadata": {"name": name, "namespace": namespace}, "spec": dict(spec)}
        return self.api.create(JOBS, doc, namespace)

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.api.object(JOBS, namespace, name)

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        return (self.job(namespace, name) or {}).get("status") or {}

    def pods(self, namespace: str, job: str | None = None) -> list[dict[str, Any]]:
        return self.api.objects("v1/pods", namespace, f"paratrain.dev/job-name={job}" if job else None)

    def events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        return [e for e in self.api.objects("v1/events", namespace) if e["involvedObject"]["name"] == name]

    def event_reasons(self, namespace: str, name: str, until: str | None = None, timeout: float = 15) -> list[str]:
        """The reasons of the job's Events, oldest first; with `until`, once an Event of that reason is there.

        The operator posts a pass's Events after writing its status, so a test that saw the status must wait for
        the Event reporting it."""
        def reasons() -> list[str]:
            events = sorted(self.events(namespace, name), key=lambda e: int(e["metadata"]["resourceVersion"]))
            return [e["reason"] for e in events]
        if until is None:
            return reasons()
        return wait_for(lambda: until in (seen := reasons()) and seen, timeout,
                        f"a {until} Event on {namespace}/{name}", interval=0.2)

    def wait_phase(self, namespace: str, name: str, phase: str, timeout: float = 60) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            status = self.status(namespace, name)
            return status if status.get("phase") == phase else None
        try:
            return wait_for(reached, timeout, f"{namespace}/{name} to be {phase}", interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnostics(namespace, name)}") from None

    def kubectl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cmd = [self.kubectl_binary(), f"--kubeconfig={self.kubeconfig}", f"--cache-dir={self.workdir / 'kube-cache'}",
               *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

    @staticmethod
    def kubectl_binary() -> str:
        return str(testbin() / "kubectl")  # the pinned kubectl scripts/testbin.sh builds

    # ---- teardown and diagnostics ------------------------------------------------------------------------

    def log_tail(self, lines: int = 60) -> str:
        return self._operator.log_tail(lines) if self._operator else ""

    def diagnostics(self, namespace: str, name: str) -> str:
        pods = {p["metadata"]["name"]: (p.get("status") or {}).get("phase") for p in self.pods(namespace)}
        logs = ""
        for log in sorted((self.workdir / "logs").glob(f"{namespace}_*.log")):
            logs += f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]) + "\n"
        return (f"status: {json.dumps(self.status(namespace, name), indent=1)}\npods: {pods}\n"
                f"--- operator log\n{self.log_tail()}\n{logs}")
