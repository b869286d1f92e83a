"""The operator's API client sends the identity its credentials name: a kubeconfig's token, or the pod's
ServiceAccount token in a cluster. (Found on the real API server: the `kubernetes` package keeps the token under a
key the client did not read, so every call went out anonymous and was forbidden.)"""

from __future__ import annotations

from pathlib import Path

import kubernetes
import yaml

from paratrain_operator.kube import Kube


def _kube_from_kubeconfig(path: Path) -> Kube:
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(path), client_configuration=configuration)
    return Kube(configuration)


def test_a_kubeconfig_token_is_sent(tmp_path: Path):
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "x",
              "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
              "users": [{"name": "u", "user": {"token": "kubeconfig-token"}}],
              "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}]}
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    headers = _kube_from_kubeconfig(tmp_path / "kubeconfig")._headers(None)
    assert headers["Authorization"] == "Bearer kubeconfig-token"


def test_the_pods_service_account_token_is_sent(tmp_path: Path, monkeypatch):
    (tmp_path / "token").write_text("service-account-token")
    (tmp_path / "ca.crt").write_text("not read here")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    configuration = kubernetes.client.Configuration()
    kubernetes.config.incluster_config.InClusterConfigLoader(
        token_filename=str(tmp_path / "token"), cert_filename=str(tmp_path / "ca.crt")).load_and_set(configuration)
    scheme, token = Kube(configuration)._headers(None)["Authorization"].split()
    assert (scheme.lower(), token) == ("bearer", "service-account-token")  # the scheme is case-insensitive
