"""Helpers for code that sees both plain tensors and DTensor shards."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank actually holds."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = local(t)
    return t.numel() * t.element_size()
