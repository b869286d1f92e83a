"""The Helm chart installed, upgraded and uninstalled for real (helm-python-sdk, Helm's own Go SDK) on a real
kube-apiserver: the objects it creates, RBAC that the server's own authorizer proves least-privilege, an upgrade
that changes the Deployment, and an uninstall that leaves the CRD and the jobs in place.

No kubelet runs here, so the operator's Deployment never gets pods: nothing waits for readiness, the tests read
the objects the server stored."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import pytest

from paratrain.api import API_GROUP, API_GROUP_VERSION, PLURAL
from paratrain_operator import rbac

from ..support.control_plane import ControlPlane, collection_path, wait_for

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "paratrain"
CRD_NAME = f"{PLURAL}.{API_GROUP}"
CRD_PATH = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}"
IMAGE = {"repository": "registry.example.com/ml/paratrain-operator", "tag": "1.2.3"}
# An API request: (verb, "group/plural[/subresource]", namespace); no namespace: in every namespace at once, or
# a cluster-scoped resource.
Request = tuple[str, str, str | None]
# Every verb a PolicyRule can name on a resource; the ones a rule leaves out must be refused.
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")
# Powers outside the operator's rules ("group/plural[/subresource]"): secrets, other workloads, its own RBAC.
FORBIDDEN = (
    ("get", "/secrets"), ("list", "/secrets"), ("create", "/secrets"), ("patch", "/pods"), ("update", "/pods"),
    ("create", "/pods/exec"), ("create", "/serviceaccounts/token"), ("watch", "/nodes"), ("patch", "/nodes"),
    ("get", "/nodes/proxy"), ("update", "/namespaces"),
    ("create", "apps/deployments"), ("create", "apps/statefulsets"), ("create", "batch/jobs"),
    ("create", "apiextensions.k8s.io/customresourcedefinitions"),
    ("delete", "apiextensions.k8s.io/customresourcedefinitions"),
    ("create", "rbac.authorization.k8s.io/clusterrolebindings"), ("create", "rbac.authorization.k8s.io/rolebindings"),
    ("escalate", "rbac.authorization.k8s.io/clusterroles"), ("bind", "rbac.authorization.k8s.io/clusterroles"),
    ("impersonate", "/users"), ("impersonate", "/serviceaccounts"),
)


@dataclass
class Release:
    """One release of charts/paratrain, through helm-python-sdk with Helm's default Secret storage."""

    plane: ControlPlane
    name: str
    namespace: str
    values: dict[str, Any]

    @property
    def fullname(self) -> str:  # the chart's paratrain.fullname
        return self.name if "paratrain" in self.name else f"{self.name}-paratrain"

    @property
    def account(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.fullname}"

    def helm(self) -> helm_python.Config:
        return helm_python.Config(kubeconfig_path=self.plane.kubeconfig, namespace=self.namespace,
                                  storage_driver="secret")

    def install(self) -> dict[str, Any]:
        with self.helm() as helm:
            return helm.install(CHART, self.name, self.values, create_namespace=True, timeout=60)

    def upgrade(self, values: dict[str, Any]) -> dict[str, Any]:
        with self.helm() as helm:
            return helm.upgrade(CHART, self.name, values, timeout=60)

    def uninstall(self) -> None:
        with self.helm() as helm:
            helm.uninstall(self.name, ignore_not_found=True, timeout=60)

    def deployed(self) -> bool:
        with self.helm() as helm:
            return any(r["name"] == self.name for r in helm.list())

    def ensure_installed(self) -> None:
        """Installed with its values (the lifecycle test uninstalls it; any test order works)."""
        if not self.deployed():
            adopt_crd(self)
            self.install()


