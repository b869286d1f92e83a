"""Resume is exact: a run killed after a checkpoint and started again reproduces the uninterrupted run's curve."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

import pytest

from paratrain import contract

from .harness import MUTANTS, TINY_JOB, assert_close_curves, forced_cpu_fp16_env, job_env, layout, run_job


def _checkpointed(tmp: Path, data: int, zero: int, accumulation: int = 1) -> list[str]:
    return layout(data=data, zeroStage=zero) + [f"spec.checkpoint.path={tmp / 'ckpt'}", "spec.checkpoint.interval=4",
                                                 "spec.training.steps=10",
                                                 f"spec.training.gradientAccumulation={accumulation}"]


# DeepSpeed once, with accumulation: its save and restore are the same without it, and the micro-step boundary is
# what a resume can get wrong (a second DeepSpeed case cost 20 s of the suite and covered nothing more).
@pytest.mark.parametrize("data,zero,accumulation", [(2, 0, 1), (2, 1, 2)],
                         ids=["dp2-ddp", "dp2-zero1-deepspeed-accumulating"])
def test_killed_run_resumes_exactly(data, zero, accumulation, tmp_path):
    _, straight = run_job(tmp_path / "straight", _checkpointed(tmp_path / "straight", data, zero, accumulation))

    crashed_dir = tmp_path / "crashed"
    overrides = _checkpointed(crashed_dir, data, zero, accumulation)
    proc, _ = run_job(crashed_dir, overrides, expect_ok=False,
                      env={"PARATRAIN_TEST_MUTANT": "crash:1:6", "PYTHONPATH": str(MUTANTS)})
    assert proc.returncode != 0, "the launcher must report a killed rank"
    assert "rank 1 exited" in proc.stderr
    assert sorted(p.name for p in (crashed_dir / "ckpt").glob("step-*")) == ["step-00000004"]

    checkpoint_bytes = sum(f.stat().st_size for f in (crashed_dir / "ckpt" / "step-00000004").iterdir())
    _, resumed = run_job(crashed_dir, overrides)
    assert resumed["resumed_from_step"] == 4
    assert_close_curves(resumed["losses"], straight["losses"], rtol=1e-6)
    assert_close_curves(resumed["grad_norms"], straight["grad_norms"], rtol=1e-6)
    assert resumed["val_loss"] == pytest.approx(straight["val_loss"], rel=1e-6)
    events = [json.loads(line) for line in (crashed_dir / "work" / "events.jsonl").read_text().splitlines()]
    assert {"event": "resume", "step": 4}.items() <= next(e for e in events if e["event"] == "resume").items()
    assert_host_phases_measured(resumed, checkpoint_bytes)


def assert_host_phases_measured(metrics: dict, checkpoint_bytes: int) -> None:
    """Every rank reports its peak resident set and bytes read while it built, resumed and saved (the figures are
    bench/host_memory.py's; here, that they are each rank's own and consistent): a phase's peak is at least the
    resident set it started from and at most the rank's peak over the run, and a resume read at least this rank's
    share of the checkpoint's files."""
    world = metrics["world_size"]
    assert len(metrics["host_phases"]) == world
    for rank, phases in enumerate(metrics["host_phases"]):
        assert set(phases) == {"build", "resume", "save"}, phases
        for name, f in phases.items():
            # The run's peak counts every phase's (read by their own counters at other moments: CI runs saw a
            # phase 4 KiB, then 92 KiB, above the run's own VmHWM before the run took the larger).
            assert 0 < f["startRssBytes"] <= f["peakRssBytes"] <= metrics["peak_memory_bytes"][rank], (rank, name, f)
        assert phases["resume"]["bytesRead"] >= checkpoint_bytes / world, (rank, phases["resume"], checkpoint_bytes)


def test_a_stopped_run_checkpoints_the_step_in_flight_and_resumes_exactly(tmp_path):
    """SIGTERM to rank 1 as it starts step 6 (0-based), with checkpoints only at the end: every rank finishes the
    step, they all save step 7 together and exit 76; the rerun resumes at 7 and its curve is the straight run's."""
    only_at_the_end = ["spec.checkpoint.interval=0"]
    _, straight = run_job(tmp_path / "straight", _checkpointed(tmp_path / "straight", 2, 0) + only_at_the_end)
    stopped_dir = tmp_path / "stopped"
    overrides = _checkpointed(stopped_dir, 2, 0) + only_at_the_end
    proc, _ = run_job(stopped_dir, overrides, expect_ok=False,
                      env={"PARATRAIN_TEST_MUTANT": "sigterm:1:6", "PYTHONPATH": str(MUTANTS)})
    assert proc.returncode == contract.EXIT_PREEMPTED, proc.stderr[-3000:]
    assert sorted(p.name for p in (stopped_dir / "ckpt").glob("step-*")) == ["step-00000007"]
    events = [json.loads(line) for line in (stopped_dir / "work" / "events.jsonl").read_text().splitlines()]
    stopped = next(e for e in events if e["event"] == "preempted")
    assert stopped["step"] == 7 and stopped["saved"] and 0 < stopped["saveSeconds"] < 60  # what the grace must fit
    _, resumed = run_job(stopped_dir, overrides)
    assert resumed["resumed_from_step"] == 7
    assert_close_curves(resumed["losses"], straight["losses"], rtol=1e-6)
    assert resumed["val_loss"] == pytest.approx(straight["val_loss"], rel=1e-6)


