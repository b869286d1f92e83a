"""The operator's cost at a 64-pod start, in counts (never times, so a slow CI machine cannot fail it): on the real
control plane, with hollow nodes (the real kube-scheduler binds the pods; nothing runs) and the operator's every
request counted (support/scale.py). bench/operator_scale.py measures the same at 1 to 1,024 pods, with times.

What fails here: a LIST of pods per pass (pod bytes read grow as N²), one pass per pod event (no coalescing),
serial creates (one POST in flight), a status write per pass.
"""

from __future__ import annotations

import re

import pytest

from paratrain.api.status import JobStatus

from ..support.control_plane import wait_for
from .support.scale import ScaleRig

pytestmark = pytest.mark.timeout(300)
GANG = 64
STATUS_MESSAGE_LIMIT = next(m.max_length for m in JobStatus.model_fields["message"].metadata
                            if hasattr(m, "max_length"))  # the CRD schema's maxLength


@pytest.fixture(scope="module")
def rig(control_plane, tmp_path_factory: pytest.TempPathFactory):
    r = ScaleRig(control_plane, tmp_path_factory.mktemp("scale"), nodes=1)
    yield r
    r.close()


def test_a_64_pod_start_costs_the_api_server_o_n(rig: ScaleRig):
    start = rig.start("scale-64", GANG)
    assert start.aftermath_passes <= 10, start  # the pods' ~3 events each, coalesced
    assert start.aftermath_pod_bytes_read <= 2 * start.gang_bytes, start  # a LIST per pass: ~30x
    assert start.aftermath_job_gets <= 3, start  # the job comes from kopf's watch and our own writes
    assert start.aftermath_status_patches <= 10, start
    assert start.max_pod_posts_in_flight >= 8, start  # slow-start batches of up to 64, not one by one
    # Each pod: its POST; then the job's few status writes, Events and the shared objects, spread over 64.
    assert start.requests_per_pod <= 1.5, start


def test_a_1024_pod_gang_that_cannot_all_be_placed_keeps_a_status_that_fits(rig: ScaleRig):
    """One hollow node holds 128 pods: the other 896 stay Unschedulable, each with the scheduler's message. The
    status groups them by reason, names the first few, and fits the schema (the whole list is about 150 KB)."""
    namespace = "scale-1024"
    rig.plane.create_namespace(namespace)
    rig.submit(namespace, "big", 1024)

    def summarised() -> str:
        message = rig.status(namespace, "big").get("message", "")
        return message if re.search(r"\d+ Unschedulable \(big-0-\d+, big-0-\d+, big-0-\d+ and \d+ more\)", message) \
            else ""
    message = wait_for(summarised, 180, "the status to summarise the unschedulable pods", interval=1)
    status = rig.status(namespace, "big")
    assert len(message) <= 4096 < STATUS_MESSAGE_LIMIT and status["pods"]["expected"] == 1024  # bounded, any size
    assert status["phase"] == "Pending" and "ValidationError" not in rig.log.read_text()
    rig.api.request("DELETE", f"/api/v1/namespaces/{namespace}")
