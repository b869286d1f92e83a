"""Security by default: every pod paratrain creates meets the restricted Pod Security Standard, and the operator's
RBAC is least privilege (no wildcards; the subresources it needs, nothing cluster-wide it does not).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from paratrain.api import load_job
from paratrain.api.platform import Platform
from paratrain_operator import planning, rbac
from paratrain_operator.render import render_job

from .conftest import ROOT, VALUE_SETS
from .policy import granted, only, pod_specs, rbac_wildcards, restricted_violations

JOB_FILES = sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "tests" / "e2e" / "jobs").glob("gloo-*.yaml"))

JOB = "paratrain.dev"
AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def user_roles(objects: list[dict]) -> list[dict]:
    """The ClusterRoles for people (aggregated into Kubernetes' own), not the operator's."""
    return [o for o in objects if o["kind"] == "ClusterRole"
            and any(k.startswith(AGGREGATE) for k in o["metadata"]["labels"])]


def operator_objects(objects: list[dict]) -> list[dict]:
    people = user_roles(objects)
    return [o for o in objects if o not in people]


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_operator_pod_is_restricted(rendered, value_set: str) -> None:
    specs = dict(pod_specs(rendered[value_set]))
    assert list(specs) == ["Deployment/" + only(rendered[value_set], "Deployment")["metadata"]["name"]]
    for name, spec in specs.items():
        assert restricted_violations(spec) == [], name
        container = spec["containers"][0]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert isinstance(spec["securityContext"]["runAsUser"], int) and spec["securityContext"]["runAsUser"] > 0


@pytest.mark.parametrize("mutate, violation", [
    (lambda s: s.update(hostNetwork=True), "hostNetwork: true"),
    (lambda s: s.update(hostPID=True), "hostPID: true"),
    (lambda s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "volume h"),
    (lambda s: s["containers"][0]["securityContext"].update(privileged=True), "privileged"),
    (lambda s: s["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True), "allowPrivilegeEscalation"),
    (lambda s: s["containers"][0]["securityContext"]["capabilities"].update(drop=["NET_RAW"]), "drop ALL"),
    (lambda s: s["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]), "adds capabilities"),
    (lambda s: s["containers"][0]["securityContext"].update(runAsNonRoot=False), "runAsNonRoot"),
    (lambda s: s["securityContext"].update(runAsUser=0), "runAsUser: 0"),
    (lambda s: s["containers"][0]["securityContext"].update(seccompProfile={"type": "Unconfined"}), "seccomp"),
    (lambda s: s["containers"][0]["ports"].append({"containerPort": 1, "hostPort": 1}), "hostPort"),
])
def test_the_checker_catches_each_violation(rendered, mutate, violation: str) -> None:
    # The restricted checks above can fail: each forbidden setting, added to the operator pod, is reported.
    spec = copy.deepcopy(dict(pod_specs(rendered["default"]))["Deployment/paratrain"])
    mutate(spec)
    assert any(violation in v for v in restricted_violations(spec)), restricted_violations(spec)


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_rbac_is_least_privilege(rendered, value_set: str) -> None:
    roles = [o for o in operator_objects(rendered[value_set]) if o["kind"] in {"ClusterRole", "Role"}]
    lease = [r for r in roles if r["metadata"]["name"].endswith("-leader-election")]
    assert len(lease) == 1 and granted(lease[0]["rules"]) == granted(rbac.policy_rules(rbac.LEASE_RULES))
    assert lease[0]["kind"] == "Role"  # leases in the operator's own namespace only
    roles = [r for r in roles if r not in lease]
    assert len(roles) == 1
    rules = roles[0]["rules"]
    assert rbac_wildcards(rules) == []
    grants = granted(rules)
    # The subresources the operator needs: status writes, and blockOwnerDeletion on the gang (kopf.adopt).
    assert {(JOB, "paralleltrainjobs/status", "patch"), (JOB, "paralleltrainjobs/finalizers", "update")} <= grants
    assert {(JOB, "paralleltrainjobs", v) for v in ("get", "list", "watch", "patch")} <= grants
    assert {("", "pods", v) for v in ("list", "watch", "create", "delete")} <= grants
    # Nothing that reads credentials or escalates.
    resources = {r for _, r, _ in grants}
    assert not resources & {"secrets", "serviceaccounts/token", "pods/exec", "pods/attach", "nodes/proxy",
                            "clusterroles", "clusterrolebindings", "roles", "rolebindings"}
    # A node is read one by one, to tell a lost node from a slow kubelet (stuck pods), and the GPU nodes are listed
    # (at most once a minute) for their GPU Feature Discovery labels, which parallelism mode auto plans for; never
    # watched or written.
    assert {v for _, r, v in grants if r == "nodes"} <= {"get", "list"}
    assert not {v for _, _, v in grants} & {"escalate", "bind", "impersonate", "deletecollection"}


def test_rbac_is_what_the_operator_declares(rendered) -> None:
    declared = granted(rbac.policy_rules(rbac.RULES))
    assert granted(only(operator_objects(rendered["default"]), "ClusterRole")["rules"]) == \
        declared | granted(rbac.policy_rules(rbac.CLUSTER_RULES))
    job_roles = [o for o in rendered["namespaced"] if not o["metadata"]["name"].endswith("-leader-election")]
    assert granted(only(job_roles, "Role")["rules"]) == declared
    # A namespaced install creates nothing cluster-scoped but the CRD.
    assert not {o["kind"] for o in rendered["namespaced"]} & {"ClusterRole", "ClusterRoleBinding"}


def test_people_get_the_job_api_through_the_default_roles(rendered) -> None:
    """edit/admin may run and delete jobs, view may read them; no one but the operator writes status."""
    roles = {r["metadata"]["name"]: r for r in user_roles(rendered["default"])}
    assert set(roles) == {"paratrain-edit", "paratrain-view"}
    edit, view = roles["paratrain-edit"], roles["paratrain-view"]
    assert {k for k in edit["metadata"]["labels"] if k.startswith(AGGREGATE)} == {AGGREGATE + "edit",
                                                                                   AGGREGATE + "admin"}
    assert {k for k in view["metadata"]["labels"] if k.startswith(AGGREGATE)} == {AGGREGATE + "view"}
    assert granted(edit["rules"]) == granted(rbac.policy_rules(rbac.USER_EDIT_RULES))
    assert granted(view["rules"]) == granted(rbac.policy_rules(rbac.USER_VIEW_RULES))
    assert (JOB, "paralleltrainjobs", "create") in granted(edit["rules"])
    assert {v for _, _, v in granted(view["rules"])} == {"get", "list", "watch"}
    assert not {(JOB, "paralleltrainjobs/status", v) for v in ("patch", "update")} & granted(edit["rules"])
    assert user_roles(rendered["namespaced"]) == [], "cluster-scoped: a namespaced install leaves them out"


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: p.name)
def test_trainer_pods_are_restricted(path: Path) -> None:
    job = load_job(str(path), [])
    if job.spec.parallelism.mode == "auto":  # rendered as the operator renders it: planned (these are CPU pods)
        job, _ = planning.plan_now(job, [], Platform(), 1)
    objects = render_job(job, namespace="ml", attempt=1)
    pods = [o for o in objects if o["kind"] == "Pod"]
    assert len(pods) == job.spec.nodes
    for name, spec in pod_specs(objects):
        assert restricted_violations(spec) == [], name
        # Training pods hold no API credentials (progress is read by the operator, not pushed by the pods), unless
        # the job names a ServiceAccount for its own program (workload identity).
        assert spec["automountServiceAccountToken"] is (job.spec.pod.service_account_name is not None), name


def test_wildcard_checker_catches_wildcards() -> None:
    assert rbac_wildcards([{"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]}]) == ["rules[0].verbs: ['*']"]
    assert rbac_wildcards([{"apiGroups": ["*"], "resources": ["pods/*"], "verbs": ["get"]}]) == [
        "rules[0].apiGroups: ['*']", "rules[0].resources: ['pods/*']"]
