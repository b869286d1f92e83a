"""A model's weights, the same in every layout: drawn from the seed by parameter name, or read from a Hugging Face
directory (spec.model.init). Each rank writes only its part of each full tensor (parallel/tensors.copy_into)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..parallel.tensors import copy_into, full_shape_of
from .hf import load_hf_into

INIT_STD = 0.02  # GPT-2's and Llama's initializer range


def initialize(model: nn.Module, seed: int, pretrained: str | None) -> None:
    """This rank's part of the weights: from the Hugging Face directory `pretrained` (spec.model.init), else drawn
    by init_weights."""
    if pretrained:
        load_hf_into(model, pretrained)
    else:
        init_weights(model, seed)


def norm_weights(model: nn.Module) -> set[str]:
    """Names of the normalisation gains (LayerNorm, RMSNorm): initialised to one."""
    return {f"{name}.weight" for name, module in model.named_modules()
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm))}


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministic init from `seed` alone, by parameter name: every layout starts from the same weights.

    Each full tensor is drawn from a generator seeded by (seed, name) and then the local shard (or stage) copies its
    part, so a tensor-parallel shard equals the slice of the single-process tensor.
    """
    layers, norms = model.cfg.layers, norm_weights(model)
    for name, param in model.named_parameters():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(name))
        full_shape = full_shape_of(param)
        if name.endswith("bias"):
            full = torch.zeros(full_shape)
        elif name in norms:
            full = torch.ones(full_shape)
        else:
            std = INIT_STD
            if name.endswith(model.residual_projections):
                std = INIT_STD / math.sqrt(2 * layers)  # GPT-2's scaled init of residual projections
            full = torch.randn(full_shape, generator=gen) * std
        copy_into(param, full)


def _stable_hash(name: str) -> int:
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % 2_147_483_647
    return h
