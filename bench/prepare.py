"""How fast `paratrain prepare` tokenizes, and what checking a token directory before launch costs.

    .venv/bin/python bench/prepare.py [--copies 9] [--out bench/results/prepare.json]

The input is examples/data/tinyshakespeare.txt repeated `--copies` times (9: about 10 MB). Each variant runs the
user's command (`paratrain prepare`, a fresh process, interpreter start-up included) side by side in one
invocation: training a byte-level BPE then encoding, and encoding with the tokenizer that run wrote. Wall time moves
with other load on the machine (its load average is recorded); CPU seconds (user + system, all threads) move less.
The checksum row times `open_token_dir(..., checksums=True)`, what `paratrain run` and `validate` do before launch.
Writes JSON and regenerates the table in docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from doc_section import DOC, write_section

from paratrain.token_shards import open_token_dir

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "examples" / "data" / "tinyshakespeare.txt"


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_prepare(out: Path, corpus: Path, tokenizer_args: list[str]) -> dict:
    started, cpu_before = time.perf_counter(), _children_cpu_seconds()
    subprocess.run([sys.executable, "-m", "paratrain.cli", "prepare", *tokenizer_args, "--out", str(out),
                    "--no-progress", str(corpus)], check=True, capture_output=True)
    seconds = time.perf_counter() - started
    cpu_seconds = _children_cpu_seconds() - cpu_before  # what other load on the machine changes least
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = manifest["train"]["tokens"] + manifest["val"]["tokens"]
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": tokens,
            "megabytes_per_second": corpus.stat().st_size / 1e6 / seconds,
            "tokens_per_second": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=9)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "prepare.json"))
    args = parser.parse_args()
    load = os.getloadavg()[0]  # other work on the machine slows every row alike
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_bytes(TEXT.read_bytes() * args.copies)
        trained, given = Path(tmp) / "trained", Path(tmp) / "given"
        results = {"--train-bpe 2048 (train, then encode)": timed_prepare(trained, corpus, ["--train-bpe", "2048"])}
        tokenizer = Path(tmp) / "tokenizer.json"
        tokenizer.write_bytes((trained / "tokenizer.json").read_bytes())
        results["--tokenizer (encode only)"] = timed_prepare(given, corpus, ["--tokenizer", str(tokenizer)])
        started = time.perf_counter()
        open_token_dir(given, checksums=True)
        shard_bytes = sum(p.stat().st_size for p in given.glob("*.bin"))
        seconds = time.perf_counter() - started
        checks = {"shard_megabytes": shard_bytes / 1e6, "seconds": seconds,
                  "megabytes_per_second": shard_bytes / 1e6 / seconds}
    for name, r in results.items():
        print(f"{name:40s} {r['seconds']:6.2f} s ({r['cpu_seconds']:5.2f} CPU s)  "
              f"{r['megabytes_per_second']:6.2f} MB/s  "
              f"{r['tokens_per_second']:12,.0f} tokens/s", flush=True)
    print(f"{'checksums before launch':40s} {checks['seconds']:6.2f} s  {checks['megabytes_per_second']:6.0f} MB/s")
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
              "input_megabytes": len(TEXT.read_bytes()) * args.copies / 1e6, "results": results,
              "checksums": checks, "load_average_at_start": load}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    write_doc(report)
    print(f"wrote {args.out} and {DOC}")


def write_doc(report: dict) -> None:
    c = report["checksums"]
    lines = [f"Measured on {report['machine']} (load average {report['load_average_at_start']:.1f} at "
             f"the start), {report['input_megabytes']:.1f} MB of text (`.venv/bin/python bench/prepare.py`).", "",
             "| command | seconds | CPU seconds | MB/s | tokens/s |", "|---|---|---|---|---|"]
    for name, r in report["results"].items():
        lines.append(f"| `paratrain prepare {name.split(' (')[0]}` ({name.split(' (')[1]} | {r['seconds']:.2f} | "
                     f"{r['cpu_seconds']:.2f} | "
                     f"{r['megabytes_per_second']:.2f} | {r['tokens_per_second']:,.0f} |")
    lines += ["", f"Checking every shard's SHA-256 before launch ({c['shard_megabytes']:.1f} MB of shards): "
              f"{c['seconds']:.2f} s, {c['megabytes_per_second']:,.0f} MB/s."]
    write_section("prepare", lines)

if __name__ == "__main__":
    main()
