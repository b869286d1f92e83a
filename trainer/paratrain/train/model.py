"""A GPT-style decoder-only transformer, small enough to read in one sitting (after nanoGPT).

Written so each parallel mode can be applied from outside:
- q, k, v and the output projection are separate Linears, so tensor parallel shards them column-then-row;
  attention reads the number of *local* heads from the activation shape, so it works on a shard unchanged;
- blocks live in a ModuleDict keyed "0".."L-1", and embeddings / final norm / head may be None, so a pipeline
  stage is the same class with the other stages' parts deleted (parameter names stay globally unique);
- no weight tying: the embedding and the head can sit on different pipeline stages.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int
    layers: int
    heads: int
    embed_dim: int
    dropout: float = 0.0


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.embed_dim // cfg.heads
        self.wq = nn.Linear(cfg.embed_dim, cfg.embed_dim, bias=False)
        self.wk = nn.Linear(cfg.embed_dim, cfg.embed_dim, bias=False)
        self.wv = nn.Linear(cfg.embed_dim, cfg.embed_dim, bias=False)
        self.wo = nn.Linear(cfg.embed_dim, cfg.embed_dim, bias=False)
        self.dropout = cfg.dropout
        self.heads_rng = None  # tensor parallel's RNGStream for the heads this rank holds; None: the default stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallel each rank holds heads / tp of them.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = self._attend(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, local C)
        return F.dropout(self.wo(y), self.dropout, self.training)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        with self.heads_rng.fork() if dropout and self.heads_rng else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.embed_dim, 4 * cfg.embed_dim)
        self.proj = nn.Linear(4 * cfg.embed_dim, cfg.embed_dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.embed_dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.embed_dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.embed_dim)
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.block_size, cfg.embed_dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.embed_dim)
        self.head: nn.Linear | None = nn.Linear(cfg.embed_dim, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 → logits (B, T, V); on a middle pipeline stage, hidden (B, T, C) → (B, T, C)."""
        h = x
        if self.tok_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            h = self.tok_emb(x) + self.pos_emb(pos)  # (B, T, C)
        for block in self.layers.values():
            h = block(h)
        if self.ln_f is not None:
            h = self.ln_f(h)
        if self.head is not None:
            h = self.head(h)
        return h


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """Deterministic init from `seed` alone, by parameter name: every layout starts from the same weights.

    Each full tensor is drawn from a generator seeded by (seed, name) and then the local shard (or stage) copies its
    part, so a tensor-parallel shard equals the slice of the single-process tensor.
    """
    layers = model.cfg.layers
    for name, param in model.named_parameters():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(name))
        full_shape = _full_shape(param)
        if name.endswith("bias"):
            full = torch.zeros(full_shape)
        elif ".ln" in name or name.startswith("ln_f"):
            full = torch.ones(full_shape)
        else:
            std = 0.02
            if name.endswith(("attn.wo.weight", "mlp.proj.weight")):
                std = 0.02 / math.sqrt(2 * layers)  # GPT-2's scaled init of residual projections
            full = torch.randn(full_shape, generator=gen) * std
        _copy_into(param, full)


def _stable_hash(name: str) -> int:
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % 2_147_483_647
    return h


def _full_shape(param: torch.Tensor) -> torch.Size:
    from torch.distributed.tensor import DTensor

    return param.shape if not isinstance(param, DTensor) else param.size()


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        shard = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))
