"""A gang's rounds of workers, as its pods' agents (`paratrain node`) agree on them in node 0's store, and the
heartbeats by which an agent sees that a worker hangs while alive.

Rounds. Every agent's workers belong to a round, a number kept in node 0's store (ROUND). When an agent's workers
fail, it ends their round at once (ROUND goes from r to r + 1, compare-and-set, so two agents failing together end
it once) and writes why (the first cause of round r wins); every other agent reads ROUND about once a second and,
finding it past its workers' round, stops them at once (a worker blocked in an NCCL collective would otherwise
wait for the watchdog's collectiveTimeoutSeconds) and starts them in the new round. An agent starting workers
joins the round in the store; a replaced pod's fresh agent, whose node's workers were last in the current round,
ends it first: its peers' workers are waiting on the lost ones. Each agent's rounds only grow, so no rank runs
twice in one round.

Heartbeats. The built-in trainer's workers write their step to HEARTBEAT_DIR/rank-N at every step boundary (and
per evaluation batch, and around a checkpoint's save; none before the first step: building, loading and the
preflight are the start timeout's); a worker whose file is older than restartPolicy.hangSeconds hangs while alive
(a deadlock, a stuck data read, a collective that never returns): its agent fails the round with EXIT_HUNG.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from .contract import EXIT_RETRYABLE

ROUND = "paratrain/agents/round"
CHECK_EVERY_SECONDS = 1.0  # how often an agent reads ROUND (every agent of a 4,096-pod gang asks node 0's store)
QUICK_ROUND_SECONDS = 60.0  # a round of this node's that failed sooner failed "at once"
BACKOFF_MAX_SECONDS = 30.0
EARLY_ROUNDS_TO_GANG = 2  # rounds in a row failed here before their first step: give in-place rounds up


def _node_round(node_rank: int) -> str:
    return f"paratrain/agents/node-{node_rank}/round"


def _cause(round_: int) -> str:
    return f"paratrain/agents/round-{round_}/cause"


def join_round(store, node_rank: int) -> int:
    """The round this node's workers start in: the store's, where a round has begun since this node's last
    workers joined one; else (a replaced pod's agent, whose lost workers were in the current round) the next one,
    ending the current round for the peers still in it."""
    current = int(store.add(ROUND, 0))
    if store.check([_node_round(node_rank)]):
        last = int(store.get(_node_round(node_rank)))
        if last == current:
            # its peers' ranks wait on a vanished one, as a peer's exit 75 says where the backend notices
            current = end_round(store, current, {"nodeRank": node_rank, "exitCode": EXIT_RETRYABLE, "replaced": True})
    store.set(_node_round(node_rank), str(current))
    return current


def end_round(store, round_: int, cause: dict) -> int:
    """End `round_` (if no agent has already), its cause kept unless another agent's came first; the round now."""
    store.compare_set(_cause(round_), "", json.dumps(cause, separators=(",", ":")))
    return int(store.compare_set(ROUND, str(round_), str(round_ + 1)))


def current_round(store) -> int:
    return int(store.add(ROUND, 0))


def cause_of(store, round_: int) -> dict | None:
    """Why `round_` ended, as the agent that ended it said: {rank, nodeRank, exitCode} (a worker's failure) or
    {nodeRank, exitCode 75, replaced} (a pod replaced alone)."""
    if not store.check([_cause(round_)]):
        return None
    return json.loads(store.get(_cause(round_)))


@dataclass
class Streak:
    """This node's own failed rounds in a row (not those a peer's failure ended). Each that failed within
    QUICK_ROUND_SECONDS of its start, after the first, waits longer before the next (2, 4, ... 30 s): a fault
    that recurs at once is not retried in a tight loop. EARLY_ROUNDS_TO_GANG in a row failed before their first
    step: the node gives its in-place rounds up, its pod fails, and the operator restarts the gang, whose pods
    may land on other nodes (a bad GPU, a full disk)."""

    quick: int = 0
    unstepped: int = 0

    def failed(self, seconds: float, stepped: bool) -> None:
        self.quick = self.quick + 1 if seconds < QUICK_ROUND_SECONDS else 0
        self.unstepped = 0 if stepped else self.unstepped + 1

    def backoff_seconds(self) -> float:
        return 0.0 if self.quick <= 1 else min(2.0 ** (self.quick - 1), BACKOFF_MAX_SECONDS)

    def gives_up(self) -> bool:
        return self.unstepped >= EARLY_ROUNDS_TO_GANG


@dataclass(frozen=True)
class Stall:
    rank: int
    step: int | None
    seconds: float


def heartbeat_file(directory: str, rank: int) -> Path:
    return Path(directory) / f"rank-{rank}"


def beat(path: Path, step: int) -> None:
    """A worker's heartbeat: its step, written in place (a reader that meets a partial write reads no step)."""
    path.write_text(str(step))


def stalled(directory: str, hang_seconds: float, now: float | None = None) -> Stall | None:
    """The worker of this node that beat longest ago, where that was more than `hang_seconds` ago; None where every
    worker that has beaten did so since. A worker removes its file when it returns."""
    now = time.time() if now is None else now
    oldest: Stall | None = None
    for path in Path(directory).glob("rank-*"):
        try:
            age = now - path.stat().st_mtime
            text = path.read_text()
        except FileNotFoundError:  # removed as its worker returned
            continue
        if age > hang_seconds and (oldest is None or age > oldest.seconds):
            oldest = Stall(int(path.name.split("-")[1]), int(text) if text.isdigit() else None, age)
    return oldest


def stepped(directory: str) -> bool:
    """Whether a worker of this round has beaten: its first step is done (a failed worker leaves its file)."""
    return any(Path(directory).glob("rank-*"))


def clear(directory: str) -> None:
    """Before a round's workers start: the last round's beats say nothing of theirs."""
    for path in Path(directory).glob("rank-*"):
        path.unlink(missing_ok=True)


def describe_stall(stall: Stall) -> str:
    at = f" since step {stall.step}" if stall.step is not None else ""
    return f"rank {stall.rank} made no progress for {stall.seconds:.0f} s{at}"

