import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .support import control_plane as support
from .support.control_plane import TESTBIN, ControlPlaneUnavailable, testbin

# Multi-process tests share 2 cores: one thread per rank keeps them from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# `.venv/bin/python -m pytest` does not activate the environment: put its scripts (paratrain, which torchrun
# launches in `paratrain node`; shellcheck) first on PATH, as activation would.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def pytest_configure(config):
    """Whether the control plane is built, read once before any test worker starts: the workers inherit it, so
    they all order the modules alike (pytest-xdist refuses workers that collected in different orders)."""
    if "PARATRAIN_CONTROL_PLANE_BUILT" not in os.environ:
        built = subprocess.run(["bash", str(TESTBIN), "--path"], capture_output=True).returncode == 0
        os.environ["PARATRAIN_CONTROL_PLANE_BUILT"] = "1" if built else "0"


def _needs_control_plane(item) -> bool:
    """The test takes the control_plane fixture, or its module starts a control plane itself (it imports
    tests/support/control_plane or something of it: ControlPlane, testbin)."""
    if "control_plane" in item.fixturenames:
        return True
    module = getattr(item, "module", None)
    return module is not None and any(
        value is support or getattr(value, "__module__", None) == support.__name__
        for value in vars(module).values())


def _module_rank(item) -> int:
    """Where a test's module starts: the kind e2e first (its first run builds kind and a node image for about 17
    minutes, which then overlaps the rest of the suite on the other worker), then modules holding slow tests, then
    the rest: longest first, so no long module is left to start last. Where the control plane is not built yet,
    the modules that need it go after all others, so the other worker tests while it builds in the background."""
    if item.get_closest_marker("e2e"):
        return 0
    rank = 1 if item.get_closest_marker("slow") else 2
    if os.environ["PARATRAIN_CONTROL_PLANE_BUILT"] != "1" and _needs_control_plane(item):
        rank += 2
    return rank


def pytest_collection_modifyitems(config, items):
    """Whole modules in _module_rank's order (stable: within a rank, collection order). With pytest-xdist's
    --dist loadfile and --no-loadscope-reorder (pyproject's addopts) the workers take modules in this order."""
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        rank[module] = min(rank.get(module, 4), _module_rank(item))
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])
    _build_control_plane_in_background(config, items)


def _build_control_plane_in_background(config, items):
    """A first run builds the Go binaries the live tests need (about 20 minutes on 2 cores) while the tests that
    need none run. One process starts it (the first worker, or pytest itself without workers); the scripts' locks
    make the live tests' own calls wait for it and reuse what it built, or build it themselves if it failed."""
    if (os.environ["PARATRAIN_CONTROL_PLANE_BUILT"] == "1" or shutil.which("go") is None
            or os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or not any(map(_needs_control_plane, items))):
        return
    node = any(item.get_closest_marker("e2e") for item in items)  # the kind node's binaries too, one module graph
    command = f"bash {TESTBIN} --node >/dev/null && bash {TESTBIN}" if node else f"bash {TESTBIN}"
    log = config.cache.mkdir("paratrain") / "testbin-background.log" if config.cache else Path(os.devnull)
    with open(log, "w") as out:
        config.stash[_BACKGROUND_BUILD] = subprocess.Popen(["bash", "-c", command], stdout=out,
                                                           stderr=subprocess.STDOUT, start_new_session=True)


_BACKGROUND_BUILD = pytest.StashKey[subprocess.Popen]()
_WAITED_FOR_BUILD = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True, wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The first test that needs the control plane waits here for its build, outside pytest-timeout's clock (this
    wrapper runs before that plugin's): a test's 10 minutes are for the test. A failed build is reported by the
    test's own call of testbin (the control_plane fixture's, or its module's)."""
    if (os.environ["PARATRAIN_CONTROL_PLANE_BUILT"] != "1" and _needs_control_plane(item)
            and not item.config.stash.get(_WAITED_FOR_BUILD, False)):
        item.config.stash[_WAITED_FOR_BUILD] = True
        try:
            testbin()
        except ControlPlaneUnavailable:
            pass  # the test's own call says why
    return (yield)


def pytest_unconfigure(config):
    """A run leaves nothing of its own running: a build not finished by the end is stopped (it resumes next time)."""
    build = config.stash.get(_BACKGROUND_BUILD, None)
    if build is not None and build.poll() is None:
        os.killpg(build.pid, signal.SIGTERM)
        build.wait()


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
