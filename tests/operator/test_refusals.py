"""Which refused writes fail a job at once and which are retried (until spec.scheduling.startTimeoutSeconds)."""

from __future__ import annotations

import asyncio

import pytest

from paratrain_operator import apply, reconcile
from paratrain_operator.kube import ApiError

POD = {"kind": "Pod", "metadata": {"namespace": "ml", "name": "job-0-3"}}
QUOTA = 'pods "job-0-3" is forbidden: exceeded quota: team, requested: pods=1, used: pods=8, limited: pods=8'
PSS = ('pods "job-0-3" is forbidden: violates PodSecurity "restricted:latest": host namespaces '
       '(hostNetwork=true)')


def test_a_refusal_names_the_object_and_keeps_the_api_error():
    refused = apply.Refused("create", POD, ApiError(403, "Forbidden", QUOTA))
    assert str(refused) == f"Pod ml/job-0-3: {QUOTA}"
    assert (refused.status, refused.verb, refused.transient) == (403, "create", False)
    assert apply.Refused("create", POD, ApiError(503, "ServiceUnavailable", "", retry_after=2)).retry_after == 2


@pytest.mark.parametrize("status, message, reason", [
    (403, PSS, "PodSecurity"),            # the namespace's level: every retry would be refused alike
    (422, "spec.containers: Invalid value", "RejectedByAPI"),
    (403, QUOTA, None),                   # quota can free up: retried, reported, bounded by the start timeout
    (403, 'admission webhook "policy.example.com" denied the request', None),
    (409, "already exists", None),        # a name still held by a same-named job's pod being deleted
    (500, "etcdserver: request timed out", None),
])
def test_only_refusals_no_retry_can_change_fail_the_job_at_once(status, message, reason):
    failure = reconcile._rejection(apply.Refused("create", POD, ApiError(status, "", message)))
    assert (failure.reason if failure else None) == reason
    if failure:
        assert not failure.retryable and "Pod ml/job-0-3" in failure.message


def test_refused_writes_back_off_doubling_to_a_cap_and_start_again_from_scratch(monkeypatch):
    """Each refusal in a row doubles the wait before the job's next creates and deletes (1, 2, 4 ... 60 s), and a
    pass is asked for at its end; writes that go through reset it."""
    asked: list[float] = []

    async def later(key, delay):
        asked.append(delay)

    monkeypatch.setattr(reconcile, "_after_backoff", later)
    key = ("ml", "job")

    async def main() -> list[float]:
        waits = []
        for _ in range(8):
            reconcile._back_off(key)
            waits.append(round(reconcile._backoff_left(key)))
            await asyncio.sleep(0)  # the pass asked for runs (here: is recorded) before the next refusal
        reconcile._write_backoff.pop(key)
        return waits

    assert asyncio.run(main()) == [1, 2, 4, 8, 16, 32, 60, 60]
    assert [round(d) for d in asked] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert reconcile._backoff_left(key) <= 0


def test_a_namespace_over_the_platforms_job_limit_starts_its_jobs_in_order():
    """maxJobsPerNamespace: started jobs count first, then the waiting ones by creation; finished, suspended and
    other namespaces' jobs do not count."""
    def job(name, phase=None, created="2026-12-01T00:00:00Z", namespace="team", suspend=False, started=None):
        status = {"phase": phase} if phase else {}
        if started:
            status["attemptStartTime"] = started
        return ((namespace, name), {"metadata": {"creationTimestamp": created}, "status": status,
                                    "spec": {"runPolicy": {"suspend": suspend}}})
    known = [job("running", "Running", "2026-12-03T00:00:00Z"), job("done", "Succeeded"),
             job("parked", "Suspended", suspend=True), job("elsewhere", namespace="other"),
             job("older", created="2026-12-01T00:00:00Z"), job("newer", created="2026-12-02T00:00:00Z")]
    assert reconcile.over_namespace_limit(("team", "older"), known, limit=2) is None  # "running", then it
    held = reconcile.over_namespace_limit(("team", "newer"), known, limit=2)
    assert held and "2 unfinished jobs in namespace team start before this one" in held
    assert "maxJobsPerNamespace" in held
    assert reconcile.over_namespace_limit(("team", "newer"), known, limit=3) is None
    assert reconcile.over_namespace_limit(("team", "newer"), known, limit=0) is None  # no limit
