"""Data parallel: model replicas over the mesh's "dp" dimension, gradients averaged."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from .tensors import local


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """DDP for layouts without tensor or pipeline parallel: bucketed all-reduce overlapped with backward."""
    device_ids = [torch.cuda.current_device()] if dp_mesh.device_type == "cuda" else None
    return DDP(model, process_group=dp_mesh.get_group(), device_ids=device_ids)


@torch.no_grad()
def allreduce_gradients(params: list[nn.Parameter], dp_mesh: DeviceMesh) -> None:
    """Average gradients over dp ranks once per step, for composed layouts (DTensor shards, pipeline stages)
    that DDP cannot wrap. Called after all microbatches' backward, so it runs once, not once per microbatch."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one collective instead of one per tensor
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_mesh.get_group())
    flat /= dp_mesh.size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()
