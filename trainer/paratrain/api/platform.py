"""What a platform team decides for every job the operator runs: which host access pods may ask for, the
NetworkPolicy each gang gets, and defaults for the jobs' cluster fields (image, env, placement, resources).

The operator reads it from `--platform FILE` (the Helm chart writes that file from its `platform` values);
`paratrain validate` and `paratrain render` take the same `--platform FILE`. Without one: the defaults below,
the restricted Pod Security profile's answer (no host access) and a NetworkPolicy per gang.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator

from .. import contract
from . import elastic
from .hardware import Accelerator, accelerator
from .kueue import kueue_problems
from .load import Problem, SpecError, parse_job
from .memory import CHECKPOINT_BYTES_PER_PARAMETER, SAVE_FIXED_SECONDS, human, parse_bytes, stop_save_seconds
from .spec import (
    BYTES, DNS_LABEL, DNS_SUBDOMAIN, IMAGE, QUANTITY, QUEUED_GANGS, EnvVar, ExtendedResource, LabelKey, LabelValue,
    ResourcesSpec, ParallelTrainJob, SchedulingSpec, Spec, Toleration, TopologySpec, _Model, cluster_problems,
    stated_vocab_size,
)

# The operator's pods as the Helm chart labels them (release `paratrain`, chart name `paratrain`).
CHART_OPERATOR_LABELS = {"app.kubernetes.io/name": "paratrain", "app.kubernetes.io/instance": "paratrain",
                         "app.kubernetes.io/component": "operator"}


class GangNetworkPolicy(_Model):
    enabled: bool = Field(True, description=(
        "Give every gang a NetworkPolicy: traffic between its own pods allowed, the operator's pods allowed to "
        "the progress port, all other ingress denied."))
    operator_namespace: str = Field("paratrain-system", pattern=DNS_LABEL, max_length=63, description=(
        "The namespace the operator's pods run in."))
    operator_labels: dict[LabelKey, LabelValue] = Field(
        default_factory=lambda: dict(CHART_OPERATOR_LABELS), min_length=1, max_length=16,
        description="Labels that select the operator's pods there.")


class DefaultResources(_Model):
    cpu: str | None = Field(None, pattern=QUANTITY, max_length=32)
    memory: str | None = Field(None, pattern=QUANTITY, max_length=32)
    shm_size: str | None = Field(None, pattern=QUANTITY, max_length=32)
    gpu_resource: ExtendedResource | None = None
    gpu_memory_reserve: str | None = Field(None, pattern=BYTES, max_length=32)
    gpu_memory_fragmentation: float | None = Field(None, ge=0, le=0.5)
    extra: dict[ExtendedResource, Annotated[int, Field(ge=1, le=1024)]] = Field(default_factory=dict, max_length=16)


class DefaultScheduling(_Model):
    gang: Literal["kubernetes", "volcano", "kai", "coscheduling"] | None = None
    queue: str | None = Field(None, pattern=DNS_LABEL, max_length=63)
    priority_class_name: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253)
    topology: TopologySpec | None = Field(None, description=(
        "The cluster's placement for jobs that give none, e.g. {level: <the rack label>, mode: preferred}."))


class JobDefaults(_Model):
    """What every job that leaves a field at its built-in default gets instead (a job's own value always wins):
    a scalar at its built-in default takes the platform's; env, tolerations, nodeSelector and resources.extra
    gain the platform's entries the job does not name."""

    image: str | None = Field(None, pattern=IMAGE, max_length=512, description="The trainer image.")
    env: list[EnvVar] = Field(default_factory=list, max_length=256)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    node_selector: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=64)
    resources: DefaultResources = Field(default_factory=DefaultResources)
    scheduling: DefaultScheduling = Field(default_factory=DefaultScheduling)


# A namespace name, or a glob pattern of them (team-rdma-*).
NamespacePattern = Annotated[str, Field(pattern=r"^[a-z0-9*?\[\]-]{1,63}$")]
HostAccess = bool | Annotated[list[NamespacePattern], Field(max_length=256)]
HOST_ACCESS_MEANING = ("false: no job; true: jobs in every namespace; a list: jobs in these namespaces only "
                       "(names or glob patterns such as team-rdma-*).")


