"""Tensors held in parts across ranks: plain tensors, DTensor shards (tensor parallel, FSDP2) and DeepSpeed ZeRO-3
partitions, seen through one set of helpers; and how the ranks split a save or a load of such tensors."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank actually holds."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = local(t)
    return t.numel() * t.element_size()


def full_shape_of(param: torch.Tensor) -> torch.Size:
    """The unsharded shape of a parameter: plain, a DTensor (tensor parallel, FSDP2), or a DeepSpeed ZeRO-3
    partition (whose own tensor is empty)."""
    if hasattr(param, "ds_shape"):
        return param.ds_shape
    return param.shape if not isinstance(param, DTensor) else param.size()


def copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full tensor `full` into `param`: a plain tensor, a DTensor shard, or a DeepSpeed
    ZeRO-3 partition (collective: gathered alone, written — the same on every rank — and re-partitioned from rank 0's
    copy, so a rank holds one whole parameter at a time)."""
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.data.copy_(full)
    elif isinstance(param, DTensor):
        shard = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))


def save_owners(sizes: list[int], ranks: int) -> list[int]:
    """Which of `ranks` ranks keeps each of the tensors of `sizes` elements that they gather together for a save:
    the least loaded so far, in order, the same answer on every rank. Each rank then holds about 1/ranks of the
    gathered state in host memory while DCP writes it, and DCP writes every tensor once, from its keeper."""
    held = [0] * ranks
    owners = []
    for size in sizes:
        owner = min(range(ranks), key=held.__getitem__)
        owners.append(owner)
        held[owner] += size
    return owners


def in_batches(sizes: list[int], budget: int) -> list[range]:
    """Consecutive index ranges of `sizes` each summing to at most `budget` (or holding one larger item): a load in
    parts, each a collective every rank makes for the same items."""
    ranges, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > budget:
            ranges.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        ranges.append(range(start, len(sizes)))
    return ranges


def norm_of_square(value: float) -> float:
    """The norm of a summed square the host has read (the step's skip and clip are decided on the host); inf where
    not finite."""
    return math.sqrt(value) if math.isfinite(value) else math.inf
