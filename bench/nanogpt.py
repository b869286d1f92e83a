"""paratrain against nanoGPT's own train.py at nanoGPT's CPU shape, the two run by turns, side by side.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT   # not a dependency: only this script reads it
    .venv/bin/python bench/nanogpt.py --nanogpt /tmp/nanoGPT [--iters 2000] [--repeats 3]

nanoGPT's README trains Shakespeare characters on a CPU with

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1
        --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000
        --dropout=0.0

and this script runs exactly that (in a copy of the checkout, on examples/data/tinyshakespeare.txt prepared by its
own data/shakespeare_char/prepare.py), against `paratrain run` of the same shape (`bias: false`, as train.py's
`bias = False`), optimizer settings, schedule, clipping and data split. The two run at once but by turns of 2 s
(timeslice.py: the other's whole process tree stopped), so both meet the same machine: run one after the other,
this shared machine's drift of up to ±15% over a minute decided the ratio. `--repeats` pairs, pair k with seed
1337 + k on both sides (for train.py, a copy whose one seed line says so): how far a seed alone moves the loss.
Reported per run: the whole command's seconds (the sum of its turns: what a user waits, start-up and evaluations
included; nanoGPT evaluates train and val, 20 batches each, every 250 iterations, paratrain val only, 20 batches at
the same interval), training tokens/s from the median iteration (nanoGPT's logged per-iteration times, paratrain's
step events; the first iteration and those after an evaluation left out; the median also leaves out the iterations a
turn cut in two), and the final validation loss. Then one step of each side's model alone, outside any loop, to tell
the models' cost from the loops'. Target (issue 27): at least nanoGPT's speed, val loss within 0.3%. Writes
bench/results/nanogpt.json and nanogpt.png, and the `nanogpt` section of docs/benchmarks.md.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from doc_section import arguments, machine, pyplot, save_results, write_section
from timeslice import Command, Finished, run_by_turns

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "examples" / "data" / "tinyshakespeare.txt"
BATCH, BLOCK, EVAL_INTERVAL, EVAL_ITERS = 12, 64, 250, 20
SEED = 1337  # train.py's
NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", f"--eval_iters={EVAL_ITERS}",
                "--log_interval=1", f"--block_size={BLOCK}", f"--batch_size={BATCH}", "--n_layer=4", "--n_head=4",
                "--n_embd=128", "--dropout=0.0"]


def paratrain_job(iters: int, seed: int = SEED) -> dict:
    """nanoGPT's settings for this run, as a ParallelTrainJob (config/train_shakespeare_char.py and the flags)."""
    return {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "nanogpt"},
            "spec": {"nodes": 1, "procsPerNode": 1,
                     "model": {"layers": 4, "heads": 4, "embedDim": 128, "blockSize": BLOCK, "dropout": 0.0,
                               "bias": False},
                     "data": {"source": "text", "path": str(TEXT), "valFraction": 0.1},
                     "training": {"steps": iters, "batchSize": BATCH, "learningRate": 1.0e-3,
                                  "minLearningRate": 1.0e-4, "warmupSteps": 100, "weightDecay": 0.1, "beta1": 0.9,
                                  "beta2": 0.99, "gradClip": 1.0, "evalInterval": EVAL_INTERVAL,
                                  "evalSteps": EVAL_ITERS, "seed": seed}}}


