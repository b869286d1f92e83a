"""The chart's `platform` values reach the operator as its --platform file, and the NetworkPolicy each gang gets
admits exactly what must reach it: its own pods (rendezvous, NCCL) and the operator's pods (progress, port 29400).

No CNI enforces NetworkPolicy on the test control plane, so this checks the policy's selectors against the labels
and namespaces of the pods the chart and the renderer create, as an enforcing CNI would match them."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from paratrain import contract
from paratrain.api import parse_job
from paratrain.api.platform import Platform
from paratrain_operator.render import render_job

from .conftest import CHART_DIR, CUSTOMIZED, RELEASE_NS
from .policy import only

JOB = {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "gang"},
       "spec": {"nodes": 2, "parallelism": {"data": 2}}}
OTHER = {**JOB, "metadata": {"name": "gang-b"}}


def platform_of(objects: list[dict[str, Any]]) -> Platform:
    """The platform file as the operator reads it: the chart's ConfigMap, mounted where --platform points."""
    deployment = only(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    path = args[args.index("--platform") + 1]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (config,) = [o for o in objects if o["kind"] == "ConfigMap"
                 and o["metadata"]["name"] == volume["configMap"]["name"]]
    return Platform.model_validate(yaml.safe_load(config["data"][path.rsplit("/", 1)[1]]))


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, "only matchLabels is used"
    return selector["matchLabels"].items() <= labels.items()


def admits(policy: dict[str, Any], pod: dict[str, Any], namespace: str, port: int) -> bool:
    """Whether `policy` lets `pod` (in `namespace`, its namespace labelled as Kubernetes labels every one) reach
    port `port` of the pods it selects."""
    namespace_labels = {"kubernetes.io/metadata.name": namespace}
    for rule in policy["spec"]["ingress"]:
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        for peer in rule["from"]:
            in_namespace = (selects(peer["namespaceSelector"], namespace_labels) if "namespaceSelector" in peer
                            else namespace == policy["metadata"]["namespace"])
            if in_namespace and selects(peer.get("podSelector", {"matchLabels": {}}), pod["metadata"]["labels"]):
                return True
    return False


@pytest.mark.parametrize("values,namespace,release", [(None, RELEASE_NS, "paratrain"),
                                                       (CUSTOMIZED, "ml-platform", "trainers")],
                         ids=["default", "customized"])
def test_a_gangs_policy_admits_its_own_pods_and_the_operator_and_nothing_else(gen, values, namespace,
                                                                              release) -> None:
    chart = gen.render_chart(CHART_DIR, values, namespace=namespace, release=release)
    platform = platform_of(chart)
    assert platform.network_policy.enabled and platform.network_policy.operator_namespace == namespace
    operator_pod = only(chart, "Deployment")["spec"]["template"]
    objects = render_job(parse_job(JOB), "team-a", 0, platform)
    policy = only(objects, "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress"], "egress is left to the namespace's own policies"
    gang = [o for o in objects if o["kind"] == "Pod"]
    other_gang = [o for o in render_job(parse_job(OTHER), "team-a", 0, platform) if o["kind"] == "Pod"]
    assert all(selects(policy["spec"]["podSelector"], p["metadata"]["labels"]) for p in gang)
    assert not any(selects(policy["spec"]["podSelector"], p["metadata"]["labels"]) for p in other_gang)
    for port in (contract.MASTER_PORT, 40000):  # the rendezvous, and a port NCCL picks
        assert all(admits(policy, p, "team-a", port) for p in gang)
        assert not any(admits(policy, p, "team-a", port) for p in other_gang), "another job's pods stay out"
    assert admits(policy, operator_pod, namespace, contract.PROGRESS_PORT), "the progress poll gets through"
    assert not admits(policy, operator_pod, namespace, contract.MASTER_PORT), "the operator reads progress only"
    assert not admits(policy, operator_pod, "team-b", contract.PROGRESS_PORT), "same labels, other namespace"
    assert not admits(policy, {"metadata": {"labels": {}}}, namespace, contract.PROGRESS_PORT)


def test_platform_values_reach_the_operator_and_turn_the_policy_off(render) -> None:
    defaults = {"image": "registry.example.com/ml/trainer:1.2", "nodeSelector": {"pool": "gpu"},
                "scheduling": {"gang": "kubernetes", "priorityClassName": "research"}}
    chart = render({"platform": {"allowIpcLock": True, "allowHostNetwork": True, "networkPolicy": {"enabled": False},
                                 "jobDefaults": defaults}})
    platform = platform_of(chart)
    assert platform.allow_ipc_lock and platform.allow_host_network and not platform.network_policy.enabled
    assert platform.job_defaults.dump() == {**defaults, "env": [], "tolerations": [], "resources": {"extra": {}}}
    assert "NetworkPolicy" not in [o["kind"] for o in render_job(parse_job(JOB), "team-a", 0, platform)]
    listed = platform_of(render({"platform": {"allowHostNetwork": ["team-rdma", "lab-*"], "allowIpcLock": ["lab-*"]}}))
    assert (listed.allow_host_network, listed.allow_ipc_lock) == (["team-rdma", "lab-*"], ["lab-*"])
    placed = platform_of(render({"platform": {"volcanoTiers": {"x.io/rack": 1}, "kaiTopology": "cluster-topology",
                                              "planner": {"gpu": "H100-80GB", "computeEfficiency": 0.5}}}))
    assert (placed.volcano_tiers, placed.kai_topology) == ({"x.io/rack": 1}, "cluster-topology")
    assert (placed.planner.gpu, placed.planner.compute_efficiency) == ("H100-80GB", 0.5)
    default = platform_of(render())
    assert not default.allow_ipc_lock and not default.allow_host_network
    assert default.model_dump() == Platform(network_policy=default.network_policy).model_dump(), \
        "the chart's defaults are the platform model's"
