"""parallelism mode auto end to end on the real control plane: the operator plans the layout before any pod exists
(for CPU pods, and for the GPU a node's GPU Feature Discovery labels name), writes it to status.plan, the pods run
it (the real trainer, on the test kubelet), and the measurements land beside the predictions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from .support.real_cluster import RealCluster
from .support.server import wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(control_plane, tmp_path: Path, request: pytest.FixtureRequest):
    c = RealCluster(control_plane, tmp_path, node=f"planner-node-{abs(hash(request.node.name)) % 10**6}")
    yield c
    c.close()


def auto_job(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"nodes": 2, "procsPerNode": 1, "parallelism": {"mode": "auto"},
                     "model": {"layers": 2, "heads": 2, "embedDim": 32, "blockSize": 16, "vocabSize": 64},
                     "training": {"steps": 14, "batchSize": 4, "warmupSteps": 1, "evalInterval": 14, "evalSteps": 1},
                     "runPolicy": {"backoffLimit": 0, "collectiveTimeoutSeconds": 30}, **spec}}


def apply(cluster: RealCluster, doc: dict[str, Any], path: Path) -> None:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    applied = cluster.kubectl("apply", "-f", str(path))
    assert applied.returncode == 0, applied.stderr


def test_a_mode_auto_job_runs_the_plan_it_shows_with_the_measurements_beside_the_predictions(
        cluster: RealCluster, ns: str, tmp_path: Path):
    apply(cluster, auto_job("auto", ns), tmp_path / "job.yaml")
    waited = cluster.kubectl("wait", "-n", ns, "--for=condition=Succeeded", "ptj/auto", "--timeout=150s", timeout=170)
    assert waited.returncode == 0, f"{waited.stderr}\n{cluster.diagnostics(ns, 'auto')}"
    st = cluster.status(ns, "auto")
    plan = st["plan"]
    assert plan["accelerator"] == "cpu" and plan["source"] == "CPU pods (resources.gpusPerNode 0)"
    layout = plan["layout"]
    assert layout["nodes"] == 2 and layout["data"] * layout["tensor"] * layout["pipeline"] == 2
    zero = f", ZeRO-{layout['zeroStage']}" if layout["zeroStage"] else ""
    words = f"data {layout['data']} × tensor {layout['tensor']} × pipeline {layout['pipeline']}{zero}"
    assert st["layout"] == f"{words}, fp32 (planned)"
    # The pods ran that layout: the spec every pod reads is the planned one, as a manual spec.
    config = cluster.kubectl("get", "configmap", "-n", ns, "-l", "paratrain.dev/job-name=auto", "-o", "yaml")
    pod_spec = yaml.safe_load(next(iter(yaml.safe_load(config.stdout)["items"][0]["data"].values())))["spec"]
    assert pod_spec["parallelism"]["mode"] == "manual"
    assert {k: pod_spec["parallelism"][k] for k in ("data", "tensor", "pipeline")} == \
        {k: layout[k] for k in ("data", "tensor", "pipeline")}
    # Measured beside predicted: tokens/s (CPU ranks measure no device memory).
    assert plan["measuredAtStep"] == 14 and plan["measuredTokensPerSecond"] > 0
    assert plan["tokensPerSecondError"] == round(plan["measuredTokensPerSecond"] / plan["predictedTokensPerSecond"]
                                                 - 1, 4)
    assert "measuredPeakBytes" not in plan and plan["predictedPeakBytes"] > 0
    planned = [e for e in cluster.events(ns, "auto") if e["reason"] == "Planned"]
    assert len(planned) == 1 and planned[0]["message"].startswith(f"planned: {plan['summary']}, for cpu from CPU pods")
    shown = cluster.kubectl("get", "ptj", "auto", "-n", ns, "-o", "jsonpath={.status.plan.summary}")
    assert shown.stdout == plan["summary"]


def test_a_gpu_job_is_planned_for_the_gpu_its_nodes_labels_name_before_any_pod_exists(
        cluster: RealCluster, ns: str, tmp_path: Path):
    node = cluster.node_api.node
    labelled = cluster.kubectl("label", "node", node, "--overwrite", "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
                               "nvidia.com/gpu.memory=81559", "nvidia.com/gpu.count=8", f"planner-test={ns}")
    assert labelled.returncode == 0, labelled.stderr
    try:
        job = auto_job("gpu", ns, nodes=2, procsPerNode=8, precision="bf16",
                       model={"preset": "llama3-1b", "blockSize": 2048},
                       data={"source": "synthetic", "vocabSize": 128256},
                       training={"steps": 100, "batchSize": 64},
                       resources={"gpusPerNode": 8},
                       scheduling={"nodeSelector": {"planner-test": ns}})
        apply(cluster, job, tmp_path / "gpu.yaml")
        plan = wait_for(lambda: cluster.status(ns, "gpu").get("plan"), 60, "status.plan")
        assert plan["accelerator"] == "H100-80GB", plan
        assert plan["source"] == "1 node(s) labelled nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"
        assert plan["memoryBudgetBytes"] < 81559 * 2**20 and plan["predictedPeakBytes"] <= plan["memoryBudgetBytes"]
        assert plan["considered"] > plan["feasible"] > 1 and len(plan["alternatives"]) == 3
        # The gang it creates runs the plan (it waits for GPUs this test node does not have).
        wait_for(lambda: len(cluster.api.objects("v1/pods", ns)) == plan["layout"]["nodes"], 60,
                 "the gang's pods, as many as the plan's nodes")
    finally:
        cluster.kubectl("label", "node", node, "nvidia.com/gpu.product-", "nvidia.com/gpu.memory-",
                        "nvidia.com/gpu.count-", "planner-test-")
