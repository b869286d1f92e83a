"""The gang's preflight: a rank that never reaches the rendezvous, or a fabric whose all-reduce is wrong, fails the
job within the preflight bound (here the job's 5-second collectiveTimeoutSeconds), as a retryable failure (exit
75) naming the ranks and the host, instead of hanging until the collective timeout or training on bad sums."""

from __future__ import annotations

import socket
import time

from paratrain import contract
from paratrain.train.preflight import _ranges

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
