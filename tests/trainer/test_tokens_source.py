"""Training on a token directory (`spec.data.source: tokens`): it learns, data parallel matches one process, a rank
holds only the windows it draws, and a broken directory is refused before launch, naming the shard."""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from paratrain.api import apply_overrides
from paratrain.prepare import ShardWriter, split_of
from paratrain.token_shards import FORMAT, FORMAT_VERSION, Manifest, TokenizerInfo, write_manifest

from .harness import TINY_JOB, assert_close_curves, layout, run_job
from .test_cli import ROOT, paratrain
from .test_prepare import copy_dir


def tokens_job(path: Path) -> dict:
    return apply_overrides(TINY_JOB, ["spec.data.source=tokens", f"spec.data.path={path}"])


@pytest.fixture(scope="module")
def single_run(job_runs, token_dir):
    return job_runs("tokens-single", [], spec=tokens_job(token_dir))[1]


def test_a_token_directory_trains_with_its_own_vocabulary(single_run):
    """The model's vocabulary is the manifest's 512 (spec.model.vocabSize, 64, is the synthetic source's): a 64-way
    head could not start near log(512) nor fall below it."""
    losses, val = single_run["losses"], single_run["val_losses"]
    assert abs(losses[0] - math.log(512)) < 0.15, losses[0]
    assert losses[-1] < losses[0] - 0.2 and val[-1][1] < math.log(512) - 0.15, (losses, val)


def test_data_parallel_matches_one_process_on_a_token_directory(tmp_path, token_dir, single_run):
    _, dp = run_job(tmp_path, layout(data=2), job=tokens_job(token_dir))
    assert_close_curves(dp["losses"], single_run["losses"], rtol=1e-4)
    assert dp["val_loss"] == pytest.approx(single_run["val_loss"], rel=1e-4)


RSS_PROBE = """
import sys
from paratrain.train.data import global_batch, load_corpus

def heap():  # bytes of this process's anonymous resident memory (the memory maps' pages are file-backed)
    return 1024 * next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:"))

corpora = []  # each kept alive: a loader that copied its corpus would show it in the next measurement
for path in sys.argv[1:]:
    before = heap()
    corpora.append(load_corpus("tokens", path, 0.1, 64, 0, 64))
    for step in range(50):
        global_batch(corpora[-1].train, 16, 64, 0, step)
        global_batch(corpora[-1].val, 16, 64, 0, step, 1)
    print(heap() - before)
"""


def counting_token_dir(root: Path, train_tokens: int) -> Path:
    """A token directory written straight from numpy (no tokenizer): ids counting up modulo 50000, in shards of 10M
    tokens."""
    root.mkdir()
    splits = {}
    for split, total in (("train", train_tokens), ("val", 100_000)):
        writer = ShardWriter(root, split, "uint16", 10_000_000)
        for start in range(0, total, 5_000_000):
            writer.write((np.arange(start, min(start + 5_000_000, total)) % 50_000).astype(np.uint16))
        splits[split] = split_of(writer.close(), "uint16")
    write_manifest(root, Manifest(format=FORMAT, version=FORMAT_VERSION, vocab_size=50_000, dtype="uint16",
                                  tokenizer=TokenizerInfo(source="none: counting ids", sha256="0" * 64,
                                                          eos_token="<|endoftext|>", eos_id=0),
                                  val_fraction=None, inputs=[], **splits))
    return root


def test_a_rank_holds_windows_not_the_corpus(tmp_path):
    """Loading a 100 MB directory and drawing batches from it grows a process's heap no more than a 20 MB one does:
    the shards stay on disk (in the page cache), only the windows are copied."""
    small, large = counting_token_dir(tmp_path / "small", 10_000_000), counting_token_dir(tmp_path / "large",
                                                                                          50_000_000)
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(small), str(large)], capture_output=True, text=True,
                         timeout=120, check=True)
    small_growth, large_growth = map(int, out.stdout.split())
    size_difference = 2 * (50_000_000 - 10_000_000)
    assert large_growth - small_growth < size_difference / 50, (small_growth, large_growth)
    assert large_growth < 16 * 2**20, (small_growth, large_growth)


def test_a_corrupt_shard_is_refused_before_launch_by_run_and_validate(tmp_path, token_dir):
    """Sizes agree, so a rank would not notice; `run` and `validate` hash every shard before anything starts."""
    copy = copy_dir(token_dir, tmp_path / "tokens")
    shard = copy / "train-00002.bin"
    shard.write_bytes(shard.read_bytes()[:-2] + b"\x01\x00")
    proc, _ = run_job(tmp_path / "run", job=tokens_job(copy), expect_ok=False)
    message = f"spec.data.path: {copy}: train-00002.bin: SHA-256 differs from the manifest's"
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "work").exists(), "no process may start"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(tokens_job(copy)))
    validate = paratrain("validate", str(tmp_path / "job.yaml"))
    assert validate.returncode == 1 and message in validate.stderr, validate.stderr


def test_the_example_runs_after_the_readme_prepare_command(tmp_path):
    """The README's prepare command, as written, makes the directory examples/llama-tokens.yaml reads (both
    relative to the working directory, here a scratch one holding the shipped text); its export command then
    writes the run's checkpoint as a Hugging Face Llama."""
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("paratrain prepare "))
    command = shlex.split(line.split("#")[0])
    assert "examples/data/shakespeare-bpe" in command
    (tmp_path / "examples" / "data").mkdir(parents=True)
    (tmp_path / "examples" / "data" / "tinyshakespeare.txt").symlink_to(ROOT / "examples/data/tinyshakespeare.txt")
    (tmp_path / "examples" / "llama-tokens.yaml").symlink_to(ROOT / "examples/llama-tokens.yaml")
    prepared = paratrain(*command[1:], cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    assert re.search(r"vocabulary 2048 \(uint16\)", prepared.stderr), prepared.stderr
    run = paratrain("run", "examples/llama-tokens.yaml", "--no-progress", "--set",
                    "spec.training.steps=2", "--set", "spec.training.warmupSteps=1", "--set",
                    "spec.training.evalSteps=1", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "data 2 × tensor 2 × pipeline 1" in run.stderr and "finished 2 steps" in run.stderr
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("paratrain export "))
    export = paratrain(*shlex.split(line.split("#")[0])[1:], cwd=tmp_path)
    assert export.returncode == 0, export.stderr
    hf = json.loads((tmp_path / "runs" / "llama-tokens" / "hf" / "config.json").read_text())
    assert (hf["architectures"], hf["vocab_size"]) == (["LlamaForCausalLM"], 2048)
    assert (tmp_path / "runs" / "llama-tokens" / "hf" / "tokenizer.json").is_file()
