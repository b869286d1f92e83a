"""Elastic gangs as tables: sizes a job may take, and the shrink / grow decisions (no cluster, no operator)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

import pytest

from paratrain import contract
from paratrain.api import SpecError, elastic, parse_job
from paratrain.api.platform import require_cluster_ready
from paratrain.api.status import Resize
from paratrain_operator import gang, resize
from paratrain_operator.clock import to_iso
from paratrain_operator.gang import GangState, Policy
from paratrain_operator.observe import PodView
from paratrain_operator.reconcile import _sizes_that_fit, at_its_size
from paratrain_operator.render import gang_objects, probe_pods, render_job

NOW = datetime(2026, 12, 6, 12, 0, 0, tzinfo=timezone.utc)
LONG_AGO = to_iso(NOW - timedelta(minutes=10))
JUST_NOW = to_iso(NOW - timedelta(seconds=5))
UNSCHEDULABLE = "Unschedulable: 0/3 nodes are available: 3 Insufficient cpu."


def job(nodes: int = 4, data: int | None = None, batch: int = 8, accumulation: int = 1, tensor: int = 1,
        elastic_spec: dict | None = None, labels: dict | None = None, **spec):
    return parse_job({"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob",
                      "metadata": {"name": "job", "namespace": "ns", "uid": "u1", **({"labels": labels} if labels else {})},
                      "spec": {"nodes": nodes, "parallelism": {"data": data or nodes // tensor, "tensor": tensor},
                               "model": {"heads": 4, "embedDim": 32},
                               "training": {"batchSize": batch, "gradientAccumulation": accumulation},
                               "checkpoint": {"path": "/ckpt"},
                               "elastic": elastic_spec or {"minNodes": 1, "waitSeconds": 60}, **spec}})


def pod(rank: int, phase: str = "Running", attempt: int = 0, **kw) -> PodView:
    defaults = {"node": f"node-{rank}", "created_at": LONG_AGO}
    return PodView(name=contract.pod_name("job", attempt, rank), attempt=attempt, rank=rank, phase=phase,
                   **(defaults | kw))


def unplaced(rank: int, attempt: int = 0, since: str = LONG_AGO, **kw) -> PodView:
    return pod(rank, "Pending", attempt, node=None, waiting=UNSCHEDULABLE, created_at=since, **kw)


def probe(rank: int, phase: str = "Running", attempt: int = 1, **kw) -> PodView:
    return PodView(name=contract.probe_name("job", attempt, rank), attempt=attempt, rank=rank, phase=phase,
                   probe=True, **({"node": f"node-{rank}"} | kw))


RUNNING = GangState(phase="Running", gang_created=True, start_time=LONG_AGO, last_step=120)


def decide(pods, state=RUNNING, the_job=None, probes=(), now=NOW, progress=None):
    the_job = at_its_size(the_job or job(), state)
    return resize.decide(Policy.from_job(the_job), state, pods, probes, now, progress)


# ---- sizes ---------------------------------------------------------------------------------------------------


def test_sizes_keep_the_micro_batch_and_the_global_batch_by_gradient_accumulation():
    spec = job(nodes=4, batch=8).spec  # 2 sequences a rank per micro-step
    assert elastic.sizes(spec) == (1, 2, 4)  # 3 replicas cannot split 8 sequences into micro-steps of 2
    two = elastic.resized(spec, 2)
    assert (two.nodes, two.parallelism.data, two.training.gradient_accumulation, two.training.batch_size) == (2, 2, 2, 8)
    assert elastic.resized(spec, 3) is None
    assert elastic.largest_within(spec, 3) == 2 and elastic.largest_within(spec, 8, least=2) == 4


def test_sizes_keep_tensor_parallel_groups_whole_and_grow_to_max_nodes():
    spec = job(nodes=4, tensor=2, batch=12, elastic_spec={"minNodes": 2, "maxNodes": 8}).spec  # data 2, micro 6
    assert elastic.sizes(spec) == (2, 4)  # data 1 or 2: 12 sequences in micro-steps of 6 (data 3 or 4 do not divide)
    assert elastic.resized(spec, 2).parallelism.tensor == 2


def test_a_resized_spec_keeps_the_jobs_bounds_so_it_resizes_back():
    spec = job(nodes=4).spec
    two = elastic.resized(spec, 2)
    assert elastic.bounds(two) == (1, 4) and elastic.resized(two, 4).training.gradient_accumulation == 1


def test_an_elastic_job_no_other_size_fits_is_refused_with_why():
    with pytest.raises(SpecError, match=r"spec.elastic.minNodes: no gang size from minNodes\(3\) to 4"):
        require_cluster_ready(job(nodes=4, batch=4, elastic_spec={"minNodes": 3}))


# ---- shrink --------------------------------------------------------------------------------------------------


def test_a_replacement_that_finds_no_place_for_wait_seconds_shrinks_the_gang_to_what_was_placed():
    pods = [pod(0), pod(1), unplaced(2), pod(3)]  # pod 2 was lost; its replacement waits for a node
    decision = decide(pods, GangState(**{**RUNNING.__dict__, "phase": "Restarting"}))
    s = decision.state
    assert (s.attempt, s.nodes, s.phase, s.restarts, s.reason) == (1, 2, "Restarting", 0, "Shrunk")
    assert set(decision.delete_pods) == {p.name for p in pods}  # the fresh gang reuses the hostnames
    assert [e.reason for e in decision.events] == ["ShrinkingGang"]
    assert "from 4 to 2 pods (data 4 → 2, gradient accumulation 1 → 2" in decision.events[0].message
    assert s.resizes == (Resize(time=NOW, attempt=1, from_nodes=4, to_nodes=2, reason="Shrunk", at_step=120,
                                message=s.resizes[0].message),)
    fresh = decide(pods, GangState(**{**RUNNING.__dict__, "phase": "Restarting"}), progress={"step": 131})
    assert fresh.state.resizes[0].at_step == 131  # rank 0's own report, fresher than the status's
    assert "job-0-2: " + UNSCHEDULABLE in s.resizes[0].message


def test_a_pod_waiting_less_than_wait_seconds_waits():
    decision = decide([pod(0), pod(1), unplaced(2, since=JUST_NOW), pod(3)])
    assert decision.state.attempt == 0 and not decision.state.nodes


def test_pods_queued_by_kueue_count_as_unplaced():
    queued = [pod(r, "Pending", node=None, queued=True, waiting="QueuedByKueue: ...") for r in range(4)]
    decision = decide(queued, GangState(phase="Pending", start_time=None))
    assert decision.state.nodes == 2  # nothing placed: one size down


def test_a_gang_placed_all_or_nothing_steps_down_one_size_per_wait():
    decision = decide([unplaced(r) for r in range(4)], GangState(phase="Pending"))
    assert decision.state.nodes == 2
    smaller = decide([unplaced(r, attempt=1) for r in range(2)], decision.state)
    assert smaller.state.nodes == 1 and smaller.state.attempt == 2 and len(smaller.state.resizes) == 2


def test_at_min_nodes_the_gang_waits_for_its_start_timeout_as_before():
    state = GangState(phase="Pending", attempt=1, nodes=1)
    decision = decide([unplaced(0, attempt=1)], state)
    assert decision.state.attempt == 1 and decision.state.phase == "Pending"


def test_a_failed_pod_goes_through_the_failure_policy_first():
    pods = [pod(0), pod(1, "Failed", exit_code=1), unplaced(2), pod(3)]
    decision = decide(pods)
    assert decision.state.reason != "Shrunk" and decision.state.restarts == 1


def test_a_job_without_elastic_never_resizes():
    plain = parse_job({"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "job"},
                       "spec": {"nodes": 4, "parallelism": {"data": 4}}})
    decision = resize.decide(Policy.from_job(plain), RUNNING, [pod(0), pod(1), unplaced(2), pod(3)], [], NOW)
    assert decision.state.attempt == 0 and not decision.create_probes


# ---- grow ----------------------------------------------------------------------------------------------------


SHRUNK = GangState(phase="Running", attempt=1, nodes=2, gang_created=True, start_time=LONG_AGO, last_step=300,
                   resizes=(Resize(time=NOW - timedelta(minutes=5), attempt=1, from_nodes=4, to_nodes=2,
                                   reason="Shrunk", at_step=120, resumed_from_step=100, steps_lost=20),))


TRAINING = {"step": 310, "startStep": 300}  # the shrunk gang's rank 0, ten steps in


def test_a_shrunk_running_gang_asks_for_its_missing_pods_with_placeholders():
    decision = decide([pod(0, attempt=1), pod(1, attempt=1)], SHRUNK)
    assert decision.create_probes == (2, 3) and decision.state.attempt == 1 and not decision.delete_pods


def test_placeholders_that_run_grow_the_gang_at_a_checkpoint_of_the_step_in_flight():
    gang_pods = [pod(0, attempt=1), pod(1, attempt=1)]
    probes = [probe(2), probe(3)]
    assert decide(gang_pods, SHRUNK, probes=probes).state.attempt == 1  # not before the gang has trained a step
    decision = decide(gang_pods, SHRUNK, probes=probes, progress=TRAINING)
    s = decision.state
    assert (s.attempt, s.nodes, s.reason, s.restarts) == (2, 4, "Grown", 0)
    assert set(decision.delete_pods) == {p.name for p in gang_pods + probes}
    assert [e.reason for e in decision.events] == ["GrowingGang"]
    assert s.resizes[-1].model_dump(exclude={"time", "message"}) == {
        "attempt": 2, "from_nodes": 2, "to_nodes": 4, "reason": "Grown", "at_step": 310, "resumed_from_step": None,
        "steps_lost": None}


def test_room_for_one_pod_is_no_size_so_the_gang_keeps_running_and_probing():
    decision = decide([pod(0, attempt=1), pod(1, attempt=1)], SHRUNK, probes=[probe(2), probe(3, "Pending", node=None)],
                      progress=TRAINING)
    assert decision.state.attempt == 1 and not decision.create_probes and not decision.delete_pods


def test_no_growth_within_wait_seconds_of_the_last_resize():
    recent = GangState(**{**SHRUNK.__dict__, "resizes": (SHRUNK.resizes[0].model_copy(update={"time": NOW}),)})
    decision = decide([pod(0, attempt=1), pod(1, attempt=1)], recent, probes=[probe(2), probe(3)], progress=TRAINING)
    assert decision.state.attempt == 1


def test_placeholders_go_when_the_gang_is_not_running_or_at_its_largest():
    failed = [pod(0, attempt=1), pod(1, "Failed", attempt=1, exit_code=1)]
    decision = decide(failed, SHRUNK, probes=[probe(2), probe(3)])
    assert {contract.probe_name("job", 1, 2), contract.probe_name("job", 1, 3)} <= set(decision.delete_pods)
    full = decide([pod(r) for r in range(4)], RUNNING, probes=[probe(2, attempt=0)])
    assert full.delete_pods == (contract.probe_name("job", 0, 2),) and not full.create_probes


def test_the_resized_attempt_records_where_it_resumed_and_the_steps_lost():
    state = GangState(phase="Running", attempt=1, nodes=2, gang_created=True, start_time=LONG_AGO,
                      resizes=(Resize(time=NOW, attempt=1, from_nodes=4, to_nodes=2, reason="Shrunk", at_step=120),))
    decision = decide([pod(0, attempt=1), pod(1, attempt=1)], state, progress={"step": 101, "startStep": 100})
    assert (decision.state.resizes[-1].resumed_from_step, decision.state.resizes[-1].steps_lost) == (100, 20)


# ---- what the operator renders at a size -----------------------------------------------------------------------


def test_the_gang_is_rendered_at_its_size_with_accumulation_making_up_the_batch():
    resized = at_its_size(job(), GangState(nodes=2))
    assert (resized.spec.nodes, resized.spec.parallelism.data, resized.spec.training.gradient_accumulation) == (2, 2, 2)
    assert at_its_size(job(), GangState(nodes=3)).spec.nodes == 4  # a size the spec no longer allows: its own


def test_placeholders_carry_the_gangs_scheduling_but_no_rank_and_under_kueue_a_group_of_their_own():
    queued = job(labels={"kueue.x-k8s.io/queue-name": "team"}, scheduling={"gang": "kubernetes",
                                                                          "nodeSelector": {"pool": "gpu"}})
    [body] = probe_pods(at_its_size(queued, GangState(nodes=2)), "ns", 1, [3], group=2)
    meta, spec = body["metadata"], body["spec"]
    assert meta["name"] == "job-1-probe-3" and meta["labels"][contract.LABEL_PROBE] == "3"
    assert contract.LABEL_NODE_RANK not in meta["labels"]
    assert meta["labels"]["kueue.x-k8s.io/pod-group-name"] == "job-1-probe"
    assert meta["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"
    assert spec["nodeSelector"] == {"pool": "gpu"} and "schedulingGroup" not in spec and "hostname" not in spec
    assert spec["containers"][0]["command"] == contract.PROBE_COMMAND and spec["containers"][0]["env"] == []
    assert spec["containers"][0]["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}


def test_placeholders_of_a_kai_gang_are_no_part_of_its_pod_group():
    """A placeholder under KAI carries none of the gang's group (the pod-group-name, its subgroup): it is placed
    alone by the default scheduler, else KAI would count it in the gang's group."""
    kai = job(nodes=4, batch=8, elastic_spec={"minNodes": 2, "waitSeconds": 60},
              scheduling={"gang": "kai", "topology": {"level": "rack", "ranksPerDomain": 2}})
    running = next(p for p in render_job(at_its_size(kai, GangState(nodes=2)), "ns", 1) if p["kind"] == "Pod")
    assert running["metadata"]["annotations"]["pod-group-name"] == "job"
    assert running["metadata"]["labels"]["kai.scheduler/subgroup-name"] == "group-0"
    for body in probe_pods(at_its_size(kai, GangState(nodes=2)), "ns", 1, [2, 3], group=2):
        assert not {"pod-group-name", "kai.scheduler/skip-podgrouper"} & body["metadata"].get("annotations", {}).keys()
        assert "kai.scheduler/subgroup-name" not in body["metadata"]["labels"] and "schedulerName" not in body["spec"]