def adopt_crd(release: Release) -> None:
    """Hand an existing CRD to the release, as Helm documents for adopting objects: Helm refuses to take over one
    without its ownership label and annotations ("invalid ownership metadata"), and a CRD applied with kubectl
    (README's kubectl install; tests/cluster/test_crd_install.py in this session) has none. A CRD kept by an
    earlier uninstall of the same release still names it, so nothing changes then."""
    api = release.plane.api
    if not api.get(CRD_PATH).ok:
        return
    for verb, pairs in (("label", ["app.kubernetes.io/managed-by=Helm"]),
                        ("annotate", [f"meta.helm.sh/release-name={release.name}",
                                      f"meta.helm.sh/release-namespace={release.namespace}"])):
        proc = release.plane.kubectl(verb, "--overwrite", "crd", CRD_NAME, *pairs)
        assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def cluster_wide(control_plane):
    release = Release(control_plane, "ptj-cluster", "helm-cluster", {"image": IMAGE})
    yield release
    release.uninstall()


@pytest.fixture
def installed(cluster_wide) -> Release:
    cluster_wide.ensure_installed()
    return cluster_wide


@pytest.fixture(scope="module")
def namespaced(control_plane, cluster_wide):
    """A team's install beside the cluster-wide one: a Role in its namespace, and the CRD left to the other."""
    cluster_wide.ensure_installed()
    release = Release(control_plane, "ptj-team", "helm-team",
                      {"image": IMAGE, "rbac": {"namespaced": True}, "crds": {"enabled": False}})
    release.install()
    yield release
    release.uninstall()


def read(release: Release, api_version: str, plural: str, name: str, namespaced: bool = True) -> dict[str, Any]:
    api = release.plane.api
    path = collection_path(api_version, plural, release.namespace if namespaced else None) + f"/{name}"
    return api.must(api.get(path))


def gone(release: Release, api_version: str, plural: str, name: str, namespaced: bool = True) -> bool:
    path = collection_path(api_version, plural, release.namespace if namespaced else None) + f"/{name}"
    return release.plane.api.get(path).status == 404


def granted(release: Release, requests: list[Request], user: str | None = None) -> list[Request]:
    """The requests by the release's ServiceAccount that the API server's authorizer allows, asked by
    SelfSubjectAccessReviews created with `kubectl --as`: the server itself impersonates the account, with its
    groups. Not `kubectl auth can-i`: for an API this cluster does not serve (Volcano's and scheduler-plugins'
    podgroups) it asks about a core resource named "podgroups.scheduling.volcano.sh"."""
    reviews = [{"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": resource_attributes(*request)}} for request in requests]
    proc = release.plane.kubectl("create", f"--as={user or release.account}", "-o", 'jsonpath={.status.allowed}{"\\n"}',
                                 "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": reviews}))
    assert proc.returncode == 0, proc.stderr
    answers = proc.stdout.split()
    assert len(answers) == len(requests), proc.stdout
    return [request for request, answer in zip(requests, answers) if answer == "true"]


def resource_attributes(verb: str, resource: str, namespace: str | None) -> dict[str, str]:
    group, _, rest = resource.partition("/")
    plural, _, subresource = rest.partition("/")
    return {"verb": verb, "group": group, "resource": plural, "subresource": subresource, "namespace": namespace or ""}


def every_verb(rules, namespace: str | None) -> list[Request]:
    return [(verb, f"{group}/{resource}", namespace) for group, resource, _ in rules for verb in VERBS]


def declared(rules, namespace: str | None) -> list[Request]:
    """every_verb's requests that the rules grant, in its order."""
    return [(verb, f"{group}/{resource}", namespace) for group, resource, verbs in rules for verb in VERBS
            if verb in verbs]


