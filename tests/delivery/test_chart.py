"""The Helm chart, with Helm's own engine (helm-python-sdk): lint, renders, schema, strict Kubernetes validation.

    .venv/bin/python -m pytest tests/delivery -q
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from paratrain import contract
from paratrain.api import API_GROUP, hardware
from paratrain.api.platform import Platform, PlannerProfile
from paratrain_operator import rbac

from .conftest import CHART_DIR, CUSTOMIZED, NAMESPACED, RELEASE_NS, VALUE_SETS
from .policy import only

K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
HELM_WARNING = 2  # helm lint severities: 1 info, 2 warning, 3 error; --strict fails on warnings
APP_VERSION = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]



def job_rbac(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects less the leader election's Role and RoleBinding (a Lease in the release namespace) and the
    ClusterRoles for people (-edit, -view)."""
    return [o for o in objects if not o["metadata"]["name"].endswith(("-leader-election", "-edit", "-view"))]


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    containers = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return containers[0]


# ---- lint -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("values", [None, NAMESPACED, CUSTOMIZED], ids=["default", "namespaced", "customized"])
def test_lint_strict_has_no_warnings(values) -> None:
    for version in K8S_VERSIONS:
        result = helm_python.lint(str(CHART_DIR), values, strict=True, kube_version=f"v{version}")
        problems = [m for m in result["messages"] if m["severity"] >= HELM_WARNING]
        assert not result["errors"] and not problems, (version, result)


def test_lint_reports_a_broken_template(tmp_path: Path) -> None:
    # The lint test above can fail: a template with invalid YAML is an error.
    chart = tmp_path / "paratrain"
    shutil.copytree(CHART_DIR, chart)
    (chart / "templates" / "broken.yaml").write_text("kind: ConfigMap\nmetadata: {name: x\n")
    result = helm_python.lint(str(chart), None, strict=True, kube_version="v1.30.0")
    assert any(m["severity"] > HELM_WARNING for m in result["messages"]) or result["errors"], result


def test_install_dry_run_prints_notes() -> None:
    config = helm_python.Config(namespace=RELEASE_NS, storage_driver="memory")
    release = config.install(str(CHART_DIR), "paratrain", {}, dry_run="client")
    assert "CustomResourceDefinition" in release["manifest"]
    assert "kubectl get ptj" in release["notes"]
    assert "rollout status deployment/paratrain" in release["notes"]


# ---- renders ----------------------------------------------------------------------------------------------------

