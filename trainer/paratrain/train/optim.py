"""The optimizer, built apart from the model's parallelisation: AdamW over nanoGPT's decay split, its state
partitioned over dp by ZeroOneOptimizer under composed ZeRO-1 (dims.zero1_enabled)."""

from __future__ import annotations

import torch
from torch import nn

from ..api.spec import TrainingSpec
from .data_parallel import OverlappedGradReducer
from .dims import ParallelDims
from .models import full_shape_of
from .zero import ZeroOneOptimizer


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings, not biases or norm gains (nanoGPT's split), by each parameter's full shape
    (a DeepSpeed ZeRO-3 partition's own tensor is flat)."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = {id(p): len(full_shape_of(p)) >= 2 for p in params}
    return [{"params": [p for p in params if matrix[id(p)]], "weight_decay": weight_decay},
            {"params": [p for p in params if not matrix[id(p)]], "weight_decay": 0.0}]


def _foreach(dims: ParallelDims) -> bool | None:
    """torch's foreach kernels batch a step over many tensors, but refuse lists that mix DTensors and plain tensors
    (TP shards next to replicated norms, unless FSDP2 makes every parameter a DTensor). DeepSpeed's optimizer steps
    one flat partition per group: torch's default choice there."""
    if dims.uses_deepspeed:
        return None
    return not (dims.tp_enabled and not dims.fsdp_enabled)


def build_optimizer(model: nn.Module, dims: ParallelDims, training: TrainingSpec,
                    dp_reducer: OverlappedGradReducer | None = None):
    """AdamW over `model`'s parameters (this rank's stage and shards), or ZeroOneOptimizer around it, which steps
    the gradient shards `dp_reducer` (built with shard=True) reduce-scatters; after the weights are initialised,
    since it steps views into them."""
    def adamw(groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, lr=training.learning_rate, betas=(training.beta1, training.beta2),
                                 foreach=_foreach(dims))

    groups = param_groups(model, training.weight_decay)
    if dims.zero1_enabled:
        return ZeroOneOptimizer(groups, dp_reducer, adamw)
    return adamw(groups)
