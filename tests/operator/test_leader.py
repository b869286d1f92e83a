"""Leader election's rules (leader.Elector) against an in-memory Lease that keeps the API server's one promise that
matters here: a write carrying an old resourceVersion is refused (409). The live test (test_live_standby.py) runs
two real replicas."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace
from typing import Any

import pytest

from paratrain_operator import kube, leader


class LeaseStore:
    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False
        self.hang = False  # requests never answer (a proxy or connection that holds them)

    async def request(self, method: str, path: str, *, body: Any = None, **_: Any) -> Any:
        while self.hang:
            await asyncio.sleep(0.01)
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
def store() -> LeaseStore:
    return LeaseStore()


def elector(store: LeaseStore, identity: str, lease_seconds: float = 0.5) -> leader.Elector:
    return leader.Elector(store, "ops", "lease", identity, lease_seconds=lease_seconds,  # type: ignore[arg-type]
                          renew_deadline=lease_seconds * 0.7, retry_seconds=0.05)


def test_one_replica_leads_and_the_other_takes_over_only_once_the_lease_runs_out(store: LeaseStore):
    async def main() -> None:
        a, b = elector(store, "a"), elector(store, "b")
        assert await a._try() and not await b._try()  # a creates the Lease; b sees it held
        assert await a._try() and not await b._try()  # a renews; b keeps seeing a fresh record
        await asyncio.sleep(0.6)  # a stops renewing: the record b saw stands unrenewed for the lease's duration
        assert await b._try()
        assert store.lease["spec"]["holderIdentity"] == "b" and store.lease["spec"]["leaseTransitions"] == 1
        assert not await a._try()  # a, back, finds b holding a fresh Lease
    asyncio.run(main())


def test_a_released_lease_is_taken_at_once(store: LeaseStore):
    async def main() -> None:
        a, b = elector(store, "a", lease_seconds=60), elector(store, "b", lease_seconds=60)
        await a.acquire()
        assert not await b._try()
        await a.release()
        assert await b._try() and not a.leading
    asyncio.run(main())


def test_two_standbys_racing_for_an_expired_lease_cannot_both_win(store: LeaseStore):
    async def main() -> None:
        a, b, c = elector(store, "a"), elector(store, "b"), elector(store, "c")
        await a.acquire()
        assert not await b._try() and not await c._try()
        await asyncio.sleep(0.6)
        # Both read the expired Lease, then both write: the second write carries a stale resourceVersion.
        wins = await asyncio.gather(b._try(), c._try())
        assert sorted(wins) == [False, True]
    asyncio.run(main())


def test_a_leader_that_cannot_renew_in_time_gives_up_before_its_lease_ends(store: LeaseStore):
    async def main() -> float:
        a = elector(store, "a")
        await a.acquire()
        store.down = True
        start = asyncio.get_running_loop().time()
        with pytest.raises(leader.LostLease):
            await a.keep()
        return asyncio.get_running_loop().time() - start
    elapsed = asyncio.run(main())
    # It stops within its renew deadline (0.35 s after its last renewal, plus one retry) < the lease (0.5 s).
    assert elapsed < 0.5


def test_a_renewal_that_hangs_is_cut_at_the_renew_deadline(store: LeaseStore):
    """A try that never answers (a held connection, an API server that accepts and stalls) must not keep the
    holder acting past its renew deadline: a standby takes over once the lease runs out."""
    async def main() -> float:
        a = elector(store, "a")
        await a.acquire()
        renewed = asyncio.get_running_loop().time()
        store.hang = True
        with pytest.raises(leader.LostLease, match="within 0.35s of the last renewal"):
            await a.keep()
        assert not a.leading
        return asyncio.get_running_loop().time() - renewed
    elapsed = asyncio.run(main())
    assert 0.3 <= elapsed < 0.5  # the renew deadline (0.35 s) from the last renewal, before the lease (0.5 s) ends


def test_a_leader_that_finds_another_holder_stops_at_once(store: LeaseStore):
    async def main() -> float:
        a, b = elector(store, "a", lease_seconds=60), elector(store, "b", lease_seconds=60)
        await a.acquire()
        spec = store.lease["spec"]  # b saw this record long ago, by its clock: a's lease ran out (a paused holder)
        b._seen, b._seen_at = (spec["holderIdentity"], spec["renewTime"], spec["leaseTransitions"]), -1e9
        assert await b._try()
        start = asyncio.get_running_loop().time()
        with pytest.raises(leader.LostLease, match="held by b"):
            await a.keep()
        return asyncio.get_running_loop().time() - start
    assert asyncio.run(main()) < 1  # not the 42 s renew deadline


def test_a_stopped_client_refuses_every_request_at_once():
    api = kube.Kube(SimpleNamespace(host="http://127.0.0.1:9"))  # nothing listens there: no request may go out

    async def main() -> kube.ApiError:
        await api.stop()
        with pytest.raises(kube.ApiError, match="Stopped") as refused:
            await asyncio.wait_for(api.request("PATCH", "/api/v1/namespaces/a/pods/b", body={}), 0.3)  # no retries
        return refused.value
    assert asyncio.run(main()).status == 0


def test_a_graceful_stop_ends_passes_and_writes_before_it_releases_the_lease(monkeypatch: pytest.MonkeyPatch):
    """A standby may act the instant the Lease is released: by then no pass of this replica may still run."""
    from paratrain_operator import handlers

    order: list[str] = []

    class Client:
        async def stop(self) -> None:
            order.append("client stopped")

    class Lease:
        api = SimpleNamespace(close=lambda: asyncio.sleep(0))

        async def release(self) -> None:
            order.append("lease released")

    async def a_pass() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.05)  # a pass winding down (its last await)
            order.append("pass ended")

    async def main() -> None:
        monkeypatch.setattr(kube, "_client", Client())
        monkeypatch.setattr(leader, "elector", Lease())
        monkeypatch.setattr(handlers, "_tasks", [asyncio.get_running_loop().create_task(a_pass())])
        await asyncio.sleep(0)
        await handlers.close()
    asyncio.run(main())
    assert order == ["pass ended", "client stopped", "lease released"]


@pytest.mark.parametrize("answer", ["empty 2xx", "500", "409"])
def test_any_renewal_failure_ends_leadership_and_no_write_may_leave_past_the_renew_deadline(store: LeaseStore,
                                                                                            answer: str):
    """An empty 2xx to the Lease GET once raised AttributeError in the renewal task, which ended it quietly:
    `leading` stayed True and writes went on while a standby took over. Whatever the answer, renewals end by
    the renew deadline, and `may_write` (which every write checks) refuses from that instant on."""
    async def main() -> tuple[str | None, str | None, str]:
        a = elector(store, "a")
        assert await a._try()
        allowed = a.may_write()
        real = store.request

        async def broken(method: str, path: str, **kwargs: Any) -> Any:
            if answer == "empty 2xx" and method == "GET":
                return None
            if answer == "500":
                raise kube.ApiError(500, "InternalError", "etcd timed out")
            if answer == "409" and method == "PUT":
                raise kube.ApiError(409, "Conflict", "the object has been modified")
            return await real(method, path, **kwargs)

        store.request = broken  # type: ignore[method-assign]
        with pytest.raises(leader.LostLease) as lost:
            await asyncio.wait_for(a.keep(), 5)
        return allowed, a.may_write(), str(lost.value)

    allowed, refused, lost = asyncio.run(main())
    assert allowed is None
    assert refused and "does not hold Lease ops/lease" in refused
    assert "could not renew Lease ops/lease within 0.35s" in lost


def test_a_write_is_refused_at_the_renew_deadline_even_while_renewal_still_hangs(store: LeaseStore):
    async def main() -> list[str | None]:
        a = elector(store, "a")
        assert await a._try()
        seen = [a.may_write()]
        await asyncio.sleep(a.renew_deadline + 0.01)  # no renewal meanwhile (a hung keep)
        seen.append(a.may_write())
        return seen

    before, after = asyncio.run(main())
    assert before is None and after and "was not renewed within 0.35s" in after


def test_the_api_client_checks_the_guard_before_every_write_and_never_before_a_read():
    client = kube.Kube(SimpleNamespace(host="http://127.0.0.1:1", get_api_key_with_prefix=lambda key: None))
    client.write_guard = lambda: "Lease ops/lease was not renewed within 7s"

    async def main() -> kube.ApiError:
        with pytest.raises(kube.ApiError) as refused:
            await client._once("PATCH", "/apis/x", {}, None, "application/json", 1 << 20)
        with pytest.raises(kube.ApiError) as read:  # a read goes out (and finds no server here)
            await client._once("GET", "/apis/x", None, None, None, 1 << 20)
        await client.close()
        assert read.value.reason != "NotLeading"
        return refused.value

    refused = asyncio.run(main())
    assert refused.reason == "NotLeading" and "not renewed within 7s" in refused.message and not refused.transient
