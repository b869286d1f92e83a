"""Leader election's rules (leader.Elector) against an in-memory Lease that keeps the API server's one promise that
matters here: a write carrying an old resourceVersion is refused (409). The live test (test_live_standby.py) runs
two real replicas."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from paratrain_operator import kube, leader


class LeaseStore:
    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False

    async def request(self, method: str, path: str, *, body: Any = None, **_: Any) -> Any:
        if self.down:
            raise kube.ApiError(503, "Unavailable", "the API server is down")
        if method == "GET":
            if self.lease is None:
                raise kube.ApiError(404, "NotFound", "no lease")
            return copy.deepcopy(self.lease)
        if method == "POST" and self.lease is not None:
            raise kube.ApiError(409, "AlreadyExists", "lease exists")
        if method == "PUT" and body["metadata"].get("resourceVersion") != str(self.version):
            raise kube.ApiError(409, "Conflict", "the object has been modified")
        self.version += 1
        self.lease = {**copy.deepcopy(body), "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        return copy.deepcopy(self.lease)


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> LeaseStore:
    s = LeaseStore()
    monkeypatch.setattr(kube, "_client", s)
    return s


def elector(identity: str, lease_seconds: float = 0.5) -> leader.Elector:
    return leader.Elector("ops", "lease", identity, lease_seconds=lease_seconds, renew_deadline=lease_seconds * 0.7,
                          retry_seconds=0.05)


def test_one_replica_leads_and_the_other_takes_over_only_once_the_lease_runs_out(store: LeaseStore):
    async def main() -> None:
        a, b = elector("a"), elector("b")
        assert await a._try() and not await b._try()  # a creates the Lease; b sees it held
        assert await a._try() and not await b._try()  # a renews; b keeps seeing a fresh record
        await asyncio.sleep(0.6)  # a stops renewing: the record b saw stands unrenewed for the lease's duration
        assert await b._try()
        assert store.lease["spec"]["holderIdentity"] == "b" and store.lease["spec"]["leaseTransitions"] == 1
        assert not await a._try()  # a, back, finds b holding a fresh Lease
    asyncio.run(main())


def test_a_released_lease_is_taken_at_once(store: LeaseStore):
    async def main() -> None:
        a, b = elector("a", lease_seconds=60), elector("b", lease_seconds=60)
        await a.acquire()
        assert not await b._try()
        await a.release()
        assert await b._try() and not a.leading
    asyncio.run(main())


def test_two_standbys_racing_for_an_expired_lease_cannot_both_win(store: LeaseStore):
    async def main() -> None:
        a, b, c = elector("a"), elector("b"), elector("c")
        await a.acquire()
        assert not await b._try() and not await c._try()
        await asyncio.sleep(0.6)
        # Both read the expired Lease, then both write: the second write carries a stale resourceVersion.
        wins = await asyncio.gather(b._try(), c._try())
        assert sorted(wins) == [False, True]
    asyncio.run(main())


def test_a_leader_that_cannot_renew_in_time_gives_up_before_its_lease_ends(store: LeaseStore):
    async def main() -> float:
        a = elector("a")
        await a.acquire()
        store.down = True
        start = asyncio.get_running_loop().time()
        with pytest.raises(leader.LostLease):
            await a.keep()
        return asyncio.get_running_loop().time() - start
    elapsed = asyncio.run(main())
    # It stops within its renew deadline (0.35 s after its last renewal, plus one retry) < the lease (0.5 s).
    assert elapsed < 0.5
