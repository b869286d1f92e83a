"""Fixtures for the delivery tests: the chart rendered by Helm's own engine (helm-python-sdk), offline."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "paratrain"
RELEASE_NS = "paratrain-system"

# Value sets every render test covers: the defaults, a namespaced install, and every other option changed.
NAMESPACED = {"rbac": {"namespaced": True}, "watchNamespace": "team-a"}
CUSTOMIZED = {
    "fullnameOverride": "ptj-operator",
    "image": {"repository": "registry.example.com/ml/paratrain-operator", "digest": "sha256:" + "ab" * 32,
              "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "resources": {"requests": {"cpu": "250m", "memory": "300Mi"}, "limits": {"memory": "1Gi"}},
    "serviceAccount": {"name": "trainer-operator", "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:r"}},
    "operator": {"qps": 20, "burst": 40, "writeConcurrency": 8, "extraArgs": ["--verbose"],
                 "env": [{"name": "TZ", "value": "UTC"}]},
    "metrics": {"service": {"port": 9191}, "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}},
    "crds": {"keep": False},
    "priorityClassName": "system-cluster-critical",
    "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
    "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]}]}]}}},
    "podLabels": {"team": "ml-platform"},
    "podAnnotations": {"example.com/owner": "ml-platform"},
}
VALUE_SETS = {"default": None, "namespaced": NAMESPACED, "customized": CUSTOMIZED}


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_manifests", ROOT / "scripts" / "gen_manifests.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def gen() -> ModuleType:
    """scripts/gen_manifests.py, the one place that renders the chart (tests use exactly what it writes)."""
    return _load_generator()


@pytest.fixture(scope="session")
def render(gen: ModuleType) -> Callable[..., list[dict[str, Any]]]:
    """render(values=None, namespace=RELEASE_NS) -> the chart's objects, as `helm template` gives them."""

    def _render(values: dict[str, Any] | None = None, namespace: str = RELEASE_NS) -> list[dict[str, Any]]:
        return gen.render_chart(CHART_DIR, values, namespace=namespace)

    return _render



@pytest.fixture(scope="session")
def rendered(render) -> dict[str, list[dict[str, Any]]]:
    """VALUE_SETS' names -> the chart's objects rendered with them."""
    return {name: render(values) for name, values in VALUE_SETS.items()}
