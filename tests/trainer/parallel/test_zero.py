"""ZeRO stages 1-3 through DeepSpeed (data-parallel-only layouts): parity with the single-process run, mixed
precision, exact resume, and each rank's model-state bytes against the ZeRO paper's per-rank formula.

Every run is a real `paratrain run` job. The model is the parity job's with embedDim 64, so that alignment padding
and the ZeRO-3 parameters kept whole on every rank (norm gains and biases) stay a few percent of the model.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest

from ..harness import MUTANTS, PRECISION_RTOL, TINY_JOB, assert_close_curves, layout, run_job

SMALL = copy.deepcopy(TINY_JOB)
SMALL["spec"]["model"]["embedDim"] = 64


def param_count(model: dict) -> int:
    """Ψ of the GPT in model.py: embeddings, L x (attention 4d², MLP 8d² + 5d, two norms 4d), final norm, head."""
    d, vocab, block, layers = model["embedDim"], model["vocabSize"], model["blockSize"], model["layers"]
    return 2 * vocab * d + block * d + layers * (12 * d * d + 9 * d) + 2 * d


def events(run_dir: Path) -> list[dict]:
    lines = (run_dir / "work" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "step"]


def assert_parity(metrics: dict, reference: dict, rtol: float) -> None:
    """Losses and global gradient norms: Adam with clipping barely notices a gradient that is summed instead of
    averaged, but its norm doubles."""
    assert_close_curves(metrics["losses"], reference["losses"], rtol)
    assert_close_curves(metrics["grad_norms"], reference["grad_norms"], rtol)


@pytest.fixture
def runs(job_runs):
    """The session's shared runs (conftest.job_runs), of the SMALL job unless a spec is given."""
    return lambda name, overrides, env=None, spec=None: job_runs(name, overrides, env=env, spec=spec or SMALL)


def zero_fp32(runs, stage: int):
    """DP=2 ZeRO run in fp32; checkpoints every 5 steps (the resume test restarts it from step 5). The ZeRO-3 run
    also records what each rank holds of the model DeepSpeed is given (in {run_dir}/handoff; the observer changes
    nothing, so every test of that run checks it too)."""
    observe = {"PYTHONPATH": str(MUTANTS), "PARATRAIN_TEST_MUTANT": "record_deepspeed_handoff:{run_dir}/handoff"}
    return runs(f"zero{stage}-dp2", layout(data=2, zeroStage=stage) + [
        "spec.checkpoint.path={run_dir}/ckpt", "spec.checkpoint.interval=5"], env=observe if stage == 3 else None)


@pytest.fixture
def reference(runs):
    """This module's single-process fp32 run, of the SMALL job (conftest's `reference` is the parity job's)."""
    return runs("single-fp32", layout())[1]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_single_process(stage, runs, reference):
    _, metrics = zero_fp32(runs, stage)
    assert metrics["layout"].startswith(f"dp2·tp1·pp1 z{stage}")
    assert_parity(metrics, reference, rtol=1e-4)  # observed ~3e-7: only the summation order differs
    assert reference["losses"][-1] < reference["losses"][0] - 0.5, "the reference must learn, or parity is vacuous"


def test_zero3_never_builds_the_whole_model_on_a_rank(runs):
    """ZeRO-3 builds the model already partitioned (deepspeed.zero.Init) and initialises it one gathered parameter
    at a time: when DeepSpeed is handed the initialised model, each rank holds no whole parameter, only its half
    (padded to whole elements) of every one. Built whole and partitioned by deepspeed.initialize, every rank would
    first hold the whole model (4Ψ bytes) here."""
    run_dir, metrics = zero_fp32(runs, 3)
    psi = param_count(SMALL["spec"]["model"])
    for rank in (0, 1):
        held = json.loads((run_dir / "handoff" / f"rank-{rank}.json").read_text())
        assert sum(p["elements"] for p in held.values()) == psi
        for name, p in held.items():
            assert p["held"] == 0, f"rank {rank} holds all of {name}"
            assert p["partition"] == math.ceil(p["elements"] / 2), f"rank {rank}'s partition of {name}: {p}"


