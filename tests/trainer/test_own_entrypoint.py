"""A training program of its own (spec.entrypoint): examples/own-script.yaml run by `paratrain run` as the pods run
it (its command once per node with the node env, so `torchrun train.py` needs no flags), resuming from its own
checkpoint on the mapped volume; and paratrain.progress, the helper that reports progress as the trainer does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml

from paratrain import contract
from paratrain.launch import free_port
from paratrain.progress import Progress

ROOT = Path(__file__).resolve().parents[2]


def _run(job: dict, tmp_path: Path, work: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return subprocess.run([sys.executable, "-m", "paratrain.cli", "run", str(path), "--workdir", str(work),
                           "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _steps(work: Path) -> list[int]:
    events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
    return [e["step"] for e in events if e["event"] == "step"]


def test_the_own_script_example_trains_here_and_resumes_from_its_checkpoint(tmp_path):
    job = yaml.safe_load((ROOT / "examples" / "own-script.yaml").read_text())
    job["spec"]["entrypoint"]["args"] += ["--steps", "20", "--checkpoint-every", "10"]  # argparse: the last wins
    work = tmp_path / "work"
    first = _run(job, tmp_path, work)
    assert first.returncode == 0, first.stderr
    assert "finished 20 steps" in first.stderr and _steps(work) == list(range(1, 21))
    # The program's /checkpoints/own-script, on the local directory of the job's checkpoints volume.
    assert (work / "volumes" / "checkpoints" / "own-script" / "latest.pt").is_file()
    assert (work / "logs" / "node-0.log").is_file() and (work / "logs" / "node-1.log").is_file()

    job["spec"]["entrypoint"]["args"] += ["--steps", "25"]
    again = _run(job, tmp_path, work)
    assert again.returncode == 0, again.stderr
    assert "resume step=20" in (work / "logs" / "node-0.log").read_text()
    assert _steps(work) == list(range(21, 26))


def test_a_program_that_refuses_its_layout_fails_with_its_exit_code(tmp_path):
    job = yaml.safe_load((ROOT / "examples" / "own-script.yaml").read_text())
    job["spec"].update(nodes=2, parallelism={"data": 1, "tensor": 2})  # the script is data parallel only
    result = _run(job, tmp_path, tmp_path / "work")
    # The script's own code (2: permanent), passed on by `paratrain node` where torchrun alone would say 1.
    assert result.returncode == 2, result.stderr
    assert "exited with code 2" in result.stderr
    assert "data parallel only" in (tmp_path / "work" / "logs" / "node-0.log").read_text()


def test_progress_serves_rank_0s_report_and_leaves_the_final_one(tmp_path, monkeypatch):
    port = free_port()
    final = tmp_path / "termination-log"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(contract.ENV_PROGRESS_PORT, str(port))
    monkeypatch.setenv(contract.ENV_PROGRESS_HOST, "127.0.0.1")
    monkeypatch.setenv(contract.ENV_TERMINATION_LOG, str(final))
    with Progress(total_steps=10) as progress:
        progress.step(4, loss=2.5, tokens=1024)
        progress.eval(4, 2.75)
        report = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=5))
        assert (report["step"], report["totalSteps"], report["loss"], report["valLoss"]) == (4, 10, 2.5, 2.75)
        assert report["phase"] == "training" and report["tokensPerSecond"] > 0 and report["etaSeconds"] > 0
    assert json.loads(final.read_text())["phase"] == "done"
    monkeypatch.setenv("RANK", "1")
    with Progress(total_steps=10) as other:  # not rank 0: nothing served, nothing written
        other.step(1, loss=1.0)
    assert json.loads(final.read_text())["step"] == 4
