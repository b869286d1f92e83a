"""`paratrain node`: what a pod runs — torchrun (its flags from the PET_* env) starting `paratrain train`, or a
program of its own (`paratrain node -- python train.py`, spec.entrypoint), once per GPU, with the workers' exit
code passed through.

Plain `torchrun` exits 1 whatever its workers exited with, which would hide a worker's classification from the
operator (75: a peer failed, restart the gang; 2: the job can never run, fail it).
"""

from __future__ import annotations

import os
import signal

from . import contract


def node_exit_code(worker_codes: list[int]) -> int:
    """One code for the pod: a permanent failure wins, then a retryable one, then the first failure's code.
    Signals (negative codes from torch's ProcessFailure) map to 128 + signal, as a shell reports them."""
    codes = [128 - c if c < 0 else c for c in worker_codes]
    for wanted in (contract.PERMANENT_EXIT_CODES, {contract.EXIT_RETRYABLE}):
        hit = [c for c in codes if c in wanted]
        if hit:
            return hit[0]
    return next((c for c in codes if c != 0), 0)


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
