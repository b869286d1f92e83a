"""The pipeline bubble of GPipe and 1F1B against (p-1)/(m+p-1), from per-stage busy time, measured side by side.

    .venv/bin/python bench/pipeline_bubble.py [--steps 4] [--out bench/results/pipeline_bubble.json]

For p = 2 and 4 stages and m = 1, 2, 4, 8 microbatches (1F1B needs m >= p), the trainer's own pipeline (its
stage split, torch.distributed.pipelining schedule and loss, gloo, one thread per rank) trains an 8-layer, 256-wide
GPT on microbatches of 4 x 128 tokens. Each stage's forward_one_chunk, backward_one_chunk and loss are wrapped
with timers: a stage is busy inside them and idle everywhere else (waiting on a neighbour, the schedule's own
work). Two idle fractions, averaged over the stages, are set against the formula of GPipe's paper (the same for
1F1B, which saves memory, not bubble):

- measured: 1 - busy / step wall time, on this machine. With p = 4 the 4 processes share 2 cores, so this one is
  marked oversubscribed: a stage's wall time then includes its turns off the core;
- replayed: each op's CPU time (thread_time, what it would take on a device of its own), laid out again in the
  order each stage ran them, every forward after the previous stage's forward of its microbatch and every backward
  after the next stage's backward: the bubble on p dedicated devices with free communication, as the formula
  assumes.

The last step of each run is also taken under a live-tensor counter (perf.LiveTensorBytes): the peak bytes a stage
allocates within a step (activations held for backward and temporaries; the weights and gradients already exist),
GPipe against 1F1B. Target (issue 17): within 20% of the formula. Writes bench/results/pipeline_bubble.json and
pipeline_bubble.png, and the `pipeline_bubble` section of docs/benchmarks.md.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from doc_section import arguments, machine, pyplot, save_results, write_section
from jobs import engine_for, spawn

SHAPE = {"layers": 8, "heads": 4, "embedDim": 256, "blockSize": 128, "dropout": 0.0, "vocabSize": 65}
MICROBATCH_ROWS = 4
CONFIGS = [(schedule, p, m) for p in (2, 4) for schedule in ("GPipe", "1F1B") for m in (1, 2, 4, 8)
           if not (schedule == "1F1B" and m < p)]


def formula(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def job(schedule: str, p: int, m: int) -> dict:
    return {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "bubble"},
            "spec": {"nodes": 1, "procsPerNode": p, "model": dict(SHAPE),
                     "parallelism": {"pipeline": p, "microbatches": m, "pipelineSchedule": schedule},
                     "data": {"source": "synthetic"},
                     "training": {"steps": 10, "warmupSteps": 0, "batchSize": MICROBATCH_ROWS * m, "seed": 1337}}}


class StageTimer:
    """Wraps a schedule's stage so that each forward, backward and loss records (kind, microbatch, wall start,
    wall end, thread CPU seconds) relative to the step's start."""

    def __init__(self, schedule):
        self.ops: list[tuple[str, int, float, float, float]] = []
        self.t0 = 0.0
        stage = schedule._stage
        stage.forward_one_chunk = self._timed("F", stage.forward_one_chunk)
        stage.backward_one_chunk = self._timed("B", stage.backward_one_chunk)
        schedule._compute_loss = self._timed("L", schedule._compute_loss, microbatch=lambda *a, **k: -1)

    def _timed(self, kind, fn, microbatch=lambda chunk, *a, **k: chunk):
        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            out = fn(*args, **kwargs)
            self.ops.append((kind, microbatch(*args, **kwargs), wall - self.t0, time.perf_counter() - self.t0,
                             time.thread_time() - cpu))
            return out
        return timed

    def start(self) -> None:
        self.ops, self.t0 = [], time.perf_counter()


