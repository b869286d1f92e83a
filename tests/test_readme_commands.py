"""Every `paratrain` command the README shows, run as written, in a fresh copy of the repository with a fresh
`.venv` built by `scripts/setup.sh`: no `../shared` beside it, no package installed by hand, the environment
activated as the README says. One test per README block; long training runs take fewer steps through `--set`.

A README block that gains a `paratrain` command, or a new such block, fails `test_every_block_is_covered` until
a test here runs it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

# The module's first test also pays for its clone's set-up (scripts/setup.sh: 1.5 minutes here, 4 on a busy
# machine), which pytest-timeout counts against it: the suite's 600 s would leave the 600-step run too little.
pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ACTIVATE = "source .venv/bin/activate\n"  # what the README asks for once per shell


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, re.S)


def block_with(command: str) -> str:
    [block] = [b for b in bash_blocks() if command in b]
    return block


def paratrain_lines(block: str) -> list[str]:
    return [line for line in block.splitlines() if re.match(r"(bash scripts/setup\.sh|paratrain) ", line)]


def fewer_steps(line: str, steps: int) -> str:
    """A `paratrain run` line as written, with its training shortened."""
    assert " run " in line, line
    return f"{line.split('  #')[0].rstrip()} --set spec.training.steps={steps}"


def clean_env() -> dict[str, str]:
    """This process's environment without its own virtualenv: the commands must work from the fresh one alone."""
    ours = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != ours)
    return env


def sh(clone: Path, script: str, timeout: int = 900) -> subprocess.CompletedProcess:
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=clone, env=clean_env(), text=True,
                         capture_output=True, timeout=timeout)
    assert out.returncode == 0, f"$ {script}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The repository's files as a clone has them (tracked, and new files git would commit), set up by the
    README's own first step."""
    clone = tmp_path_factory.mktemp("readme") / "paratrain"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    assert not (clone / ".venv").exists() and not (clone.parent / "shared").exists()
    sh(clone, "bash scripts/setup.sh")
    return clone


def unigram_entropy(text: str) -> float:
    counts = Counter(text)
    return -sum(c / len(text) * math.log(c / len(text)) for c in counts.values())


def test_every_block_is_covered() -> None:
    """The blocks the tests below take, by a command each holds, are all the blocks with a command to run."""
    taken = {block_with(key) for key in ("paratrain run examples/shakespeare.yaml", ".venv/bin/python -m pytest",
                                         "paratrain validate examples/tensor-parallel.yaml", "paratrain prepare",
                                         "paratrain validate gpt-shakespeare.yaml")}
    runnable = {block for block in bash_blocks() if paratrain_lines(block)}
    assert runnable == taken, f"README blocks no test runs: {runnable - taken}"


@pytest.mark.slow
def test_first_command_trains_shakespeare(clone: Path) -> None:
    """The README's first command, in full: set up, then the example's 600 steps learn far below the corpus'
    unigram entropy (3.31 nats, what a model ignoring context achieves); the README promises about 1.9."""
    [line] = [line for line in block_with("paratrain run examples/shakespeare.yaml").splitlines()
              if "paratrain run" in line]
    sh(clone, f"{line} --metrics-out m.json")
    metrics = json.loads((clone / "m.json").read_text())
    entropy = unigram_entropy((clone / "examples/data/tinyshakespeare.txt").read_text())
    assert metrics["val_loss"] < entropy - 1.0, (metrics["val_loss"], entropy)
    assert metrics["val_loss"] < 2.1, metrics["val_loss"]


def test_second_command_sets_up_and_collects_the_suite(clone: Path) -> None:
    """The README's test command, its pytest collecting only (the suite itself is what runs it): every test
    module imports from the fresh environment."""
    [line] = [line for line in block_with(".venv/bin/python -m pytest").splitlines() if "-m pytest" in line]
    assert line.endswith(".venv/bin/python -m pytest"), line
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith(line), ".ci/run runs exactly the README's command"
    out = sh(clone, f"{line} --collect-only -q -p no:cacheprovider")
    assert re.search(r"^(\d+) tests collected in ", out.stdout, re.M), out.stdout[-2000:]
    assert "error" not in out.stdout.splitlines()[-1].lower(), out.stdout[-3000:]


def test_modes_block_validates_runs_and_renders(clone: Path) -> None:
    validate, run, render, explain = paratrain_lines(block_with("paratrain validate examples/tensor-parallel.yaml"))
    sh(clone, ACTIVATE + validate)
    sh(clone, ACTIVATE + fewer_steps(run, 20))
    metrics = json.loads((clone / "m.json").read_text())
    assert metrics["world_size"] == 4 and len(metrics["losses"]) == 20, metrics.keys()
    rendered = list(yaml.safe_load_all(sh(clone, ACTIVATE + render).stdout))
    assert {doc["kind"] for doc in rendered} >= {"Service", "ConfigMap", "Pod"}
    assert "  chosen: data " in sh(clone, ACTIVATE + explain).stdout  # the planner's choice, on the GPU it names


def test_tokens_block_prepares_trains_and_exports(clone: Path) -> None:
    prepare, run, export = paratrain_lines(block_with("paratrain prepare"))
    sh(clone, ACTIVATE + prepare)
    assert json.loads((clone / "examples/data/shakespeare-bpe/manifest.json").read_text())
    sh(clone, ACTIVATE + fewer_steps(run, 20))
    sh(clone, ACTIVATE + export)
    hf = clone / "runs/llama-tokens/hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in hf.iterdir()}
    # As the README says: transformers loads it as a LlamaForCausalLM (the fresh environment's transformers).
    loaded = sh(clone, ACTIVATE + "python -c 'import transformers as t; "
                f"print(type(t.AutoModelForCausalLM.from_pretrained(\"{hf}\")).__name__)'")
    assert loaded.stdout.strip().splitlines()[-1] == "LlamaForCausalLM"


def test_gpu_cluster_job_validates_and_renders(clone: Path) -> None:
    """The README's GPU job, saved under the name its first line gives, through the block's paratrain lines."""
    [job] = [b for b in re.findall(r"```yaml\n(.*?)```", README, re.S) if b.startswith("# gpt-shakespeare.yaml")]
    (clone / "gpt-shakespeare.yaml").write_text(job)
    validate, render = paratrain_lines(block_with("paratrain validate gpt-shakespeare.yaml"))
    sh(clone, ACTIVATE + validate)
    pods = [d for d in yaml.safe_load_all(sh(clone, ACTIVATE + render).stdout) if d["kind"] == "Pod"]
    assert len(pods) == 2
    assert all(p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8" for p in pods)
