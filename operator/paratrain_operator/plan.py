"""The gang plan, pure: a job → the names, labels and per-node env of its objects (no Kubernetes objects yet).

`render` turns a plan into objects; the operator finds what it created by the same names and labels.
Label merge: the user's `spec.pod.labels` / `annotations` first, paratrain's own on top, so a user key can never
replace one paratrain selects by (the spec also rejects user keys under `paratrain.dev/`). Env order: POD_IP /
POD_NAME (downward API; first, so user values may use `$(POD_IP)`) → torchrun's PET_* → PARATRAIN_* → NCCL /
torch watchdog and other defaults (each dropped when the user sets the same name) → the user's env.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from paratrain import contract
from paratrain.api import API_GROUP, API_GROUP_VERSION, KIND, ParallelTrainJob, kueue, layout_label
from paratrain.api.spec import EnvVar

from . import topology

ANNOTATION_NODE_RANK = f"{API_GROUP}/node-rank"
ANNOTATION_ATTEMPT = f"{API_GROUP}/attempt"
ANNOTATION_LAYOUT = f"{API_GROUP}/layout"
# Gang schedulers: the scheduler each needs, and how a pod names its group.
SCHEDULER_NAMES = {"volcano": "volcano", "kai": "kai-scheduler", "coscheduling": "scheduler-plugins-scheduler"}
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
# KAI (v0.15+) takes a PodGroup its pods name, where they ask its pod-grouper to leave them alone (else it makes a
# group of its own per top owner, of one pod for a kind it does not know) and name their subgroup by label.
KAI_GROUP_ANNOTATION = "pod-group-name"
KAI_SKIP_GROUPER_ANNOTATION = "kai.scheduler/skip-podgrouper"
KAI_SUBGROUP_LABEL = "kai.scheduler/subgroup-name"
# The native gang: one Workload per job whose template the PodGroup of each attempt follows.
WORKLOAD_TEMPLATE = "workers"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"

# Env from the downward API (name → pod field).
FIELD_ENV = {contract.ENV_PROGRESS_HOST: "status.podIP", "POD_NAME": "metadata.name"}
# Other defaults. A user env var of the same name replaces any default, fabric tuning included.
OVERRIDABLE_ENV = {
    "PYTHONUNBUFFERED": "1",  # log lines reach `kubectl logs` as they happen
    "HOME": "/tmp",  # the root filesystem is read-only; caches (torch, triton, HF) go under $HOME
}


@dataclass(frozen=True)
class NodePlan:
    """One pod of the gang."""

    rank: int
    pod_name: str
    hostname: str
    labels: dict[str, str]
    annotations: dict[str, str]
    env: tuple[dict[str, Any], ...]  # the container's env, in order: Kubernetes EnvVars
    affinity: dict[str, Any] | None = None  # spec.scheduling.affinity with the topology's pod affinity (topology.py)


@dataclass(frozen=True)
class GangPlan:
    job_name: str
    namespace: str
    attempt: int
    service: str
    config_map: str
    labels: dict[str, str]  # on every object of the gang; pods add attempt and rank
    gang: str  # spec.scheduling.gang
    scheduler_name: str | None
    pod_group: str | None
    owner: dict[str, Any] | None  # the ownerReference to the job, when it exists on a cluster (has a uid)
    nodes: tuple[NodePlan, ...]
    group_topology: str | None = None  # the native PodGroup's topology level (topology.group_constraint)


def gang_labels(job_name: str) -> dict[str, str]:
    return {contract.LABEL_JOB: job_name, "app.kubernetes.io/name": "paratrain",
            "app.kubernetes.io/instance": job_name, "app.kubernetes.io/managed-by": "paratrain-operator"}


def owner_reference(job: ParallelTrainJob) -> dict[str, Any] | None:
    """Deleting the job deletes the gang (garbage collection follows the controller reference)."""
    uid = job.metadata.uid
    if not uid:
        return None
    return {"apiVersion": API_GROUP_VERSION, "kind": KIND, "name": job.metadata.name, "uid": str(uid),
            "controller": True, "blockOwnerDeletion": True}


def node_env(job: ParallelTrainJob, namespace: str, attempt: int, rank: int) -> tuple[dict[str, Any], ...]:
    spec, name = job.spec, job.metadata.name
    env = contract.node_env(nnodes=spec.nodes, nproc_per_node=spec.procs_per_node, node_rank=rank,
                            master_addr=contract.pod_dns_name(name, namespace, 0),
                            # torchrun gives up on its peers when the operator ends the attempt, not before
                            rendezvous_timeout=spec.scheduling.start_timeout_seconds,
                            in_place_limit=spec.restart_policy.in_place_limit)
    env |= {contract.ENV_JOB_NAME: name, contract.ENV_RESTART_ATTEMPT: str(attempt),
            contract.ENV_PROGRESS_PORT: str(contract.PROGRESS_PORT),
            contract.ENV_TERMINATION_LOG: contract.TERMINATION_LOG_PATH,
            **contract.layout_env(spec.parallelism, spec.precision),
            contract.ENV_STOP_GRACE: str(spec.pod.termination_grace_period_seconds - contract.STOP_MARGIN_SECONDS)}
    if spec.restart_policy.hang_seconds:
        env[contract.ENV_HANG_SECONDS] = str(spec.restart_policy.hang_seconds)
    if spec.restart_policy.in_place_limit:
        rules = [r.dump() for r in spec.failure_policy.rules if r.exit_codes]
        env[contract.ENV_EXIT_CODE_RULES] = json.dumps(rules, separators=(",", ":"))
    user = {e.name for e in spec.pod.env}
    env |= {k: v for k, v in (contract.COMMS_ENV | OVERRIDABLE_ENV).items() if k not in user}
    return (*({"name": k, "valueFrom": {"fieldRef": {"fieldPath": f}}} for k, f in FIELD_ENV.items()),
            *({"name": k, "value": v} for k, v in env.items()), *container_env(spec.pod.env))


def container_env(env: Sequence[EnvVar]) -> tuple[dict[str, Any], ...]:
    """The user's env as Kubernetes EnvVars."""
    return tuple({"name": e.name, "valueFrom": e.value_from.dump()} if e.value_from else {"name": e.name,
                                                                                        "value": e.value}
                 for e in env)


