"""The gang's rounds in node 0's store and the workers' heartbeats (paratrain.rounds), on a real TCPStore: a
failure ends a round once however many agents see it, the first cause is kept, an agent whose workers were
stopped joins the round that began, and a replaced pod's agent ends the round its lost workers were in."""

from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist

from paratrain import contract, rounds


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))


def test_a_round_ends_once_and_keeps_its_first_cause(store):
    assert [rounds.join_round(store, n) for n in (0, 1)] == [0, 0]  # the gang's first workers
    assert rounds.end_round(store, 0, {"rank": 1, "nodeRank": 1, "exitCode": 1}) == 1
    # node 0's workers saw their peer die (75) and its agent ends the same round: nothing moves, the cause stays
    assert rounds.end_round(store, 0, {"rank": 0, "nodeRank": 0, "exitCode": 75}) == 1
    assert rounds.cause_of(store, 0) == {"rank": 1, "nodeRank": 1, "exitCode": 1}
    assert rounds.current_round(store) == 1
    # both agents start their next workers in round 1, however many times they were told
    assert [rounds.join_round(store, n) for n in (1, 0)] == [1, 1]
    assert rounds.cause_of(store, 1) is None


def test_an_agent_stopped_late_joins_the_round_that_began_not_one_past_it(store):
    for n in (0, 1):
        rounds.join_round(store, n)
    rounds.end_round(store, 0, {"rank": 0, "nodeRank": 0, "exitCode": 1})
    assert rounds.join_round(store, 0) == 1
    rounds.end_round(store, 1, {"rank": 0, "nodeRank": 0, "exitCode": 1})  # round 1 fails before node 1 noticed 0
    # node 1 was in round 0: it ends nothing (round 0 is over) and joins round 2 with node 0
    assert rounds.end_round(store, 0, {"rank": 1, "nodeRank": 1, "exitCode": 75}) == 2
    assert rounds.join_round(store, 1) == 2 and rounds.join_round(store, 0) == 2


def test_a_replaced_pods_agent_ends_the_round_its_lost_workers_were_in(store):
    for n in (0, 1):
        rounds.join_round(store, n)
    # node 1's pod is lost while node 0's worker waits in a collective (NCCL: until its timeout); the fresh agent
    # of node 1 finds its node's last round still current and ends it, naming itself
    assert rounds.join_round(store, 1) == 1
    assert rounds.cause_of(store, 0) == {"nodeRank": 1, "exitCode": contract.EXIT_RETRYABLE, "replaced": True}
    assert rounds.current_round(store) == 1
    # where its peers had already ended that round (gloo saw the loss at once), it joins theirs
    rounds.end_round(store, 1, {"rank": 0, "nodeRank": 0, "exitCode": 75})
    assert rounds.join_round(store, 0) == 2
    assert rounds.join_round(store, 1) == 2 and rounds.current_round(store) == 2


def test_a_stall_is_the_oldest_beat_past_the_limit(tmp_path):
    now = 1_000_000.0
    for rank, age, step in ((4, 3.0, 17), (5, 12.0, 16), (6, 30.0, None)):
        path = rounds.heartbeat_file(str(tmp_path), rank)
        rounds.beat(path, step) if step is not None else path.write_text("")  # a write caught half done
        os.utime(path, (now - age, now - age))
    assert rounds.stalled(str(tmp_path), 60, now) is None
    assert rounds.stalled(str(tmp_path), 10, now) == rounds.Stall(6, None, 30.0)
    (tmp_path / "rank-6").unlink()  # its worker returned
    stall = rounds.stalled(str(tmp_path), 10, now)
    assert stall == rounds.Stall(5, 16, 12.0)
    assert rounds.describe_stall(stall) == "rank 5 made no progress for 12 s since step 16"
    rounds.clear(str(tmp_path))
    assert rounds.stalled(str(tmp_path), 0, now) is None


def test_a_streak_of_quick_failures_backs_off_and_two_before_a_first_step_give_in_place_up():
    streak = rounds.Streak()
    waits = []
    for _ in range(7):  # a fault that recurs a few seconds into every round, after its first step
        streak.failed(seconds=5.0, stepped=True)
        waits.append(streak.backoff_seconds())
    assert waits == [0.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0] and not streak.gives_up()
    streak.failed(seconds=3600.0, stepped=True)  # an hour of training between: a fault of its own
    assert streak.backoff_seconds() == 0.0
    streak.failed(seconds=20.0, stepped=False)  # a round that never stepped here
    assert not streak.gives_up()
    streak.failed(seconds=20.0, stepped=False)
    assert streak.gives_up() and streak.backoff_seconds() == 2.0
    streak.failed(seconds=20.0, stepped=True)
    assert not streak.gives_up()
