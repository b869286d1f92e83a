"""NCCL's failures reach Python (train.nccl_errors): the env that keeps the process alive when the watchdog aborts
its communicators, the step's check of every NCCL group, and the roll call's answer from ranks that are not hung.
No NCCL here: the groups' backends are stand-ins that answer get_error() as ProcessGroupNCCL does."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ErrorType

from paratrain import contract
from paratrain.api import parse_job
from paratrain.train import nccl_errors
from paratrain.train.entrypoint import _is_timeout, is_peer_failure, pick_device
from paratrain.train.preflight import answer_roll_call, roll_call

from .test_entrypoint import gpu_job


class Backend:
    def __init__(self, error: ErrorType):
        self.error = error

    def get_error(self) -> ErrorType:
        return self.error


def test_the_watchdog_aborts_communicators_not_the_process_and_tells_the_other_ranks():
    assert contract.COMMS_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: no SIGABRT
    assert contract.COMMS_ENV["TORCH_NCCL_PROPAGATE_ERROR"] == "1"
    assert nccl_errors.comms_defaults({}) == contract.COMMS_ENV
    mine = nccl_errors.comms_defaults({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_DEBUG": "INFO"})
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in mine and "NCCL_DEBUG" not in mine, "the user's settings stay"


def test_a_cuda_rank_sets_them_before_its_process_groups_exist(monkeypatch):
    for name in contract.COMMS_ENV:  # set first, so that monkeypatch restores their absence after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.delenv(contract.ENV_DEVICE, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda precision: None)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert pick_device(parse_job(gpu_job()), local_rank=0) == (torch.device("cuda", 0), "nccl")
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and os.environ["TORCH_NCCL_PROPAGATE_ERROR"] == "1"
    assert os.environ["NCCL_DEBUG"] == "INFO"


def test_healthy_groups_let_the_step_stand():
    nccl_errors.raise_if_aborted([("0", Backend(ErrorType.SUCCESS)), ("3", Backend(ErrorType.SUCCESS))])
    assert not nccl_errors.timed_out([("0", Backend(ErrorType.SUCCESS))])


@pytest.mark.parametrize("error, timeout", [(ErrorType.TIMEOUT, True), (ErrorType.COMM_ERROR, False),
                                            (ErrorType.REMOTE_ERROR, False)])
def test_an_aborted_group_fails_the_step_as_a_peer_failure(error, timeout):
    groups = [("0", Backend(ErrorType.SUCCESS)), ("2", Backend(error))]
    with pytest.raises(dist.DistBackendError, match="group 2: ") as raised:
        nccl_errors.raise_if_aborted(groups)
    assert "group 0" not in str(raised.value)
    assert is_peer_failure(raised.value), "exit 75: a restart may succeed"
    assert _is_timeout(raised.value) is timeout, "a timeout gets the roll call"
    assert nccl_errors.timed_out(groups) is timeout


def test_a_gloo_rank_has_no_nccl_group_to_ask(one_rank_group):
    assert nccl_errors.nccl_backends() == []
    nccl_errors.raise_if_aborted()


def test_ranks_ended_by_another_answer_the_roll_call_so_only_the_hung_one_is_named():
    store = dist.HashStore()
    answer_roll_call(store, 1)
    assert roll_call(store, 0, 3, wait=0.5) == [2]
