"""The memory model (paratrain.api.memory) against measurement, over every layout of its test, in one table.

    .venv/bin/python bench/memory_model.py [--only NAME ...]

tests/trainer/test_memory_model.py asserts each layout's predicted peak within ±15% of the measured one; this
records how close each is. Every layout there (the one list: imported from the test) runs 3 steps with
`paratrain run --measure-memory` (each rank's peak bytes of live tensors) and is set against `predict(spec,
vocab)`, the figures `paratrain validate --memory` and the operator's admission check use. Reported per layout:
the largest rank's predicted and measured peak and the worst error over its ranks; then the worst over all
layouts. Writes bench/results/memory_model.json and .png, and the `memory_model` section of docs/benchmarks.md.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from doc_section import arguments, machine, pyplot, save_results, write_section
from jobs import run_job

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.trainer.test_memory_model import LAYOUTS, TOLERANCE, job_of  # noqa: E402  (the test's layouts)


def measure(name: str, tmp: Path) -> dict:
    from paratrain.api.load import parse_job
    from paratrain.api.memory import predict

    job = job_of(name)
    measured = run_job(job, tmp / name, args=["--measure-memory"])["peak_tensor_bytes"]
    predicted = [r.peak_bytes for r in predict(parse_job(job).spec, job["spec"]["model"]["vocabSize"])]
    errors = [(p - m) / m for p, m in zip(predicted, measured, strict=True)]
    worst = max(range(len(errors)), key=lambda i: abs(errors[i]))
    return {"layout": name, "ranks": len(measured), "predicted": predicted, "measured": measured,
            "errors": errors, "worst_rank": worst, "worst_error": errors[worst]}


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(rows) + 1.2))
    names = [r["layout"] for r in rows]
    ax.barh(range(len(rows)), [100 * r["worst_error"] for r in rows])
    for bound in (-100 * TOLERANCE, 100 * TOLERANCE):
        ax.axvline(bound, color="red", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("predicted peak − measured, % of measured (worst rank)")
    ax.set_title("Memory model against measurement (test tolerance dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = arguments(__doc__, "memory_model")
    parser.add_argument("--only", nargs="+", choices=list(LAYOUTS), help="these layouts alone (no docs update)")
    args = parser.parse_args()
    names = args.only or list(LAYOUTS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rows.append(row := measure(name, Path(tmp)))
            r = row["worst_rank"]
            print(f"{name}: rank {r} predicted {row['predicted'][r] / 2**20:.2f} MiB, measured "
                  f"{row['measured'][r] / 2**20:.2f} MiB, {row['worst_error']:+.1%}", flush=True)
    worst = max(rows, key=lambda row: abs(row["worst_error"]))
    result = {"layouts": rows, "worst": {"layout": worst["layout"], "error": worst["worst_error"]},
              "tolerance": TOLERANCE, "machine": machine()}
    save_results(result, args.out, lambda png: plot(rows, png))
    print(f"worst: {worst['layout']} {worst['worst_error']:+.1%}")
    if args.no_doc or args.only:
        return
    table = [f"| {row['layout']} | {row['ranks']} | {row['predicted'][row['worst_rank']] / 2**20:.2f} | "
             f"{row['measured'][row['worst_rank']] / 2**20:.2f} | {row['worst_error']:+.1%} |" for row in rows]
    write_section("memory_model", [
        f"`.venv/bin/python bench/memory_model.py` ({result['machine']}): every layout of "
        "tests/trainer/test_memory_model.py, the rank whose prediction is furthest off (MiB of live tensors):", "",
        "| layout | ranks | predicted | measured | error |", "|---|---|---|---|---|", *table, "",
        f"Worst: **{worst['layout']}, {worst['worst_error']:+.1%}** (the test's bound: ±{TOLERANCE:.0%}).", "",
        "![memory model errors](../bench/results/memory_model.png)"])


if __name__ == "__main__":
    main()
