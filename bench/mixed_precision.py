"""Mixed precision against fp32 on the Shakespeare example, measured side by side.

    .venv/bin/python bench/mixed_precision.py [--steps 500] [--out bench/results/mixed_precision.json]

examples/shakespeare.yaml (a character-level GPT, data-parallel over 2 processes) trains for `--steps` steps in
fp32, bf16 and fp16 (autocast; fp16 with dynamic loss scaling), one after the other in one invocation, through
`paratrain run`. For each: tokens/s and seconds per step, the largest gap between its loss curve and fp32's (per
step, relative), its final validation loss, and the fp16 steps skipped for an overflow. On a CPU without native
16-bit matrix units (AVX512-BF16/AMX, AVX512-FP16) the 16-bit runs are emulated and slower than fp32: the speed
column says how this machine does, the curves how the numerics do. Writes bench/results/mixed_precision.json and
mixed_precision.png, and the `mixed_precision` section of docs/benchmarks.md.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml
from doc_section import arguments, machine, pyplot, save_results, write_section
from jobs import run_job

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "shakespeare.yaml"
PRECISIONS = ("fp32", "bf16", "fp16")


def run(precision: str, steps: int, tmp: Path) -> dict:
    job = yaml.safe_load(EXAMPLE.read_text())
    spec = job["spec"]
    spec["precision"] = precision
    spec["training"].update(steps=steps, evalInterval=steps)
    spec["checkpoint"] = {}
    spec["pod"] = {}
    spec["data"]["path"] = str(ROOT / spec["data"]["path"])
    return run_job(job, tmp)


def plot(curves: dict[str, list[float]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for precision, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=precision, linewidth=0.9)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title("Shakespeare example, DP=2: fp32, bf16 and fp16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = arguments(__doc__, "mixed_precision")
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()

    from paratrain.train.parallel.precision import cpu_has_native_fp16

    got = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        for precision in PRECISIONS:
            got[precision] = run(precision, args.steps, Path(tmp_name) / precision)
            print(f"{precision}: {got[precision]['tokens_per_second']:,.0f} tokens/s, val loss "
                  f"{got[precision]['val_loss']:.4f}, {got[precision]['skipped_steps']} steps skipped")
    reference = got["fp32"]
    rows = {}
    for precision, m in got.items():
        gap = max(abs(a - b) / abs(b) for a, b in zip(m["losses"], reference["losses"]))
        seconds = (m["step_time_seconds"]["forward_backward"] + m["step_time_seconds"]["optimizer"]) / args.steps
        rows[precision] = {"tokens_per_second": m["tokens_per_second"], "seconds_per_step": seconds,
                           "speed_over_fp32": m["tokens_per_second"] / reference["tokens_per_second"],
                           "largest_relative_loss_gap": gap, "val_loss": m["val_loss"],
                           "skipped_steps": m["skipped_steps"], "losses": m["losses"]}
    result = {"example": "examples/shakespeare.yaml", "steps": args.steps, "precisions": rows,
              "cpu_native_fp16": cpu_has_native_fp16(),
              "machine": machine()}
    save_results(result, args.out, lambda png: plot({p: r["losses"] for p, r in rows.items()}, png))
    if not args.no_doc:
        table = [f"| {p} | {r['tokens_per_second']:,.0f} | {r['seconds_per_step'] * 1000:.1f} | "
                 f"{r['speed_over_fp32']:.2f}x | {r['largest_relative_loss_gap']:.2%} | {r['val_loss']:.4f} | "
                 f"{r['skipped_steps']} |" for p, r in rows.items()]
        write_section("mixed_precision", [
            f"`.venv/bin/python bench/mixed_precision.py --steps {args.steps}` ({result['machine']}; native fp16 "
            f"on this CPU: {'yes' if result['cpu_native_fp16'] else 'no'}):", "",
            "| precision | tokens/s | ms per step | speed over fp32 | largest loss gap to fp32 | val loss | "
            "steps skipped |", "|---|---|---|---|---|---|---|", *table, "",
            "![mixed precision loss curves](../bench/results/mixed_precision.png)"])


if __name__ == "__main__":
    main()
