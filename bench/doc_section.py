"""Benchmarks write their tables into docs/benchmarks.md between `<!-- bench:NAME:begin/end -->` markers, and their
results as JSON with a plot beside it."""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
RESULTS = Path(__file__).resolve().parent / "results"


def arguments(doc: str, name: str) -> argparse.ArgumentParser:
    """A benchmark's command line with the options every one takes: `--out` (its JSON, default
    bench/results/NAME.json; the plot goes beside it) and `--no-doc`. `doc` is the script's docstring, its help."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / f"{name}.json")
    parser.add_argument("--no-doc", action="store_true", help="leave docs/benchmarks.md alone")
    return parser


def write_section(name: str, lines: list[str], doc: Path = DOC) -> None:
    """Replace the section `name` of `doc` with `lines` (appended at the end the first time)."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if begin not in text:
        text = f"{text.rstrip()}\n\n{begin}\n{end}\n"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    doc.write_text(head + "\n".join([begin, "", *lines, "", end]) + tail)
    print(f"updated the {name} section of {doc}")


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_results(result: dict[str, Any], out: Path, draw: Callable[[Path], None]) -> None:
    """`result` as JSON at `out`, and `draw`'s plot beside it (same name, .png)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    draw(out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
