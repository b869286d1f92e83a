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

import faulthandler
import json
import logging
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field

from . import contract, rounds
from .api.spec import FailurePolicyRule, first_rule

log = logging.getLogger("paratrain.node")


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


# A worker's exit that says another's failure ended its round, not its own (75: a peer failed; 134: NCCL's watchdog
# aborted it; 76: stopped with the gang's step saved).
NOT_ITS_OWN = contract.CONSEQUENCE_EXITS | {contract.EXIT_PREEMPTED}
STACKS_SECONDS = 1.0  # for hung workers to write their stacks to the pod's log
IN_PLACE_STOP_SECONDS = 3  # a failed round's workers of a program of its own: SIGTERM, then SIGKILL (the built-in
# trainer's are killed at once: a broken gang has nothing to save, the next round resumes from the newest checkpoint)


@dataclass
class AgentRound:
    """What `paratrain node`'s agent knows of its workers' round (guard_rounds)."""

    number: int = -1  # the round in node 0's store (paratrain.rounds)
    started: float = 0.0  # time.monotonic() at the workers' start
    checked: float = 0.0  # when the store and the heartbeats were last looked at
    cause: dict | None = None  # why the round ended, where it was not this node's worker exit
    ended_elsewhere: bool = False  # another pod's agent ended it
    backoff: float = 0.0  # to wait before the next round's workers start
    streak: rounds.Streak = field(default_factory=rounds.Streak)


