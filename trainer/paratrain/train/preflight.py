"""The gang's liveness, around the process group: every rank checks in at the rendezvous store, then each link
the job uses carries one all-reduce and a barrier (the backend's, and on GPUs the gloo link that checkpoints use),
each within PREFLIGHT_SECONDS (or the job's shorter collectiveTimeoutSeconds); every process group created after
that waits the job's collectiveTimeoutSeconds; and after a collective times out, a roll call names the ranks that
no longer answer.

A rank that never arrives (its pod did not start, or cannot reach rank 0's address) or a fabric that cannot carry
an all-reduce (a wrong NCCL_SOCKET_IFNAME or GLOO_SOCKET_IFNAME, an InfiniBand port down) then fails the job within
that bound, the ranks and hosts named, as an infrastructure failure the operator retries, rather than as a hang
until the collective timeout, or as a first step that never ends. NCCL opens its communicators lazily, at the
first collective: this is that collective, under its own short timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time

import torch
import torch.distributed as dist

log = logging.getLogger("paratrain.preflight")
PREFLIGHT_SECONDS = 120.0


class FabricError(RuntimeError):
    """The gang cannot communicate: an infrastructure failure, which a gang restart (elsewhere) may not have."""


def _key(rank: int) -> str:
    return f"paratrain/preflight/{rank}"


def _joins_key(rank: int) -> str:
    return f"paratrain/joins/{rank}"


def join(rank: int, world: int, timeout: float, rejoin_timeout: float | None = None
         ) -> tuple[dist.Store, list[str], int]:
    """This rank's rendezvous store (torchrun's env:// contract), once every rank has checked in; each rank's host;
    and the round: 0 in a gang's first, n after n in-place restarts (`paratrain node`). Raises FabricError naming
    the ranks that did not arrive within `timeout` seconds (`rejoin_timeout` in a later round, where a replaced
    pod may still be starting).

    The rounds share node 0's agent store, which keeps every round's keys (this check-in, the process groups'):
    each round keeps to its own, keyed by how many times this rank has joined the store. That count agrees
    across ranks where the agents' restart counts (TORCHELASTIC_RESTART_COUNT) do not: a pod replaced alone
    starts a fresh agent at 0 while its peers' agents have counted on, but its rank's count lives in the store."""
    host = socket.gethostname()
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=datetime.timedelta(seconds=timeout)))
        round_ = store.add(_joins_key(rank), 1) - 1
    except (RuntimeError, ValueError) as exc:
        raise FabricError(f"rank {rank} on {host} cannot reach the rendezvous store at {where}: {exc}") from None
    wait = rejoin_timeout if round_ and rejoin_timeout else timeout
    store = dist.PrefixStore(f"paratrain/round-{round_}", store)
    store.set(_key(rank), host)
    try:
        store.wait([_key(r) for r in range(world)], datetime.timedelta(seconds=wait))
    except RuntimeError:  # DistStoreError: the wait timed out
        missing = [r for r in range(world) if not store.check([_key(r)])]
        raise FabricError(f"rank {rank} on {host}: rank(s) {_ranges(missing)} of {world} did not reach the "
                          f"rendezvous at {where} within {wait:g} s (their pods did not start, or cannot reach "
                          "rank 0's)") from None
    return store, [store.get(_key(r)).decode() for r in range(world)], round_


# What to check where a link fails: the variable that picks its interface.
_LINK_HINTS = {"nccl": "NCCL_SOCKET_IFNAME, or the InfiniBand/RoCE ports", "gloo": "GLOO_SOCKET_IFNAME"}


def fabric_links(backend: str, device: torch.device) -> list[tuple[str, torch.device]]:
    """Each (backend, device) the job's collectives use: the job's backend, and gloo on the host where that is
    another link (checkpoints' group is gloo: DCP's plans are Python objects)."""
    return [(backend, device)] + ([("gloo", torch.device("cpu"))] if backend != "gloo" else [])


def prove_fabric(device: torch.device, hosts: list[str], timeout: float) -> None:
    """On each of the job's links, one all-reduce and a barrier over every rank within `timeout` seconds; their sum
    must be exact. Raises FabricError."""
    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.monotonic()
    links = fabric_links(dist.get_backend(), device)
    for backend, on in links:
        group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout))
        probe = torch.ones(1, device=on)
        try:
            dist.all_reduce(probe, group=group)
            dist.barrier(group=group)
        except Exception as exc:  # noqa: BLE001 (any failure here is the fabric's)
            raise FabricError(f"rank {rank} on {hosts[rank]}: the {backend} all-reduce over {world} ranks on "
                              f"{len(set(hosts))} host(s) did not complete within {timeout:g} s (check "
                              f"{_LINK_HINTS.get(backend, 'the network')}): {exc}") from None
        if probe.item() != world:
            raise FabricError(f"rank {rank} on {hosts[rank]}: the {backend} all-reduce summed to "
                              f"{probe.item():g}, not {world}: the fabric corrupts data")
        dist.destroy_process_group(group)
    if rank == 0:
        log.info("preflight: %d ranks on %d host(s) (%s) joined and all-reduced over %s in %.1f s", world,
                 len(set(hosts)), ", ".join(sorted(set(hosts))), " and ".join(b for b, _ in links),
                 time.monotonic() - started)


def wait_everywhere(timeout: datetime.timedelta) -> None:
    """Every process group created from now on waits `timeout` for a collective: the mesh's dp/tp/pp subgroups,
    the checkpoints' gloo group, and the groups DeepSpeed and FSDP make for themselves, none of which take a
    timeout from the world group (each would otherwise wait c10d's defaults: 10 minutes on NCCL, 30 on gloo).
    c10d reads these two module defaults whenever a group is created without a timeout of its own."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


ROLL_CALL_SECONDS = 30.0


def roll_call(store: dist.Store, rank: int, world: int, wait: float) -> list[int]:
    """After a collective timed out: this rank answers, then waits up to `wait` seconds for the others (each
    rank blocked behind the hung one times out in turn and answers too). Returns the ranks that did not answer:
    hung, or still blocked. The store is rank 0's; where it is gone too, no rank is named."""
    deadline = time.monotonic() + wait
    answer_roll_call(store, rank)
    try:
        while True:
            silent = [r for r in range(world) if not store.check([_roll_call_key(r)])]
            if not silent or time.monotonic() >= deadline:
                return silent
            time.sleep(0.2)
    except (RuntimeError, ValueError):  # the store's host is gone
        return []


def answer_roll_call(store: dist.Store, rank: int) -> None:
    """A rank ended by another's failure, not hung: answers the roll call without waiting for it."""
    try:
        store.set_timeout(datetime.timedelta(seconds=5))  # a store whose host is stopped answers nothing
        store.set(_roll_call_key(rank), "here")
    except (RuntimeError, ValueError):  # the store's host is gone
        pass


def describe_silent(silent: list[int], wait: float) -> str:
    if not silent:
        return "every rank answered the roll call (none is hung: a link is slow or lost)"
    return (f"rank(s) {_ranges(silent)} did not answer the roll call within {wait:g} s: hung, or blocked waiting "
            "on a hung rank")


def _roll_call_key(rank: int) -> str:
    return f"paratrain/roll-call/{rank}"


def _ranges(ranks: list[int]) -> str:
    """[1, 2, 3, 7] → "1-3, 7"."""
    out: list[str] = []
    for r in ranks:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)
