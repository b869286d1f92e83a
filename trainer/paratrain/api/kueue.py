"""Kueue admission, in Kueue's own convention: the `kueue.x-k8s.io/queue-name` label on a ParallelTrainJob (as users
put it on a Job, JobSet or TrainJob) puts its gang under Kueue's plain-pod group integration. Every pod of an
attempt carries the queue, the attempt's group name and the group's size, so Kueue admits, holds or preempts the
gang as one Workload.

The names are Kueue's (v0.17: pkg/controller/constants and pkg/controller/jobs/pod/constants).
"""

from __future__ import annotations

import re
from typing import Any

from ..contract import LABEL_NODE_RANK
from .spec import DNS_SUBDOMAIN, KUEUE_KEY_PREFIX, QUEUED_GANGS, ParallelTrainJob

API_VERSION = "kueue.x-k8s.io/v1beta2"  # its Workload objects' (the operator deletes one it gave up)
QUEUE_LABEL = f"{KUEUE_KEY_PREFIX}queue-name"
PRIORITY_CLASS_LABEL = f"{KUEUE_KEY_PREFIX}priority-class"  # a WorkloadPriorityClass, as on any Kueue job
POD_GROUP_LABEL = f"{KUEUE_KEY_PREFIX}pod-group-name"
POD_GROUP_TOTAL_COUNT = f"{KUEUE_KEY_PREFIX}pod-group-total-count"
# "false": a group whose pods have all ended is finished. The operator never re-creates a pod inside a group (a
# restart is a new attempt, a new group), so Kueue can release the quota and the pods' finalizers at once.
RETRIABLE_IN_GROUP = f"{KUEUE_KEY_PREFIX}retriable-in-group"
# Topology-aware scheduling (TAS, beta and on by default since v0.14), read from the group's pods: the whole group
# within one domain of a level (required or preferred), or slices of a size each within one; the pod's index
# (its label named here) orders the pods into the domains, so consecutive node ranks share one.
REQUIRED_TOPOLOGY = f"{KUEUE_KEY_PREFIX}podset-required-topology"
PREFERRED_TOPOLOGY = f"{KUEUE_KEY_PREFIX}podset-preferred-topology"
SLICE_REQUIRED_TOPOLOGY = f"{KUEUE_KEY_PREFIX}podset-slice-required-topology"
SLICE_SIZE = f"{KUEUE_KEY_PREFIX}podset-slice-size"
POD_INDEX_LABEL = f"{KUEUE_KEY_PREFIX}pod-group-pod-index-label"
ADMISSION_GATE = f"{KUEUE_KEY_PREFIX}admission"  # the scheduling gate Kueue holds a pod with until admission
# The job labels carried to every pod (Kueue reads them there).
CARRIED_LABELS = (QUEUE_LABEL, PRIORITY_CLASS_LABEL)


def _job_labels(job: ParallelTrainJob) -> dict[str, Any]:
    return job.metadata.labels or {}


def queue_name(job: ParallelTrainJob) -> str | None:
    """The job's LocalQueue, or None when Kueue does not manage it."""
    return _job_labels(job).get(QUEUE_LABEL) or None


def pod_group(job_name: str, attempt: int) -> str:
    """One group per attempt: a restarted gang is a new Workload, queued afresh."""
    return f"{job_name}-{attempt}"


def probe_group(job_name: str, attempt: int) -> str:
    """An elastic gang's placeholder pods (paratrain_operator.resize) are a group of their own: Kueue admits them
    within the queue's quota like any pods, and they never join the gang's Workload."""
    return f"{job_name}-{attempt}-probe"


def probe_metadata(job: ParallelTrainJob, attempt: int, count: int) -> tuple[dict[str, str], dict[str, str]]:
    """The placeholder pods' Kueue labels and annotations (a group of `count`), or none when Kueue does not
    manage the job. The job's topology, as TAS places them: with ranksPerDomain, slices of a domain's size (the
    missing ranks are whole slices); without, the placeholders in one domain (not necessarily the running pods':
    TAS places a group alone). In no rank order: placeholders have no ranks."""
    if not queue_name(job):
        return {}, {}
    placed = {k: v for k, v in topology_annotations(job).items() if k != POD_INDEX_LABEL}
    return pod_labels(job, attempt) | {POD_GROUP_LABEL: probe_group(job.metadata.name, attempt)}, {
        POD_GROUP_TOTAL_COUNT: str(count), RETRIABLE_IN_GROUP: "false"} | placed


def pod_labels(job: ParallelTrainJob, attempt: int) -> dict[str, str]:
    if not queue_name(job):
        return {}
    labels = _job_labels(job)
    return {k: str(labels[k]) for k in CARRIED_LABELS if labels.get(k)} | {
        POD_GROUP_LABEL: pod_group(job.metadata.name, attempt)}


def pod_annotations(job: ParallelTrainJob) -> dict[str, str]:
    if not queue_name(job):
        return {}
    return {POD_GROUP_TOTAL_COUNT: str(job.spec.nodes), RETRIABLE_IN_GROUP: "false", **topology_annotations(job)}


def topology_annotations(job: ParallelTrainJob) -> dict[str, str]:
    """spec.scheduling.topology as Kueue's TAS reads it from the group's pods."""
    t = job.spec.scheduling.topology
    if not t:
        return {}
    if t.ranks_per_domain:  # Kueue's slices are required only (kueue_problems refuses preferred)
        placed = {SLICE_REQUIRED_TOPOLOGY: t.level, SLICE_SIZE: str(t.ranks_per_domain // job.spec.procs_per_node)}
    else:
        placed = {REQUIRED_TOPOLOGY if t.mode == "required" else PREFERRED_TOPOLOGY: t.level}
    return placed | {POD_INDEX_LABEL: LABEL_NODE_RANK}


def kueue_problems(job: ParallelTrainJob) -> list[tuple[str, str]]:
    """What Kueue cannot admit, as (field path, message)."""
    labels, out = _job_labels(job), []
    for key, kind in ((QUEUE_LABEL, "LocalQueue"), (PRIORITY_CLASS_LABEL, "WorkloadPriorityClass")):
        value = labels.get(key)
        if value is not None and not (isinstance(value, str) and len(value) <= 63 and re.match(DNS_SUBDOMAIN, value)):
            out.append((f"metadata.labels[{key}]", f"must name a Kueue {kind} (a lowercase DNS name of at most 63 "
                        f"characters), got {value!r}"))
    t = job.spec.scheduling.topology
    if queue_name(job) and t and t.ranks_per_domain and t.mode == "preferred":
        out.append(("spec.scheduling.topology.mode", "Kueue keeps groups of ranksPerDomain ranks in a domain only "
                    "as required (its slices): use mode required, or leave ranksPerDomain out to prefer one domain "
                    "for the whole gang"))
    if queue_name(job) and job.spec.scheduling.gang in QUEUED_GANGS:
        scheduler = {"volcano": "Volcano", "kai": "KAI"}[job.spec.scheduling.gang]
        out.append(("spec.scheduling.gang", f"Kueue admits this job (label {QUEUE_LABEL}) and {scheduler} would "
                    "queue it again: use one of them (Kueue composes with gang 'kubernetes', 'coscheduling' or "
                    "'none')"))
    return out
