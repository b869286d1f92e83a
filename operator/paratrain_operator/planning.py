"""parallelism mode auto in the operator: the layout a job's gang runs.

It is planned (paratrain.api.planner) when the gang is about to be created with no pod of the job left, on the
GPU the cluster's nodes then have, and recorded in status.plan before any pod exists (the status is written before
pods are created). While any pod of the job exists the recorded layout holds: a lost pod's replacement must run its
peers' layout. A gang created afresh (a restart, a resume) is planned again, so a job that comes back on other
nodes gets a layout for them; its checkpoint reshards into it.

The GPU comes from GPU Feature Discovery's node labels (nvidia.com/gpu.product, gpu.memory in MiB, gpu.count) of
the nodes the job may use (its nodeSelector, enough GPUs for procsPerNode); where they name several GPUs, the one
with the least memory, since the gang may land on any of them. Else the platform's planner.gpu. Link bandwidths
and the compute efficiency are the catalogue's, or the platform's planner profile's. Where the job is placed by a
topology level, the nodes' labels of that level say how many ranks one domain holds: for an NVLink-domain label
(GFD's nvidia.com/gpu.clique, Topograph's accelerator) the NVLink fabric tensor parallel may span, else the
boundary past which a group crosses the spine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from paratrain.api import ParallelTrainJob, Spec, hardware, planner
from paratrain.api.platform import Platform

GFD_PRODUCT = "nvidia.com/gpu.product"
GFD_MEMORY = "nvidia.com/gpu.memory"  # MiB
GFD_COUNT = "nvidia.com/gpu.count"
MiB = 2**20


def target_of(spec: Spec, node_labels: Sequence[Mapping[str, str]] | None, platform: Platform) -> planner.Target:
    """What a job is planned for, from the labels of the cluster's nodes (None: the operator may not list nodes);
    NoPlan where nothing says which GPU."""
    if not spec.resources.gpus_per_node:
        return planner.Target(hardware.CPU, "CPU pods (resources.gpusPerNode 0)")
    selector = spec.scheduling.node_selector
    usable = [labels for labels in node_labels or () if GFD_PRODUCT in labels
              and all(labels.get(k) == v for k, v in selector.items())
              and _int(labels.get(GFD_COUNT), spec.procs_per_node) >= spec.procs_per_node]
    found: dict[str, list[hardware.Accelerator]] = {}
    unknown: set[str] = set()
    for labels in usable:
        product = labels[GFD_PRODUCT]
        gpu = hardware.by_device_name(product, _int(labels.get(GFD_MEMORY), 0) * MiB or None)
        if gpu is None:
            unknown.add(product)
        else:
            found.setdefault(product, []).append(gpu)
    if found:
        product, gpus = min(found.items(), key=lambda kv: min(g.memory_bytes for g in kv[1]))
        gpu = min(gpus, key=lambda g: g.memory_bytes)
        also = f"; the least memory of {len(found)} GPU types the job may land on" if len(found) > 1 else ""
        gpu, domains = _with_domains(spec, platform.planner.calibrated(gpu), usable)
        return planner.Target(gpu, f"{len(gpus)} node(s) labelled {GFD_PRODUCT}={product}{also}{domains}",
                              gpu.memory_bytes)
    if platform.planner.gpu:
        why = (f"the nodes' {', '.join(sorted(unknown))} is not in the catalogue" if unknown else
               f"no node the job may use carries {GFD_PRODUCT}")
        return planner.Target(platform.planner.calibrated(hardware.accelerator(platform.planner.gpu)),
                              f"the platform's planner.gpu ({why})")
    where = ("the operator may not list nodes (a namespaced install)" if node_labels is None else
             f"nodes labelled {', '.join(sorted(unknown))}: not a GPU paratrain knows" if unknown else
             f"no node the job may use (spec.scheduling.nodeSelector, {spec.procs_per_node} GPUs or more) carries "
             f"GPU Feature Discovery's {GFD_PRODUCT} label")
    raise planner.NoPlan(f"mode auto cannot tell which GPU to plan for: {where}; the platform's planner.gpu (a Helm "
                         f"value) names it, one of {', '.join(hardware.BY_NAME)}")


def _with_domains(spec: Spec, gpu: hardware.Accelerator, usable: Sequence[Mapping[str, str]]
                  ) -> tuple[hardware.Accelerator, str]:
    """`gpu` with the size of the job's topology domains as the nodes' labels give it (the most ranks one domain of
    spec.scheduling.topology.level holds: an NVLink domain's for an NVLink-domain label, else the spine's
    boundary), and that in words ("" where the job has no topology or no node carries the label)."""
    topology = spec.scheduling.topology
    if topology is None:
        return gpu, ""
    nodes = Counter(labels[topology.level] for labels in usable if topology.level in labels)
    if not nodes:
        return gpu, ""
    ranks = max(nodes.values()) * spec.procs_per_node
    said = f"; {len(nodes)} {topology.level} domain(s), the largest {ranks} ranks"
    if topology.level in hardware.NVLINK_DOMAIN_LABELS:
        return replace(gpu, nvlink_gpus=ranks), said + " on one NVLink fabric"
    return replace(gpu, domain_gpus=ranks), said


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def recorded(job: ParallelTrainJob, plan: Mapping[str, Any]) -> ParallelTrainJob:
    """The job with the layout status.plan recorded (what its existing pods run)."""
    return job.model_copy(update={"spec": planner.with_layout(job.spec, plan["layout"])})


def plan_now(job: ParallelTrainJob, node_labels: Sequence[Mapping[str, str]] | None, platform: Platform,
             attempt: int) -> tuple[ParallelTrainJob, dict[str, Any]]:
    """The job with the layout planned now, and its status.plan; NoPlan where nothing fits or no GPU is known."""
    spec = job.spec
    target = target_of(spec, node_labels, platform)
    chosen, result = planner.planned(spec, planner.stated_vocab(spec), target)
    record = planner.record(result, target, spec.training.batch_size * spec.model.block_size, attempt)
    return job.model_copy(update={"spec": chosen}), record


def split_cost(spec: Spec, node_labels: Sequence[Mapping[str, str]] | None, platform: Platform) -> str:
    """What the planner predicts a gang split across topology domains costs, in words (or why it cannot say)."""
    try:
        target, vocab = target_of(spec, node_labels, platform), planner.stated_vocab(spec)
    except planner.NoPlan as exc:
        return f"no cost predicted: {exc}"
    cross, whence = platform.planner.cross_domain(target.accelerator)
    base, more = planner.cross_domain_seconds(spec, vocab, platform.planner.calibrated(target.accelerator),
                                              spec.procs_per_node, cross)
    network = platform.planner.calibrated(target.accelerator).network_bytes_per_second
    return (f"the planner predicts {more:.3g} s more a step ({base:.3g} → {base + more:.3g} s on "
            f"{target.accelerator.name}), its inter-node traffic crossing domains at {cross / 1e9:.3g} GB/s "
            f"({whence}) instead of {network / 1e9:.3g} GB/s")
