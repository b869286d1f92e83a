"""Leader election on a `coordination.k8s.io/v1` Lease, as client-go's leaderelection does it: of the operator's
replicas exactly one acts; the others stand by and take over when its lease runs out.

- The holder renews the Lease every `retry_seconds`. It gives up `renew_deadline` seconds after its last successful
  renewal was sent, however long a try hangs (each try is cut at the deadline), or at once when it finds another
  holder; `python -m paratrain_operator` then ends the process: an operator that might have lost its lease must stop
  acting before another one starts. Fail-stop: any error in renewal ends the process the same way, and no write
  leaves after the deadline even before it ends (`may_write`, which the API clients check before every write).
- The Lease has an API client of its own (own connections, no rate limiter): a renewal never waits behind the
  operator's pod writes.
- A standby tries every `retry_seconds`. It takes the Lease once it has seen the same record (holder, renewTime)
  unchanged for `leaseDurationSeconds` by its own clock (clocks of different nodes are never compared), or at once
  when the holder released it (a graceful shutdown, e.g. a rolling update).
- Every write is conditional on the Lease's resourceVersion: two standbys racing for it cannot both win.

With the defaults (lease 10 s, renew deadline 7 s, retry 2 s), a standby acts within about 12 s of the holder's
last renewal, and no sooner than 10 s after it; the holder has given up 7 s after it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from .kube import ApiError, Kube, api_path

log = logging.getLogger("paratrain.operator")
LEASES = "coordination.k8s.io/v1"


class LostLease(Exception):
    """The holder could not renew its Lease in time."""


def micro_time() -> str:
    """A Kubernetes MicroTime: RFC 3339 with microseconds."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    def __init__(self, api: Kube, namespace: str, name: str, identity: str | None = None, *,
                 lease_seconds: float = 10, renew_deadline: float = 7, retry_seconds: float = 2):
        assert renew_deadline < lease_seconds, "the holder must give up before a standby may take over"
        self.api, self.namespace, self.name = api, namespace, name
        self.identity = identity or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
        self.lease_seconds, self.renew_deadline, self.retry_seconds = lease_seconds, renew_deadline, retry_seconds
        self._seen: tuple[Any, ...] | None = None  # the last record seen, and when (our clock)
        self._seen_at = 0.0
        self._renewed_at = 0.0  # when the last successful write was sent (our clock)
        self.leading = False

    @property
    def path(self) -> str:
        return api_path(LEASES, "leases", self.namespace, self.name)

    async def acquire(self) -> None:
        """Wait until this replica holds the Lease."""
        logged = False
        while not await self._try():
            if not logged:
                log.info("standing by: Lease %s/%s is held by another replica", self.namespace, self.name)
                logged = True
            await asyncio.sleep(self.retry_seconds)
        log.info("leading: acquired Lease %s/%s as %s", self.namespace, self.name, self.identity)

    async def keep(self) -> None:
        """Renew the Lease until cancelled; raises LostLease when no renewal succeeds within the renew deadline of
        the last one, or another replica holds it."""
        while True:
            await asyncio.sleep(self.retry_seconds)
            while True:
                left = self._renewed_at + self.renew_deadline - time.monotonic()
                try:
                    if left > 0 and await asyncio.wait_for(self._try(), left):
                        break
                except asyncio.TimeoutError:
                    pass
                holder = self._seen[0] if self._seen else ""
                if holder not in ("", self.identity):
                    self._lose(f"Lease {self.namespace}/{self.name} is held by {holder}")
                if time.monotonic() >= self._renewed_at + self.renew_deadline:
                    self._lose(f"could not renew Lease {self.namespace}/{self.name} within "
                               f"{self.renew_deadline:g}s of the last renewal")
                await asyncio.sleep(min(self.retry_seconds, max(0.0, left)))

    def may_write(self) -> str | None:
        """Why this replica may not write now, or None: it leads, and its renew deadline has not passed (a
        standby may take over only after the whole lease; a write after the deadline could race it)."""
        if not self.leading:
            return f"this replica does not hold Lease {self.namespace}/{self.name}"
        if self.write_time_left() <= 0:
            return f"Lease {self.namespace}/{self.name} was not renewed within {self.renew_deadline:g}s"
        return None

    def write_time_left(self) -> float:
        """Seconds until the renew deadline (0 when not leading): a write must be sent within them, so its
        client's timeout is capped at them (one waiting for a connection then never leaves late)."""
        return max(0.0, self._renewed_at + self.renew_deadline - time.monotonic()) if self.leading else 0.0

    def _lose(self, why: str) -> None:
        self.leading = False
        raise LostLease(why)

    async def release(self) -> None:
        """Give the Lease up (a graceful stop): a standby takes over at once instead of after it expires."""
        if not self.leading:
            return
        try:
            lease = await self.api.request("GET", self.path)
            if (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                now = micro_time()
                lease["spec"] = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1,
                                 "acquireTime": now, "renewTime": now}
                await self.api.request("PUT", self.path, body=lease)
            log.info("released Lease %s/%s", self.namespace, self.name)
        except ApiError as exc:
            log.warning("could not release Lease %s/%s (it expires by itself): %s", self.namespace, self.name, exc)
        self.leading = False

    async def _try(self) -> bool:
        """One try to acquire or renew; True when this replica holds the Lease now."""
        now, sent = micro_time(), time.monotonic()
        try:
            lease = await self.api.request("GET", self.path)
            if not isinstance(lease, dict):
                raise ApiError(0, "Malformed", f"GET {self.path} answered without a Lease")
        except ApiError as exc:
            if exc.status != 404:
                log.warning("Lease %s/%s: %s", self.namespace, self.name, exc)
                return False
            return await self._write(sent, "POST", {"apiVersion": LEASES, "kind": "Lease",
                                              "metadata": {"name": self.name, "namespace": self.namespace},
                                              "spec": self._spec(now, now, 0)})
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._seen:
            self._seen, self._seen_at = record, time.monotonic()
        if holder and holder != self.identity and \
                time.monotonic() < self._seen_at + float(spec.get("leaseDurationSeconds") or self.lease_seconds):
            return False
        transitions = int(spec.get("leaseTransitions") or 0)
        acquired = spec.get("acquireTime") if holder == self.identity else now
        lease["spec"] = self._spec(acquired or now, now, transitions if holder == self.identity else transitions + 1)
        return await self._write(sent, "PUT", lease)

    def _spec(self, acquired: str, renewed: str, transitions: int) -> dict[str, Any]:
        return {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_seconds),
                "acquireTime": acquired, "renewTime": renewed, "leaseTransitions": transitions}

    async def _write(self, sent: float, method: str, lease: dict[str, Any]) -> bool:
        """Write the Lease; `sent` is when this try began, the earliest the server can have seen it renewed."""
        path = api_path(LEASES, "leases", self.namespace, None if method == "POST" else self.name)
        try:
            written = await self.api.request(method, path, body=lease)
            if not isinstance(written, dict):
                raise ApiError(0, "Malformed", f"{method} {path} answered without a Lease")
        except ApiError as exc:
            if exc.status not in (409, 422):  # 409: another replica wrote first (it holds the Lease now)
                log.warning("Lease %s/%s: %s", self.namespace, self.name, exc)
            return False
        spec = written.get("spec") or {}
        self._seen = (spec.get("holderIdentity") or "", spec.get("renewTime"), spec.get("leaseTransitions"))
        self._seen_at = time.monotonic()
        self._renewed_at = sent
        self.leading = True
        return True


elector: Elector | None = None  # set by `python -m paratrain_operator --leader-elect`
