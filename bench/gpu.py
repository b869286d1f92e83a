"""The trainer on one GPU machine: tokens/s, MFU and peak memory of a 1B-class Llama, side by side in one run, and
each peak against the memory model's prediction.

    bash bench/gpu.sh                 # on a machine with CUDA GPUs: under 10 minutes on one GPU
    bash bench/gpu.sh --dry-run       # anywhere: the same variants on a tiny model on the CPU (tested in the suite)

Variants (each a `paratrain run` of synthetic data, so no dataset is needed, for --steps steps, each stopped and
reported after --variant-timeout):
- on one GPU, every variant it can run: bf16; fp32 with TF32 tensor cores (spec.tf32, how fp32 is run on GPUs);
  bf16 with selective and with full activation checkpointing;
- with 2+ GPUs (torchrun-style, one process each), DDP over all of them and ZeRO-3 (FSDP2 with tensor parallel 2
  from 4 GPUs; DeepSpeed on 2-3).
Each runs the largest per-GPU batch (a power of two up to 64) the memory model predicts within 85% of the GPU's
usable memory (`fit_batch`: the operator's rule, memory.Headroom). A driver too old for torch's CUDA build is
named as such.

Model: Llama 3.2 1B's shape (`preset: llama3-1b`, 16 layers, 2048 wide, untied head) with a 128,256-token
vocabulary and 2,048 tokens of context. FLOPs per token are perf.model_flops_per_token: 6N + 12·L·H·Q·T (N the
parameters outside the embedding, L layers, H·Q = embedDim, T the context; no recompute counted), MFU their rate
over the GPU's dense bf16 peak from perf.PEAK_FLOPS (989 TFLOP/s for an H100 SXM), printed with the results.
Tokens/s and MFU are at steady state (the steps after each run's first: perf.SteadyRate). Peak memory is the
allocator's peak of live tensors (torch.cuda.max_memory_allocated), the quantity paratrain.api.memory predicts;
each result carries `predicted_peak_bytes` and their ratio, measured less predicted bytes per term
(`measured_minus_predicted`: params, grads, optimizer, the rest of the peak; the memory model's CUDA terms, which
only a GPU can check), and the allocator's reserved peak beside it; and the compute efficiency at which the
planner's time model predicts the measured step (`planner_compute_efficiency`), the bf16 variant's printed as the
platform's `planner.computeEfficiency` to set (JSON key `planner`).

Also the host syncs of one training step (`step_syncs`: HostReads' count, and on a GPU torch's sync debug
mode's), and for each precision and head layout, the attention kernel paratrain aims at beside torch's own verdicts
(`can_use_flash_attention` etc., debug on) and its reasons for each kernel it rules out (`attention_verdicts`).

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
from dataclasses import replace
from pathlib import Path

import yaml

from paratrain.api import hardware, planner
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
    """name → spec overrides (dotted keys): every variant one GPU runs, then with 2+ GPUs the multi-GPU ones."""
    out = {
        "bf16": {},
        "fp32-tf32": {"precision": "fp32", "tf32": True},  # fp32 as GPU users run it: TF32 tensor cores
        "bf16-selective-ac": {"training.activationCheckpointing": "selective"},
        "bf16-full-ac": {"training.activationCheckpointing": "full"},
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


def fit_batch(job: dict, device_bytes: int, share: float = 0.85, most: int = 64) -> dict:
    """The largest per-GPU batch (a power of two, at most `most`) whose predicted peak stays within `share` of the
    device's usable memory, by the rule the operator and `validate --memory` apply (memory.Headroom: the job's
    gpuMemoryReserve for the CUDA context, NCCL and workspaces, then gpuMemoryFragmentation); at least 1. The same
    script fills a 40 GB or a 141 GB GPU alike."""
    spec = job["spec"]
    dp = spec["parallelism"].get("data", 1)

    def fits(per_gpu: int) -> bool:
        spec["training"]["batchSize"] = per_gpu * dp
        parsed = parse_job(job).spec
        peak = max(r.peak_bytes for r in predict(parsed, spec["model"]["vocabSize"], "cuda"))
        return peak <= share * Headroom.of(parsed).usable(device_bytes)

    per_gpu = 1
    while per_gpu * 2 <= most and fits(per_gpu * 2):
        per_gpu *= 2
    spec["training"]["batchSize"] = per_gpu * dp
    return job


def _cpu_bf16() -> bool:
    import torch

    from paratrain.train.parallel.precision import check_device_supports

    try:
        check_device_supports("bf16", torch.device("cpu"), False)
    except ValueError:
        return False
    return True


def compute_efficiency(job: dict, tokens_per_second: float, gpu: hardware.Accelerator | None) -> float | None:
    """The compute efficiency at which the planner's time model (planner.step_time) predicts this run's measured
    step: its compute and bubble priced at the whole peak, over the measured step less the model's other parts
    (the optimizer's update, communication). What the platform's planner.computeEfficiency should state. None where
    the catalogue lacks the GPU or the other parts alone outlast the measured step. (Exact for one GPU; with more,
    the exposed data-parallel reduction depends on the compute time too.)"""
    if gpu is None or not tokens_per_second:
        return None
    spec = parse_job(job).spec
    parts = planner.step_time(spec, spec.model.vocab_size, replace(gpu, compute_efficiency=1.0), spec.procs_per_node)
    at_peak = parts["compute"] + parts["bubble"]
    measured = spec.training.batch_size * spec.model.block_size / tokens_per_second
    rest = parts["total"] - at_peak
    return round(at_peak / (measured - rest), 4) if measured > rest else None


def accelerator(dry_run: bool) -> hardware.Accelerator | None:
    """The catalogue's entry for this machine's GPU (hardware.CPU for the dry run)."""
    if dry_run:
        return hardware.CPU
    import torch

    return hardware.by_device_name(torch.cuda.get_device_name(0), device_memory())


def run(name: str, job: dict, work: Path, dry_run: bool, timeout: float) -> dict:
    run_dir = work / name
    run_dir.mkdir(parents=True)
    (run_dir / "job.yaml").write_text(yaml.safe_dump(job))
    cmd = [sys.executable, "-m", "paratrain.cli", "run", str(run_dir / "job.yaml"), "--metrics-out",
           str(run_dir / "metrics.json"), "--workdir", str(run_dir / "work"), "--no-progress"]
    if dry_run:
        cmd.append("--measure-memory")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s (--variant-timeout)"}
    if proc.returncode:
        return {"error": proc.stderr[-3000:]}
    metrics = json.loads((run_dir / "metrics.json").read_text())
    measured = max(metrics["peak_tensor_bytes"])
    reserved = metrics["peak_reserved_bytes"]
    ranks = predict(parse_job(job).spec, job["spec"]["model"]["vocabSize"], "cpu" if dry_run else "cuda")
    predicted = max(r.peak_bytes for r in ranks)
    return {"layout": metrics["layout"], "world_size": metrics["world_size"],
            "batch_size": job["spec"]["training"]["batchSize"],
            "tokens_per_second": metrics["tokens_per_second"],
            "steps_left_out_of_the_rate": metrics["tokens_per_second_skips_steps"], "mfu": metrics["mfu"],
            "model_flops_per_token": metrics["model_flops_per_token"],
            "peak_flops_per_device": metrics["peak_flops_per_device"],
            "peak_tensor_bytes": measured, "predicted_peak_bytes": predicted,
            "predicted_over_measured": predicted / measured,
            "measured_minus_predicted": by_term(ranks, metrics),
            "peak_reserved_bytes": None if None in reserved else max(reserved),
            "planner_compute_efficiency": compute_efficiency(job, metrics["tokens_per_second"], accelerator(dry_run)),
            "final_loss": metrics["losses"][-1]}


def by_term(ranks: list, metrics: dict) -> dict[str, int]:
    """Measured less predicted bytes, per term, on the rank whose measured peak is largest: the model state's terms
    (params, grads, optimizer) as the trainer counts its tensors, and the rest of the peak (activations, loss,
    buffers and what the model leaves out) as the peak less those. Where it is far from 0 is where to calibrate."""
    rank = max(range(len(metrics["peak_tensor_bytes"])), key=lambda i: metrics["peak_tensor_bytes"][i])
    said = next(s for s in metrics["model_state_bytes"] if s["rank"] == rank)
    terms = ranks[rank].terms
    out = {term: said[term] - terms[term] for term in ("params", "grads", "optimizer")}
    states = ("params", "grads", "optimizer")
    out["rest_of_the_peak"] = ((metrics["peak_tensor_bytes"][rank] - sum(said[t] for t in states))
                               - (ranks[rank].peak_bytes - sum(terms[t] for t in states)))
    return out


# Asked in a child process: torch says why a kernel is ruled out only as C++ warnings on stderr (debug=True).
VERDICTS = """
import json, sys
import torch
from torch.backends.cuda import (SDPAParams, can_use_cudnn_attention, can_use_efficient_attention,
                                 can_use_flash_attention)
from paratrain.train.models.gpt import attention_kernel, fuses_grouped_heads
device, heads, kv_heads, head_dim, seq = sys.argv[1], *map(int, sys.argv[2:6])
out = {}
for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
    for grouped in (False, True):
        q = torch.empty(1, heads, seq, head_dim, device=device, dtype=dtype)
        k = torch.empty(1, kv_heads if grouped else heads, seq, head_dim, device=device, dtype=dtype)
        if grouped and not fuses_grouped_heads(device, dtype):
            k = k.repeat_interleave(heads // kv_heads, dim=1)  # as models.gpt.attend passes them
        params = SDPAParams(q, k, k, None, 0.0, True, k.shape[1] != heads)
        case = f"{precision}/{'gqa' if grouped else 'mha'}"
        usable = {}
        for name, check in (("flash", can_use_flash_attention), ("memory-efficient", can_use_efficient_attention),
                            ("cudnn", can_use_cudnn_attention)):
            print(f"@@ {case} {name}", file=sys.stderr, flush=True)
            try:
                usable[name] = bool(check(params, True))
            except Exception as exc:  # cuDNN's check needs a working CUDA runtime
                usable[name] = False
                print(f"Warning: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        out[case] = {"aimed": attention_kernel(device, dtype, grouped), "usable": usable}
print(json.dumps(out))
"""


# A child process too: the sync debug mode is process-wide, and its warnings are counted per step.
SYNCS = """
import json, sys, warnings
import torch
import torch.distributed as dist
from paratrain.api import parse_job
from paratrain.train.engine import TorchEngine
from paratrain.train.loop import train_step
from paratrain.train.models.registry import build_model, model_config
from paratrain.train.parallel.dims import ParallelDims
from paratrain.train.parallel.precision import LossScaler
from paratrain.train.perf import HostReads
device, precision = torch.device(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no collective runs
spec = parse_job({"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "s"},
                  "spec": {"model": {"preset": "debug", "blockSize": 64}, "precision": precision,
                           "training": {"batchSize": 8, "gradientAccumulation": 2}}}).spec
torch.manual_seed(0)
with torch.device(device):
    model = build_model(model_config(spec, 256))
# On CPU, AdamW reads its CPU step counters with .item() (no device sync, but HostReads cannot tell): SGD there.
optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-4) if device.type == "cuda"
             else torch.optim.SGD(model.parameters(), lr=1e-4))
engine = TorchEngine(model=model, module=model, optimizer=optimizer,
                     dims=ParallelDims(dp=1, tp=1, pp=1, world_size=1), precision=precision, grad_clip=1.0,
                     dp_reducer=None, scaler=LossScaler(enabled=precision == "fp16"), accumulation=2)
tokens = torch.randint(256, (8, 65), device=device)
micro = list(zip(tokens[:, :-1].chunk(2), tokens[:, 1:].chunk(2)))
reads, syncs = [], []
for step in range(4):
    if device.type == "cuda" and step:  # the first step's warm-up (lazy inits) is not the loop's
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as said, HostReads() as counted:
        warnings.simplefilter("always")
        train_step(engine, micro, 1e-4, device, flags=lambda: (False, False))
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode(0)
    if step:
        reads.append(len(counted.reads))
        syncs.append(sum("synchroniz" in str(w.message) for w in said) if device.type == "cuda" else None)
print(json.dumps({"host_reads_per_step": reads, "cuda_syncs_per_step": syncs}))
"""


def step_syncs(dry_run: bool) -> dict:
    """How many times one training step (2 micro-steps, the optimizer, the loss report) makes the host wait for
    the device: the reads paratrain.train.perf.HostReads counts, and on a GPU the synchronizing CUDA calls torch's
    sync debug mode warns of (torch.cuda.set_sync_debug_mode), per step after the first. One is expected
    (loop.train_step's read: the loss, the ranks' flags and the gradient norm together; tests/trainer/test_engine.py
    counts it on CPU). On a GPU the
    CUDA count is the one to read: HostReads also counts AdamW's .item() of its CPU step counters, no sync."""
    args = ["cpu", "fp32"] if dry_run else ["cuda", "bf16"]
    proc = subprocess.run([sys.executable, "-c", SYNCS, *args], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def attention_verdicts(dry_run: bool) -> dict:
    """For each precision and head layout (llama3-1b's: 32 query heads, 8 key/value heads, 64 wide, 2,048 tokens),
    the kernel paratrain aims at (models.gpt.attention_kernel) beside torch's own verdicts on the inputs `attend`
    passes (can_use_flash_attention, can_use_efficient_attention, can_use_cudnn_attention), with torch's reasons
    for each kernel it rules out; `aimed_usable` false where paratrain aims at a kernel torch will not run. The dry
    run asks about CPU tensors: every CUDA kernel is ruled out, and the code path is what is checked."""
    shape = ["cpu", "4", "2", "16", "64"] if dry_run else ["cuda", "32", "8", "64", "2048"]
    proc = subprocess.run([sys.executable, "-c", VERDICTS, *shape], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    verdicts = json.loads(proc.stdout.strip().splitlines()[-1])
    reasons: dict[tuple[str, str], list[str]] = {}
    current = None
    for line in proc.stderr.splitlines():
        if line.startswith("@@ "):
            current = tuple(line[3:].split(" ", 1))
            reasons[current] = []
        elif current and "Warning: " in line:
            reasons[current].append(line.split("Warning: ", 1)[1].split(" (function ")[0].strip())
    for case, verdict in verdicts.items():
        verdict["why_not"] = {name: reasons.get((case, name), []) for name, ok in verdict["usable"].items() if not ok}
        aimed = verdict["aimed"].split(",")[0]
        verdict["aimed_usable"] = verdict["usable"].get(aimed, False)
    return verdicts


def device_memory() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def gpu_count() -> tuple[int, str | None]:
    """(CUDA GPUs torch sees, why it sees none where a driver is there but unusable): a driver older than this
    torch's CUDA build is named as such, not taken for a machine without GPUs."""
    import shutil
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        return count, None
    driver = [str(w.message) for w in said if "driver" in str(w.message).lower()]
    if driver:
        return 0, (f"the NVIDIA driver here is too old for this torch (CUDA {torch.version.cuda}), or broken: "
                   f"{driver[0].strip()}")
    if shutil.which("nvidia-smi"):
        return 0, f"nvidia-smi is here but torch (CUDA {torch.version.cuda}) sees no GPU: check the driver"
    return 0, None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU: checks the script runs")
    parser.add_argument("--steps", type=int, default=None, help="steps per variant (default 20; dry run 3)")
    parser.add_argument("--out", help="default: bench/results/gpu.json (dry run: gpu-dry-run.json)")
    parser.add_argument("--variant-timeout", type=float, default=None, metavar="S",
                        help="seconds one variant may run before it is stopped and reported (default 600; dry run 300)")
    args = parser.parse_args()
    gpus, why_none = gpu_count()
    if not args.dry_run and gpus == 0:
        print(f"gpu.py: {why_none or 'no CUDA GPU here'}; `bash bench/gpu.sh --dry-run` checks the script on the "
              "CPU", file=sys.stderr)
        return 2
    steps = args.steps or (3 if args.dry_run else 20)
    chosen = variants(2 if args.dry_run else gpus)
    attention = attention_verdicts(args.dry_run)  # first: seconds, where the variants take minutes
    syncs = step_syncs(args.dry_run)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in chosen.items():
            job = job_for(overrides, args.dry_run, steps)
            if not args.dry_run:
                job = fit_batch(job, device_memory())
            timeout = args.variant_timeout or (300 if args.dry_run else 600)
            results[name] = run(name, job, Path(tmp), args.dry_run, timeout)
            r = results[name]
            if "error" in r:
                print(f"{name}: FAILED\n{r['error']}", file=sys.stderr)
                continue
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (peak unknown)"
            reserved = f", reserved {human(r['peak_reserved_bytes'])}" if r["peak_reserved_bytes"] else ""
            efficiency = r["planner_compute_efficiency"]
            calibrated = f"  planner compute efficiency {efficiency:.1%}" if efficiency else ""
            print(f"{name:22} {r['layout']:24} batch {r['batch_size']:>3} {r['tokens_per_second']:>10,.0f} tok/s  "
                  f"MFU {mfu:>8}  peak {human(r['peak_tensor_bytes'])} (model {human(r['predicted_peak_bytes'])}, "
                  f"{r['predicted_over_measured']:.2f}x){reserved}{calibrated}")
    ok = {k: v for k, v in results.items() if "error" not in v}
    if "bf16" in ok and "fp32-tf32" in ok:
        print(f"bf16 / fp32 (TF32) tokens/s: "
              f"{ok['bf16']['tokens_per_second'] / ok['fp32-tf32']['tokens_per_second']:.2f}x")
    for ac in ("selective", "full"):
        if "bf16" in ok and f"bf16-{ac}-ac" in ok:
            plain, checkpointed = ok["bf16"], ok[f"bf16-{ac}-ac"]
            print(f"{ac} AC / none at their own batches: tokens/s "
                  f"{checkpointed['tokens_per_second'] / plain['tokens_per_second']:.2f}x, peak "
                  f"{checkpointed['peak_tensor_bytes'] / plain['peak_tensor_bytes']:.2f}x")
    calibration = {"computeEfficiency": ok["bf16"]["planner_compute_efficiency"]} if "bf16" in ok else {}
    if calibration.get("computeEfficiency"):
        print(f"planner: the bf16 step ran at {calibration['computeEfficiency']:.1%} of the peak the time model "
              f"prices compute at ({planner.COMPUTE_EFFICIENCY:.0%} uncalibrated): set the platform's "
              f"planner.computeEfficiency: {calibration['computeEfficiency']} (Helm: platform.planner)")
    for case, verdict in attention.items() if "error" not in attention else ():
        usable = ", ".join(name for name, can in verdict["usable"].items() if can) or "none (math)"
        flag = "" if verdict["aimed_usable"] or args.dry_run else "   <- paratrain aims at a kernel torch rules out"
        print(f"attention {case:9} aimed: {verdict['aimed']:60} torch can use: {usable}{flag}")
    if "error" in attention:
        print(f"attention verdicts: FAILED\n{attention['error']}", file=sys.stderr)
    if "error" in syncs:
        print(f"host syncs per step: FAILED\n{syncs['error']}", file=sys.stderr)
    else:
        print(f"host syncs per step (after the first): reads {syncs['host_reads_per_step']}, CUDA's own count "
              f"{syncs['cuda_syncs_per_step']}")
    flops_note = ("FLOPs per token: 6N + 12·L·H·Q·T (perf.model_flops_per_token); MFU against the device's dense "
                  "bf16 peak (perf.PEAK_FLOPS), the same peak for fp32 (TF32) runs; tokens/s over the steps after "
                  "each run's first (perf.SteadyRate)")
    print(flops_note)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / ("gpu-dry-run.json" if args.dry_run
                                                                         else "gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"dry_run": args.dry_run, "gpus": gpus, "steps": steps, "machine": platform.node(),
                               "flops": flops_note, "attention": attention, "step_syncs": syncs,
                               "planner": calibration,
                               "results": results}, indent=1) + "\n")
    print(f"wrote {out}")
    return 1 if len(ok) < len(results) or "error" in attention or "error" in syncs else 0


if __name__ == "__main__":
    sys.exit(main())
