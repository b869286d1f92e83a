"""What the renderer builds for a gang, property by property (the golden files pin the whole output)."""

from __future__ import annotations

import json

import copy
from pathlib import Path
from typing import Any

import yaml

from paratrain import contract
from paratrain.api import load_job, parse_job
from paratrain_operator.plan import plan_gang
from paratrain_operator.render import render_job

JOBS = Path(__file__).resolve().parent / "jobs"


def job_doc(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "j"},
            "spec": {"nodes": 3, "parallelism": {"data": 3}, "training": {"batchSize": 9}, **spec}}


def render(doc: dict[str, Any], attempt: int = 0, namespace: str = "ns") -> list[dict[str, Any]]:
    return render_job(parse_job(doc), namespace, attempt)


def pods(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "Pod"]


def env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def container(pod: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod["spec"]["containers"]
    return only


def test_one_headless_service_and_one_pod_per_node() -> None:
    objects = render(job_doc())
    assert [o["kind"] for o in objects] == ["ConfigMap", "Service", "NetworkPolicy", "Pod", "Pod", "Pod"]
    (svc,) = [o for o in objects if o["kind"] == "Service"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"rendezvous": contract.MASTER_PORT,
                                                                    "progress": contract.PROGRESS_PORT}
    for pod in pods(objects):
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert pod["spec"]["subdomain"] == svc["metadata"]["name"]


def test_only_the_ranks_asked_for_are_built_beside_the_shared_objects() -> None:
    """A pass that creates one missing pod builds that pod, not the whole gang (4,096 pods took 4.9 s of CPU on
    the operator's event loop; issue 31)."""
    whole = render(job_doc())
    some = render_job(parse_job(job_doc()), "ns", 0, ranks=(2,))
    assert [o["kind"] for o in some] == ["ConfigMap", "Service", "NetworkPolicy", "Pod"]
    assert some[-1] == pods(whole)[2] and some[:3] == whole[:3]


def test_names_per_attempt_and_stable_hostnames() -> None:
    first, later = pods(render(job_doc(), attempt=0)), pods(render(job_doc(), attempt=4))
    assert [p["metadata"]["name"] for p in first] == ["j-0-0", "j-0-1", "j-0-2"]
    assert [p["metadata"]["name"] for p in later] == ["j-4-0", "j-4-1", "j-4-2"]
    assert [p["spec"]["hostname"] for p in first] == [p["spec"]["hostname"] for p in later] == ["j-0", "j-1", "j-2"]


def test_torchrun_env_contract() -> None:
    for rank, pod in enumerate(pods(render(job_doc(procsPerNode=2, parallelism={"data": 6},
                                                   training={"batchSize": 12}), attempt=2))):
        e = env(pod)
        assert {k: e[k] for k in ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                                  "PET_MASTER_PORT")} == {
            "PET_NNODES": "3", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "j-0.j.ns.svc", "PET_MASTER_PORT": str(contract.MASTER_PORT)}
        assert e[contract.ENV_RESTART_ATTEMPT] == "2" and e[contract.ENV_JOB_NAME] == "j"
        assert e[contract.ENV_PROGRESS_PORT] == str(contract.PROGRESS_PORT)
        assert e["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert contract.COMMS_ENV.items() <= e.items() and e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
        assert container(pod)["command"] == contract.train_command()


def test_in_place_restarts_give_torchrun_its_budget_and_the_exit_code_rules() -> None:
    assert env(pods(render(job_doc()))[0])["PET_MAX_RESTARTS"] == "0"
    assert contract.ENV_EXIT_CODE_RULES not in env(pods(render(job_doc()))[0])
    doc = job_doc(restartPolicy={"inPlaceLimit": 3}, failurePolicy={"rules": [
        {"action": "FailJob", "exitCodes": [3]}, {"action": "Ignore", "podConditions": ["DisruptionTarget"]}]})
    e = env(pods(render(doc))[0])
    assert e["PET_MAX_RESTARTS"] == "3"
    assert json.loads(e[contract.ENV_EXIT_CODE_RULES]) == [{"action": "FailJob", "exitCodes": [3],
                                                           "podConditions": []}]


def test_hang_seconds_reach_every_pods_agent_only_where_asked() -> None:
    assert contract.ENV_HANG_SECONDS not in env(pods(render(job_doc()))[0])
    doc = job_doc(restartPolicy={"inPlaceLimit": 2, "hangSeconds": 300})
    assert {env(p)[contract.ENV_HANG_SECONDS] for p in pods(render(doc))} == {"300"}


def test_user_env_comes_last_and_replaces_only_overridable_defaults() -> None:
    doc = job_doc(pod={"env": [{"name": "HOME", "value": "/data/home"}, {"name": "WANDB_MODE", "value": "off"}]})
    names = [e["name"] for e in container(pods(render(doc))[0])["env"]]
    assert names[-2:] == ["HOME", "WANDB_MODE"]
    assert len(names) == len(set(names)), "no env name twice"
    assert env(pods(render(doc))[0])["HOME"] == "/data/home"


def test_every_pod_gets_the_layout_as_env() -> None:
    doc = job_doc(nodes=4, parallelism={"data": 2, "pipeline": 2, "zeroStage": 1, "microbatches": 2},
                  precision="bf16", training={"batchSize": 8})
    for pod in pods(render(doc)):
        e = env(pod)
        assert {k: e[k] for k in ("PARATRAIN_DATA", "PARATRAIN_TENSOR", "PARATRAIN_PIPELINE", "PARATRAIN_ZERO_STAGE",
                                  "PARATRAIN_PRECISION")} == {"PARATRAIN_DATA": "2", "PARATRAIN_TENSOR": "1",
                                                              "PARATRAIN_PIPELINE": "2", "PARATRAIN_ZERO_STAGE": "1",
                                                              "PARATRAIN_PRECISION": "bf16"}


def test_an_entrypoint_replaces_the_trainers_command_and_nothing_else() -> None:
    own = {"command": ["torchrun", "train.py"], "args": ["--steps", "10"], "workingDir": "/workspace/code"}
    plain = job_doc(nodes=2, parallelism={"data": 2})
    del plain["spec"]["training"]  # the built-in trainer's section: a program of its own leaves it out
    builtin, custom = pods(render(plain)), pods(render({**plain, "spec": {**plain["spec"], "entrypoint": own}}))
    for before, after in zip(builtin, custom):
        assert container(after)["command"] == ["torchrun", "train.py", "--steps", "10"]
        assert container(after)["workingDir"] == "/workspace/code" and "workingDir" not in container(before)
        assert container(before)["command"] == contract.train_command()
        assert env(after) == env(before), "the same env contract: PET_*, the layout, progress port"
        for key in ("volumes", "securityContext", "restartPolicy", "hostname", "subdomain"):
            assert after["spec"][key] == before["spec"][key]


def test_fabric_tuning_replaces_paratrains_nccl_defaults() -> None:
    doc = job_doc(pod={"env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "NCCL_IB_HCA", "value": "mlx5_0"},
                               {"name": "TORCH_NCCL_DUMP_ON_TIMEOUT", "valueFrom": {"configMapKeyRef": {
                                   "name": "fabric", "key": "dump"}}}]})
    names = [e["name"] for e in container(pods(render(doc))[0])["env"]]
    assert len(names) == len(set(names)), "no env name twice: the user's replaces the default"
    e = env(pods(render(doc))[0])
    assert e["NCCL_DEBUG"] == "INFO" and e["NCCL_IB_HCA"] == "mlx5_0"
    assert e["TORCH_NCCL_DUMP_ON_TIMEOUT"] == {"configMapKeyRef": {"name": "fabric", "key": "dump", "optional": False}}
    assert e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2", "defaults the user left alone stay"


