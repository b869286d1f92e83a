"""The CLI as users run it: invalid jobs are refused before any process starts, with every bad field named."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from paratrain.api import apply_overrides, load_job
from paratrain.api.load import parse_scalar

from .harness import TINY_JOB, run_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def paratrain(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    # The bound only catches a hang, not slowness under load.
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


def test_validate_gives_both_verdicts_and_fails_only_where_neither_runs(tmp_path):
    """A cluster job's corpus lives on a volume the pods mount, not on the machine that validates it: refused here,
    run there. A local job's relative checkpoint path: run here, refused there. Both refused: exit 1."""
    job = tmp_path / "job.yaml"
    cluster = ["spec.data.source=text", "spec.data.path=/data/c.txt", "spec.checkpoint.path=/checkpoints/x",
               "spec.pod.volumes=[{name: data, mountPath: /data, persistentVolumeClaim: corpus}, "
               "{name: ckpt, mountPath: /checkpoints, persistentVolumeClaim: ckpt}]"]
    job.write_text(yaml.safe_dump(apply_overrides(TINY_JOB, cluster)))
    proc = paratrain("validate", str(job))
    assert proc.returncode == 0, proc.stderr
    assert "here (paratrain run): refused: spec.data.path: " in proc.stdout
    assert "runs/parity/volumes/data/c.txt: no such file" in proc.stdout  # the data volume's local directory
    assert "it is on volume data (/data in pods)" in proc.stdout and "--mount data=DIR" in proc.stdout
    assert "in a cluster (the operator): runs" in proc.stdout

    job.write_text(yaml.safe_dump(apply_overrides(TINY_JOB, ["spec.checkpoint.path=ckpt"])))
    proc = paratrain("validate", str(job))
    assert proc.returncode == 0 and "here (paratrain run): runs" in proc.stdout
    assert "in a cluster (the operator): refused: spec.checkpoint.path: 'ckpt' is relative" in proc.stdout

    job.write_text(yaml.safe_dump(apply_overrides(TINY_JOB, ["spec.checkpoint.path=ckpt", "spec.data.source=text",
                                                             "spec.data.path=/nowhere.txt"])))
    proc = paratrain("validate", str(job))
    assert proc.returncode == 1 and "note, in a cluster" not in proc.stdout


def test_examples_run_from_a_fresh_clone_without_shared_data(tmp_path):
    """The examples' corpus ships with the repository: a clone without ../shared finds it."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    for example in ("shakespeare.yaml", "shakespeare-3d.yaml"):
        job = load_job(clone / "examples" / example)
        assert (clone / job.spec.data.path).is_file(), job.spec.data.path


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_examples_run_in_both_places_or_name_their_twin(example, capsys, monkeypatch):
    """Every example is accepted by the operator as it is (and renders); it runs here too, unless its header says
    why not: a GPU job names its CPU twin, the token example its `paratrain prepare` command. (The CLI runs in this
    process: a fresh interpreter per command would spend most of the test importing torch.)"""
    from paratrain.cli import main

    monkeypatch.chdir(ROOT)
    job = load_job(example)
    assert job.metadata.name == example.stem or example.stem == "gpu-cluster"
    code, out = main(["validate", str(example)]), capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "in a cluster (the operator): runs" in out.out, out.out
    header = "".join(line for line in example.read_text().splitlines(keepends=True) if line.startswith("#"))
    if "here (paratrain run): runs" not in out.out:
        twin = re.search(r"Its CPU twin.*?examples/([a-z0-9-]+\.yaml)", header, re.S)
        prepare = "paratrain prepare" in header and "here (paratrain run): refused: spec.data.path:" in out.out
        assert prepare or (twin and (ROOT / "examples" / twin.group(1)).is_file()), out.out
    if job.spec.resources.gpus_per_node == 0:
        assert "kubectl apply -f examples/cluster/checkpoints-pvc.yaml" in header
    code, out = main(["render", str(example)]), capsys.readouterr()
    assert code == 0 and "kind: Pod" in out.out, out.err


def test_a_cluster_job_runs_locally_with_its_volumes_mapped(tmp_path):
    """tests/e2e/jobs/gloo-failover.yaml (checkpoints on a PVC at /checkpoints/e2e-gloo-failover), unchanged but for
    its length: `--mount checkpoints=DIR` puts the checkpoints in DIR/e2e-gloo-failover; else under the workdir."""
    job = yaml.safe_load((ROOT / "tests/e2e/jobs/gloo-failover.yaml").read_text())
    short = ["spec.training.steps=4", "spec.training.warmupSteps=1", "spec.training.evalInterval=2",
             "spec.checkpoint.interval=2"]
    proc, _ = run_job(tmp_path / "a", short, job=job, args=["--mount", f"checkpoints={tmp_path / 'pvc'}"])
    assert sorted(p.name for p in (tmp_path / "pvc" / "e2e-gloo-failover").glob("step-*")) == [
        "step-00000002", "step-00000004"]
    assert f"volume checkpoints (/checkpoints in pods) is {tmp_path / 'pvc'}" in proc.stderr
    run_job(tmp_path / "b", short, job=job)
    assert list((tmp_path / "b" / "work" / "volumes" / "checkpoints" / "e2e-gloo-failover").glob("step-*"))
    proc, _ = run_job(tmp_path / "c", short, job=job, args=["--mount", "nope=/tmp"], expect_ok=False)
    assert proc.returncode == 1 and "--mount: no volume 'nope' in spec.pod.volumes (it has: checkpoints)" in proc.stderr
