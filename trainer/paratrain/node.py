"""`paratrain node`: what a pod runs — torchrun (its flags from the PET_* env) starting the built-in trainer (workers
forked from a fork server that imported it once), or a program of its own (`paratrain node -- python train.py`,
spec.entrypoint), once per GPU, with the workers' exit code passed through; and, within
spec.restartPolicy.inPlaceLimit, torchrun's agent restarting its workers in place after a failure the job's policy
restarts in place (every pod's agent does: a peer's failure fails its workers too), each round on the same static
rendezvous (node 0's agent keeps hosting the store; the trainer keys each round's entries apart, preflight.join).
A pod the operator replaced alone joins its peers' next round the same way: its fresh agent finds node 0's store,
and its workers wait there with the survivors' restarted ones.

Plain `torchrun` exits 1 whatever its workers exited with, which would hide a worker's classification from the
operator (75: a peer failed, restart the gang; 2: the job can never run, fail it).
"""

from __future__ import annotations

import json
import logging
import os
import signal

from . import contract
from .api.spec import FailurePolicyRule, first_rule


def shell_code(code: int) -> int:
    """A worker's exit code as a shell reports it: torch's ProcessFailure gives a signal as its negative."""
    return 128 - code if code < 0 else code


def node_exit_code(worker_codes: list[int]) -> int:
    """One code for the pod: a permanent failure wins, then a retryable one, then the first failure's code."""
    codes = [shell_code(c) for c in worker_codes]
    for wanted in (contract.PERMANENT_EXIT_CODES, {contract.EXIT_RETRYABLE}):
        hit = [c for c in codes if c in wanted]
        if hit:
            return hit[0]
    return next((c for c in codes if c != 0), 0)


def restarts_in_place(code: int, rules: list[FailurePolicyRule]) -> bool:
    """Whether a node whose workers failed with `code` restarts them in place: where a rule of the job matches the
    code, only if it says RestartInPlace; else any failure but the permanent codes.

    Exit 76 (stopped, the step saved) reaches an agent only where another pod was stopped: a SIGTERM to this
    pod's agent ends the agent itself before it looks at its workers again. The gang's round is over (its step is
    saved); the next one waits for that pod's replacement, or the operator restarts the whole gang."""
    if hit := first_rule(rules, code):
        return hit[1].action == "RestartInPlace"
    return code not in contract.PERMANENT_EXIT_CODES


def guard_in_place_restarts(rules: list[FailurePolicyRule]) -> None:
    """torchrun's agent restarts its workers (PET_MAX_RESTARTS, from spec.restartPolicy.inPlaceLimit) after any
    failure; this makes it do so only for failures the job's policy restarts in place (else its budget is spent
    at once, it stops, and the pod fails with the code), and tells the next round's workers why the last one ended
    (ENV_LAST_FAILURE; a program inherits it from the agent's environment, the built-in trainer gets it as its
    worker's argument: a fork server's environment is its own), so that rank 0 can report it to the operator."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers

    def _monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.state == WorkerState.FAILED and self._remaining_restarts > 0:
            codes = {rank: shell_code(failure.exitcode) for rank, failure in result.failures.items()}
            code = node_exit_code(list(codes.values()))
            if restarts_in_place(code, rules):
                rank = min(r for r, c in codes.items() if c == code)
                said = json.dumps({"rank": rank, "nodeRank": worker_group.group_rank, "exitCode": code})
                os.environ[contract.ENV_LAST_FAILURE] = said
                if callable(worker_group.spec.entrypoint):
                    worker_group.spec.args = (*worker_group.spec.args[:1], said)
            else:
                self._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = _monitor_workers


def train_worker(spec_path: str, last_failure: str = "") -> int:
    """A worker of the built-in trainer, forked from the agent's fork server (launch.fork_context, RANK_MODULES
    imported): torch elastic sets its env, this its threads and the last round's failure. A failure leaves at once
    with its code (entrypoint.exit_now); success returns, since the agent waits for every worker's return value."""
    from .launch import name_process, use_own_threads
    from .train.entrypoint import exit_now, train_main

    name_process(f"paratrain-r{os.environ.get('RANK', '')}")
    if last_failure:
        os.environ[contract.ENV_LAST_FAILURE] = last_failure
    use_own_threads()
    code = train_main(spec_path)
    if code:
        exit_now(code)
    logging.shutdown()
    return code


