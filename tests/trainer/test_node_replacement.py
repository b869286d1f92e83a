"""A pod replaced alone, without Kubernetes: two `paratrain node` processes stand for a 2-pod gang with
restartPolicy.inPlaceLimit; node 1 is lost (its whole process tree killed, as when its node goes; or stopped with
SIGTERM, as a drain or `kubectl delete pod` stops it) and a fresh node 1 is started, as the operator recreates the
pod. Node 0's agent restarts its worker in place, the new round waits for the fresh node's worker at node 0's
store (that worker's agent counts its restarts from 0, its peer's from 1: the round is keyed by the store), and
the gang resumes from the newest checkpoint: the whole loss curve is the uninterrupted run's, exactly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from paratrain import contract
from paratrain.launch import free_port

from ..reliability.gang import FAULTS
from .harness import TINY_JOB, job_env, run_job

pytestmark = pytest.mark.timeout(300)
STEPS = 300


def job(checkpoints: Path, interval: int) -> dict:
    spec = {**TINY_JOB["spec"], "nodes": 2, "parallelism": {"data": 2},
            "training": {**TINY_JOB["spec"]["training"], "steps": STEPS, "evalInterval": STEPS},
            "checkpoint": {"path": str(checkpoints), "interval": interval},
            "runPolicy": {"collectiveTimeoutSeconds": 30}, "restartPolicy": {"inPlaceLimit": 2}}
    return {**TINY_JOB, "metadata": {"name": "replaced"}, "spec": spec}


def start_node(spec: Path, rank: int, port: int, log: Path, fault: str | None = None,
               extra: dict[str, str] | None = None, in_place_limit: int = 2) -> subprocess.Popen:
    """`paratrain node` as pod `rank` runs it, in a session of its own (the pod's process tree)."""
    faults = {"PARATRAIN_TEST_FAULT": fault, "PYTHONPATH": str(FAULTS)} if fault else {}
    env = {**job_env(faults), "OMP_NUM_THREADS": "1", **(extra or {}),
           **contract.node_env(nnodes=2, nproc_per_node=1, node_rank=rank, master_addr="127.0.0.1",
                               master_port=port, in_place_limit=in_place_limit)}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "paratrain.cli", "node", "--spec", str(spec)], env=env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=spec.parent, start_new_session=True)


def stop_all(nodes) -> None:
    """Whatever of the nodes' process trees still runs."""
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)


@pytest.mark.parametrize("loss", ["killed", "stopped"])
def test_a_lost_node_replaced_alone_rejoins_and_the_curve_goes_on_exactly(tmp_path: Path, loss: str):
    checkpoints = tmp_path / "ckpt"
    doc = job(checkpoints, interval=10 if loss == "killed" else 0)  # a stop saves the step in flight itself
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(doc))
    port = free_port()
    logs = [tmp_path / "node-0.log", tmp_path / "node-1.log"]
    # Rank 1 signals its own agent after step 25: KILL takes agent and rank at once (no step saved, no goodbye);
    # TERM is the kubelet's stop, which the agent passes on to its worker.
    fault = f"lose_node:1:25:{'KILL' if loss == 'killed' else 'TERM'}"
    node0, node1 = start_node(spec, 0, port, logs[0], fault), start_node(spec, 1, port, logs[1], fault)
    try:
        lost = node1.wait(120)
        assert lost == (-signal.SIGKILL if loss == "killed" else contract.EXIT_PREEMPTED), logs[1].read_text()[-3000:]
        assert node0.poll() is None, "node 0's agent restarts its worker in place instead of failing"
        node1 = start_node(spec, 1, port, logs[1])  # the replacement: a fresh agent, restart count 0
        assert node1.wait(240) == 0, logs[1].read_text()[-3000:]
        assert node0.wait(60) == 0, logs[0].read_text()[-3000:]
    finally:
        stop_all((node0, node1))
    said = logs[0].read_text()
    # Rank 0 tells the operator of the in-place round; the kill left step 20's checkpoint, the stop saved the step
    # at whose boundary the ranks agreed on it.
    assert "restart restartsInPlace=1 " in said, said[-3000:]
    saved = re.search(r"preempted step=(\d+) saved=True", said)
    resumed = 20 if loss == "killed" else int(saved[1]) if saved else -1
    assert resumed >= 20 and f"start step={resumed} " in said, said[-3000:]
    final = json.loads((checkpoints / f"step-{STEPS:08d}" / "manifest.json").read_text())
    _, straight = run_job(tmp_path / "straight", job={**doc, "spec": {**doc["spec"], "checkpoint": {}}})
    assert final["losses"] == straight["losses"], "the curve goes on from the checkpoint exactly"


HANG_SECONDS = 5


