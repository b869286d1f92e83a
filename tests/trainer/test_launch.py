"""The local launcher (`paratrain run`), with stand-in ranks."""

import socket

from paratrain import launch
from paratrain.api import apply_overrides, parse_job

from .harness import TINY_JOB, layout


class ProbeRank:
    """Stands in for a rank: at the moment it is started, someone must already listen on its MASTER_PORT, or another
    process could take that port before rank 0 binds it."""

    def __init__(self, cmd, env, **kwargs):
        with socket.create_connection((env["MASTER_ADDR"], int(env["MASTER_PORT"])), timeout=5):
            pass
        kwargs["stdout"].close()

    def poll(self) -> int:
        return 0

    def wait(self, timeout=None) -> int:
        return 0


def test_the_rendezvous_port_is_listened_on_before_any_rank_starts(monkeypatch, tmp_path):
    monkeypatch.setattr(launch.subprocess, "Popen", ProbeRank)
    job = parse_job(apply_overrides(TINY_JOB, layout(data=2)))
    assert launch.run_local(job, workdir=str(tmp_path), progress=False) == 0


def test_the_rank_that_died_is_reported_not_the_peer_that_saw_it():
    """A SIGKILLed rank 1 and rank 0's exit 75 (a peer failed) in the same poll: rank 1 is the cause."""
    assert launch.root_failure([75, -9]) == (1, -9)
    assert launch.root_failure([None, 75]) == (1, 75)  # alone, the peer failure is what there is to report
    assert launch.root_failure([2, 75, None]) == (0, 2)
    assert launch.root_failure([0, None]) is None