class PlannerProfile(_Model):
    """What `parallelism: auto` plans for where the nodes do not say it (the operator reads GPU Feature Discovery's
    nvidia.com/gpu.product, gpu.memory and gpu.count labels first), and what the catalogue's defaults
    (paratrain.api.hardware) get wrong on this cluster: its links, and the compute efficiency measured on it."""

    gpu: str | None = Field(None, max_length=64, description=(
        "The GPU jobs are planned for where no node the job may use carries GPU Feature Discovery's labels (or the "
        "operator may not list nodes: a namespaced install), by its catalogue name, e.g. H100-80GB."))
    node_bandwidth: str | None = Field(None, pattern=BYTES, max_length=32, description=(
        "Bytes a second one GPU sends to another in its node, each way (NVLink, else PCIe), e.g. 450G; unset: the "
        "catalogue's figure for the GPU."))
    network_bandwidth: str | None = Field(None, pattern=BYTES, max_length=32, description=(
        "Bytes a second one GPU sends across nodes, each way: the node's NICs divided by its GPUs, e.g. 50G for "
        "8 x 400 Gb/s and 8 GPUs; unset: the catalogue's figure."))

    @field_validator("gpu")
    @classmethod
    def _known(cls, name: str | None) -> str | None:
        return None if name is None else accelerator(name).name

    cross_domain_bandwidth: str | None = Field(None, pattern=BYTES, max_length=32, description=(
        "Bytes a second one GPU sends to a GPU in another domain of a job's spec.scheduling.topology.level (across "
        "the spine), each way, e.g. 25G under a 2:1 oversubscribed spine; what the operator prices a gang split "
        "across domains at. Unset: half the network bandwidth (2:1)."))

    compute_efficiency: float | None = Field(None, gt=0, le=1, description=(
        "The fraction of the GPU's dense peak FLOP/s a training step's matmuls reach on this cluster, as "
        "bench/gpu.sh measured it (it prints the value to set here); what the planner's compute time is priced at. "
        "Unset: 0.4, an uncalibrated prior."))

    def calibrated(self, gpu: Accelerator) -> Accelerator:
        """`gpu` with this cluster's link bandwidths and compute efficiency where the profile states them."""
        changes = {k: float(parse_bytes(v)) for k, v in (("node_bytes_per_second", self.node_bandwidth),
                                                         ("network_bytes_per_second", self.network_bandwidth),
                                                         ("cross_domain_bytes_per_second", self.cross_domain_bandwidth))
                   if v}
        if self.compute_efficiency:
            changes["compute_efficiency"] = self.compute_efficiency
        return replace(gpu, **changes)

    def cross_domain(self, gpu: Accelerator) -> tuple[float, str]:
        """Bytes a second across topology domains for `gpu` (its links as this profile states them), and whence."""
        if self.cross_domain_bandwidth:
            return self.calibrated(gpu).cross_domain, "the platform's planner.crossDomainBandwidth"
        return self.calibrated(gpu).cross_domain, "half the network bandwidth (a 2:1 spine; the platform's " \
            "planner.crossDomainBandwidth states yours)"


