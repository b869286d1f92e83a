"""The kind end to end (scripts/kind-e2e.sh) and docs/kind.md's walkthrough (`--doc`), on a real kind cluster whose
node image, tools and images are all built on this machine (scripts/kindbin.sh, scripts/base-image.sh). They run
where that build is cached; elsewhere they are skipped, naming the command that builds it (tens of minutes the first
time on 2 cores; docs/kind.md has the figures).

    bash scripts/docker.sh start && bash scripts/kindbin.sh
    .venv/bin/python -m pytest tests/e2e/test_kind.py -ra
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "kind-e2e.sh"


def missing_prerequisite() -> str | None:
    """Why the kind e2e cannot run here, or None when it can."""
    docker = subprocess.run(["bash", str(ROOT / "scripts" / "docker.sh"), "status"], capture_output=True, text=True)
    if docker.returncode != 0:
        return f"scripts/docker.sh status failed: {docker.stderr.strip()}"
    built = subprocess.run(["bash", str(ROOT / "scripts" / "kindbin.sh"), "--path"], capture_output=True)
    if built.returncode != 0 and docker.stdout.strip() != "none":
        return "kind, helm and the kind node image are not built here: run `bash scripts/kindbin.sh`"
    if built.returncode != 0:
        return ("no Docker daemon answers and the kind node image is not built: run "
                "`bash scripts/docker.sh start && bash scripts/kindbin.sh`")
    return None


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("mode", [[], ["--doc"]], ids=["e2e", "docs-kind-walkthrough"])
def test_kind_end_to_end(mode: list[str]) -> None:
    """The e2e script's own checks, and docs/kind.md's blocks run as a reader runs them."""
    reason = missing_prerequisite()
    if reason:
        pytest.skip(f"kind e2e: {reason}")
    result = subprocess.run(["bash", str(SCRIPT), *mode], cwd=ROOT, timeout=3500)
    assert result.returncode == 0, f"{SCRIPT.name} failed (exit {result.returncode}); see its captured output for the diagnostics"
