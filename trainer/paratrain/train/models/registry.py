"""The model families behind one entry point: spec → config → model.

Everything family-specific is declared by the model class itself and read from there by the parallel modes:
`tp_plan` (parallel/tensor_parallel.py), `embeddings` / `final` (parallel/pipeline.py, perf.py),
`residual_projections` (weights.py).
"""

from __future__ import annotations

from torch import nn

from ...api import Spec
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig

ModelConfig = GPTConfig | LlamaConfig
MODELS: dict[type, type[nn.Module]] = {GPTConfig: GPT, LlamaConfig: Llama}


def model_config(spec: Spec, vocab_size: int) -> ModelConfig:
    """The model of `spec` over a vocabulary of `vocab_size` (which comes from the data)."""
    m = spec.model
    common = dict(vocab_size=vocab_size, block_size=m.block_size, layers=m.layers, heads=m.heads,
                  embed_dim=m.embed_dim, ffn_dim=m.ffn_dim, norm_eps=m.norm_eps, dropout=m.dropout)
    if m.family == "llama":
        return LlamaConfig(**common, kv_heads=m.kv_heads, rope_theta=m.rope_theta)
    return GPTConfig(**common, bias=m.bias)


def build_model(cfg: ModelConfig) -> nn.Module:
    """The whole model of `cfg`, on the current default device (build under `torch.device("meta")` to split and
    shard it before any memory is allocated)."""
    return MODELS[type(cfg)](cfg)