class Platform(_Model):
    allow_ipc_lock: HostAccess = Field(False, description=(
        "Jobs may add the IPC_LOCK capability (spec.pod.ipcLock), which GPUDirect RDMA needs to pin memory. "
        + HOST_ACCESS_MEANING))
    allow_host_network: HostAccess = Field(False, description=(
        "Jobs may use the node's network namespace (spec.pod.hostNetwork), for RDMA fabrics without a CNI; "
        "NetworkPolicy does not apply to such pods, so their rendezvous, progress and NCCL/gloo ports are open to "
        "whatever reaches the node. " + HOST_ACCESS_MEANING))
    network_policy: GangNetworkPolicy = Field(default_factory=GangNetworkPolicy)
    job_defaults: JobDefaults = Field(default_factory=JobDefaults)
    max_nodes: int | None = Field(None, ge=1, le=4096, description=(
        "The most pods one job may ask for (spec.nodes); unset: the CRD's own limit, 4096."))
    max_jobs_per_namespace: int | None = Field(None, ge=1, le=100000, description=(
        "The most unfinished jobs the operator starts in one namespace: a job past it (counting the jobs already "
        "started, then the waiting ones by creation) waits, Pending with reason NamespaceJobLimit, and starts when "
        "one of them finishes or is suspended; a started job is never stopped by it. Unset: no limit."))
    max_gang_bytes: str = Field("64Mi", pattern=BYTES, max_length=32, description=(
        "The most a job's gang may weigh in the operator's memory, estimated as spec.nodes times the size of its "
        "spec (each pod carries the spec's env, annotations and volumes): 1,024 pods with 240 KB of annotations "
        "peaked at 266 MiB, against the operator's 512 Mi limit."))
    max_spec_bytes: str = Field("64Ki", pattern=BYTES, max_length=32, description=(
        "The most one job's spec may weigh (its JSON). The operator keeps every job's spec in memory, suspended "
        "and finished ones too; a larger spec is refused and not kept. Beyond about 100 KiB a job breaks before "
        "it reaches the operator anyway: kubectl apply and the operator's handler state each copy the spec into "
        "the job's annotations, which may hold 256 KiB in all."))
    checkpoint_bandwidth: str = Field("512Mi", pattern=BYTES, max_length=32, description=(
        "Bytes per second one node writes, then hashes, a checkpoint at on the storage jobs checkpoint to. A "
        "stopped gang must save within spec.pod.terminationGracePeriodSeconds; jobs whose estimated save takes "
        "longer are refused."))
    volcano_tiers: dict[LabelKey, Annotated[int, Field(ge=1, le=16)]] = Field(
        default_factory=dict, max_length=16, description=(
            "The tier of Volcano's HyperNodes that each node label stands for, e.g. {<the rack label>: 1, <the "
            "block label>: 2}, as the cluster's HyperNodes (or Volcano's label-based discovery) define them. A job "
            "with gang volcano whose spec.scheduling.topology.level is listed gets Volcano's own network topology "
            "on its PodGroup: the whole gang within one HyperNode of that tier (required: hard, preferred: soft), "
            "or with ranksPerDomain each group of ranks (a subGroupPolicy); its pods keep their pod affinity. "
            "Unset: pod affinity alone."))
    kai_topology: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253, description=(
        "The name of KAI Scheduler's Topology resource (kai.scheduler/v1alpha1) whose levels are the node labels "
        "jobs name in spec.scheduling.topology.level. A job with gang kai and a topology gets KAI's own "
        "placement on its PodGroup: a topologyConstraint (required or preferred) for the whole gang, or with "
        "ranksPerDomain one for each subgroup of ranks; its pods keep their pod affinity. Unset: pod affinity "
        "alone."))
    planner: PlannerProfile = Field(default_factory=PlannerProfile, description=(
        "What parallelism mode auto plans for where the nodes' labels do not say it, and this cluster's links and "
        "measured compute efficiency."))


def with_job_defaults(job: ParallelTrainJob, platform: Platform) -> tuple[ParallelTrainJob, list[str]]:
    """The job with the platform's jobDefaults merged in (validated again, cross-field rules included), and the
    fields they filled (e.g. `spec.image`). Raises SpecError where the merged job is invalid."""
    spec, filled = _merged_spec(job.spec, platform.job_defaults)
    if not filled:
        return job, []
    try:
        return parse_job({**job.dump(), "spec": spec}), filled
    except SpecError as exc:
        why = f" (after the platform's jobDefaults filled {', '.join(filled)})"
        raise SpecError([Problem(p.path, p.message + why) for p in exc.problems]) from None


