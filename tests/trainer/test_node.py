"""`paratrain node` (a pod's command) passes the workers' exit code through torchrun, so the operator can tell a
spec that can never run (2) from a failure a gang restart may cure (75)."""

import logging
import os
import subprocess
import sys

import pytest
import yaml

from paratrain import contract
from paratrain.launch import free_port
from paratrain.api.spec import FailurePolicyRule
from paratrain.node import QuietWorkerExits, node_exit_code, restarts_in_place

from .harness import TINY_JOB


@pytest.mark.parametrize("codes,expected", [
    ([0, 0], 0),
    ([1, 75], 75),
    ([75, 2], 2),
    ([-9, 0], 137),  # SIGKILL
    ([0, 3], 3),
])
def test_node_exit_code(codes, expected):
    assert node_exit_code(codes) == expected


@pytest.mark.parametrize("code,rules,in_place", [
    (1, [], True), (137, [], True), (75, [], True),  # a crash, a kill, a peer's death
    (2, [], False), (78, [], False), (127, [], False),  # permanent: the operator fails the job
    (76, [], True),  # another pod was stopped (this one's agent would have ended): the next round waits for it
    (3, [{"action": "FailJob", "exitCodes": [3]}], False),
    (3, [{"action": "RestartGang", "exitCodes": [1, 3]}], False),
    (2, [{"action": "RestartInPlace", "exitCodes": [2]}], True),  # the job's own rule wins
    (1, [{"action": "FailJob", "exitCodes": [3]}], True),
])
def test_which_failures_restart_in_place(code, rules, in_place):
    assert restarts_in_place(code, [FailurePolicyRule.model_validate(r) for r in rules]) is in_place


def _node(tmp_path, spec_overrides: dict) -> subprocess.CompletedProcess:
    job = yaml.safe_load(yaml.safe_dump(TINY_JOB))
    job["spec"].update(spec_overrides)
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job))
    env = {**os.environ, **contract.node_env(nnodes=1, nproc_per_node=1, node_rank=0, master_addr="127.0.0.1",
                                             master_port=free_port())}
    return subprocess.run([sys.executable, "-m", "paratrain.cli", "node", "--spec", str(spec)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_pod_command_reports_a_spec_that_cannot_run_as_permanent(tmp_path):
    # The pod env says 1 process, the spec says 2: the worker exits 2, and so must the pod (not torchrun's 1).
    proc = _node(tmp_path, {"nodes": 2, "parallelism": {"data": 2}})
    assert proc.returncode == contract.EXIT_INVALID_SPEC, proc.stderr[-2000:]


def test_a_failed_pods_log_ends_with_the_trainers_own_error(tmp_path):
    proc = _node(tmp_path, {"data": {"source": "text", "path": "/nonexistent/x.txt"}})
    assert proc.returncode == contract.EXIT_INVALID_SPEC, proc.stderr[-2000:]
    assert "spec.data.path: /nonexistent/x.txt: no such file" in proc.stdout, proc.stdout[-2000:]
    # torch elastic's report of the worker's exit (its traceback of torch internals) is not below it
    assert "Traceback" not in proc.stderr and "failed (exitcode" not in proc.stderr, proc.stderr[-3000:]


def test_pod_command_trains(tmp_path):
    proc = _node(tmp_path, {"training": {**TINY_JOB["spec"]["training"], "steps": 3}})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done step=3" in proc.stdout + proc.stderr
    assert "backend gloo, attention cpu flash;" in proc.stdout + proc.stderr  # the first line names the kernel


def _worker_exit(exitcode: int, exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:  # noqa: BLE001
        return logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, __file__, 1,
                                 "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)",
                                 (exitcode, 0, 123, "train_worker", "forkserver"), sys.exc_info())


@pytest.mark.parametrize("exitcode, kept", [(2, False), (75, False), (-9, True)])
def test_a_workers_exit_is_one_line_and_only_where_a_signal_killed_it(exitcode, kept):
    from torch.multiprocessing import ProcessExitedException

    record = _worker_exit(exitcode, ProcessExitedException("process 0 terminated", 0, 123, exitcode))
    assert QuietWorkerExits().filter(record) is kept and record.exc_info is None


def test_a_worker_that_raised_keeps_its_own_traceback_in_the_pods_log():
    """An exception the trainer did not handle: torch's worker wrapper hands its traceback to this record alone,
    so it is kept, in place of torch's own traceback."""
    from torch.multiprocessing import ProcessRaisedException

    worker_traceback = 'Traceback (most recent call last):\n  File "loop.py", line 9\nKeyError: \'step\''
    record = _worker_exit(1, ProcessRaisedException(worker_traceback, 0, 123))
    assert QuietWorkerExits().filter(record) and record.exc_info is None
    assert record.getMessage().endswith("KeyError: 'step'") and "File \"loop.py\"" in record.getMessage()
