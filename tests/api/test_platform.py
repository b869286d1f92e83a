"""The platform file's jobDefaults: merged into a job where it leaves a field at its built-in default, never over
a job's own value; lists and maps gain the entries the job does not name; the merged job is validated again."""

from __future__ import annotations

import pytest

from paratrain.api import SpecError, parse_job, require_cluster_ready
from paratrain.api.platform import Platform, grace_problem, with_job_defaults

DEFAULTS = {"image": "registry.example.com/ml/trainer:1.2",
            "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "TEAM", "value": "platform"}],
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
            "nodeSelector": {"pool": "gpu", "zone": "a"},
            "resources": {"cpu": "16", "memory": "64Gi", "gpuResource": "amd.com/gpu", "extra": {"rdma/ib": 1}},
            "scheduling": {"gang": "volcano", "queue": "research", "priorityClassName": "batch"}}


def job(**spec) -> dict:
    return {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "j"},
            "spec": spec}


def merged(**spec):
    return with_job_defaults(parse_job(job(**spec)), Platform.model_validate({"jobDefaults": DEFAULTS}))


def test_a_job_that_sets_nothing_gets_every_default():
    merged_job, filled = merged()
    s = merged_job.spec
    assert s.image == DEFAULTS["image"] and (s.resources.cpu, s.resources.memory) == ("16", "64Gi")
    assert s.resources.gpu_resource == "amd.com/gpu" and s.resources.extra == {"rdma/ib": 1}
    assert (s.scheduling.gang, s.scheduling.queue, s.scheduling.priority_class_name) == ("volcano", "research",
                                                                                          "batch")
    assert s.scheduling.node_selector == DEFAULTS["nodeSelector"] and len(s.scheduling.tolerations) == 1
    assert [e.name for e in s.pod.env] == ["HF_HUB_OFFLINE", "TEAM"]
    assert set(filled) == {"spec.image", "spec.resources.cpu", "spec.resources.memory", "spec.resources.gpuResource",
                           "spec.resources.extra", "spec.scheduling.gang", "spec.scheduling.queue",
                           "spec.scheduling.priorityClassName", "spec.scheduling.nodeSelector", "spec.pod.env",
                           "spec.scheduling.tolerations"}


def test_the_jobs_own_values_win_and_lists_only_gain_what_it_does_not_name():
    merged_job, filled = merged(image="mine:1", resources={"cpu": "2", "extra": {"rdma/ib": 4}},
                                scheduling={"gang": "kubernetes", "nodeSelector": {"pool": "cpu"}},
                                pod={"env": [{"name": "TEAM", "value": "mine"}]})
    s = merged_job.spec
    assert s.image == "mine:1" and s.resources.cpu == "2" and s.resources.extra == {"rdma/ib": 4}
    assert s.scheduling.gang == "kubernetes" and s.scheduling.queue is None, "a queue is Volcano's only"
    assert s.scheduling.node_selector == {"pool": "cpu", "zone": "a"}
    assert [(e.name, e.value) for e in s.pod.env] == [("HF_HUB_OFFLINE", "1"), ("TEAM", "mine")]
    assert "spec.image" not in filled and "spec.scheduling.queue" not in filled


def test_no_defaults_leave_the_job_untouched():
    original = parse_job(job(nodes=2, parallelism={"data": 2}))
    assert with_job_defaults(original, Platform()) == (original, [])


def test_a_merged_job_that_breaks_a_rule_is_refused_naming_the_field_and_the_defaults():
    platform = Platform.model_validate({"jobDefaults": {"resources": {"gpuResource": "amd.com/gpu"}}})
    bad = parse_job(job(resources={"extra": {"amd.com/gpu": 1}}))
    with pytest.raises(SpecError) as err:
        with_job_defaults(bad, platform)
    [problem] = err.value.problems
    assert problem.path == "spec.resources.extra"
    assert "after the platform's jobDefaults filled spec.resources.gpuResource" in problem.message


def llama(nodes: int, grace: int, **spec) -> dict:
    """A 1B-class Llama (973M parameters + 4,096 per vocabulary entry) on `nodes` nodes of 8 GPUs."""
    return {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "big"},
            "spec": {"nodes": nodes, "procsPerNode": 8, "resources": {"gpusPerNode": 8},
                     "parallelism": {"data": 8 * nodes}, "model": {"preset": "llama3-1b", "vocabSize": 128256},
                     "training": {"batchSize": 8 * nodes}, "checkpoint": {"path": "/ckpt"},
                     "pod": {"terminationGracePeriodSeconds": grace}, **spec}}


def test_a_grace_period_too_short_for_the_stop_save_is_refused_with_the_period_it_needs():
    # 12 bytes x 1.5e9 parameters = 18 GB on one node at 512 MiB/s: 33.5 s + 10 s, and the node keeps 5 s.
    found = grace_problem(parse_job(llama(1, grace=45)).spec, Platform())
    assert found and "estimated at 43 s (16.75 GiB per node" in found and "set it to at least 49" in found, found
    assert grace_problem(parse_job(llama(1, grace=49)).spec, Platform()) is None
    assert grace_problem(parse_job(llama(2, grace=45)).spec, Platform()) is None  # half the share per node
    assert grace_problem(parse_job(llama(1, grace=45)).spec, Platform(checkpoint_bandwidth="2Gi")) is None
    # Nothing to save: no estimate.
    assert grace_problem(parse_job(llama(1, grace=10, checkpoint={})).spec, Platform()) is None