def test_default_render(rendered) -> None:
    objects = rendered["default"]
    assert sorted(o["kind"] for o in objects) == sorted(
        ["CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service", "Deployment",
         "Role", "RoleBinding", "ConfigMap", "ClusterRole", "ClusterRole", "NetworkPolicy", "PodDisruptionBudget"])
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] in {"ServiceAccount", "Service",
                                                                               "Deployment"}} == {RELEASE_NS}
    deployment = only(objects, "Deployment")
    # Two replicas, one acting (leader election on a Lease): the Lease's Role is in the release namespace only.
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate"}
    lease_role = only(objects, "Role")
    assert lease_role["metadata"]["namespace"] == RELEASE_NS
    assert lease_role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                                    "verbs": ["get", "create", "update"]}]
    assert only(objects, "RoleBinding")["roleRef"]["name"] == lease_role["metadata"]["name"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    assert only(objects, "ServiceAccount")["automountServiceAccountToken"] is False
    c = container(objects)
    assert c["image"] == f"ghcr.io/paratrain/operator:{APP_VERSION}"
    assert c["args"] == RATE_ARGS  # cluster-wide: the operator's default; the API rate limit spelt out
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"health": 8080, "metrics": 9090}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert set(c["resources"]) == {"requests", "limits"} and c["resources"]["limits"]["memory"]
    service = only(objects, "Service")
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    binding = only(objects, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == only(job_rbac(objects), "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "paratrain", "namespace": RELEASE_NS}]
    crd = only(objects, "CustomResourceDefinition")
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


PLATFORM_ARGS = ["--platform", "/etc/paratrain-operator/platform.yaml"]
RATE_ARGS = ["--leader-elect", "--lease-seconds", "10", *PLATFORM_ARGS, "--qps", "100", "--burst", "200",
             "--write-concurrency", "64", "--progress-seconds", "30"]



def test_the_optional_admission_policy_names_the_operators_account_and_the_opt_in_label(render) -> None:
    """Off by default; on, it matches the operator's ServiceAccount only (tests/cluster/test_helm_install.py has the
    API server enforce it)."""
    assert not [o for o in render() if o["kind"].startswith("ValidatingAdmissionPolicy")]
    objects = render({"admissionPolicy": {"enabled": True, "namespaceLabel": {"key": "example.com/ml", "value": "yes"}}})
    policy, binding = only(objects, "ValidatingAdmissionPolicy"), only(objects, "ValidatingAdmissionPolicyBinding")
    account = only(objects, "ServiceAccount")["metadata"]
    assert policy["spec"]["matchConditions"][0]["expression"] == (
        f'request.userInfo.username == "system:serviceaccount:{account["namespace"]}:{account["name"]}"')
    assert '"example.com/ml"' in policy["spec"]["validations"][0]["expression"]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    # Everything the operator may create, change or delete in a tenant's namespace is held to the policy: all but
    # events and the job itself, and Kueue's Workloads (owned by the gang's pods, not by the job).
    scope = {(group, resource) for rule in policy["spec"]["matchConstraints"]["resourceRules"]
             for group in rule["apiGroups"] for resource in rule["resources"]}
    writes = {(group, resource) for group, resource, verbs in rbac.RULES
              if {"create", "update", "patch", "delete"} & set(verbs) and group != API_GROUP and resource != "events"}
    assert writes - {("kueue.x-k8s.io", "workloads")} <= scope, writes - scope


def test_the_operators_pods_admit_only_metrics_scrapes_and_keep_a_replica_through_drains(render) -> None:
    """Issue 31: the operator's metrics (whose namespace label lists every tenant) and health ports were open to
    every pod, and a drain could evict both replicas at once."""
    objects = render()
    selector = only(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    policy = only(objects, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == selector
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "metrics", "protocol": "TCP"}],
                                          "from": [{"podSelector": {}}]}]  # the release's namespace only
    # Issue 42: egress only to the API server, DNS and rank 0's progress port (the trainer's contract).
    api, dns, progress = policy["spec"]["egress"]
    assert api == {"ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]}
    assert dns["ports"] == [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
    assert dns["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}]
    assert progress == {"ports": [{"port": contract.PROGRESS_PORT, "protocol": "TCP"}], "to": [
        {"namespaceSelector": {}, "podSelector": {"matchExpressions": [
            {"key": contract.LABEL_JOB, "operator": "Exists"}]}}]}
    control_plane = [{"ipBlock": {"cidr": "10.0.0.0/24"}}]
    narrowed = only(render({"networkPolicy": {"enabled": True, "egress": {
        "enabled": True, "apiServerPorts": [6443], "apiServerTo": control_plane}}}), "NetworkPolicy")
    assert narrowed["spec"]["egress"][0] == {"ports": [{"port": 6443, "protocol": "TCP"}], "to": control_plane}
    ingress_only = only(render({"networkPolicy": {"enabled": True, "egress": {"enabled": False}}}), "NetworkPolicy")
    assert ingress_only["spec"]["policyTypes"] == ["Ingress"] and "egress" not in ingress_only["spec"]
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    policy = only(render({"networkPolicy": {"enabled": True, "metricsFrom": monitoring}}), "NetworkPolicy")
    assert policy["spec"]["ingress"][0]["from"] == monitoring
    assert not [o for o in render({"networkPolicy": {"enabled": False}}) if o["kind"] == "NetworkPolicy"]
    budget = only(objects, "PodDisruptionBudget")
    assert budget["spec"] == {"minAvailable": 1, "selector": {"matchLabels": selector}}
    single = render({"replicas": 1, "leaderElection": {"enabled": False}})
    assert not [o for o in single if o["kind"] == "PodDisruptionBudget"]  # one replica: a budget would block drains

def test_namespaced_install_uses_role_and_passes_namespace(rendered, render) -> None:
    objects = rendered["namespaced"]
    kinds = {o["kind"] for o in objects}
    assert {"Role", "RoleBinding"} <= kinds and not {"ClusterRole", "ClusterRoleBinding"} & kinds
    role, binding = only(job_rbac(objects), "Role"), only(job_rbac(objects), "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "team-a"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    # The ServiceAccount stays in the release namespace; the binding in the watched one points at it.
    assert binding["subjects"][0]["namespace"] == RELEASE_NS
    assert container(objects)["args"] == ["--namespace", "team-a", *RATE_ARGS]
    # Without watchNamespace, a namespaced install runs the release namespace's jobs.
    default_ns = render({"rbac": {"namespaced": True}}, namespace="ml")
    assert container(default_ns)["args"] == ["--namespace", "ml", *RATE_ARGS]
    assert only(job_rbac(default_ns), "Role")["metadata"]["namespace"] == "ml"


def test_customized_values_reach_the_objects(rendered) -> None:
    objects = rendered["customized"]
    deployment = only(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    c = container(objects)
    assert deployment["metadata"]["name"] == "ptj-operator"
    assert c["image"] == "registry.example.com/ml/paratrain-operator@sha256:" + "ab" * 32
    assert c["imagePullPolicy"] == "Always"
    assert c["resources"] == CUSTOMIZED["resources"]
    assert c["args"] == ["--leader-elect", "--lease-seconds", "10", *PLATFORM_ARGS, "--qps", "20", "--burst", "40",
                         "--write-concurrency", "8", "--progress-seconds", "30", "--verbose"]
    assert c["env"] == [{"name": "TZ", "value": "UTC"}]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["serviceAccountName"] == "trainer-operator"
    for key in ("priorityClassName", "nodeSelector", "tolerations", "affinity"):
        assert pod[key] == CUSTOMIZED[key], key
    assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "ml-platform"
    assert deployment["spec"]["template"]["metadata"]["annotations"]["example.com/owner"] == "ml-platform"
    sa = only(objects, "ServiceAccount")
    assert sa["metadata"]["name"] == "trainer-operator"
    assert sa["metadata"]["annotations"] == CUSTOMIZED["serviceAccount"]["annotations"]
    assert only(objects, "ClusterRoleBinding")["subjects"][0]["name"] == "trainer-operator"
    service = only(objects, "Service")
    assert service["spec"]["ports"][0]["port"] == 9191
    monitor = only(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert "annotations" not in only(objects, "CustomResourceDefinition")["metadata"]  # crds.keep: false


def test_crds_can_be_left_to_another_owner(render) -> None:
    objects = render({"crds": {"enabled": False}})
    assert "CustomResourceDefinition" not in {o["kind"] for o in objects}


@pytest.mark.parametrize("text", [
    'x"\n  hostNetwork: true',
    "a: b\n- c: {d: e}",
    "{{ .Release.Name }}",
    "'; kubectl delete ns default; '",
])
def test_user_strings_stay_data(render, text: str) -> None:
    # Values are inserted with toJson/toYaml, never spliced into YAML as raw text.
    objects = render({"podAnnotations": {"example.com/note": text},
                      "serviceAccount": {"create": True, "name": "", "annotations": {"example.com/note": text}}})
    pod = only(objects, "Deployment")["spec"]["template"]
    assert pod["metadata"]["annotations"]["example.com/note"] == text
    assert "hostNetwork" not in pod["spec"]
    assert only(objects, "ServiceAccount")["metadata"]["annotations"]["example.com/note"] == text


# ---- values.schema.json -----------------------------------------------------------------------------------------

def with_value(path: str, value: Any) -> dict[str, Any]:
    """A full values dict (the defaults) with `path` (dot-separated) set to `value`."""
    values = copy.deepcopy(yaml.safe_load((CHART_DIR / "values.yaml").read_text()))
    *parents, leaf = path.split(".")
    node = values
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return values


BAD_VALUES = [
    # (path, value, what the error must mention)
    ("image.pullPolicy", "Sometimes", "/image/pullPolicy"),
    ("image.tag", "1.0; rm -rf /", "/image/tag"),
    ("image.digest", "sha256:xyz", "/image/digest"),
    ("image.repository", "", "/image/repository"),
    ("image.registry", "docker.io", "registry"),
    ("replicaCount", 2, "replicaCount"),
    ("crds.enabled", "yes", "/crds/enabled"),
    ("rbac.namespaced", 1, "/rbac/namespaced"),
    ("rbac.clusterWide", True, "clusterWide"),
    ("watchNamespace", "Team_A", "/watchNamespace"),
    ("serviceAccount.name", "Bad Name", "/serviceAccount/name"),
    ("resources.requests.cpu", "lots", "/resources/requests/cpu"),
    ("resources.limits", "1Gi", "/resources/limits"),
    ("metrics.service.port", 70000, "/metrics/service/port"),
    ("metrics.service.port", "9090", "/metrics/service/port"),
    ("metrics.serviceMonitor.interval", "30 seconds", "/metrics/serviceMonitor/interval"),
    ("operator.extraArgs", "--verbose", "/operator/extraArgs"),
    ("operator.env", [{"name": "1BAD", "value": "x"}], "/operator/env/0/name"),
    ("tolerations", [{"key": "gpu", "operator": "Maybe"}], "/tolerations/0/operator"),
    ("nodeSelector", {"pool": 3}, "/nodeSelector/pool"),
    ("imagePullSecrets", ["regcred"], "/imagePullSecrets/0"),
    ("podLabels", {"team": "has spaces"}, "/podLabels/team"),
]


@pytest.mark.parametrize(("path", "value", "mentions"), BAD_VALUES, ids=[f"{p}={v!r}" for p, v, _ in BAD_VALUES])
def test_schema_rejects_bad_values(render, path: str, value: Any, mentions: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as err:
        render(with_value(path, value))
    assert mentions in str(err.value)


@pytest.mark.parametrize(("values", "message"), [
    ({"watchNamespace": "team-a"}, "watchNamespace needs rbac.namespaced=true"),
    ({"serviceAccount": {"create": False, "name": ""}}, "serviceAccount.name is required"),
    ({"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
     "serviceMonitor.enabled needs metrics.service.enabled"),
])
def test_inconsistent_values_fail_with_a_reason(render, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError) as err:
        render(values)
    assert message in str(err.value)


def test_the_schema_takes_the_platform_as_the_operator_reads_it() -> None:
    """values.schema.json is hand-written: its `platform` fields are the Platform model's, and planner.gpu's names
    the catalogue's (a GPU added to one and not the other would be refused by Helm or read by nothing)."""
    platform = json.loads((CHART_DIR / "values.schema.json").read_text())["properties"]["platform"]
    assert set(platform["properties"]) == set(Platform.model_json_schema(by_alias=True)["properties"])
    planner = platform["properties"]["planner"]["properties"]
    assert set(planner) == set(PlannerProfile.model_json_schema(by_alias=True)["properties"])
    assert planner["gpu"]["enum"] == list(hardware.BY_NAME)


def test_schema_accepts_the_defaults_and_every_documented_option(render) -> None:
    for values in VALUE_SETS.values():
        render(values)  # raises on any schema error
    render(with_value("resources.requests.cpu", 2))  # quantities may be numbers


# ---- strict Kubernetes schema validation ------------------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_every_object_validates_strictly(rendered, value_set: str, version: str) -> None:
    for obj in rendered[value_set]:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            # A prometheus-operator custom resource: not in Kubernetes' own schemas.
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, version, strict=True)
            continue
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_catches_a_misspelt_field(rendered) -> None:
    # The validation above can fail: a misspelt field in the Deployment is an error in strict mode.
    deployment = copy.deepcopy(only(rendered["default"], "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
