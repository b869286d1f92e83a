"""Framework overhead: paratrain's single-process run against a plain PyTorch loop, measured side by side.

    .venv/bin/python bench/overhead.py [--steps 400] [--repeats 3] [--out bench/results/overhead.json]

Both sides train the same model (paratrain's GPT, built and initialised by the same functions) on the same
Shakespeare characters with the same optimizer (AdamW over nanoGPT's decay split, fused), schedule (warmup then
cosine), gradient clipping and batches, at nanoGPT's CPU shape for Shakespeare (4 layers, 4 heads, 128 wide,
block 64, batch 12). The plain loop is written out below, nanoGPT-style: no process group, no progress reporting,
no checkpoints. paratrain runs as its users run it (`paratrain run`, one process, gloo). Each side counts
tokens/s over its training steps alone (start-up and the final evaluation excluded), in its own process with the
same threads; repetitions alternate the two sides so that machine load falls on both alike. The ratio is
paratrain's tokens/s over the plain loop's, per pair; the median pair is reported. Target: within 3%.

Writes bench/results/overhead.json and overhead.png, and the `overhead` section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from doc_section import arguments, machine, pyplot, save_results, write_section
from jobs import run_job

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "examples" / "data" / "tinyshakespeare.txt"
# nanoGPT's config/train_shakespeare_char.py with its README's CPU settings.
SHAPE = {"layers": 4, "heads": 4, "embedDim": 128, "blockSize": 64, "dropout": 0.0}
TRAINING = {"batchSize": 12, "learningRate": 1.0e-3, "minLearningRate": 1.0e-4, "warmupSteps": 100,
            "weightDecay": 0.1, "beta1": 0.9, "beta2": 0.99, "gradClip": 1.0, "seed": 1337}


def job(steps: int) -> dict:
    return {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "overhead"},
            "spec": {"nodes": 1, "procsPerNode": 1, "model": dict(SHAPE),
                     "data": {"source": "text", "path": str(TEXT), "valFraction": 0.1},
                     "training": {**TRAINING, "steps": steps, "evalInterval": steps, "evalSteps": 1}}}


def plain_loop(job_file: Path, out: Path) -> None:
    """The plain PyTorch loop (run in a process of its own by `--plain`)."""
    import torch
    import torch.nn.functional as F

    from paratrain.api import load_job
    from paratrain.train.data import TRAIN_STREAM, global_batch, load_corpus
    from paratrain.train.loop import lr_at
    from paratrain.train.models.registry import build_model, model_config
    from paratrain.train.models.weights import initialize
    from paratrain.train.optim import param_groups

    spec = load_job(job_file).spec
    t, m, d = spec.training, spec.model, spec.data
    corpus = load_corpus(d.source, d.path, d.val_fraction, m.vocab_size, t.seed, m.block_size)
    model = build_model(model_config(spec, corpus.vocab_size))
    initialize(model, t.seed, None)
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.learning_rate, betas=(t.beta1, t.beta2),
                                  fused=True)
    model.train()
    losses, train_time = [], 0.0
    for step in range(t.steps):
        t0 = time.perf_counter()
        x, y = global_batch(corpus.train, t.batch_size, m.block_size, t.seed, step, TRAIN_STREAM)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        train_time += time.perf_counter() - t0
    out.write_text(json.dumps({"tokens_per_second": t.steps * t.batch_size * m.block_size / train_time,
                               "losses": losses}))


def run_plain(job_file: Path, tmp: Path) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "plain.json"
    proc = subprocess.run([sys.executable, __file__, "--plain", str(job_file), str(out)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the plain loop failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def plot(pairs: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    reps = range(1, len(pairs) + 1)
    width = 0.38
    ax.bar([r - width / 2 for r in reps], [p["plain"] for p in pairs], width, label="plain PyTorch loop")
    ax.bar([r + width / 2 for r in reps], [p["paratrain"] for p in pairs], width, label="paratrain run")
    for r, p in zip(reps, pairs):
        ax.annotate(f"{p['ratio']:.3f}x", (r + width / 2, p["paratrain"]), ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("repetition (the two sides alternate)")
    ax.set_ylabel("tokens/s")
    ax.set_xticks(list(reps))
    ax.set_title("Framework overhead at nanoGPT's CPU shape (one process)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--plain":
        plain_loop(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = arguments(__doc__, "overhead")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    pairs = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        job_file = tmp / "job.yaml"
        job_file.write_text(yaml.safe_dump(job(args.steps)))
        for rep in range(args.repeats):
            # Alternate which side goes first, so neither always runs on a warmer (or busier) machine.
            order = ("paratrain", "plain") if rep % 2 == 0 else ("plain", "paratrain")
            got = {}
            for side in order:
                where = tmp / f"{side}-{rep}"
                got[side] = run_job(job(args.steps), where) if side == "paratrain" else run_plain(job_file, where)
            pair = {"paratrain": got["paratrain"]["tokens_per_second"], "plain": got["plain"]["tokens_per_second"]}
            pair["ratio"] = pair["paratrain"] / pair["plain"]
            # Same model, data and optimizer: the curves must agree, or the comparison is of different work.
            gap = max(abs(a - b) for a, b in zip(got["paratrain"]["losses"], got["plain"]["losses"]))
            pair["largest_loss_gap"] = gap
            pairs.append(pair)
            print(f"repetition {rep + 1}: paratrain {pair['paratrain']:,.0f} tokens/s, plain loop "
                  f"{pair['plain']:,.0f} tokens/s: {pair['ratio']:.3f}x (loss curves differ by at most {gap:.1e})")

    median = statistics.median(p["ratio"] for p in pairs)
    result = {"shape": SHAPE, "training": TRAINING, "steps": args.steps, "repeats": args.repeats, "pairs": pairs,
              "median_ratio": median, "target": "within 3% (ratio >= 0.97)",
              "threads": int(os.environ.get("OMP_NUM_THREADS", "0")) or os.cpu_count(),
              "machine": machine()}
    save_results(result, args.out, lambda png: plot(pairs, png))
    print(f"median ratio {median:.3f}x (paratrain over the plain loop)")
    if not args.no_doc:
        rows = [f"| {i} | {p['plain']:,.0f} | {p['paratrain']:,.0f} | {p['ratio']:.3f}x | {p['largest_loss_gap']:.1e} |"
                for i, p in enumerate(pairs, 1)]
        write_section("overhead", [
            f"`.venv/bin/python bench/overhead.py --steps {args.steps} --repeats {args.repeats}` "
            f"({result['machine']}):", "",
            "| repetition | plain loop tokens/s | paratrain tokens/s | ratio | largest loss gap |",
            "|---|---|---|---|---|", *rows, "",
            f"Median ratio: **{median:.3f}x** (target: at least 0.97x).", "",
            "![framework overhead](../bench/results/overhead.png)"])


if __name__ == "__main__":
    main()
