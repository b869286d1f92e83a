"""The trainer on one GPU machine: tokens/s, MFU and peak memory of a 1B-class Llama, side by side in one run, and
each peak against the memory model's prediction.

    bash bench/gpu.sh                 # on a machine with CUDA GPUs: under 10 minutes on one GPU
    bash bench/gpu.sh --dry-run       # anywhere: the same variants on a tiny model on the CPU (tested in the suite)

Variants (each a `paratrain run` of synthetic data, so no dataset is needed, for --steps steps):
- bf16 against fp32, and activation checkpointing none against selective, on one GPU;
- with 2+ GPUs, DDP over all of them against ZeRO-3 (FSDP2 with tensor parallel 2 from 4 GPUs; DeepSpeed on 2).
Each runs 4 sequences per GPU, halved until the memory model predicts it fits the GPU's usable memory
(`fit_batch`: the operator's rule, memory.Headroom).

Model: Llama 3.2 1B's shape (`preset: llama3-1b`, 16 layers, 2048 wide, untied head) with a 128,256-token
vocabulary and 2,048 tokens of context. FLOPs per token are perf.model_flops_per_token: 6N + 12·L·H·Q·T (N the
parameters outside the embedding, L layers, H·Q = embedDim, T the context; no recompute counted), MFU their rate
over the GPU's dense bf16 peak from perf.PEAK_FLOPS (989 TFLOP/s for an H100 SXM), printed with the results.
Peak memory is the allocator's peak of live tensors (torch.cuda.max_memory_allocated), the quantity
paratrain.api.memory predicts; each result carries `predicted_peak_bytes` and their ratio.

Writes bench/results/gpu.json (dry run: bench/results/gpu-dry-run.json, or --out).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from paratrain.api.load import parse_job
from paratrain.api.memory import Headroom, human, predict

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128_256
JOB = {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "gpu-bench"},
       "spec": {"model": {"preset": "llama3-1b", "blockSize": 2048, "vocabSize": VOCAB},
                "data": {"source": "synthetic"},
                "training": {"steps": 20, "batchSize": 4, "evalInterval": 1000, "evalSteps": 1, "warmupSteps": 2,
                             "learningRate": 3e-4},
                "precision": "bf16"}}
# The dry run's stand-in: the same variants, a model a CPU trains in seconds.
DRY_MODEL = {"preset": "debug", "blockSize": 64, "vocabSize": 256}


def variants(gpus: int) -> dict[str, dict]:
    """name → spec overrides (dotted keys)."""
    out = {
        "bf16": {},
        "fp32": {"precision": "fp32"},
        "bf16-selective-ac": {"training.activationCheckpointing": "selective"},
    }
    if gpus >= 2:
        out["bf16-ddp"] = {"parallelism.data": gpus}
        if gpus >= 4:
            out["bf16-zero3-fsdp2"] = {"parallelism.data": gpus // 2, "parallelism.tensor": 2,
                                       "parallelism.zeroStage": 3}
        else:
            out["bf16-zero3-deepspeed"] = {"parallelism.data": gpus, "parallelism.zeroStage": 3}
    return out


def job_for(overrides: dict, dry_run: bool, steps: int) -> dict:
    job = copy.deepcopy(JOB)
    spec = job["spec"]
    spec["training"]["steps"] = steps
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = spec
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    p = spec.setdefault("parallelism", {})
    world = p.get("data", 1) * p.get("tensor", 1) * p.get("pipeline", 1)
    spec["nodes"], spec["procsPerNode"] = 1, world
    spec["training"]["batchSize"] *= p.get("data", 1)  # per-GPU batch fixed
    if dry_run:
        spec["model"] = dict(DRY_MODEL)
        spec["resources"] = {"gpusPerNode": 0}
        if spec.get("precision") == "bf16" and not _cpu_bf16():
            spec["precision"] = "fp32"
    else:
        spec["resources"] = {"gpusPerNode": world}
    return job


def fit_batch(job: dict, device_bytes: int) -> dict:
    """Halve the batch until the memory model predicts every rank's peak within the device's usable memory, by the
    rule the operator and `validate --memory` apply (memory.Headroom: the job's gpuMemoryReserve for the CUDA
    context, NCCL and workspaces, then gpuMemoryFragmentation): the same script runs on a 40 GB or an 80 GB GPU."""
    spec = job["spec"]
    while spec["training"]["batchSize"] > spec["parallelism"].get("data", 1):
        parsed = parse_job(job).spec
        peak = max(r.peak_bytes for r in predict(parsed, spec["model"]["vocabSize"]))
        if peak <= Headroom.of(parsed).usable(device_bytes):
            break
        spec["training"]["batchSize"] //= 2
    return job


def _cpu_bf16() -> bool:
    import torch

    from paratrain.train.parallel.precision import check_device_supports

    try:
        check_device_supports("bf16", torch.device("cpu"), False)
    except ValueError:
        return False
    return True


def run(name: str, job: dict, work: Path, dry_run: bool) -> dict:
    run_dir = work / name
    run_dir.mkdir(parents=True)
    (run_dir / "job.yaml").write_text(yaml.safe_dump(job))
    cmd = [sys.executable, "-m", "paratrain.cli", "run", str(run_dir / "job.yaml"), "--metrics-out",
           str(run_dir / "metrics.json"), "--workdir", str(run_dir / "work"), "--no-progress"]
    if dry_run:
        cmd.append("--measure-memory")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr[-3000:]}
    metrics = json.loads((run_dir / "metrics.json").read_text())
    measured = max(metrics["peak_tensor_bytes"])
    predicted = max(r.peak_bytes for r in predict(parse_job(job).spec, job["spec"]["model"]["vocabSize"]))
    return {"layout": metrics["layout"], "world_size": metrics["world_size"],
            "batch_size": job["spec"]["training"]["batchSize"],
            "tokens_per_second": metrics["tokens_per_second"], "mfu": metrics["mfu"],
            "model_flops_per_token": metrics["model_flops_per_token"],
            "peak_flops_per_device": metrics["peak_flops_per_device"],
            "peak_tensor_bytes": measured, "predicted_peak_bytes": predicted,
            "predicted_over_measured": predicted / measured, "final_loss": metrics["losses"][-1]}


def device_memory() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU: checks the script runs")
    parser.add_argument("--steps", type=int, default=None, help="steps per variant (default 20; dry run 3)")
    parser.add_argument("--out", help="default: bench/results/gpu.json (dry run: gpu-dry-run.json)")
    args = parser.parse_args()
    gpus = gpu_count()
    if not args.dry_run and gpus == 0:
        print("gpu.py: no CUDA GPU here; `bash bench/gpu.sh --dry-run` checks the script on the CPU", file=sys.stderr)
        return 2
    steps = args.steps or (3 if args.dry_run else 20)
    chosen = variants(2 if args.dry_run else gpus)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in chosen.items():
            job = job_for(overrides, args.dry_run, steps)
            if not args.dry_run:
                job = fit_batch(job, device_memory())
            results[name] = run(name, job, Path(tmp), args.dry_run)
            r = results[name]
            if "error" in r:
                print(f"{name}: FAILED\n{r['error']}", file=sys.stderr)
                continue
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (peak unknown)"
            print(f"{name:22} {r['layout']:24} {r['tokens_per_second']:>10,.0f} tok/s  MFU {mfu:>8}  peak "
                  f"{human(r['peak_tensor_bytes'])} (model {human(r['predicted_peak_bytes'])}, "
                  f"{r['predicted_over_measured']:.2f}x)")
    ok = {k: v for k, v in results.items() if "error" not in v}
    if "bf16" in ok and "fp32" in ok:
        print(f"bf16 / fp32 tokens/s: {ok['bf16']['tokens_per_second'] / ok['fp32']['tokens_per_second']:.2f}x")
    if "bf16" in ok and "bf16-selective-ac" in ok:
        plain, selective = ok["bf16"], ok["bf16-selective-ac"]
        print(f"selective AC / none: tokens/s {selective['tokens_per_second'] / plain['tokens_per_second']:.2f}x, "
              f"peak {selective['peak_tensor_bytes'] / plain['peak_tensor_bytes']:.2f}x")
    flops_note = ("FLOPs per token: 6N + 12·L·H·Q·T (perf.model_flops_per_token); MFU against the device's dense "
                  "bf16 peak (perf.PEAK_FLOPS), the same peak for fp32 runs")
    print(flops_note)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / ("gpu-dry-run.json" if args.dry_run
                                                                         else "gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"dry_run": args.dry_run, "gpus": gpus, "steps": steps, "machine": platform.node(),
                               "flops": flops_note, "results": results}, indent=1) + "\n")
    print(f"wrote {out}")
    return 1 if len(ok) < len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
