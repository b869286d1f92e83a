"""Composition of the parallel modes, in one place and one documented order (after torchtitan).

`parallelize` applies, to this rank's stage (already split by `pipeline.split_stage`), tensor parallel →
activation checkpointing → torch.compile per block (opt-in) → ZeRO-2/3 sharding (FSDP2) on the meta device, then
allocates the weights and wraps the data-parallel reduction: DDP, or the overlapped reducer of composed layouts.
The run's builder (train/build.py) then writes every weight by parameter name.
"""

from __future__ import annotations

import torch
from torch import nn

from .activation_checkpoint import apply_ac
from .compile import apply_compile
from .data_parallel import OverlappedGradReducer, apply_ddp
from .dims import ParallelDims
from .precision import DTYPES
from .tensor_parallel import RNGStream, apply_tp
from .fsdp import apply_fsdp


def parallelize(model: nn.Module, dims: ParallelDims, device: torch.device, heads_rng: RNGStream | None,
                activation_checkpointing: str, precision: str, reduce_precision: str = "fp32",
                compile_blocks: bool = False) -> tuple[nn.Module, OverlappedGradReducer | None]:
    """Apply this layout's modes to `model` (a stage, on the meta device) in place, in the order they must nest;
    return what forward runs (DDP's wrapper, or the model) and the composed layouts' reducer, if any.

    `reduce_precision` (spec.reducePrecision): the dtype gradients are summed in over dp, by whichever mode reduces.
    The weights are allocated but not yet written: DDP needs real tensors to bucket (and broadcasts rank 0's at
    construction, which `initialize` then overwrites with the same values on every rank)."""
    if dims.tp_enabled:
        apply_tp(model, dims.get_mesh("tp"), heads_rng)
    apply_ac(model, activation_checkpointing)
    if compile_blocks:
        apply_compile(model)
    if dims.fsdp_enabled:
        apply_fsdp(model, dims.get_mesh("dp"), dims.zero_stage, precision, reduce_precision)
    model.to_empty(device=device)
    reduce_dtype = None if reduce_precision == "fp32" else DTYPES[reduce_precision]
    if dims.ddp_enabled:
        return apply_ddp(model, dims.get_mesh("dp"), reduce_dtype), None
    if dims.composed_dp:
        return model, OverlappedGradReducer([p for p in model.parameters() if p.requires_grad], dims.get_mesh("dp"),
                                            shard=dims.zero1_enabled, reduce_dtype=reduce_dtype)
    return model, None
