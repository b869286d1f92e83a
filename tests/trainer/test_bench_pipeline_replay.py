"""bench/pipeline_bubble.py reports the bubble of a recorded schedule replayed on dedicated devices: the replay
must give exactly (p-1)/(m+p-1) for GPipe's and 1F1B's op orders with a backward twice a forward (the formula's
own assumptions), honour each op's dependency on its neighbour stage, and refuse an order that cannot run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from pipeline_bubble import formula, replay  # noqa: E402


def gpipe(p: int, m: int) -> list[list[tuple[str, int, float]]]:
    return [[("F", i, 1.0) for i in range(m)] + [("B", i, 2.0) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[tuple[str, int, float]]]:
    stages = []
    for s in range(p):
        warmup = min(m, p - s)
        ops, forwards = [("F", i, 1.0) for i in range(warmup)], warmup
        for b in range(m):
            ops.append(("B", b, 2.0))
            if forwards < m:
                ops.append(("F", forwards, 1.0))
                forwards += 1
        stages.append(ops)
    return stages


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8)])
def test_uniform_stages_replay_to_the_formula(p, m):
    for order in (gpipe(p, m), one_f_one_b(p, m)):
        makespan, busy = replay(order)
        assert busy == [3.0 * m] * p
        assert 1 - busy[0] / makespan == pytest.approx(formula(p, m))


def test_a_slow_stage_holds_up_the_stages_after_it():
    stages = gpipe(2, 2)
    stages[0] = [("F", 0, 5.0), ("F", 1, 1.0), ("B", 0, 2.0), ("B", 1, 2.0)]
    makespan, _ = replay(stages)
    # stage 1 runs F0 at 5-6, F1 at 6-7, B0 to 9, B1 to 11; stage 0's B0 waits for 9 (to 11), B1 for 11 (to 13)
    assert makespan == pytest.approx(13.0)


def test_an_order_that_waits_on_itself_is_refused():
    stages = [[("B", 0, 2.0), ("F", 0, 1.0)], [("F", 0, 1.0), ("B", 0, 2.0)]]
    with pytest.raises(RuntimeError, match="deadlocks"):
        replay(stages)