def test_install_creates_the_crd_account_rbac_deployment_and_metrics_service(installed):
    installed.plane.wait_established(CRD_NAME)
    annotations = read(installed, "apiextensions.k8s.io/v1", "customresourcedefinitions", CRD_NAME,
                       namespaced=False)["metadata"]["annotations"]
    assert annotations["helm.sh/resource-policy"] == "keep"
    assert annotations["meta.helm.sh/release-name"] == installed.name

    read(installed, "v1", "serviceaccounts", installed.fullname)
    binding = read(installed, "rbac.authorization.k8s.io/v1", "clusterrolebindings", installed.fullname,
                   namespaced=False)
    assert binding["roleRef"]["name"] == installed.fullname
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": installed.fullname,
                                    "namespace": installed.namespace}]

    pod = read(installed, "apps/v1", "deployments", installed.fullname)["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == installed.fullname
    assert pod["spec"]["containers"][0]["image"] == f"{IMAGE['repository']}:{IMAGE['tag']}"
    service = read(installed, "v1", "services", f"{installed.fullname}-metrics")["spec"]
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    assert [(p["port"], p["targetPort"]) for p in service["ports"]] == [(9090, "metrics")]

    secret = read(installed, "v1", "secrets", f"sh.helm.release.v1.{installed.name}.v1")
    assert secret["type"] == "helm.sh/release.v1"


def test_the_cluster_role_holds_exactly_the_operators_rules(installed):
    role = read(installed, "rbac.authorization.k8s.io/v1", "clusterroles", installed.fullname, namespaced=False)
    assert role["rules"] == rbac.policy_rules() + rbac.policy_rules(rbac.CLUSTER_RULES)


def test_the_authorizer_grants_the_operator_its_verbs_and_nothing_more(installed):
    """Every verb of every rule, in every namespace at once, and no other verb on those resources."""
    rules = rbac.RULES + rbac.CLUSTER_RULES
    assert granted(installed, every_verb(rules, namespace=None)) == declared(rules, namespace=None)


def test_the_authorizer_refuses_the_operator_anything_else(installed):
    # One request it may make, so that a refusal of everything (an unknown account) cannot pass.
    control = ("create", "/pods", "default")
    requests = [(verb, resource, namespace) for verb, resource in FORBIDDEN
                for namespace in (installed.namespace, "default", None)]
    assert granted(installed, [control, *requests]) == [control]


def test_namespace_editors_may_run_jobs_and_viewers_only_read_them(installed):
    """The chart's -edit and -view ClusterRoles, aggregated by the controller manager into Kubernetes' own edit and
    view: a namespace admin grants the job API with the roles people already have."""
    api, namespace = installed.plane.api, "helm-people"
    if not api.get(f"/api/v1/namespaces/{namespace}").ok:
        installed.plane.create_namespace(namespace)
    for user, role in (("alice", "edit"), ("bob", "view")):
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": f"{user}-{role}", "namespace": namespace},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}
        response = api.create(collection_path("rbac.authorization.k8s.io/v1", "rolebindings", namespace), binding)
        assert response.ok or response.status == 409, response.body
    jobs = f"{API_GROUP}/{PLURAL}"
    run = [(verb, jobs, namespace) for verb in ("create", "get", "list", "watch", "delete")]
    write_status = [("patch", f"{jobs}/status", namespace), ("update", f"{jobs}/status", namespace)]
    elsewhere = [("create", jobs, "default"), ("get", jobs, "default")]
    wait_for(lambda: granted(installed, run, "alice") == run or None, 30, "edit to aggregate the job API")
    assert granted(installed, write_status + elsewhere, "alice") == []
    reads = [(verb, jobs, namespace) for verb in ("get", "list", "watch")]
    wait_for(lambda: granted(installed, reads, "bob") == reads or None, 30, "view to aggregate the job API")
    assert granted(installed, [("create", jobs, namespace), ("delete", jobs, namespace), *write_status],
                   "bob") == []


def test_a_namespaced_install_without_the_crd_acts_in_its_namespace_only(namespaced):
    stored = read(namespaced, "rbac.authorization.k8s.io/v1", "roles", namespaced.fullname)
    assert stored["rules"] == rbac.policy_rules()
    assert gone(namespaced, "rbac.authorization.k8s.io/v1", "clusterroles", namespaced.fullname, namespaced=False)
    with namespaced.helm() as helm:
        assert "CustomResourceDefinition" not in helm.status(namespaced.name)["manifest"]

    assert granted(namespaced, every_verb(rbac.RULES, namespaced.namespace)) == declared(rbac.RULES,
                                                                                        namespaced.namespace)
    control = ("create", "/pods", namespaced.namespace)
    elsewhere = every_verb(rbac.RULES, "default") + every_verb(rbac.RULES + rbac.CLUSTER_RULES, namespace=None)
    assert granted(namespaced, [control, *elsewhere]) == [control]


def test_the_admission_policy_keeps_the_operator_to_opted_in_namespaces_and_gang_objects(installed):
    """admissionPolicy.enabled: the API server itself refuses the operator's ServiceAccount a pod in a namespace
    that did not opt in (its RBAC alone would allow it anywhere, kube-system included) and a pod no
    ParallelTrainJob owns; a gang's pod in an opted-in namespace passes, and nobody else is affected. Server-side
    dry runs: admission runs, nothing is stored."""
    plane = installed.plane
    closed, opened = plane.create_namespace("vap-closed"), plane.create_namespace("vap-open")
    assert plane.kubectl("label", "namespace", opened, "paratrain.dev/jobs=enabled").returncode == 0
    owner = {"apiVersion": API_GROUP_VERSION, "kind": "ParallelTrainJob", "name": "j",
             "uid": "00000000-0000-0000-0000-000000000000"}

    def create(namespace: str, owned: bool, user: str | None = None):
        meta = {"name": "probe", **({"ownerReferences": [owner]} if owned else {})}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
               "spec": {"containers": [{"name": "c", "image": "registry.example.com/x:1"}]}}
        return plane.kubectl("create", "--dry-run=server", f"--as={user or installed.account}", "-n", namespace,
                             "-f", "-", input=json.dumps(pod))

    installed.upgrade({**installed.values, "admissionPolicy": {"enabled": True}})
    try:
        # The API server compiles and loads a new policy within seconds.
        refused = wait_for(lambda: (p := create(closed, owned=True)).returncode != 0 and p, 30,
                           "the policy to be enforced")
        assert "acts only in namespaces labelled paratrain.dev/jobs=enabled" in refused.stderr
        unowned = create(opened, owned=False)
        assert unowned.returncode != 0 and "only objects owned by a ParallelTrainJob" in unowned.stderr
        assert create(opened, owned=True).returncode == 0
        admin = plane.kubectl("create", "--dry-run=server", "-n", "kube-system", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
             "spec": {"containers": [{"name": "c", "image": "registry.example.com/x:1"}]}}))
        assert admin.returncode == 0, admin.stderr  # people and other controllers are not held by it
        kube_system = plane.kubectl("create", "--dry-run=server", f"--as={installed.account}", "-n", "kube-system",
                                    "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                                                                 "metadata": {"name": "probe",
                                                                              "ownerReferences": [owner]}}))
        assert kube_system.returncode != 0 and "acts only in namespaces labelled" in kube_system.stderr
    finally:
        installed.upgrade(installed.values)


