"""Speed and memory of each parallel mode, measured side by side in one run.

    .venv/bin/python bench/parallel_modes.py [--steps 30] [--out bench/results/parallel_modes.json]

Every layout trains the same model on the same global batches through `paratrain run` (the user's command) and
reports tokens/s and per-rank model-state bytes (params + grads + optimizer state, counted from the tensors each
rank holds). Ratios are against the single-process run measured in the same invocation, so machine load affects
both sides alike. Writes JSON and regenerates the table in docs/benchmarks.md between its markers.

On a 2-core CPU, layouts of more than 2 processes oversubscribe the cores: read their speed ratios as overhead of
the communication pattern on one host, not as scaling. The memory ratios hold on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from doc_section import DOC, write_section

ROOT = Path(__file__).resolve().parents[1]

JOB = {
    "apiVersion": "paratrain.dev/v1alpha1",
    "kind": "ParallelTrainJob",
    "metadata": {"name": "bench"},
    "spec": {
        "model": {"layers": 4, "heads": 4, "embedDim": 128, "blockSize": 64, "vocabSize": 256},
        "training": {"steps": 30, "batchSize": 16, "warmupSteps": 2, "evalInterval": 1000, "evalSteps": 1},
    },
}

LAYOUTS = {
    "single process": {},
    "DP=2 (DDP)": {"data": 2},
    "TP=2": {"tensor": 2},
    "PP=2 1F1B, 4 microbatches": {"pipeline": 2, "microbatches": 4},
    "DP=2 ZeRO-1 (DeepSpeed)": {"data": 2, "zeroStage": 1},
    "DP=2 ZeRO-2 (DeepSpeed)": {"data": 2, "zeroStage": 2},
    "DP=2 ZeRO-3 (DeepSpeed)": {"data": 2, "zeroStage": 3},
    "DP=2 bf16": {"data": 2, "precision": "bf16"},
    "DP=2 x TP=2 ZeRO-3 (FSDP2)": {"data": 2, "tensor": 2, "zeroStage": 3},
}


def run_layout(parallelism: dict, steps: int, tmp: Path) -> dict:
    par = dict(parallelism)
    precision = par.pop("precision", "fp32")
    world = par.get("data", 1) * par.get("tensor", 1) * par.get("pipeline", 1)
    job = json.loads(json.dumps(JOB))
    job["spec"].update({"nodes": world, "parallelism": par, "precision": precision})
    job["spec"]["training"]["steps"] = steps
    job_file, metrics_file = tmp / "job.yaml", tmp / "metrics.json"
    job_file.write_text(yaml.safe_dump(job))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "paratrain.cli", "run", str(job_file), "--no-progress",
                    "--metrics-out", str(metrics_file), "--workdir", str(tmp / "work")],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    m = json.loads(metrics_file.read_text())
    per_rank = [r["params"] + r["grads"] + r["optimizer"] for r in m["model_state_bytes"]]
    return {"world_size": world, "tokens_per_second": m["tokens_per_second"], "wall_seconds":
            time.perf_counter() - started, "state_bytes_max_rank": max(per_rank), "final_loss": m["losses"][-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "parallel_modes.json"))
    args = parser.parse_args()
    results = {}
    for name, par in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            results[name] = run_layout(par, args.steps, Path(tmp))
        print(f"{name:32s} {results[name]['tokens_per_second']:10,.0f} tok/s  "
              f"{results[name]['state_bytes_max_rank'] / 1e6:7.2f} MB/rank", flush=True)
    base = results["single process"]
    for r in results.values():
        r["speed_vs_single"] = r["tokens_per_second"] / base["tokens_per_second"]
        r["state_bytes_vs_single"] = r["state_bytes_max_rank"] / base["state_bytes_max_rank"]
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
              "steps": args.steps, "model": JOB["spec"]["model"], "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    write_doc(report)
    print(f"wrote {args.out} and {DOC}")


def write_doc(report: dict) -> None:
    lines = [f"Measured on {report['machine']}, {report['steps']} steps of a "
             f"{report['model']['layers']}-layer, {report['model']['embedDim']}-wide GPT "
             "(`.venv/bin/python bench/parallel_modes.py`).", "",
             "| layout | ranks | tokens/s | speed vs single | model state per rank (MB) | memory vs single |",
             "|---|---|---|---|---|---|"]
    for name, r in report["results"].items():
        lines.append(f"| {name} | {r['world_size']} | {r['tokens_per_second']:,.0f} | {r['speed_vs_single']:.2f}x | "
                     f"{r['state_bytes_max_rank'] / 1e6:.2f} | {r['state_bytes_vs_single']:.2f}x |")
    write_section("parallel_modes", lines)


if __name__ == "__main__":
    main()
