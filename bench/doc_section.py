"""Benchmarks write their tables into docs/benchmarks.md between `<!-- bench:NAME:begin/end -->` markers."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


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
