"""parallelism mode auto in the operator (paratrain_operator.planning): which GPU a gang is planned for, from the
nodes' GPU Feature Discovery labels or the platform; the plan recorded in status.plan, applied back while pods run
it, and measured beside its predictions. The operator's use of it, end to end: test_live_planner.py."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from paratrain.api import hardware, parse_job, planner
from paratrain.api.platform import Platform
from paratrain.api.status import JobStatus
from paratrain_operator import planning, status
from paratrain_operator.gang import GangState

H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.count": "8", "pool": "train"}
A100_40 = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB", "nvidia.com/gpu.memory": "40960",
           "nvidia.com/gpu.count": "8", "pool": "train"}


def job_of(gpus=8, node_selector=None, **parallelism):
    return parse_job({"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "a"},
                      "spec": {"nodes": 2, "procsPerNode": gpus or 2, "precision": "bf16",
                               "parallelism": {"mode": "auto", **parallelism},
                               "model": {"preset": "llama3-1b", "blockSize": 2048},
                               "data": {"source": "synthetic", "vocabSize": 128256},
                               "training": {"batchSize": 64, "steps": 100},
                               "resources": {"gpusPerNode": gpus},
                               "scheduling": {"nodeSelector": node_selector or {}}}})


def test_the_gpu_comes_from_the_labels_of_the_nodes_the_job_may_use():
    target = planning.target_of(job_of().spec, [H100, H100, {"kubernetes.io/hostname": "cpu-1"}], Platform())
    assert target.accelerator.name == "H100-80GB" and target.memory_bytes == 81559 * 2**20
    assert target.source == "2 node(s) labelled nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"
    # Two GPU types the gang may land on: the one with less memory, said so.
    mixed = planning.target_of(job_of().spec, [H100, A100_40], Platform())
    assert mixed.accelerator.name == "A100-40GB" and "the least memory of 2 GPU types" in mixed.source
    # The job's nodeSelector and its GPUs a node rule nodes out.
    picky = planning.target_of(job_of(node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}).spec,
                               [H100, A100_40], Platform())
    assert picky.accelerator.name == "H100-80GB"
    small = dict(A100_40, **{"nvidia.com/gpu.count": "4"})
    assert planning.target_of(job_of().spec, [H100, small], Platform()).accelerator.name == "H100-80GB"


def test_without_labels_the_platform_names_the_gpu_and_its_links():
    platform = Platform.model_validate({"planner": {"gpu": "a100-80gb", "networkBandwidth": "12.5G"}})
    target = planning.target_of(job_of().spec, [], platform)
    assert target.accelerator.name == "A100-80GB" and target.source.startswith("the platform's planner.gpu (no node")
    assert target.accelerator.network_bytes_per_second == 12.5e9  # the profile's
    assert target.accelerator.node_bytes_per_second == hardware.accelerator("A100-80GB").node_bytes_per_second
    assert planning.target_of(job_of().spec, None, platform).accelerator.name == "A100-80GB"  # may not list nodes


def test_the_nodes_labels_say_how_many_ranks_a_topology_domain_holds():
    """GB200 trays (4 GPUs) in two NVLink cliques (GFD's nvidia.com/gpu.clique), 3 trays and 1: a job placed by the
    clique plans tensor parallel across the largest's 12 ranks; placed by a rack label, the largest rack's ranks
    are where a group starts crossing the spine; no topology, neither."""
    def tray(clique: str, rack: str) -> dict[str, str]:
        return {"nvidia.com/gpu.product": "NVIDIA-GB200", "nvidia.com/gpu.memory": "189471",
                "nvidia.com/gpu.count": "4", "nvidia.com/gpu.clique": f"7c3e.{clique}", "x.io/rack": rack}
    nodes = [tray("1", "r1"), tray("1", "r1"), tray("1", "r2"), tray("2", "r2")]

    def target(level: str | None) -> planner.Target:
        job = job_of(gpus=4)
        scheduling = {"topology": {"level": level}} if level else {}
        return planning.target_of(job.spec.model_copy(update={"scheduling": type(job.spec.scheduling)
                                                              .model_validate(scheduling)}), nodes, Platform())
    clique = target("nvidia.com/gpu.clique")
    assert clique.accelerator.name == "GB200-186GB" and clique.accelerator.nvlink_gpus == 12
    assert clique.source.endswith("2 nvidia.com/gpu.clique domain(s), the largest 12 ranks on one NVLink fabric")
    rack = target("x.io/rack")
    assert rack.accelerator.domain_gpus == 8 and rack.accelerator.nvlink_gpus == 72  # the catalogue's NVL72
    assert "2 x.io/rack domain(s), the largest 8 ranks" in rack.source
    assert target(None).accelerator.domain_gpus == 0


@pytest.mark.parametrize("labels,says", [
    ([], "no node the job may use (spec.scheduling.nodeSelector, 8 GPUs or more) carries GPU Feature Discovery's "
         "nvidia.com/gpu.product label"),
    (None, "the operator may not list nodes (a namespaced install)"),
    ([{"nvidia.com/gpu.product": "Tesla-T4", "nvidia.com/gpu.count": "8"}],
     "nodes labelled Tesla-T4: not a GPU paratrain knows"),
])
def test_an_unknown_gpu_is_a_clear_refusal_naming_the_platform_setting(labels, says):
    with pytest.raises(planner.NoPlan) as refused:
        planning.target_of(job_of().spec, labels, Platform())
    assert says in str(refused.value) and "the platform's planner.gpu (a Helm value) names it" in str(refused.value)


def test_cpu_pods_are_planned_for_cpus_without_asking_the_nodes():
    target = planning.target_of(job_of(gpus=0).spec, None, Platform())
    assert target.accelerator is hardware.CPU and target.device == "cpu"


def test_the_plan_recorded_is_what_the_pods_run_and_fits_the_status_schema():
    job = job_of()
    planned, record = planning.plan_now(job, [H100, H100], Platform(), attempt=3)
    assert planned.spec.parallelism.mode == "manual" and planned.spec.world_size == 16
    assert record["attempt"] == 3 and record["accelerator"] == "H100-80GB" and record["feasible"] > 1
    assert planning.recorded(job, record).spec == planned.spec  # a replacement pod runs its peers' layout
    st = status.build(None, GangState(phase="Running", attempt=3), nodes=2, pods=[], stall_timeout=600,
                      generation=1, layout="data 16 × tensor 1 × pipeline 1, bf16", now=datetime.now(timezone.utc),
                      plan=record, progress={"step": 10, "startStep": 0, "totalSteps": 100,
                                             "tokensPerSecond": 1000, "peakMemoryBytes": 2**30})
    assert st["layout"] == "data 16 × tensor 1 × pipeline 1, bf16 (planned)"
    assert st["plan"]["measuredTokensPerSecond"] == 1000 and st["plan"]["measuredPeakBytes"] == 2**30
    assert st["plan"]["tokensPerSecondError"] == round(1000 / record["predictedTokensPerSecond"] - 1, 4)
    JobStatus.model_validate(st)  # what the CRD's status schema is generated from
    # A later pass without a fresh report keeps the measurements.
    again = status.build(st, GangState(phase="Running", attempt=3), nodes=2, pods=[], stall_timeout=600,
                         generation=1, layout="x", now=datetime.now(timezone.utc), plan=st["plan"], progress=None)
    assert again["plan"] == st["plan"]


def test_a_job_nothing_fits_names_the_rejections():
    with pytest.raises(planner.NoPlan, match="no layout fits on 2 node"):
        planning.plan_now(job_of(allow=["data"], memoryHeadroom=0.9), [H100, H100], Platform(), attempt=0)


def test_the_recorded_plan_holds_while_pods_run_it_and_a_fresh_gang_is_planned_again(monkeypatch):
    import asyncio

    from paratrain_operator import observe, reconcile

    nodes = [H100, H100]

    async def labels(_label):
        return nodes

    monkeypatch.setattr(observe, "gpu_node_labels", labels)
    job = job_of()
    running = GangState(phase="Running", attempt=1)
    first, plan = asyncio.run(reconcile._planned(job, {}, [], running))
    assert plan["accelerator"] == "H100-80GB"
    # The cluster's GPUs change while the gang runs: its pods keep the layout they run.
    nodes = [A100_40, A100_40]
    kept, same = asyncio.run(reconcile._planned(job, {"plan": plan}, ["a pod of the job"], running))
    assert same is plan and kept.spec == first.spec
    # A gang created afresh (no pod of the job left: a restart, a resume) is planned for what the cluster has now.
    again, replanned = asyncio.run(reconcile._planned(job, {"plan": plan}, [], GangState(phase="Restarting",
                                                                                         attempt=2)))
    assert replanned["accelerator"] == "A100-40GB" and replanned["attempt"] == 2
    assert reconcile._planned_event(replanned, plan).message.startswith("planned again (a fresh gang): ")
    # Nothing changed: the record (and its measurements) stays.
    measured = dict(plan, measuredTokensPerSecond=5)
    nodes = [H100, H100]
    _, unchanged = asyncio.run(reconcile._planned(job, {"plan": measured}, [], running))
    assert unchanged is measured
    # A finished job is never planned again.
    _, finished = asyncio.run(reconcile._planned(job, {"plan": plan}, [], GangState(phase="Succeeded")))
    assert finished is plan
