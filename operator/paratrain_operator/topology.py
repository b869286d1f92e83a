"""spec.scheduling.topology rendered for the gang's scheduler: what each one can say, and pod affinity by domain
for the rest.

- Kueue (the job carries a queue label): its topology-aware scheduling reads the pod group's annotations
  (paratrain.api.kueue.topology_annotations) and fills domains in node-rank order.
- gang 'kubernetes': the PodGroup's (and Workload template's) topology constraint keeps the whole gang in one
  domain; it is required only and has no groups, so `preferred` and `ranksPerDomain` fall back to affinity.
- every other gang (none, volcano, kai, coscheduling): pod affinity. Each pod is labelled with its group (node rank
  // nodes per domain; one group without ranksPerDomain) and asks to share a domain of `level` with the pods of its
  group in its attempt, required or preferred. The first pod of a group matches itself, so it may go anywhere;
  the rest follow it. Under Volcano, where the platform's volcanoTiers names the level's HyperNode tier, its
  PodGroup also carries Volcano's own network topology (volcano_placement); under KAI, where the platform names
  KAI's Topology resource, its PodGroup carries KAI's topology constraints, per subgroup of ranks with
  ranksPerDomain (kai_placement).
- an elastic gang's placeholders (probe_placement): pod affinity for the domain the grown gang needs them in, or
  under Kueue its TAS annotations on their own group.
"""

from __future__ import annotations

import collections
import copy
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from paratrain import contract
from paratrain.api import ParallelTrainJob, kueue

GROUP_LABEL = "paratrain.dev/topology-group"


def group_constraint(job: ParallelTrainJob) -> str | None:
    """The level a native PodGroup keeps the whole gang within; None where it cannot say the job's request."""
    t, gang = job.spec.scheduling.topology, job.spec.scheduling.gang
    if t and gang == "kubernetes" and t.mode == "required" and not t.ranks_per_domain and not kueue.queue_name(job):
        return t.level
    return None


def volcano_placement(job: ParallelTrainJob, tiers: Mapping[str, int]) -> dict[str, Any]:
    """Volcano's own placement (its PodGroup's spec) for spec.scheduling.topology, where the platform's
    volcanoTiers names the HyperNode tier of the level: the whole gang within one HyperNode of that tier
    (`networkTopology`, hard for required, soft for preferred) or, with ranksPerDomain, each group of ranks (a
    `subGroupPolicy` keyed by the pods' group and attempt labels; hard only, as Volcano takes no soft constraint
    on subgroups). {} where Volcano cannot say it: the pods' affinity still does."""
    t = job.spec.scheduling.topology
    if not t or job.spec.scheduling.gang != "volcano" or t.level not in tiers:
        return {}
    hard = {"mode": "hard", "highestTierAllowed": tiers[t.level]}
    if not t.ranks_per_domain:
        return {"networkTopology": hard if t.mode == "required" else {"mode": "soft"}}
    if t.mode != "required":
        return {}
    return {"subGroupPolicy": [{
        "name": "domain", "subGroupSize": t.ranks_per_domain // job.spec.procs_per_node,
        "labelSelector": {"matchLabels": {contract.LABEL_JOB: job.metadata.name}},
        "matchLabelKeys": [GROUP_LABEL, contract.LABEL_ATTEMPT], "networkTopology": hard}]}


def kai_placement(job: ParallelTrainJob, topology_name: str | None) -> dict[str, Any]:
    """KAI's PodGroup spec for the gang's shape and placement: with ranksPerDomain one subgroup of pods per group of
    ranks (kai_subgroup names each pod's), all required (minSubGroup); else the whole gang (minMember). Where the
    platform names KAI's Topology resource (`topology_name`), each subgroup, or the gang, gets a topologyConstraint
    at `level`, required or preferred (KAI takes both, on subgroups too); else the pods' affinity alone says it."""
    t = job.spec.scheduling.topology
    constraint = {"topologyConstraint": {"topology": topology_name, f"{t.mode}TopologyLevel": t.level}} \
        if t and topology_name else {}
    if not t or not t.ranks_per_domain:
        return {"minMember": job.spec.nodes, **constraint}
    per = group_size(job)
    groups = job.spec.nodes // per
    return {"minSubGroup": groups,
            "subGroups": [{"name": f"group-{g}", "minMember": per, **constraint} for g in range(groups)]}


def kai_subgroup(job: ParallelTrainJob, rank: int) -> str | None:
    """The KAI subgroup of node rank `rank` (kai_placement's), or None where the gang is one group."""
    t = job.spec.scheduling.topology
    return f"group-{rank // group_size(job)}" if t and t.ranks_per_domain else None


def nodes_per_group(job: ParallelTrainJob) -> int | None:
    """Pods per affinity group where pod affinity places the job; None where its scheduler does (or no topology)."""
    t = job.spec.scheduling.topology
    if not t or kueue.queue_name(job) or group_constraint(job):
        return None
    return t.ranks_per_domain // job.spec.procs_per_node if t.ranks_per_domain else job.spec.nodes


