"""A rank dies or hangs: `paratrain run` stops the whole gang within a bounded time, leaves no process behind,
and a rerun resumes from the latest complete checkpoint with exactly the uninterrupted run's losses."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from paratrain import contract
from paratrain.launch import STOP_GRACE_SECONDS

from ..trainer.harness import assert_close_curves, layout, run_job
from .gang import INTERVAL, STEPS, checkpointed, fault_env, processes_left, start_run

# Faults land at seeded random places; a failure message names the seed (override: PARATRAIN_CHAOS_SEED).
SEED = int(os.environ.get("PARATRAIN_CHAOS_SEED", "5"))


def complete_checkpoints(ckpt) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in ckpt.glob("step-*") if (p / "manifest.json").is_file())


@pytest.mark.parametrize("victim", [0, 1], ids=["rank0", "rank1"])
def test_sigkilled_rank_stops_the_gang_and_the_rerun_resumes_exactly(victim, reference, tmp_path):
    straight, _ = reference
    kill_after = random.Random(f"{SEED}-kill-{victim}").randint(INTERVAL, STEPS - 1)
    context = f"seed {SEED}: SIGKILL rank {victim} after step {kill_after}"
    ckpt = tmp_path / "ckpt"
    run = start_run(tmp_path, checkpointed(ckpt))
    try:
        run.wait_for_step(kill_after)
        pids = run.rank_pids()
        assert sorted(pids) == [0, 1], context
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.monotonic()
        code = run.proc.wait(timeout=120)
        stopped_in = time.monotonic() - killed
        left = processes_left(run, pids)
    finally:
        run.kill_all()
    assert code != 0, context
    assert stopped_in < 30, f"{context}: the launcher took {stopped_in:.1f}s to stop the gang"
    assert f"rank {victim} exited" in run.stderr() and "stopped the other ranks" in run.stderr(), run.stderr()
    assert left == [], f"{context}: left running: {left}"

    # Training before the last checkpoint is not lost: the checkpoint of the last reported step's interval exists.
    latest = max(complete_checkpoints(ckpt))
    assert latest >= kill_after // INTERVAL * INTERVAL, context
    _, resumed = run_job(tmp_path, checkpointed(ckpt))
    assert resumed["resumed_from_step"] == latest, context
    assert_close_curves(resumed["losses"], straight["losses"], rtol=1e-6)
    assert resumed["val_loss"] == pytest.approx(straight["val_loss"], rel=1e-6)


def test_hung_rank_fails_the_job_on_the_collective_timeout(tmp_path):
    timeout = 10
    victim = random.Random(f"{SEED}-hang").randint(0, 1)
    context = f"seed {SEED}: SIGSTOP rank {victim}"
    run = start_run(tmp_path, layout(data=2) + ["spec.training.steps=100000",
                                                f"spec.runPolicy.collectiveTimeoutSeconds={timeout}"])
    try:
        run.wait_for_step(2)
        pids = run.rank_pids()
        os.kill(pids[victim], signal.SIGSTOP)  # alive, connections open, never answering: a hung rank
        stopped = time.monotonic()
        code = run.proc.wait(timeout=timeout + 120)
        failed_in = time.monotonic() - stopped
        left = processes_left(run, pids)
    finally:
        run.kill_all()
    assert code == contract.EXIT_RETRYABLE, f"{context}: exit {code}\n{run.stderr()}"
    # The survivors' collective gave up after the configured timeout (not sooner: it was the timeout), then the
    # launcher stopped the gang (the hung rank gets SIGKILL after the grace period).
    assert timeout - 1 <= failed_in < timeout + STOP_GRACE_SECONDS + 20, f"{context}: failed after {failed_in:.1f}s"
    assert f"collective timed out (spec.runPolicy.collectiveTimeoutSeconds={timeout})" in run.stderr(), run.stderr()
    assert left == [], f"{context}: left running: {left}"


def rank_1_log_after_out_of_memory(tmp_path, fault: str) -> str:
    """A 2-rank run whose rank 1 meets `fault` (an injected OutOfMemoryError): it exits EXIT_OUT_OF_MEMORY; rank 1's log."""
    run = start_run(tmp_path, layout(data=2), env=fault_env(fault))
    try:
        code = run.proc.wait(timeout=120)
    finally:
        run.kill_all()
    assert code == contract.EXIT_OUT_OF_MEMORY, run.stderr()
    log = (tmp_path / "work" / "logs" / "rank-1.log").read_text()
    return log


def test_out_of_memory_while_building_fails_at_once_with_its_own_exit_code(tmp_path):
    """A layout that does not fit the device fails before any step with EXIT_OUT_OF_MEMORY (permanent: the
    operator fails the job instead of spending backoffLimit on restarts that meet the same error), its reason in
    the termination message the operator shows."""
    log = rank_1_log_after_out_of_memory(tmp_path, "build_oom:1")
    assert ("out of memory while building the model, before any step, on cpu (data 2 × tensor 1 × pipeline 1, fp32): "
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB "
            "is free. This layout needs fewer bytes per device") in log, log
    assert "paratrain validate --memory" in log


def test_out_of_memory_in_a_step_fails_at_once_naming_the_rank_the_step_and_the_bytes(tmp_path):
    """An out-of-memory error in a step (a GPU's OutOfMemoryError, injected) exits EXIT_OUT_OF_MEMORY too, not 1:
    as 1 it was restartable, and the same OOM came back through inPlaceLimit, then backoffLimit. The termination
    message, which the operator shows, names the rank, the step and the bytes torch asked for."""
    log = rank_1_log_after_out_of_memory(tmp_path, "step_oom:1:3")
    assert ("out of memory on rank 1 in step 3 on cpu (data 2 × tensor 1 × pipeline 1, fp32): CUDA out of memory. "
            "Tried to allocate 3.50 GiB.") in log, log
    assert "activation checkpointing" in log and "paratrain validate --memory" in log