def test_the_operator_refuses_the_short_grace_period_naming_the_field():
    with pytest.raises(SpecError) as info:
        require_cluster_ready(parse_job(llama(1, grace=20)))
    assert [p.path for p in info.value.problems] == ["spec.pod.terminationGracePeriodSeconds"]


def host_job(namespace: str | None, **pod) -> dict:
    doc = job(image="x/y:1", nodes=1, pod=pod)
    if namespace:
        doc["metadata"]["namespace"] = namespace
    return doc


@pytest.mark.parametrize("field, rule", [("hostNetwork", "allowHostNetwork"), ("ipcLock", "allowIpcLock")])
def test_host_access_is_allowed_per_namespace(field, rule):
    """Issue 31: host access was one cluster-wide switch. A list names the namespaces (or glob patterns) whose jobs
    may use it; elsewhere the job is refused naming its namespace and what the platform allows."""
    platform = Platform.model_validate({rule: ["team-rdma", "lab-*"]})
    for namespace in ("team-rdma", "lab-7"):
        require_cluster_ready(parse_job(host_job(namespace, **{field: True})), platform)
    for namespace in ("team-a", None):  # no namespace: kubectl's default
        with pytest.raises(SpecError, match=rf"spec\.pod\.{field}: the platform does not allow .* in namespace "
                                            rf"'{namespace or 'default'}' \(it allows team-rdma, lab-\*\)"):
            require_cluster_ready(parse_job(host_job(namespace, **{field: True})), platform)
    require_cluster_ready(parse_job(host_job("team-a", **{field: True})), Platform.model_validate({rule: True}))
    with pytest.raises(SpecError, match=rf"spec\.pod\.{field}: the platform does not allow [^(]*\(the operator"):
        require_cluster_ready(parse_job(host_job("team-rdma", **{field: True})), Platform())
    require_cluster_ready(parse_job(host_job("team-a")), platform)  # a job that asks for nothing


def test_a_namespace_rule_that_is_not_a_namespace_pattern_is_refused():
    with pytest.raises(ValueError):
        Platform.model_validate({"allowHostNetwork": ["Team A"]})


def test_the_platform_caps_a_jobs_pods_and_the_weight_of_its_gang():
    """Issue 31: one job's gang was rendered whole in the operator's memory (1,024 pods with 240 KB of annotations
    peaked at 266 MiB against a 512 Mi limit, and the standby then took the same job and failed the same way), and
    every job's whole body was kept, however large."""
    heavy = {"annotations": {f"note-{i}": "x" * 20_000 for i in range(3)}}
    require_cluster_ready(parse_job(host_job("team-a", **heavy)), Platform())  # one pod of 60 KB: fine
    many = job(image="x/y:1", nodes=4096, parallelism={"data": 4096}, training={"batchSize": 4096}, pod=heavy)
    with pytest.raises(SpecError, match=r"spec: the gang would weigh about 2\d\d\.\d+ MiB .*4096 pods.*"
                                        r"maxGangBytes \(64\.00 MiB\)"):
        require_cluster_ready(parse_job(many), Platform())
    require_cluster_ready(parse_job(many), Platform.model_validate({"maxGangBytes": "256Mi"}))
    with pytest.raises(SpecError, match=r"spec\.nodes: 4096 pods is more than the platform allows a job .*maxNodes, "
                                        r"512"):
        require_cluster_ready(parse_job(many), Platform.model_validate({"maxNodes": 512, "maxGangBytes": "1Gi"}))
    # One job's spec, whatever its nodes: the operator keeps every job's spec in memory.
    huge = host_job("team-a", env=[{"name": f"NOTE_{i}", "value": "x" * 30_000} for i in range(3)])
    with pytest.raises(SpecError, match=r"spec: the spec is 8\d\.\d+ KiB of JSON, more than the platform's "
                                        r"maxSpecBytes \(64\.00 KiB\)"):
        require_cluster_ready(parse_job(huge), Platform())
    require_cluster_ready(parse_job(huge), Platform.model_validate({"maxSpecBytes": "1Mi"}))

def test_the_platforms_topology_places_jobs_that_give_none_and_a_job_that_breaks_with_it_is_named():
    platform = Platform.model_validate({"jobDefaults": {"scheduling": {
        "topology": {"level": "network.example.com/rack", "mode": "preferred"}}}})
    merged_job, filled = with_job_defaults(parse_job(job(nodes=2, parallelism={"data": 2})), platform)
    t = merged_job.spec.scheduling.topology
    assert (t.level, t.mode, t.ranks_per_domain) == ("network.example.com/rack", "preferred", None)
    assert filled == ["spec.scheduling.topology"]
    own = parse_job(job(nodes=2, parallelism={"data": 2}, scheduling={"topology": {"level": "x.io/block"}}))
    assert with_job_defaults(own, platform)[0].spec.scheduling.topology.level == "x.io/block"
    grouped = Platform.model_validate({"jobDefaults": {"scheduling": {
        "topology": {"level": "x.io/rack", "ranksPerDomain": 4}}}})
    with pytest.raises(SpecError) as refused:
        with_job_defaults(parse_job(job(nodes=2, parallelism={"data": 2})), grouped)
    assert "ranksPerDomain(4) must divide" in str(refused.value) and "jobDefaults filled" in str(refused.value)
