"""The CLI as users run it: invalid jobs are refused before any process starts, with every bad field named."""

import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from paratrain.api import apply_overrides, load_job
from paratrain.api.load import parse_scalar

from .harness import TINY_JOB, run_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def paratrain(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    # The Shakespeare example takes ~50 s on 2 idle cores: the bound only catches a hang, not slowness under load.
    return subprocess.run([sys.executable, "-m", "paratrain.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


# (overrides, field path the message must name, words it must contain)
INVALID = [
    (["spec.nodes=3"], "spec.parallelism", "must equal nodes(3)"),
    (["spec.model.heads=3"], "spec.model.embedDim", "divisible by heads(3)"),
    (["spec.nodes=2", "spec.parallelism.tensor=2", "spec.model.heads=3", "spec.model.embedDim=48"],
     "spec.model.heads", "divisible by parallelism.tensor(2)"),
    (["spec.nodes=4", "spec.parallelism.pipeline=4", "spec.parallelism.microbatches=4", "spec.model.layers=2"],
     "spec.model.layers", "every stage needs at least one layer"),
    (["spec.nodes=3", "spec.parallelism.data=3"], "spec.training.batchSize", "divisible by parallelism.data(3)"),
    (["spec.nodes=2", "spec.parallelism.pipeline=2", "spec.parallelism.microbatches=3"],
     "spec.parallelism.microbatches", "divisible by microbatches(3)"),
    (["spec.parallelism.zeroStage=2"], "spec.parallelism.zeroStage", "needs parallelism.data >= 2"),
    (["spec.parallelism.zeroStage=4"], "spec.parallelism.zeroStage", "Input should be"),
    (["spec.precision=fp8"], "spec.precision", "'fp32', 'bf16' or 'fp16'"),
    (["spec.parallelism.data=0"], "spec.parallelism.data", "greater than or equal to 1"),
    (["spec.parallelism.tensr=2"], "spec.parallelism.tensr", "unknown field"),
    (["spec.data.source=text"], "spec.data.path", "needs data.path"),
    (["spec.training.warmupSteps=50"], "spec.training.warmupSteps", "<= steps(10)"),
    (["spec.resources.gpusPerNode=2"], "spec.resources.gpusPerNode", "must equal procsPerNode(1)"),
    (["spec.training.learningRate=-1"], "spec.training.learningRate", "greater than 0"),
    (["metadata.name=Bad_Name"], "metadata.name", "DNS label"),
    (["spec.data.source=text", "spec.data.path=no/such/corpus.txt"], "spec.data.path", "no/such/corpus.txt: no such "
     "file (looked for"),
    (["spec.data.source=tokens", "spec.data.path=no/such/tokens"], "spec.data.path", "no/such/tokens: no such "
     "directory (looked for"),
]


@pytest.mark.parametrize("overrides,field,words", INVALID, ids=[c[1] + ":" + c[2][:20] for c in INVALID])
def test_invalid_job_is_refused_before_launch(overrides, field, words, tmp_path):
    proc, metrics = run_job(tmp_path, overrides, expect_ok=False)
    assert proc.returncode == 1
    assert f"{field}: " in proc.stderr and words in proc.stderr, proc.stderr
    assert not (tmp_path / "work").exists(), "no process may start for an invalid job"
    assert metrics is None


def test_validate_lists_every_problem(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(apply_overrides(TINY_JOB, ["spec.nodes=3", "spec.model.heads=3",
                                                             "spec.parallelism.zeroStage=1"])))
    proc = paratrain("validate", str(job))
    assert proc.returncode == 1
    for field in ("spec.parallelism:", "spec.model.embedDim:", "spec.parallelism.zeroStage:"):
        assert field in proc.stderr


def test_validate_prints_the_parameter_count(tmp_path):
    """llama3-8b's 8,030,261,248 parameters at Llama 3's vocabulary (the model card's 8.03B), from the spec alone."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(apply_overrides(TINY_JOB, ["spec.model={}", "spec.model.preset=llama3-8b",
                                                             "spec.model.vocabSize=128256"])))
    proc = paratrain("validate", str(job))
    assert proc.returncode == 0 and "llama, 8,030,261,248 parameters" in proc.stdout, proc.stdout + proc.stderr


def test_set_values_are_yaml_scalars():
    assert [parse_scalar(v) for v in ("2", "true", "1e-3", "1.5", "bf16", "'2'")] == [2, True, 1e-3, 1.5, "bf16", "2"]
    with pytest.raises(ValueError, match="PATH=VALUE"):
        apply_overrides({}, ["spec.nodes"])


def test_validate_notes_a_corpus_missing_here_without_failing(tmp_path):
    """A cluster job's corpus lives on a volume the pods mount, not on the machine that validates it."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(apply_overrides(TINY_JOB, ["spec.data.source=text", "spec.data.path=/data/c.txt"])))
    proc = paratrain("validate", str(job))
    assert proc.returncode == 0 and "note: spec.data.path: /data/c.txt: no such file" in proc.stderr, proc.stderr


def test_examples_run_from_a_fresh_clone_without_shared_data(tmp_path):
    """The examples' corpus ships with the repository: a clone without ../shared finds it."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    for example in ("shakespeare.yaml", "shakespeare-3d.yaml"):
        job = load_job(clone / "examples" / example)
        assert (clone / job.spec.data.path).is_file(), job.spec.data.path


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_examples_are_valid(example):
    job = load_job(example)
    assert job.metadata.name == example.stem or example.stem == "gpu-cluster"
    assert paratrain("validate", str(example)).returncode == 0


def unigram_entropy(text: str) -> float:
    counts = Counter(text)
    return -sum(c / len(text) * math.log(c / len(text)) for c in counts.values())


@pytest.mark.slow
def test_shakespeare_example_learns_far_below_unigram_entropy(tmp_path):
    """The README's first command, as is (checkpoints redirected so a user's earlier run is not resumed)."""
    metrics_file = tmp_path / "m.json"
    proc = paratrain("run", "examples/shakespeare.yaml", "--no-progress", "--metrics-out", str(metrics_file),
                     "--workdir", str(tmp_path / "work"), "--set", f"spec.checkpoint.path={tmp_path / 'ckpt'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    metrics = json.loads(metrics_file.read_text())
    entropy = unigram_entropy(SHAKESPEARE.read_text())  # 3.31 nats: what a model ignoring context achieves
    assert metrics["val_loss"] < entropy - 1.0, (metrics["val_loss"], entropy)
    assert "val loss" in proc.stderr and "finished 600 steps" in proc.stderr


def test_render_refuses_what_only_works_locally(tmp_path):
    """A relative checkpoint path is fine for `paratrain run` but would land on a pod's read-only root (and vanish
    with it): render refuses it, as the operator does, naming the field; an absolute path renders."""
    relative = paratrain("render", "examples/zero1.yaml")
    assert relative.returncode == 1 and "spec.checkpoint.path: 'runs/zero1/checkpoints' is relative" in relative.stderr
    absolute = paratrain("render", "examples/zero1.yaml", "--set", "spec.checkpoint.path=/checkpoints")
    assert absolute.returncode == 0, absolute.stderr
    assert [d["kind"] for d in yaml.safe_load_all(absolute.stdout)].count("Pod") == 2


def test_a_rank_without_the_corpus_fails_naming_the_field():
    """In a pod (no preflight there), a missing corpus is a permanent spec error (exit 2), not a traceback."""
    from paratrain.train.data import load_corpus

    with pytest.raises(ValueError, match=r"^spec\.data\.path: /nowhere/c\.txt: no such file"):
        load_corpus("text", "/nowhere/c.txt", 0.1, 64, 0, 16)