def rank_steps(schedule: str, m: int, steps: int) -> dict:
    """On one rank: `steps` timed steps after a first one (which builds the stage's buffers), then one more under
    the live-tensor counter."""
    import torch
    import torch.distributed as dist

    from paratrain.train.perf import LiveTensorBytes

    _, _, engine = engine_for(job(schedule, dist.get_world_size(), m), SHAPE["vocabSize"])
    timer = StageTimer(engine.schedule)
    x = torch.randint(0, SHAPE["vocabSize"], (MICROBATCH_ROWS * m, SHAPE["blockSize"]),
                      generator=torch.Generator().manual_seed(0))
    timed = []
    for step in range(steps + 1):
        dist.barrier()
        timer.start()
        engine.forward_backward([(x, x)])
        if step > 0:
            timed.append({"wall": time.perf_counter() - timer.t0, "ops": timer.ops})
    dist.barrier()
    timer.start()  # the timed steps keep their lists
    with LiveTensorBytes(torch.device("cpu")) as counter:
        engine.forward_backward([(x, x)])
    return {"steps": timed, "peak_bytes": counter.peak}


def replay(stages: list[list[tuple[str, int, float]]]) -> tuple[float, list[float]]:
    """Lay each stage's ops (kind, microbatch, seconds; in the order it ran them) out on dedicated devices with
    free communication: (makespan, busy seconds per stage)."""
    p = len(stages)
    end: dict[tuple[str, int, int], float] = {}
    clock, pos = [0.0] * p, [0] * p
    while any(pos[s] < len(stages[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(stages[s]):
                kind, mb, seconds = stages[s][pos[s]]
                dep = ("F", s - 1, mb) if kind == "F" and s > 0 else ("B", s + 1, mb) if kind == "B" and s < p - 1 \
                    else None
                if dep is not None and dep not in end:
                    break
                clock[s] = max(clock[s], end[dep] if dep else 0.0) + seconds
                end[(kind, s, mb)] = clock[s]
                pos[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("the recorded schedule deadlocks when replayed")
    return max(clock), [sum(op[2] for op in ops) for ops in stages]


def compute_ops(ops: list) -> list[tuple[str, int, float]]:
    """A stage's ops for the replay: the loss (recorded after its forward) is folded into that forward."""
    out: list[tuple[str, int, float]] = []
    for kind, mb, _, _, cpu in ops:
        if kind == "L":
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + cpu)
        else:
            out.append((kind, mb, cpu))
    return out


def measure(schedule: str, p: int, m: int, steps: int) -> dict:
    ranks = spawn(rank_steps, p, schedule, m, steps)
    measured, replayed = [], []
    for i in range(steps):
        wall = max(r["steps"][i]["wall"] for r in ranks)
        busy = [sum(op[3] - op[2] for op in r["steps"][i]["ops"]) for r in ranks]
        measured.append(1 - statistics.mean(busy) / wall)
        makespan, busy_cpu = replay([compute_ops(r["steps"][i]["ops"]) for r in ranks])
        replayed.append(1 - statistics.mean(busy_cpu) / makespan)
    last = ranks[0]["steps"][-1]["ops"]
    forward = statistics.mean(op[4] for op in last if op[0] == "F")
    backward = statistics.mean(op[4] for op in last if op[0] == "B")
    return {"schedule": schedule, "stages": p, "microbatches": m, "formula": formula(p, m),
            "measured_idle": statistics.median(measured), "replayed_idle": statistics.median(replayed),
            "step_seconds": statistics.median(max(r["steps"][i]["wall"] for r in ranks) for i in range(steps)),
            "stage0_forward_seconds": forward, "stage0_backward_over_forward": backward / forward,
            "peak_step_bytes_per_stage": [r["peak_bytes"] for r in ranks], "oversubscribed": p > (os.cpu_count() or 1)}


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, (ax, mem) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {2: "#4c72b0", 4: "#c44e52"}
    for p in (2, 4):
        ms = [1, 2, 4, 8]
        ax.plot(ms, [formula(p, m) for m in ms], color=colors[p], linewidth=0.9, label=f"(p-1)/(m+p-1), p={p}")
        for schedule, marker in (("GPipe", "o"), ("1F1B", "s")):
            got = [r for r in rows if r["stages"] == p and r["schedule"] == schedule]
            ax.scatter([r["microbatches"] for r in got], [r["replayed_idle"] for r in got], color=colors[p],
                       marker=marker, label=f"{schedule} p={p} replayed")
            ax.scatter([r["microbatches"] for r in got], [r["measured_idle"] for r in got], color=colors[p],
                       marker=marker, facecolors="none", label=f"{schedule} p={p} measured")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("microbatches m")
    ax.set_ylabel("idle fraction of the step")
    ax.set_title("Pipeline bubble")
    ax.legend(fontsize=6, ncol=2)
    at8 = [r for r in rows if r["microbatches"] == 8]
    width = 0.2
    for i, r in enumerate(at8):
        peaks = [b / 2**20 for b in r["peak_step_bytes_per_stage"]]
        mem.bar([s + (i - 1.5) * width for s in range(len(peaks))], peaks, width,
                label=f"{r['schedule']} p={r['stages']}")
    mem.set_xlabel("stage")
    mem.set_ylabel("peak MiB allocated in a step")
    mem.set_title("Activation memory, m = 8")
    mem.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = arguments(__doc__, "pipeline_bubble")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per configuration (median taken)")
    args = parser.parse_args()

    rows = []
    for schedule, p, m in CONFIGS:
        row = measure(schedule, p, m, args.steps)
        rows.append(row)
        print(f"{schedule} p={p} m={m}: formula {row['formula']:.3f}, replayed {row['replayed_idle']:.3f}, "
              f"measured {row['measured_idle']:.3f}{' (oversubscribed)' if row['oversubscribed'] else ''}; "
              f"peak MiB per stage {[round(b / 2**20, 1) for b in row['peak_step_bytes_per_stage']]}", flush=True)
    result = {"shape": SHAPE, "microbatch_rows": MICROBATCH_ROWS, "steps": args.steps, "rows": rows,
              "target": "idle fraction within 20% of (p-1)/(m+p-1)", "machine": machine()}
    save_results(result, args.out, lambda png: plot(rows, png))
    if not args.no_doc:
        write_section("pipeline_bubble", doc_lines(result, args.steps))


def doc_lines(result: dict, steps: int) -> list[str]:
    rows = result["rows"]
    table = []
    for r in rows:
        measured = f"{r['measured_idle']:.3f}" + (" (oversubscribed)" if r["oversubscribed"] else "")
        table.append(f"| {r['schedule']} | {r['stages']} | {r['microbatches']} | {r['formula']:.3f} | "
                     f"{r['replayed_idle']:.3f} | {r['replayed_idle'] / r['formula'] - 1:+.0%} | {measured} | "
                     f"{r['measured_idle'] / r['formula'] - 1:+.0%} | {r['step_seconds'] * 1000:.0f} |")
    memory = []
    for p in (2, 4):
        gpipe = next(r for r in rows if (r["schedule"], r["stages"], r["microbatches"]) == ("GPipe", p, 8))
        one = next(r for r in rows if (r["schedule"], r["stages"], r["microbatches"]) == ("1F1B", p, 8))
        cells = [f"{g / 2**20:.1f} / {o / 2**20:.1f} ({o / g:.2f}x)"
                 for g, o in zip(gpipe["peak_step_bytes_per_stage"], one["peak_step_bytes_per_stage"], strict=True)]
        memory.append("| " + " | ".join([str(p), *cells, *[""] * (4 - p)]) + " |")
    return [
        f"`.venv/bin/python bench/pipeline_bubble.py --steps {steps}` ({result['machine']}; medians of {steps} "
        "steps):", "",
        "| schedule | stages p | microbatches m | (p-1)/(m+p-1) | replayed idle | vs formula | measured idle | "
        "vs formula | ms per step |", "|---|---|---|---|---|---|---|---|---|", *table, "",
        "Peak MiB allocated within a step at m = 8, per stage (GPipe / 1F1B):", "",
        "| p | stage 0 | stage 1 | stage 2 | stage 3 |", "|---|---|---|---|---|",
        *memory, "",
        "![pipeline bubble](../bench/results/pipeline_bubble.png)"]


if __name__ == "__main__":
    main()
