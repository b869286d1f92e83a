"""The trainer's exit classification, on real exceptions raised in the test process."""

import datetime
import json
import socket
import threading

import pytest
import torch
import torch.distributed as dist
import yaml

from paratrain import contract
from paratrain.api import parse_job
from paratrain.train.entrypoint import is_peer_failure, pick_device, train_main

from .harness import TINY_JOB

TIMEOUT = datetime.timedelta(seconds=1)


def raised(action) -> BaseException:
    with pytest.raises(Exception) as info:
        action()
    return info.value


def gloo_pair() -> list[dist.ProcessGroupGloo]:
    """Both ranks of a 2-rank gloo group, in this process (each rank's constructor waits for the other)."""
    store, groups = dist.HashStore(), [None, None]

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


def collective_timeout() -> BaseException:
    """Rank 1 is alive but never joins the all-reduce: what a hung (SIGSTOPped) rank's peers see."""
    rank0, _rank1 = gloo_pair()
    return raised(lambda: rank0.allreduce([torch.ones(4)]).wait())


def dead_peer() -> BaseException:
    """Rank 1's connections close: what a SIGKILLed rank's peers see."""
    rank0, rank1 = gloo_pair()
    del rank1
    return raised(lambda: rank0.allreduce([torch.ones(4)]).wait())


def unreachable_store() -> BaseException:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    return raised(lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT))


def store_wait_timeout() -> BaseException:
    return raised(lambda: dist.HashStore().wait(["never-set"], datetime.timedelta(milliseconds=10)))


def gloo_error_of_a_build_with_relative_paths() -> BaseException:
    return RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.7]:40122")


@pytest.mark.parametrize("make", [collective_timeout, dead_peer, unreachable_store, store_wait_timeout,
                                  gloo_error_of_a_build_with_relative_paths,
                                  lambda: ConnectionResetError(104, "Connection reset by peer"),
                                  lambda: TimeoutError("timed out")])
def test_a_broken_gang_is_retryable(make):
    assert is_peer_failure(make())


def shape_bug() -> BaseException:
    return raised(lambda: torch.nn.Linear(3, 4)(torch.ones(2, 5)))


def bug_that_talks_about_the_network() -> BaseException:
    def forward():
        raise RuntimeError("shape mismatch in block 3 after the gloo all-reduce: no peer sent it (timeout nccl)")

    return raised(forward)


def gloo_assertion() -> BaseException:
    """In gloo's GLOO_ENFORCE format, for an assertion gloo checks on the calling thread (one failing inside
    gloo's transport thread aborts the process instead)."""
    return RuntimeError("[enforce fail at third_party/gloo/gloo/transport/tcp/pair.cc:446] op.preamble.length <= "
                        "op.nbytes. 40 vs 4")


@pytest.mark.parametrize("make", [shape_bug, bug_that_talks_about_the_network, gloo_assertion])
def test_a_bug_in_this_rank_is_not(make):
    assert not is_peer_failure(make())


def gpu_job() -> dict:
    return {**TINY_JOB, "spec": {**TINY_JOB["spec"], "resources": {"gpusPerNode": 1}}}


def test_a_gpu_job_without_cuda_fails_permanently_naming_the_field(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(contract.ENV_DEVICE, raising=False)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(contract.ENV_TERMINATION_LOG, str(tmp_path / "termination-log"))
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(gpu_job()))
    assert train_main(str(spec)) == contract.EXIT_INVALID_SPEC
    said = "spec.resources.gpusPerNode: the job asks for 1 GPU(s) per node, but no CUDA device"
    assert said in caplog.text
    # The pod's termination message carries the same words, for the operator's status and Warning Event.
    assert said in json.loads((tmp_path / "termination-log").read_text())["error"]


def test_paratrain_device_cpu_runs_a_gpu_job_on_the_cpu(monkeypatch):
    """How the tests' stand-in kubelet runs GPU jobs on a machine without GPUs."""
    monkeypatch.setenv(contract.ENV_DEVICE, "cpu")
    assert pick_device(parse_job(gpu_job()), local_rank=0) == (torch.device("cpu"), "gloo")


def test_cuda_ranks_default_to_expandable_segments_unless_the_pod_says_otherwise():
    from paratrain.train.entrypoint import allocator_defaults

    assert allocator_defaults({}) == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert allocator_defaults({"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}) == {}
    assert allocator_defaults({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) == {}  # the older name
