"""bench/gpu.sh, the benchmark prepared for the day a GPU is at hand, in its CPU dry-run mode: every variant runs
and reports, and the memory model's prediction stays within ±15% of each variant's measured peak (a debug-sized
Llama: another shape than tests/trainer/test_memory_model.py's)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_benchmark_dry_run_runs_every_variant(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    assert set(report["results"]) == {"bf16", "fp32", "bf16-selective-ac", "bf16-ddp", "bf16-zero3-deepspeed"}
    for name, result in report["results"].items():
        assert result["tokens_per_second"] > 0, name
        assert 0.85 <= result["predicted_over_measured"] <= 1.15, (name, result)
    assert "6N + 12·L·H·Q·T" in proc.stdout and f"wrote {out}" in proc.stdout