@pytest.mark.parametrize("mutant,stage", [("deepspeed_skips_reduction", 1), ("deepspeed_sums_instead_of_averaging", 3)])
def test_parity_catches_a_broken_deepspeed_reduction(mutant, stage, runs, reference):
    _, metrics = runs(f"{mutant}-z{stage}", layout(data=2, zeroStage=stage),
                      env={"PARATRAIN_TEST_MUTANT": mutant, "PYTHONPATH": str(MUTANTS)})
    with pytest.raises(AssertionError, match="differ"):
        assert_parity(metrics, reference, rtol=1e-4)


# DeepSpeed's bf16/fp16 modes are not autocast: weights, activations and gradients are bf16/fp16 throughout, over an
# fp32 master partition; harness.PRECISION_RTOL bounds their distance from the autocast reference.
def test_bf16_zero2_matches_single_process_bf16(runs):
    _, single = runs("single-bf16", layout() + ["spec.precision=bf16"])
    _, zero = runs("zero2-dp2-bf16", layout(data=2, zeroStage=2) + ["spec.precision=bf16"])
    loss_rtol, norm_rtol = PRECISION_RTOL["bf16"]
    assert_close_curves(zero["losses"], single["losses"], loss_rtol)
    assert_close_curves(zero["grad_norms"], single["grad_norms"], norm_rtol)
    psi = param_count(SMALL["spec"]["model"])
    for rank in zero["model_state_bytes"]:  # DeepSpeed keeps bf16 weights (2Ψ), fp32 master + Adam moments 12Ψ/N
        assert rank["params"] == pytest.approx(2 * psi, rel=0.1), rank
        assert rank["optimizer"] == pytest.approx(12 * psi / 2, rel=0.1), rank


def test_fp16_zero3_skips_an_overflow_step_like_single_process(cpu_fp16, runs, tmp_path):
    """One rank's gradients overflow in step 4 (0-based 3): every rank skips that step and halves the loss scale,
    as the single-process fp16 run does; before and after, the two runs agree. DeepSpeed's fp16 on CPU needs
    native fp16: without it the job is refused before launch, while torch-native layouts (autocast emulates fp16)
    still run fp16."""
    if not cpu_fp16.native:
        assert_fp16_deepspeed_refused(tmp_path / "zero3", env=cpu_fp16.env)
        _, single = run_job(tmp_path / "single", layout() + ["spec.precision=fp16", "spec.training.steps=2"],
                            job=SMALL, env=cpu_fp16.env)
        assert len(single["losses"]) == 2
        return
    single_dir, single = runs("single-fp16-overflow", layout() + ["spec.precision=fp16"],
                              env={**cpu_fp16.env, "PARATRAIN_TEST_MUTANT": "overflow:0:3"})
    zero_dir, zero = runs("zero3-dp2-fp16-overflow", layout(data=2, zeroStage=3) + ["spec.precision=fp16"],
                          env={**cpu_fp16.env, "PARATRAIN_TEST_MUTANT": "overflow:1:3"})
    for run_dir, metrics in ((single_dir, single), (zero_dir, zero)):
        assert metrics["skipped_steps"] == 1
        assert [e["applied"] for e in events(run_dir)] == [True] * 3 + [False] + [True] * 6
        assert math.isinf(metrics["grad_norms"][3])
    loss_rtol, norm_rtol = PRECISION_RTOL["fp16"]
    assert_close_curves(zero["losses"], single["losses"], loss_rtol)
    finite = [i for i in range(10) if i != 3]
    assert_close_curves([zero["grad_norms"][i] for i in finite], [single["grad_norms"][i] for i in finite], norm_rtol)


def assert_fp16_deepspeed_refused(tmp_path: Path, env: dict) -> None:
    proc, _ = run_job(tmp_path, layout(data=2, zeroStage=3) + ["spec.precision=fp16"], job=SMALL, expect_ok=False,
                      env=env)
    assert proc.returncode == 1, proc.stderr
    assert "spec.precision: fp16 with ZeRO" in proc.stderr and "native fp16" in proc.stderr, proc.stderr
    assert not (tmp_path / "work").exists(), "refused before launch: no rank started, no workdir"


