"""The gang's preflight, around the process group's start: every rank checks in at the rendezvous store, then the
backend's fabric carries one all-reduce and a barrier, each within PREFLIGHT_SECONDS (or the job's shorter
collectiveTimeoutSeconds).

A rank that never arrives (its pod did not start, or cannot reach rank 0's address) or a fabric that cannot carry
an all-reduce (a wrong NCCL_SOCKET_IFNAME, an InfiniBand port down) then fails the job within that bound, the ranks
and hosts named, as an infrastructure failure the operator retries, rather than as a hang until the collective
timeout, or as a first step that never ends. NCCL opens its communicators lazily, at the first collective: this is
that collective, under its own short timeout.
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


def join(rank: int, world: int, timeout: float) -> tuple[dist.Store, list[str]]:
    """This rank's rendezvous store (torchrun's env:// contract), once every rank has checked in; and each rank's
    host. Raises FabricError naming the ranks that did not arrive within `timeout` seconds."""
    host = socket.gethostname()
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=datetime.timedelta(seconds=timeout)))
    except (RuntimeError, ValueError) as exc:
        raise FabricError(f"rank {rank} on {host} cannot reach the rendezvous store at {where}: {exc}") from None
    store.set(_key(rank), host)
    try:
        store.wait([_key(r) for r in range(world)], datetime.timedelta(seconds=timeout))
    except RuntimeError:  # DistStoreError: the wait timed out
        missing = [r for r in range(world) if not store.check([_key(r)])]
        raise FabricError(f"rank {rank} on {host}: rank(s) {_ranges(missing)} of {world} did not reach the "
                          f"rendezvous at {where} within {timeout:g} s (their pods did not start, or cannot reach "
                          "rank 0's)") from None
    return store, [store.get(_key(r)).decode() for r in range(world)]


def prove_fabric(device: torch.device, hosts: list[str], timeout: float) -> None:
    """One all-reduce and a barrier over every rank, on the job's backend, within `timeout` seconds; their sum must
    be exact. Raises FabricError."""
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    started = time.monotonic()
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout))
    probe = torch.ones(1, device=device)
    try:
        dist.all_reduce(probe, group=group)
        dist.barrier(group=group)
    except Exception as exc:  # noqa: BLE001 (any failure here is the fabric's)
        raise FabricError(f"rank {rank} on {hosts[rank]}: the {backend} all-reduce over {world} ranks on "
                          f"{len(set(hosts))} host(s) did not complete within {timeout:g} s: {exc}") from None
    if probe.item() != world:
        raise FabricError(f"rank {rank} on {hosts[rank]}: the {backend} all-reduce summed to {probe.item():g}, "
                          f"not {world}: the fabric corrupts data")
    dist.destroy_process_group(group)
    if rank == 0:
        log.info("preflight: %d ranks on %d host(s) (%s) joined and all-reduced over %s in %.1f s", world,
                 len(set(hosts)), ", ".join(sorted(set(hosts))), backend, time.monotonic() - started)


def _ranges(ranks: list[int]) -> str:
    """[1, 2, 3, 7] → "1-3, 7"."""
    out: list[str] = []
    for r in ranks:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)
