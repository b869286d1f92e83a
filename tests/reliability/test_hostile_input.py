"""Hostile input goes no further than it should: injection attempts in every user string are refused with the
field named or arrive intact as data (no extra object, no extra field); reserved env names, host access and
over-long names are refused; absurd sizes are refused without allocating; a YAML alias bomb or a Python tag in a
job file is refused before anything is built."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
import tracemalloc
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from paratrain import contract
from paratrain.api import SpecError, load_job, parse_job, require_cluster_ready
from paratrain.api.platform import Platform
from paratrain.api.spec import MAX_NAME_LENGTH, ParallelTrainJob
from paratrain_operator.render import render_job

from . import apiserver

BASE = {
    "apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob",
    "metadata": {"name": "job", "namespace": "team"},
    "spec": {
        "nodes": 2, "parallelism": {"data": 2}, "image": "ghcr.io/org/trainer:1.0",
        "checkpoint": {"path": "/ckpt/run"}, "data": {"source": "text", "path": "/data/text.txt"},
        "resources": {"memory": "2Gi"},
        "scheduling": {"gang": "volcano", "queue": "research", "priorityClassName": "high",
                       "nodeSelector": {"pool": "gpu"}},
        "pod": {"env": [{"name": "USER_VALUE", "value": "plain"}],
                "volumes": [{"name": "data", "mountPath": "/data", "persistentVolumeClaim": "datasets"}],
                "imagePullSecrets": ["regcred"], "labels": {"team": "plain"}, "annotations": {"note": "plain"},
                "initContainers": [{"name": "fetch", "image": "busybox:1.37", "args": ["plain"]}]},
    },
}
PAYLOADS = [
    "x\nkind: Secret", "a: b\n---\nkind: Pod", "'; rm -rf / #", '"quoted" \\ backslash', "{{ 7 * 7 }}",
    "{% if true %}x{% endif %}", "{# c #}", "key: [1, 2]", "- item", "&a *a !!python/object/apply:os.system ['id']",
    "null", "true", "0x10", "", " ", "\u2028\u0085", "a" * 300,
]


def _set(doc: dict, path: tuple, value: Any) -> None:
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _rename_key(doc: dict, path: tuple, new_key: str) -> None:
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[new_key] = node.pop(path[-1])


# Every user string that reaches an object: (field path as reported, where it sits in the document, key or value).
FIELDS = [
    ("metadata.name", ("metadata", "name"), "value"),
    ("metadata.namespace", ("metadata", "namespace"), "value"),
    ("spec.image", ("spec", "image"), "value"),
    ("spec.pod.env[0].name", ("spec", "pod", "env", 0, "name"), "value"),
    ("spec.pod.env[0].value", ("spec", "pod", "env", 0, "value"), "value"),
    ("spec.pod.volumes[0].name", ("spec", "pod", "volumes", 0, "name"), "value"),
    ("spec.pod.volumes[0].mountPath", ("spec", "pod", "volumes", 0, "mountPath"), "value"),
    ("spec.pod.volumes[0].persistentVolumeClaim", ("spec", "pod", "volumes", 0, "persistentVolumeClaim"), "value"),
    ("spec.pod.imagePullSecrets[0]", ("spec", "pod", "imagePullSecrets", 0), "value"),
    ("spec.pod.labels", ("spec", "pod", "labels", "team"), "value"),
    ("spec.pod.labels", ("spec", "pod", "labels", "team"), "key"),
    ("spec.pod.annotations", ("spec", "pod", "annotations", "note"), "value"),
    ("spec.pod.annotations", ("spec", "pod", "annotations", "note"), "key"),
    ("spec.scheduling.queue", ("spec", "scheduling", "queue"), "value"),
    ("spec.scheduling.priorityClassName", ("spec", "scheduling", "priorityClassName"), "value"),
    ("spec.scheduling.nodeSelector", ("spec", "scheduling", "nodeSelector", "pool"), "value"),
    ("spec.scheduling.nodeSelector", ("spec", "scheduling", "nodeSelector", "pool"), "key"),
    ("spec.data.path", ("spec", "data", "path"), "value"),
    ("spec.checkpoint.path", ("spec", "checkpoint", "path"), "value"),
    ("spec.resources.memory", ("spec", "resources", "memory"), "value"),
]


FREE_TEXT = {"spec.pod.env[0].value", "spec.pod.annotations:value"}


def _shape(obj: Any, at: str = "") -> set[str]:
    """Every key path of an object (values left out; list items collapsed), to compare structures."""
    if isinstance(obj, dict):
        user_keys = at.rpartition(".")[2] in ("labels", "annotations", "nodeSelector", "data")
        return {at} | {p for k, v in obj.items() for p in _shape(v, f"{at}.<key>" if user_keys else f"{at}.{k}")}
    if isinstance(obj, list):
        return {at} | {p for v in obj for p in _shape(v, at + "[]")}
    return {at}


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in [k, *_strings(v)]]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return [obj] if isinstance(obj, str) else []


def _render(doc: dict) -> list[dict]:
    job = parse_job(doc)
    return render_job(job, namespace=job.metadata.namespace or "default", attempt=1)


@pytest.mark.parametrize("field,path,part", FIELDS, ids=[f"{f}:{p}" for f, _, p in FIELDS])
def test_injection_payloads_are_refused_naming_the_field_or_arrive_intact(field, path, part):
    field_id = f"{field}:{part}" if field == "spec.pod.annotations" else field
    baseline = _render(BASE)
    outcomes = {"refused": 0, "intact": 0}
    for payload in PAYLOADS:
        doc = copy.deepcopy(BASE)
        (_rename_key if part == "key" else _set)(doc, path, payload)
        try:
            objects = _render(doc)
        except SpecError as exc:
            assert [p.path for p in exc.problems if p.path.startswith(field)], (payload, str(exc))
            assert all(p.path.startswith(field) for p in exc.problems), (payload, str(exc))
            outcomes["refused"] += 1
            continue
        outcomes["intact"] += 1
        # Intact, as data: the same objects with the same structure, the payload a whole string in them.
        assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
            (o["kind"], o["metadata"]["name"]) for o in baseline] or field == "metadata.name", payload
        assert [_shape(o) for o in objects] == [_shape(o) for o in baseline], payload
        config = next(o for o in objects if o["kind"] == "ConfigMap")
        as_trainer_reads_it = yaml.safe_load(config["data"][contract.SPEC_FILE_NAME])
        assert as_trainer_reads_it["spec"] == parse_job(doc).spec.dump()
        assert payload in _strings(objects) + _strings(as_trainer_reads_it), payload
        for obj in objects:
            assert apiserver.problems(obj) == [], (payload, obj["metadata"])
    if field_id in FREE_TEXT:
        assert outcomes["refused"] == 0, "free text is data: nothing in it is refused"
    else:
        assert outcomes["refused"] >= sum("\n" in p for p in PAYLOADS), "a line break is never part of a name"


# The rendezvous contract. Fabric tuning (NCCL_*, TORCH_NCCL_*, GLOO_*, ...) is the user's to set.
ENV_RESERVED = ["MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_WORLD_SIZE",
                "ROLE_NAME", "PET_NNODES", "PET_MASTER_ADDR", "PARATRAIN_SPEC", "TORCHELASTIC_RESTART_COUNT", "POD_IP"]


@pytest.mark.parametrize("name", ENV_RESERVED)
def test_reserved_env_names_are_refused(name):
    doc = copy.deepcopy(BASE)
    doc["spec"]["pod"]["env"].append({"name": name, "value": "10.0.0.66"})
    with pytest.raises(SpecError) as err:
        parse_job(doc)
    assert [str(p) for p in err.value.problems] == [
        f"spec.pod.env[1].name: {name} is reserved: torchrun's rendezvous contract, which paratrain sets"]


HOST_ACCESS = [
    (("spec", "pod", "hostPath"), "/"), (("spec", "pod", "securityContext"), {"privileged": True}),
    (("spec", "pod", "volumes", 0, "hostPath"), {"path": "/"}), (("spec", "pod", "privileged"), True),
    (("spec", "pod", "hostIPC"), True), (("spec", "pod", "hostPID"), True),
    (("spec", "pod", "automountServiceAccountToken"), True), (("spec", "pod", "command"), ["sh", "-c", "id"]),
    (("spec", "pod", "initContainers", 0, "securityContext"), {"privileged": True}),
    (("spec", "image"), "x\nsecurityContext: {privileged: true}"),
]


@pytest.mark.parametrize("path,value", HOST_ACCESS, ids=[".".join(map(str, p)) for p, _ in HOST_ACCESS])
def test_host_access_and_privilege_cannot_be_requested(path, value):
    doc = copy.deepcopy(BASE)
    _set(doc, path, value)
    with pytest.raises(SpecError) as err:
        parse_job(doc)
    shown = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)[1:]
    problems = [p.path + (": unknown field" if "unknown field" in p.message else "") for p in err.value.problems]
    assert problems == [f"{shown}: unknown field" if path[-1] != "image" else shown], problems
    # Whatever a user asks, the pods keep the restricted security context.
    for pod in (o for o in _render(BASE) if o["kind"] == "Pod"):
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert pod["spec"]["automountServiceAccountToken"] is False
        assert {"hostNetwork", "hostPID", "hostIPC"}.isdisjoint(pod["spec"])
        assert all("hostPath" not in v for v in pod["spec"]["volumes"])
        for container in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("field,path", [("hostNetwork", "spec.pod.hostNetwork"), ("ipcLock", "spec.pod.ipcLock")])
def test_host_access_needs_the_platforms_consent(field, path, tmp_path):
    """spec.pod.hostNetwork and ipcLock parse, but the operator (and render) refuse them unless the platform file
    allows them; allowed, the pod gets exactly that and nothing more."""
    doc = copy.deepcopy(BASE)
    doc["spec"]["pod"][field] = True
    job = parse_job(doc)
    with pytest.raises(SpecError) as err:
        require_cluster_ready(job)
    assert [p.path for p in err.value.problems] == [path]
    platform = Platform(allow_host_network=True, allow_ipc_lock=True)
    require_cluster_ready(job, platform)
    for pod in (o for o in render_job(job, "team", 0, platform) if o["kind"] == "Pod"):
        trainer = pod["spec"]["containers"][0]
        assert pod["spec"].get("hostNetwork", False) is (field == "hostNetwork")
        assert trainer["securityContext"]["capabilities"] == (
            {"drop": ["ALL"], "add": ["IPC_LOCK"]} if field == "ipcLock" else {"drop": ["ALL"]})
        assert pod["spec"]["initContainers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert trainer["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert {"hostPID", "hostIPC"}.isdisjoint(pod["spec"])


# (field path, value at the limit, value over it)
LENGTHS = [
    (("metadata", "name"), "a" * MAX_NAME_LENGTH, "a" * (MAX_NAME_LENGTH + 1)),
    (("metadata", "namespace"), "a" * 63, "a" * 64),
    (("spec", "pod", "volumes", 0, "name"), "v" * 63, "v" * 64),
    (("spec", "pod", "labels", "team"), "l" * 63, "l" * 64),
    (("spec", "scheduling", "queue"), "q" * 63, "q" * 64),
    (("spec", "pod", "imagePullSecrets", 0), ".".join(["s" * 63] * 4)[:253], "s" * 254),
    (("spec", "pod", "env", 0, "value"), "e" * 32768, "e" * 32769),
]


@pytest.mark.parametrize("path,longest,too_long", LENGTHS, ids=[".".join(map(str, p)) for p, _, _ in LENGTHS])
def test_over_long_names_are_refused_and_the_longest_allowed_render_valid(path, longest, too_long):
    doc = copy.deepcopy(BASE)
    _set(doc, path, too_long)
    with pytest.raises(SpecError) as err:
        parse_job(doc)
    assert [p.path for p in err.value.problems] == [
        "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)[1:]]
    _set(doc, path, longest)
    for obj in _render(doc):
        assert apiserver.problems(obj) == [], obj["metadata"]


def test_longest_job_name_leaves_room_for_every_pod_name_and_hostname():
    name = "a" * MAX_NAME_LENGTH
    worst_rank, worst_attempt = 4095, 1000  # spec bounds: nodes <= 4096, backoffLimit <= 1000
    assert len(contract.pod_name(name, worst_attempt, worst_rank)) <= 63
    assert len(contract.pod_hostname(name, worst_rank)) <= 63
    assert len(f"{name}-spec") <= 63


# (field the refusal must name, the spec) — built lazily: some are large on purpose.
ABSURD = [
    ("spec.nodes", lambda: {"nodes": 10**6, "parallelism": {"data": 10**6}}),
    ("spec.nodes", lambda: {"nodes": 0}), ("spec.nodes", lambda: {"nodes": -1}),
    ("spec.procsPerNode", lambda: {"procsPerNode": 10**9}),
    ("spec.parallelism.data", lambda: {"parallelism": {"data": 0}}),
    ("spec.parallelism.tensor", lambda: {"parallelism": {"tensor": -4}}),
    ("spec.parallelism.pipeline", lambda: {"parallelism": {"pipeline": 10**12}}),
    ("spec.parallelism.microbatches", lambda: {"parallelism": {"microbatches": 0}}),
    ("spec.training.batchSize", lambda: {"training": {"batchSize": 10**15}}),
    ("spec.training.steps", lambda: {"training": {"steps": 10**100}}),
    ("spec.model.embedDim", lambda: {"model": {"embedDim": 2**40}}),
    ("spec.model.vocabSize", lambda: {"model": {"vocabSize": 10**10}}),
    ("spec.model.blockSize", lambda: {"model": {"blockSize": 2**31}}),
    ("spec.training.learningRate", lambda: {"training": {"learningRate": float("inf")}}),
    ("spec.training.learningRate", lambda: {"training": {"learningRate": float("nan")}}),
    ("spec.runPolicy.collectiveTimeoutSeconds", lambda: {"runPolicy": {"collectiveTimeoutSeconds": 0}}),
    ("spec.pod.env", lambda: {"pod": {"env": [{"name": f"V{i}", "value": "x"} for i in range(100_000)]}}),
    ("spec.pod.env[0].value", lambda: {"pod": {"env": [{"name": "BIG", "value": "x" * 50_000_000}]}}),
    ("spec.pod.annotations", lambda: {"pod": {"annotations": {f"k{i}": "x" * 60_000 for i in range(5)}}}),
]


@pytest.mark.parametrize("field,spec", ABSURD, ids=[f"{f}:{i}" for i, (f, _) in enumerate(ABSURD)])
def test_absurd_sizes_are_refused_naming_the_field_without_allocating(field, spec):
    doc = {**BASE, "spec": spec()}
    tracemalloc.start()
    try:
        with pytest.raises(SpecError) as err:
            parse_job(doc)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert field in [p.path for p in err.value.problems], str(err.value)
    assert peak < 64 * 2**20, f"parsing took {peak / 2**20:.0f} MiB"


def test_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    levels = ["a0: &a0 [" + ", ".join(['"lol"'] * 10) + "]"]
    levels += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]  # 10^9 strings
    job = tmp_path / "bomb.yaml"
    job.write_text("apiVersion: paratrain.dev/v1alpha1\nkind: ParallelTrainJob\nmetadata: {name: bomb}\nspec:\n"
                   "  scheduling:\n    affinity:\n      nodeAffinity:\n" + "".join(f"        {x}\n" for x in levels))
    started = time.monotonic()
    with pytest.raises(SpecError) as err:
        load_job(job)
    assert time.monotonic() - started < 10
    assert f"{job}: expands to more than 100000 values" in str(err.value)


def test_python_tags_in_a_job_file_never_run(tmp_path):
    marker = tmp_path / "ran"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(BASE) + f"extra: !!python/object/apply:os.system ['touch {marker}']\n")
    for command in ("validate", "render", "run"):
        proc = subprocess.run([sys.executable, "-m", "paratrain.cli", command, str(job)], capture_output=True,
                              text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 1 and f"{job}: not valid YAML" in proc.stderr, proc.stderr
    assert not marker.exists()
    assert not (tmp_path / "runs").exists(), "nothing may start"


def test_job_model_has_no_field_that_reaches_the_pod_spec_raw():
    """Only `spec.scheduling.affinity` is passed through as free-form data; everything else is typed. A new
    free-form field must be added here on purpose (and fuzzed: see test_spec_fuzz)."""
    free_form = []

    def walk(model, path):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{path}.{field.alias or name}")
            elif "Any" in str(ann):
                free_form.append(f"{path}.{field.alias or name}")

    walk(ParallelTrainJob.model_fields["spec"].annotation, "spec")
    assert free_form == ["spec.scheduling.affinity"]
