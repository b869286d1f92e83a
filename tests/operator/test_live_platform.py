"""The operator started with a platform file (`--platform`, what the Helm chart writes from its `platform` values),
on the real control plane, as its own ServiceAccount: jobDefaults merged into every gang (and listed in the job's
status), host access the platform does not allow refused naming the field before any pod exists, and each gang's
NetworkPolicy created beside its Service (so the operator's RBAC covers it)."""

from __future__ import annotations

import pytest
import yaml

from .support.cluster import ClusterBase as Cluster
from .support.cluster import fake_job, fake_trainer_command
from .support.real_cluster import RealCluster

pytestmark = pytest.mark.timeout(180)
PLATFORM = {
    "networkPolicy": {"operatorNamespace": "paratrain-system", "operatorLabels": {"app.kubernetes.io/name": "ops"}},
    "jobDefaults": {"image": "registry.example.com/ml/trainer:1.2", "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
                    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                                     "effect": "NoSchedule"}]},
}


@pytest.fixture(scope="module")
def cluster(control_plane, tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("platform")
    platform = workdir / "platform.yaml"
    platform.write_text(yaml.safe_dump(PLATFORM))
    c = RealCluster(control_plane, workdir, command=fake_trainer_command, node="platform-node",
                    operator_args=("--platform", str(platform)))
    yield c
    c.close()


def test_job_defaults_reach_the_pods_and_the_status(cluster: Cluster, ns: str):
    spec = fake_job(steps=3)
    spec["pod"]["env"].append({"name": "HF_HUB_OFFLINE", "value": "0"})  # the job's own value wins
    cluster.submit(ns, "defaults", spec)
    status = cluster.wait_phase(ns, "defaults", "Succeeded", 60)
    assert status["platformDefaults"] == ["spec.image", "spec.scheduling.tolerations"]
    for pod in cluster.pods(ns, "defaults"):
        container = pod["spec"]["containers"][0]
        assert container["image"] == "registry.example.com/ml/trainer:1.2"
        assert {e["name"]: e.get("value") for e in container["env"]}["HF_HUB_OFFLINE"] == "0"
        assert {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"} in \
            pod["spec"]["tolerations"]
    policy = cluster.api.object("networking.k8s.io/v1/networkpolicies", ns, "defaults")
    assert policy is not None, "created by the operator, under its own RBAC"
    [_, operator_peer] = policy["spec"]["ingress"]
    assert operator_peer["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "ops"}


def test_host_access_the_platform_does_not_allow_is_refused_before_any_pod(cluster: Cluster, ns: str):
    spec = fake_job(steps=3)
    spec["pod"]["hostNetwork"] = True
    cluster.submit(ns, "host", spec)
    status = cluster.wait_phase(ns, "host", "Failed", 30)
    assert status["failure"]["reason"] == "InvalidSpec"
    assert "spec.pod.hostNetwork: the platform does not allow host networking" in status["failure"]["message"]
    assert cluster.pods(ns, "host") == []
