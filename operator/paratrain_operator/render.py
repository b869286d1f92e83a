"""Rendering, pure: a job → the Kubernetes objects of one gang attempt (ConfigMap, Service, PodGroup, Pods).

The objects come from the jinja2 templates beside this module. Every value reaches a template as data and
leaves it through `|tojson` (a JSON scalar or flow collection is valid YAML), so no user string can become YAML
structure; each template renders exactly one object, parsed back into a dict. `spec.runPolicy.suspend` is not
read here: a suspended job is simply one whose pods the operator does not create.

    paratrain render JOB.yaml [--namespace NS] [--attempt N]
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import jinja2
import yaml

from paratrain import contract
from paratrain.api import ParallelTrainJob, kueue
from paratrain.api.platform import GangNetworkPolicy, Platform
from paratrain.api.spec import RESERVED_VOLUME_PREFIX, TRAINER_CONTAINER, ResourcesSpec, Spec, Volume

from . import topology
from .plan import (COSCHEDULING_GROUP_LABEL, KAI_SUBGROUP_LABEL, WORKLOAD_TEMPLATE, GangPlan, NodePlan, container_env,
                   plan_gang)

TRAINER_UID = 1000  # the trainer images run as this non-root user
SHM_DIR = "/dev/shm"
TMP_DIR = "/tmp"  # writable scratch under a read-only root filesystem
# Every container's: the restricted Pod Security profile.
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}}
PORTS = [{"name": "rendezvous", "port": contract.MASTER_PORT}, {"name": "progress", "port": contract.PROGRESS_PORT}]

# Characters YAML reads as line breaks, or refuses raw (C1 controls, BOM): escaped as \uXXXX.
_YAML_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ufeff]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def to_json(value: Any) -> str:
    """JSON that a YAML parser reads back as exactly `value`.

    Other non-ASCII characters stay as they are: a \\u-escaped surrogate pair (json's ensure_ascii form of an
    emoji) would come back from PyYAML as two broken characters. A lone surrogate (not a character; only an
    escape in the job's YAML makes one) becomes U+FFFD, as the API server's JSON decoder would store it."""
    text = _LONE_SURROGATE.sub("\ufffd", json.dumps(value, ensure_ascii=False))
    return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class _Dumper(yaml.SafeDumper):
    """Readable and exact YAML: multi-line strings as literal blocks (PyYAML quotes any a block cannot hold), and
    NEL / LS / PS double-quoted, because PyYAML writes them raw in other styles and reads them back as breaks."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = '"' if re.search("[\x85\u2028\u2029]", text) else "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _represent_str)


def to_yaml_stream(objects: list[dict[str, Any]]) -> str:
    """The objects as one YAML stream (what `paratrain render` prints)."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, allow_unicode=True)


_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("paratrain_operator", "templates"), undefined=jinja2.StrictUndefined,
    autoescape=False, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
    auto_reload=False)  # templates ship with the package: no stat of the file per pod
_TEMPLATES.filters["tojson"] = to_json  # replaces jinja2's HTML-escaping tojson


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, when PyYAML has it: ten times faster


def _render(template: str, **values: Any) -> dict[str, Any]:
    text = _TEMPLATES.get_template(template).render(**values)
    docs = [d for d in yaml.load_all(text, Loader=_LOADER) if d is not None]
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise RuntimeError(f"{template} rendered {len(docs)} documents, expected one object")
    return docs[0]


def metadata(plan: GangPlan, name: str, labels: dict[str, str],
             annotations: dict[str, str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "namespace": plan.namespace, "labels": labels}
    if annotations:
        out["annotations"] = annotations
    if plan.owner:
        out["ownerReferences"] = [plan.owner]
    return out


def job_yaml(job: ParallelTrainJob, namespace: str) -> str:
    """The job as the trainer reads it: defaults filled in, cluster bookkeeping (uid, status) left out."""
    doc = {"apiVersion": job.api_version, "kind": job.kind,
           "metadata": {"name": job.metadata.name, "namespace": namespace}, "spec": job.spec.dump()}
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, allow_unicode=True)


def config_map(plan: GangPlan, job: ParallelTrainJob) -> dict[str, Any]:
    return _render("configmap.yaml.j2", metadata=metadata(plan, plan.config_map, plan.labels),
                   file_name=contract.SPEC_FILE_NAME, job_yaml=job_yaml(job, plan.namespace))


def service(plan: GangPlan) -> dict[str, Any]:
    ports = [{**p, "targetPort": p["port"], "protocol": "TCP"} for p in PORTS]
    return _render("service.yaml.j2", metadata=metadata(plan, plan.service, plan.labels),
                   selector={contract.LABEL_JOB: plan.job_name}, ports=ports)


def pod_group(plan: GangPlan, spec: Spec, placement: dict[str, Any] | None = None) -> dict[str, Any]:
    """The gang scheduler's PodGroup; `placement`: Volcano's network topology (topology.volcano_placement), KAI's
    shape and topology (topology.kai_placement)."""
    assert plan.pod_group
    return _render(f"podgroup-{plan.gang}.yaml.j2", metadata=metadata(plan, plan.pod_group, plan.labels),
                   min_member=spec.nodes, scheduling=spec.scheduling, workload=plan.job_name,
                   group_template=WORKLOAD_TEMPLATE, group_topology=plan.group_topology, placement=placement or {})


def workload(plan: GangPlan, spec: Spec) -> dict[str, Any]:
    """The native gang's Workload: the job's one pod-group template, all `nodes` pods or none."""
    return _render("workload.yaml.j2", metadata=metadata(plan, plan.job_name, plan.labels), min_member=spec.nodes,
                   group_template=WORKLOAD_TEMPLATE, scheduling=spec.scheduling, group_topology=plan.group_topology)


def network_policy(plan: GangPlan, settings: GangNetworkPolicy) -> dict[str, Any]:
    """The gang's ingress under a namespace that denies by default (see the template)."""
    return _render("networkpolicy.yaml.j2", metadata=metadata(plan, plan.job_name, plan.labels),
                   gang_selector={contract.LABEL_JOB: plan.job_name}, settings=settings,
                   progress_port=contract.PROGRESS_PORT)


def resources(r: ResourcesSpec) -> dict[str, Any]:
    """Requests = limits (Guaranteed QoS: a training pod is never the first one evicted or CPU-throttled for
    others). The memory limit also covers /dev/shm, a memory-backed emptyDir. Device-plugin resources cannot be
    overcommitted: their requests default to the limits."""
    amounts = {"cpu": r.cpu, "memory": r.memory}
    limits = dict(amounts)
    if r.gpus_per_node and not any(c.provides_gpus for c in r.claims):
        limits[r.gpu_resource] = str(r.gpus_per_node)
    limits |= {name: str(count) for name, count in r.extra.items()}
    out: dict[str, Any] = {"requests": amounts, "limits": limits}
    if r.claims:
        out["claims"] = [{"name": c.name} for c in r.claims]
    return out


def init_containers(spec: Spec, mounts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The user's init containers, each with the trainer's CPU and memory (so the pod stays Guaranteed; an init
    container's request never adds to the pod's) and mounts."""
    amounts = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    return [{"name": c.name, "image": c.image, **({"command": c.command} if c.command else {}),
             **({"args": c.args} if c.args else {}), **({"env": list(container_env(c.env))} if c.env else {}),
             "resources": {"requests": amounts, "limits": amounts}, "volumeMounts": mounts,
             "securityContext": CONTAINER_SECURITY}
            for c in spec.pod.init_containers]


def volume_source(v: Volume) -> dict[str, Any]:
    if v.persistent_volume_claim:
        return {"persistentVolumeClaim": {"claimName": v.persistent_volume_claim, **_read_only(v.read_only)}}
    if v.config_map:
        return {"configMap": {"name": v.config_map}}
    if v.secret:
        return {"secret": {"secretName": v.secret}}
    return {"emptyDir": {}}


def _read_only(flag: bool) -> dict[str, bool]:
    return {"readOnly": True} if flag else {}


def volumes_and_mounts(spec: Spec, config_map_name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """paratrain's volumes (spec, /dev/shm, /tmp), then the user's; a user volume at /tmp replaces ours."""
    shm = {"emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}}
    own = [("paratrain-spec", {"configMap": {"name": config_map_name}}, contract.SPEC_MOUNT_DIR, True),
           ("paratrain-shm", shm, SHM_DIR, False)]
    if all(v.mount_path != TMP_DIR for v in spec.pod.volumes):
        own.append(("paratrain-tmp", {"emptyDir": {}}, TMP_DIR, False))
    user = [(v.name, volume_source(v), v.mount_path, v.read_only) for v in spec.pod.volumes]
    volumes = [{"name": name, **source} for name, source, _, _ in own + user]
    mounts = [{"name": name, "mountPath": path, **_read_only(ro)} for name, _, path, ro in own + user]
    return volumes, mounts


def container_security(spec: Spec) -> dict[str, Any]:
    if not spec.pod.ipc_lock:
        return CONTAINER_SECURITY
    return {**CONTAINER_SECURITY, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}


def pod(plan: GangPlan, node: NodePlan, spec: Spec) -> dict[str, Any]:
    volumes, mounts = volumes_and_mounts(spec, plan.config_map)
    user_mounts = [m for m in mounts if not m["name"].startswith(RESERVED_VOLUME_PREFIX) or m["mountPath"] == TMP_DIR]
    return _render(
        "pod.yaml.j2", metadata=metadata(plan, node.pod_name, node.labels, node.annotations), plan=plan,
        node=node, scheduling=spec.scheduling, tolerations=[t.dump() for t in spec.scheduling.tolerations],
        image_pull_secrets=[{"name": s} for s in spec.pod.image_pull_secrets], uid=TRAINER_UID, image=spec.image,
        command=spec.entrypoint.command + spec.entrypoint.args if spec.entrypoint else contract.train_command(),
        working_dir=spec.entrypoint.working_dir if spec.entrypoint else None,
        resources=resources(spec.resources), pod_spec=spec.pod,
        resource_claims=[{"name": c.name, "resourceClaimTemplateName": c.resource_claim_template_name}
                         for c in spec.resources.claims],
        init_containers=init_containers(spec, user_mounts), container=TRAINER_CONTAINER,
        spread=[{**c.dump(), "labelSelector": {"matchLabels": {contract.LABEL_JOB: plan.job_name}}}
                for c in spec.pod.topology_spread_constraints],
        container_security=container_security(spec),
        ports=[{"name": p["name"], "containerPort": p["port"], "protocol": "TCP"} for p in PORTS],
        volumes=volumes, mounts=mounts)


def probe_pods(job: ParallelTrainJob, namespace: str, attempt: int, ranks: Collection[int], group: int
               ) -> list[dict[str, Any]]:
    """An elastic gang's placeholder pods for node ranks `ranks` of a larger gang (paratrain_operator.resize), `group`
    in all: rank 0's pod as the gang's scheduling, resources and volumes make it, less what a rank is (its rank, env,
    ports, hostname, pod group, topology group), sleeping. Outside the gang's pod group and scheduler, so that one
    is placed wherever a pod fits within the domain the grown gang needs it in (topology.probe_placement); under
    Kueue, a group of their own."""
    plan = plan_gang(job, namespace, attempt, ranks=(0,))
    rank0, name = plan.nodes[0], job.metadata.name
    dropped = {contract.LABEL_NODE_RANK, COSCHEDULING_GROUP_LABEL, KAI_SUBGROUP_LABEL,
               *kueue.pod_labels(job, attempt), *topology.group_labels(job, 0)}
    queued_labels, queued_annotations = kueue.probe_metadata(job, attempt, group)
    alone = replace(plan, gang="none", scheduler_name=None, pod_group=None)
    out = []
    for rank in sorted(set(ranks)):
        group_labels, affinity = topology.probe_placement(job, attempt, rank)
        labels = {k: v for k, v in rank0.labels.items() if k not in dropped} | queued_labels | group_labels | {
            contract.LABEL_PROBE: str(rank)}
        node = replace(rank0, rank=rank, pod_name=contract.probe_name(name, attempt, rank), labels=labels,
                       annotations=dict(job.spec.pod.annotations) | queued_annotations, env=(), affinity=affinity)
        body = pod(alone, node, job.spec)
        for key in ("hostname", "subdomain", "initContainers"):  # a user's init (a data download) is the gang's
            body["spec"].pop(key, None)
        body["spec"]["containers"][0].update(command=contract.PROBE_COMMAND, ports=[])
        out.append(body)
    return out


def render_job(job: ParallelTrainJob, namespace: str, attempt: int = 0,
               platform: Platform | None = None, ranks: Collection[int] | None = None) -> list[dict[str, Any]]:
    """The objects of gang attempt `attempt`, in creation order: its shared objects (gang_objects), then its Pods
    (only those of `ranks`, if given: a pass that replaces one pod builds one, not the whole gang)."""
    return gang_objects(job, namespace, attempt, platform) + gang_pods(job, namespace, attempt, ranks)


def gang_objects(job: ParallelTrainJob, namespace: str, attempt: int = 0,
                 platform: Platform | None = None) -> list[dict[str, Any]]:
    """What gang attempt `attempt`'s pods need first, in creation order: ConfigMap, Service, NetworkPolicy (unless
    the platform turns it off), Workload and PodGroup (per the gang scheduler)."""
    platform = platform or Platform()
    plan = plan_gang(job, namespace, attempt, ranks=())
    objects = [config_map(plan, job), service(plan)]
    if platform.network_policy.enabled:
        objects.append(network_policy(plan, platform.network_policy))
    if plan.gang == "kubernetes":
        objects.append(workload(plan, job.spec))
    if plan.pod_group:
        placement = (topology.kai_placement(job, platform.kai_topology) if plan.gang == "kai" else
                     topology.volcano_placement(job, platform.volcano_tiers))
        objects.append(pod_group(plan, job.spec, placement))
    return objects


def gang_pods(job: ParallelTrainJob, namespace: str, attempt: int = 0,
              ranks: Collection[int] | None = None) -> list[dict[str, Any]]:
    """The Pods of gang attempt `attempt` (of `ranks` only, if given), by rank."""
    plan = plan_gang(job, namespace, attempt, ranks)
    return [pod(plan, node, job.spec) for node in plan.nodes]


def native_pod_group(job: ParallelTrainJob, namespace: str, attempt: int) -> dict[str, Any] | None:
    """A reference (apiVersion, kind, name, namespace) to attempt `attempt`'s native PodGroup; None unless the job's
    gang is `kubernetes`."""
    if job.spec.scheduling.gang != "kubernetes":
        return None
    group = pod_group(plan_gang(job, namespace, attempt, ranks=()), job.spec)
    return {"apiVersion": group["apiVersion"], "kind": group["kind"],
            "metadata": {"name": group["metadata"]["name"], "namespace": namespace}}


def superseded(job: ParallelTrainJob, namespace: str, attempt: int) -> list[dict[str, Any]]:
    """What gang attempt `attempt` replaces, to delete once it is created: the native PodGroup of the attempt
    before (one scheduling instance each; Volcano's, KAI's and scheduler-plugins' groups are reused)."""
    old = native_pod_group(job, namespace, attempt - 1) if attempt > 0 else None
    return [old] if old else []
