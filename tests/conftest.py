import os
import sys
from pathlib import Path

import pytest

# Multi-process tests share 2 cores: one thread per rank keeps them from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# `.venv/bin/python -m pytest` does not activate the environment: put its scripts (paratrain, which torchrun
# launches in `paratrain node`; shellcheck) first on PATH, as activation would.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def _module_rank(item) -> int:
    """Where a test's module starts: the kind e2e first (its first run builds kind and a node image for about 17
    minutes, which then overlaps the rest of the suite on the other worker), then modules holding slow tests, then
    the rest: longest first, so no long module is left to start last."""
    if item.get_closest_marker("e2e"):
        return 0
    return 1 if item.get_closest_marker("slow") else 2


def pytest_collection_modifyitems(config, items):
    """Whole modules in _module_rank's order (stable: within a rank, collection order). With pytest-xdist's
    --dist loadfile and --no-loadscope-reorder (pyproject's addopts) the workers take modules in this order."""
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        rank[module] = min(rank.get(module, 2), _module_rank(item))
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])


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