def test_upgrade_changes_the_deployment_and_uninstall_keeps_the_crd_and_the_jobs(installed):
    api = installed.plane.api
    jobs = collection_path(API_GROUP_VERSION, PLURAL, installed.namespace)
    api.must(api.create(jobs, {"apiVersion": API_GROUP_VERSION, "kind": "ParallelTrainJob",
                               "metadata": {"name": "keep-me"}, "spec": {}}))
    try:
        upgraded = installed.upgrade({"image": {**IMAGE, "tag": "1.2.4"},
                                      "resources": {"requests": {"cpu": "200m", "memory": "300Mi"},
                                                    "limits": {"memory": "1Gi"}}})
        assert upgraded["status"] == "deployed" and upgraded["revision"] >= 2
        container = read(installed, "apps/v1", "deployments", installed.fullname)["spec"]["template"]["spec"][
            "containers"][0]
        assert container["image"] == f"{IMAGE['repository']}:1.2.4"
        assert container["resources"] == {"requests": {"cpu": "200m", "memory": "300Mi"},
                                          "limits": {"memory": "1Gi"}}

        installed.uninstall()
        released = [("apps/v1", "deployments", installed.fullname, True),
                    ("v1", "serviceaccounts", installed.fullname, True),
                    ("v1", "services", f"{installed.fullname}-metrics", True),
                    ("rbac.authorization.k8s.io/v1", "clusterroles", installed.fullname, False),
                    ("rbac.authorization.k8s.io/v1", "clusterrolebindings", installed.fullname, False)]
        wait_for(lambda: all(gone(installed, *obj) for obj in released), 30, "the release's objects deleted")
        assert not installed.deployed()
        assert api.get(CRD_PATH).ok
        assert api.get(f"{jobs}/keep-me").ok
    finally:
        api.request("DELETE", f"{jobs}/keep-me")
