"""Composition of the parallel modes, in one place and one documented order (after torchtitan):

    model on the meta device → pipeline split → tensor parallel → activation checkpointing → ZeRO-2/3 sharding (FSDP2)
      → materialise and initialise → data parallel (DDP, or one all-reduce per step) → optimizer (ZeRO-1 or plain)

Data-parallel-only ZeRO layouts go to DeepSpeed instead (deepspeed_engine.py), as the spec promises.
"""

from __future__ import annotations

import torch

from ..api import Spec
from .activation_checkpoint import apply_ac
from .data_parallel import OverlappedGradReducer, apply_ddp
from .dims import ParallelDims
from .engine import TorchEngine
from .models import build_model, initialize, model_config
from .pipeline import build_schedule, split_stage
from .precision import LossScaler
from .tensor_parallel import HEADS_SEED_OFFSET, RNGStream, apply_tp
from .zero import ZeroOneOptimizer, apply_fsdp


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings, not biases or norm gains (nanoGPT's split)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def uses_deepspeed(spec: Spec) -> bool:
    p = spec.parallelism
    return p.zero_stage > 0 and p.tensor == 1 and p.pipeline == 1


def build_engine(spec: Spec, dims: ParallelDims, device: torch.device, vocab_size: int):
    if uses_deepspeed(spec):
        from .deepspeed_engine import build_deepspeed_engine

        return build_deepspeed_engine(spec, dims, device, model_config(spec, vocab_size))
    return build_torch_engine(spec, dims, device, vocab_size)


def build_torch_engine(spec: Spec, dims: ParallelDims, device: torch.device, vocab_size: int) -> TorchEngine:
    zero_stage, t = spec.parallelism.zero_stage, spec.training
    with torch.device("meta"):
        model = build_model(model_config(spec, vocab_size))
    if dims.pp_enabled:
        split_stage(model, dims.pp_rank, dims.pp)
    heads_rng = None
    if dims.tp_enabled:
        heads_rng = RNGStream(dims.dropout_seed(t.seed) + HEADS_SEED_OFFSET + dims.coordinate("tp"), device)
        apply_tp(model, dims.get_mesh("tp"), heads_rng)
    apply_ac(model, t.activation_checkpointing)
    if zero_stage >= 2:
        apply_fsdp(model, dims.get_mesh("dp"), zero_stage, spec.precision)
    model.to_empty(device=device)
    initialize(model, t.seed, spec.model.init)

    composed = dims.tp_enabled or dims.pp_enabled
    wrapped, dp_reducer = model, None
    if dims.dp_enabled and zero_stage < 2:
        if composed:  # DDP cannot wrap DTensor shards or a pipeline stage
            dp_reducer = OverlappedGradReducer([p for p in model.parameters() if p.requires_grad],
                                               dims.get_mesh("dp"), shard=zero_stage == 1)
        else:
            wrapped = apply_ddp(model, dims.get_mesh("dp"))

    # foreach kernels refuse lists that mix DTensor and plain tensors (TP shards next to replicated norms).
    mixed = dims.tp_enabled and zero_stage < 2

    def make_optimizer(groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, lr=t.learning_rate, betas=(t.beta1, t.beta2), foreach=not mixed)

    groups = param_groups(model, t.weight_decay)
    if zero_stage == 1:
        optimizer = ZeroOneOptimizer(groups, dp_reducer, make_optimizer)
    else:
        optimizer = make_optimizer(groups)

    engine = TorchEngine(
        model=wrapped, module=model, optimizer=optimizer, dims=dims, precision=spec.precision,
        grad_clip=t.grad_clip, dp_reducer=dp_reducer,
        accumulation=t.gradient_accumulation, microbatches=spec.parallelism.microbatches,
        scaler=LossScaler(enabled=spec.precision == "fp16"), heads_rng=heads_rng,
    )
    if dims.pp_enabled:
        p = spec.parallelism
        engine.schedule = build_schedule(model, dims.get_mesh("pp"), device, p.microbatches, p.pipeline_schedule,
                                         engine.scaled_loss_fn())
    return engine
