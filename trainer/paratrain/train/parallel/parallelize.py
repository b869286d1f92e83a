"""Composition of the parallel modes, in one place and one documented order (after torchtitan):

    build_model on the meta device → split_stage (pipeline) → parallelize → initialize → build_optimizer

`parallelize` applies, to this rank's stage, tensor parallel → activation checkpointing → ZeRO-2/3 sharding
(FSDP2) on the meta device, then allocates the weights and wraps the data-parallel reduction: DDP, or the
overlapped reducer of composed layouts. (torch.compile, which would go between activation checkpointing and
sharding, is not implemented.) `initialize` then writes every weight by parameter name.

ZeRO on data-parallel-only layouts goes to DeepSpeed instead (deepspeed_engine.py), as the spec promises;
`ParallelDims.uses_deepspeed` decides, here and only here.
"""

from __future__ import annotations

import torch
from torch import nn

from ...api import Spec
from .. import deepspeed_engine
from .activation_checkpoint import apply_ac
from .data_parallel import OverlappedGradReducer, apply_ddp
from .dims import ParallelDims
from ..engine import TorchEngine
from ..models.registry import ModelConfig, build_model, initialize, model_config
from ..optim import build_optimizer
from .pipeline import build_schedule, split_stage
from .precision import LossScaler
from .tensor_parallel import HEADS_SEED_OFFSET, RNGStream, apply_tp
from .zero import apply_fsdp


def build_engine(spec: Spec, dims: ParallelDims, device: torch.device, vocab_size: int):
    """The engine the loop drives: DeepSpeed's for data-parallel-only ZeRO, TorchEngine for every other layout."""
    cfg = model_config(spec, vocab_size)
    if dims.uses_deepspeed:
        return deepspeed_engine.build_deepspeed_engine(spec, dims, device, cfg)
    return build_torch_engine(spec, dims, device, cfg)


def parallelize(model: nn.Module, dims: ParallelDims, device: torch.device, heads_rng: RNGStream | None,
                activation_checkpointing: str, precision: str) -> tuple[nn.Module, OverlappedGradReducer | None]:
    """Apply this layout's modes to `model` (a stage, on the meta device) in place, in the order they must nest;
    return what forward runs (DDP's wrapper, or the model) and the composed layouts' reducer, if any.

    The weights are allocated but not yet written: DDP needs real tensors to bucket (and broadcasts rank 0's at
    construction, which `initialize` then overwrites with the same values on every rank)."""
    if dims.tp_enabled:
        apply_tp(model, dims.get_mesh("tp"), heads_rng)
    apply_ac(model, activation_checkpointing)
    if dims.fsdp_enabled:
        apply_fsdp(model, dims.get_mesh("dp"), dims.zero_stage, precision)
    model.to_empty(device=device)
    if dims.ddp_enabled:
        return apply_ddp(model, dims.get_mesh("dp")), None
    if dims.composed_dp:
        return model, OverlappedGradReducer([p for p in model.parameters() if p.requires_grad], dims.get_mesh("dp"),
                                            shard=dims.zero1_enabled)
    return model, None


def build_torch_engine(spec: Spec, dims: ParallelDims, device: torch.device, cfg: ModelConfig) -> TorchEngine:
    t, p = spec.training, spec.parallelism
    with torch.device("meta"):
        model = build_model(cfg)
    if dims.pp_enabled:
        split_stage(model, dims.pp_rank, dims.pp)
    heads_rng = None
    if dims.tp_enabled:
        heads_rng = RNGStream(dims.dropout_seed(t.seed) + HEADS_SEED_OFFSET + dims.coordinate("tp"), device)
    wrapped, dp_reducer = parallelize(model, dims, device, heads_rng, t.activation_checkpointing, spec.precision)
    initialize(model, t.seed, spec.model.init)
    engine = TorchEngine(
        model=wrapped, module=model, optimizer=build_optimizer(model, dims, t, dp_reducer), dims=dims,
        precision=spec.precision, grad_clip=t.grad_clip, dp_reducer=dp_reducer, accumulation=t.gradient_accumulation,
        microbatches=p.microbatches, scaler=LossScaler(enabled=spec.precision == "fp16"), heads_rng=heads_rng,
    )
    if dims.pp_enabled:
        engine.schedule = build_schedule(model, dims.get_mesh("pp"), device, p.microbatches, p.pipeline_schedule,
                                         engine.scaled_loss_fn())
    return engine
