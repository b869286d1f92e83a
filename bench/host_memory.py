"""Host memory and reads per rank while a run builds, saves and resumes, and while `paratrain export` writes.

    .venv/bin/python bench/host_memory.py [--layers 8] [--width 512] [--only NAME ...]

At 8B parameters a rank that holds the whole fp32 model (32 GB), or the whole fp32 state with Adam's moments
(96 GB), in host memory during one phase needs that much beyond its share: eight ranks on a node run out there, not
in training. Each layout below trains a GPT of `--layers` blocks `--width` wide (vocabulary 8,192) on synthetic
tokens: 4 steps, a checkpoint at steps 2 and 4; then a second run to step 6 resumes from step 4 and
saves again. Every rank measures each phase itself (paratrain.train.host_memory: its resident-set peak, reset at
the phase's start, and its bytes read, from /proc/self), as every run does: the figures come from the second run's
`--metrics-out`. Reported per layout, the worst rank's rise over the phase (peak − resident at its start) and the
resume's bytes read, each also as a multiple of the model's fp32 weights (Ψ·4 bytes). On this CPU the model and
its optimizer state are host memory too, so a sharded layout's build is smaller for that reason as well; on a GPU
only the host-side copies count. Then `paratrain export` of the one-process checkpoint to safetensors: fp32 and bf16 in
one file, and fp32 in 16 MB shards (a shard is written as soon as its tensors are read).
Writes bench/results/host_memory.json and .png, and the `host_memory` section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from doc_section import arguments, machine, pyplot, save_results, write_section
from jobs import run_job

MIB = 2**20
PHASES = ("build", "save", "resume")

# name → --set overrides: world 2 (and 4 for the composed ZeRO-1 under TP), the engines that shard state differently
LAYOUTS = {
    "one-process": {},
    "dp2-ddp": {"spec.nodes": 2, "spec.parallelism.data": 2},
    "dp2-zero1-deepspeed": {"spec.nodes": 2, "spec.parallelism.data": 2, "spec.parallelism.zeroStage": 1},
    "dp2-zero2-deepspeed": {"spec.nodes": 2, "spec.parallelism.data": 2, "spec.parallelism.zeroStage": 2},
    "dp2-zero3-deepspeed": {"spec.nodes": 2, "spec.parallelism.data": 2, "spec.parallelism.zeroStage": 3},
    "tp2": {"spec.nodes": 2, "spec.parallelism.tensor": 2},
    "dp2xtp2-zero1": {"spec.nodes": 4, "spec.parallelism.data": 2, "spec.parallelism.tensor": 2,
                      "spec.parallelism.zeroStage": 1},
    "dp2xtp2-zero3-fsdp2": {"spec.nodes": 4, "spec.parallelism.data": 2, "spec.parallelism.tensor": 2,
                            "spec.parallelism.zeroStage": 3},
}


def job(layers: int, width: int, checkpoints: Path) -> dict:
    return {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "host-memory"},
            "spec": {"model": {"layers": layers, "heads": 8, "embedDim": width, "blockSize": 64, "vocabSize": 8192},
                     "data": {"source": "synthetic"},  # the vocabulary as given (text would bring its 65)
                     "training": {"steps": 4, "batchSize": 8, "evalInterval": 100, "evalSteps": 1,
                                  "warmupSteps": 1},
                     "checkpoint": {"path": str(checkpoints), "interval": 2, "keep": 2}}}


def parameters(layers: int, width: int) -> int:
    import torch

    from paratrain.api.load import parse_job
    from paratrain.train.models.registry import build_model, model_config

    with torch.device("meta"):
        model = build_model(model_config(parse_job(job(layers, width, Path("/unused"))).spec, 8192))
    return sum(p.numel() for p in model.parameters())


def measure(name: str, layers: int, width: int, tmp: Path) -> dict:
    sets = [f"{k}={v}" for k, v in LAYOUTS[name].items()]
    document = job(layers, width, tmp / name / "ckpt")
    run_job(document, tmp / name / "first", sets)
    resumed = run_job(document, tmp / name / "resumed", [*sets, "spec.training.steps=6"])
    assert resumed["resumed_from_step"] == 4, resumed["resumed_from_step"]
    ranks = resumed["host_phases"]
    rise = {p: max(r[p]["peakRssBytes"] - r[p]["startRssBytes"] for r in ranks) for p in PHASES}
    return {"layout": name, "world": len(ranks), "per_rank": ranks, "rise_bytes": rise,
            "resume_read_bytes": max(r["resume"]["bytesRead"] for r in ranks),
            "peak_rss_bytes": max(resumed["peak_memory_bytes"]), "checkpoint": str(tmp / name / "ckpt")}


def export(document: dict, checkpoint: str, out: Path, dtype: str, shard: str) -> dict:
    """`paratrain export` in a process of its own, measured as the trainer measures a phase."""
    job_file = out.with_suffix(".yaml")
    job_file.write_text(yaml.safe_dump(document))
    # The phase starts once torch and the exporter are imported (torch alone is some 600 MiB resident here): what
    # it shows is the export's own.
    program = ("import json, sys\nimport safetensors.torch, torch\nimport paratrain.train.export\n"
               "from paratrain.cli import main\nfrom paratrain.train.host_memory import HostPhases\n"
               "phases = HostPhases()\nwith phases.phase('export'):\n    code = main(sys.argv[1:])\n"
               "print(json.dumps(phases.as_dict()['export']))\nsys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", program, "export", str(job_file), "--checkpoint", checkpoint,
                           "--out", str(out), "--dtype", dtype, "--max-shard-size", shard],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"paratrain export failed:\n{proc.stderr[-3000:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    written = sum(f.stat().st_size for f in out.iterdir())
    return {"dtype": dtype, "max_shard_size": shard, "files": sum(1 for _ in out.glob("*.safetensors")),
            "rise_bytes": figures["peakRssBytes"] - figures["startRssBytes"],
            "read_bytes": figures["bytesRead"], "written_bytes": written}


def plot(rows: list[dict], weights: int, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.4))
    height = 0.8 / len(PHASES)
    for i, phase in enumerate(PHASES):
        ax.barh([k + i * height for k in range(len(rows))], [r["rise_bytes"][phase] / weights for r in rows],
                height, label=phase)
    ax.set_yticks([k + height for k in range(len(rows))], [r["layout"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("worst rank's host-memory rise over the phase, × the model's fp32 weights")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = arguments(__doc__, "host_memory")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--only", nargs="+", choices=list(LAYOUTS), help="these layouts alone (no docs update)")
    args = parser.parse_args()
    n = parameters(args.layers, args.width)
    weights = 4 * n
    rows = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for name in args.only or LAYOUTS:
            rows.append(measure(name, args.layers, args.width, tmp))
            r = rows[-1]
            print(f"{name:22s} " + "  ".join(f"{p} +{r['rise_bytes'][p] / MIB:,.0f} MiB" for p in PHASES)
                  + f"  resume read {r['resume_read_bytes'] / MIB:,.0f} MiB", flush=True)
        document = job(args.layers, args.width, Path(rows[0]["checkpoint"]))
        exports = [export(document, rows[0]["checkpoint"], tmp / f"export-{d}-{shard}", d, shard)
                   for d, shard in (("fp32", "5GB"), ("bf16", "5GB"), ("fp32", "16MB"))]
    for e in exports:
        print(f"export {e['dtype']}, shards {e['max_shard_size']}: +{e['rise_bytes'] / MIB:,.0f} MiB, "
              f"read {e['read_bytes'] / MIB:,.0f} MiB, "
              f"wrote {e['written_bytes'] / MIB:,.0f} MiB")
    result = {"machine": machine(), "parameters": n, "fp32_weight_bytes": weights, "layers": args.layers,
              "width": args.width, "layouts": rows, "exports": exports}
    save_results(result, args.out, lambda path: plot(rows, weights, path))
    if args.only or args.no_doc:
        return

    def cell(b: int) -> str:
        return f"{b / MIB:,.0f} ({b / weights:.1f}×)"

    lines = [f"`.venv/bin/python bench/host_memory.py` ({machine()}): GPT {args.layers} × {args.width}, vocabulary "
             f"8,192: {n / 1e6:.1f}M parameters, fp32 weights Ψ·4 = {weights / MIB:,.0f} MiB. The worst rank's "
             "rise in resident memory over each phase, MiB (× Ψ·4), and what its resume read:", "",
             "| layout | ranks | build | save | resume | resume read | run's peak RSS |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['world']} | {cell(r['rise_bytes']['build'])} | "
                     f"{cell(r['rise_bytes']['save'])} | {cell(r['rise_bytes']['resume'])} | "
                     f"{cell(r['resume_read_bytes'])} | {r['peak_rss_bytes'] / MIB:,.0f} |")
    lines += ["", "`paratrain export` of the one-process checkpoint (one process, safetensors):", "",
              "| dtype | --max-shard-size | files | rise | read | written |", "|---|---|---|---|---|---|"]
    for e in exports:
        lines.append(f"| {e['dtype']} | {e['max_shard_size']} | {e['files']} | {cell(e['rise_bytes'])} | "
                     f"{cell(e['read_bytes'])} | "
                     f"{cell(e['written_bytes'])} |")
    lines += ["", "![host memory per phase](../bench/results/host_memory.png)"]
    write_section("host_memory", lines)


if __name__ == "__main__":
    main()
