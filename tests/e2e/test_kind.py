"""The kind end to end (scripts/kind-e2e.sh): runs where kind, kubectl and helm are on PATH (the script starts a
Docker daemon itself where none answers, scripts/docker.sh); elsewhere it is skipped with the reason shown by
`pytest -ra`.

    .venv/bin/python -m pytest tests/e2e/test_kind.py -ra
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "kind-e2e.sh"


def missing_prerequisite() -> str | None:
    """Why the kind e2e cannot run here, or None when it can."""
    for tool in ("kind", "kubectl", "helm"):
        if shutil.which(tool) is None:
            return f"{tool} not on PATH"
    return None


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("mode", [[], ["--doc"]], ids=["e2e", "docs-kind-walkthrough"])
def test_kind_end_to_end(mode: list[str]) -> None:
    """The e2e script's own checks, and docs/kind.md's blocks run as a reader runs them."""
    reason = missing_prerequisite()
    if reason:
        pytest.skip(f"kind e2e needs kind, kubectl and helm: {reason}")
    result = subprocess.run(["bash", str(SCRIPT), *mode], cwd=ROOT, timeout=3500)
    assert result.returncode == 0, f"{SCRIPT.name} failed (exit {result.returncode}); see its captured output for the diagnostics"
