"""The RBAC the operator needs, and nothing more (the Helm chart's Role/ClusterRole is tested against this).

Why each rule:
- paralleltrainjobs: kopf lists and watches them and patches its bookkeeping annotations; the operator reads
  each job and deletes it after `ttlSecondsAfterFinished`.
- paralleltrainjobs/status: the operator writes status (merge patch) — and only status.
- paralleltrainjobs/finalizers: ownerReferences with blockOwnerDeletion on the gang's objects need `update`
  on the owner's finalizers where the OwnerReferencesPermissionEnforcement admission plugin runs.
- pods: watched (kopf, server-side label selector) and listed by label, created per gang attempt, deleted on
  gang restarts, suspension, failure and deadline. No patch/update: pods are never modified.
- configmaps, services: the gang's spec ConfigMap and headless Service; a ConfigMap is patched when a new
  attempt follows a spec change.
- get on everything the operator creates: a create answered 409 (already exists) is checked, since the name
  may be held by a same-named job's object that is about to be deleted.
- events: the operator's own Events on the job: created, and patched to count a repeat of the same Event.
- networkpolicies: each gang's ingress policy (the platform's networkPolicy), created with the job's Service and
  owned by the job like it.
- workloads and podgroups (scheduling.k8s.io: Kubernetes' native gang; Volcano's, KAI's, scheduler-plugins'): only for
  `spec.scheduling.gang`; without them such a job fails with a clear message and everything else works. A native
  PodGroup is one attempt's scheduling instance: the next attempt deletes it (`delete`), so restarts and resumes
  leave one, not one each (all are owned by the job and go with it). Volcano's, KAI's, scheduler-plugins' groups are one
  per job: patched when a new attempt has another size (an elastic resize).
- workloads (kueue.x-k8s.io: get, delete): the Kueue Workload of a pod group of the job's that the operator gave up
  while Kueue still held it (a gang restarted, shrunk or timed out before admission, placeholder pods no longer
  wanted): Kueue keeps its finalizer on such pods until the group ends, and a group of deleted, never-admitted pods
  never ends; deleting its Workload is Kueue's way to let them go. Only a Workload owned by the job's own pods.
- namespaces (list, watch): kopf's namespace observer, cluster-wide or with `--namespace` patterns.
- nodes (get): only for a pod of an old attempt stuck terminating past its grace period: if its node is gone or
  NotReady (no kubelet will ever confirm the deletion), the pod is force-deleted, as the pod garbage collector
  does, so the gang's restart can proceed; on a Ready node it is only reported. (list): parallelism mode auto
  reads the GPU nodes' GPU Feature Discovery labels (nvidia.com/gpu.product, gpu.memory, gpu.count) to plan a
  gang, at most once a minute; without it the platform's planner.gpu names the GPU.
- customresourcedefinitions (list, watch): kopf's resource observer (it notices the CRD being installed).
- leases (coordination.k8s.io), only in the operator's own namespace (a Role there): leader election among its
  replicas (`--leader-elect`): read, created once, renewed and taken over by update.
Reads of rank 0's progress endpoint are plain HTTP to the pod IP, not API calls.

The job API for people comes in two ClusterRoles the chart aggregates into Kubernetes' own: `<release>-edit`
(into `edit` and `admin`) and `<release>-view` (into `view`), so whoever a namespace admin lets edit a namespace
may run jobs there. Creating a job is creating pods (any image, the namespace's Secrets and ServiceAccounts;
docs/operator.md, "Trust model"), which `edit` already allows; `view` only reads jobs.
"""

from __future__ import annotations

from paratrain.api import API_GROUP, PLURAL

# (apiGroup, resource, verbs); "" is the core group.
RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (API_GROUP, PLURAL, ("get", "list", "watch", "patch", "delete")),
    (API_GROUP, f"{PLURAL}/status", ("patch",)),
    (API_GROUP, f"{PLURAL}/finalizers", ("update",)),
    ("", "pods", ("get", "list", "watch", "create", "delete")),
    ("", "configmaps", ("get", "create", "patch")),
    ("", "services", ("get", "create")),
    ("", "events", ("create", "patch", "get")),
    ("networking.k8s.io", "networkpolicies", ("get", "create")),
    ("scheduling.k8s.io", "workloads", ("get", "create")),
    ("scheduling.k8s.io", "podgroups", ("get", "create", "delete")),
    ("scheduling.volcano.sh", "podgroups", ("get", "create", "patch")),
    ("scheduling.run.ai", "podgroups", ("get", "create", "patch")),
    ("scheduling.x-k8s.io", "podgroups", ("get", "create", "patch")),
    ("kueue.x-k8s.io", "workloads", ("get", "delete")),
)
# Cluster-scoped reads: kopf's (namespaces, CRDs) even when the operator serves only some namespaces, and one
# node at a time to tell a lost node from a slow kubelet (a stuck pod), the GPU nodes' labels for mode auto's plans.
# A namespaced install goes without them; a stuck pod is then only reported, never force-deleted, and mode auto
# plans for the platform's planner.gpu.
CLUSTER_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("", "namespaces", ("list", "watch")),
    ("", "nodes", ("get", "list")),
    ("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch")),
)

# In the operator's own namespace only, for leader election.
LEASE_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("coordination.k8s.io", "leases", ("get", "create", "update")),
)


# People's access to jobs. No one but the operator writes status.
USER_EDIT_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (API_GROUP, PLURAL, ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")),
    (API_GROUP, f"{PLURAL}/status", ("get",)),
)
USER_VIEW_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (API_GROUP, PLURAL, ("get", "list", "watch")),
    (API_GROUP, f"{PLURAL}/status", ("get",)),
)


def policy_rules(rules: tuple[tuple[str, str, tuple[str, ...]], ...] = RULES) -> list[dict[str, list[str]]]:
    """As Kubernetes PolicyRules (one per resource), e.g. for a Role's `rules`."""
    return [{"apiGroups": [group], "resources": [resource], "verbs": list(verbs)} for group, resource, verbs in rules]
