"""The real Kueue controller manager on a test control plane, installed from its Go module's own release files.

`scripts/kueuebin.sh` builds the manager from `sigs.k8s.io/kueue` and keeps the module's config/ folder. Its
release manifests are `kubectl kustomize config/default`: namespace kueue-system, CRDs (with their conversion
webhooks), RBAC, the webhook Service and configurations, the manager's Configuration and its Deployment. All of it
is applied as built, except:

- the Deployment: the manager runs here as a process, with the release's Configuration and as the release's
  ServiceAccount (its RBAC is what Kueue asks for), so nothing it does needs more rights than in a real cluster;
- the visibility APIService (an optional on-demand API; its server is off, VisibilityOnDemand=false);
- the Configuration's listeners: webhook on this machine's address and a free port, health probe on a free port,
  no metrics listener.

The webhook Service reaches the process through an EndpointSlice naming this machine's address, which the API
server follows (test-cluster.sh runs it with --enable-aggregator-routing). Kueue's own certificate management
signs the webhook certificate for the Service's name, keeps it in its Secret and injects the CA into the webhook
configurations and CRDs, as in a cluster; the test copies the Secret into the manager's certDir, as a kubelet
mounts it into the manager's pod.
"""

from __future__ import annotations

import base64
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from ...support.control_plane import REPO, ControlPlane, ControlPlaneUnavailable, wait_for

KUEUEBIN = REPO / "scripts" / "kueuebin.sh"
NAMESPACE = "kueue-system"
MANAGER_ACCOUNT = "kueue-controller-manager"
WEBHOOK_SERVICE, WEBHOOK_SECRET = "kueue-webhook-service", "kueue-webhook-server-cert"
CONFIG_MAP, CONFIG_KEY = "kueue-manager-config", "controller_manager_config.yaml"
LEFT_OUT = {"Deployment", "APIService"}


def kueuebin() -> Path:
    """The folder holding bin/kueue and config/, building them on first use."""
    proc = subprocess.run(["bash", str(KUEUEBIN)], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise ControlPlaneUnavailable(f"scripts/kueuebin.sh failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_address() -> str:
    """An address of this machine other than loopback: an EndpointSlice may not name 127.0.0.0/8."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.255", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            address = ""
    if not address or address.startswith("127."):
        names = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
        address = next((a for a in names if "." in a and not a.startswith("127.")), "")
    if not address:
        raise ControlPlaneUnavailable("the Kueue test needs a non-loopback IPv4 address on this machine for the "
                                      "webhook's EndpointSlice, and found none")
    return address


def release_manifests(plane: ControlPlane, config_dir: Path) -> list[dict[str, Any]]:
    built = plane.kubectl("kustomize", str(config_dir / "default"), timeout=120)
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


def manager_configuration(release: list[dict[str, Any]], host: str, webhook_port: int, probe_port: int,
                          cert_dir: Path) -> dict[str, Any]:
    config_map = next(d for d in release if d["kind"] == "ConfigMap" and d["metadata"]["name"] == CONFIG_MAP)
    config = yaml.safe_load(config_map["data"][CONFIG_KEY])
    config["webhook"] = {**config.get("webhook", {}), "host": host, "port": webhook_port, "certDir": str(cert_dir)}
    config["health"] = {**config.get("health", {}), "healthProbeBindAddress": f"127.0.0.1:{probe_port}"}
    config["metrics"] = {**config.get("metrics", {}), "bindAddress": "0"}
    config["leaderElection"] = {**config.get("leaderElection", {}), "leaderElect": False}
    return config


class Kueue:
    """Kueue's release on `plane`, its manager a process, until close()."""

    def __init__(self, plane: ControlPlane, workdir: Path):
        self.plane, self.dir = plane, kueuebin()
        workdir.mkdir(parents=True, exist_ok=True)
        release = release_manifests(plane, self.dir / "config")
        installed = workdir / "release.yaml"
        installed.write_text(yaml.safe_dump_all([d for d in release if d["kind"] not in LEFT_OUT]))
        # Server-side: the CRDs are larger than client-side apply's last-applied annotation may be.
        applied = plane.kubectl("apply", "--server-side", "-f", str(installed), timeout=120)
        assert applied.returncode == 0, applied.stderr
        for _ in range(5):  # kubectl errors, rather than waits, on a CRD that has no status yet (kubernetes#66439)
            waited = plane.kubectl("wait", "--for", "condition=established", "--timeout=60s", "crd", "--all",
                                   timeout=90)
            if waited.returncode == 0 or "accessor error" not in waited.stderr:
                break
            time.sleep(1)
        assert waited.returncode == 0, waited.stderr

        host, self.port, probe = host_address(), _free_port(), _free_port()
        slice_ = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                  "metadata": {"name": f"{WEBHOOK_SERVICE}-process", "namespace": NAMESPACE,
                               "labels": {"kubernetes.io/service-name": WEBHOOK_SERVICE,
                                          "endpointslice.kubernetes.io/managed-by": "paratrain-tests"}},
                  "addressType": "IPv4", "endpoints": [{"addresses": [host], "conditions": {"ready": True}}],
                  "ports": [{"name": "", "port": self.port, "protocol": "TCP"}]}
        plane.api.must(plane.api.create(f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices", slice_))

        config, certs = workdir / "config.yaml", workdir / "certs"
        config.write_text(yaml.safe_dump(manager_configuration(release, host, self.port, probe, certs)))
        kubeconfig = self._manager_kubeconfig(workdir / "kubeconfig")
        self.log = workdir / "kueue.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [str(self.dir / "bin" / "kueue"), f"--config={config}", f"--kubeconfig={kubeconfig}",
                 "--feature-gates=VisibilityOnDemand=false", "--zap-log-level=2"],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            # The manager waits for the certificate it wrote to its Secret to appear in its certDir, where a kubelet
            # mounts the Secret in a cluster.
            wait_for(lambda: self._mount_certificate(certs), 120, f"Kueue's webhook certificate (log: {self.log})",
                     interval=0.5)
            wait_for(lambda: self._ready(probe), 120, f"Kueue's /readyz (log: {self.log})", interval=0.5)
        except BaseException:
            self.close()
            raise

    def _manager_kubeconfig(self, path: Path) -> Path:
        api = self.plane.api
        wait_for(lambda: api.get(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{MANAGER_ACCOUNT}").ok, 30,
                 "Kueue's ServiceAccount")
        token = api.must(api.create(
            f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{MANAGER_ACCOUNT}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 7200}},
        ))["status"]["token"]
        config = yaml.safe_load(self.plane.kubeconfig.read_text())
        config["users"] = [{"name": MANAGER_ACCOUNT, "user": {"token": token}}]
        config["contexts"][0]["context"]["user"] = MANAGER_ACCOUNT
        path.write_text(yaml.safe_dump(config))
        return path

    def _mount_certificate(self, certs: Path) -> bool:
        self._check_alive()
        secret = self.plane.api.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/{WEBHOOK_SECRET}")
        data = (secret.body or {}).get("data") or {} if secret.ok else {}
        if not data.get("tls.crt"):
            return False
        certs.mkdir(parents=True, exist_ok=True)
        for key, value in data.items():
            (certs / key).write_bytes(base64.b64decode(value))
        return True

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"kueue exited ({self.process.returncode}); its log ends:\n{self.log_tail()}")

    def _ready(self, probe: int) -> bool:
        self._check_alive()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{probe}/readyz", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
