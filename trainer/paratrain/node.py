"""`paratrain node`: what a pod runs — torchrun (its flags from the PET_* env) starting `paratrain train`, or a
program of its own (`paratrain node -- python train.py`, spec.entrypoint), once per GPU, with the workers' exit
code passed through; and, within spec.restartPolicy.inPlaceLimit, torchrun's agent restarting its workers in place
after a failure the job's policy restarts in place (every pod's agent does: a peer's failure fails its workers
too), each round on the same static rendezvous (node 0's agent keeps hosting the store; the trainer keys each
round's entries by TORCHELASTIC_RESTART_COUNT).

Plain `torchrun` exits 1 whatever its workers exited with, which would hide a worker's classification from the
operator (75: a peer failed, restart the gang; 2: the job can never run, fail it).
"""

from __future__ import annotations

import json
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
    code, only if it says RestartInPlace; else any failure but the permanent codes and a stop (exit 76)."""
    if hit := first_rule(rules, code):
        return hit[1].action == "RestartInPlace"
    return code not in contract.PERMANENT_EXIT_CODES and code != contract.EXIT_PREEMPTED


def guard_in_place_restarts(rules: list[FailurePolicyRule]) -> None:
    """torchrun's agent restarts its workers (PET_MAX_RESTARTS, from spec.restartPolicy.inPlaceLimit) after any
    failure; this makes it do so only for failures the job's policy restarts in place (else its budget is spent
    at once, it stops, and the pod fails with the code), and tells the next round's workers why the last one ended
    (ENV_LAST_FAILURE: they inherit the agent's environment), so that rank 0 can report it to the operator."""
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
                os.environ[contract.ENV_LAST_FAILURE] = json.dumps(
                    {"rank": rank, "nodeRank": worker_group.group_rank, "exitCode": code})
            else:
                self._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = _monitor_workers


def node_main(program: list[str]) -> int:
    """Run `program` (a command, not a script: `python train.py`) in every worker.

    A SIGTERM (the pod is being stopped: a drain, a preemption, a suspend) goes on to the workers, which save a
    checkpoint at their next step boundary and exit; torchrun waits for them $PARATRAIN_STOP_GRACE_SECONDS (the
    pod's grace period less a margin) instead of its fixed 30 s before it kills them, and the pod exits
    EXIT_PREEMPTED."""
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
    args = get_args_parser().parse_args(["--no-python", *program])
    try:
        run(args)
    except ChildFailedError as exc:
        return node_exit_code([f.exitcode for f in exc.failures.values()])
    except SignalException as exc:
        if exc.sigval == signal.SIGTERM:
            return contract.EXIT_PREEMPTED
        raise
    return contract.EXIT_OK