def group_labels(job: ParallelTrainJob, rank: int) -> dict[str, str]:
    per = nodes_per_group(job)
    return {GROUP_LABEL: str(rank // per)} if per else {}


def affinity(job: ParallelTrainJob, attempt: int, rank: int) -> dict[str, Any] | None:
    """The pod's affinity: the spec's (scheduling.affinity, copied), with its group's pod affinity added."""
    per = nodes_per_group(job)
    if not per:
        return _own_affinity(job)
    return _sharing_a_domain(job, {contract.LABEL_JOB: job.metadata.name, contract.LABEL_ATTEMPT: str(attempt),
                                   GROUP_LABEL: str(rank // per)})


def probe_placement(job: ParallelTrainJob, attempt: int, rank: int) -> tuple[dict[str, str], dict[str, Any] | None]:
    """A placeholder's (render.probe_pods) labels and affinity, for node rank `rank` of a grown gang attempt
    `attempt`'s pods run smaller: the domain the grown gang needs it in, whatever scheduler places the gang
    (placeholders are placed alone, by the default scheduler). With ranksPerDomain the missing ranks are whole
    groups (a legal size is a multiple of one, and the running pods' groups come first): each shares a domain with
    its group's other placeholders; without, the whole gang is one group: it shares the running pods' domain.
    Under Kueue none: TAS annotations on the placeholders' own group say it (kueue.probe_metadata)."""
    t = job.spec.scheduling.topology
    if not t or kueue.queue_name(job):
        return {}, _own_affinity(job)
    match = {contract.LABEL_JOB: job.metadata.name, contract.LABEL_ATTEMPT: str(attempt)}
    if not t.ranks_per_domain:
        return {}, _sharing_a_domain(job, match)
    group = {GROUP_LABEL: str(rank // (t.ranks_per_domain // job.spec.procs_per_node))}
    return group, _sharing_a_domain(job, match | group)


def _own_affinity(job: ParallelTrainJob) -> dict[str, Any] | None:
    """The spec's scheduling.affinity, copied (each pod gets terms of its own added)."""
    return copy.deepcopy(job.spec.scheduling.affinity) if job.spec.scheduling.affinity else None


def _sharing_a_domain(job: ParallelTrainJob, match: dict[str, str]) -> dict[str, Any]:
    """The spec's affinity (copied) with a pod affinity term: a domain of topology.level shared with the pods
    matching `match`, required or preferred."""
    t = job.spec.scheduling.topology
    own = _own_affinity(job) or {}
    term = {"labelSelector": {"matchLabels": match}, "topologyKey": t.level}
    pod_affinity = own.setdefault("podAffinity", {})
    if t.mode == "required":
        pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
    else:
        pod_affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
            {"weight": 100, "podAffinityTerm": term})
    return own


def group_size(job: ParallelTrainJob) -> int:
    """Pods kept in one domain: ranksPerDomain's, else the whole gang."""
    t = job.spec.scheduling.topology
    return t.ranks_per_domain // job.spec.procs_per_node if t and t.ranks_per_domain else job.spec.nodes


def ranges(ranks: Iterable[int], limit: int = 256) -> str:
    """`0-3,8,10-11`: sorted ranks as ranges, cut to `limit` characters (…)."""
    out: list[str] = []
    for _, run in itertools.groupby(enumerate(sorted(ranks)), key=lambda item: item[1] - item[0]):
        values = [rank for _, rank in run]
        out.append(f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0]))
    text = ",".join(out)
    return text if len(text) <= limit else text[:limit - 1] + "…"


@dataclass(frozen=True)
class Outlier:
    """A node rank placed outside its group's domain (the one most of its group's pods are in)."""

    rank: int
    pod: str
    node: str
    domain: str
    group_domain: str
    group: tuple[int, int]  # its group's first and last node rank


def placement(job: ParallelTrainJob, attempt: int, nodes: Mapping[int, tuple[str, str]],
              domains: Mapping[str, str]) -> tuple[dict[str, Any], list[Outlier]]:
    """status.placement for gang attempt `attempt`, whose node ranks run on `nodes` (rank → (pod, node)), from the
    domain of each node (`domains`: node → its `level` label; a node without one is in domain ""), and the
    ranks outside their group's domain."""
    level = job.spec.scheduling.topology.level if job.spec.scheduling.topology else ""
    per, by_domain, outliers = group_size(job), {}, []
    domain_of = {rank: domains.get(node, "") for rank, (_, node) in nodes.items()}
    for rank, domain in domain_of.items():
        by_domain.setdefault(domain, []).append(rank)
    split = 0
    for first in range(0, job.spec.nodes, per):
        group = [r for r in range(first, first + per) if r in domain_of]
        counts = collections.Counter(domain_of[r] for r in group)
        if len(counts) <= 1:
            continue
        split += 1
        main = max(counts, key=lambda d: (counts[d], -min(r for r in group if domain_of[r] == d)))
        outliers += [Outlier(r, nodes[r][0], nodes[r][1], domain_of[r], main, (first, first + per - 1))
                     for r in group if domain_of[r] != main]
    listed = sorted(by_domain.items(), key=lambda item: min(item[1]))[:32]
    return {"attempt": attempt, "level": level, "splitGroups": split,
            "domains": [{"domain": domain, "nodeRanks": ranges(ranks)} for domain, ranks in listed]}, outliers