GROUP = "paratrain.dev/topology-group"


def required_terms(body: dict) -> list[dict]:
    return body["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


@pytest.mark.parametrize("gang_scheduler", ["kubernetes", "none"])
def test_placeholders_of_a_gang_kept_in_one_domain_share_the_running_pods_domain(gang_scheduler):
    """Placeholders that run anywhere would grow a gang that then finds no domain for itself, waits and shrinks
    again. Whole gang in one rack (the native PodGroup's constraint, or affinity): each placeholder asks for the
    rack of the attempt's running pods (which match the same labels, so the first placeholder follows them)."""
    racked = job(scheduling={"gang": gang_scheduler, "topology": {"level": "rack"}})
    bodies = probe_pods(at_its_size(racked, GangState(nodes=2)), "ns", 1, [2, 3], group=2)
    for body in bodies:
        [term] = required_terms(body)
        assert term == {"labelSelector": {"matchLabels": {contract.LABEL_JOB: "job", contract.LABEL_ATTEMPT: "1"}},
                        "topologyKey": "rack"}
        labels = body["metadata"]["labels"]
        assert (labels[contract.LABEL_JOB], labels[contract.LABEL_ATTEMPT]) == ("job", "1") and GROUP not in labels


def test_placeholders_of_a_gang_with_ranks_per_domain_are_placed_as_whole_groups():
    """ranksPerDomain 2, grown from 2 to 6: ranks 2-3 and 4-5 are the missing groups; each pair shares a domain,
    not necessarily the running pods' (group 0) nor each other's."""
    racked = job(nodes=6, batch=12, elastic_spec={"minNodes": 2, "waitSeconds": 60},
                 scheduling={"topology": {"level": "rack", "ranksPerDomain": 2}})
    bodies = probe_pods(at_its_size(racked, GangState(nodes=2)), "ns", 1, [2, 3, 4, 5], group=4)
    groups = [body["metadata"]["labels"][GROUP] for body in bodies]
    assert groups == ["1", "1", "2", "2"]
    for body, group in zip(bodies, groups, strict=True):
        [term] = required_terms(body)
        assert term["labelSelector"]["matchLabels"] == {contract.LABEL_JOB: "job", contract.LABEL_ATTEMPT: "1",
                                                        GROUP: group}


def test_placeholders_under_kueue_carry_the_topology_as_tas_annotations_on_their_group():
    """Kueue places the placeholders' own pod group: ranksPerDomain as slices of a domain's size (admitted only
    where whole slices fit), with no rank order (placeholders have no rank) and no pod affinity of their own."""
    queued = job(nodes=4, labels={"kueue.x-k8s.io/queue-name": "team"}, elastic_spec={"minNodes": 2},
                 scheduling={"topology": {"level": "rack", "ranksPerDomain": 2}})
    bodies = probe_pods(at_its_size(queued, GangState(nodes=2)), "ns", 1, [2, 3], group=2)
    for body in bodies:
        annotations = body["metadata"]["annotations"]
        assert annotations["kueue.x-k8s.io/podset-slice-required-topology"] == "rack"
        assert annotations["kueue.x-k8s.io/podset-slice-size"] == "2"
        assert "kueue.x-k8s.io/pod-group-pod-index-label" not in annotations
        assert "affinity" not in body["spec"]


def test_policy_of_a_gang_is_its_size():
    assert Policy.from_job(at_its_size(job(), GangState(nodes=2))).nodes == 2
    assert gang.Policy.from_job(job()).elastic is not None


# ---- mode auto: the planner lays out each size ------------------------------------------------------------------


def auto_job(**spec):
    return parse_job({"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob",
                      "metadata": {"name": "job", "namespace": "ns", "uid": "u1"},
                      "spec": {"nodes": 4, "parallelism": {"mode": "auto"}, "model": {"heads": 4, "embedDim": 32},
                               "training": {"batchSize": 8}, "checkpoint": {"path": "/ckpt"},
                               "elastic": {"minNodes": 1, "waitSeconds": 60}, **spec}})


def test_under_mode_auto_every_size_is_the_planners_to_lay_out():
    spec = auto_job().spec
    assert elastic.sizes(spec) == (1, 2, 3, 4) and elastic.problem(spec) is None
    three = elastic.resized(spec, 3)
    assert three.nodes == 3 and three.parallelism.mode == "auto" and elastic.bounds(three) == (1, 4)


def test_a_size_the_planner_finds_no_layout_for_is_passed_over():
    the_job = auto_job()
    policy = Policy.from_job(the_job)
    pods = [pod(0), pod(1), unplaced(2), pod(3)]
    assert resize.decide(policy, RUNNING, pods, [], NOW).state.nodes == 3  # placed: 3 (any size fits auto's rules)
    decision = resize.decide(policy, RUNNING, pods, [], NOW, fits=lambda n: n != 3)
    assert decision.state.nodes == 2 and "the planner lays the new size out afresh" in decision.events[0].message
    assert resize.decide(policy, RUNNING, pods, [], NOW, fits=lambda n: False).state.attempt == 0  # none: it waits


def test_the_operator_asks_the_planner_whether_a_size_fits():
    fits = asyncio.run(_sizes_that_fit(auto_job()))  # CPU pods: the planner's CPU target, no node read
    # 3 ranks cannot split a batch of 8: no data degree divides it, nor 3 pipeline microbatches
    assert (fits(1), fits(2), fits(3), fits(4)) == (True, True, False, True)
    ranked = auto_job(nodes=8, training={"batchSize": 16}, scheduling={"topology": {"level": "x.io/rack",
                                                                                      "ranksPerDomain": 4}})
    fits = asyncio.run(_sizes_that_fit(ranked))
    assert fits(4) and not fits(2)  # 2 ranks do not fill a domain of 4
    assert asyncio.run(_sizes_that_fit(job())) is resize.any_size  # mode manual: its rules alone


@pytest.mark.parametrize("scheduler,count", [("kubernetes", "minCount"), ("volcano", "minMember"),
                                             ("kai", "minMember"), ("coscheduling", "minMember")])
def test_each_attempts_pod_group_asks_for_the_gang_at_its_size(scheduler, count):
    shrunk = at_its_size(job(scheduling={"gang": scheduler}), GangState(nodes=2))
    [group] = [o for o in gang_objects(shrunk, "ns", 3) if o["kind"] == "PodGroup"]
    policy = group["spec"].get("schedulingPolicy", {}).get("gang", group["spec"])
    assert policy[count] == 2