def test_env_from_secrets_config_maps_and_pod_fields() -> None:
    sources = [{"secretKeyRef": {"name": "wandb", "key": "api-key", "optional": False}},
               {"configMapKeyRef": {"name": "settings", "key": "bucket", "optional": True}},
               {"fieldRef": {"fieldPath": "spec.nodeName"}}]
    doc = job_doc(pod={"env": [{"name": f"V{i}", "valueFrom": s} for i, s in enumerate(sources)]})
    for pod in pods(render(doc)):
        assert container(pod)["env"][-3:] == [{"name": f"V{i}", "valueFrom": s} for i, s in enumerate(sources)]


def test_identity_runtime_class_and_spread() -> None:
    spread = [{"topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}]
    plain = pods(render(job_doc()))[0]["spec"]
    assert plain["automountServiceAccountToken"] is False and "serviceAccountName" not in plain
    spec = pods(render(job_doc(pod={"serviceAccountName": "trainer", "runtimeClassName": "nvidia",
                                    "topologySpreadConstraints": spread})))[0]["spec"]
    assert spec["serviceAccountName"] == "trainer" and spec["automountServiceAccountToken"] is True
    assert spec["runtimeClassName"] == "nvidia" and spec["topologySpreadConstraints"] == [{
        "topologyKey": "topology.kubernetes.io/zone", "maxSkew": 1, "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": {"paratrain.dev/job-name": "j"}}}], "over the gang's own pods"


def test_init_containers_run_restricted_with_the_jobs_volumes() -> None:
    doc = job_doc(pod={"volumes": [{"name": "data", "mountPath": "/data", "persistentVolumeClaim": "corpus"}],
                       "initContainers": [{"name": "fetch", "image": "amazon/aws-cli:2", "args": ["s3", "sync",
                                                                                                 "s3://b", "/data"],
                                           "env": [{"name": "AWS_REGION", "value": "eu-west-1"}]}]})
    spec = pods(render(doc))[0]["spec"]
    (fetch,) = spec["initContainers"]
    trainer = spec["containers"][0]
    assert fetch["image"] == "amazon/aws-cli:2" and "command" not in fetch and fetch["args"][0] == "s3"
    assert fetch["securityContext"] == trainer["securityContext"]
    assert fetch["resources"]["requests"] == fetch["resources"]["limits"] == trainer["resources"]["requests"]
    assert {m["mountPath"] for m in fetch["volumeMounts"]} == {"/data", "/tmp"}
    assert fetch["env"] == [{"name": "AWS_REGION", "value": "eu-west-1"}]


def test_labels_and_annotations_merge_with_paratrains_on_top() -> None:
    doc = job_doc(scheduling={"gang": "coscheduling"},
                  pod={"labels": {"team": "a", "scheduling.x-k8s.io/pod-group": "someone-elses"},
                       "annotations": {"note": "hi"}})
    for rank, pod in enumerate(pods(render(doc, attempt=1))):
        labels, notes = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert labels["team"] == "a" and notes["note"] == "hi"
        assert labels["scheduling.x-k8s.io/pod-group"] == "j"  # ours wins
        assert (labels[contract.LABEL_JOB], labels[contract.LABEL_ATTEMPT], labels[contract.LABEL_NODE_RANK]) == (
            "j", "1", str(rank))
        assert (notes["paratrain.dev/node-rank"], notes["paratrain.dev/attempt"]) == (str(rank), "1")


def test_resources_gpus_and_shm() -> None:
    doc = job_doc(procsPerNode=2, parallelism={"data": 6}, training={"batchSize": 12},
                  resources={"gpusPerNode": 2, "cpu": "8", "memory": "64Gi", "shmSize": "8Gi"})
    pod = pods(render(doc))[0]
    assert container(pod)["resources"] == {"requests": {"cpu": "8", "memory": "64Gi"},
                                           "limits": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"}}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["paratrain-shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    cpu_pod = pods(render(job_doc()))[0]
    assert "nvidia.com/gpu" not in container(cpu_pod)["resources"]["limits"]


def test_device_plugin_resources_and_dra_claims() -> None:
    rdma = job_doc(nodes=2, procsPerNode=4, parallelism={"data": 8}, training={"batchSize": 8},
                   resources={"gpusPerNode": 4, "gpuResource": "amd.com/gpu", "extra": {"rdma/ib": 1}})
    limits = container(pods(render(rdma))[0])["resources"]["limits"]
    assert limits["amd.com/gpu"] == "4" and limits["rdma/ib"] == "1" and "nvidia.com/gpu" not in limits
    claims = [{"name": "gpus", "resourceClaimTemplateName": "four-h100", "providesGpus": True},
              {"name": "nic", "resourceClaimTemplateName": "rdma-nic"}]
    dra = job_doc(nodes=2, procsPerNode=4, parallelism={"data": 8}, training={"batchSize": 8},
                  resources={"gpusPerNode": 4, "claims": claims})
    pod = pods(render(dra))[0]
    assert pod["spec"]["resourceClaims"] == [{"name": c["name"], "resourceClaimTemplateName":
                                              c["resourceClaimTemplateName"]} for c in claims]
    res = container(pod)["resources"]
    assert res["claims"] == [{"name": "gpus"}, {"name": "nic"}]
    assert "nvidia.com/gpu" not in res["limits"], "the claim holds the GPUs: no device-plugin request besides it"


def test_user_volumes_mount_beside_paratrains() -> None:
    doc = job_doc(pod={"volumes": [
        {"name": "ckpt", "mountPath": "/ckpt", "persistentVolumeClaim": "ckpt-pvc"},
        {"name": "corpus", "mountPath": "/corpus", "persistentVolumeClaim": "corpus", "readOnly": True},
        {"name": "cfg", "mountPath": "/cfg", "configMap": "cfg"}, {"name": "key", "mountPath": "/key", "secret": "k"},
        {"name": "tmp", "mountPath": "/tmp", "emptyDir": True}]})
    pod = pods(render(doc))[0]
    volumes = {v["name"]: {k: v2 for k, v2 in v.items() if k != "name"} for v in pod["spec"]["volumes"]}
    assert volumes == {
        "paratrain-spec": {"configMap": {"name": "j-spec"}},
        "paratrain-shm": {"emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        "ckpt": {"persistentVolumeClaim": {"claimName": "ckpt-pvc"}},
        "corpus": {"persistentVolumeClaim": {"claimName": "corpus", "readOnly": True}},
        "cfg": {"configMap": {"name": "cfg"}}, "key": {"secret": {"secretName": "k"}}, "tmp": {"emptyDir": {}},
    }, "a user volume at /tmp replaces paratrain's"
    mounts = {m["mountPath"]: m for m in container(pod)["volumeMounts"]}
    assert mounts[contract.SPEC_MOUNT_DIR] == {"name": "paratrain-spec", "mountPath": contract.SPEC_MOUNT_DIR,
                                               "readOnly": True}
    assert mounts["/corpus"]["readOnly"] is True and "readOnly" not in mounts["/ckpt"]
    assert mounts["/tmp"]["name"] == "tmp"
    assert pods(render(job_doc()))[0]["spec"]["volumes"][2] == {"name": "paratrain-tmp", "emptyDir": {}}


def test_spec_config_map_is_what_the_trainer_reads() -> None:
    job = load_job(JOBS / "gpu-3d-volcano.yaml")
    config_map, *_, pod = render_job(job, "llm")
    assert config_map["metadata"]["name"] == "gpt-3d-spec"
    text = config_map["data"][contract.SPEC_FILE_NAME]
    assert parse_job(yaml.safe_load(text)).spec == job.spec
    assert "uid" not in yaml.safe_load(text)["metadata"]  # cluster bookkeeping stays out
    assert contract.SPEC_PATH_IN_POD in container(pod)["command"]


def test_cluster_placement_passes_through() -> None:
    job = load_job(JOBS / "gpu-3d-volcano.yaml")
    pod = pods(render_job(job, "llm"))[0]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][1] == {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute",
                                     "tolerationSeconds": 300}
    assert pod["affinity"] == job.spec.scheduling.affinity
    assert pod["priorityClassName"] == "training.high"
    assert pod["imagePullSecrets"] == [{"name": "registry.example.com"}]
    bare = pods(render(job_doc()))[0]["spec"]
    assert not {"nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets",
                "schedulerName"} & bare.keys()


def test_gang_scheduling_objects() -> None:
    assert "PodGroup" not in [o["kind"] for o in render(job_doc())]
    volcano = render(job_doc(scheduling={"gang": "volcano", "queue": "research"}))
    (group,) = [o for o in volcano if o["kind"] == "PodGroup"]
    assert (group["apiVersion"], group["spec"]) == ("scheduling.volcano.sh/v1beta1", {"minMember": 3,
                                                                                      "queue": "research"})
    for pod in pods(volcano):
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == group["metadata"]["name"]
    kai = render(job_doc(scheduling={"gang": "kai", "priorityClassName": "train"}))
    (group,) = [o for o in kai if o["kind"] == "PodGroup"]
    assert (group["apiVersion"], group["spec"]) == ("scheduling.run.ai/v2alpha2", {
        "minMember": 3, "queue": "default-queue", "priorityClassName": "train"})  # KAI's default queue
    for pod in pods(kai):  # KAI's pod-grouper leaves them to the job's own group (else: one of one pod each)
        assert pod["spec"]["schedulerName"] == "kai-scheduler"
        assert pod["metadata"]["annotations"]["pod-group-name"] == group["metadata"]["name"]
        assert pod["metadata"]["annotations"]["kai.scheduler/skip-podgrouper"] == "true"
        assert "kai.scheduler/subgroup-name" not in pod["metadata"]["labels"]
    cosched = render(job_doc(scheduling={"gang": "coscheduling"}))
    (group,) = [o for o in cosched if o["kind"] == "PodGroup"]
    assert (group["apiVersion"], group["spec"]) == ("scheduling.x-k8s.io/v1alpha1", {"minMember": 3})
    for pod in pods(cosched):
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == group["metadata"]["name"]


def test_native_gang_objects_a_fresh_pod_group_per_attempt() -> None:
    """gang: kubernetes — one Workload (the job's gang template, minCount = nodes) and, per gang attempt, a PodGroup
    following it that every pod joins through spec.schedulingGroup; the default scheduler binds them."""
    for attempt in (0, 1):
        objects = render(job_doc(scheduling={"gang": "kubernetes"}), attempt=attempt)
        (workload,) = [o for o in objects if o["kind"] == "Workload"]
        (group,) = [o for o in objects if o["kind"] == "PodGroup"]
        assert workload["apiVersion"] == group["apiVersion"] == "scheduling.k8s.io/v1beta1"
        assert workload["metadata"]["name"] == "j"
        assert workload["spec"]["podGroupTemplates"] == [
            {"name": "workers", "schedulingPolicy": {"gang": {"minCount": 3}}}]
        assert group["metadata"]["name"] == f"j-{attempt}"
        assert group["spec"] == {"workloadRef": {"workloadName": "j", "templateName": "workers"},
                                 "schedulingPolicy": {"gang": {"minCount": 3}}}
        for pod in pods(objects):
            assert pod["spec"]["schedulingGroup"] == {"podGroupName": f"j-{attempt}"}
            assert "schedulerName" not in pod["spec"]
    zoned = render(job_doc(scheduling={"gang": "kubernetes", "topologyKey": "topology.kubernetes.io/zone"}))
    (workload,) = [o for o in zoned if o["kind"] == "Workload"]
    (group,) = [o for o in zoned if o["kind"] == "PodGroup"]
    one_zone = {"topology": [{"key": "topology.kubernetes.io/zone"}]}
    assert workload["spec"]["podGroupTemplates"][0]["schedulingConstraints"] == one_zone
    assert group["spec"]["schedulingConstraints"] == one_zone


def test_owner_references_only_for_a_job_on_a_cluster() -> None:
    assert all("ownerReferences" not in o["metadata"] for o in render(job_doc()))
    doc = job_doc()
    doc["metadata"]["uid"] = "1234-abcd"
    for obj in render(doc):
        assert obj["metadata"]["ownerReferences"] == [{
            "apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "name": "j", "uid": "1234-abcd",
            "controller": True, "blockOwnerDeletion": True}]


def test_suspend_does_not_change_the_gang() -> None:
    running = render(job_doc())
    suspended = render(job_doc(runPolicy={"suspend": True}))
    assert suspended[1:] == running[1:]  # only the ConfigMap's copy of the spec differs


def test_pod_basics_for_training() -> None:
    pod = pods(render(job_doc()))[0]
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["enableServiceLinks"] is False and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsUser"] == 1000 and spec["securityContext"]["fsGroup"] == 1000
    assert container(pod)["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_render_is_pure_and_deterministic() -> None:
    job = load_job(JOBS / "gpu-3d-volcano.yaml")
    before = copy.deepcopy(job.model_dump())
    assert render_job(job, "llm", 1) == render_job(job, "llm", 1)
    assert job.model_dump() == before
    assert plan_gang(job, "llm", 1) == plan_gang(job, "llm", 1)


def test_a_job_in_a_kueue_queue_labels_every_pod_as_one_group_per_attempt() -> None:
    doc = job_doc()
    doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a", "kueue.x-k8s.io/priority-class": "low",
                                 "team": "vision"}
    for attempt in (0, 3):
        for pod in pods(render(doc, attempt=attempt)):
            labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
            assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
            assert labels["kueue.x-k8s.io/priority-class"] == "low"
            assert labels["kueue.x-k8s.io/pod-group-name"] == f"j-{attempt}"  # a restart is a new Workload
            assert annotations["kueue.x-k8s.io/pod-group-total-count"] == "3"
            assert annotations["kueue.x-k8s.io/retriable-in-group"] == "false"
            assert "team" not in labels  # only Kueue's keys are carried from the job
    for pod in pods(render(job_doc())):
        assert not [k for k in {**pod["metadata"]["labels"], **pod["metadata"]["annotations"]} if "kueue" in k]
