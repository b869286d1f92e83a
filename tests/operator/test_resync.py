"""Running jobs at scale (issue 26, item 6), without a cluster: each job's resync has its own slot in the period and
runs as its own task, so one slow job delays no other; a status write that moves only training progress comes at
most once per PARATRAIN_PROGRESS_SECONDS a job. bench/operator_scale.py measures 500 running jobs."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import pytest

from paratrain_operator import handlers, observe, reconcile


def test_resync_slots_spread_over_the_period_and_come_once_a_period():
    schedule = handlers.ResyncSchedule(10.0)
    keys = [("team", f"job-{i}") for i in range(500)]
    offsets = [schedule.offset(k) for k in keys]
    assert all(0 <= o < 10 for o in offsets)
    tenths = Counter(int(o) for o in offsets)  # 500 jobs over ten 1-second slices: ~50 each, never all at once
    assert len(tenths) == 10 and max(tenths.values()) < 100
    due_at: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
    for tick in range(0, 300):  # 30 s in steps of 0.1 s
        for key in schedule.take_due(keys, tick / 10):
            due_at[key].append(tick / 10)
    for key, times in due_at.items():  # one resync a period, at its own offset (the first within one period)
        assert 2 <= len(times) <= 3 and times[0] < schedule.offset(key) + 0.1
        assert all(b - a == pytest.approx(10, abs=0.11) for a, b in zip(times, times[1:]))


def test_a_job_late_for_its_slot_gets_its_next_slot_not_a_burst():
    schedule = handlers.ResyncSchedule(10.0)
    key = ("team", "slow")
    at = schedule.offset(key)
    assert schedule.take_due([key], 0.0) == ([key] if at == 0 else [])
    assert schedule.take_due([key], at + 35) == [key]  # 35 s late (its loop was busy): one resync, not four
    assert schedule.take_due([key], at + 35.5) == []
    assert schedule.take_due([key], at + 40) == [key]


def test_a_slow_job_never_delays_another_jobs_resync(monkeypatch: pytest.MonkeyPatch):
    """Before, the resync gathered every job's pass and waited for all of them: a rank 0 answering in 2 s (or a
    pass waiting on the API) held up every other job's deadline and stall check as long."""
    resyncs: Counter[str] = Counter()
    release = asyncio.Event()

    async def refresh_progress(namespace: str, name: str) -> None:
        resyncs[name] += 1
        if name == "slow":
            await release.wait()  # its rank 0 never answers while the test runs

    async def reconcile_job(namespace: str, name: str) -> None:
        return None

    jobs = observe.JobCache()
    for name in ("slow", "quick"):
        jobs.offer({"metadata": {"namespace": "team", "name": name, "resourceVersion": "1"}, "status": {}})
    monkeypatch.setattr(reconcile, "jobs", jobs)
    monkeypatch.setattr(reconcile, "refresh_progress", refresh_progress)
    monkeypatch.setattr(reconcile, "reconcile", reconcile_job)
    monkeypatch.setattr(handlers, "RESYNC_SECONDS", 0.2)

    async def main() -> None:
        loop = asyncio.create_task(handlers._resync_forever(logging.getLogger("test")))
        await asyncio.sleep(2.0)
        loop.cancel()
        release.set()
        await asyncio.gather(loop, *handlers._resyncs.values(), return_exceptions=True)
    asyncio.run(main())
    assert resyncs["slow"] == 1  # its one resync still runs: later slots are skipped, never stacked
    assert resyncs["quick"] >= 6  # about one every 0.2 s for 2 s, the slow job notwithstanding


def test_a_write_of_progress_alone_comes_at_most_once_per_progress_seconds(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(reconcile, "PROGRESS_SECONDS", 30.0)
    monkeypatch.setattr(reconcile, "_progress_written", {})
    key = ("team", "job")
    progress: dict[str, Any] = {"progress": {"step": 10}, "progressText": "10/100"}
    assert reconcile._paced(key, dict(progress), now=100.0) == progress  # the first one at once
    assert reconcile._paced(key, {"progress": {"step": 11}}, now=110.0) == {}  # 10 s later: held back
    both = {"phase": "Succeeded", "progress": {"step": 100}}
    assert reconcile._paced(key, both, now=115.0) == both  # with another change: written, progress along
    assert reconcile._paced(key, {"progress": {"step": 12}}, now=140.0) == {}  # 25 s after that one
    assert reconcile._paced(key, {"progress": {"step": 13}}, now=145.5) == {"progress": {"step": 13}}
    assert reconcile._paced(("team", "other"), {"progress": {"step": 1}}, now=146.0) == {"progress": {"step": 1}}


def test_passes_asked_for_in_a_row_come_further_apart_and_an_ended_pod_brings_one_forward(
        monkeypatch: pytest.MonkeyPatch):
    """A 1,024-pod start sends thousands of pod events over tens of seconds: a pass every 0.5 s made 25 passes
    after creation (each writing status). Now the wait doubles to 4 s while events keep coming; a pod that ends
    (a restart may be due) still gets a pass within 0.5 s."""
    monkeypatch.setattr(reconcile, "_streaks", {})
    key = ("team", "big")
    assert [reconcile.coalesce_delay(key, t) for t in (0.0, 0.6, 1.7, 3.8, 7.9, 12.0)] == [0.5, 1, 2, 4, 4, 4]
    assert reconcile.coalesce_delay(key, 30.0) == 0.5  # quiet for a while: the streak is over

    started: list[float] = []

    async def record(namespace: str, name: str, body: Any = None) -> None:
        started.append(asyncio.get_running_loop().time())

    monkeypatch.setattr(reconcile, "reconcile", record)
    monkeypatch.setattr(reconcile, "_scheduled", {})

    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reconcile._streaks[key] = (5, t0)  # deep in a streak: the next pass would wait 4 s
        reconcile.request(key)
        reconcile.request(key)  # shares it
        await asyncio.sleep(0.1)
        reconcile.request(key, urgent=True)  # a pod failed: brought forward
        await asyncio.sleep(1.0)
        await asyncio.gather(*reconcile.requested_passes(), return_exceptions=True)
        return t0
    t0 = asyncio.run(main())
    assert len(started) == 1 and started[0] - t0 < 1.0


@pytest.mark.parametrize("phase, run_policy, due", [
    ("Running", {}, True),
    ("Pending", {}, True),
    ("Suspended", {"suspend": True}, False),  # costs nothing until resumed (issue 42)
    ("Suspended", {"suspend": False}, True),  # resumed: its pass is due
    ("Running", {"suspend": True}, True),  # being suspended: its pods still go
    ("Succeeded", {}, False),
    ("Failed", {"ttlSecondsAfterFinished": 60}, True),
])
def test_which_jobs_the_resync_visits(phase: str, run_policy: dict, due: bool):
    assert handlers.resync_due({"status": {"phase": phase}, "spec": {"runPolicy": run_policy}}) is due