def pod_labels(job: ParallelTrainJob, plan_labels: dict[str, str], attempt: int, rank: int,
               pod_group: str | None) -> dict[str, str]:
    own = plan_labels | {contract.LABEL_ATTEMPT: str(attempt), contract.LABEL_NODE_RANK: str(rank)}
    own |= kueue.pod_labels(job, attempt) | topology.group_labels(job, rank)
    if job.spec.scheduling.gang == "coscheduling" and pod_group:
        own[COSCHEDULING_GROUP_LABEL] = pod_group
    if job.spec.scheduling.gang == "kai" and pod_group and (subgroup := topology.kai_subgroup(job, rank)):
        own[KAI_SUBGROUP_LABEL] = subgroup
    return dict(job.spec.pod.labels) | own


def pod_annotations(job: ParallelTrainJob, attempt: int, rank: int, pod_group: str | None) -> dict[str, str]:
    own = {ANNOTATION_NODE_RANK: str(rank), ANNOTATION_ATTEMPT: str(attempt),
           ANNOTATION_LAYOUT: layout_label(job.spec)} | kueue.pod_annotations(job)
    if job.spec.scheduling.gang == "volcano" and pod_group:
        own[VOLCANO_GROUP_ANNOTATION] = pod_group
    if job.spec.scheduling.gang == "kai" and pod_group:
        own |= {KAI_GROUP_ANNOTATION: pod_group, KAI_SKIP_GROUPER_ANNOTATION: "true"}
    return dict(job.spec.pod.annotations) | own


def plan_gang(job: ParallelTrainJob, namespace: str, attempt: int = 0,
              ranks: Collection[int] | None = None) -> GangPlan:
    """The gang's plan; its `nodes` only those of `ranks` when given (each node copies the spec's env and
    annotations: a batch of a 4,096-pod gang plans its own nodes, not all of them). A mode auto job is rendered
    once the layout planner has chosen its layout (paratrain_operator.planning)."""
    if job.spec.parallelism.mode == "auto":
        raise ValueError("a mode auto job is rendered as planned: plan it first (paratrain.api.planner.planned)")
    name, gang = job.metadata.name, job.spec.scheduling.gang
    wanted = range(job.spec.nodes) if ranks is None else sorted(set(ranks))
    labels = gang_labels(name)
    # A native PodGroup is one scheduling instance, so each gang attempt gets a fresh one; Volcano's, KAI's and
    # scheduler-plugins' groups are reused across attempts.
    pod_group = None if gang == "none" else f"{name}-{attempt}" if gang == "kubernetes" else name
    nodes = tuple(
        NodePlan(rank=rank, pod_name=contract.pod_name(name, attempt, rank),
                 hostname=contract.pod_hostname(name, rank),
                 labels=pod_labels(job, labels, attempt, rank, pod_group),
                 annotations=pod_annotations(job, attempt, rank, pod_group),
                 env=node_env(job, namespace, attempt, rank), affinity=topology.affinity(job, attempt, rank))
        for rank in wanted if 0 <= rank < job.spec.nodes)
    return GangPlan(job_name=name, namespace=namespace, attempt=attempt, service=contract.service_name(name),
                    config_map=f"{name}-spec", labels=labels, gang=gang, scheduler_name=SCHEDULER_NAMES.get(gang),
                    pod_group=pod_group, owner=owner_reference(job), nodes=nodes,
                    group_topology=topology.group_constraint(job))
