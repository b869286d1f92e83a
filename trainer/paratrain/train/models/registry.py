"""The model families behind one entry point: spec → config → model, and the deterministic init.

Everything family-specific is declared by the model class itself and read from there by the parallel modes:
`tp_plan` (tensor_parallel.py), `embeddings` / `final` (pipeline.py, perf.py), `residual_projections` (below).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...api import Spec
from .llama import Llama, LlamaConfig
from .gpt import GPT, GPTConfig

ModelConfig = GPTConfig | LlamaConfig
MODELS: dict[type, type[nn.Module]] = {GPTConfig: GPT, LlamaConfig: Llama}
INIT_STD = 0.02  # GPT-2's and Llama's initializer range


def model_config(spec: Spec, vocab_size: int) -> ModelConfig:
    """The model of `spec` over a vocabulary of `vocab_size` (which comes from the data)."""
    m = spec.model
    common = dict(vocab_size=vocab_size, block_size=m.block_size, layers=m.layers, heads=m.heads,
                  embed_dim=m.embed_dim, ffn_dim=m.ffn_dim, norm_eps=m.norm_eps, dropout=m.dropout)
    if m.family == "llama":
        return LlamaConfig(**common, kv_heads=m.kv_heads, rope_theta=m.rope_theta)
    return GPTConfig(**common)


def build_model(cfg: ModelConfig) -> nn.Module:
    """The whole model of `cfg`, on the current default device (build under `torch.device("meta")` to split and
    shard it before any memory is allocated)."""
    return MODELS[type(cfg)](cfg)


def initialize(model: nn.Module, seed: int, pretrained: str | None) -> None:
    """This rank's part of the weights: from the Hugging Face directory `pretrained` (spec.model.init), else drawn
    by init_weights."""
    if pretrained:
        from .hf import load_hf_into

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


def full_shape_of(param: torch.Tensor) -> torch.Size:
    """The unsharded shape of a parameter: plain, a DTensor (tensor parallel, FSDP2), or a DeepSpeed ZeRO-3
    partition (whose own tensor is empty)."""
    from torch.distributed.tensor import DTensor

    if hasattr(param, "ds_shape"):
        return param.ds_shape
    return param.shape if not isinstance(param, DTensor) else param.size()


def copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full tensor `full` into `param`: a plain tensor, a DTensor shard, or a DeepSpeed
    ZeRO-3 partition (collective: gathered alone, written — the same on every rank — and re-partitioned from rank 0's
    copy, so a rank holds one whole parameter at a time)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.data.copy_(full)
    elif isinstance(param, DTensor):
        shard = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))
