"""What activation checkpointing saves and costs, measured side by side in one run.

    .venv/bin/python bench/activation_checkpointing.py [--steps 10] [--out bench/results/activation_checkpointing.json]

For each mode (none, full, selective) the same model takes the same training steps in this process. Activation
memory is what the forward leaves allocated for backward (torch's profiler, allocations minus frees over the
forward: the activations and the logits); step time is the median forward + backward. Ratios are against `none`
measured in the same invocation. On CPU there is no device allocator; the byte counts are the same on any machine,
the times are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from doc_section import write_section

from paratrain.train.parallel.activation_checkpoint import MODES, apply_ac
from paratrain.train.models.gpt import GPT, GPTConfig
from paratrain.train.models.weights import init_weights

ROOT = Path(__file__).resolve().parents[1]
CFG = GPTConfig(vocab_size=256, block_size=256, layers=4, heads=4, embed_dim=256, dropout=0.1)
BATCH = 8


def measure(mode: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    init_weights(model, seed=1)
    apply_ac(model, mode)
    tokens = torch.randint(CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    with torch.profiler.profile(profile_memory=True) as prof:
        logits = model(x)
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        times.append(time.perf_counter() - t0)
    return {"activation_bytes": held, "step_seconds": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "activation_checkpointing.json"))
    args = parser.parse_args()
    results = {mode: measure(mode, args.steps) for mode in MODES}
    base = results["none"]
    for mode, r in results.items():
        r["memory_vs_none"] = r["activation_bytes"] / base["activation_bytes"]
        r["time_vs_none"] = r["step_seconds"] / base["step_seconds"]
        print(f"{mode:10s} {r['activation_bytes'] / 1e6:8.1f} MB ({r['memory_vs_none']:.2f}x)  "
              f"{r['step_seconds'] * 1e3:7.1f} ms/step ({r['time_vs_none']:.2f}x)", flush=True)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
              "threads": torch.get_num_threads(), "batch": BATCH, "model": CFG.__dict__, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    lines = [f"Measured on {report['machine']}, {report['threads']} threads: one process, a {CFG.layers}-layer, "
             f"{CFG.embed_dim}-wide GPT, {BATCH} x {CFG.block_size} tokens, dropout {CFG.dropout} "
             "(`.venv/bin/python bench/activation_checkpointing.py`).", "",
             "| activationCheckpointing | activations held after forward (MB) | memory vs none | "
             "forward+backward (ms) | time vs none |", "|---|---|---|---|---|"]
    for mode, r in results.items():
        lines.append(f"| {mode} | {r['activation_bytes'] / 1e6:.1f} | {r['memory_vs_none']:.2f}x | "
                     f"{r['step_seconds'] * 1e3:.0f} | {r['time_vs_none']:.2f}x |")
    write_section("activation_checkpointing", lines)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