def test_zero3_holds_fp32_parameters_whatever_the_cpu_fp16(cpu_fp16, runs):
    """An fp32 job's ZeRO-3 partitions are fp32 (4 bytes a parameter, 4Ψ/N a rank) on every CPU. DeepSpeed 0.19.8's
    zero.Init, given an explicit dtype on a CPU without native fp16, built them in bf16 (2Ψ/N) and trained other
    numerics than the job asked for: deepspeed_engine._build_model lets the config choose the dtype instead."""
    _, metrics = runs("zero3-dp2-fp32-params", layout(data=2, zeroStage=3) + [
        "spec.training.steps=2", "spec.training.evalSteps=1"], env=cpu_fp16.env)
    psi = param_count(SMALL["spec"]["model"])
    for rank in metrics["model_state_bytes"]:
        assert rank["params"] == pytest.approx(4 * psi / 2, rel=0.1), rank


def test_zero3_resume_is_exact(runs, tmp_path):
    """Restart the DP=2 ZeRO-3 job from its step-5 checkpoint: steps 6-10 reproduce the uninterrupted run exactly.
    The checkpoint holds the whole fp32 model and Adam's two moments once (12Ψ bytes, plus DCP's framing of each
    tensor, ~1 KB, and each rank's RNG state: observed 15% more), not once per rank (24Ψ)."""
    straight_dir, straight = zero_fp32(runs, 3)
    psi = param_count(SMALL["spec"]["model"])
    step5 = straight_dir / "ckpt" / "step-00000005"
    assert 12 * psi < sum(p.stat().st_size for p in step5.glob("*.distcp")) < 1.25 * 12 * psi

    shutil.copytree(step5, tmp_path / "ckpt" / step5.name)
    _, resumed = run_job(tmp_path, layout(data=2, zeroStage=3) + [
        f"spec.checkpoint.path={tmp_path / 'ckpt'}", "spec.checkpoint.interval=5"], job=SMALL)
    assert resumed["resumed_from_step"] == 5
    assert resumed["losses"] == straight["losses"]
    assert resumed["grad_norms"] == straight["grad_norms"]
    assert resumed["val_loss"] == straight["val_loss"]


# Per-rank model-state bytes, fp32 Adam, N data-parallel ranks: (params, grads, optimizer) in units of Ψ bytes.
# The ZeRO paper: stage 0 4 + 4 + 8 (Adam's two fp32 moments); stage 1 shards optimizer state (8/N), stage 2 also
# gradients (4/N), stage 3 also parameters (4/N). Two things DeepSpeed does differently, counted as they are held:
# - its optimizer state includes an fp32 master copy of the rank's partition, kept even when the model is fp32:
#   optimizer = 12/N (the paper's K = 12 of mixed precision), not 8/N;
# - at gradient_accumulation_steps 1 it reduces ZeRO-1 gradients bucket by bucket during backward into each
#   partition's owner and frees them, exactly as ZeRO-2 does: stage 1 holds 4/N of gradients, not 4.
ZERO_FORMULA = {
    0: lambda n: (4, 4, 8),  # DDP (TorchEngine)
    1: lambda n: (4, 4 / n, 12 / n),
    2: lambda n: (4, 4 / n, 12 / n),
    3: lambda n: (4 / n, 4 / n, 12 / n),
}
# ZeRO-1/2 keep the whole gradient of a parameter that straddles a partition boundary (up to two per rank, each at
# most one MLP matrix, 4d² of a layer's 12d²): at most 2N/(3L) over 4Ψ/N, so their runs use 24 layers (observed
# ≤ 6%). ZeRO-3 partitions every tensor separately; the norm gains and biases it keeps whole on every rank are
# 1.2% of this model, ≤ 5% over 4Ψ/N at N = 4.
FORMULA_LAYERS = {0: 2, 1: 24, 2: 24, 3: 2}


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_match_zero_formula(stage, dp, runs):
    layers = FORMULA_LAYERS[stage]
    if (stage, dp) == (3, 2):
        _, metrics = zero_fp32(runs, 3)
    else:
        _, metrics = runs(f"memory-z{stage}-dp{dp}", layout(data=dp, zeroStage=stage) + [
            f"spec.model.layers={layers}", "spec.training.steps=2", "spec.training.evalSteps=1"])
    psi = param_count({**SMALL["spec"]["model"], "layers": layers})
    expected = dict(zip(("params", "grads", "optimizer"), (psi * k for k in ZERO_FORMULA[stage](dp))))
    assert len(metrics["model_state_bytes"]) == dp
    for rank in metrics["model_state_bytes"]:
        for kind, want in expected.items():
            assert rank[kind] == pytest.approx(want, rel=0.1), f"rank {rank['rank']} {kind}: {rank[kind]} vs {want}"