def as_the_operator_takes_it(job: ParallelTrainJob, platform: Platform) -> tuple[ParallelTrainJob, list[str]]:
    """The job the operator renders (jobDefaults merged in) and the fields the defaults filled; SpecError for what
    the operator refuses (require_cluster_ready)."""
    merged, filled = with_job_defaults(job, platform)
    return require_cluster_ready(merged, platform), filled


def require_cluster_ready(job: ParallelTrainJob, platform: Platform | None = None) -> ParallelTrainJob:
    """Raise SpecError for what a valid job cannot do in pods (e.g. a relative checkpoint path), or may not do on
    this platform (host access it does not allow; default: the restricted profile's answer), or Kueue cannot admit."""
    resizing = [("spec.elastic.minNodes", said)] if (said := elastic.problem(job.spec)) else []
    checks = (cluster_problems(job.spec) + platform_problems(job.spec, platform or Platform(), job.metadata.namespace)
              + kueue_problems(job) + resizing)
    problems = [Problem(path, msg) for path, msg in checks]
    if problems:
        raise SpecError(problems)
    return job


def _merged_spec(spec: Spec, defaults: JobDefaults) -> tuple[dict[str, Any], list[str]]:
    doc, filled = spec.dump(), []

    def take(path: str, section: dict[str, Any], key: str, builtin: Any, value: Any) -> None:
        if value is not None and section.get(key, builtin) == builtin and value != builtin:
            section[key] = value
            filled.append(path)

    take("spec.image", doc, "image", Spec.model_fields["image"].default, defaults.image)
    res, sched, pod = doc["resources"], doc["scheduling"], doc["pod"]
    for field in ("cpu", "memory", "shm_size", "gpu_resource", "gpu_memory_reserve", "gpu_memory_fragmentation"):
        alias = ResourcesSpec.model_fields[field].alias
        take(f"spec.resources.{alias}", res, alias, ResourcesSpec.model_fields[field].default,
             getattr(defaults.resources, field))
    take("spec.scheduling.gang", sched, "gang", SchedulingSpec.model_fields["gang"].default, defaults.scheduling.gang)
    if sched.get("gang") in QUEUED_GANGS:  # a queue is Volcano's or KAI's
        take("spec.scheduling.queue", sched, "queue", None, defaults.scheduling.queue)
    take("spec.scheduling.priorityClassName", sched, "priorityClassName", None,
         defaults.scheduling.priority_class_name)
    take("spec.scheduling.topology", sched, "topology", None,
         defaults.scheduling.topology.dump() if defaults.scheduling.topology else None)
    for path, mine, theirs in (("spec.resources.extra", res.setdefault("extra", {}), defaults.resources.extra),
                               ("spec.scheduling.nodeSelector", sched.setdefault("nodeSelector", {}),
                                defaults.node_selector)):
        if added := {k: v for k, v in theirs.items() if k not in mine}:
            mine.update(added)
            filled.append(path)
    names = {e["name"] for e in pod.get("env", [])}
    if env := [e.dump() for e in defaults.env if e.name not in names]:
        pod["env"] = env + pod.get("env", [])  # the job's own come last, as in the pod
        filled.append("spec.pod.env")
    tolerations = sched.setdefault("tolerations", [])
    if added := [t.dump() for t in defaults.tolerations if t.dump() not in tolerations]:
        tolerations.extend(added)
        filled.append("spec.scheduling.tolerations")
    return doc, filled


def load_platform(path: str | Path) -> Platform:
    """The platform file, or SpecError naming what is wrong with it."""
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
        return Platform.model_validate(doc)
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError([Problem(str(path), f"cannot read the platform file: {exc}")]) from None
    except ValidationError as exc:
        raise SpecError([Problem(f"{path}: " + ".".join(map(str, e["loc"])), e["msg"]) for e in exc.errors()]) from None


def spec_size_problem(size: int, platform: Platform) -> str | None:
    """Why a spec of `size` bytes of JSON is refused, or None."""
    limit = parse_bytes(platform.max_spec_bytes)
    if size <= limit:
        return None
    return (f"the spec is {human(size)} of JSON, more than the platform's maxSpecBytes ({human(limit)}): the "
            "operator keeps every job's spec in memory; move large env values and files to a ConfigMap or a volume")


