import os
import sys
from pathlib import Path

import pytest

# Multi-process tests share 2 cores: one thread per rank keeps them from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# `.venv/bin/python -m pytest` does not activate the environment: put its scripts (paratrain, which torchrun
# launches in `paratrain node`; shellcheck) first on PATH, as activation would.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def pytest_report_header(config):
    """Capabilities that choose some tests' assertions (measured, never assumed), shown at the top of every run."""
    from paratrain.train.parallel.precision import cpu_has_native_fp16

    return [f"cpu native fp16 (oneDNN: AVX512-FP16 or AMX-FP16): {'yes' if cpu_has_native_fp16() else 'no'}"]


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    """One real control plane (scripts/test-cluster.sh) for the whole run, started on first use. Where it cannot be
    built (no Go) the tests that need it fail, saying how to get it: they never skip."""
    from .support.control_plane import ControlPlane

    plane = ControlPlane(tmp_path_factory.mktemp("control-plane"))
    yield plane
    plane.close()
