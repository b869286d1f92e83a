"""scripts/test-cluster.sh keeps etcd's data in /dev/shm (a disk that fills or floods must not stop the tests' API
server) and sweeps the stores killed runs left there: never one a live etcd holds open, however old."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from ..support.control_plane import ControlPlane

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")


def store_of(plane_dir: Path) -> Path:
    store = plane_dir / "etcd"
    assert store.is_symlink(), "etcd's data is not in /dev/shm"
    return Path(os.readlink(store))


def age(path: Path, minutes: int) -> None:
    then = time.time() - minutes * 60
    os.utime(path, (then, then))


def test_a_live_store_survives_the_sweep_and_a_dead_one_does_not(tmp_path):
    planes = [ControlPlane(tmp_path / "live")]
    try:
        live_store = store_of(tmp_path / "live")
        age(live_store, 30)  # as old as a long suite's
        planes.append(ControlPlane(tmp_path / "dead"))
        dead_store = store_of(tmp_path / "dead")
        etcd_pid = int((tmp_path / "dead" / "pids").read_text().split()[0])
        os.kill(etcd_pid, signal.SIGKILL)  # a run killed before its `down`
        age(dead_store, 30)
        (tmp_path / "dead" / "etcd").unlink()  # ... whose directory is gone too
        planes.append(ControlPlane(tmp_path / "third"))  # its `up` sweeps
        assert live_store.is_dir() and not dead_store.exists()
        assert planes[0].api.get("/api/v1/namespaces/default").ok  # the live one still answers
    finally:
        for plane in planes:
            plane.close()
    assert not live_store.exists()  # `down` takes its store with it
