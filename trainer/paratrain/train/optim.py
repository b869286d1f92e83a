"""The optimizer, built apart from the model's parallelisation: AdamW over nanoGPT's decay split, its state
partitioned over dp by ZeroOneOptimizer under composed ZeRO-1 (dims.zero1_enabled)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..api.spec import TrainingSpec
from .parallel.data_parallel import OverlappedGradReducer
from .parallel.dims import ParallelDims
from .parallel.tensors import full_shape_of
from .parallel.zero1 import ZeroOneOptimizer


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings, not biases or norm gains (nanoGPT's split), by each parameter's full shape
    (a DeepSpeed ZeRO-3 partition's own tensor is flat). Each split further by kind, DTensors (tensor-parallel
    shards) apart from plain tensors (the replicated norms beside them): torch's fused and foreach kernels take a
    group's tensors as one list and refuse a list that mixes the two."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = []
    for decay, is_matrix in ((weight_decay, True), (0.0, False)):
        chosen = [p for p in params if (len(full_shape_of(p)) >= 2) == is_matrix]
        for kind in (True, False):
            same_kind = [p for p in chosen if isinstance(p, DTensor) == kind]
            if same_kind:
                groups.append({"params": same_kind, "weight_decay": decay})
    return groups


def _implementation(dims: ParallelDims) -> dict[str, bool | None]:
    """torch's fused AdamW (one kernel per parameter, on CPU and CUDA alike; DTensor shards included): a quarter
    of foreach's time on a CPU at nanoGPT's shape (0.5 against 2.2 ms a step, bench/nanogpt.py), and torchtitan's
    default on GPUs. DeepSpeed's optimizer steps one flat partition per group: torch's default choice there."""
    return {} if dims.uses_deepspeed else {"fused": True}


def build_optimizer(model: nn.Module, dims: ParallelDims, training: TrainingSpec,
                    dp_reducer: OverlappedGradReducer | None = None):
    """AdamW over `model`'s parameters (this rank's stage and shards), or ZeroOneOptimizer around it, which steps
    the gradient shards `dp_reducer` (built with shard=True) reduce-scatters; after the weights are initialised,
    since it steps views into them."""
    def adamw(groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, lr=training.learning_rate, betas=(training.beta1, training.beta2),
                                 **_implementation(dims))

    groups = param_groups(model, training.weight_decay)
    if dims.zero1_enabled:
        return ZeroOneOptimizer(groups, dp_reducer, adamw)
    return adamw(groups)
