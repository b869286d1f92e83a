"""Loss curves of every parity-tested layout at an example's full length, one plot per model family.

    .venv/bin/python bench/loss_curves.py [--family gpt|llama|both] [--out bench/results/loss_curves.json]

The parity tests (tests/trainer/parallel/test_parity.py and test_parity_llama.py) check each layout against one process
over 10 steps of a tiny model. This runs the same layouts on the examples at their own length through `paratrain
run`: examples/shakespeare.yaml (the GPT family, 600 steps, character-level) and examples/llama-tokens.yaml (the
Llama family, 200 steps on byte-level BPE tokens, prepared here first by `paratrain prepare --train-bpe 2048`, as
the example says). Each layout's world is its own (one process per node); everything else is the example's.

For each: the loss curve, its largest relative gap to the single-process curve over the whole run, and the
validation loss. The plot draws every curve of a family on one axis, and beside it each layout's largest gap to
the single-process run up to each step (log scale). Writes bench/results/loss_curves.json and loss_curves.png, and the
`loss_curves` section of docs/benchmarks.md.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from doc_section import arguments, machine, pyplot, save_results, write_section
from jobs import run_job

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "examples" / "data" / "tinyshakespeare.txt"


def parity_layouts(family: str) -> dict[str, list[str]]:
    """The parity tests' own layouts (their --set overrides), with the single process first."""
    sys.path.insert(0, str(ROOT))
    from tests.trainer.harness import layout
    from tests.trainer.parallel.test_parity import LAYOUTS as GPT
    from tests.trainer.parallel.test_parity_llama import LAYOUTS as LLAMA

    return {"single process": layout(), **(GPT if family == "gpt" else LLAMA)}


def example_job(family: str, tmp: Path) -> dict:
    """The family's example, as `paratrain run` takes it here: its data path absolute, no checkpoints or volumes
    (the layouts run one after another and must not resume each other)."""
    name = {"gpt": "shakespeare.yaml", "llama": "llama-tokens.yaml"}[family]
    job = yaml.safe_load((ROOT / "examples" / name).read_text())
    spec = job["spec"]
    spec["checkpoint"], spec["pod"], spec["procsPerNode"] = {}, {}, 1
    if family == "gpt":
        spec["data"]["path"] = str(TEXT)
    else:
        tokens = tmp / "shakespeare-bpe"
        subprocess.run([sys.executable, "-m", "paratrain.cli", "prepare", "--train-bpe", "2048", "--out",
                        str(tokens), str(TEXT)], check=True, capture_output=True)
        spec["data"]["path"] = str(tokens)
    return job


def family_curves(family: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        job = example_job(family, tmp)
        runs = {}
        for i, (name, overrides) in enumerate(parity_layouts(family).items()):
            runs[name] = run_job(job, tmp / str(i), overrides)
            print(f"{family} {name}: final loss {runs[name]['losses'][-1]:.4f}, val loss {runs[name]['val_loss']:.4f}"
                  f" ({runs[name]['seconds']:.0f} s)", flush=True)
    reference = runs["single process"]["losses"]
    layouts = {}
    for name, m in runs.items():
        gaps = [abs(a - b) / abs(b) for a, b in zip(m["losses"], reference, strict=True)]
        layouts[name] = {"losses": m["losses"], "gaps": gaps, "largest_gap": max(gaps), "val_loss": m["val_loss"],
                         "world": m.get("world_size"), "seconds": m["seconds"]}
    return {"example": job["metadata"]["name"], "steps": len(reference), "layouts": layouts}


def plot(families: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(len(families), 2, figsize=(11, 3.6 * len(families)), squeeze=False)
    for (family, got), (curves, gaps) in zip(families.items(), axes, strict=True):
        for name, r in got["layouts"].items():
            steps = range(1, len(r["losses"]) + 1)
            curves.plot(steps, r["losses"], linewidth=0.7, label=name)
            if name != "single process":  # the largest gap so far: per-step gaps swing over decades
                gaps.plot(steps, [max(g, 1e-9) for g in itertools.accumulate(r["gaps"], max)], linewidth=0.8,
                          label=name)
        curves.set_title(f"{got['example']} ({family}): every parity layout")
        curves.set_xlabel("step")
        curves.set_ylabel("training loss (nats)")
        curves.legend(fontsize=6)
        gaps.set_yscale("log")
        gaps.set_title("largest relative gap to the single-process curve so far")
        gaps.set_xlabel("step")
        gaps.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = arguments(__doc__, "loss_curves")
    parser.add_argument("--family", choices=("gpt", "llama", "both"), default="both")
    args = parser.parse_args()

    families = {f: family_curves(f) for f in (("gpt", "llama") if args.family == "both" else (args.family,))}
    result = {"families": families, "machine": machine()}
    save_results(result, args.out, lambda png: plot(families, png))
    if not args.no_doc:
        write_section("loss_curves", doc_lines(result, args.family))


def doc_lines(result: dict, family: str) -> list[str]:
    lines = [f"`.venv/bin/python bench/loss_curves.py --family {family}` ({result['machine']}):", ""]
    for name, got in result["families"].items():
        lines += [f"{got['example']} ({name}), {got['steps']} steps:", "",
                  "| layout | processes | largest loss gap to one process | val loss | seconds |",
                  "|---|---|---|---|---|"]
        lines += [f"| {layout} | {r['world']} | {r['largest_gap']:.1e} | {r['val_loss']:.4f} | {r['seconds']:.0f} |"
                  for layout, r in got["layouts"].items()]
        lines.append("")
    return [*lines, "![loss curves](../bench/results/loss_curves.png)"]


if __name__ == "__main__":
    main()