@pytest.mark.parametrize("zero,first,then", [(0, "fp32", "bf16"), (1, "fp16", "bf16")],
                         ids=["dp2-ddp-fp32-to-bf16", "dp2-zero1-deepspeed-fp16-to-bf16"])
def test_run_resumes_under_another_precision(zero, first, then, tmp_path):
    """spec.precision may change between restarts (bf16 after fp16 overflow trouble, say): both engines keep fp32
    master weights and optimizer state in every precision, so the checkpoint loads and training goes on. DeepSpeed's
    fp16 needs a CPU with native fp16: its jobs run as on one, on every CPU (test_zero checks the refusal)."""
    overrides = _checkpointed(tmp_path, 2, zero)
    env = forced_cpu_fp16_env(native=True) if zero and "fp16" in (first, then) else None
    _, straight = run_job(tmp_path / "straight", overrides + [f"spec.precision={first}"], env=env)
    shutil.rmtree(tmp_path / "ckpt" / "step-00000010")  # the restart finds step 8, the newest left

    _, resumed = run_job(tmp_path / "resumed", overrides + [f"spec.precision={then}"], env=env)
    assert resumed["resumed_from_step"] == 8
    assert resumed["skipped_steps"] == 0
    assert_close_curves(resumed["losses"], straight["losses"], rtol=5e-3)  # bf16 rounding: test_parity's bound


def test_a_pipeline_and_tensor_parallel_run_with_dropout_resumes_exactly(tmp_path):
    """pp2×tp2 with dropout: torch's pipeline runs a metadata forward on the first step of every run (so on the
    resumed run's first step too, not only the uninterrupted run's step 0). It must not advance tensor parallel's
    dropout stream, or the resumed step draws other masks."""
    overrides = layout(pipeline=2, tensor=2, microbatches=2) + [
        f"spec.checkpoint.path={tmp_path / 'ckpt'}", "spec.checkpoint.interval=2", "spec.training.steps=4",
        "spec.model.dropout=0.2"]
    _, straight = run_job(tmp_path / "straight", overrides)
    shutil.rmtree(tmp_path / "ckpt" / "step-00000004")  # the rerun finds step 2
    _, resumed = run_job(tmp_path / "resumed", overrides)
    assert resumed["resumed_from_step"] == 2
    assert_close_curves(resumed["losses"], straight["losses"], rtol=1e-6)


def test_a_job_with_only_a_checkpoint_path_checkpoints_by_minutes_of_training(tmp_path):
    """checkpoint.interval unset: rank 0's clock decides when intervalMinutes of training have passed, and every
    rank saves at that step (the flag rides in the loss's all-reduce). 1e-6 minutes: after every step."""
    ckpt = tmp_path / "ckpt"
    overrides = layout(data=2) + [f"spec.checkpoint.path={ckpt}", "spec.checkpoint.intervalMinutes=0.000001",
                                  "spec.checkpoint.keep=100"]
    proc, _ = run_job(tmp_path, overrides)
    steps = sorted(int(p.name.removeprefix("step-")) for p in ckpt.glob("step-*"))
    assert len(steps) >= 5 and steps[-1] == 10, steps  # TINY_JOB: 10 steps
    assert f"checkpoints in {ckpt} every 1e-06 minutes of training, keeping 100" in proc.stderr


def test_ctrl_c_of_paratrain_run_saves_the_step_in_flight(tmp_path):
    """Ctrl-C (SIGINT to the launcher): the ranks get SIGTERM, save the step they are in together, and exit; the
    run reports the interruption (130) and the checkpoint is there to resume from.

    No wall-clock limit of its own on the stop: the launcher bounds it (SAVE_GRACE_SECONDS, then SIGKILL), and a
    fixed limit here failed on a busy machine. The run's stderr goes to a file, which never blocks the launcher as
    an unread pipe would; pytest's timeout guards a hang."""
    tmp_path.mkdir(exist_ok=True)
    job = {**TINY_JOB, "spec": {**TINY_JOB["spec"], "training": {**TINY_JOB["spec"]["training"], "steps": 100000}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cmd = [sys.executable, "-m", "paratrain.cli", "run", str(tmp_path / "job.yaml"), "--workdir",
           str(tmp_path / "work"), "--no-progress", *(f"--set={s}" for s in layout(data=2)),
           f"--set=spec.checkpoint.path={tmp_path / 'ckpt'}", "--set=spec.checkpoint.interval=0"]
    with open(tmp_path / "stderr.log", "w") as stderr_file:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env({}), stderr=stderr_file, text=True)
    try:
        events = tmp_path / "work" / "events.jsonl"
        while not (events.exists() and '"step": 20' in events.read_text()):
            assert proc.poll() is None, "the run ended before step 20"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        proc.wait()
    finally:
        proc.kill()
    stderr = (tmp_path / "stderr.log").read_text()
    assert proc.returncode == 130, stderr[-2000:]
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))
    assert len(saved) == 1 and int(saved[0].removeprefix("step-")) >= 20, (saved, stderr[-2000:])
    stops = [e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "preempted"]
    assert [(e["step"], e["saved"]) for e in stops] == [(int(saved[0].removeprefix("step-")), True)]
