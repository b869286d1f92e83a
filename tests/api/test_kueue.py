"""A job Kueue admits: its queue label is checked before any pod exists, with the field named."""

from __future__ import annotations

from typing import Any

import pytest

from paratrain.api import SpecError, parse_job, require_cluster_ready


def queued(labels: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob",
            "metadata": {"name": "j", "labels": labels}, "spec": spec}


def problems(doc: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        require_cluster_ready(parse_job(doc))
    return {p.path: p.message for p in info.value.problems}


def test_a_queued_job_is_accepted_with_the_native_gang_coscheduling_or_none() -> None:
    for gang in ("none", "kubernetes", "coscheduling"):
        require_cluster_ready(parse_job(queued({"kueue.x-k8s.io/queue-name": "team-a"}, scheduling={"gang": gang})))


@pytest.mark.parametrize("gang,scheduler", [("volcano", "Volcano"), ("kai", "KAI")])
def test_kueue_and_a_gang_scheduler_with_queues_would_both_queue_the_gang(gang: str, scheduler: str) -> None:
    found = problems(queued({"kueue.x-k8s.io/queue-name": "team-a"}, scheduling={"gang": gang}))
    assert f"{scheduler} would queue it again" in found["spec.scheduling.gang"]


@pytest.mark.parametrize("key,kind", [("kueue.x-k8s.io/queue-name", "LocalQueue"),
                                      ("kueue.x-k8s.io/priority-class", "WorkloadPriorityClass")])
def test_a_label_that_cannot_name_a_kueue_object_is_refused(key: str, kind: str) -> None:
    found = problems(queued({key: "Team_A"}))
    assert found == {f"metadata.labels[{key}]": f"must name a Kueue {kind} (a lowercase DNS name of at most 63 "
                                               "characters), got 'Team_A'"}