def test_a_rank_hung_alive_is_restarted_in_place_in_seconds_its_peers_stopped_through_the_store(tmp_path: Path):
    """Rank 1 stops making progress after step 25 but stays alive (holding its process group, as a deadlock
    does); rank 0 blocks in its next all-reduce, which would wait the collective timeout (120 s). Node 1's agent
    sees rank 1's heartbeat go stale after restartPolicy.hangSeconds and ends the round in node 0's store; node 0's
    agent, which has no hang detection of its own here, stops its worker because the round ended. The next round
    resumes from step 20's checkpoint within seconds of the hang's detection, and the curve is the uninterrupted
    run's, exactly."""
    checkpoints, events, faults = tmp_path / "ckpt", tmp_path / "events.jsonl", tmp_path / "faults.log"
    doc = job(checkpoints, interval=10)
    doc["spec"]["runPolicy"]["collectiveTimeoutSeconds"] = 120
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(doc))
    port = free_port()
    logs = [tmp_path / "node-0.log", tmp_path / "node-1.log"]
    fault, said = "hang_at:1:25", {"PARATRAIN_TEST_FAULT_LOG": str(faults)}
    node0 = start_node(spec, 0, port, logs[0], fault, {**said, contract.ENV_EVENTS_FILE: str(events)})
    node1 = start_node(spec, 1, port, logs[1], fault, {**said, contract.ENV_HANG_SECONDS: str(HANG_SECONDS)})
    try:
        assert node1.wait(240) == 0, logs[1].read_text()[-3000:]
        assert node0.wait(60) == 0, logs[0].read_text()[-3000:]
    finally:
        stop_all((node0, node1))
    own, peer = logs[1].read_text(), logs[0].read_text()
    assert "rank 1 made no progress for" in own and "(restartPolicy.hangSeconds 5)" in own, own[-3000:]
    assert "time.sleep(60)" in own or "in optimizer_step" in own, "the hung worker's stacks are in its pod's log"
    assert "round 0 ended by another pod" in peer, peer[-3000:]
    # The peer waits in its next collective: the step's read (mean_over_reporters' all_reduce) or DDP's gradient
    # all-reduce in backward (_micro_step), whichever it reached first.
    assert any(f"in {where}" in peer for where in ("all_reduce", "mean_over_reporters", "_micro_step")), \
        "the peer's stacks show where it waited"
    hung_at = float(faults.read_text().split()[0])
    records = [json.loads(line) for line in events.read_text().splitlines()]
    restart = next(r for r in records if r["event"] == "restart")
    assert restart["lastFailure"] == {"rank": 1, "nodeRank": 1, "exitCode": contract.EXIT_HUNG, "step": 24}
    resumed = next(r for r in records if r["event"] == "start" and r["startStep"] == 20)
    # hangSeconds, the agents' one-second look, the stacks' second, a 3 s stop at most, the new round's start
    waited = resumed["time"] - hung_at
    assert HANG_SECONDS < waited < HANG_SECONDS + 25, waited
    final = json.loads((checkpoints / f"step-{STEPS:08d}" / "manifest.json").read_text())
    _, straight = run_job(tmp_path / "straight", job={**doc, "spec": {**doc["spec"], "checkpoint": {}}})
    assert final["losses"] == straight["losses"], "the curve goes on from the checkpoint exactly"


def two_nodes(tmp_path: Path, doc: dict, fault: str, faults: Path) -> tuple[subprocess.Popen, ...]:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(doc))
    port, said = free_port(), {"PARATRAIN_TEST_FAULT_LOG": str(faults)}
    limit = doc["spec"]["restartPolicy"]["inPlaceLimit"]
    return tuple(start_node(spec, rank, port, tmp_path / f"node-{rank}.log", fault, said, limit) for rank in (0, 1))


def test_rounds_failing_at_once_back_off_and_two_before_a_first_step_give_in_place_up(tmp_path: Path):
    """Rank 1 exits 1 two steps into each of its first three rounds: its agent restarts the first at once, waits
    2 s before the third round and 4 s before the fourth, which trains to the end. Then a rank that exits while
    building, every round: its agent gives in-place rounds up after the second (its pod fails, so the operator
    restarts the gang, maybe elsewhere) instead of spending all of inPlaceLimit's 3."""
    doc = job(tmp_path / "ckpt", interval=0)
    doc["spec"]["training"]["steps"] = 20
    doc["spec"]["restartPolicy"]["inPlaceLimit"] = 3
    faults = tmp_path / "exits.log"
    nodes = two_nodes(tmp_path, doc, "exit_at:1:2:1:3", faults)
    try:
        assert [node.wait(240) for node in nodes] == [0, 0], (tmp_path / "node-1.log").read_text()[-3000:]
    finally:
        stop_all(nodes)
    exits = [float(t) for t in faults.read_text().split()]
    assert len(exits) == 3
    first, second = exits[1] - exits[0], exits[2] - exits[1]
    assert 1.5 < second - first < 3.5, (first, second)  # the 2 s wait, beside the round's own time
    said = (tmp_path / "node-1.log").read_text()
    assert "waiting 2 s before the next" in said and "waiting 4 s before the next" in said, said[-3000:]

    early = tmp_path / "early"
    early.mkdir()
    nodes = two_nodes(early, {**doc, "spec": {**doc["spec"], "checkpoint": {}}}, "fail_build:1:1", early / "exits.log")
    try:
        assert nodes[1].wait(240) == 1, (early / "node-1.log").read_text()[-3000:]
    finally:
        stop_all(nodes)
    assert len((early / "exits.log").read_text().split()) == 2  # two rounds, not inPlaceLimit + 1
    said = (early / "node-1.log").read_text()
    assert "failed before their first step 2 times in a row: no more in-place rounds" in said, said[-3000:]