def _launch_train_workers(spec_path: str) -> None:
    """torchrun's own `run` (its rendezvous defaults), its workers `train_worker` forked from a fork server that
    has imported the trainer once and lives as long as the agent, instead of a `paratrain train` program exec'd
    per worker: a round of in-place restarts skips the imports (about half of it, on CPU). CUDA is never touched
    before the fork (as for `paratrain run`'s ranks)."""
    import torch.distributed.run as torchrun

    args = torchrun.get_args_parser().parse_args(["--start-method", "forkserver", "--no-python", "paratrain"])
    config_from_args = torchrun.config_from_args
    torchrun.config_from_args = lambda parsed: (config_from_args(parsed)[0], train_worker, [spec_path])
    try:
        torchrun.run(args)
    finally:
        torchrun.config_from_args = config_from_args


class QuietWorkerExits(logging.Filter):
    """torch elastic logs a failed worker's exit with ten lines of its own traceback (torch internals), below the
    error the worker logged itself: a pod's log should end with that error. Where the worker raised an exception
    it did not handle, its own traceback (which only this record carries: torch's worker wrapper prints nothing)
    takes the place of torch's; where a signal killed it (it could say nothing), one line; where it exited with a
    code, nothing (it said why before exiting)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.exc_info and str(record.msg).startswith("failed (exitcode")):
            return True
        from torch.multiprocessing import ProcessRaisedException

        raised = record.exc_info[1]
        record.exc_info, record.exc_text = None, None
        if isinstance(raised, ProcessRaisedException):
            record.msg, record.args = f"{record.msg}\n%s", (*record.args, str(raised).strip())
            return True
        code = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not isinstance(code, int) or code < 0


def node_main(program: list[str], spec_path: str | None = None) -> int:
    """Run the built-in trainer on `spec_path`, or else `program` (a command, not a script: `python train.py`), in
    every worker.

    A SIGTERM (the pod is being stopped: a drain, a preemption, a suspend) goes on to the workers, which save a
    checkpoint at their next step boundary and exit; torchrun waits for them $PARATRAIN_STOP_GRACE_SECONDS (the
    pod's grace period less a margin) instead of its fixed 30 s before it kills them, and the pod exits
    EXIT_PREEMPTED."""
    if spec_path:
        # The fork server imports the trainer while this process imports torch and meets its peers: its own
        # preload, set before torch elastic would first start it.
        import multiprocessing.forkserver

        from .launch import fork_context

        fork_context()
        multiprocessing.forkserver.ensure_running()
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    grace = os.environ.get(contract.ENV_STOP_GRACE)
    if grace:  # torchrun's shutdown takes its wait as a default argument, with no flag or env of its own
        death_sig, _ = LocalElasticAgent._shutdown.__defaults__
        LocalElasticAgent._shutdown.__defaults__ = (death_sig, max(1, int(float(grace))))
    said = json.loads(os.environ.get(contract.ENV_EXIT_CODE_RULES) or "[]")
    rules = [FailurePolicyRule.model_validate(rule) for rule in said]
    guard_in_place_restarts(rules)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(QuietWorkerExits())
    try:
        if spec_path:
            _launch_train_workers(spec_path)
        else:
            run(get_args_parser().parse_args(["--no-python", *program]))
    except ChildFailedError as exc:
        return node_exit_code([f.exitcode for f in exc.failures.values()])
    except SignalException as exc:
        if exc.sigval == signal.SIGTERM:
            return contract.EXIT_PREEMPTED
        raise
    return contract.EXIT_OK