def prepare_nanogpt(checkout: Path, tmp: Path) -> Path:
    """A copy of the checkout with Shakespeare prepared by its own script (input.txt present: no download)."""
    work = tmp / "nanoGPT"
    shutil.copytree(checkout, work, ignore=shutil.ignore_patterns(".git", "out*"))
    data = work / "data" / "shakespeare_char"
    shutil.copy(TEXT, data / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    return work


def nanogpt_command(work: Path, iters: int, out: Path, seed: int = SEED) -> Command:
    """train.py, or for another seed a copy of it whose one seed line says so (train.py takes no seed flag)."""
    script = "train.py"
    if seed != SEED:
        script = f"train_seed{seed}.py"
        text = (work / "train.py").read_text()
        line = f"torch.manual_seed({SEED} + seed_offset)"
        if line not in text:
            raise SystemExit(f"nanoGPT's train.py no longer says {line!r}: cannot run it with another seed")
        (work / script).write_text(text.replace(line, f"torch.manual_seed({seed} + seed_offset)"))
    return Command([sys.executable, script, *NANOGPT_ARGS, f"--max_iters={iters}", f"--lr_decay_iters={iters}",
                    f"--out_dir={out}"], cwd=work)


def nanogpt_result(done: Finished) -> dict:
    """train.py's log: each iteration's time (the evaluation iterations and the first left out), the last val loss."""
    if done.returncode != 0:
        raise SystemExit(f"nanoGPT's train.py failed:\n{done.output[-3000:]}")
    times = {int(i): float(ms) / 1000 for i, ms in re.findall(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms",
                                                                done.output, re.M)}
    train = [dt for i, dt in times.items() if i > 0 and i % EVAL_INTERVAL != 0]
    val = re.findall(r"^step \d+: train loss [\d.]+, val loss ([\d.]+)", done.output, re.M)
    return {"seconds": done.active_seconds, "tokens_per_second": BATCH * BLOCK / statistics.median(train),
            "val_loss": float(val[-1])}


def paratrain_command(iters: int, where: Path, seed: int = SEED) -> Command:
    where.mkdir(parents=True)
    (where / "job.yaml").write_text(yaml.safe_dump(paratrain_job(iters, seed)))
    return Command([sys.executable, "-m", "paratrain.cli", "run", str(where / "job.yaml"), "--metrics-out",
                    str(where / "metrics.json"), "--workdir", str(where / "work"), "--no-progress"])


def paratrain_result(done: Finished, where: Path) -> dict:
    """Each step's time from rank 0's step events (a step after an evaluation and the first left out, as for
    nanoGPT), the final val loss from the metrics."""
    if done.returncode != 0:
        raise SystemExit(f"paratrain run failed:\n{done.output[-3000:]}")
    events = [json.loads(line) for line in (where / "work" / "events.jsonl").read_text().splitlines()]
    at = {e["step"]: e["time"] for e in events if e["event"] == "step"}
    train = [at[k] - at[k - 1] for k in sorted(at) if k - 1 in at and (k - 1) % EVAL_INTERVAL != 0]
    metrics = json.loads((where / "metrics.json").read_text())
    return {"seconds": done.active_seconds, "tokens_per_second": BATCH * BLOCK / statistics.median(train),
            "val_loss": metrics["val_loss"]}


def model_step_seconds(work: Path, steps: int) -> dict[str, float]:
    """Median seconds of one forward+backward+AdamW step of each side's model alone (nanoGPT's model.py GPT from the
    checkout, with train.py's bias=False; paratrain's GPT), same shape and batch, alternating in this process:
    what the models cost apart from the loops around them."""
    import torch
    import torch.nn.functional as F

    from paratrain.train.models.gpt import GPT, GPTConfig

    found = importlib.util.spec_from_file_location("nanogpt_model", work / "model.py")  # the checkout's model.py
    nanogpt_model = importlib.util.module_from_spec(found)
    found.loader.exec_module(nanogpt_model)

    vocab = 65
    theirs = nanogpt_model.GPT(nanogpt_model.GPTConfig(block_size=BLOCK, vocab_size=vocab, n_layer=4, n_head=4,
                                                       n_embd=128, dropout=0.0, bias=False))
    ours = GPT(GPTConfig(vocab_size=vocab, block_size=BLOCK, layers=4, heads=4, embed_dim=128, dropout=0.0,
                         bias=False))
    tokens = torch.randint(0, vocab, (BATCH, BLOCK + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    sides = {"nanoGPT model.py": (theirs, lambda m: m(x, y)[1]),
             "paratrain model.py": (ours, lambda m: F.cross_entropy(m(x).flatten(0, 1), y.flatten()))}
    times: dict[str, list[float]] = {name: [] for name in sides}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True) for name, (m, _) in sides.items()}
    for step in range(2 * steps):
        for name, (m, loss_of) in sides.items():
            started = time.perf_counter()
            loss_of(m).backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            if step >= steps // 2:  # after a warm-up
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    plt = pyplot()
    fig, (wall, speed) = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, label in ((wall, "seconds", "whole command (s)"), (speed, "tokens_per_second", "training tokens/s")):
        for i, side in enumerate(runs):
            values = [r[key] for r in runs[side]]
            ax.scatter([i] * len(values), values, label=side)
        ax.set_xticks(range(len(runs)), list(runs))
        ax.set_ylabel(label)
    fig.suptitle("paratrain against nanoGPT's train.py, CPU Shakespeare shape")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = arguments(__doc__, "nanogpt")
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of github.com/karpathy/nanoGPT")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not (args.nanogpt / "train.py").exists():
        raise SystemExit(f"--nanogpt {args.nanogpt}: no train.py there; clone github.com/karpathy/nanoGPT first")
    commit = subprocess.run(["git", "-C", str(args.nanogpt), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"

    runs: dict[str, list[dict]] = {"nanoGPT train.py": [], "paratrain run": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        work = prepare_nanogpt(args.nanogpt, tmp)
        for rep in range(args.repeats):
            where, seed = tmp / str(rep), SEED + rep  # the README's seed first, then the next ones on both sides
            done = run_by_turns({"nanogpt": nanogpt_command(work, args.iters, where / "nanogpt", seed),
                                 "paratrain": paratrain_command(args.iters, where / "paratrain", seed)},
                                where / "logs")
            got = {"nanoGPT train.py": nanogpt_result(done["nanogpt"]),
                   "paratrain run": paratrain_result(done["paratrain"], where / "paratrain")}
            for side, result in got.items():
                runs[side].append(result)
                print(f"repetition {rep + 1} (seed {seed}): {side}: {result['seconds']:.1f} s, "
                      f"{result['tokens_per_second']:,.0f} "
                      f"training tokens/s, val loss {result['val_loss']:.4f}", flush=True)
        models = model_step_seconds(work, 200)
    print("one step of each model alone: " + ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in models.items()))
    med = {side: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for side, rs in runs.items()}
    ours, theirs = med["paratrain run"], med["nanoGPT train.py"]
    # Val loss over the seeds: the mean of each side, and how far one seed's loss strays from its side's mean.
    losses = {side: [r["val_loss"] for r in rs] for side, rs in runs.items()}
    mean = {side: statistics.fmean(v) for side, v in losses.items()}
    spread = max(abs(x - mean[side]) / mean[side] for side, v in losses.items() for x in v)
    result = {"iters": args.iters, "repeats": args.repeats, "seeds": [SEED + r for r in range(args.repeats)],
              "nanogpt_commit": commit, "runs": runs, "medians": med,
              "speed_over_nanogpt": ours["tokens_per_second"] / theirs["tokens_per_second"],
              "wall_over_nanogpt": theirs["seconds"] / ours["seconds"], "model_step_seconds": models,
              "model_speed_over_nanogpt": models["nanoGPT model.py"] / models["paratrain model.py"],
              "mean_val_loss": mean,
              "val_loss_gap": mean["paratrain run"] / mean["nanoGPT train.py"] - 1,
              "readme_seed_val_loss_gap": losses["paratrain run"][0] / losses["nanoGPT train.py"][0] - 1,
              "largest_seed_deviation": spread, "machine": machine()}
    save_results(result, args.out, lambda png: plot(runs, png))
    print(f"paratrain's training speed is {result['speed_over_nanogpt']:.3f}x nanoGPT's; whole command "
          f"{result['wall_over_nanogpt']:.3f}x; mean val loss {100 * result['val_loss_gap']:+.2f}% "
          f"(seed {SEED} alone {100 * result['readme_seed_val_loss_gap']:+.2f}%; one seed strays up to "
          f"{100 * spread:.2f}% from its side's mean)")
    if not args.no_doc:
        rows = [f"| {side} | {m['seconds']:.1f} | {m['tokens_per_second']:,.0f} | "
                f"{' / '.join(f'{x:.4f}' for x in losses[side])} | {mean[side]:.4f} |" for side, m in med.items()]
        seeds = ", ".join(str(s) for s in result["seeds"])
        write_section("nanogpt", [
            f"`.venv/bin/python bench/nanogpt.py --nanogpt DIR --iters {args.iters} --repeats {args.repeats}` "
            f"(nanoGPT at {commit}; {result['machine']}; the two by turns of 2 s; repeat k with seed 1337 + k on "
            "both sides; medians of the repeats):", "",
            "| command | whole command, its turns (s) | training tokens/s, median step | "
            f"final val loss, seeds {seeds} | mean |", "|---|---|---|---|---|", *rows, "",
            f"paratrain trains at **{result['speed_over_nanogpt']:.3f}x** nanoGPT's speed; the whole command runs "
            f"at {result['wall_over_nanogpt']:.3f}x (nanoGPT's seconds over paratrain's). Mean final val loss: "
            f"**{100 * result['val_loss_gap']:+.2f}%** against nanoGPT's (seed {SEED}, the README's, alone: "
            f"{100 * result['readme_seed_val_loss_gap']:+.2f}%); one seed's loss strays up to "
            f"{100 * spread:.2f}% from its side's mean.", "",
            "One forward, backward and AdamW step of each model alone, outside any loop (median of 300 "
            "alternating steps after 100 of warm-up): " + ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in models.items())
            + f": paratrain's model runs at {result['model_speed_over_nanogpt']:.3f}x nanoGPT's.", "",
            "![nanoGPT comparison](../bench/results/nanogpt.png)"])

if __name__ == "__main__":
    main()