def spec_bytes(spec: Mapping[str, Any]) -> int:
    """A spec's weight: the size of its compact JSON (what maxSpecBytes and maxGangBytes measure)."""
    return len(json.dumps(spec, separators=(",", ":"), default=str))


def allowed_in(rule: bool | list[str], namespace: str) -> bool:
    """Whether a host-access rule of the platform (see HOST_ACCESS_MEANING) admits a job of `namespace`."""
    return rule if isinstance(rule, bool) else any(fnmatch.fnmatchcase(namespace, p) for p in rule)


def platform_problems(spec: Spec, platform: Platform, namespace: str | None = None) -> list[tuple[str, str]]:
    """Host access the job asks for and the platform does not allow in its namespace (none given: `default`, where
    kubectl would create it), and a grace period too short for a stopped gang to save its step on the platform's
    storage, as (field path, message)."""
    out = []
    namespace = namespace or "default"
    if platform.max_nodes is not None and spec.nodes > platform.max_nodes:
        out.append(("spec.nodes", f"{spec.nodes} pods is more than the platform allows a job (the operator's "
                                  f"platform.maxNodes, {platform.max_nodes})"))
    size = spec_bytes(spec.dump())
    if problem := spec_size_problem(size, platform):
        out.append(("spec", problem))
    # What the operator holds per gang it renders: every pod carries the spec's env, annotations and volumes.
    if (gang := spec.nodes * size) > (limit := parse_bytes(platform.max_gang_bytes)):
        out.append(("spec", f"the gang would weigh about {human(gang)} in the operator ({spec.nodes} pods, each "
                            f"carrying the spec's {human(gang // spec.nodes)}), more than the platform's "
                            f"maxGangBytes ({human(limit)}): make spec.pod's env and annotations smaller, or use "
                            "fewer nodes"))
    if problem := grace_problem(spec, platform):
        out.append(("spec.pod.terminationGracePeriodSeconds", problem))
    for asked, rule, path, what, value in (
            (spec.pod.ipc_lock, platform.allow_ipc_lock, "spec.pod.ipcLock", "the IPC_LOCK capability",
             "allowIpcLock"),
            (spec.pod.host_network, platform.allow_host_network, "spec.pod.hostNetwork", "host networking",
             "allowHostNetwork")):
        if asked and not allowed_in(rule, namespace):
            where = "" if isinstance(rule, bool) else f" in namespace {namespace!r} (it allows {', '.join(rule)})"
            out.append((path, f"the platform does not allow {what}{where} (the operator's platform.{value}, a "
                              "Helm value)"))
    return out


def grace_problem(spec: Spec, platform: Platform) -> str | None:
    """Why a stopped gang of the built-in trainer cannot save its step within its grace period (None if it can,
    or if it saves nothing)."""
    if not spec.checkpoint.path:  # nothing is saved (a program of its own has no checkpoint section either)
        return None
    # Without a stated vocabulary (text or token data) the embedding is left out: the estimate is then a floor.
    vocab = stated_vocab_size(spec) or 0
    bandwidth = parse_bytes(platform.checkpoint_bandwidth)
    seconds, per_node = stop_save_seconds(spec, vocab, bandwidth)
    budget = spec.pod.termination_grace_period_seconds - contract.STOP_MARGIN_SECONDS
    if seconds <= budget:
        return None
    need = math.ceil(seconds) + contract.STOP_MARGIN_SECONDS
    return (f"a stopped gang saves its step within the grace period less {contract.STOP_MARGIN_SECONDS} s, and this "
            f"job's save is estimated at {seconds:.0f} s ({human(per_node)} per node: "
            f"{CHECKPOINT_BYTES_PER_PARAMETER} bytes per parameter, "
            f"weights and AdamW's moments, over {spec.nodes} node(s), at the platform's checkpointBandwidth of "
            f"{human(bandwidth)}/s per node, plus {SAVE_FIXED_SECONDS} s): set it to at least {need}")
