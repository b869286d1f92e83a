"""The kind end to end: scripts/kind-e2e.sh runs docs/kind.md as a reader does, then checks what only a real
kubelet shows on that same cluster (a control plane and two workers whose node image, tools and images are all
built on this machine by scripts/kindbin.sh and the page's image steps), then cleans up.

It runs wherever a Docker daemon answers or can be started (scripts/docker.sh installs Debian's docker.io and starts
dockerd where none answers); only where none can be started is it skipped, with the reason. The first run builds
kind, helm and the node image (about 17 minutes on 2 cores, then cached beside testbin's control plane); the
conftest schedules this module first so that the build overlaps the rest of the suite.

    .venv/bin/python -m pytest tests/e2e/test_kind.py -ra
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "kind-e2e.sh"
NO_DOCKER = 3  # kind-e2e.sh's exit code where no Docker daemon answers and none can be started


def shown(output: str, each: int = 15000) -> str:
    """The script's output around its failure: what led up to its diagnostics (the failing step), then their end."""
    cut = output.find("---- diagnostics ----")
    if cut < 0:
        return output[-2 * each:]
    return output[max(0, cut - each):cut] + "\n[...]\n" + output[-each:]


def failed_step(output: str) -> str:
    """The last step the script began and its last words before the diagnostics, for the one line a CI summary
    shows."""
    before = output.split("---- diagnostics ----")[0].splitlines()
    steps = [line[4:] for line in before if line.startswith("==> ")]
    last = [line.strip() for line in before if line.strip()][-3:]
    return f"in step {steps[-1] if steps else '(before the first)'!r}: " + " | ".join(last)[-600:]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(4800)
def test_kind_walkthrough_and_real_kubelet_checks() -> None:
    """docs/kind.md's blocks as a reader runs them, then the e2e's own checks on the page's cluster."""
    result = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, timeout=4700, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    print(shown(result.stdout))  # pytest shows it where the test fails
    if result.returncode == NO_DOCKER:
        pytest.skip(f"kind e2e: no Docker daemon can be started here: {result.stdout.strip()[-1500:]}")
    assert result.returncode == 0, (f"{SCRIPT.name} failed (exit {result.returncode}) {failed_step(result.stdout)}; "
                                    "its output above has the diagnostics")
