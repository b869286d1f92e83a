"""Where a topology job's gang landed, on the real control plane and kube-scheduler: two try-out nodes in two racks,
each with room for one pod, and a 2-pod gang that prefers one rack (pod affinity, gang none) cannot have it. The
status lists each rack's node ranks, and a Warning Event names the rank outside its group's rack with the step
time the planner predicts the split costs."""

from __future__ import annotations

from pathlib import Path

import pytest

from .support.cluster import fake_job, fake_trainer_command
from .support.real_cluster import RealCluster
from .support.server import wait_for

pytestmark = pytest.mark.timeout(180)
RACK = "network.example.com/rack"
ONE_POD = {"cpu": "1", "memory": "4Gi", "pods": "8"}


def test_a_gang_split_across_racks_is_shown_by_rack_and_its_outlier_named_with_the_predicted_cost(control_plane,
                                                                                                  tmp_path: Path):
    cluster = RealCluster(control_plane, tmp_path, command=fake_trainer_command, node="rack-a-0", capacity=ONE_POD)
    try:
        control_plane.api.request("PATCH", "/api/v1/nodes/rack-a-0", {"metadata": {"labels": {RACK: "a"}}},
                                  content_type="application/merge-patch+json")
        cluster.add_node("rack-b-0", ONE_POD, labels={RACK: "b"})
        ns = cluster.namespace("placement")
        spec = fake_job(nodes=2, steps=200, step_seconds=0.1)
        spec["scheduling"] = {"topology": {"level": RACK, "mode": "preferred"}}
        cluster.submit(ns, "split", spec)
        status = cluster.wait_phase(ns, "split", "Running", 60)
        placed = status.get("placement") or cluster.wait_phase(ns, "split", "Running", 10).get("placement")
        assert placed and placed["level"] == RACK and placed["splitGroups"] == 1, cluster.diagnostics(ns, "split")
        assert sorted(d["domain"] for d in placed["domains"]) == ["a", "b"], placed
        assert sorted(d["nodeRanks"] for d in placed["domains"]) == ["0", "1"], placed
        # posted right after the status write that carries the placement: it may trail the status by a moment
        events = wait_for(lambda: [e for e in cluster.events(ns, "split") if e["reason"] == "SplitAcrossDomains"], 15,
                          "the SplitAcrossDomains Event")
        assert len(events) == 1 and events[0]["type"] == "Warning", cluster.event_reasons(ns, "split")
        said = events[0]["message"]
        assert "node rank 1 (pod split-0-1 on node rack-" in said and "(node ranks 0-1)" in said, said
        assert "1 group(s) split across domains of network.example.com/rack (mode preferred)" in said, said
        assert "the planner predicts" in said and "s more a step" in said and "on cpu" in said, said
    finally:
        cluster.close()
