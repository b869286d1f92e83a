"""The gang's liveness: a rank that never reaches the rendezvous, or a fabric whose all-reduce is wrong, fails the
job within the preflight bound (here the job's 5-second collectiveTimeoutSeconds), as a retryable failure (exit
75) naming the ranks and the host, instead of hanging until the collective timeout or training on bad sums; a rank
that hangs mid-training fails its peers within that timeout on every group, the hung rank named."""

from __future__ import annotations

import datetime
import re
import socket
import time

import torch
import torch.distributed as dist

from paratrain import contract
from paratrain.train.preflight import _ranges, fabric_links, wait_everywhere

from .harness import MUTANTS, layout, run_job

FAST = ["spec.runPolicy.collectiveTimeoutSeconds=5", "spec.training.steps=2"]


def test_a_rank_that_never_arrives_fails_the_gang_fast_and_named(tmp_path):
    started = time.monotonic()
    proc, _ = run_job(tmp_path, layout(data=2) + FAST, expect_ok=False,
                      env={"PARATRAIN_TEST_MUTANT": "absent:1", "PYTHONPATH": str(MUTANTS)})
    assert time.monotonic() - started < 60
    assert proc.returncode == contract.EXIT_RETRYABLE, proc.stderr[-3000:]
    log = (tmp_path / "work" / "logs" / "rank-0.log").read_text()
    assert f"preflight: rank 0 on {socket.gethostname()}: rank(s) 1 of 2 did not reach the rendezvous" in log, log
    assert "within 5 s" in log and "the gang should restart" in log


def test_an_all_reduce_with_a_wrong_sum_fails_the_preflight(tmp_path):
    proc, _ = run_job(tmp_path, layout(data=2) + FAST, expect_ok=False,
                      env={"PARATRAIN_TEST_MUTANT": "fabric_drops_the_all_reduce", "PYTHONPATH": str(MUTANTS)})
    assert proc.returncode == contract.EXIT_RETRYABLE, proc.stderr[-3000:]
    log = (tmp_path / "work" / "logs" / "rank-0.log").read_text()
    assert "the gloo all-reduce summed to 1, not 2: the fabric corrupts data" in log, log


def test_rank_lists_read_as_ranges():
    assert _ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10" and _ranges([4]) == "4"


def test_a_rank_asleep_before_a_tensor_parallel_all_reduce_fails_the_gang_within_the_timeout_named(tmp_path):
    """dp 2 x tp 2: rank 3 sleeps before a TP all-reduce at step 2. Its TP peer (rank 2) waits on the TP subgroup,
    the other two on the DP subgroup; both subgroups wait the job's 5 s (c10d's default would be 30 minutes on
    gloo), then a roll call names rank 3, and every rank has stopped within 30 s of the hang."""
    proc, _ = run_job(tmp_path, layout(data=2, tensor=2) + ["spec.runPolicy.collectiveTimeoutSeconds=5",
                                                            "spec.training.steps=6"],
                      expect_ok=False, timeout=240,
                      env={"PARATRAIN_TEST_MUTANT": "asleep:3:2", "PYTHONPATH": str(MUTANTS)})
    stopped = time.time()
    assert proc.returncode == contract.EXIT_RETRYABLE, proc.stderr[-3000:]
    logs = tmp_path / "work" / "logs"
    asleep = re.search(r"mutant: rank 3 falls asleep at ([0-9.]+)", (logs / "rank-3.log").read_text())
    assert asleep, (logs / "rank-3.log").read_text()[-3000:]
    assert stopped - float(asleep[1]) < 30
    log = (logs / "rank-2.log").read_text()
    assert "a collective timed out (spec.runPolicy.collectiveTimeoutSeconds=5)" in log, log[-3000:]
    assert "rank(s) 3 did not answer the roll call within 5 s" in log, log[-3000:]


def test_groups_made_after_the_set_up_wait_the_jobs_timeout(one_rank_group):
    """c10d gives a group made without a timeout its module default (30 minutes on gloo); the trainer sets that
    default to the job's timeout once, so the mesh's, the checkpoints' and DeepSpeed's groups all wait it. The
    session's one default group is used: a second init in the same process fails (xdist runs many modules in one)."""
    from torch.distributed import distributed_c10d

    saved = distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout
    try:
        wait_everywhere(datetime.timedelta(seconds=7))
        group = dist.new_group(backend="gloo")
        assert group._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(seconds=7)
        dist.destroy_process_group(group)
    finally:
        distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout = saved


def test_a_gpu_job_also_proves_the_gloo_link_its_checkpoints_use():
    assert fabric_links("nccl", torch.device("cuda", 0)) == [("nccl", torch.device("cuda", 0)),
                                                              ("gloo", torch.device("cpu"))]
    assert fabric_links("gloo", torch.device("cpu")) == [("gloo", torch.device("cpu"))]