def guard_rounds(rules: list[FailurePolicyRule], hang_seconds: float | None = None,
                 heartbeats: str | None = None) -> None:
    """torchrun's agent, made to keep the gang's rounds (paratrain.rounds):
    - it restarts its workers (PET_MAX_RESTARTS, from spec.restartPolicy.inPlaceLimit) only after failures the
      job's policy restarts in place (else its budget is spent at once, it stops, and the pod fails with the
      code), and tells the next round's workers why the last one ended (ENV_LAST_FAILURE; a program inherits it
      from the agent's environment, the built-in trainer gets it as its worker's argument: a fork server's
      environment is its own), so that rank 0 can report it to the operator;
    - a failure of its workers ends their round in node 0's store at once, and a round ended by another pod's
      agent stops its workers within about a second (CHECK_EVERY_SECONDS), failed as a peer's failure (75):
      no worker waits for a collective to time out;
    - a worker whose heartbeat is older than `hang_seconds` is failed as hung (EXIT_HUNG);
    - a node whose own rounds fail at once waits longer before each next one, and after two in a row that fail
      before their first step gives its in-place rounds up (rounds.Streak);
    - a failed round's workers are stopped at once (a program's within IN_PLACE_STOP_SECONDS), not after the
      pod's grace period, which only the pod's own stop (SIGTERM) waits."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    monitor, start = LocalElasticAgent._monitor_workers, LocalElasticAgent._start_workers

    def state(agent) -> AgentRound:
        return agent.__dict__.setdefault("_paratrain_round", AgentRound())

    def _start_workers(self, worker_group):
        now = state(self)
        if now.backoff:
            log.warning("paratrain node: this pod's rounds fail at once: waiting %.0f s before the next", now.backoff)
            time.sleep(now.backoff)
        if heartbeats:
            rounds.clear(heartbeats)
        now.number = rounds.join_round(worker_group.store, worker_group.group_rank)
        now.started = now.checked = time.monotonic()
        now.backoff, now.cause, now.ended_elsewhere = 0.0, None, False
        return start(self, worker_group)

    def _stop_workers(self, worker_group):
        # The built-in trainer's workers at once: a failed round has nothing to save (a checkpoint is written
        # atomically, so one cut short is not there) and one blocked in a collective would ignore SIGTERM.
        builtin = callable(worker_group.spec.entrypoint)
        self._shutdown(signal.SIGKILL if builtin else signal.SIGTERM, IN_PLACE_STOP_SECONDS)

    def failed(worker_group, code: int, ranks) -> RunResult:
        return RunResult(state=WorkerState.FAILED, failures={
            w.global_rank: ProcessFailure(w.local_rank, w.id or -1, code, "")
            for w in worker_group.workers if w.global_rank in ranks})

    def looked_around(now: AgentRound, worker_group) -> RunResult | None:
        """A failed result where another agent ended this round or a worker of this node hangs."""
        if time.monotonic() - now.checked < rounds.CHECK_EVERY_SECONDS:
            return None
        now.checked = time.monotonic()
        try:
            ended = rounds.current_round(worker_group.store) > now.number
        except (RuntimeError, ValueError):  # node 0's store is gone: its pod's loss fails the gang anyway
            ended = False
        if ended:
            now.cause, now.ended_elsewhere = rounds.cause_of(worker_group.store, now.number), True
            log.warning("paratrain node: round %d ended by another pod (%s): stopping this pod's workers",
                        now.number, json.dumps(now.cause))
            if (now.cause or {}).get("exitCode") == contract.EXIT_HUNG:
                dump_stacks(worker_group)  # where this pod's ranks waited on the hung one
            return failed(worker_group, contract.EXIT_RETRYABLE, {w.global_rank for w in worker_group.workers})
        stall = rounds.stalled(heartbeats, hang_seconds) if hang_seconds and heartbeats else None
        if stall:
            log.error("paratrain node: %s (restartPolicy.hangSeconds %g): ending this round",
                      rounds.describe_stall(stall), hang_seconds)
            now.cause = {"rank": stall.rank, "nodeRank": worker_group.group_rank, "exitCode": contract.EXIT_HUNG,
                         "step": stall.step}
            # First, so that the other pods stop theirs (and dump their stacks) rather than time out on their own.
            rounds.end_round(worker_group.store, now.number, now.cause)
            dump_stacks(worker_group)
            return failed(worker_group, contract.EXIT_HUNG, {stall.rank})
        return None

    def dump_stacks(worker_group) -> None:
        """The built-in trainer's workers write every thread's stack to the pod's log (train_worker's SIGUSR1)."""
        if callable(worker_group.spec.entrypoint):
            log.warning("paratrain node: the stacks of this pod's workers follow")
            for worker in worker_group.workers:
                os.kill(worker.id, signal.SIGUSR1)
            time.sleep(STACKS_SECONDS)

    def _monitor_workers(self, worker_group):
        result, now = monitor(self, worker_group), state(self)
        if result.state == WorkerState.HEALTHY:
            result = looked_around(now, worker_group) or result
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY) or not result.failures:
            return result
        codes = {rank: shell_code(failure.exitcode) for rank, failure in result.failures.items()}
        code = node_exit_code(list(codes.values()))
        rank = min(r for r, c in codes.items() if c == code)
        cause = now.cause or {"rank": rank, "nodeRank": worker_group.group_rank, "exitCode": code}
        try:
            rounds.end_round(worker_group.store, now.number, cause)
        except (RuntimeError, ValueError):
            pass  # node 0's store is gone: there is no round left to end
        builtin = callable(worker_group.spec.entrypoint)
        if not now.ended_elsewhere and code not in NOT_ITS_OWN:
            # Only the built-in trainer's rounds are known to have stepped (its heartbeats); a program's always count.
            now.streak.failed(time.monotonic() - now.started, not builtin or bool(heartbeats)
                              and rounds.stepped(heartbeats))
            now.backoff = now.streak.backoff_seconds()
        in_place = self._remaining_restarts > 0 and restarts_in_place(code, rules)
        if in_place and now.streak.gives_up():
            log.error("paratrain node: this pod's rounds failed before their first step %d times in a row: no more "
                      "in-place rounds; the pod fails and the gang restarts (its pods may land elsewhere)",
                      now.streak.unstepped)
            self._remaining_restarts = 0
        elif in_place:
            said = json.dumps(cause)
            os.environ[contract.ENV_LAST_FAILURE] = said
            if builtin:
                worker_group.spec.args = (*worker_group.spec.args[:1], said)
        else:
            self._remaining_restarts = 0
        return result

    LocalElasticAgent._start_workers = _start_workers
    LocalElasticAgent._stop_workers = _stop_workers
    LocalElasticAgent._monitor_workers = _monitor_workers


def train_worker(spec_path: str, last_failure: str = "") -> int:
    """A worker of the built-in trainer, forked from the agent's fork server (launch.fork_context, RANK_MODULES
    imported): torch elastic sets its env, this its threads and the last round's failure. A failure leaves at once
    with its code (entrypoint.exit_now); success returns, since the agent waits for every worker's return value."""
    from .launch import name_process, use_own_threads
    from .train.entrypoint import exit_now, train_main

    name_process(f"paratrain-r{os.environ.get('RANK', '')}")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the agent asks a hung round for its stacks
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
    # Made before the fork server starts: the workers' heartbeats (paratrain.rounds), in the pod's own /tmp.
    os.environ.setdefault(contract.ENV_HEARTBEAT_DIR, tempfile.mkdtemp(prefix="paratrain-heartbeats-"))
    if spec_path:
        # The fork server imports the trainer while this process imports torch and meets its peers: its own
        # preload, set before torch elastic would first start it.
        import multiprocessing.forkserver

        from .launch import fork_context

        fork_context()
        multiprocessing.forkserver.ensure_running()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    grace = os.environ.get(contract.ENV_STOP_GRACE)
    if grace:  # how long torchrun's agent waits for its workers after a SIGTERM before it kills them
        os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(max(1, int(float(grace))))
    said = json.loads(os.environ.get(contract.ENV_EXIT_CODE_RULES) or "[]")
    rules = [FailurePolicyRule.model_validate(rule) for rule in said]
    hang = float(os.environ.get(contract.ENV_HANG_SECONDS) or 0) or None
    guard_rounds(rules, hang, os.environ[contract.ENV_HEARTBEAT_DIR])
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
