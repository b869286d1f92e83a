"""The operator's cost at a 64-pod start, in counts (never times, so a slow CI machine cannot fail it): on the real
control plane, with hollow nodes (the real kube-scheduler binds the pods; nothing runs) and the operator's every
request counted (support/scale.py). bench/operator_scale.py measures the same at 1 to 1,024 pods, with times.

What fails here: a LIST of pods per pass (pod bytes read grow as N²), one pass per pod event (no coalescing),
serial creates (one POST in flight), a status write per pass.
"""

from __future__ import annotations

import pytest

from .support.scale import ScaleRig

pytestmark = pytest.mark.timeout(300)
GANG = 64


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
