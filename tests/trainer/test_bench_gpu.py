"""bench/gpu.sh, the benchmark prepared for the day a GPU is at hand, in its CPU dry-run mode: every variant runs
and reports, and the memory model's prediction stays within ±15% of each variant's measured peak (a debug-sized
Llama: another shape than tests/trainer/test_memory_model.py's)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_benchmark_dry_run_runs_every_variant(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    assert set(report["results"]) == {"bf16", "fp32-tf32", "bf16-selective-ac", "bf16-full-ac", "bf16-ddp",
                                      "bf16-zero3-deepspeed"}
    for name, result in report["results"].items():
        assert result["tokens_per_second"] > 0 and result["steps_left_out_of_the_rate"] == 1, name  # 3 steps
        assert 0.85 <= result["predicted_over_measured"] <= 1.15, (name, result)
        # Measured less predicted, per term, adds up to the whole peak's difference (the largest rank's).
        terms = result["measured_minus_predicted"]
        assert set(terms) == {"params", "grads", "optimizer", "rest_of_the_peak"}, name
        if result["world_size"] == 1:
            assert sum(terms.values()) == result["peak_tensor_bytes"] - result["predicted_peak_bytes"], (name, terms)
        assert result["peak_reserved_bytes"] is None, name  # no allocator reserves on the CPU
    assert "6N + 12·L·H·Q·T" in proc.stdout and f"wrote {out}" in proc.stdout
    assert report["planner"]["computeEfficiency"] > 0 and "set the platform's planner.computeEfficiency" in proc.stdout
    # The attention verdicts: every precision x head layout, paratrain's aim beside torch's checks and its reasons
    # (on CPU tensors every CUDA kernel is ruled out, each with torch's words for why).
    attention = report["attention"]
    assert set(attention) == {f"{p}/{h}" for p in ("fp32", "bf16", "fp16") for h in ("mha", "gqa")}, attention
    for case, verdict in attention.items():
        assert verdict["aimed"] == "cpu flash" and set(verdict["usable"]) == {"flash", "memory-efficient", "cudnn"}
        assert not any(verdict["usable"].values()) and all(verdict["why_not"].values()), (case, verdict)
    assert "cuda device" in " ".join(attention["bf16/gqa"]["why_not"]["flash"])
    assert "attention bf16/gqa" in proc.stdout
    assert report["step_syncs"] == {"host_reads_per_step": [1, 1, 1], "cuda_syncs_per_step": [None, None, None]}


def test_the_batch_is_the_largest_the_memory_model_fits_in_85_percent_of_usable_memory():
    """fit_batch on an 80 GiB GPU for the 1B Llama: the largest power-of-two batch predicted within 85% of the
    usable memory (the operator's headroom), and its double is not."""
    gpu = bench_gpu()

    from paratrain.api.load import parse_job
    from paratrain.api.memory import Headroom, predict

    device = 80 * 2**30
    job = gpu.fit_batch(gpu.job_for({}, dry_run=False, steps=20), device)
    spec = parse_job(job).spec
    budget = 0.85 * Headroom.of(spec).usable(device)

    def peak(batch: int) -> int:
        job["spec"]["training"]["batchSize"] = batch
        return max(r.peak_bytes for r in predict(parse_job(job).spec, gpu.VOCAB))

    batch = spec.training.batch_size
    assert batch >= 1 and peak(batch) <= budget < peak(2 * batch)


def bench_gpu():
    import importlib.util

    loader = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def test_the_compute_efficiency_it_reports_is_the_one_at_which_the_planner_predicts_the_measured_step():
    """Issue 43's calibration: a run whose measured tokens/s the time model predicts at 55% of peak is reported as
    planner.computeEfficiency 0.55, for a one-GPU run and with activation checkpointing (its recompute priced in)."""
    from dataclasses import replace

    from paratrain.api import hardware, planner
    from paratrain.api.load import parse_job

    gpu_bench, h100 = bench_gpu(), hardware.accelerator("H100-80GB")
    for overrides in ({}, {"training.activationCheckpointing": "full"}):
        job = gpu_bench.job_for(overrides, dry_run=False, steps=20)
        spec = parse_job(job).spec
        step = planner.step_time(spec, gpu_bench.VOCAB, replace(h100, compute_efficiency=0.55), 1)["total"]
        tokens_per_second = spec.training.batch_size * spec.model.block_size / step
        assert gpu_bench.compute_efficiency(job, tokens_per_second, h100) == pytest.approx(0.55, abs=1e-4)
    assert gpu_bench.compute_efficiency(job, 1e12, h100) is None  # faster than the optimizer alone: no answer
