"""NCCL's failures as Python exceptions.

Under TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (contract.COMMS_ENV) NCCL's watchdog aborts a rank's communicators when a
collective fails or times out, and the process lives on: the aborted kernels end, so whatever waited on them
returns, with whatever the buffers held. The next collective of that group raises; until then the rank could
update its weights from a half-reduced gradient, and a checkpoint written over gloo's link would keep them. So
each step, after its host read (which the aborted kernels no longer hold up), asks every NCCL group whether its
watchdog saw an error, and raises DistBackendError if one did: the rank then exits 75 like any peer failure, and a
timeout gets the roll call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from .. import contract


def comms_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """contract.COMMS_ENV where `env` sets none of its names: pods get them from the operator, local runs here."""
    return {k: v for k, v in contract.COMMS_ENV.items() if k not in env}


def nccl_backends() -> list[tuple[str, object]]:
    """(group name, its NCCL backend) for every process group this rank belongs to that runs on NCCL (a gloo group
    answers for CUDA tensors too: the checkpoints' link on GPU runs)."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from builds without NCCL
    world = dist.distributed_c10d._world
    found = []
    for group in list(world.pg_map):
        try:
            backend = group._get_backend(torch.device("cuda"))
        except RuntimeError:  # a group with no CUDA backend
            continue
        if nccl is not None and isinstance(backend, nccl):
            found.append((world.pg_names.get(group, "?"), backend))
    return found


def errors(backends: Iterable[tuple[str, object]] | None = None) -> list[tuple[str, str]]:
    """(group name, what its watchdog saw: TIMEOUT, COMM_ERROR or REMOTE_ERROR) for each group of `backends`
    (default: this rank's NCCL groups) not in SUCCESS."""
    seen = [(name, backend.get_error().name) for name, backend in (nccl_backends() if backends is None else backends)]
    return [(name, kind) for name, kind in seen if kind != "SUCCESS"]


_WHAT = {"TIMEOUT": "a collective timed out", "COMM_ERROR": "a collective failed (NCCL error)",
         "REMOTE_ERROR": "another rank of the group said through the store that its collective failed"}


def raise_if_aborted(backends: Iterable[tuple[str, object]] | None = None) -> None:
    """Raise DistBackendError when a watchdog aborted one of this rank's NCCL groups: the step's results are not
    to be used (after the step's host read, and before a checkpoint is written)."""
    found = errors(backends)
    if found:
        said = "; ".join(f"group {name}: {_WHAT.get(kind, kind)}" for name, kind in found)
        raise dist.DistBackendError(f"NCCL's watchdog aborted this rank's communicators ({said}); this step's "
                                    "results are not used")


def timed_out(backends: Iterable[tuple[str, object]] | None = None) -> bool:
    """Whether one of this rank's NCCL groups timed out (the exception Python got may only say 'aborted')."""
    return any(kind == "TIMEOUT" for _, kind in errors(backends))
